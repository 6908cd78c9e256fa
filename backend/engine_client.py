"""The gateway's handle on the engine process: spawn it, send requests, route updates to waiters.

asyncio + zmq.asyncio. One reader task receives UpdateBatch messages and puts each RequestUpdate on
the asyncio queue of its request. If the engine process dies (EngineError, or its exit noticed by
the watchdog), every waiting request receives an update with finish_reason "error" and `dead` is
set, so callers answer 5xx instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from k3rt.config import EngineConfig
from k3rt.protocol import (
    AbortRequest, EngineError, FlushCache, GenerateRequest, ProtocolError, Ready, RequestUpdate, Shutdown, ShutdownAck,
    Unpin, UpdateBatch, decode, encode,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Addresses:
    to_engine: str
    from_engine: str

    @staticmethod
    def fresh() -> "Addresses":
        d = tempfile.mkdtemp(prefix="k3rt-")
        return Addresses(f"ipc://{d}/to-engine", f"ipc://{d}/from-engine")


class EngineDead(RuntimeError):
    pass


class EngineClient:
    def __init__(self, cfg: EngineConfig, *, log_level: str = "WARNING", startup_timeout: float = 600.0) -> None:
        self.cfg, self.log_level, self.startup_timeout = cfg, log_level, startup_timeout
        self.addrs = Addresses.fresh()
        self.queues: dict[str, asyncio.Queue[RequestUpdate]] = {}
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.dead: str | None = None  # reason, once the engine is gone
        self._ack = asyncio.Event()
        self._ready = asyncio.Event()
        self.proc: mp.process.BaseProcess | None = None

    async def start(self) -> None:
        from k3rt.backend.engine_process import engine_main

        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.addrs.from_engine)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.addrs.to_engine)
        spawn = mp.get_context("spawn")
        self.proc = spawn.Process(target=engine_main, name="k3rt-engine", daemon=True,
                                  args=(self.cfg, self.addrs.to_engine, self.addrs.from_engine, self.log_level))
        self.proc.start()
        self._reader = asyncio.create_task(self._read())
        self._watchdog = asyncio.create_task(self._watch())
        try:
            await asyncio.wait_for(self._ready.wait(), self.startup_timeout)
        except asyncio.TimeoutError:
            raise EngineDead(f"engine did not become ready within {self.startup_timeout:.0f}s") from None
        if self.dead:
            raise EngineDead(self.dead)

    async def _read(self) -> None:
        while True:
            try:
                msg = decode(await self.pull.recv(), trusted=True)  # our engine process, private ipc
            except ProtocolError as e:  # a bug on the engine side: say so, keep reading
                log.error("ignoring a malformed message from the engine: %s", e)
                continue
            if isinstance(msg, UpdateBatch):
                self.stats = msg.stats or self.stats
                for u in msg.updates:
                    q = self.queues.get(u.rid)
                    if q is not None:
                        q.put_nowait(u)
            elif isinstance(msg, Ready):
                self.info = msg.info
                self._ready.set()
            elif isinstance(msg, ShutdownAck):
                self._ack.set()
                return
            elif isinstance(msg, EngineError):
                self._fail(f"engine failed: {msg.message}")
                return

    async def _watch(self) -> None:
        while self.proc is not None and self.proc.is_alive() and not self._ack.is_set():
            await asyncio.sleep(0.2)
        if not self._ack.is_set() and self.dead is None:
            code = self.proc.exitcode if self.proc is not None else None
            self._fail(f"engine process exited unexpectedly (exit code {code})")

    def _fail(self, reason: str) -> None:
        self.dead = reason
        log.error("%s", reason)
        self._ready.set()
        for rid, q in self.queues.items():
            q.put_nowait(RequestUpdate(rid, [], True, "error", error=reason))

    async def generate(self, prompt_ids: list[int], params: dict[str, Any], *, cache_salt: str | None = None,
                       grammar: dict[str, Any] | None = None, eos_token_ids: list[int] | None = None,
                       rid: str | None = None, prompt_logprobs_from: int | None = None, pin: bool = False,
                       ) -> AsyncIterator[RequestUpdate]:
        """Stream the request's updates until it finishes. Cancelling the iterator aborts the request."""
        if self.dead:
            raise EngineDead(self.dead)
        rid = rid or uuid.uuid4().hex
        q: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self.queues[rid] = q
        finished = False
        try:
            await self.push.send(encode(GenerateRequest(rid, prompt_ids, params, cache_salt, grammar, eos_token_ids,
                                                        prompt_logprobs_from, pin)))
            while True:
                u = await q.get()
                yield u
                if u.finished:
                    finished = True
                    return
        finally:
            self.queues.pop(rid, None)
            if not finished and not self.dead:
                # the client went away (or the caller stopped early): free the request's pages now
                await self.push.send(encode(AbortRequest(rid)))

    async def unpin(self, rid: str) -> None:
        """Release a finished pin=True request's end-of-request snapshot."""
        if not self.dead:
            await self.push.send(encode(Unpin(rid)))

    async def flush_cache(self) -> None:
        await self.push.send(encode(FlushCache()))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Drain handshake: Shutdown -> wait for ShutdownAck -> join the process (kill if it hangs)."""
        if self.proc is None:
            return
        if self.proc.is_alive() and not self.dead:
            await self.push.send(encode(Shutdown()))
            try:
                await asyncio.wait_for(self._ack.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("engine did not acknowledge shutdown within %.0fs", timeout)
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for t in (self._reader, self._watchdog):
            t.cancel()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        for a in (self.addrs.to_engine, self.addrs.from_engine):
            path = a.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.addrs.to_engine.removeprefix("ipc://")))  # Addresses.fresh()'s folder
        self.proc = None
