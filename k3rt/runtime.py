"""`k3rt.Runtime`: a local backend for DSL programs, started from Python.

    with k3rt.Runtime(model="/path/to/ckpt") as rt:
        k3rt.set_default_backend(rt)
        state = my_program.run(question="...")

The gateway (program server) runs on a background thread of this process with its own event loop;
the engine runs in a spawned process (default) or on a thread of this one (in_process=True). Either
way programs reach it through the same ZMQ endpoint, so behaviour is identical. No torch here.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from typing import Any

from k3rt.config import CacheConfig, EngineConfig


class Runtime:
    def __init__(self, model: str | None = None, *, in_process: bool = False, dtype: str | None = None,
                 cache_pages: int = 512, max_running: int = 64, endpoint: str | None = None,
                 engine_config: EngineConfig | None = None, startup_timeout: float = 600.0,
                 api_key: str | None = None, model_path: str | None = None) -> None:
        """api_key: a key the program server requires (for an `endpoint` others can reach, e.g. tcp); the
        default endpoint is an ipc socket in a private (0700) temporary folder and needs none.
        model_path: sglang.Runtime's name for `model`."""
        if model_path is not None:
            if model is not None:
                raise TypeError("Runtime: give model or model_path, not both")
            model = model_path
        from k3rt.frontend.client import RemoteBackend

        if engine_config is None:
            from k3rt.config import SchedulerConfig
            from k3rt.models import resolve_model_dir

            # model omitted: the default model shipped inside the package (k3rt/models/k3-tiny)
            engine_config = EngineConfig(model=str(resolve_model_dir(model)), dtype=dtype,
                                         cache=CacheConfig(num_pages=cache_pages),
                                         scheduler=SchedulerConfig(max_running=max_running))
        self.config = engine_config
        self.address = endpoint or f"ipc://{tempfile.mkdtemp(prefix='k3rt-dsl-')}/programs"  # the ZMQ endpoint
        self._api_key = api_key
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_process = in_process
        self._thread = threading.Thread(target=self._serve, name="k3rt-runtime", daemon=True)
        self._thread.start()
        if not self._ready.wait(startup_timeout):
            raise TimeoutError(f"k3rt.Runtime: not ready within {startup_timeout:.0f}s")
        if self._error is not None:
            raise RuntimeError(f"k3rt.Runtime failed to start: {self._error}") from self._error
        self.backend = RemoteBackend(self.address, api_key=api_key)  # (not connect(): K3RT_API_KEY is not ours)
        # sglang's Runtime.endpoint is the backend its programs talk to (get_model_name, flush_cache, ...)
        self.endpoint = self.backend

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as e:  # reported to the constructor, or logged after start
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        from k3rt.backend.program.server import ProgramServer
        from k3rt.backend.tokenizer import load_tokenizer

        if self._in_process:
            from k3rt.backend.engine_inproc import InProcEngineClient

            self.client: Any = InProcEngineClient(self.config)
        else:
            from k3rt.backend.engine_client import EngineClient

            self.client = EngineClient(self.config)
        await self.client.start()
        self.server = ProgramServer(self.client, load_tokenizer(self.config.model), self.address,
                                    api_keys=self._api_key)
        self._stop = asyncio.Event()
        serve = asyncio.create_task(self.server.serve())
        await asyncio.sleep(0.05)
        if serve.done():
            serve.result()  # raises the server's startup error into the constructor
        self._ready.set()
        await self._stop.wait()
        serve.cancel()
        try:
            await serve
        except asyncio.CancelledError:
            pass
        await self.client.shutdown()

    @property
    def token_usage(self):
        """The tokens this Runtime's programs used (frontend/client.py TokenUsage)."""
        return self.backend.token_usage

    @property
    def engine_stats(self) -> dict[str, Any]:
        """Scheduler/cache counters (prompt, cached and computed tokens, pages, snapshots)."""
        c = self.client
        if hasattr(c, "engine"):
            return c.engine.stats_dict()
        return dict(c.stats)

    def shutdown(self) -> None:
        if getattr(self, "backend", None) is not None:
            self.backend.shutdown()
            self.backend = self.endpoint = None
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(60)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
