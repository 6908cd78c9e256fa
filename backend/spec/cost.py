"""What a step costs, learned online from the engine's own step times: the speculation controller's cost model.

Per batch-size bucket (the next power of two at or above the step's request count), three exponential moving
averages of wall time in seconds:

  plain   a decode-only step (no verify chunk, no prefill chunk), the drafter's pass excluded;
  verify  a step of verify chunks and plain decodes (no prefill chunk), the drafter's pass excluded;
  draft   one call of the drafter (the scheduler times it around `propose`).

Mixed steps (a prefill chunk in the step) are not sampled: their time is the prefill's. The engine hands in
one sample per `Engine.step` call whose time is known to belong to one kind of step (`step_sample`): the
synchronous path's step, or with overlap scheduling a call that launched a plain step and collected the plain
step before it (the pipelined rate of plain decoding, which is what a plain step costs while overlapped). A
call that launched one kind and collected another is not sampled.

This module knows nothing of acceptance or of the decision (gate.py); it is plain arithmetic on floats.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3rt.backend.scheduler.scheduler import SchedulerOutput


class StepKind(enum.Enum):
    PLAIN = "plain"  # decodes only
    VERIFY = "verify"  # verify chunks (and decodes), no prefill
    MIXED = "mixed"  # a prefill chunk ran: not a sample of either


def classify(out: SchedulerOutput) -> tuple[StepKind, int]:
    """(kind, requests in the step) of a scheduled step."""
    verify = prefill = 0
    for c in out.chunks:
        if c.draft_ids:
            verify += 1
        else:
            prefill += 1
    kind = StepKind.MIXED if prefill else StepKind.VERIFY if verify else StepKind.PLAIN
    return kind, len(out.decodes) + verify + prefill


def ran_prefill(launched: SchedulerOutput, collected: Sequence[SchedulerOutput]) -> bool:
    """Whether an engine-step call that launched `launched` and read back `collected` involved a prefill chunk
    (its time is then the prefill's, no sample of decoding)."""
    return any(classify(o)[0] is StepKind.MIXED for o in (launched, *collected))


def step_sample(launched: SchedulerOutput | None, collected: Sequence[SchedulerOutput]
                ) -> tuple[StepKind, int] | None:
    """The step kind and batch one engine-step call's wall time measures, or None when it measures no one kind.
    launched: the step the call launched (None: nothing ran); collected: the steps whose tokens it read back."""
    if launched is None or not collected:
        return None
    kind, batch = classify(launched)
    if kind is StepKind.MIXED:
        return None
    if len(collected) == 1 and collected[0] is launched:
        return kind, batch  # synchronous: the call ran exactly this step
    if len(collected) == 1 and kind is StepKind.PLAIN:
        prev_kind, prev_batch = classify(collected[0])
        if prev_kind is StepKind.PLAIN and bucket(prev_batch) == bucket(batch):
            return kind, batch  # overlapped plain decoding: one step's pipelined time
    return None


# a step time this many times off the running estimate is an outlier (see Ema.add)
OUTLIER = 4.0
# the second sample of an estimate this many times below its first replaces it (see Ema.add)
FIRST_DROP = 2.0
# a verify sample this many times below an estimate that went unsampled for a while replaces it (StepCosts)
STALE_DROP = 1.5


def bucket(batch: int) -> int:
    """The batch-size bucket: the next power of two at or above batch (>= 1)."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass(slots=True)
class Ema:
    """An exponential moving average; `n` counts the samples (0: no estimate yet)."""

    value: float = 0.0
    n: int = 0
    at_step: int = 0  # the controller's step counter at the last sample (how stale it is)

    def add(self, x: float, weight: float, step: int, restart: bool = True, stale_after: int | None = None) -> None:
        """restart False: a sample far below the estimate is averaged in like any other (the estimate's high
        samples recur: see StepCosts.observe_draft). stale_after: an estimate not sampled for that many steps is
        replaced by a sample STALE_DROP times below it (see StepCosts.observe_step)."""
        stale = stale_after is not None and step - self.at_step >= stale_after and x < self.value / STALE_DROP
        self.at_step = step
        # the first sample of a kind at a bucket carries first-use costs (CUDA's lazy kernel loading, allocator
        # growth, host paths run for the first time): on the H200 k3-tiny's first verify round at batch 1 took
        # 4.96 ms and its first DSpark pass 44.6 ms, against 1.3-1.4 and 0.7-0.9 ms after (session 23)
        drop = FIRST_DROP if self.n == 1 else OUTLIER
        if self.n and (stale or (restart and x < self.value / drop)):
            # the estimate began on a stall (a kernel compiling, a first graph replay): start again from here
            self.value, self.n = x, 1
            return
        if self.n:
            x = min(x, OUTLIER * self.value)  # one stall (GC, a page fault storm) moves it by a bounded step
        # the first samples weigh more (1/n) until the EMA's own weight takes over: no bias toward 0
        w = max(weight, 1.0 / (self.n + 1))
        self.value += w * (x - self.value)
        self.n += 1


@dataclass
class StepCosts:
    """Seconds per step kind and batch bucket (see the module docstring)."""

    weight: float
    # decisions after which an unsampled verify estimate is stale (the controller's probe_interval)
    stale_after: int = 16
    plain: dict[int, Ema] = field(default_factory=dict)
    verify: dict[int, Ema] = field(default_factory=dict)
    draft: dict[int, Ema] = field(default_factory=dict)
    verify_drafts: dict[int, Ema] = field(default_factory=dict)  # draft tokens per verify step (trimming's unit)
    # verify rounds per verifying engine step (SpecConfig.rounds: the device runs several; `verify` is per round)
    verify_rounds: dict[int, Ema] = field(default_factory=dict)

    def observe_step(self, kind: StepKind, batch: int, seconds: float, step: int, drafted: float = 0,
                     rounds: int = 1) -> None:
        """A sampled step's wall time, the drafter's pass excluded (MIXED steps are ignored); a verify step of
        several device rounds is given per round (seconds / rounds) with its round count."""
        b = bucket(batch)
        if kind is StepKind.PLAIN:
            self.plain.setdefault(b, Ema()).add(seconds, self.weight, step)
        elif kind is StepKind.VERIFY:
            # a verify estimate that says speculation costs too much seals itself: the controller stops verifying,
            # so samples come only from probes, spaced by the very loss the estimate implies, each moving it by
            # `weight` (k3-tiny's first verify on the H200 includes warm-up work: at 3x the true cost, recovery
            # took thousands of steps). A probe far below an estimate that went unsampled therefore replaces it;
            # an estimate too low corrects itself (the controller keeps verifying and sampling)
            self.verify.setdefault(b, Ema()).add(seconds, self.weight, step, stale_after=self.stale_after)
            self.verify_drafts.setdefault(b, Ema()).add(float(drafted), self.weight, step)
            self.verify_rounds.setdefault(b, Ema()).add(float(rounds), self.weight, step, restart=False)

    def observe_draft(self, batch: int, seconds: float, step: int, stable: bool = False) -> None:
        """stable: the drafter's passes cost alike whatever they are asked (a model drafter replaying its graph), so
        a call far below the estimate restarts it as a step time does. Otherwise no restart on a cheap call after
        a dear one: a drafter's dear calls recur (the suffix drafter's first sight of each new batch's prompts:
        ~100 ms for 64 agent prompts on the H200 against ~7 ms once indexed; restarting from the cheap call priced
        the next probe, new prompts again, at a fifteenth of its cost)."""
        self.draft.setdefault(bucket(batch), Ema()).add(seconds, self.weight, step, restart=stable)

    @staticmethod
    def get(table: dict[int, Ema], batch: int) -> Ema | None:
        e = table.get(bucket(batch))
        return e if e is not None and e.n else None
