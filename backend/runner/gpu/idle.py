"""The GPU-idle metric: how much of the wall time between two steps' ends the device spent waiting for
the host (to schedule, pack and launch the next step).

Each step records a CUDA event where its device work begins (`started`: right before the copy of its packed
step buffers, once the host has scheduled and packed it) and one after its last (sampling). On the one stream
both complete in order, so for consecutive steps N and N+1:

  span  = end(N) -> end(N+1)       the device's time per step
  idle  = end(N) -> start(N+1)     > 0 only when the host had not launched N+1 by the time N finished

Overlap scheduling exists to drive idle to ~0. The events are read when the host collects the step (it
waits for the step then anyway), so timing costs no extra synchronization. Page zeroing and copies queued
before the step's buffers count as idle (host-issued work between the steps, microseconds). After the engine
went idle (no work), the next gap is not counted: waiting for requests is not host cost.

Not counted: the device's waits inside a step whose host issues it eagerly (a piecewise step's eager attention
cores between its graph replays): only a profiler sees those.

The start was once recorded where `launch` begins, before packing: the host's packing (and, synchronously,
everything from the read-back to the launch) then counted as device time. The served 48B shape without
overlap reported 2.5-4.5% idle while its steps took 23.8 ms against 18.4 ms with overlap (session 27).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepEvents:
    start: torch.cuda.Event
    end: torch.cuda.Event | None = None
    recorded: bool = False  # start is on the stream


class IdleTimer:
    def __init__(self) -> None:
        self.idle_s = 0.0  # summed device waits for the host, between counted steps
        self.span_s = 0.0  # summed end-to-end times of counted steps
        self.steps = 0
        self._last_end: torch.cuda.Event | None = None

    def begin(self) -> StepEvents:
        """A step's events, nothing recorded yet (`started` marks where its device work begins)."""
        return StepEvents(torch.cuda.Event(enable_timing=True))

    def started(self, t: StepEvents | None) -> None:
        """The step's device work is queued next: its start event goes on the stream now (the first call counts)."""
        if t is not None and not t.recorded:
            t.start.record()
            t.recorded = True

    def end(self, t: StepEvents) -> None:
        self.started(t)  # a step whose work never marked its start: it started where it ends
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
