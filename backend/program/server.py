"""The DSL endpoint of the gateway: a ZMQ ROUTER that runs shipped programs, one asyncio task per
program session, next to the engine client. A client that sends ProgramClose or goes away has its
programs cancelled, which aborts their engine requests. Going away is noticed by ROUTER_NOTIFY where
libzmq has it (a draft API: pyzmq's bundled libzmq does not), and otherwise by probing: every
PROBE_INTERVAL_S each client with open sessions is sent an empty frame, which ROUTER_MANDATORY makes
fail with EHOSTUNREACH once the peer's connection is closed (a killed process's included).

Keys. With API keys (`k3rt serve --api-key`), the socket is a ZMQ CURVE server and a ZAP handler
(`_zap`, RFC 27) admits a connection only if the client's CURVE public key is one derived from one of
the keys (frontend/client.py `client_curve_keys`: scrypt of the key). The server's own key pair is
public, so it proves nothing about the server: like the HTTP port without TLS, a man in the middle could
pose as the server (and read programs), though never learn or replay the key. Why CURVE rather than a
key frame in front of every message: libzmq reads a whole multipart message into memory before the
application sees its first frame, and ZMQ_MAXMSGSIZE bounds each frame, not the message, so a peer
without the key could still make the gateway buffer any number of frames of the maximum size (300 x 1
MiB were buffered in a check) before a key frame was compared. With CURVE, a peer without the key never
completes the handshake: not one of its frames is accepted, let alone decoded. The key never crosses the
wire (a key frame would travel in clear), the traffic is encrypted, no new message type is needed, and a
reconnecting client (a new ROUTER identity) is simply handshaken again. Rejections are logged (the ZAP
handler names the peer's address; a handshake that fails before ZAP, e.g. a client without CURVE, is
seen by a socket monitor), at most one line per peer and reason every LOG_EVERY_S. Several keys are
accepted at once (issue 19 part 5). Without keys the socket speaks plain ZMTP, as before; a client that
brings a key to it fails its handshake.

Limits: ZMQ_MAXMSGSIZE (`--dsl-max-message-mb`; libzmq drops the connection of a peer that sends a
larger frame, which the client reports as a ConnectionError; a key holder's message of many frames is
still buffered whole before it is refused), and per ProgramRun at most MAX_OPS ops and MAX_STATES
states, every op's fields of their annotated types, every state existing before its ops run, and no
state with more text than a prompt within the context could hold (`_parse_program`; checked before
anything is tokenized). Long texts are tokenized off the event loop (executor.py).
Nothing one message does ends the receive loop: each is handled under a try/except that logs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils import z85

from k3rt.backend.program.executor import ProgramSession
from k3rt.backend.program.generator import Generator
from k3rt.backend.program.roles import role_text
from k3rt.backend.tokenizer import Tokenizer
from k3rt.frontend.client import client_curve_keys, server_curve_keys
from k3rt.frontend.ir import Op, Program
from k3rt.protocol import (
    ProgramClose, ProgramEvent, ProgramResult, ProgramRun, ProtocolError, ServerCall, ServerReply, decode, encode,
)

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # a context of 256K tokens is ~1 MB of text; room for many forks' worth
MAX_OPS = 65536  # per ProgramRun (a message of 16 MiB could otherwise hold ~1M ops, ~600 MB of Op objects)
MAX_STATES = 4096  # per session: each state is a copy of its parent's token ids
TEXT_MARGIN = 4  # (x context x longest token: for normalizers that shrink text, e.g. NFC)
LOG_EVERY_S = 10.0  # at most one rejection line per peer and reason this often
_PARSE_IN_THREAD_OPS = 2048  # programs with more ops are checked off the event loop
_ZAP_ADDR = "inproc://zeromq.zap.01"  # where libzmq asks a socket's ZAP handler (RFC 27)


class ProgramInvalid(ValueError):
    """A ProgramRun's program that cannot run; the text names the field (`program.ops[3].state: ...`)."""


_FLUSH_S = 5.0  # at shutdown, how long the last results may take to leave the queue for the socket
_CLOSE_LINGER_MS = 1000  # then how long libzmq may take to write them out (ctx.term() waits for it)


class _Entry:
    def __init__(self, session: ProgramSession, ident: bytes) -> None:
        self.session, self.ident = session, ident
        self.lock = asyncio.Lock()
        self.runs: set[asyncio.Task] = set()


class _RejectLog:
    """A warning per rejected message or connection, at most one per (peer, reason) every LOG_EVERY_S,
    with the number left unlogged in between."""

    def __init__(self) -> None:
        self.seen: dict[tuple[Any, str], tuple[float, int]] = {}

    def __call__(self, peer: Any, reason: str, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self.seen.get((peer, reason), (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self.seen[(peer, reason)] = (last, skipped + 1)
            return
        if len(self.seen) > 4096:  # a flood of peers: forget those quiet for a while
            self.seen = {k: v for k, v in self.seen.items() if now - v[0] < LOG_EVERY_S}
        self.seen[(peer, reason)] = (now, 0)
        log.warning("DSL port: " + fmt + (f" ({skipped} more since)" if skipped else ""), *args)


def _key_set(api_keys: str | Iterable[str] | None) -> frozenset[str]:
    keys = frozenset([api_keys] if isinstance(api_keys, str) else api_keys or ())
    if "" in keys:
        raise ValueError("api_keys: must not be empty strings")
    return keys


class ProgramServer:
    def __init__(self, client: Any, tokenizer: Tokenizer, addr: str, *,
                 api_keys: str | Iterable[str] | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tenant: Callable[[str], str | None] | None = None) -> None:
        """api_keys: a key or several; clients must hold one (None or empty: no key). max_message_bytes:
        ZMQ_MAXMSGSIZE of the socket. tenant: a key's prefix-cache namespace (ServerConfig.tenant); the
        programs of a connection admitted with that key run in it (the ZAP reply's User-Id carries it)."""
        self.gen = Generator(client, tokenizer)
        self.roles = role_text(tokenizer)
        self.addr = addr
        # Z85 public key of each api key's client -> the namespace its programs' cache lives in
        self.client_keys = {client_curve_keys(k)[0]: (tenant(k) if tenant else None) or ""
                            for k in _key_set(api_keys)}
        self.max_message_bytes = max_message_bytes
        # a state's text longer than this never fits a prompt: rejected before it is tokenized
        context = getattr(client, "info", {}).get("max_model_len")
        self.max_text_chars = TEXT_MARGIN * context * _max_token_bytes(tokenizer) if context else None
        self.sessions: dict[str, _Entry] = {}
        self.outq: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self.bound = asyncio.Event()  # set once the socket is bound (or binding failed)
        self.endpoint: str | None = None  # the bound address (a wildcard port resolved)
        self.programs_run = 0
        self.draining = False  # shutting down: running programs finish, new runs are refused
        self.rejected = 0  # messages and connections refused (what a test counts)
        self._reject_log = _RejectLog()
        self._calls: set[asyncio.Task] = set()  # ServerCall replies in progress

    def _reject(self, peer: Any, reason: str, fmt: str, *args: Any) -> None:
        self.rejected += 1
        self._reject_log(peer, reason, fmt, *args)

    async def serve(self) -> None:
        self.ctx = zmq.asyncio.Context()
        tasks: list[asyncio.Task] = []
        zap, sockets = None, []  # the monitor's socket: closed before ctx.term(), which waits for every socket
        self.sock = self.ctx.socket(zmq.ROUTER)
        try:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises instead of vanishing
            try:
                self.sock.setsockopt(zmq.ROUTER_NOTIFY, zmq.NOTIFY_DISCONNECT)
            except (zmq.ZMQError, AttributeError):
                log.info("ROUTER_NOTIFY unavailable: gone clients are found by probing")
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            if self.client_keys:
                # the ZAP handler first: a CURVE socket whose context has none admits every client
                zap = self.ctx.socket(zmq.REP)
                zap.bind(_ZAP_ADDR)
                tasks.append(asyncio.create_task(self._zap(zap)))
                public, secret = server_curve_keys()
                self.sock.curve_server = True
                self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
                self.sock.zap_domain = b"k3rt-dsl"
                monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                       | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
                sockets.append(monitor)
                tasks.append(asyncio.create_task(self._watch_handshakes(monitor)))
            try:
                self.sock.bind(self.addr)
            finally:
                self.bound.set()
            self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
            tasks += [asyncio.create_task(self._send_loop()), asyncio.create_task(self._probe_loop())]
            while True:
                frames = await self.sock.recv_multipart(copy=False)
                try:
                    self._handle(frames)
                except Exception:  # a bug costs this message, never the endpoint
                    log.exception("DSL port: a message from peer %s failed", frames[0].bytes.hex())
        finally:
            for t in tasks:
                t.cancel()
            for pid in list(self.sessions):
                self._drop(pid)
            if sockets:
                self.sock.disable_monitor()
            for m in sockets:
                m.close(linger=0)
            # the last results (a drain's shutdown errors) may still be queued in libzmq: they get _CLOSE_LINGER_MS
            # to leave (linger 0 dropped them, and the client saw only the connection close). Before the ZAP
            # handler: never a CURVE socket without one
            self.sock.close(linger=_CLOSE_LINGER_MS)
            if zap is not None:
                zap.close(linger=0)
            self.ctx.term()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if len(frames) != 2:
            self._reject(ident, "frames", "rejected a message of %d frames from peer %s (%s): one expected",
                         len(frames) - 1, ident.hex(), _peer_address(frames[-1]))
            return
        data = frames[1].bytes
        if not data:  # ROUTER_NOTIFY: this peer disconnected
            self._drop_client(ident)
            return
        try:
            msg = decode(data)
        except ProtocolError as e:
            self._reject(ident, "decode", "rejected a message from peer %s (%s): %s", ident.hex(),
                         _peer_address(frames[1]), e)
            return
        if isinstance(msg, ProgramRun):
            self._start(ident, msg, _user_id(frames[1]))
        elif isinstance(msg, ServerCall):
            task = asyncio.create_task(self._call(ident, msg))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        elif isinstance(msg, ProgramClose):
            entry = self.sessions.get(msg.pid)
            if entry is not None and entry.ident == ident:  # another connection's session is not this one's
                self._drop(msg.pid)
        else:
            self._reject(ident, "type", "rejected a %s from peer %s: not a DSL message", type(msg).__name__,
                         ident.hex())

    def _start(self, ident: bytes, msg: ProgramRun, tenant: str | None = None) -> None:
        if self.draining:
            self.outq.put_nowait((ident, encode(ProgramResult(
                msg.pid, {}, {}, {}, {}, "server_shutdown: the server is shutting down", None))))
            return
        entry = self.sessions.get(msg.pid)
        if entry is not None and entry.ident != ident:
            self._reject(ident, "pid", "rejected a ProgramRun from peer %s: its pid is another connection's "
                         "session", ident.hex())
            self.outq.put_nowait((ident, encode(ProgramResult(
                msg.pid, {}, {}, {}, {}, "pid: the session belongs to another connection", None))))
            return
        entry = self._entry(ident, msg, tenant)
        task = asyncio.create_task(self._run(entry, msg))
        entry.runs.add(task)
        task.add_done_callback(entry.runs.discard)

    async def _call(self, ident: bytes, msg: ServerCall) -> None:
        """sglang's get_server_info and flush_cache for DSL clients (the HTTP server has its own routes)."""
        result, error = {}, None
        if msg.method == "server_info":
            info = dict(getattr(self.gen.client, "info", {}) or {})
            result = {**info, "model_path": info.get("model"), "dsl_endpoint": self.endpoint,
                      "programs_run": self.programs_run}
        elif msg.method == "flush_cache":
            await self.gen.client.flush_cache()
            result = {"flushed": True}
        else:
            error = f"method: {msg.method!r} not one of ['server_info', 'flush_cache']"
        self.outq.put_nowait((ident, encode(ServerReply(msg.cid, result, error))))

    async def drain(self, timeout: float) -> bool:
        """Stop taking programs and wait up to `timeout` s for the running ones (a shutdown's drain; the
        server's cut at the drain timeout ends their engine requests, so they end soon after it). Returns
        whether every one finished; their results still go out before `serve` is cancelled."""
        self.draining = True
        runs = {t for e in self.sessions.values() for t in e.runs}
        pending: set[asyncio.Task] = set()
        if runs:
            _, pending = await asyncio.wait(runs, timeout=timeout)
            # still running past the drain (the engine's cut normally ends them first; a loaded machine may
            # not have): each gets its shutdown error now, so a client never sees a bare closed connection
            for pid, e in list(self.sessions.items()):
                cut = [t for t in e.runs if t in pending]
                for t in cut:
                    t.cancel()  # a cancelled run sends nothing itself
                if cut:
                    self.outq.put_nowait((e.ident, encode(ProgramResult(
                        pid, {}, {}, {}, {}, "server_shutdown: the server shut down before the program finished", None))))
        deadline = time.monotonic() + _FLUSH_S
        while not self.outq.empty() and time.monotonic() < deadline:  # the results of the last runs
            await asyncio.sleep(0.01)
        return not pending

    async def _zap(self, sock: zmq.asyncio.Socket) -> None:
        """Answer libzmq's ZAP requests (RFC 27): a CURVE client is admitted when its public key is one
        derived from one of our keys. The keys are public keys, so a set lookup leaks nothing of a secret."""
        while True:
            frames = await sock.recv_multipart()
            request_id, ok, user = frames[1] if len(frames) > 1 else b"", False, b""
            try:
                _, _, _, address, _, mechanism, *credentials = frames
                ok = (mechanism == b"CURVE" and len(credentials) == 1
                      and z85.encode(credentials[0]) in self.client_keys)
                if ok:
                    user = self.client_keys[z85.encode(credentials[0])].encode()
                if not ok:
                    self._reject(address, "key", "rejected a connection from %s: its %s key is not one of this "
                                 "server's api keys", address.decode(errors="replace"),
                                 mechanism.decode(errors="replace"))
            except Exception:  # a malformed request: deny it, keep serving
                log.exception("DSL port: a malformed ZAP request")
            await sock.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                       b"OK" if ok else b"unknown api key", user, b""])

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """Log handshakes that fail before ZAP is asked: a client without CURVE (no key), or not ZMTP."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            self._reject(event["endpoint"], "handshake", "rejected a connection on %s: the handshake failed "
                         "(a client without the api key?), event %s value %s",
                         event["endpoint"].decode(errors="replace"), getattr(event["event"], "name", event["event"]),
                         event["value"])

    async def _send_loop(self) -> None:
        while True:
            ident, data = await self.outq.get()
            try:
                await self.sock.send_multipart([ident, data])
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self._drop_client(ident)  # the client is gone: nobody will read its programs' results

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for ident in {e.ident for e in self.sessions.values()}:
                self.outq.put_nowait((ident, b""))  # clients ignore empty frames

    def _drop_client(self, ident: bytes) -> None:
        for pid in [p for p, e in self.sessions.items() if e.ident == ident]:
            self._drop(pid)

    def _drop(self, pid: str) -> None:
        entry = self.sessions.pop(pid, None)
        if entry is not None:
            entry.session.cancel()  # its engine requests are aborted as their streams close
            for t in list(entry.runs):
                t.cancel()

    def _entry(self, ident: bytes, msg: ProgramRun, tenant: str | None = None) -> "_Entry":
        entry = self.sessions.get(msg.pid)
        if entry is None:
            on_event = None
            if msg.stream:
                def on_event(sid: int, name: str | None, delta: str, done: bool, meta: dict | None = None,
                             pid: str = msg.pid) -> None:
                    self.outq.put_nowait((ident, encode(ProgramEvent(pid, sid, name, delta, done, meta))))
            entry = _Entry(ProgramSession(msg.pid, self.gen, self.roles, on_event=on_event, cache_salt=tenant), ident)
            self.sessions[msg.pid] = entry
        return entry

    async def _run(self, entry: "_Entry", msg: ProgramRun) -> None:
        session, ident = entry.session, entry.ident
        async with entry.lock:  # flushes of one session run in order
            try:
                existing = frozenset(session.states)  # (the session's earlier runs are done: their forks exist)
                ops = msg.program.get("ops")
                if isinstance(ops, list) and len(ops) > _PARSE_IN_THREAD_OPS:
                    program = await asyncio.to_thread(_parse_program, msg.program, existing, self.max_text_chars)
                else:
                    program = _parse_program(msg.program, existing, self.max_text_chars)
                await session.run(program)
                result = session.result()
            except asyncio.CancelledError:
                return
            except ProgramInvalid as e:
                self._reject(ident, "program", "rejected a program from peer %s: %s", ident.hex(), e)
                result = {**session.result(), "error": str(e), "error_line": None}
            except Exception as e:  # malformed program: answer with an error, never crash the server
                result = {**session.result(), "error": f"{type(e).__name__}: {e}", "error_line": None}
        self.programs_run += 1
        if msg.final or result.get("error"):
            self._drop(msg.pid)
        self.outq.put_nowait((ident, encode(ProgramResult(msg.pid, result["variables"], result["texts"],
                                                          result["messages"], result.get("meta", {}),
                                                          result.get("error"), result.get("error_line"),
                                                          result.get("usage", {})))))


def _user_id(frame: zmq.Frame) -> str | None:
    """The namespace the ZAP handler gave the frame's connection (None: no keys, or isolation off)."""
    try:
        return frame.get("User-Id") or None
    except zmq.ZMQError:
        return None


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return "address unknown"


def _max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes of text one token stands for (0.1 s for a vocabulary of 160K)."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        try:
            longest = max(longest, len(tokenizer.token_bytes(i)))
        except ValueError:  # an unused id
            pass
    return longest


def _json_types(hint: Any) -> tuple[frozenset[type], type | None]:
    """The JSON types a value of this annotation may have, and the element type of a list."""
    parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    outer, item = set(), None
    for h in parts:
        origin = typing.get_origin(h) or h
        outer.add(origin)
        if origin is list:
            item = typing.get_args(h)[0]
    return frozenset(outer), item


_OP_HINTS = typing.get_type_hints(Op)
_OP_FIELDS = {f.name: _json_types(_OP_HINTS[f.name]) for f in dataclasses.fields(Op)}
_PROGRAM_FIELDS = {"ops": (list,), "num_states": (int,), "default_params": (dict,), "name": (str,)}


def _parse_program(d: dict[str, Any], existing: frozenset[int], max_text_chars: int | None = None) -> Program:
    """`Program.from_dict` for a program from the wire: ProgramInvalid naming the field for a wrong type, an
    unknown field, too many ops or states, an op on a state that does not exist when it runs (it would wait
    forever) or a fork into one that does, or more text in one state than `max_text_chars` (which no prompt
    of the model holds: tokenizing it would only cost time). existing: the session's states before this
    program."""
    unknown = d.keys() - _PROGRAM_FIELDS.keys()
    if unknown:
        raise ProgramInvalid(f"program: unknown fields {sorted(unknown)}")
    if "ops" not in d:
        raise ProgramInvalid("program.ops: missing")
    for name, allowed in _PROGRAM_FIELDS.items():
        if name in d and type(d[name]) not in allowed:
            raise ProgramInvalid(f"program.{name}: expected {allowed[0].__name__}, got {type(d[name]).__name__}")
    num_states = d.get("num_states", 1)
    if not 1 <= num_states <= MAX_STATES:
        raise ProgramInvalid(f"program.num_states: {num_states} states, must be in [1, {MAX_STATES}]")
    if len(d["ops"]) > MAX_OPS:
        raise ProgramInvalid(f"program.ops: {len(d['ops'])} ops, limit {MAX_OPS}")
    ops, known = [], set(existing)
    chars = dict.fromkeys(existing, 0)  # text added to each state by this program (a fork's child: its parent's)
    for i, o in enumerate(d["ops"]):
        where = f"program.ops[{i}]"
        if type(o) is not dict:
            raise ProgramInvalid(f"{where}: expected an object, got {type(o).__name__}")
        unknown = o.keys() - _OP_FIELDS.keys()
        if unknown:
            raise ProgramInvalid(f"{where}: unknown fields {sorted(unknown)}")
        for name, v in o.items():
            allowed, item = _OP_FIELDS[name]
            if type(v) not in allowed:
                raise ProgramInvalid(f"{where}.{name}: expected {_OP_HINTS[name]}, got {type(v).__name__}")
            if item is not None and type(v) is list and not all(type(x) is item for x in v):
                raise ProgramInvalid(f"{where}.{name}: expected {_OP_HINTS[name]}")
        try:
            op = Op(**o)
        except (TypeError, ValueError) as e:
            raise ProgramInvalid(f"{where}: {e}") from None
        if op.state not in known:
            raise ProgramInvalid(f"{where}.state: state {op.state} does not exist (no fork made it)")
        if op.kind == "text" and op.value and max_text_chars is not None:
            chars[op.state] += len(op.value)
            if chars[op.state] > max_text_chars:
                raise ProgramInvalid(f"{where}.value: state {op.state} has {chars[op.state]} characters of text, "
                                     f"more than a prompt within the model's context length can hold")
        for c in op.children:
            if op.kind == "fork":
                if c in known or not 0 < c < num_states:
                    raise ProgramInvalid(f"{where}.children: state {c} exists already or is outside [1, {num_states})")
                known.add(c)
                chars[c] = chars[op.state]
            elif op.kind == "join" and c not in known:
                raise ProgramInvalid(f"{where}.children: state {c} does not exist")
        ops.append(op)
    return Program(ops, num_states, d.get("default_params", {}), d.get("name", "program"))
