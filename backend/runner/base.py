"""The runner interface between the scheduler and compute."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.runner.step_plan import step_chunks
from k3rt.backend.scheduler.request import PENDING
from k3rt.backend.scheduler.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class LaunchedStep:
    """A step handed to the device (overlap scheduling): what `Runner.collect` needs to read its tokens back,
    and what the next launch needs to feed them without the host seeing them.

    `sampled` is set when the runner computed the step eagerly (no async device, or sampling that had to
    read the logits on the host); else `tokens` holds the sampled tokens on the device, one per entry of
    `rows` (rid -> index into `tokens`), read back by `collect`."""

    sampled: dict[int, int | list[int]] | None = None
    tokens: Any = None  # torch.Tensor [R] int64 on the device, or None
    rows: dict[int, int] = field(default_factory=dict)
    # the tokens' copy into pinned host memory, queued right after the step's sampling, and a CUDA event recorded
    # after it: `collect` waits for that event, not for the stream (a read of `tokens` itself would queue behind,
    # and wait for, the step launched after this one)
    host_tokens: Any = None
    ready: Any = None
    timing: Any = None  # the runner's GPU timing record of this step (backend/runner/gpu/idle.py), or None
    # a drafter pass queued after the step for the requests whose prompt it completed (backend/runner/gpu/rounds.py
    # PendingCarry), handed to the drafter when `collect` reads the step back; or None
    carry: Any = None


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

    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Start the step `out` and return without waiting for its tokens (overlap scheduling). Requests that
        continue from `prev` (the step launched before this one, not collected yet) end their token_ids with
        PENDING: the runner feeds prev's sampled token in its place. A runner that does not override this
        cannot overlap: the engine refuses overlap=True for it at start (it compares against this method), so
        reaching this body is a caller's error, refused by name."""
        raise RuntimeError(f"overlap: {type(self).__name__} has no launch/collect; run it with overlap=False")

    def collect(self, step: LaunchedStep) -> dict[int, int | list[int]]:
        """The launched step's sampled tokens ({rid: token}, as `execute` returns them); waits for the device."""
        assert step.sampled is not None
        return step.sampled

    def gpu_time(self) -> tuple[float, float] | None:
        """(seconds the device waited for the host between steps, seconds from one step's end to the next's),
        summed over the steps collected so far; None where there is no asynchronous device to time."""
        return None

    def timing_break(self) -> None:
        """The engine went idle (nothing to run): the wait until the next step is not host cost."""

    def release(self, rid: int) -> None:
        """The request ended (finished or aborted): drop any per-request state the runner keeps."""

    # Runners with tensor-parallel workers hold rank 0's plan channel as `self.sender` (backend/distributed/
    # channel.py). Not a class attribute: a wrapping runner that forwards unknown attributes to the runner it
    # wraps (tests' Recorder) must still find the inner runner's.

    def check(self) -> None:
        """Raise if the runner can no longer run steps (a lost tensor-parallel rank); called between steps."""
        sender = getattr(self, "sender", None)
        if sender is not None:
            sender.check()

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers, process groups)."""
        if getattr(self, "sender", None) is not None:
            self.sender.close()
            self.sender = None


def begin_step(pool: PagePool, out: SchedulerOutput) -> list[ScheduledChunk]:
    """Apply the step's pending page and state copies; return its work as chunks, decodes first
    (a decode is a one-token chunk at num_computed that is always sampled)."""
    if out.page_copies:
        src, dst = zip(*out.page_copies)
        pool.copy_pages(list(src), list(dst), tensors=len(pool.layout.mla_group))
    for src, dst in out.state_copies:
        pool.copy_state_set(src, dst)
    return step_chunks(out)


def pending_tokens(chunks: list[ScheduledChunk], prev: LaunchedStep | None) -> dict[int, int]:
    """{row of the step's packed tokens: rid} for each fed PENDING token (the last token of a request that
    continues from `prev`). The scheduler only ever feeds it as a request's last token."""
    rows, row = {}, 0
    for c in chunks:
        r = c.req
        row += c.num_fed
        if c.start + c.num_tokens == len(r.token_ids) and r.token_ids[-1] == PENDING:
            if prev is None:
                raise RuntimeError(f"request {r.rid}: a PENDING token with no launched step that samples it")
            rows[row - c.num_fed + c.num_tokens - 1] = r.rid
    return rows
