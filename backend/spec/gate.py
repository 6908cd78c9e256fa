"""The cost-aware speculation controller: per step, draft only when drafting + verifying is expected to emit
tokens faster than plain decoding, trimming each request's drafts to the ones worth their verify cost.

The rule, for a step of `batch` decode-like requests (plain decoding emits one token per request per step):

    speculate  iff  (batch + sum_r gain_r) / (draft + P * verify + (1 - P) * plain)  >  (1 + margin) * batch / plain

plain, verify, draft: seconds of a plain step, a verify step and the drafter's pass at this batch bucket
(cost.py, learned from the engine's step times); gain_r: the draft tokens request r is expected to get accepted;
P: the probability that some request gets drafts to verify (a model-free drafter often has none to offer).

Two estimates of gain, before and after the drafter's pass:
- before (`plan`, deciding whether to call the drafter at all): the request's *yield*, an EMA of the drafts
  accepted per drafting step (0 when the drafter had nothing for it or `trim` kept none of its drafts),
  blended with the method's yield as a prior worth `prior_verifies` steps, so a new request starts at the
  method's running rate;
- after (`trim`, the drafts in hand): per draft j the probability that drafts 1..j are all accepted: the
  drafter's own estimates where it gives them (DSpark's confidence head: the cumulative product, scaled by how
  the method's predictions have compared with what was accepted), else alpha^j, alpha the request's
  conditional acceptance rate (accepted / (accepted + rejections) over its verifies, EMA'd and blended with
  the method's like the yield). A draft is kept while its probability times a token's worth (plain / batch
  seconds) covers its share of the verify's extra cost (verify - plain per draft token); the drafter's pass
  is already paid, so the step then speculates iff (batch + gain) / verify beats the plain rate.

A model-free drafter whose pass costs at most CHEAP_PASS of a plain step (suffix and n-gram lookups next to a
GPU step) is asked every step instead, and `trim` alone decides from what it proposed: a suffix match into a
repeated tool output is worth verifying at once, whatever the running averages say.

Hopeless buckets: when even a typical verify's drafts all accepted (the verify_drafts estimate) would emit
tokens no faster than plain decoding, `plan` says no without reading acceptance, and probes keep the spacing
their loss allows, never shortened for new requests (below).

Exploration: with no plain sample at this bucket the step decodes plainly (one sample is enough to start);
with no verify or draft sample, or fewer than `explore_samples` request outcomes of drafting steps for the
method, it speculates; and a "no" that rests on the first sample of the verify or the pass explores too (a first
sample carries first-use costs; a second one at most half of it replaces it, cost.py). While the rule says no, a
step now and then drafts anyway (a probe, drafts untrimmed)
so the estimates follow changing acceptance and cost. A probe loses its step's time beyond the plain steps its
tokens are worth, so probes come at least `probe_interval` steps apart and far enough apart that this loss
stays within `probe_overhead` of plain decoding's time (at a batch where a verify costs several plain steps,
one in a hundred steps or so): each bucket holds a credit of probe_overhead plain steps' time per step, which
a probe spends. A step whose requests were never measured may probe sooner, in proportion to their share (only
drafting can tell whether an agent's new turn repeats what the last one wrote), running the credit into a debt
that is paid before the next probe: new requests bring a probe forward, they never make probes more frequent
than the budget. A probe whose drafter pass cost more than the estimate its loss assumed (a suffix drafter's
first sight of new prompts) adds the difference to the debt (observe_draft). While the rule says yes, a plain step
is forced when the bucket's plain cost is older than 4 x probe_interval.

Over the rule sits the governor (governor.py): per batch bucket it allows speculation or turns it off by the
tokens per second the engine delivered in each mode, in alternating trials; while it says off, `plan` says so
(Why.OFF) before any estimate is read, and no probe runs. When it allows speculation again, the bucket's next step
that the rule would not draft probes (the estimates are as old as the period off).

The controller knows nothing of pages, grammars or sampling: the scheduler asks it, then bounds drafts as
before. Its only clock is its own decision counter (`steps`); times come in as seconds.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from k3rt.backend.spec.cost import StepCosts, StepKind, bucket
from k3rt.backend.spec.governor import Governor
from k3rt.config import SpecGateConfig

# a drafter pass costing at most this share of a plain step is asked every step (its proposals decide)
CHEAP_PASS = 0.05
# probability that a draft is accepted before any verify has been seen (the prior's prior)
_ALPHA0 = 0.5
# estimates are scaled by (accepted + _CALIB_PRIOR) / (predicted + _CALIB_PRIOR), kept within _CALIB: one
# verify that accepted nothing must not condemn a drafter whose estimates then never get verified again
_CALIB = (0.25, 2.0)
_CALIB_PRIOR = 2.0


class Why(enum.Enum):
    """Why a step speculates or not (the scheduler counts them)."""

    PAYS = "pays"  # the estimates say drafting pays
    NOT_WORTH = "not_worth"  # they say it does not
    EXPLORE = "explore"  # a cost or acceptance estimate is missing: measure it
    PROBE = "probe"  # off, but drafting this step to refresh the estimates
    REFRESH = "refresh"  # on, but decoding plainly this step to refresh the plain cost
    CHEAP = "cheap"  # a model-free drafter's pass costs next to nothing: ask it, and let its drafts decide (trim)
    OFF = "off"  # the governor measured plain decoding faster at this batch bucket (governor.py)


class Plan(NamedTuple):
    draft: bool
    why: Why


class Trim(NamedTuple):
    keep: list[int]  # drafts to verify per request (all zeros: the step decodes plainly)
    probe: bool  # every draft kept to refresh the estimates, not because they pay


@dataclass(slots=True)
class _Acceptance:
    """Decayed acceptance counts of one request or one method."""

    accepted: float = 0.0  # accepted drafts
    trials: float = 0.0  # accepted drafts + rejections (a verify that accepted all of its drafts adds none)
    gained: float = 0.0  # accepted drafts over drafting steps (0 for a step the drafter proposed nothing)
    verified: float = 0.0  # drafting steps in which it verified drafts (the others cost no verify)
    steps: float = 0.0  # drafting steps
    seen: int = 0  # outcomes observed, undecayed (exploration lasts until the method has explore_samples)
    predicted: float = 0.0  # accepted drafts the drafter's own estimates predicted (DSpark)
    actual: float = 0.0  # accepted drafts of the verifies that had estimates

    def decay(self, keep: float) -> None:
        self.accepted *= keep
        self.trials *= keep
        self.gained *= keep
        self.verified *= keep
        self.steps *= keep


@dataclass(slots=True)
class _ProbeClock:
    """Per batch bucket, when one kind of drafting step last happened and the step at which the bucket's probe
    credit is zero: credit accrues probe_overhead plain steps' time per step after it; a probe spends its loss, and a
    probe the step's new requests brought forward leaves the bucket in debt (that step lies ahead), so the next
    probe waits until the debt is paid."""

    last: dict[int, int] = field(default_factory=dict)
    credit_at: dict[int, float] = field(default_factory=dict)


class SpecGate:
    def __init__(self, cfg: SpecGateConfig, fixed_verify_upto: int = 0, stable_pass: bool = False) -> None:
        """fixed_verify_upto: at batches up to this the runner replays verify steps from CUDA graphs that run
        K + 1 rows for every request whatever it drafted (verify_graph.py), so a draft costs nothing more to verify
        and `trim` keeps them all; above it (eager verify steps) a draft costs its share (0: no graphs).
        stable_pass: the drafter's pass costs alike whatever it is asked (a model drafter: StepCosts.observe_draft)."""
        self.cfg = cfg
        self.fixed_verify_upto = fixed_verify_upto
        self.stable_pass = stable_pass
        self.costs = StepCosts(cfg.ema_weight, cfg.probe_interval)
        self.steps = 0  # decisions made (the controller's clock)
        self._method = _Acceptance()
        self._reqs: dict[int, _Acceptance] = {}
        self._spec_probes = _ProbeClock()  # speculating decisions (`plan`) and their probes
        self._verify_probes = _ProbeClock()  # trims that kept drafts and `trim`'s verify probes (Why.CHEAP steps)
        self.governor = (Governor(cfg.governor_trial, cfg.governor_max_hold, 0.0)
                         if cfg.governor_trial else None)
        # buckets where the governor allowed speculation again after a period off: their next step that the rule
        # would not draft probes instead (see _owed_probe)
        self._owed: set[int] = set()
        self._probe_pass: tuple[int, float] | None = None  # the last probe's bucket and assumed pass (observe_draft)

    # ---- estimates ----

    def _method_alpha(self) -> float:
        m = self._method
        return m.accepted / m.trials if m.trials > 0 else (1.0 if m.accepted > 0 else _ALPHA0)

    def alpha(self, rid: int) -> float:
        """P(a draft is accepted | the drafts before it were), for request rid."""
        r, prior = self._reqs.get(rid), self.cfg.prior_verifies
        g = self._method_alpha()
        if r is None or r.trials + prior <= 0:
            return g
        # the method's rate counts as prior_verifies trials of the request's own
        return (r.accepted + prior * g) / (r.trials + prior)

    def yield_(self, rid: int) -> float | None:
        """Expected accepted drafts for rid in a step that drafts (None: too little measured yet)."""
        m = self._method
        if m.seen < self.cfg.explore_samples:
            return None
        g = m.gained / m.steps
        r = self._reqs.get(rid)
        if r is None:
            return g
        prior = self.cfg.prior_verifies
        return (r.gained + prior * g) / (r.steps + prior)

    def verifies(self, rid: int) -> float:
        """P(rid verifies drafts in a step that drafts): suffix and n-gram drafters often have nothing to offer."""
        m = self._method
        g = m.verified / m.steps if m.steps > 0 else 1.0
        r = self._reqs.get(rid)
        if r is None:
            return g
        prior = self.cfg.prior_verifies
        return (r.verified + prior * g) / (r.steps + prior)

    def calibration(self) -> float:
        m = self._method
        return min(max((m.actual + _CALIB_PRIOR) / (m.predicted + _CALIB_PRIOR), _CALIB[0]), _CALIB[1])

    def survival(self, rid: int, num_drafts: int, estimates: Sequence[float] | None) -> list[float]:
        """P(drafts 1..j all accepted) for j = 1..num_drafts."""
        out: list[float] = []
        p = 1.0
        if estimates is not None:
            c = self.calibration()
            for j in range(num_drafts):
                p *= float(estimates[j]) if j < len(estimates) else 0.0
                out.append(min(p * c, 1.0))
            return out
        a = self.alpha(rid)
        for _ in range(num_drafts):
            p *= a
            out.append(p)
        return out

    # ---- decisions ----

    def resumes_within(self, batch: int, steps: int) -> bool:
        """Whether the governor's hold of speculation off at this batch's bucket ends within `steps` decode steps
        (a model drafter's target states must be recorded again before then, see Scheduler._plan)."""
        left = self.governor.off_hold_left(bucket(batch)) if self.governor is not None else None
        return left is not None and left <= steps

    def off(self, batch: int) -> bool:
        """Whether the governor has speculation off at this batch's bucket (plan() would say Why.OFF)."""
        return self.governor is not None and not self.governor.allowed(bucket(batch))

    def plan(self, batch: int, rids: Sequence[int], *, model_free: bool = False) -> Plan:
        """Before the drafter's pass: draft this step? batch: the step's decode-like requests; rids: those the
        drafter would be asked for; model_free: the drafter reads tokens only (so it can also be asked about the
        tokens known before a step in flight, see Scheduler.drafts_next)."""
        self.steps += 1
        c, b = self.costs, bucket(batch)
        if self.off(batch):
            return Plan(False, Why.OFF)
        plain, verify = c.get(c.plain, batch), c.get(c.verify, batch)
        draft = c.get(c.draft, len(rids))
        if plain is None:
            return Plan(False, Why.EXPLORE)
        if verify is None or draft is None:
            return self._spec(b, Why.EXPLORE)
        if model_free and draft.value <= CHEAP_PASS * plain.value:
            # the pass is nearly free and its proposals (their length, the trie's probabilities) say more about
            # this step than any running average: trim() decides
            if self.steps - plain.at_step > 4 * self.cfg.probe_interval:
                return Plan(False, Why.REFRESH)
            return self._spec(b, Why.CHEAP)
        # the scheduler's drafter pass runs once per engine step; a step of several device rounds (SpecConfig.rounds)
        # drafts its further rounds inside the rounds' own time (`verify` is per round): per round it costs a share
        rounds = c.get(c.verify_rounds, batch)
        draft_s = draft.value / max(rounds.value if rounds is not None else 1.0, 1.0)
        drafted = c.get(c.verify_drafts, batch)
        # a "no" that rests on the first sample of the verify or of the pass is not trusted: draft again to take a
        # second (which replaces a first far above it, cost.py FIRST_DROP). A first sample carries first-use costs;
        # taken as the estimate, k3-tiny's DSpark drafter at batch 1 on the H200 looked hopeless (a 44.6 ms first
        # pass, a 4.96 ms first verify round), so it was probed only as far apart as that loss allowed and spent
        # the gate's first two code rounds off (0.90-1.11x where the later rounds ran 1.92x, session 23)
        unsure = verify.n < 2 or draft.n < 2
        if drafted is not None:
            ceiling_s = draft_s + verify.value
            if (batch + drafted.value) * plain.value <= batch * ceiling_s:
                # hopeless at this bucket: with every draft of a typical verify accepted, a drafting step would
                # still emit tokens no faster than plain decoding (k3-tiny at batch 64 on the H200: a verify of
                # ~16 ms against 1.6 ms plain steps). Acceptance cannot change that, so no exploration, and probes
                # (which refresh the costs) only as far apart as their loss allows, however new the requests
                if unsure:
                    return self._spec(b, Why.EXPLORE)
                loss = ceiling_s / plain.value - (batch + drafted.value) / batch
                if self._owed_probe(b, loss) or self._probe_due(self._spec_probes, b, loss, ()):
                    return self._spec(b, Why.PROBE, loss, draft.value)
                return Plan(False, Why.NOT_WORTH)
        gains = [self.yield_(r) for r in rids]
        if any(g is None for g in gains):
            return self._spec(b, Why.EXPLORE)
        # a drafting step verifies unless no request gets drafts (then it is a plain step plus the pass)
        none = math.prod(1.0 - self.verifies(r) for r in rids)
        spec_s, plain_s = draft_s + (1.0 - none) * verify.value + none * plain.value, max(plain.value, 1e-9)
        tokens = batch + sum(gains)
        if tokens / max(spec_s, 1e-9) > (1.0 + self.cfg.margin) * batch / plain_s:
            if self.steps - plain.at_step > 4 * self.cfg.probe_interval:
                return Plan(False, Why.REFRESH)
            return self._spec(b, Why.PAYS)
        # a probe costs what its step takes beyond the plain steps its tokens are worth; spaced so that this
        # stays within probe_overhead of plain decoding's time, and sooner the more of the step's requests have
        # never been measured (a new turn of an agent may repeat what the last one wrote: only drafting tells)
        if unsure:
            return self._spec(b, Why.EXPLORE)
        loss = spec_s / plain_s - tokens / batch
        if self._owed_probe(b, loss) or self._probe_due(self._spec_probes, b, loss, rids):
            return self._spec(b, Why.PROBE, loss, draft.value)
        return Plan(False, Why.NOT_WORTH)

    def _owed_probe(self, b: int, loss: float) -> bool:
        """Whether bucket b is owed a probe that loses `loss` plain steps' time (and settle the debt): the governor
        allowed speculation again after a period off, during which nothing refreshed the estimates. Without it the
        rule judged the governor's trial by estimates as old as that period, and when they said no, the trial
        measured plain steps against plain steps, lost by noise and turned speculation off for ever longer holds:
        k3-tiny's code at batch 1 on the H200 spent 968 of 989 steps off after its first three verifies, priced at
        2.3x a plain step by rounds the device replayed after the request had ended (session 22). Not a probe
        dearer than the trial itself (governor_trial plain steps: a suffix drafter's first sight of 64 agent
        prompts cost ~100 ms, 50 plain steps, on the H200): those keep the budgeted spacing."""
        if b not in self._owed:
            return False
        self._owed.discard(b)
        return loss <= self.cfg.governor_trial

    def void_probe(self, batch: int) -> None:
        """A probe (Why.PROBE) found no request to draft for: a model drafter's requests had no recorded target
        states yet (the plan is made a step ahead, when the governor's return has only just resumed recording).
        The bucket is owed the probe again: its next step that the rule would not draft probes (_owed_probe).
        Without this the probe owed to the governor's return was spent on a step with nothing to draft, and
        k3-tiny's DSpark drafter at batch 1 on the H200 still never verified after the first three (session 22)."""
        self._owed.add(bucket(batch))
        self._probe_pass = None  # no pass ran for it

    def _fresh(self, rids: Sequence[int]) -> float:
        """The share of rids never measured."""
        return sum(r not in self._reqs for r in rids) / max(len(rids), 1)

    def _credit(self, clock: _ProbeClock, b: int) -> float:
        """Bucket b's probe credit now, in plain steps' time (negative: a debt)."""
        return (self.steps - clock.credit_at.get(b, 0.0)) * self.cfg.probe_overhead

    def _probe_due(self, clock: _ProbeClock, b: int, loss: float, rids: Sequence[int]) -> bool:
        """Whether a probe that loses `loss` plain steps' time is due at bucket b: probe_interval steps after the
        last drafting step at least, and the bucket's credit covering the loss, or the share of it the step's
        never-measured requests leave (they bring a probe forward; the debt it leaves is paid before the next).
        Without the debt a burst of new requests (each wave of a benchmark, 64 at a time) probed at once every
        time, whatever a probe cost: at batch 64 on the H200 one probe per 64-token wave (a suffix drafter's pass
        over 64 new prompts plus a verify: an estimated ~10% of the wave's time) where the gate's suffix and n-gram
        rows ran at 0.85-0.91x of plain decoding with 1-2% of their steps drafting."""
        if self.steps - clock.last.get(b, 0) < self.cfg.probe_interval:
            return False
        return self._credit(clock, b) >= max(loss, 0.0) * (1.0 - self._fresh(rids))

    def _spend(self, clock: _ProbeClock, b: int, loss: float) -> None:
        """A drafting (verifying) step at bucket b: a probe spends `loss` of the credit; any such step drops the
        credit saved beyond zero (probes are spaced from the last one, as without credit), a debt stays."""
        credit = min(self._credit(clock, b) - max(loss, 0.0), 0.0)
        clock.credit_at[b] = self.steps - credit / self.cfg.probe_overhead
        clock.last[b] = self.steps

    def _spec(self, b: int, why: Why, loss: float = 0.0, draft_s: float | None = None) -> Plan:
        """A drafting plan at bucket b; a probe (draft_s: the drafter-pass estimate its loss assumed) spends its loss
        now, and observe_draft charges what the pass cost beyond that estimate."""
        self._spend(self._spec_probes, b, loss)
        self._probe_pass = (b, draft_s) if draft_s is not None else None
        return Plan(True, why)

    def trim(self, batch: int, drafts: Sequence[tuple[int, int, Sequence[float] | None]], why: Why, *,
             record: bool = True) -> Trim:
        """After the drafter's pass: how many of each request's drafts to verify. drafts: (rid, drafts proposed,
        the drafter's per-draft acceptance estimates or None) per request; why: the plan's. Probes and
        explorations keep every draft (they measure what the drafter offers); so does a step asked every step
        (Why.CHEAP) whose bucket has not verified for as long as a probe's spacing. record False: a look ahead
        (Scheduler.drafts_next), not the step itself."""
        full = [n for _, n, _ in drafts]
        c, b = self.costs, bucket(batch)
        plain, verify = c.get(c.plain, batch), c.get(c.verify, batch)
        if why in (Why.PROBE, Why.EXPLORE) or plain is None or verify is None:
            return Trim(full, why is Why.PROBE)
        per_draft = c.get(c.verify_drafts, batch)
        # seconds one more draft token adds to the verify (linear in the step's draft tokens in an eager step,
        # nothing in a graph of fixed shape), and what an accepted token is worth (the time plain decoding takes
        # per token at this batch)
        cost = (0.0 if batch <= self.fixed_verify_upto else
                max(verify.value - plain.value, 0.0) / max(per_draft.value if per_draft else 1.0, 1.0))
        worth = plain.value / batch
        keep, gain = [], 0.0
        for rid, n, est in drafts:
            k = 0
            for p in self.survival(rid, n, est):
                if p * worth < cost * (1.0 + self.cfg.margin):
                    break
                k += 1
                gain += p
            keep.append(k)
        if (batch + gain) / max(verify.value, 1e-9) <= (1.0 + self.cfg.margin) * batch / max(plain.value, 1e-9):
            if why is Why.CHEAP and drafts:
                loss = verify.value / plain.value - 1.0 - gain / batch
                if ((record and self._owed_probe(b, loss))
                        or self._probe_due(self._verify_probes, b, loss, [r for r, _, _ in drafts])):
                    if record:
                        self._spend(self._verify_probes, b, loss)
                    return Trim(full, True)
            return Trim([0] * len(drafts), False)
        if record:
            self._spend(self._verify_probes, b, 0.0)
        return Trim(keep, False)

    # ---- observations ----

    def observe_step(self, kind: StepKind, batch: int, seconds: float, drafted: float = 0, rounds: int = 1) -> None:
        """A step's wall time (the drafter's pass excluded; per round for a step of several device rounds), its
        draft tokens and its rounds (verify steps)."""
        self.costs.observe_step(kind, batch, seconds, self.steps, drafted, rounds)

    def observe_rate(self, batch: int, tokens: int, seconds: float, drafted: bool = False) -> None:
        """A decode-only engine step of `batch` requests delivered `tokens` in `seconds` (the governor's input);
        drafted: it verified drafts (a phase of speculation allowed without any measured only its upkeep, see
        governor.IDLE_TOLERANCE). The governor compares tokens per request-second: a bucket spans batches up to 2x
        apart (9-16 requests in bucket 16), and as a batch's requests finish its trials run at fewer of them, so
        raw tokens/s favoured whichever mode had its trial first (k3-tiny code at batch 16 on the H200: speculation
        measured 10.3K tokens/s against plain's 6.7K and stayed on, delivering 0.82x plain decoding end to end)."""
        if self.governor is not None and self.governor.observe(bucket(batch), tokens / max(batch, 1), seconds,
                                                               drafted):
            self._owed.add(bucket(batch))

    def observe_draft(self, batch: int, seconds: float) -> None:
        """One drafter pass over `batch` requests took `seconds`. The pass of a probe that cost more than its loss
        assumed leaves the difference as probe debt: a suffix drafter's pass is dear on its first sight of new
        prompts (a wave of 64 agent prompts: ~200 ms on the H200's host against a 2.3 ms plain step) and cheap
        after, so its running estimate priced the probes that new requests bring forward at a fraction of their
        cost, and they came several times a row (agent batch 64: 4 passes, 795 ms, 18% of the row; session 22)."""
        self.costs.observe_draft(batch, seconds, self.steps, self.stable_pass)
        if self._probe_pass is None:
            return
        (b, assumed), self._probe_pass = self._probe_pass, None
        plain = self.costs.plain.get(b)
        if plain is not None and plain.n and seconds > assumed:
            extra = (seconds - assumed) / plain.value  # plain steps' time beyond the loss already spent
            clock = self._spec_probes
            clock.credit_at[b] = clock.credit_at.get(b, 0.0) + extra / self.cfg.probe_overhead

    def observe(self, rid: int, drafted: int, accepted: int, estimated: float | None = None) -> None:
        """Request rid was asked for drafts in a drafting step: `drafted` were verified (0: the drafter had none)
        and `accepted` of them accepted; estimated: the accepted count the drafter's estimates predicted."""
        keep = 1.0 - self.cfg.ema_weight
        r = self._reqs.get(rid)
        if r is None:
            r = self._reqs[rid] = _Acceptance()
        for a in (r, self._method):
            a.decay(keep)
            a.seen += 1
            a.steps += 1.0
            a.gained += accepted
            if drafted:
                a.verified += 1.0
                a.accepted += accepted
                a.trials += accepted + (1.0 if accepted < drafted else 0.0)
        if estimated is not None and drafted:
            m = self._method
            m.predicted = keep * m.predicted + estimated
            m.actual = keep * m.actual + accepted

    def finish(self, rid: int) -> None:
        self._reqs.pop(rid, None)

    def state(self) -> dict:
        """What the controller believes now, for benchmarks: per batch bucket its cost estimates in ms (plain, verify
        per round, drafter pass) with their sample counts, draft tokens and rounds per verify step; the method's
        acceptance (alpha, the accepted drafts per drafting step, outcomes seen); the governor's state."""
        c, m = self.costs, self._method
        tables = {"plain_ms": c.plain, "verify_ms": c.verify, "draft_ms": c.draft,
                  "drafts_per_verify": c.verify_drafts, "rounds_per_verify": c.verify_rounds}
        costs: dict[int, dict] = {}
        for name, table in tables.items():
            scale = 1e3 if name.endswith("_ms") else 1.0
            for b, e in table.items():
                costs.setdefault(b, {})[name] = [round(e.value * scale, 4), e.n]
        return {"costs": dict(sorted(costs.items())),
                "method": {"alpha": round(self._method_alpha(), 4),
                           "yield": round(m.gained / m.steps, 4) if m.steps else None, "seen": m.seen},
                "governor": self.governor.state() if self.governor is not None else {}}
