"""The speculation controller (backend/spec/gate.py, cost.py) with injected step costs: it turns speculation off
when a verify's cost at the plain rate exceeds the tokens it is expected to emit, back on when a probe shows
acceptance improved, trims drafts by the drafter's estimates, and in the engine a step whose drafting it skips
is exactly a plain step (with and without overlap scheduling). Deterministic: no wall time is read."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from k3rt.backend.scheduler.scheduler import ScheduledChunk, SchedulerOutput
from k3rt.backend.spec.cost import Ema, StepCosts, StepKind, bucket, step_sample
from k3rt.backend.spec.gate import Plan, SpecGate, Trim, Why
from k3rt.config import SpecConfig, SpecGateConfig
from tests.backend.engine_fixtures import NullOracle, assert_at_rest, greedy, make_engine, run, tiny_checkpoint


def _costs(g: SpecGate, batch: int, plain: float, verify: float, draft: float, drafted: int = 7) -> None:
    """Two samples of each (the controller does not say no on a first sample alone)."""
    for _ in range(2):
        g.observe_step(StepKind.PLAIN, batch, plain)
        g.observe_step(StepKind.VERIFY, batch, verify, drafted)
        g.observe_draft(batch, draft)


def test_off_when_a_verify_costs_more_than_it_emits_on_after_a_probe_shows_acceptance() -> None:
    # probe_overhead 1: probes as often as probe_interval allows (their loss here is under a plain step)
    g = SpecGate(SpecGateConfig(margin=0.05, probe_interval=4, probe_overhead=1.0, ema_weight=0.5,
                                explore_samples=2))
    assert g.plan(1, [0]) == Plan(False, Why.EXPLORE)  # no plain step measured at this batch yet
    g.observe_step(StepKind.PLAIN, 1, 1.0)
    assert g.plan(1, [0]) == Plan(True, Why.EXPLORE)  # nor a verify step: draft to measure one (step 2)
    # the H200's k3-tiny batch-1 ratios: a verify of 1 + 7 costs 1.84 plain steps, the drafter's pass 0.92
    g.observe_draft(1, 0.92)
    g.observe_step(StepKind.VERIFY, 1, 1.84, 7)
    g.observe(0, 7, 1)  # one draft accepted: 2 tokens in 2.76 plain steps' time
    assert g.yield_(0) is None and g.plan(1, [0]) == Plan(True, Why.EXPLORE)  # one outcome is not enough (step 3)
    g.observe(0, 7, 1)  # and again
    assert g.yield_(0) == pytest.approx(1.0)
    # a "no" on the first sample of the verify and the pass is not trusted: one more drafting step (step 4)
    assert g.plan(1, [0]) == Plan(True, Why.EXPLORE)
    g.observe_draft(1, 0.92)
    g.observe_step(StepKind.VERIFY, 1, 1.84, 7)
    g.observe(0, 7, 1)
    assert g.yield_(0) == pytest.approx(1.0)
    assert [g.plan(1, [0]) for _ in range(3)] == [Plan(False, Why.NOT_WORTH)] * 3  # steps 5..7
    assert g.plan(1, [0]) == Plan(True, Why.PROBE)  # step 8: probe_interval steps since the last drafting one
    g.observe(0, 7, 7)  # the probe: every draft accepted (the request reached a repetitive stretch)
    # yield: (0.5 * 1.75 + 7) / (0.5 * 1.75 + 1) = 4.2 for the method and the request: 5.2 tokens per 2.76
    assert g.yield_(0) == pytest.approx(7.875 / 1.875)
    assert g.plan(1, [0]) == Plan(True, Why.PAYS)
    # a new request starts at the method's rate
    assert g.plan(1, [9]) == Plan(True, Why.PAYS)
    # while on, the plain cost is refreshed once it is older than 4 x probe_interval steps
    while (p := g.plan(1, [0])) == Plan(True, Why.PAYS):
        pass
    assert p == Plan(False, Why.REFRESH) and g.steps - g.costs.plain[1].at_step == 4 * 4 + 1
    g.observe_step(StepKind.PLAIN, 1, 1.0)
    assert g.plan(1, [0]) == Plan(True, Why.PAYS)


def test_the_same_acceptance_does_not_pay_at_a_batch_whose_verify_costs_several_plain_steps() -> None:
    g = SpecGate(SpecGateConfig(probe_interval=16, probe_overhead=0.02, explore_samples=64))
    _costs(g, 1, plain=1.0, verify=1.5, draft=0.2)
    # 64 x 8 tokens route to many more experts than 64 x 1
    _costs(g, 64, plain=1.0, verify=4.0, draft=0.3, drafted=64 * 7)
    for rid in range(64):
        g.observe(rid, 7, 2)  # 2 of 7 accepted per verify: 3 tokens per request per verify step
    assert g.plan(1, [0]) == Plan(True, Why.PAYS)  # 3 tokens in 1.7 plain steps
    assert g.plan(64, list(range(64))) == Plan(False, Why.NOT_WORTH)  # 192 tokens in 4.3: 44.7 < 64 per step
    assert g.plan(48, list(range(48))) == Plan(False, Why.NOT_WORTH)  # the same bucket (64)
    assert bucket(48) == bucket(64) == 64 and bucket(1) == 1 and bucket(3) == 4
    # a probe at 64 loses 4.3 - 192 / 64 = 1.3 plain steps: at most 2% of the time means one in 65 steps
    while (p := g.plan(64, list(range(64)))) == Plan(False, Why.NOT_WORTH):
        pass
    assert p == Plan(True, Why.PROBE) and g.steps == 65
    assert g.plan(64, list(range(64))) == Plan(False, Why.NOT_WORTH)
    # a batch of requests never measured (new ones) is probed after probe_interval steps, not 65
    while (p := g.plan(64, list(range(100, 164)))) == Plan(False, Why.NOT_WORTH):
        pass
    assert p == Plan(True, Why.PROBE) and g.steps == 65 + 16


def test_new_requests_bring_a_probe_forward_once_and_its_debt_is_paid_before_the_next() -> None:
    """Regression (session 21): every batch of new requests was probed probe_interval steps after the last probe,
    however much a probe cost, so a benchmark whose waves of 64 new requests last ~65 steps probed every wave: on
    the H200 the suffix and n-gram rows at batch 64 drafted in 1-2% of the steps and ran at 0.85-0.91x of plain
    decoding (a probe there, the drafter's pass over 64 new prompts and a verify, is an estimated ~10% of a
    wave; not measured on its own). New requests
    still bring a probe forward, once: the credit it overdraws (probe_overhead of plain decoding's time per step)
    is paid back before the next, so over many waves probes cost probe_overhead of the time."""
    g = SpecGate(SpecGateConfig(probe_interval=16, probe_overhead=0.02, explore_samples=64))
    # a full acceptance would pay ((64 + 448) tokens in 7.3 plain steps' time), the measured one does not
    _costs(g, 64, plain=1.0, verify=7.0, draft=0.3, drafted=64 * 7)
    for rid in range(64):
        g.observe(rid, 7, 2)  # 3 tokens per request: a probe loses 7.3 - 192 / 64 = 4.3 plain steps
    waves = (list(range(r, r + 64)) for r in range(1000, 10 ** 6, 64))
    probes, wave = [], next(waves)
    while g.steps < 1300:
        if g.steps % 65 == 0:
            wave = next(waves)  # 64 new requests every 65 steps (64 tokens each and a prefill)
        plan = g.plan(64, wave)
        assert plan in (Plan(True, Why.PROBE), Plan(False, Why.NOT_WORTH))
        if plan.draft:
            probes.append(g.steps)
            for rid in wave:
                g.observe(rid, 7, 2)
    # the first wave's new requests bring a probe forward to probe_interval steps; it leaves a debt of 4.3 - 0.32
    # plain steps, paid 199 steps later: from then on one probe per 4.3 / 0.02 = 215 steps, not one per wave
    # (20 probes, 4.3 x 20 / 1300 = 6.6% of the time, before)
    assert probes == [16, 215, 430, 645, 860, 1075, 1290]


def test_a_probes_pass_dearer_than_assumed_leaves_its_cost_as_debt() -> None:
    """Regression (session 22's H200 gate, suffix drafter, agent at batch 64): the drafter's pass is dear on its
    first sight of a wave's prompts (~200 ms) and cheap after (its running estimate ~50 ms), so each probe that new
    requests brought forward was priced, and its debt set, at a fraction of its cost: 4 such passes took 795 ms,
    18% of the row. What a probe's pass cost beyond the estimate its loss assumed is now debt too."""
    def probes(actual_pass: float) -> list[int]:
        g = SpecGate(SpecGateConfig(probe_interval=16, probe_overhead=0.02, explore_samples=64, governor_trial=0))
        _costs(g, 64, plain=1.0, verify=7.0, draft=0.3, drafted=64 * 7)
        for rid in range(64):
            g.observe(rid, 7, 2)
        waves = (list(range(r, r + 64)) for r in range(1000, 10 ** 6, 64))
        out, wave = [], next(waves)
        while g.steps < 1300:
            if g.steps % 65 == 0:
                wave = next(waves)
            if g.plan(64, wave).draft:
                out.append(g.steps)
                g.observe_draft(64, actual_pass)  # the probe's pass
                g.costs.draft[64].value = 0.3  # the running estimate stays where cheap passes keep it
                for rid in wave:
                    g.observe(rid, 7, 2)
        return out

    assert probes(0.3) == [16, 215, 430, 645, 860, 1075, 1290]  # as estimated: one probe per 4.3 / 0.02 steps
    # a pass of 4.3 plain steps beyond the estimate doubles the debt: half as many probes
    assert probes(4.6) == [16, 430, 860, 1290]


def test_a_step_of_several_device_rounds_pays_the_drafters_host_pass_once() -> None:
    """SpecConfig.rounds: a verifying step ran 8 rounds on the device (its time given per round) and called the
    scheduler's drafter pass once: per round the pass costs an eighth. The same costs with one round per step
    do not pay (k3-tiny at batch 1 on the H200, session 18: pass 0.6, round 1.8, plain 1.1 ms, 2 tokens a round)."""
    one, eight = (SpecGate(SpecGateConfig(margin=0.05, explore_samples=2)) for _ in range(2))
    for g, rounds in ((one, 1), (eight, 8)):
        for _ in range(2):
            g.observe_step(StepKind.PLAIN, 1, 1.1)
            g.observe_step(StepKind.VERIFY, 1, 1.8, 7, rounds)
            g.observe_draft(1, 0.6)
        for _ in range(2):
            g.observe(0, 7, 1)  # 2 tokens a round
    assert one.plan(1, [0]) == Plan(False, Why.NOT_WORTH)  # 2 tokens in 2.4 ms < 1 in 1.1 ms
    assert eight.plan(1, [0]) == Plan(True, Why.PAYS)  # 2 tokens in 1.8 + 0.6 / 8 ms
    assert eight.costs.verify_rounds[1].value == 8.0


def test_a_bucket_where_even_full_acceptance_loses_is_not_explored_nor_probed_for_new_requests() -> None:
    """Regression (session 16): on the H200 at batch 64 a k3-tiny verify step took ~16 ms and a plain step 1.6 ms;
    every new batch of requests was probed within probe_interval steps (new requests shorten the spacing) and
    each probe cost ~10 plain steps, so code b64 ran at 0.82-0.83x of plain decoding in every round. When a
    verify's drafts all accepted would still not pay, acceptance is not explored and new requests do not bring
    the probes closer: they keep the spacing their loss allows (probe_overhead of plain decoding's time)."""
    g = SpecGate(SpecGateConfig(probe_interval=16, probe_overhead=0.02, explore_samples=64))
    # 64 requests, ~3 drafts each per verify: (64 + 200) tokens in 1 + 10 = 11 plain steps' time < 64 per step
    _costs(g, 64, plain=1.0, verify=10.0, draft=1.0, drafted=200)
    assert g.plan(64, list(range(64))) == Plan(False, Why.NOT_WORTH)  # no EXPLORE: acceptance is moot
    # a probe loses 11 - 264 / 64 = 6.9 plain steps: 2% of the time means one in 344 steps, new requests or not
    new_batches = (list(range(r, r + 64)) for r in range(1000, 10 ** 6, 64))
    while (p := g.plan(64, next(new_batches))) == Plan(False, Why.NOT_WORTH):
        pass
    assert p == Plan(True, Why.PROBE) and g.steps == 344
    # where a full acceptance would pay, the acceptance estimate decides as before (explored first)
    g2 = SpecGate(SpecGateConfig(probe_interval=16, probe_overhead=0.02, explore_samples=64))
    _costs(g2, 64, plain=1.0, verify=4.0, draft=0.3, drafted=64 * 7)
    assert g2.plan(64, list(range(64))) == Plan(True, Why.EXPLORE)


def test_a_drafter_that_often_has_nothing_costs_only_its_pass_in_those_steps() -> None:
    g = SpecGate(SpecGateConfig(prior_verifies=0.0, ema_weight=0.5, explore_samples=2))
    _costs(g, 1, plain=1.0, verify=2.5, draft=0.02)
    g.observe(0, 4, 4)  # drafts offered and all accepted...
    g.observe(0, 0, 0)  # ...then nothing to offer (a suffix drafter between repeats)
    # yield (0.5 * 4 + 0) / 1.5 = 1.33, drafts one step in (0.5 + 0) / 1.5 = 1/3: a drafting step takes
    # 0.02 + 1/3 * 2.5 + 2/3 * 1 = 1.52 for 2.33 tokens (1.53 per plain step's time): it pays, where charging
    # every drafting step a verify (2.33 / 2.52 = 0.93) would have said no
    assert g.yield_(0) == pytest.approx(4 / 3) and g.verifies(0) == pytest.approx(1 / 3)
    assert g.plan(1, [0]) == Plan(True, Why.PAYS)


def test_trim_keeps_drafts_whose_acceptance_pays_their_verify_share() -> None:
    g = SpecGate(SpecGateConfig(margin=0.05))
    # one more draft token costs (1.7 - 1.0) / 7 = 0.1 plain steps; an accepted token is worth 1
    _costs(g, 1, plain=1.0, verify=1.7, draft=0.2)
    sure = [0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5]  # cumulative .9 .81 .405 .2025 .101 ...: four pass 0.105
    assert g.trim(1, [(0, 7, sure)], Why.PAYS).keep == [4]
    # one draft at 0.3 passes, but 1.3 tokens in 1.7 plain steps do not pay: the step decodes plainly
    assert g.trim(1, [(0, 7, [0.3] * 7)], Why.PAYS).keep == [0]
    # a probe (or an exploration) verifies what the drafter offered
    assert g.trim(1, [(0, 7, [0.3] * 7)], Why.PROBE) == (([7], True))
    # without estimates (model-free drafters): alpha^j, alpha the request's acceptance (4 of 5, then rejected)
    g.observe(3, 5, 4)
    assert g.alpha(3) == pytest.approx(0.8)
    assert g.trim(1, [(3, 7, None)], Why.PAYS).keep == [7]  # 0.8^7 = 0.21 still pays 0.105
    # estimates are calibrated by what was accepted against what they predicted, with 2 tokens of prior each
    g.observe(4, 7, 2, estimated=6.0)
    assert g.calibration() == pytest.approx((2 + 2) / (6 + 2))
    assert g.survival(4, 2, [0.8, 0.5]) == pytest.approx([0.4, 0.2])
    g.finish(3)
    assert g.alpha(3) == pytest.approx(g.alpha(12345))  # its own counts are gone


def test_trim_keeps_every_draft_where_verify_graphs_run_k_plus_1_rows_anyway() -> None:
    """On CUDA graphs a verify step runs K + 1 rows for every request whatever it drafted (verify_graph.py): a
    trimmed draft saved nothing, cost accepted tokens, and its request decoded plainly, which held the whole step
    to one device round (Scheduler._plan_rounds). Up to the largest graph bucket trim keeps every draft; the step
    still speculates only if the expected gain beats plain decoding."""
    g = SpecGate(SpecGateConfig(margin=0.05), fixed_verify_upto=16)
    for b in (1, 16):
        _costs(g, b, plain=1.0, verify=1.7, draft=0.2)
    _costs(g, 32, plain=1.0, verify=1.1, draft=0.2)  # a draft: 0.1 / 7 of a step; a token: 1 / 32 of one
    sure = [0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert g.trim(1, [(0, 7, sure)], Why.PAYS).keep == [7]  # eager: 4 (the test above)
    assert g.trim(16, [(r, 7, sure) for r in range(16)], Why.PAYS).keep == [7] * 16
    assert g.trim(32, [(r, 7, sure) for r in range(32)], Why.PAYS).keep == [2] * 32  # past the graphs: eager
    assert g.trim(1, [(0, 7, [0.05] * 7)], Why.PAYS).keep == [0]  # 1.05 tokens per 1.7 steps: plain decoding


def test_a_cheap_drafter_is_asked_every_step_and_probed_when_its_drafts_never_pay() -> None:
    g = SpecGate(SpecGateConfig(probe_interval=4, probe_overhead=1.0))
    _costs(g, 1, plain=1.0, verify=1.7, draft=0.01)  # a suffix lookup next to a GPU step
    got = []
    for _ in range(5):
        assert g.plan(1, [0], model_free=True) == Plan(True, Why.CHEAP)  # DSpark (model_free False) plans by yields
        got.append(g.trim(1, [(0, 7, [0.3] * 7)], Why.CHEAP))
    # drafts the trie is unsure of are not worth a verify, until the bucket went probe_interval steps without one
    assert got == [Trim([0], False)] * 3 + [Trim([7], True), Trim([0], False)]
    # a look ahead (overlap) neither probes nor records
    assert g.trim(1, [(0, 7, [0.99] * 7)], Why.CHEAP, record=False) == Trim([7], False)
    assert g._verify_probes.last[1] == 4


def test_step_samples_name_one_kind_of_step_or_none() -> None:
    verify = ScheduledChunk(None, 10, 1, True, draft_ids=[1, 2])
    prefill = ScheduledChunk(None, 0, 64, True)
    plain2 = SchedulerOutput([object(), object()], [], [], [])
    plain3 = SchedulerOutput([object()] * 3, [], [], [])
    plain4 = SchedulerOutput([object()] * 4, [], [], [])
    spec = SchedulerOutput([object()], [verify], [], [])
    mixed = SchedulerOutput([object()], [verify, prefill], [], [])
    assert step_sample(plain2, [plain2]) == (StepKind.PLAIN, 2)  # synchronous
    assert step_sample(spec, [spec]) == (StepKind.VERIFY, 2)
    assert step_sample(mixed, [mixed]) is None  # the prefill's time
    assert step_sample(plain3, [plain4]) == (StepKind.PLAIN, 3)  # overlapped plain decoding, one bucket (4)
    assert step_sample(plain2, [spec]) is None  # launched one kind, read back another
    assert step_sample(plain2, [plain3]) is None  # another bucket
    assert step_sample(plain4, [plain4, plain3]) is None and step_sample(None, []) is None


def test_step_cost_estimates_shrug_off_stalls() -> None:
    e = Ema()
    e.add(0.5, 0.125, 1)  # the bucket's first verify compiled its kernels
    e.add(0.01, 0.125, 2)  # 50x faster: the first sample was the stall, start again
    assert (e.value, e.n, e.at_step) == (0.01, 1, 2)
    e.add(1.0, 0.125, 3)  # a GC pause counts as 4x the estimate at most, at the 1/n weight of a second sample
    assert e.value == pytest.approx(0.01 + 0.5 * (0.04 - 0.01)) and e.n == 2


def test_a_drafters_dear_calls_are_not_forgotten_after_a_cheap_one() -> None:
    """Regression (session 16): the suffix drafter's first sight of a new batch's 64 agent prompts cost ~100 ms on
    the H200, its next call ~7 ms; the draft estimate restarted from the cheap call (the stall rule of step
    times), so the next probe, with new prompts again, was priced at 7 ms and came 15x too often."""
    c = StepCosts(0.125)
    c.observe_draft(64, 0.100, 1)
    c.observe_draft(64, 0.007, 2)
    assert c.get(c.draft, 64).value == pytest.approx(0.0535)  # the mean of both (weight 1/2 for a second sample)
    c.observe_step(StepKind.VERIFY, 64, 0.100, step=1, drafted=8)
    c.observe_step(StepKind.VERIFY, 64, 0.002, step=2, drafted=8)
    assert c.get(c.verify, 64).value == 0.002  # step times still restart after a stall (a compile)


def test_a_stale_verify_estimate_is_replaced_by_a_probe_far_below_it() -> None:
    e = Ema()
    e.add(0.005, 0.125, 1)
    e.add(0.003, 0.125, 5, stale_after=16)  # sampled 4 decisions ago: averaged in
    assert e.value == pytest.approx(0.004) and e.n == 2
    e.add(0.003, 0.125, 21, stale_after=16)  # 16 decisions unsampled, but within STALE_DROP of it: averaged in
    assert e.value == pytest.approx(0.004 - 0.001 / 3) and e.n == 3  # (a third sample weighs 1/3)
    e.add(0.002, 0.125, 40, stale_after=16)  # unsampled for 19 decisions and 1.9x below: out of date, replaced
    assert (e.value, e.n, e.at_step) == (0.002, 1, 40)
    e.add(0.0001, 0.125, 41, stale_after=16)  # fresh, and a stall's opposite (the 4x restart rule) still applies
    assert e.value == 0.0001


def test_speculation_recovers_at_once_from_a_verify_estimate_that_began_dear() -> None:
    """Regression: the controller's verify estimate of a bucket came from warm-up steps at ~3x the steady cost; it
    then said drafting did not pay, so it verified only in probes, spaced by the loss the dear estimate implied,
    each moving the estimate by ema_weight: with k3-tiny's costs (plain 1, verify 1.8 against 5 estimated, pass
    0.1, tau 3.2) the rule took ~700 steps to speculate again. The first probe now replaces the stale estimate."""
    g = SpecGate(SpecGateConfig(governor_trial=0))  # the rule alone
    for _ in range(8):  # warm-up: exploration's verifies at the dear cost
        _costs(g, 1, plain=0.001, verify=0.005, draft=0.0001)
        g.observe(0, 7, 2)
        g.plan(1, [0])
    first_pays = None
    for step in range(2000):
        p = g.plan(1, [0])
        if p.why is Why.PAYS:
            first_pays = step
            break
        if p.draft:  # a probe: the steady verify cost, the same acceptance
            g.observe_step(StepKind.VERIFY, 1, 0.0018, 7)
            g.observe(0, 7, 2)
        else:
            g.observe_step(StepKind.PLAIN, 1, 0.001)
    assert first_pays is not None and first_pays <= 150, first_pays


def test_a_cold_first_verify_and_pass_do_not_price_speculation_out() -> None:
    """Regression (session 23, H200, k3-tiny with DSpark, 8 device rounds, batch 1): the bucket's first verify round
    (4.96 ms, against ~1.4 after) and first drafter pass (44.6 ms, against ~0.8) came from the warm-up and were
    each the estimate's only sample; the rule found the bucket hopeless (a verify's whole drafts accepted would not
    pay 22 ms of pass per round), so it probed only as far apart as that loss allowed and the gate's first two code
    rounds ran at 0.90-1.11x of plain decoding, the later ones at 1.92x. A "no" on first samples is not trusted:
    the controller drafts again, and a second sample far below the first replaces it."""
    g = SpecGate(SpecGateConfig(governor_trial=0, explore_samples=2), fixed_verify_upto=1, stable_pass=True)
    for _ in range(40):
        g.observe_step(StepKind.PLAIN, 1, 0.001)
    g.observe_step(StepKind.VERIFY, 1, 0.00496, 5, rounds=2)
    g.observe_draft(1, 0.0446)
    for _ in range(2):
        g.observe(0, 7, 2)
    assert g.plan(1, [0]) == Plan(True, Why.EXPLORE)  # it said NOT_WORTH (hopeless) here before
    g.observe_step(StepKind.VERIFY, 1, 0.0014, 7, rounds=8)
    g.observe_draft(1, 0.0008)
    g.observe(0, 7, 2)
    assert g.costs.verify[1].value == 0.0014 and g.costs.draft[1].value == 0.0008  # the cold samples dropped
    assert g.plan(1, [0]) == Plan(True, Why.PAYS)  # 3 tokens in 1.4 + 0.8 / 8 ms


def test_a_model_free_drafters_dear_first_pass_still_prices_its_next_dear_ones() -> None:
    """The first-sample drop is for passes that cost alike (stable_pass): a suffix drafter's dear first sight of new
    prompts recurs with every new batch of them, so its cheap second call does not replace it."""
    g = SpecGate(SpecGateConfig())
    g.observe_draft(64, 0.1)
    g.observe_draft(64, 0.007)
    assert g.costs.draft[64].value > 0.05


def _governed_until_probe(draft: float) -> tuple[SpecGate, list[Why]]:
    """A bucket-1 controller whose rule says drafting does not pay (verify 2.3 plain steps, one draft accepted of 7,
    the drafter's pass `draft` seconds), under a governor (trials of 2 steps) that sees plain steps in both modes,
    "on" a little slower (its steps record target states): the plans until the first probe, 40 at most."""
    g = SpecGate(SpecGateConfig(governor_trial=2, governor_max_hold=8, explore_samples=1))
    for _ in range(2):
        _costs(g, 1, plain=0.001, verify=0.0023, draft=draft)
        g.observe(0, 7, 1)
    whys = []
    for _ in range(40):
        whys.append(g.plan(1, [0]).why)
        if whys[-1] is Why.PROBE:
            break
        g.observe_step(StepKind.PLAIN, 1, 0.001)
        g.observe_rate(1, 1, 0.00105 if g.governor.allowed(1) else 0.001)
    return g, whys


def test_the_governor_allowing_speculation_again_brings_a_probe_at_once() -> None:
    """Regression (k3-tiny code at batch 1 on the H200, session 22): the rule's verify estimate began dear (2.3x a
    plain step), so the governor's first trial with speculation allowed ran plain steps, lost to plain decoding by
    noise, and each later trial judged speculation by the same stale estimate: no probe came within a trial's
    steps, so it lost again and the holds grew to 1024 steps. A trial after a period off now probes in its first
    step, and that probe's cheap verify replaces the stale estimate (STALE_DROP)."""
    g, whys = _governed_until_probe(draft=0.0003)
    assert Why.OFF in whys and whys[-1] is Why.PROBE, whys  # off, then back with a probe
    assert whys[whys.index(Why.OFF):].count(Why.NOT_WORTH) == 0  # the first step allowed again probes
    # the probe measures the steady cost (1.1 plain steps per round) and acceptance: the rule pays from here on
    g.observe_step(StepKind.VERIFY, 1, 0.0011, 7)
    g.observe(0, 7, 4)
    assert g.plan(1, [0]) == Plan(True, Why.PAYS)
    assert g.plan(1, [0]).why is not Why.PROBE  # owed once per return, not every step


def test_a_probe_dearer_than_the_governors_trial_is_not_owed_to_it() -> None:
    """The probe owed to a governor's return is no probe dearer than the trial it would run in (governor_trial
    plain steps): a drafter's pass of 30 plain steps keeps the budgeted spacing."""
    _, whys = _governed_until_probe(draft=0.03)
    assert Why.OFF in whys and Why.PROBE not in whys, whys


def test_state_reports_the_estimates_it_decides_by() -> None:
    """SpecGate.state (benchmarks report it): per bucket the cost EMAs in ms with their sample counts, the method's
    acceptance, the governor's modes."""
    g = SpecGate(SpecGateConfig(explore_samples=1, governor_trial=2, governor_max_hold=8))
    assert g.state() == {"costs": {}, "method": {"alpha": 0.5, "yield": None, "seen": 0}, "governor": {}}
    _costs(g, 3, plain=0.002, verify=0.004, draft=0.001, drafted=5)
    g.observe(1, 4, 3)
    g.observe_rate(3, 3, 0.002)
    st = g.state()
    assert st["costs"] == {4: {"plain_ms": [2.0, 2], "verify_ms": [4.0, 2], "draft_ms": [1.0, 2],
                               "drafts_per_verify": [5.0, 2], "rounds_per_verify": [1.0, 2]}}
    assert st["method"] == {"alpha": 0.75, "yield": 3.0, "seen": 1}
    assert st["governor"] == {4: {"on": True, "trial": True, "samples": 1, "hold": 2, "rate_on": None,
                                  "rate_off": None}}


def test_gate_config_errors_name_the_field() -> None:
    for kw, name in (({"margin": -0.1}, "margin"), ({"probe_interval": 0}, "probe_interval"),
                     ({"ema_weight": 0.0}, "ema_weight"), ({"probe_overhead": 0.0}, "probe_overhead"),
                     ({"explore_samples": 0}, "explore_samples"), ({"prior_verifies": -1}, "prior_verifies")):
        with pytest.raises(ValueError, match=f"spec_gate.{name}"):
            SpecGateConfig(**kw)


def _workload() -> list[list[int]]:
    rng = random.Random(5)
    gram = [rng.randrange(1, 200) for _ in range(6)]
    return [gram * 5, [rng.randrange(1, 200) for _ in range(20)], gram * 3 + [7], gram * 4]


def _forced(eng, pays: bool) -> list:
    """Fix the controller's costs at every batch bucket (and stop it learning new ones) so it decides one way:
    a perfect drafter's 4 accepted drafts per request pay for a verify at 1.1 plain steps + a 0.05 pass, not
    for one at 5 plain steps + a pass of 1."""
    g = eng.gate
    for b in (1, 2, 4, 8):
        _costs(g, b, plain=1.0, verify=1.1 if pays else 5.0, draft=0.05 if pays else 1.0)
    for _ in range(g.cfg.explore_samples):  # past exploration
        g.observe(-1, 4, 4)
    g.finish(-1)
    samples = []  # the step samples the engine hands in: recorded, not learned from
    g.observe_step = lambda kind, batch, seconds, drafted=0, rounds=1: samples.append((kind, drafted))
    g.observe_draft = lambda *a, **k: None
    eng.scheduler.drafter = NullOracle(eng.runner.inner)
    return samples


def test_the_controller_drafts_in_decode_only_steps(tmp_path_factory) -> None:
    """Regression (session 16): with the controller on, verify rows rode in steps that also carried a prefill
    chunk; such steps are no sample of any cost the controller learns, and on the H200 (k3-tiny, batch 64) they
    took 57-62 ms against 9-17 ms without the rows. The controller now drafts only in steps without prefill work;
    with it off (adaptive=False) verify and prefill chunks still share steps (the runner's capability)."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    gram = [11, 12, 13, 14, 15, 16]
    spec = SpecConfig(method="ngram", num_tokens=4, ngram_min=1, gate=SpecGateConfig(probe_interval=10_000))
    for adaptive in (True, False):
        eng = make_engine(ckpt, budget=64, engine={"spec": replace(spec, adaptive=adaptive)})
        if adaptive:
            _forced(eng, pays=True)
        else:
            eng.scheduler.drafter = NullOracle(eng.runner.inner)
        outs = []
        schedule = eng.scheduler.schedule
        eng.scheduler.schedule = lambda: outs.append(o := schedule()) or o
        eng.add_request(gram * 3, greedy(40))
        for _ in range(4):  # the first request decodes (and speculates)
            eng.step()
        eng.add_request(list(range(100, 400)), greedy(4))  # 300 prompt tokens: chunks over several steps
        while eng.has_unfinished:
            eng.step()
        verify = [o for o in outs if any(c.draft_ids for c in o.chunks)]
        mixed = [o for o in verify if any(not c.draft_ids for c in o.chunks)]
        prefill = [o for o in outs if any(not c.draft_ids for c in o.chunks)]
        assert verify and len(prefill) >= 5
        assert (not mixed) if adaptive else mixed, (adaptive, len(mixed))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_skipped_step_decodes_every_request_plainly(tmp_path_factory, overlap) -> None:
    """With speculation not paying, every step is scheduled exactly as without a drafter (each request one plain
    decode), the drafter is never asked, the skips are counted, and under overlap plain steps stay in flight.
    With it paying, verify steps run (and are never left in flight). Outputs equal the plain engine's."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    prompts, params = _workload(), [greedy(12), greedy(9), greedy(12), greedy(5)]
    plain = make_engine(ckpt, engine={"overlap": overlap})
    ref = [o.output_ids for o in run(plain, prompts, params)]
    spec = SpecConfig(method="ngram", num_tokens=4, ngram_min=1, gate=SpecGateConfig(probe_interval=10_000))
    for pays in (False, True):
        eng = make_engine(ckpt, engine={"overlap": overlap, "spec": spec})
        samples = _forced(eng, pays)
        asked = []
        propose = eng.scheduler.drafter.propose_scored
        eng.scheduler.drafter.propose_scored = lambda qs, full=False: asked.append(len(qs)) or propose(qs, full)
        in_flight = []  # per step: (a step left in flight, it verifies drafts)

        def look(e) -> None:
            f = e.overlap.inflight if e.overlap is not None else None
            in_flight.append((f is not None, f is not None and any(c.draft_ids for c in f.out.chunks)))

        out = run(eng, prompts, params, after_step=look)
        assert [o.output_ids for o in out] == ref
        s = eng.stats
        # what the engine's step times were attributed to: plain decode steps (synchronous, or overlapped behind
        # the plain step before), verify steps with their draft tokens; prefill steps are no sample
        assert samples and {k for k, _ in samples} <= {StepKind.PLAIN, StepKind.VERIFY}
        assert all(d > 0 for k, d in samples if k is StepKind.VERIFY)
        if pays:
            assert asked and s.spec_steps_speculated > 0 and s.spec_verifies > 0 and s.spec_steps_skipped == 0
            assert 0 < sum(k is StepKind.VERIFY for k, _ in samples) <= s.spec_steps_speculated
            # the plans by reason: a pass at 0.05 of a plain step is a cheap one, asked every step
            assert set(s.spec_plan_whys) <= {"cheap", "refresh"} and s.spec_plan_whys.get("cheap", 0) > 0
        else:
            assert {k for k, _ in samples} == {StepKind.PLAIN}
            assert eng.runner.steps == plain.runner.steps  # the same steps, decode for decode
            assert not asked and s.spec_verifies == 0 and s.spec_steps_skipped == s.spec_steps > 0
            assert s.spec_probes == 0 and s.spec_plan_whys == {"not_worth": s.spec_steps}
        # plain steps overlap while speculation is off; a verify step is never left in flight (its advance needs
        # its accepted run), and while it pays only steps after which nobody can draft are
        assert not any(v for _, v in in_flight)
        held = sum(f for f, _ in in_flight)
        if not overlap:
            assert held == 0
        elif not pays:
            assert held > len(in_flight) // 2
            assert len(samples) >= held // 2  # an overlapped plain step's time is still a plain sample
        assert_at_rest(eng)


class _Stretches(NullOracle):
    """Drafts (what the null runner will emit) only in alternate stretches of 4 output tokens."""

    def propose(self, queries):
        return [d if ((len(q.token_ids) - q.prompt_len) // 4) % 2 == 0 else []
                for q, d in zip(queries, super().propose(queries))]


def test_a_cheap_model_free_drafter_is_asked_ahead_and_steps_overlap_where_it_has_nothing(tmp_path_factory) -> None:
    """Overlap with a drafter whose pass is nearly free (Why.CHEAP): after launching a step the scheduler asks the
    drafter about the tokens known so far; where it has nothing the step stays in flight, where it has drafts
    the next step verifies them. Outputs equal the plain engine's."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    prompts, params = _workload(), [greedy(24), greedy(17), greedy(24), greedy(13)]
    ref = [o.output_ids for o in run(make_engine(ckpt, engine={"overlap": True}), prompts, params)]
    eng = make_engine(ckpt, engine={"overlap": True, "spec": SpecConfig(method="ngram", num_tokens=4)})
    g = eng.gate
    for b in (1, 2, 4, 8):
        _costs(g, b, plain=1.0, verify=1.2, draft=0.01)
    g.observe_step = g.observe_draft = lambda *a, **k: None
    eng.scheduler.drafter = _Stretches(eng.runner.inner)
    plans = []
    plan = g.plan

    def spy(*a, **k):
        p = plan(*a, **k)
        plans.append(p.why)
        return p

    g.plan = spy
    held = []
    out = run(eng, prompts, params, after_step=lambda e: held.append(e.overlap.inflight is not None))
    assert [o.output_ids for o in out] == ref
    s = eng.stats
    assert set(plans) <= {Why.CHEAP, Why.EXPLORE} and Why.CHEAP in plans
    assert s.spec_verifies > 0 and s.spec_accepted_tokens > 0 and s.spec_steps_skipped > 0
    assert 0 < sum(held) < len(held)
    assert_at_rest(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["suffix", "dspark"])
def test_cuda_controller_with_overlap_is_token_identical(method) -> None:
    """k3-tiny on CUDA (GPU runner, graphs, overlap on by default) with the controller learning from real step
    times, one request at a time, in the batch-invariant mode (--deterministic: a verify row computes as a decode
    row, so greedy equality is by construction; outside it a one-row decode and a verify's rows run different
    kernels, the unrolled GEMV against cuBLAS since session 46, and bf16 greedy may part at a near-tie, as
    docs/dspark.md says): outputs equal plain decoding's, and whatever it chose, the counters add up; where it
    skipped drafting, plain steps were left in flight."""
    import torch

    from k3rt.backend.engine import Engine
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.config import EngineConfig
    from k3rt.models import resolve_model_dir
    from k3rt.sampling_params import SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = resolve_model_dir("k3-tiny")
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode_prompt(p) for p in ("def fibonacci(n):", "import os\n\ndef read_lines(path):")]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = Engine(EngineConfig(model=str(model_dir), device="cuda", deterministic=True))
    ref = [plain.generate([p], params)[0].output_ids for p in prompts]
    eng = Engine(EngineConfig(model=str(model_dir), device="cuda", deterministic=True,
                              spec=SpecConfig(method=method, num_tokens=7)))
    assert eng.overlap is not None and eng.gate is not None
    held = []
    got = []
    for p in prompts:
        rid = eng.add_request(p, params)
        while eng.has_unfinished:
            for o in eng.step():
                if o.finished and o.rid == rid:
                    got.append(o.output_ids)
            held.append(eng.overlap.inflight is not None)
        eng.check()
    assert got == ref
    s = eng.stats
    assert s.spec_steps >= s.spec_steps_speculated + s.spec_steps_skipped and s.spec_steps_speculated > 0
    if s.spec_steps_skipped > 4:  # skips come in runs, planned a step ahead: those steps overlap
        assert any(held)
