"""Where programs run: a Backend. `RemoteBackend` talks to a k3rt gateway over ZMQ (DEALER -> ROUTER),
typed messages (k3rt.protocol), orjson. One I/O thread owns the socket; callers block on futures.
No torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from k3rt.protocol import ProgramClose, ProgramEvent, ProgramResult, ProgramRun, ProtocolError, decode, encode

log = logging.getLogger(__name__)

EventCallback = Callable[[int, "str | None", str, bool], None]


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


class RemoteBackend(Backend):
    def __init__(self, addr: str, *, timeout: float | None = None) -> None:
        import zmq  # here, not at module level: `import k3rt` stays fast

        self.addr, self.timeout = addr, timeout
        self.ctx = zmq.Context()
        self.outbox: queue.Queue[bytes | None] = queue.Queue()
        self.pending: dict[str, tuple[Future, EventCallback | None]] = {}
        self.lock = threading.Lock()
        self.round_trips = 0  # ProgramRun messages sent (what a test counts)
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

        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.addr)
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self._wake_addr)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        self._ready.set()
        while not self._stop:
            events = dict(poller.poll(1000))
            if wake in events:
                while wake.poll(0):
                    wake.recv()
            while True:
                try:
                    data = self.outbox.get_nowait()
                except queue.Empty:
                    break
                if data is not None:
                    sock.send(data)
            if sock in events:
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
        sock.close(linger=500)
        wake.close(linger=0)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ProgramEvent):
            with self.lock:
                entry = self.pending.get(msg.pid)
            if entry is not None and entry[1] is not None:
                entry[1](msg.state, msg.name, msg.delta, msg.done)
        elif isinstance(msg, ProgramResult):
            with self.lock:
                entry = self.pending.pop(msg.pid, None)
            if entry is not None:
                entry[0].set_result({"variables": msg.variables, "texts": msg.texts, "messages": msg.messages,
                                     "meta": msg.meta, "error": msg.error, "error_line": msg.error_line})

    def _send(self, data: bytes) -> None:
        self.outbox.put(data)
        with self.lock:
            self._wake_send.send(b"")

    def run(self, pid: str, program: dict[str, Any], *, final: bool, stream: bool,
            on_event: EventCallback | None) -> dict[str, Any]:
        fut: Future = Future()
        with self.lock:
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
        with self.lock:
            self._wake_send.send(b"")
        self.thread.join(5)
        self._wake_send.close(linger=0)
        self.ctx.term()


_default: Backend | None = None  # the DSL's one piece of process state, as in sglang.set_default_backend


def set_default_backend(backend: Backend | None) -> None:
    global _default
    _default = backend


def get_default_backend() -> Backend | None:
    return _default


def resolve_backend(backend: Backend | Any | None) -> Backend:
    if backend is None:
        backend = _default
    if backend is None:
        raise RuntimeError("no backend: pass backend=..., or call k3rt.set_default_backend(k3rt.connect(addr)) "
                           "or use `with k3rt.Runtime(model=...) as rt:`")
    inner = getattr(backend, "backend", None)  # a Runtime wraps a RemoteBackend
    return inner if isinstance(inner, Backend) else backend


def connect(addr: str, *, timeout: float | None = None) -> RemoteBackend:
    """A backend for a running k3rt gateway: 'tcp://host:port' or 'ipc:///path'."""
    if not addr.startswith(("tcp://", "ipc://")):
        raise ValueError(f"addr: {addr!r} must start with tcp:// or ipc://")
    return RemoteBackend(addr, timeout=timeout)
