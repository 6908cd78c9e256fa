"""The DSL endpoint of the gateway: a ZMQ ROUTER that runs shipped programs, one asyncio task per
program session, next to the engine client. A client that sends ProgramClose or goes away has its
programs cancelled, which aborts their engine requests. Going away is noticed by ROUTER_NOTIFY where
libzmq has it (a draft API: pyzmq's bundled libzmq does not), and otherwise by probing: every
PROBE_INTERVAL_S each client with open sessions is sent an empty frame, which ROUTER_MANDATORY makes
fail with EHOSTUNREACH once the peer's connection is closed (a killed process's included)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
import zmq.asyncio

from k3rt.backend.program.executor import ProgramSession
from k3rt.backend.program.generator import Generator
from k3rt.backend.program.roles import role_text
from k3rt.backend.tokenizer import Tokenizer
from k3rt.frontend.ir import Program
from k3rt.protocol import ProgramClose, ProgramEvent, ProgramResult, ProgramRun, decode, encode

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


class _Entry:
    def __init__(self, session: ProgramSession, ident: bytes) -> None:
        self.session, self.ident = session, ident
        self.lock = asyncio.Lock()
        self.runs: set[asyncio.Task] = set()


class ProgramServer:
    def __init__(self, client: Any, tokenizer: Tokenizer, addr: str) -> None:
        self.gen = Generator(client, tokenizer)
        self.roles = role_text(tokenizer)
        self.addr = addr
        self.sessions: dict[str, _Entry] = {}
        self.outq: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self.bound = asyncio.Event()  # set once the socket is bound (or binding failed)
        self.endpoint: str | None = None  # the bound address (a wildcard port resolved)
        self.programs_run = 0

    async def serve(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises instead of vanishing
        try:
            self.sock.setsockopt(zmq.ROUTER_NOTIFY, zmq.NOTIFY_DISCONNECT)
        except (zmq.ZMQError, AttributeError):
            log.info("ROUTER_NOTIFY unavailable: gone clients are found by probing")
        try:
            self.sock.bind(self.addr)
        finally:
            self.bound.set()
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sender = asyncio.create_task(self._send_loop())
        prober = asyncio.create_task(self._probe_loop())
        try:
            while True:
                frames = await self.sock.recv_multipart()
                ident, data = frames[0], frames[-1]
                if not data:  # ROUTER_NOTIFY: this peer disconnected
                    self._drop_client(ident)
                    continue
                try:
                    msg = decode(data)
                except Exception as e:
                    log.warning("undecodable DSL message from %r: %s", ident, e)
                    continue
                if isinstance(msg, ProgramRun):
                    entry = self._entry(ident, msg)
                    task = asyncio.create_task(self._run(entry, msg))
                    entry.runs.add(task)
                    task.add_done_callback(entry.runs.discard)
                elif isinstance(msg, ProgramClose):
                    self._drop(msg.pid)
        finally:
            sender.cancel()
            prober.cancel()
            for pid in list(self.sessions):
                self._drop(pid)
            self.sock.close(linger=0)
            self.ctx.term()

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

    def _entry(self, ident: bytes, msg: ProgramRun) -> "_Entry":
        entry = self.sessions.get(msg.pid)
        if entry is None:
            on_event = None
            if msg.stream:
                def on_event(sid: int, name: str | None, delta: str, done: bool, pid: str = msg.pid) -> None:
                    self.outq.put_nowait((ident, encode(ProgramEvent(pid, sid, name, delta, done))))
            entry = _Entry(ProgramSession(msg.pid, self.gen, self.roles, on_event=on_event), ident)
            self.sessions[msg.pid] = entry
        return entry

    async def _run(self, entry: "_Entry", msg: ProgramRun) -> None:
        session, ident = entry.session, entry.ident
        async with entry.lock:  # flushes of one session run in order
            try:
                program = Program.from_dict(msg.program)
                await session.run(program)
                result = session.result()
            except asyncio.CancelledError:
                return
            except Exception as e:  # malformed program: answer with an error, never crash the server
                result = {**session.result(), "error": f"{type(e).__name__}: {e}", "error_line": None}
        self.programs_run += 1
        if msg.final or result.get("error"):
            self._drop(msg.pid)
        self.outq.put_nowait((ident, encode(ProgramResult(msg.pid, result["variables"], result["texts"],
                                                          result["messages"], result.get("meta", {}),
                                                          result.get("error"), result.get("error_line")))))
