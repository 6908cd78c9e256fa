"""The gateway's handle on the engine process: spawn it, send requests, route updates to waiters.

asyncio + zmq.asyncio. One reader task receives UpdateBatch messages and puts each RequestUpdate on
the asyncio queue of its request. If the engine process dies (EngineError, or its exit: the watchdog
wakes on the process sentinel, and reading `dead` asks the process too, so /health never reports a
dead engine as ready), every waiting request receives an update with finish_reason "error" and `dead`
is set, so callers answer 5xx instead of hanging. `cut` ends every waiting request the same way with
another reason (the server's drain timeout).

The engine process ignores SIGINT and SIGTERM: the gateway owns shutdown (`shutdown`: the Shutdown ->
ShutdownAck handshake, which returns at once if the engine is already gone).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
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
        self._dead: str | None = None  # reason, once the engine is gone
        self._exit_expected = False  # ShutdownAck received (or shutdown killed a starting engine): no failure
        self._cut: set[str] = set()  # requests `cut` ended while the engine still runs them (to abort)
        self._finished: set[str] = set()  # requests whose last update is queued, not yet read: `cut` skips them
        self._ended = asyncio.Event()  # ShutdownAck received, or the engine is dead: `shutdown` waits no longer
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
        with _main_hidden():
            self.proc.start()
        # the engine ignores SIGTERM, so multiprocessing's exit-time terminate() of daemonic children would
        # leave it running (and that exit waiting on it forever) if the gateway exits without `shutdown`
        atexit.register(self._kill)
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
                try:
                    self._route(msg)
                except ProtocolError as e:  # columns of different lengths: as malformed as bad JSON
                    log.error("ignoring a malformed update batch from the engine: %s", e)
            elif isinstance(msg, Ready):
                self.info = msg.info
                self._ready.set()
            elif isinstance(msg, ShutdownAck):
                self._exit_expected = True
                self._ended.set()
                return
            elif isinstance(msg, EngineError):
                self._fail(f"engine failed: {msg.message}")
                return

    def _route(self, batch: UpdateBatch) -> None:
        """Each update onto the queue of its request (updates of requests nobody waits for are dropped)."""
        self.stats = batch.stats or self.stats
        for u in batch.expand():
            q = self.queues.get(u.rid)
            if q is not None:
                q.put_nowait(u)
                if u.finished:
                    self._finished.add(u.rid)

    @property
    def dead(self) -> str | None:
        """Why the engine is gone, or None while it runs (or before it started, or after a clean shutdown).
        Asks the process itself (a non-blocking waitpid), so a death shows before the watchdog wakes."""
        if self._dead is None and not self._exit_expected and self.proc is not None and not self.proc.is_alive():
            self._exited()
        return self._dead

    async def _watch(self) -> None:
        """Wake when the process exits (its sentinel fd becomes readable), polling as a fallback."""
        loop, sentinel = asyncio.get_running_loop(), self.proc.sentinel
        exited = asyncio.Event()
        loop.add_reader(sentinel, exited.set)
        try:
            while self.proc.is_alive() and not self._ended.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(exited.wait(), 0.2)
        finally:
            loop.remove_reader(sentinel)
        if not self._exit_expected and self._dead is None:
            self._exited()

    def _exited(self) -> None:
        self._fail(f"engine process exited unexpectedly (exit code {self.proc.exitcode})")

    def _fail(self, reason: str) -> None:
        self._dead = reason
        log.error("%s", reason)
        self._ready.set()
        self._ended.set()
        self.cut(reason)

    def cut(self, reason: str) -> int:
        """End every request still running now with an error update carrying `reason` (their engine requests
        are aborted as the callers stop reading); returns how many."""
        running = [rid for rid in self.queues if rid not in self._finished]
        for rid in running:
            self.queues[rid].put_nowait(RequestUpdate(rid, [], True, "error", error=reason))
            self._cut.add(rid)
        return len(running)

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
            self._finished.discard(rid)
            if rid in self._cut:
                self._cut.discard(rid)
                finished = False
            if not finished and not self.dead:
                # the client went away (or the caller stopped early): free the request's pages now
                await self.push.send(encode(AbortRequest(rid)))

    async def unpin(self, rid: str) -> None:
        """Release a finished pin=True request's end-of-request snapshot."""
        if not self.dead:
            await self.push.send(encode(Unpin(rid)))

    async def flush_cache(self) -> None:
        await self.push.send(encode(FlushCache()))

    def _kill(self) -> None:
        """The interpreter is exiting without `shutdown` (atexit): the engine's end is expected, so the watchdog,
        which may still run in a daemon thread's loop, must not report it as a crash."""
        if self.proc is not None and self.proc.is_alive():
            self._exit_expected = True
            self.proc.kill()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Drain handshake: Shutdown -> wait for ShutdownAck (or the engine's death) -> join the process
        (kill if it hangs). An engine still starting (no Ready yet) has nothing to drain: it is killed."""
        if self.proc is None:
            return
        if not self._ready.is_set():
            self._exit_expected = True
            self.proc.kill()
        elif not self.dead:
            await self.push.send(encode(Shutdown()))
            try:
                await asyncio.wait_for(self._ended.wait(), timeout)
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
        atexit.unregister(self._kill)


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """While the engine process is spawned, `__main__` has no file and no spec, so the child does not
    re-run the parent's main module. Spawn re-imports it (as `__mp_main__`) to find functions pickled from
    there; the engine's target and arguments all live in k3rt's own modules, and a plain script that builds
    `k3rt.Runtime(...)` at module level (no `if __name__ == "__main__":` guard) would otherwise build a second
    runtime inside the engine process, which dies. Popen writes the child's preparation data during
    `start()`, so hiding the two attributes for that call is enough."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
