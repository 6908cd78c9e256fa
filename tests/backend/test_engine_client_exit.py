"""The engine process killed at interpreter exit (EngineClient's atexit hook, for a script that never called
`shutdown`) is an expected end: the watchdog, still running in the Runtime's daemon thread, must not log it as
"engine process exited unexpectedly". Under load the watchdog won that race and a plain script that had finished
its work printed the crash message (tests/compat/test_runtime_script.py, CI of 2026-12-02)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

from k3rt.backend.engine_client import EngineClient
from k3rt.config import EngineConfig


def test_the_atexit_kill_is_not_reported_as_a_crash() -> None:
    client = EngineClient(EngineConfig(model="unused", runner="null"))
    client.proc = mp.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    client.proc.start()

    async def run() -> None:
        watch = asyncio.create_task(client._watch())
        await asyncio.sleep(0.3)  # the watchdog is waiting on the live process
        client._kill()
        await asyncio.wait_for(watch, 10)

    try:
        asyncio.run(run())
    finally:
        client.proc.join(5)
        os.rmdir(os.path.dirname(client.addrs.to_engine.removeprefix("ipc://")))
    assert client.proc.exitcode == -9
    assert client.dead is None
