"""The runner interface between the scheduler and compute."""

from __future__ import annotations

from abc import ABC, abstractmethod

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.runner.step_plan import step_chunks
from k3rt.backend.scheduler.scheduler import ScheduledChunk, SchedulerOutput


class Runner(ABC):
    @abstractmethod
    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        """Run the copies, the forward and the sampling of one step.

        Order: page copies and state copies first, then the forward (which reads/writes the
        requests' pages and live state sets in place and emits snapshot states), then the
        emitted states are written to their destination state sets. Returns {rid: sampled token}
        for every decode request and every chunk with needs_logits; for a verify chunk (draft_ids), the
        accepted run as a list (backend/spec/rejection.py), with the request's live KDA state left after
        exactly len(run) fed tokens from its start.
        """

    def release(self, rid: int) -> None:
        """The request ended (finished or aborted): drop any per-request state the runner keeps."""

    def check(self) -> None:
        """Raise if the runner can no longer run steps (a lost tensor-parallel rank); called between steps."""

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers, process groups)."""


def begin_step(pool: PagePool, out: SchedulerOutput) -> list[ScheduledChunk]:
    """Apply the step's pending page and state copies; return its work as chunks, decodes first
    (a decode is a one-token chunk at num_computed that is always sampled)."""
    if out.page_copies:
        src, dst = zip(*out.page_copies)
        pool.copy_pages(list(src), list(dst), tensors=len(pool.layout.mla_group))
    for src, dst in out.state_copies:
        pool.copy_state_set(src, dst)
    return step_chunks(out)
