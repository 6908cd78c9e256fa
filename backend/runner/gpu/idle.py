"""The GPU-idle metric: how much of the wall time between two steps' ends the device spent waiting for
the host (to schedule, pack and launch the next step).

Each step records a CUDA event where its launch begins (before its first device work) and one after its
last (sampling). On the one stream both complete in order, so for consecutive steps N and N+1:

  span  = end(N) -> end(N+1)       the device's time per step
  idle  = end(N) -> start(N+1)     > 0 only when the host had not launched N+1 by the time N finished

Overlap scheduling exists to drive idle to ~0. The events are read when the host collects the step (it
waits for the step then anyway), so timing costs no extra synchronization. Page zeroing that the scheduler
queues before the launch begins counts as idle (it is host-issued work between the steps). After the
engine went idle (no work), the next gap is not counted: waiting for requests is not host cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepEvents:
    start: torch.cuda.Event
    end: torch.cuda.Event | None = None


class IdleTimer:
    def __init__(self) -> None:
        self.idle_s = 0.0  # summed device waits for the host, between counted steps
        self.span_s = 0.0  # summed end-to-end times of counted steps
        self.steps = 0
        self._last_end: torch.cuda.Event | None = None

    def begin(self) -> StepEvents:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return StepEvents(ev)

    def end(self, t: StepEvents) -> None:
        t.end = torch.cuda.Event(enable_timing=True)
        t.end.record()

    def collected(self, t: StepEvents) -> None:
        """The step's tokens were read (its events are complete); steps are collected in launch order."""
        t.end.synchronize()
        if self._last_end is not None:
            self.idle_s += max(self._last_end.elapsed_time(t.start), 0.0) / 1e3
            self.span_s += self._last_end.elapsed_time(t.end) / 1e3
            self.steps += 1
        self._last_end = t.end

    def reset(self) -> None:
        self._last_end = None
