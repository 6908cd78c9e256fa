"""Where programs run: a Backend. `RemoteBackend` talks to a k3rt gateway over ZMQ (DEALER -> ROUTER),
typed messages (k3rt.protocol), orjson. One I/O thread owns the socket; callers block on futures.
No torch.

The API key (`k3rt serve --api-key`) is proven in ZMQ's CURVE handshake, before the server accepts a
frame: the client's CURVE key pair is derived from the key (`client_curve_keys`), and the server accepts
the public keys derived from its keys (backend/program/server.py says why CURVE). The handshake's
outcome comes from a socket monitor: a rejected key (or a key for a server without one, or none for a
server with one) fails every waiting and later program with PermissionError; a connection the server
drops (a message over its size limit, a restart) fails the programs waiting on it with ConnectionError.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from k3rt.protocol import (
    ProgramClose, ProgramEvent, ProgramResult, ProgramRun, ProtocolError, ServerCall, ServerReply, decode, encode,
)

log = logging.getLogger(__name__)

EventCallback = Callable[[int, "str | None", str, bool, "dict | None"], None]

SERVER_CALL_TIMEOUT_S = 60.0  # flush_cache / get_server_info, when the backend has no timeout of its own
API_KEY_ENV = "K3RT_API_KEY"  # connect()'s api_key when none is given
# The server's CURVE key pair is public: it authenticates nothing (the client's key pair does) and only
# makes the session keys; clients need it to connect, so it is derived from a fixed string.
_SERVER_SECRET = hashlib.sha256(b"k3rt-dsl-server-v1").digest()


def server_curve_keys() -> tuple[bytes, bytes]:
    """(public, secret) of the DSL server's CURVE key pair, Z85-encoded."""
    import zmq
    from zmq.utils import z85

    secret = z85.encode(_SERVER_SECRET)
    return zmq.curve_public(secret), secret


def client_curve_keys(api_key: str) -> tuple[bytes, bytes]:
    """(public, secret) CURVE key pair, Z85-encoded, of a client holding `api_key`. scrypt (0.1 s) makes
    guessing a weak key from a public key slow; the key itself never crosses the wire."""
    import zmq
    from zmq.utils import z85

    seed = hashlib.scrypt(api_key.encode(), salt=b"k3rt-dsl-client-v1", n=1 << 14, r=8, p=1, dklen=32)
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def apply_api_key(sock: Any, api_key: str) -> None:
    """Make a ZMQ socket (before connect) a CURVE client of a DSL server that requires `api_key`."""
    import zmq

    if not zmq.has("curve"):
        raise RuntimeError("api_key: this libzmq has no CURVE support")
    public, secret = client_curve_keys(api_key)
    sock.curve_serverkey = server_curve_keys()[0]
    sock.curve_publickey, sock.curve_secretkey = public, secret


@dataclass
class TokenUsage:
    """Tokens of every engine request a backend's programs made (gens, select scoring, prefix commits),
    as sglang's OpenAI backend counts them: `backend.token_usage`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0

    def add(self, usage: dict[str, int]) -> None:
        self.prompt_tokens += int(usage.get("prompt_tokens", 0))
        self.completion_tokens += int(usage.get("completion_tokens", 0))


class Backend(ABC):
    @abstractmethod
    def run(self, pid: str, program: dict[str, Any], *, final: bool, stream: bool,
            on_event: EventCallback | None) -> dict[str, Any]:
        """Execute the program's ops in session `pid`; block until done; return ProgramResult as a dict."""

    @abstractmethod
    def close(self, pid: str) -> None:
        """Drop the session (fire and forget)."""

    def shutdown(self) -> None:
        pass

    @abstractmethod
    def get_server_info(self) -> dict[str, Any]:
        """The server's model and layout (sglang's get_server_info)."""

    @abstractmethod
    def flush_cache(self) -> bool:
        """Drop the server's prefix cache (entries no running request holds)."""

    def get_model_name(self) -> str:
        """The served model's path (sglang's RuntimeEndpoint.get_model_name)."""
        return self.get_server_info()["model_path"]


class RemoteBackend(Backend):
    def __init__(self, addr: str, *, timeout: float | None = None, api_key: str | None = None) -> None:
        """api_key: the server's key (None: a server without one). connect() resolves K3RT_API_KEY."""
        import zmq  # here, not at module level: `import k3rt` stays fast

        self.addr, self.timeout, self.api_key = addr, timeout, api_key or None
        self.failed: Exception | None = None  # set for good: a refused handshake, or the I/O thread's failure
        self.ctx = zmq.Context()
        self.outbox: queue.Queue[bytes | None] = queue.Queue()
        self.pending: dict[str, tuple[Future, EventCallback | None]] = {}
        self.lock = threading.Lock()
        self.round_trips = 0  # ProgramRun messages sent (what a test counts)
        self.token_usage = TokenUsage()
        self.calls: dict[str, Future] = {}  # ServerCall cid -> its reply
        self._wake_addr = f"inproc://k3rt-wake-{id(self)}"
        self._wake_send = self.ctx.socket(zmq.PAIR)
        self._wake_send.bind(self._wake_addr)
        self._stop = False
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._io, name="k3rt-dsl-io", daemon=True)
        self.thread.start()
        self._ready.wait()

    def _io(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        sock = self.ctx.socket(zmq.DEALER)
        if self.api_key is not None:
            apply_api_key(sock, self.api_key)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                          | zmq.EVENT_DISCONNECTED)
        sock.connect(self.addr)
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self._wake_addr)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self._ready.set()
        # messages are sent without blocking: with no peer (a refused handshake) a blocking send never returns
        unsent: collections.deque[bytes] = collections.deque()
        try:
            link = _Link()
            while not self._stop:
                poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if unsent else 0))
                events = dict(poller.poll(1000))
                if wake in events:
                    while wake.poll(0):
                        wake.recv()
                if sock in events:
                    self._receive(sock)
                if monitor in events:
                    while monitor.poll(0):
                        failure = link.on_event(recv_monitor_message(monitor), self.api_key)
                        if failure is None or self.failed is not None:
                            continue
                        if isinstance(failure, PermissionError):
                            with self.lock:  # (run() checks it under the lock before it registers a program)
                                self.failed = failure
                        # what the server sent before it closed is read first: a program's result (its
                        # shutdown error, say) must not be lost to the disconnect that follows it
                        self._receive(sock)
                        self._fail_pending(failure)
                if self.failed is not None:
                    break  # a refused key: stop retrying it every 100 ms (closing the socket)
                while True:
                    try:
                        data = self.outbox.get_nowait()
                    except queue.Empty:
                        break
                    if data is not None:
                        unsent.append(data)
                while unsent:
                    try:
                        sock.send(unsent[0], zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    unsent.popleft()
        except Exception as e:  # a bug: fail the waiting programs rather than leave them hanging
            log.exception("the DSL client's I/O thread failed")
            with self.lock:
                self.failed = ConnectionError(f"the DSL client's I/O thread failed: {e}")
            self._fail_pending(self.failed)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0 if self.failed else 500)
            wake.close(linger=0)

    def _receive(self, sock: Any) -> None:
        """Dispatch every message waiting on the socket."""
        while sock.poll(0):
            data = sock.recv()
            if not data:
                continue  # an empty frame is the server's liveness probe
            try:
                msg = decode(data)
            except ProtocolError as e:  # never let one bad frame end the I/O thread
                log.warning("ignoring a malformed message from the server: %s", e)
                continue
            self._dispatch(msg)

    def _fail_pending(self, error: Exception) -> None:
        with self.lock:
            pending, self.pending = self.pending, {}
            calls, self.calls = self.calls, {}
        for fut in [f for f, _ in pending.values()] + list(calls.values()):
            fut.set_exception(type(error)(*error.args))  # one instance each: tracebacks don't pile up

    def _call(self, method: str) -> dict[str, Any]:
        import uuid

        fut: Future = Future()
        cid = uuid.uuid4().hex
        with self.lock:
            if self.failed is not None:
                raise type(self.failed)(*self.failed.args)
            self.calls[cid] = fut
        self._send(encode(ServerCall(cid, method)))
        try:
            # a server that predates ServerCall drops it without a reply: never wait forever
            reply = fut.result(self.timeout or SERVER_CALL_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"{method}: no reply from the DSL server within "
                               f"{self.timeout or SERVER_CALL_TIMEOUT_S:g} s") from None
        finally:
            with self.lock:
                self.calls.pop(cid, None)
        if reply.error:
            raise RuntimeError(f"{method}: {reply.error}")
        return reply.result

    def get_server_info(self) -> dict[str, Any]:
        """The served model (model_path, max_model_len, vocab_size, cache layout) and the DSL endpoint."""
        return self._call("server_info")

    def flush_cache(self) -> bool:
        """Drop every prefix-cache entry no running request holds (pinned program prefixes included)."""
        return bool(self._call("flush_cache").get("flushed"))

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ProgramEvent):
            with self.lock:
                entry = self.pending.get(msg.pid)
            if entry is not None and entry[1] is not None:
                entry[1](msg.state, msg.name, msg.delta, msg.done, msg.meta)
        elif isinstance(msg, ServerReply):
            with self.lock:
                fut = self.calls.pop(msg.cid, None)
            if fut is not None:
                fut.set_result(msg)
        elif isinstance(msg, ProgramResult):
            with self.lock:
                entry = self.pending.pop(msg.pid, None)
                self.token_usage.add(msg.usage)
            if entry is not None:
                entry[0].set_result({"variables": msg.variables, "texts": msg.texts, "messages": msg.messages,
                                     "meta": msg.meta, "error": msg.error, "error_line": msg.error_line})

    def _send(self, data: bytes) -> None:
        if self.failed is not None:
            return  # the I/O thread is gone
        self.outbox.put(data)
        self._wake()

    def _wake(self) -> None:
        import zmq

        with self.lock:
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the I/O thread has ended (its end of the pair is closed) or has wakes queued
                pass

    def run(self, pid: str, program: dict[str, Any], *, final: bool, stream: bool,
            on_event: EventCallback | None) -> dict[str, Any]:
        fut: Future = Future()
        with self.lock:
            if self.failed is not None:
                raise type(self.failed)(*self.failed.args)
            self.pending[pid] = (fut, on_event)
            self.round_trips += 1
        self._send(encode(ProgramRun(pid, program, final, stream)))
        try:
            return fut.result(self.timeout)
        except BaseException:
            self.close(pid)  # interrupted or timed out: the server cancels the program
            raise

    def close(self, pid: str) -> None:
        with self.lock:
            self.pending.pop(pid, None)
        self._send(encode(ProgramClose(pid)))

    def shutdown(self) -> None:
        if self._stop:
            return
        with self.lock:
            open_pids = list(self.pending)
        for pid in open_pids:  # programs still waiting: cancel them on the server
            self.close(pid)
        self._stop = True
        self._wake()
        self.thread.join(5)
        self._wake_send.close(linger=0)
        self.ctx.term()


class _Link:
    """The DEALER's connection as its socket monitor reports it: which event fails the waiting programs."""

    def __init__(self) -> None:
        self.up = False
        self.unexplained = 0  # handshake failures in a row without a reason (a third is taken as final)

    def on_event(self, event: dict[str, Any], api_key: str | None) -> Exception | None:
        import zmq

        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up, self.unexplained = True, 0
            return None
        if kind == zmq.EVENT_DISCONNECTED:
            was_up, self.up = self.up, False
            if was_up:
                return ConnectionError("the DSL server closed the connection with programs in flight: a message "
                                       "over its size limit (k3rt serve --dsl-max-message-mb), or a restart")
            return None
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.unexplained += 1
            if self.unexplained < 3:
                return None
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return PermissionError("the DSL server rejected the api_key (k3rt.connect(addr, api_key=...) or "
                                   f"{API_KEY_ENV})")
        if api_key is None:
            return PermissionError("the DSL server requires a key: k3rt.connect(addr, api_key=...) or "
                                   f"{API_KEY_ENV}")
        return PermissionError("the handshake with the DSL server failed: it takes no api_key (connect without "
                               f"one; unset {API_KEY_ENV}), or it is not a k3rt DSL endpoint")


class GlobalConfig:
    """sglang's `global_config`: the DSL's one piece of process state, as in sglang.

    default_backend: what run() uses without backend= (set_default_backend sets it).
    verbosity: 2 prints each finished program's text (sglang's meaning).
    The others are sglang's switches with the one value k3rt implements; another is refused when set:
    skip_special_tokens_in_output (True: special tokens never reach program text),
    spaces_between_special_tokens_in_out (True), enable_precache_with_tracing (True: run_batch's shared
    prefix is computed once, by the prefix cache rather than by tracing), enable_parallel_encoding
    (False: join(mode="concate_and_append") appends text; KDA states cannot be spliced like KV caches)."""

    _FIXED = {"skip_special_tokens_in_output": True, "spaces_between_special_tokens_in_out": True,
              "enable_precache_with_tracing": True, "enable_parallel_encoding": False}

    def __init__(self) -> None:
        object.__setattr__(self, "default_backend", None)
        object.__setattr__(self, "verbosity", 0)

    def __getattr__(self, name: str) -> Any:
        if name in GlobalConfig._FIXED:
            return GlobalConfig._FIXED[name]
        raise AttributeError(f"global_config has no setting {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in GlobalConfig._FIXED:
            if value != GlobalConfig._FIXED[name]:
                raise ValueError(f"global_config.{name}: k3rt implements only {GlobalConfig._FIXED[name]!r}")
            return
        if name not in ("default_backend", "verbosity"):
            raise AttributeError(f"global_config has no setting {name!r}")
        object.__setattr__(self, name, value)


global_config = GlobalConfig()


def set_default_backend(backend: Backend | Any | None) -> None:
    global_config.default_backend = backend


def get_default_backend() -> Backend | Any | None:
    return global_config.default_backend


def flush_cache(backend: Backend | Any | None = None) -> bool:
    """Drop the server's prefix cache (entries no running request holds). False without a backend."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return False
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Backend | Any | None = None) -> dict[str, Any] | None:
    """The server's model and layout (None without a backend)."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        return None
    return resolve_backend(backend).get_server_info()


def resolve_backend(backend: Backend | Any | None) -> Backend:
    if backend is None:
        backend = global_config.default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=..., or call k3rt.set_default_backend(k3rt.connect(addr)) "
                           "or use `with k3rt.Runtime(model=...) as rt:`")
    inner = getattr(backend, "backend", None)  # a Runtime wraps a RemoteBackend
    return inner if isinstance(inner, Backend) else backend


def RuntimeEndpoint(base_url: str, api_key: str | None = None, verify: Any = None,  # noqa: N802 (sglang's name)
                    chat_template_name: str | None = None, *, dsl_addr: str | None = None) -> RemoteBackend:
    """sglang.RuntimeEndpoint: the programs of a running `k3rt serve` at base_url (http://host:port). Programs
    travel to its DSL endpoint, by default tcp://host:(port + 1) (`k3rt serve --dsl-addr`'s "auto"); pass
    dsl_addr= when the server was started with another. verify (TLS) and chat_template_name (k3rt takes
    role text from the model's own template) have no k3rt meaning and are refused when set."""
    from urllib.parse import urlsplit

    if verify is not None or chat_template_name is not None:
        raise ValueError("RuntimeEndpoint: verify and chat_template_name are not supported (the DSL port speaks "
                         "ZMQ, not HTTPS; role text comes from the model's chat template)")
    if dsl_addr is None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url: {base_url!r} must be http://host:port")
        dsl_addr = f"tcp://{url.hostname}:{(url.port or (443 if url.scheme == 'https' else 80)) + 1}"
    return connect(dsl_addr, api_key=api_key)


def connect(addr: str, *, timeout: float | None = None, api_key: str | None = None) -> RemoteBackend:
    """A backend for a running k3rt gateway: 'tcp://host:port' or 'ipc:///path'. api_key: the server's
    `--api-key`; None reads the environment variable K3RT_API_KEY (unset or empty: no key). A wrong key,
    or a key for a server without one, raises PermissionError from the first program run."""
    if not addr.startswith(("tcp://", "ipc://")):
        raise ValueError(f"addr: {addr!r} must start with tcp:// or ipc://")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    return RemoteBackend(addr, timeout=timeout, api_key=api_key)
