"""Several speculative verify rounds per engine step on the device (backend/runner/gpu/rounds.py, SpecConfig.rounds).

The pure tensor steps against their host definitions (rejection.py's cut, pack_step's indices), then the engine:
k3-tiny with its shipped DSpark drafter through the GPU runner's padded verify form (torch ops on the CPU; graphs
on CUDA), greedy output equal to plain decoding token for token, with stop tokens and token budgets that end
requests inside a round."""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.engine import Engine
from k3rt.backend.runner.gpu.rounds import advance_step, greedy_accept, shift_window
from k3rt.backend.runner.gpu.step import StepSeq, pack_step, step_views
from k3rt.backend.runner.gpu.verify_graph import pad_rows, plan_verify
from k3rt.backend.tokenizer import load_tokenizer
from k3rt.config import EngineConfig, SpecConfig
from k3rt.models import MODELS_DIR
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import assert_at_rest, run


def test_greedy_accept_cuts_like_the_host_verifier() -> None:
    # rows: argmax per row; fed: anchor then drafts. Sequence 0 accepts 2 drafts (row 2 disagrees), 1 accepts all
    # 3 and gets a bonus, 2 hits a stop id inside its accepted run, 3 runs out of budget, 4 is not live.
    argmax = torch.tensor([[5, 6, 9, 1], [5, 6, 7, 8], [5, 99, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    fed = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [0, 5, 99, 7], [0, 5, 6, 7], [0, 5, 6, 7]])
    drafts = torch.tensor([3, 3, 3, 3, 3])
    stops = torch.tensor([[-1], [-1], [99], [-1], [-1]])
    budget = torch.tensor([10, 10, 10, 2, 10])
    live = torch.tensor([True, True, True, True, False])
    kept, ended = greedy_accept(argmax, fed, drafts, stops, budget, live)
    assert kept.tolist() == [3, 4, 2, 2, 0]  # tokens emitted: argmax[:kept]
    assert ended.tolist() == [False, False, True, True, False]
    # padding rows past a sequence's real drafts are never accepted
    kept, _ = greedy_accept(argmax[1:2], fed[1:2], torch.tensor([1]), stops[1:2], budget[1:2], live[1:2])
    assert kept.tolist() == [2]


def test_shift_window_keeps_the_newest_positions() -> None:
    W, R, F = 4, 3, 2
    ctx = torch.arange(2 * W * F, dtype=torch.float32).view(2, W, F)
    tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    taps = -torch.arange(2 * R * F, dtype=torch.float32).view(2, R, F) - 1
    fed = torch.tensor([[14, 15, 16], [24, 25, 26]])
    kept, anchor = torch.tensor([2, 0]), torch.tensor([77, 88])
    before = ctx.clone(), tokens.clone(), valid.clone()
    shift_window(ctx, tokens, valid, taps, fed, kept, anchor)
    assert torch.equal(ctx[0], torch.cat([before[0][0, 2:], taps[0, :2]]))
    assert tokens[0].tolist() == [12, 13, 14, 15, 77]
    assert valid[0].tolist() == [True, True, True, True]
    # kept 0 (an ended request): the window stays
    assert all(torch.equal(now[1], was[1]) for now, was in zip((ctx, tokens, valid), before))


def test_advance_step_equals_packing_the_next_round() -> None:
    """The device advance of a verify-form step gives the indices pack_step computes for the next round's rows."""
    bs, R = 4, 3
    table = [[7, 3, 9, 2]]
    pad = StepSeq([0], 0, [1], [1], True)

    def packed(start: int, ids: list[int], size: int = 2):
        padded, plan = plan_verify([StepSeq(ids, start, table[0], [5], True, verify=True)], size, R, pad)
        meta, (h64, h32) = pack_step(padded, block_size=bs, conv_width=4, num_groups=1, max_blocks=4,
                                     row_queries=True)
        pad_rows(meta, h64, plan, 1 * bs)
        return step_views(meta, h64, h32)

    step = packed(5, [40, 41])  # one draft: the run's third row is padding
    nxt = packed(7, [50, 51, 52])
    pad_before = step.pos.view(2, R)[1].clone(), step.kv_slot.view(2, R)[1].clone()
    advance_step(step.ids.view(2, R), step.pos.view(2, R), step.kv_slot.view(2, R), step.ctx_lens,
                 step.block_table, torch.tensor([2, 0]), torch.tensor([50, 0]), torch.tensor([[51, 52, 60], [1, 2, 3]]),
                 bs, torch.tensor([True, False]), torch.tensor([100, 100]))
    for name in ("ids", "pos", "kv_slot", "ctx_lens", "block_table", "row_seq", "state_pages"):
        assert torch.equal(getattr(step, name), getattr(nxt, name)), name  # the pad sequence's rows included
    assert torch.equal(step.kda_rows.conv_idx, nxt.kda_rows.conv_idx)
    # the pad sequence stays put
    assert torch.equal(step.pos.view(2, R)[1], pad_before[0]) and torch.equal(step.kv_slot.view(2, R)[1], pad_before[1])
    # rows past a request's last position are fed at it (positions 9 and 10 -> 8 when its last position is 8)
    advance_step(step.ids.view(2, R), step.pos.view(2, R), step.kv_slot.view(2, R), step.ctx_lens,
                 step.block_table, torch.tensor([1, 0]), torch.tensor([5, 0]), torch.tensor([[6, 7, 8], [1, 2, 3]]),
                 bs, torch.tensor([True, False]), torch.tensor([8, 8]))
    assert step.pos.view(2, R)[0].tolist() == [8, 8, 8] and step.kv_slot.view(2, R)[0].tolist() == [9 * bs] * 3


# ---- the engine: k3-tiny and its shipped drafter ----

def _engine(rounds: int, **over) -> Engine:
    eng = Engine(EngineConfig(model=str(MODELS_DIR / "k3-tiny"), dtype="float32", runner="gpu", kernels=False,
                              cuda_graphs=False, spec=SpecConfig(method="dspark", num_tokens=7, rounds=rounds, **over)))
    inner = eng.runner
    # the padded verify form the CUDA graphs replay, run eagerly (what the engine sets up on CUDA, without capture)
    inner.verify_run_len, inner.verify_sizes = 8, (1, 2, 4)
    inner.fwd.reserve_verify_inputs(4 * 8)
    return eng


@pytest.fixture(scope="module")
def workload():
    tok = load_tokenizer(MODELS_DIR / "k3-tiny")
    texts = ("def fibonacci(n):", "import os\n\ndef read_lines(path):", "class Stack:\n    def push(self, x):",
             "for i in range(10):")
    prompts = [tok.encode_prompt(t) for t in texts]
    plain = Engine(EngineConfig(model=str(MODELS_DIR / "k3-tiny"), dtype="float32"))
    base = SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True)
    ref = [o.output_ids for o in plain.generate(prompts, base)]
    # stop ids taken from the outputs (each ends its request mid-output, inside some round), and budgets that
    # end requests inside a round
    params = [SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True, stop_token_ids=(ref[0][30],)),
              SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True, stop_token_ids=(ref[2][17],)),
              SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True)]
    expect = [o.output_ids for o in plain.generate(prompts, params)]
    return prompts, params, expect


@pytest.mark.parametrize("adaptive", [False, True], ids=["every-step", "controller"])
def test_device_rounds_greedy_output_equals_plain(workload, adaptive) -> None:
    prompts, params, expect = workload
    eng = _engine(4, adaptive=adaptive)
    planned, rounds_run = [], []
    plan = eng.scheduler._plan_rounds
    eng.scheduler._plan_rounds = lambda s, d: (lambda r: planned.append(r) or r)(plan(s, d))
    update = eng.scheduler._update_verify
    eng.scheduler._update_verify = lambda c, r, f: (rounds_run.append(len(getattr(r, "rounds", [0]))), update(c, r, f))
    # the rounds start from the windows of this step's proposal (DSparkDrafter.window): equal to building them anew
    drafter, windows = eng.runner.round_drafter, []
    window = drafter.window

    def checked(queries):
        got = window(queries)
        assert drafter._last is not None and all(q.rid in drafter._last[0] for q in queries)
        last, drafter._last = drafter._last, None
        fresh = window(queries)
        drafter._last = last
        assert [a is None for a in got] == [b is None for b in fresh]
        assert all(torch.equal(a, b) for a, b in zip(got, fresh) if a is not None)
        windows.append(len(queries))
        return got

    drafter.window = checked
    # one request alone (batch 1: every step may run rounds), then all four
    out = run(eng, prompts[:1], params[:1]) + run(eng, prompts, params)
    assert [o.output_ids for o in out] == expect[:1] + expect
    assert max(rounds_run) == 4 and 4 in planned and windows  # steps of several rounds ran
    s = eng.stats
    assert s.spec_verifies == sum(rounds_run)  # every round counted once
    # the drafter's tau on these prompts is above 2 when every step drafts (the controller's choices vary with timing)
    assert s.spec_accepted_tokens > (s.spec_verifies if not adaptive else 0)
    assert sum(o.spec_accepted_tokens for o in out[1:]) + out[0].spec_accepted_tokens == s.spec_accepted_tokens
    eng.check()
    assert len(eng.target_states) == 0
    assert_at_rest(eng)  # every page back (lookahead pages of the rounds included), or in the cache


def test_the_next_step_drafts_from_the_pass_the_rounds_ran_after_their_last_acceptance(workload) -> None:
    """After a step of device rounds the drafter's pass over the final windows is read back with the step's tokens
    (DSparkDrafter.carry): the next step's proposal takes it instead of building the windows from the recorded
    states and running a pass with the host waiting. Its drafts and estimates equal a fresh pass's, and the
    output equals plain decoding."""
    prompts, params, expect = workload
    eng = _engine(4, adaptive=False)
    drafter = eng.runner.round_drafter
    built, carried = [], []
    inputs, pass_ = drafter._inputs, drafter._pass

    def counted_inputs(queries):
        built.append(len(queries))
        return inputs(queries)

    def checked_pass(queries, full=False):
        got = pass_(queries, full)
        if any(drafter._carried_for(q) is not None for q in queries):
            carried.append(len(queries))
            held, last = drafter._carried, drafter._last
            drafter._carried = {}
            assert pass_(queries, full) == got  # a fresh pass over the recorded states proposes the same
            drafter._carried, drafter._last = held, last
        return got

    drafter._inputs, drafter._pass = counted_inputs, checked_pass
    out = run(eng, prompts[1:2], params[1:2])  # 45 tokens, no stop id: several steps of rounds
    assert [o.output_ids for o in out] == expect[1:2]
    assert carried  # steps after a rounds step drafted from the carried pass
    # windows were built only for the checks and the steps without a carried pass: fewer than the proposals
    assert len(built) - len(carried) < eng.stats.spec_steps
    assert not drafter._carried  # dropped when the request ended
    assert_at_rest(eng)


def test_a_requests_first_drafts_come_from_the_pass_queued_after_its_prefill(workload, monkeypatch) -> None:
    """Session 33: the step that completes a prompt queues the drafter's pass on the device (the sampled token as
    the anchor, rounds.py queue_first_pass) and its collect hands it to the drafter, so the request's first
    drafting step builds no window and runs no pass with the host waiting. Every request's first proposal is
    carried; each carried proposal equals a fresh pass over the recorded states (checked below); output equals plain
    decoding, alone and four at once. Nothing is queued while the controller's latest plan decoded plainly, and a
    pass that fails to queue leaves the step's tokens alone (the first drafts then come from the host)."""
    from k3rt.backend.runner.gpu import runner as gpu_runner

    prompts, params, expect = workload
    eng = _engine(4, adaptive=False)
    drafter = eng.runner.round_drafter
    pass_ = drafter._pass
    first: dict[int, bool] = {}  # rid -> its first proposal was carried

    def checked_pass(queries, full=False):
        carried = {q.rid: drafter._carried_for(q) is not None for q in queries}
        got = pass_(queries, full)
        for rid, c in carried.items():
            first.setdefault(rid, c)
        if any(carried.values()):
            held, last = drafter._carried, drafter._last
            drafter._carried = {}
            assert pass_(queries, full) == got  # a fresh pass over the recorded states proposes the same
            drafter._carried, drafter._last = held, last
        return got

    drafter._pass = checked_pass
    out = run(eng, prompts[:1], params[:1]) + run(eng, prompts, params)
    assert [o.output_ids for o in out] == expect[:1] + expect
    assert len(first) == 5 and all(first.values()), first
    assert not drafter._carried
    assert_at_rest(eng)
    # while the controller's latest plan decoded plainly (SchedulerOutput.first_pass False) no pass is queued: an
    # arrival then costs no drafter pass the next steps may not use
    first.clear()
    eng.scheduler._last_plan_drafted = False  # no controller here: nothing plans it back
    out = run(eng, prompts[:2], params[:2])
    assert [o.output_ids for o in out] == expect[:2]
    assert len(first) == 2 and not any(first.values()), first
    # a pass that fails to queue costs the step nothing: the first drafts come from the host, output unchanged
    first.clear()
    eng.scheduler._last_plan_drafted = True

    def broken(*args):
        raise RuntimeError("no pass")
    monkeypatch.setattr(gpu_runner, "queue_first_pass", broken)
    out = run(eng, prompts[:1], params[:1])
    assert [o.output_ids for o in out] == expect[:1]
    assert len(first) == 1 and not any(first.values()), first


def test_device_rounds_through_the_fused_round_kernels_equal_plain(workload, monkeypatch) -> None:
    """The round's acceptance, window shift and advance through kernels/spec/triton_rounds.py (the interpreter here;
    what CUDA runs with the kernels on) inside the engine's rounds: the same greedy output as plain decoding."""
    import k3rt.kernels.spec as fused
    from k3rt.backend.runner.gpu import rounds

    prompts, params, expect = workload
    calls = []
    for name in ("round_accept", "round_shift", "round_advance"):
        fn = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a), raising=False)
    monkeypatch.setattr(rounds, "_fused", lambda runner: fused)
    eng = _engine(4, adaptive=False)
    assert [o.output_ids for o in run(eng, prompts[:2], params[:2])] == expect[:2]
    assert {"round_accept", "round_shift", "round_advance"} <= set(calls)
    eng.check()
    assert_at_rest(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_rounds_on_cuda_graphs(workload, dtype) -> None:
    """On CUDA the rounds replay the verify, commit and drafter graphs. fp32: equal to plain decoding; bf16:
    equal to one round per step (the same graphs on the same inputs: the device's window and drafts are the ones
    the host path builds)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    prompts, params, expect = workload

    def outputs(rounds: int) -> tuple[list[list[int]], Engine]:
        eng = Engine(EngineConfig(model=str(MODELS_DIR / "k3-tiny"), dtype=dtype, device="cuda",
                                  spec=SpecConfig(method="dspark", num_tokens=7, rounds=rounds, adaptive=False)))
        return [o.output_ids for o in run(eng, prompts, params)], eng

    one, _ = outputs(1)
    four, eng = outputs(4)
    assert four == one
    if dtype == "float32":
        assert four == expect
    assert eng.runner.verify_graph_replays > 0 and eng.stats.spec_accepted_tokens > eng.stats.spec_verifies


def test_spec_rounds_flag_and_its_bounds() -> None:
    from k3rt.backend.bench.spec_bench import SpecBenchConfig
    from k3rt.cli import _spec_config, build_parser

    a = build_parser().parse_args(["serve", "--spec", "dspark", "--spec-rounds", "8"])
    assert _spec_config(a).rounds == 8
    # 16 by default (session 26 on the H200: 16 rounds beat 1 in every gate row), and the benchmarks measure it
    assert _spec_config(build_parser().parse_args(["serve", "--spec", "dspark"])).rounds == 16
    assert SpecBenchConfig.spec_rounds == SpecConfig.rounds
    with pytest.raises(ValueError, match=r"spec_rounds: must be in \[1, 64\], got 0"):
        SpecConfig(method="dspark", rounds=0)


def test_spec_round_benchmark_smoke(tmp_path) -> None:
    """benchmarks/spec_round.py --smoke (CPU, reference runner): a row per engine with its step times, tokens per
    step, tau and host phases (bit-rot check; its numbers mean something on the GPU)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "spec_round.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "spec_round.py"), "--smoke", "--engines",
                    "plain,dspark", "--out", str(out)], check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [("plain", 1), ("dspark", 1)]
    assert rows[0]["tokens_per_step"] == 1.0 and rows[0]["tau"] is None
    assert rows[1]["tau"] > 1.0 and "draft" in rows[1]["host_phase_ms_per_step"]


def test_plan_rounds_rules(tmp_path_factory) -> None:
    """Scheduler._plan_rounds: rounds only for steps of greedy verify chunks, no more than tokens are left to emit,
    pages allocated up to each request's reach, one round when the pool cannot give them."""
    from dataclasses import replace

    from k3rt.backend.scheduler.scheduler import ScheduledChunk
    from tests.backend.engine_fixtures import greedy, make_engine, tiny_checkpoint

    eng = make_engine(tiny_checkpoint(tmp_path_factory), runner="null", num_pages=64,
                      engine={"spec": SpecConfig(method="ngram", num_tokens=3, rounds=4)})
    sched = eng.scheduler
    assert not sched.device_rounds  # the null runner runs no device rounds: never planned
    sched.device_rounds = True  # as the engine sets it for the GPU runner with a DSpark drafter
    eng.add_request(list(range(1, 44)), greedy(40))  # 43 tokens: the rounds reach the next page
    while not any(r.num_output for r in sched.running):
        eng.step()
    req = sched.running[0]
    chunk = ScheduledChunk(req, req.num_computed, 1, True, draft_ids=[5, 6, 7])
    B, pages = sched.B, len(req.block_table)
    assert sched._plan_rounds([chunk], [req]) == 1  # a plain decode in the step
    assert sched._plan_rounds([ScheduledChunk(req, req.num_computed, 1, True)], []) == 1  # no drafts
    for bad in (replace(req.params, temperature=0.7), replace(req.params, logprobs=2),
                replace(req.params, repetition_penalty=1.2)):
        params, req.params = req.params, bad
        assert sched._plan_rounds([chunk], []) == 1, bad
        req.params = params
    held = sched.pool.allocate(sched.pool.num_free)  # no page to spare
    reach = min(chunk.start + 4 * 4, req.prompt_len + req.params.max_tokens)
    assert -(-reach // B) > pages  # the rounds need more pages than the request holds
    assert sched._plan_rounds([chunk], []) == 1 and len(req.block_table) == pages
    sched.pool.unref(held)
    assert sched._plan_rounds([chunk], []) == 4 and len(req.block_table) == -(-reach // B)
    req.params = replace(req.params, max_tokens=req.num_output + 2)  # two tokens left: two rounds at most
    assert sched._plan_rounds([chunk], []) == 2


def test_plan_rounds_count_the_tokens_a_round_is_expected_to_emit(tmp_path_factory) -> None:
    """The device replays every planned round: a request expected to accept 3 drafts per round gets the rounds its
    tokens left need at that rate (ceil(12 / (1 + 0.85 * 3)) = 4), not one round per token left (8, the cap, half
    of them replays after it ended); without an estimate, one token per round as before."""
    from dataclasses import replace

    from k3rt.backend.scheduler.scheduler import PLAN_YIELD_SHARE, ScheduledChunk
    from tests.backend.engine_fixtures import greedy, make_engine, tiny_checkpoint

    eng = make_engine(tiny_checkpoint(tmp_path_factory), runner="null", num_pages=64,
                      engine={"spec": SpecConfig(method="ngram", num_tokens=3, rounds=8)})
    sched = eng.scheduler
    sched.device_rounds = True
    eng.add_request(list(range(1, 20)), greedy(40))
    while not any(r.num_output for r in sched.running):
        eng.step()
    req = sched.running[0]
    req.params = replace(req.params, max_tokens=req.num_output + 12)
    chunk = ScheduledChunk(req, req.num_computed, 1, True, draft_ids=[5, 6, 7])

    class Yields:  # the controller's expectation for this request
        def __init__(self, y):
            self.y = y

        def yield_(self, rid):
            return self.y

    gate, sched.gate = sched.gate, Yields(None)
    assert sched._plan_rounds([chunk], []) == 8
    sched.gate = Yields(3.0)
    assert PLAN_YIELD_SHARE == 0.85 and sched._plan_rounds([chunk], []) == 4
    sched.gate = Yields(0.0)  # nothing accepted lately: one token per round
    assert sched._plan_rounds([chunk], []) == 8
    # a step of several requests runs the median request's rounds (2, 3, 8 -> 3), not the most any needs: rounds
    # past it would replay the whole batch for the few still live (the rest go on in the next step)
    sched.gate = gate
    for p in (list(range(30, 45)), list(range(50, 60))):
        eng.add_request(p, greedy(40))
    while sum(1 for r in sched.running if r.num_output) < 3:
        eng.step()
    chunks = []
    for r, left in zip(sched.running, (2, 3, 8)):
        r.params = replace(r.params, max_tokens=r.num_output + left)
        chunks.append(ScheduledChunk(r, r.num_computed, 1, True, draft_ids=[5, 6, 7]))
    sched.gate = Yields(None)
    assert sched._plan_rounds(chunks, []) == 3
    sched.gate = gate


def test_fixed_shape_verify_drafts_every_token_and_each_round_counts_its_drafts(workload) -> None:
    """Regression (session 19's H200 gate, k3-tiny + its DSpark drafter, 8 rounds, controller on, batch 1): the
    drafter cut its first round's drafts by its confidence threshold (code: ~1 draft of 7) although a verify CUDA
    graph runs K + 1 rows per request whatever they carry, and the engine handed the controller that first
    round's drafts as the step's drafts per round (the further rounds draft K each), so one measured verify priced
    a round's tokens at 1 + 1 and the controller judged speculation hopeless at batch 1 (0 verifies after it).
    Where verify has a fixed shape (gate.fixed_verify_upto) the drafter now returns min(K, tokens left) drafts,
    and a verify sample's drafts are the step's drafts over every round, per round. The per-step draft cap
    (bounding eager verify work) does not apply there either: at batch 64, K 7 it kept 256 of 448 drafts, and
    the plain decodes it left held every step to one device round."""
    from k3rt.backend.spec.cost import Ema, StepKind

    prompts, params, expect = workload
    eng = _engine(4, adaptive=True, max_draft_tokens_per_step=3)
    g, drafter = eng.gate, eng.scheduler.drafter
    drafter.threshold = 1.0  # a cut that bites on every request: the confident prefix is then min_verify (1)
    g.fixed_verify_upto = 4  # the padded verify form runs K + 1 rows per request, as the graphs do on CUDA
    for b in (1, 2, 4):  # costs where drafting pays, fixed (nothing learned: the samples are recorded instead)
        g.costs.plain[b], g.costs.verify[b], g.costs.draft[b] = Ema(1.0, 1), Ema(1.1, 1), Ema(0.05, 1)
    for _ in range(g.cfg.explore_samples):
        g.observe(-1, 4, 4)
    g.finish(-1)
    samples, firsts, per_step = [], [], []
    g.observe_step = lambda kind, batch, seconds, drafted=0, rounds=1: samples.append((kind, drafted, rounds))
    g.observe_draft = lambda *a, **k: None
    update = eng.scheduler._update_verify

    def recorded(c, run_, finished):
        left = c.req.params.max_tokens - c.req.num_output
        firsts.append((len(c.draft_ids), left))
        per_step[-1] += sum(d for d, _ in getattr(run_, "rounds", [(len(c.draft_ids), 0)]))
        update(c, run_, finished)

    eng.scheduler._update_verify = recorded
    step = eng.step

    def counted():
        per_step.append(0)
        return step()

    eng.step = counted
    out = run(eng, prompts[1:2], params[1:2])  # 45 tokens, no stop id: several steps of 4 rounds
    assert [o.output_ids for o in out] == expect[1:2]
    assert firsts and all(n == min(7, left - 1) for n, left in firsts), firsts  # every draft, not the cut's 1
    verifies = [(d, r) for k, d, r in samples if k is StepKind.VERIFY]
    assert verifies and any(r > 1 for _, r in verifies)
    # each verify sample: the step's drafts over its rounds, per round (steps that verified, in order)
    assert [d * r for d, r in verifies] == pytest.approx([n for n in per_step if n][:len(verifies)])
