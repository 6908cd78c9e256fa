"""Overlap scheduling: the host schedules and launches step N+1 while the device still runs step N.

The protocol (one step late), per engine step:

  schedule N+1   requests that step N samples already count that token (num_computed advanced, a PENDING
                 token at the end of token_ids), so a continuing request is a plain decode of it
  launch N+1     the runner feeds step N's sampled tokens from the device (a gather by row), never the host
  advance N+1    the scheduler counts N+1's work as done (Scheduler.advance) and appends its PENDING tokens
  collect N      the only wait: step N's tokens come back (from a pinned copy queued right after step N's
                 sampling, behind an event of its own: a read of the device tokens would queue behind N+1 and
                 wait for it); Scheduler.resolve puts them in place, finishes the requests they end and the
                 engine reports them

Exactness (outputs equal overlap off, token for token, under greedy sampling):
- A request at its max_tokens with a token in flight is not scheduled again (its end is known without the
  token's value), so it ends exactly where it would without overlap.
- A request that a stop token ends is usually in step N+1 already: that step's token for it is dropped
  (`resolve` cuts token_ids back). Its live state then holds one more token (the stop token, fed by N+1),
  which is a correct state of all its tokens: the end-of-turn snapshot is published at len(token_ids)
  instead of len(token_ids) - 1. Its pages go back to the pool right away; every later use of them (zeroing
  on reuse, copies) is queued on the same device stream after N+1, so nothing races the dropped work.
- Stop strings are the gateway's (it aborts the request); an abort with a token in flight drops the token,
  and a live state that already holds it is not donated to the cache.
- Requests whose next step needs their sampled token on the host take the synchronous path: a step that
  holds any of them is collected before the next one is scheduled (`needs_sync`). These are grammars (the
  next bitmask comes from the matcher advanced by the token), speculative decoding (drafts extend the
  token), logprobs (returned with the token, written by the sampler), penalties and logit bias (the
  host-assisted sampler reads the token history), and prompt scoring. With speculative decoding, a step is
  collected at once when the next step will draft (the drafts extend its token): the speculation controller
  plans the next step right after this one is launched (`Scheduler.drafts_next`), so while it turns
  speculation off, plain decode steps overlap as they do without a drafter.

Timing: `launched` and `collected` say which steps the last call launched and read back, so the engine can tell
which step kind its wall time measured (backend/spec/cost.py `step_sample`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from k3rt.backend.runner.base import LaunchedStep, Runner
from k3rt.backend.scheduler.request import Request
from k3rt.backend.scheduler.scheduler import AdvancedStep, Scheduler, SchedulerOutput


def needs_sync(req: Request, speculative: bool) -> bool:
    """Whether the step after one that samples for `req` must wait for that token on the host."""
    p = req.params
    return (req.grammar is not None or p.logprobs is not None or bool(p.logit_bias)
            or p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
            or req.prompt_logprobs_from is not None or (speculative and p.speculative))


@dataclass
class InFlight:
    """A step launched and advanced, whose tokens the host has not read yet."""

    out: SchedulerOutput
    launched: LaunchedStep
    advanced: AdvancedStep


class OverlapLoop:
    """The engine's step with overlap: holds at most one step in flight between calls."""

    def __init__(self, scheduler: Scheduler, *, speculative: bool) -> None:
        self.scheduler, self.speculative = scheduler, speculative
        self.inflight: InFlight | None = None
        self.launched: SchedulerOutput | None = None  # the step the last call launched (None: none)
        self.collected: list[SchedulerOutput] = []  # the steps the last call read back, in order

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def step(self, runner: Runner, out: SchedulerOutput, report: Callable[[SchedulerOutput, dict, list[Request]], None],
             fail: Callable[[SchedulerOutput, Exception], None]) -> None:
        """Launch `out` (already scheduled) on `runner`, then collect the step before it. report(out, sampled,
        finished) is called for each collected step; fail(out, error) when launching `out` raised."""
        prev = self.inflight
        launched = None
        self.launched, self.collected = None, []
        if out.decodes or out.chunks:
            try:
                launched = runner.launch(out, prev.launched if prev is not None else None)
            except Exception as e:
                fail(out, e)
        self.inflight = None
        if launched is not None:
            self.inflight = InFlight(out, launched, self.scheduler.advance(out))
            self.launched = out
        if prev is not None:
            self._collect(runner, prev, report)
        cur = self.inflight
        if cur is not None and (self._sync_needed(cur.out) or self.speculative and self._drafts_next(cur.out)):
            self.inflight = None
            self._collect(runner, cur, report)

    def _collect(self, runner: Runner, step: InFlight,
                 report: Callable[[SchedulerOutput, dict, list[Request]], None]) -> None:
        sampled = runner.collect(step.launched)
        self.collected.append(step.out)
        report(step.out, sampled, self.scheduler.resolve(step.advanced, sampled))

    def _drafts_next(self, out: SchedulerOutput) -> bool:
        # a verify step's advance waits for its accepted run (Scheduler.resolve): never leave one in flight
        if any(c.draft_ids for c in out.chunks):
            return True
        return self.scheduler.drafts_next(out.decodes + [c.req for c in out.chunks if c.needs_logits])

    def _sync_needed(self, out: SchedulerOutput) -> bool:
        # speculation is asked separately (drafts_next): only the requests' own needs here
        return any(needs_sync(r, False) for r in out.decodes) or any(
            c.needs_logits and needs_sync(c.req, False) for c in out.chunks)
