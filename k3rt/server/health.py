"""What GET /health judges once the engine is ready: is it making progress, and can it still admit a request.

`EngineWatch` samples the gateway's view of the engine a few times a second (`run`) and at every probe:
  * when the engine's stats last arrived (every `UpdateBatch` carries them: after each step that produced
    updates, and at least once a second otherwise), told apart by the identity of the stats dict the
    engine client replaces on arrival;
  * when it last made progress: `steps` or `computed_tokens` changed, or the gateway saw a request update.
The stall clock only runs while the engine has work (its last stats show running + waiting > 0, or the
gateway has engine requests in flight): an idle engine never stalls, and the clock starts when work arrives.

Unhealthy (503, the body says why):
  stalled       work pending and no progress for `stall_timeout_s`, or no stats at all for that long (a
                wedged engine loop sends nothing). `stall_timeout_s` 0 disables both.
  pinned_full   pinned snapshots hold so much of the pool that one more request cannot be admitted:
                pinned_pages > pages_usable - (pages_per_state_set + 1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class EngineWatch:
    def __init__(self, gateway: Any, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """`gateway`: anything with `client.stats`, `client.info`, `client.queues`, `in_flight` and
        `last_update_at` (a `Gateway`)."""
        self.gateway, self.stall_timeout_s, self.clock = gateway, stall_timeout_s, clock
        now = clock()
        self._stats: dict[str, Any] | None = None  # the stats dict seen last (a new object per UpdateBatch)
        self._stats_at = now  # when it arrived (as far as sampling can tell)
        self._progress: tuple[Any, Any] | None = None  # (steps, computed_tokens) of those stats
        self._progress_at = now  # the last progress
        self._idle_at = now  # the last moment the engine had no work: the stall clocks start there

    @property
    def tick_s(self) -> float:
        """How often `run` samples: a tenth of the stall timeout, between 50 ms and 1 s."""
        return min(1.0, max(0.05, self.stall_timeout_s / 10))

    async def run(self) -> None:
        """Sample until cancelled (started once the engine is ready)."""
        while True:
            self.observe()
            await asyncio.sleep(self.tick_s)

    def _pending(self) -> tuple[int, int, int]:
        """(running, waiting) of the engine's last stats, and the engine requests the gateway waits on
        (its own and the DSL programs')."""
        gw, s = self.gateway, self.gateway.client.stats
        in_flight = max(gw.in_flight, len(gw.client.queues))
        return int(s.get("running") or 0), int(s.get("waiting") or 0), in_flight

    def observe(self) -> None:
        now = self.clock()
        s = self.gateway.client.stats
        if s is not self._stats:
            self._stats, self._stats_at = s, now
            progress = (s.get("steps"), s.get("computed_tokens"))
            if progress != self._progress:
                self._progress, self._progress_at = progress, now
        self._progress_at = max(self._progress_at, self.gateway.last_update_at)
        if not any(self._pending()):
            self._idle_at = now

    def problem(self) -> dict[str, Any] | None:
        """None when healthy; otherwise the 503 body: {"status": ..., "reason": ..., plus the numbers}."""
        self.observe()
        now = self.clock()
        timeout = self.stall_timeout_s
        running, waiting, in_flight = self._pending()
        if timeout > 0 and (running or waiting or in_flight):
            work = {"running": running, "waiting": waiting, "in_flight": in_flight, "stall_timeout_s": timeout}
            silent = now - max(self._stats_at, self._idle_at)
            if silent > timeout:
                return {"status": "stalled", "reason": f"the engine has sent no stats for {silent:.1f}s while "
                        f"requests are pending (stall timeout {timeout:g}s)", "seconds": round(silent, 3), **work}
            stuck = now - max(self._progress_at, self._idle_at)
            if stuck > timeout:
                return {"status": "stalled", "reason": f"the engine has had work and made no progress (steps "
                        f"{self._progress[0] if self._progress else None}) for {stuck:.1f}s (stall timeout "
                        f"{timeout:g}s)", "seconds": round(stuck, 3), **work}
        s = self.gateway.client.stats
        pinned, usable = s.get("pinned_pages"), s.get("pages_usable")
        per_request = self.gateway.client.info.get("pages_per_state_set")
        if pinned is not None and usable is not None and per_request is not None:
            room = usable - (per_request + 1)  # a request needs its state set and one page of KV
            if pinned > room:
                return {"status": "pinned_full", "reason": f"pinned snapshots hold {pinned} of the {usable} usable "
                        f"cache pages; a request needs {per_request + 1}, so none can be admitted",
                        "pinned_pages": pinned, "pages_usable": usable, "pages_per_request": per_request + 1}
        return None
