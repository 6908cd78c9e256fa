"""The speculation governor: per batch bucket, whether speculation is allowed at all, decided by the tokens per
second the engine actually delivered with it allowed and with it off (A/B phases), not by a model of step costs.

Why a second layer over the per-step rule (gate.py): the rule compares modeled step costs (plain, verify,
draft), but speculation also costs what no step time shows: plain steps that give up overlap because the next
one drafts, the target-state recording a model drafter needs every step, the drafter's index upkeep, the tail
of a batch whose requests finish at different steps. On the H200 with k3-tiny at batch 16-64 (plain steps of
1.5-1.9 ms) the rule speculated in 30-50% of steps and delivered 0.5-0.8x plain decoding's tokens/s (session
14, benchmarks/spec_gate.py). The governor measures the outcome and turns speculation off where it loses.

Phases, per bucket, counted in rate samples (decode-only engine steps of that bucket):
  1. a trial with speculation allowed (the rule decides each step), `trial` samples;
  2. a trial with speculation off (plain decoding, overlap kept, no drafter calls), `trial` samples;
  3. the faster mode holds for `hold` samples, then the slower one gets another trial; a trial that loses
     again multiplies `hold` by GROWTH, by BIG_GROWTH when it lost by more than BIG_MARGIN x (up to `max_hold`: the
     losing trials then cost at most trial / max_hold of the time);
     a trial that wins takes over and `hold` starts again from `trial`.
Speculation wins by more than `margin` (the engine's controller passes 0: with speculation configured but off
the engine still pays part of its upkeep, ~10-20% at k3-tiny's 1.3-1.9 ms steps in session 14, so a margin in
favour of off gave back more than the noise it guards against: batch-4 rows fell from 0.88-1.00x to 0.67-0.86x).
A phase with speculation allowed in which no step drafted (the rule said no throughout) measured only the upkeep
of having it allowed: it loses only when plain decoding is more than IDLE_TOLERANCE faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# a trial that loses again multiplies the next hold by this: the losing side's share of the steps falls fast
# (k3-tiny's speculation at batch 64 delivered half of plain decoding's rate: every losing trial step costs)
GROWTH = 4
# ...and by this when it lost by more than BIG_MARGIN (the winner's rate over the loser's): such a trial is unlikely to
# win the next time and costs much (k3-tiny code at batch 1 on the H200, session 33: speculation 2,659 tokens/s
# against 991 plain; the governor's 85 trial steps of plain decoding took 89 of the 803 ms the speculative engine
# ran, for 85 tokens that speculation emits in ~25 ms)
BIG_GROWTH = 16
BIG_MARGIN = 2.5
# a phase with speculation allowed in which no step drafted measured only the upkeep of having it allowed: it loses
# to plain decoding only by more than this share. Off by noise, such a phase turned speculation off and with it the
# per-step rule's probes, the only way its estimates recover (k3-tiny code at batch 1 on the H200, session 22: 809
# against 823 tokens/s, then 1024-step holds off, for prompts where drafting had run at 1.7x); the upkeep that
# matters (10-20% at batch 16-64, see the module docstring) still loses
IDLE_TOLERANCE = 0.05


@dataclass(slots=True)
class _Phase:
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    drafted: int = 0  # steps that verified drafts


@dataclass(slots=True)
class _Bucket:
    on: bool = True  # the current phase's mode: speculation allowed (True) or off
    trial: bool = True  # the current phase is a trial (ends after `trial` samples) rather than a hold
    phase: _Phase = field(default_factory=_Phase)
    rate: dict[bool, float] = field(default_factory=dict)  # mode -> tokens/s of its latest finished phase
    hold: int = 0
    idle_on: bool = False  # the latest finished phase with speculation allowed drafted in no step


class Governor:
    def __init__(self, trial: int, max_hold: int, margin: float) -> None:
        if trial < 1 or max_hold < trial:
            raise ValueError(f"governor: need 1 <= trial <= max_hold, got trial {trial}, max_hold {max_hold}")
        self.trial, self.max_hold, self.margin = trial, max_hold, margin
        self._buckets: dict[int, _Bucket] = {}

    def allowed(self, b: int) -> bool:
        """Whether speculation is allowed at batch bucket b now."""
        st = self._buckets.get(b)
        return True if st is None else st.on

    def off_hold_left(self, b: int) -> int | None:
        """Samples left in bucket b's hold of speculation off (None: not in such a hold; a trial of plain decoding
        is not, so it keeps measuring plain decoding with none of speculation's upkeep)."""
        st = self._buckets.get(b)
        if st is None or st.on or st.trial:
            return None
        return st.hold - st.phase.samples

    def rates(self, b: int) -> dict[bool, float]:
        """tokens/s of the latest finished phase per mode (True: speculation allowed) at bucket b."""
        st = self._buckets.get(b)
        return {} if st is None else dict(st.rate)

    def state(self) -> dict[int, dict]:
        """Per bucket: the current mode (on: speculation allowed), whether it is a trial, the phase's samples so far,
        the hold, and each mode's latest rate in tokens/s (per request, as SpecGate hands them in; benchmarks
        report it)."""
        return {b: {"on": st.on, "trial": st.trial, "samples": st.phase.samples, "hold": st.hold,
                    "rate_on": round(st.rate[True], 1) if True in st.rate else None,
                    "rate_off": round(st.rate[False], 1) if False in st.rate else None}
                for b, st in sorted(self._buckets.items())}

    def observe(self, b: int, tokens: float, seconds: float, drafted: bool = False) -> bool:
        """One decode-only engine step at bucket b delivered `tokens` in `seconds` (wall time, the drafter's
        pass and any synchronous wait included); drafted: it verified drafts. The controller hands in tokens per
        request of the step (SpecGate.observe_rate), so rates are per request and comparable across a bucket's
        batch sizes. Returns True when this step ended a period of speculation off and speculation is allowed
        again (the controller's estimates are then as old as that period: SpecGate owes the bucket a probe)."""
        st = self._buckets.setdefault(b, _Bucket(hold=self.trial))
        ph = st.phase
        ph.tokens += tokens
        ph.seconds += seconds
        ph.samples += 1
        ph.drafted += drafted
        if ph.samples < (self.trial if st.trial else st.hold):
            return False
        was_on = st.on
        st.rate[st.on] = ph.tokens / max(ph.seconds, 1e-9)
        if st.on:
            st.idle_on = ph.drafted == 0
        st.phase = _Phase()
        if len(st.rate) < 2:  # the first trial of each mode: speculation allowed first, then off
            st.on, st.trial = not st.on, True
            return False
        if st.idle_on:  # the allowed phase never drafted: it measured upkeep, which loses only beyond the tolerance
            best = (1.0 + IDLE_TOLERANCE) * st.rate[True] > st.rate[False]
        else:
            best = st.rate[True] > (1.0 + self.margin) * st.rate[False]
        if st.trial:  # the better mode holds; a trial that lost makes the next hold longer (much longer: by far)
            far = st.rate[best] > BIG_MARGIN * st.rate[not best]
            st.hold = min((BIG_GROWTH if far else GROWTH) * st.hold, self.max_hold) if st.on != best else self.trial
            st.on, st.trial = best, False
        elif st.on == best:  # the hold confirmed its mode: the other one gets a trial
            st.on, st.trial = not best, True
        else:  # the held mode fell behind the other's last rate: switch
            st.on, st.hold = best, self.trial
        return st.on and not was_on
