"""The runner interface between the scheduler and compute."""

from __future__ import annotations

from abc import ABC, abstractmethod

from k3rt.backend.scheduler.scheduler import SchedulerOutput


class Runner(ABC):
    @abstractmethod
    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        """Run the copies, the forward and the sampling of one step.

        Order: page copies and state copies first, then the forward (which reads/writes the
        requests' pages and live state sets in place and emits snapshot states), then the
        emitted states are written to their destination state sets. Returns {rid: sampled token}
        for every decode request and every chunk with needs_logits.
        """

    def release(self, rid: int) -> None:
        """The request ended (finished or aborted): drop any per-request state the runner keeps."""
