"""An in-process engine client with EngineClient's interface: the Engine steps on a worker thread of
this process instead of in a separate process. Tests and `k3rt.Runtime(in_process=True)` use it;
callers cannot tell the difference (same RequestUpdate stream, same abort-on-close)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from k3rt.config import EngineConfig
from k3rt.backend.request_map import RequestMap
from k3rt.protocol import GenerateRequest, RequestUpdate


class InProcEngineClient:
    def __init__(self, cfg: EngineConfig, *, model=None) -> None:
        self.cfg, self._model = cfg, model
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestUpdate]]] = {}
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._inbox: list[tuple[str, Any]] = []
        self._stop = False

    async def start(self) -> None:
        from k3rt.backend.engine import Engine

        self.engine = await asyncio.to_thread(Engine, self.cfg, model=self._model)
        self.info = {"model": self.cfg.model, "vocab_size": self.engine.model_cfg.vocab_size,
                     "max_model_len": self.engine.model_cfg.max_position_embeddings, **self.engine.layout.as_dict()}
        self.thread = threading.Thread(target=self._loop, name="k3rt-engine-inproc", daemon=True)
        self.thread.start()

    def _deliver(self, u: RequestUpdate) -> None:
        entry = self.queues.get(u.rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, u)

    def _loop(self) -> None:
        eng = self.engine
        requests = RequestMap(eng)
        while True:
            with self._work:
                while not self._inbox and not eng.has_unfinished and not self._stop:
                    self._work.wait()
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
            for kind, arg in inbox:
                if kind == "add":
                    error = requests.add(arg)
                    if error is not None:
                        self._deliver(error)
                elif kind == "unpin":
                    requests.unpin(arg)
                elif kind == "flush":
                    requests.flush()
                elif kind == "abort":
                    requests.abort(arg)
            if eng.has_unfinished:
                try:
                    updates = requests.step()
                except Exception as e:  # fatal, like the engine process dying
                    self.dead = f"engine failed: {type(e).__name__}: {e}"
                    for name in list(self.queues):
                        self._deliver(RequestUpdate(name, [], True, "error", error=self.dead))
                    return
                for u in updates:
                    self._deliver(u)
                self.stats = eng.stats_dict()

    def _submit(self, kind: str, arg: Any) -> None:
        with self._work:
            self._inbox.append((kind, arg))
            self._work.notify()

    async def generate(self, prompt_ids: list[int], params: dict[str, Any], *, cache_salt: str | None = None,
                       grammar: dict[str, Any] | None = None, eos_token_ids: list[int] | None = None,
                       rid: str | None = None, prompt_logprobs_from: int | None = None, pin: bool = False,
                       ) -> AsyncIterator[RequestUpdate]:
        rid = rid or uuid.uuid4().hex
        q: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self.queues[rid] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self._submit("add", GenerateRequest(rid, list(prompt_ids), params, cache_salt, grammar, eos_token_ids,
                                                prompt_logprobs_from, pin))
            while True:
                u = await q.get()
                yield u
                if u.finished:
                    finished = True
                    return
        finally:
            self.queues.pop(rid, None)
            if not finished:
                self._submit("abort", rid)

    async def unpin(self, rid: str) -> None:
        self._submit("unpin", rid)

    async def flush_cache(self) -> None:
        self._submit("flush", None)

    async def shutdown(self, timeout: float = 30.0) -> None:
        with self._work:
            self._stop = True
            self._work.notify()
        await asyncio.to_thread(self.thread.join, timeout)
        if not self.thread.is_alive():
            self.engine.close()  # tensor-parallel workers; the loop no longer steps
