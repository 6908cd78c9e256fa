"""`k3rt bench spec` on the CPU: a tiny run through the CLI gives one row per (workload, batch, drafter), with
the plain and speculative outputs identical and the numbers consistent; bad lists are refused by name."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from k3rt.backend.bench.spec_bench import SpecBenchConfig
from k3rt.cli import main


def test_bench_spec_tiny_cpu_run(capsys, tmp_path) -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "spec.json"
        assert main(["bench", "spec", "--workloads", "code,agent", "--batch-sizes", "1,2", "--drafters",
                     "ngram,dspark", "--max-tokens", "8", "--turns", "2", "--prompt-len", "32", "--json",
                     "--out", str(out), "--no-spec-adaptive", "--requests", "1", "--trace"]) == 0
    finally:
        torch.set_num_threads(n)
    rows = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == rows
    assert [(r["workload"], r["batch"], r["drafter"]) for r in rows] == [
        (w, b, d) for w in ("code", "agent") for b in (1, 2) for d in ("ngram", "dspark")]
    assert all(r["identical"] for r in rows)
    assert all(r["plain_step_ms"] > 0 and r["tokens_per_s_plain"] > 0 and r["tokens_per_s_spec"] > 0 for r in rows)
    for r in rows:
        assert r["skipped"] == 0 and 0.0 <= r["spec_share"] <= 1.0  # no controller: nothing skipped
        assert r["plan_whys"] == {} and r["controller"] == {}  # ... no plans, no controller state
        assert r["whys_by_round"] == [{}] and r["controller_by_round"] == []  # --trace's per round: the same
        if r["verifies"]:
            assert 1.0 <= r["tau"] <= 1 + r["spec_tokens"] and r["verify_step_ms"] > 0 and r["spec_share"] > 0
            assert r["speedup"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_plain"])
    dspark = [r for r in rows if r["drafter"] == "dspark"]
    assert all(r["draft_ms"] > 0 for r in dspark) and sum(r["verifies"] for r in dspark) > 0
    # graphs are a CUDA thing: on the CPU every verify step and drafter pass runs eagerly, and the rows say so
    assert all(r["graph_verifies"] == 0 and not r["drafter_graphs"] for r in rows)
    # where the time went: step calls by kind (their ms add up to the run's wall time with "other"), the drafter
    # inside them; a run with verifies has verify calls, a plain run none
    for r in rows:
        spec, plain = r["time_spec"], r["time_plain"]
        assert "verify" not in plain and "draft" not in plain and plain["prefill"][0] >= 1
        assert (r["verifies"] > 0) == ("verify" in spec)
        assert spec["draft"][0] >= 1 and spec["draft"][1] > 0
        assert set(spec) <= {"prefill", "verify", "plain_sync", "plain_overlap", "drain", "draft", "other"}
        tokens = r["batch"] * 8 * (2 if r["workload"] == "agent" else 1)
        wall_ms = sum(v[1] for k, v in spec.items() if k != "draft")
        assert wall_ms == pytest.approx(1e3 * tokens / r["tokens_per_s_spec"], abs=0.01)  # ms rounded to 3 places
        # --trace: a line per step call; its last two fields, the device rounds planned (one on the CPU's reference
        # runner) and the tokens the call delivered, which add up to the run's
        for trace in (r["trace_plain"], r["trace_spec"]):
            assert trace and all(len(t) == 9 and t[7] in (0, 1) for t in trace)
            assert sum(t[8] for t in trace) == tokens


def test_step_times_are_measured_under_overlap_scheduling(monkeypatch) -> None:
    """On the GPU runner overlap is on by default and the engine never calls the runner's execute: the step
    times were all 0.00 on the H200 when the bench timed execute. It times engine steps now (the reference
    runner overlaps here, computing eagerly, which the engine cannot tell apart).
    And every measured run follows an untimed one on the same prompts: on the H200 the first method's runs timed
    the kernels' compiles for their shapes (plain k3-tiny at 30 tokens/s, so every speedup read ~15x). That
    warm-up prefills every prompt length its measured run prefills, every agent turn included, at most
    WARMUP_TOKENS per request and turn, the same number of new prompt tokens per turn (up to the prefix cache's
    page rounding): it ran only the first turn (as "code"), and the measured agent runs then compiled for their
    later turns' shapes (plain agent b1 at 29 tokens/s against 767 for code b1)."""
    from k3rt.backend.bench import spec_bench
    from k3rt.backend.engine import Engine
    from k3rt.backend.spec.ngram import NgramDrafter

    calls, generated = [], []
    real = spec_bench._run
    real_generate = Engine.generate

    def generate_spy(self, prompts, params, *a, **kw):
        before = self.stats.computed_prompt_tokens
        out = real_generate(self, prompts, params, *a, **kw)
        # the engine, the prompt tokens prefilled (past the cached prefix), the tokens generated per request
        generated.append((id(self), self.stats.computed_prompt_tokens - before, params.max_tokens,
                          self.layout.block_size))
        return out

    monkeypatch.setattr(Engine, "generate", generate_spy)
    # a slow drafter: its time must land in draft_ms, not in the verify step's (the scheduler drafts inside
    # the engine step; the H200 table's verify column included the drafter's pass)
    slow = NgramDrafter.propose
    delay = [0.2]

    def slow_propose(self, queries):
        time.sleep(delay[0])
        return slow(self, queries)

    monkeypatch.setattr(NgramDrafter, "propose", slow_propose)

    def spy(eng, prompts, cfg, tok, workload, **kw):
        calls.append((id(eng), prompts, cfg.max_tokens))
        return real(eng, prompts, cfg, tok, workload, **kw)

    monkeypatch.setattr(spec_bench, "_run", spy)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = SpecBenchConfig(workloads=("agent",), batch_sizes=(1,), drafters=("ngram",), max_tokens=12, turns=2,
                              overlap=True, spec_adaptive=False, requests=1)
        rows = spec_bench.bench_spec(cfg, progress=False)
        first, first_generated = list(calls), list(generated)
        # with the speculation controller, a drafter whose pass costs 50 ms (a few plain steps) is turned down:
        # most steps decode plainly (overlapped), only explorations and probes draft
        delay[0] = 0.05
        (gated,) = spec_bench.bench_spec(replace(cfg, spec_adaptive=True), progress=False)
    finally:
        torch.set_num_threads(n)
    assert gated.identical and gated.skipped > 0 and gated.spec_share < 0.5
    calls = first
    (r,) = rows
    assert r.plain_step_ms > 0 and r.verifies and r.verify_step_ms > 0 and r.identical
    assert r.draft_ms >= 200 and r.verify_step_ms < 200
    assert r.step_speedup == pytest.approx(r.plain_step_ms * r.tau / (r.verify_step_ms + r.draft_ms))
    measured = [i for i, c in enumerate(calls) if c[2] == 12]
    assert len(measured) == 2  # plain, ngram
    for i in measured:  # an earlier call on the same engine, same prompts, fewer tokens (the warm-up)
        assert any(c[0] == calls[i][0] and c[1] == calls[i][1] and c[2] < 12 for c in calls[:i])
    # turn by turn (generate calls: warm-up turns, then the measured run's turns, per method): the same lengths
    warm = [g for g in first_generated if g[2] < 12]
    timed = [g for g in first_generated if g[2] == 12]
    assert len(warm) == len(timed) == 4  # (plain, ngram) x 2 turns
    assert all(g[2] <= spec_bench.WARMUP_TOKENS for g in warm)
    assert [g[0] for g in warm] == [g[0] for g in timed]  # the same engines, in order
    assert warm[0][1] == timed[0][1] and warm[2][1] == timed[2][1]  # first turns: the same prompts
    for w_, t_ in zip(warm, timed):  # later turns: the history cached up to a page boundary
        assert abs(w_[1] - t_[1]) < w_[3] and t_[1] > 0, (warm, timed)
    assert all(r.compiles_plain == r.compiles_spec == 0 for r in rows)  # the CPU compiles nothing


def _timed_bench(monkeypatch, drafters: tuple[str, ...], rounds: int, walls: list[float]):
    """`bench_spec` on code at batch 1 (10 tokens, 1 request) with the measured runs' wall times replaced by `walls`
    in call order -> (the engines of the measured runs in order, the rows)."""
    from k3rt.backend.bench import spec_bench
    from k3rt.backend.spec.suffix import SuffixDrafter

    order, real, it = [], spec_bench._run, iter(walls)

    def spy(eng, prompts, cfg, tok, workload, **kw):
        r = real(eng, prompts, cfg, tok, workload, **kw)
        if cfg.max_tokens == 10:  # a measured run (warm-ups generate WARMUP_TOKENS)
            d = eng.scheduler.drafter
            order.append("plain" if d is None else "suffix" if isinstance(d, SuffixDrafter) else "ngram")
            r = replace(r, wall_s=next(it))
        return r

    monkeypatch.setattr(spec_bench, "_run", spy)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = SpecBenchConfig(workloads=("code",), batch_sizes=(1,), drafters=drafters, max_tokens=10,
                              prompt_len=16, rounds=rounds, requests=1)
        return order, spec_bench.bench_spec(cfg, progress=False)
    finally:
        torch.set_num_threads(n)


def test_rounds_alternate_the_engines_and_pair_each_speculative_run_with_a_plain_one(monkeypatch) -> None:
    """Regression (session 16): each engine ran all its rows before the next engine was built, so a speculative
    run was compared with a plain run minutes earlier; the H200 machine's host speed drifts by up to 1.35x over
    tens of seconds (the same plain engine: 1.02 then 1.34 ms per step, benchmarks/spec_upkeep.py), and a row's
    speedup read that drift. Now every engine is alive at once, they take turns per round (the first rotating),
    and the speedup is the median of the rounds' own ratios."""
    order, (row,) = _timed_bench(monkeypatch, ("ngram",), 3, [1.0, 2.0, 4.0, 2.0, 1.0, 3.0])
    assert order == ["plain", "ngram", "ngram", "plain", "plain", "ngram"]
    # rounds' ratios: (t / 2) / (t / 1), (t / 4) / (t / 2), (t / 3) / (t / 1) -> median 0.5
    assert row.speedups == pytest.approx([0.5, 0.5, 1 / 3], abs=1e-4) and row.speedup == pytest.approx(0.5)
    assert row.identical


def test_each_drafters_ratio_pairs_it_with_an_adjacent_plain_run_of_its_own(monkeypatch) -> None:
    """Regression (session 22): a round ran one plain run and then every drafter, each drafter's ratio reading that
    one plain run; on the H200, k3-tiny's code at batch 64 (speculating in under 1% of steps) measured 0.96-0.98 in
    round 1 and 0.73-0.77 in round 2 for all three drafters alike. Now each drafter runs next to a plain run of
    its own, plain first and second in turn, and its ratios read that run."""
    order, (ngram, suffix) = _timed_bench(monkeypatch, ("ngram", "suffix"), 2, [1.0, 2.0, 3.0, 6.0, 8.0, 2.0, 5.0, 5.0])
    assert order == ["plain", "ngram", "suffix", "plain", "suffix", "plain", "plain", "ngram"]
    # ngram: (t / 2) / (t / 1), then (t / 5) / (t / 5); suffix: (t / 3) / (t / 6), then (t / 8) / (t / 2)
    assert ngram.speedups == pytest.approx([0.5, 1.0], abs=1e-4)
    assert suffix.speedups == pytest.approx([2.0, 0.25], abs=1e-4)
    assert ngram.identical and suffix.identical


@pytest.mark.parametrize("kw, field", [({"drafters": ("eagle",)}, "drafters"), ({"workloads": ()}, "workloads"),
                                       ({"batch_sizes": (0,)}, "batch_sizes"), ({"turns": 0}, "turns"),
                                       ({"rounds": 0}, "rounds"), ({"requests": 0}, "requests"),
                                       ({"waves": 0}, "waves")])
def test_bench_spec_config_errors_name_the_field(kw, field) -> None:
    with pytest.raises(ValueError, match=field):
        SpecBenchConfig(**kw)


def test_a_row_runs_its_requests_in_waves_of_the_batch(monkeypatch) -> None:
    """Regression (session 21): a row ran exactly `batch` requests, so a batch-1 row timed one prompt. The H200
    gate's batch-1 code row read tau 2.52 (one prompt, k3-tiny + its drafter) against 3.97 over the drafter's 32
    held-out prompts, and its speedup was that prompt's luck. A row now runs `requests` (rounded up to whole
    waves) in waves of `batch` submitted together, every agent turn of a wave before the next wave."""
    from k3rt.backend.bench import spec_bench
    from k3rt.backend.engine import Engine

    waves, real_generate = [], Engine.generate

    def generate_spy(self, prompts, params, *a, **kw):
        if params.max_tokens == 10:  # measured runs (the warm-up generates WARMUP_TOKENS)
            waves.append((self.scheduler.drafter is None, [list(p) for p in prompts]))
        return real_generate(self, prompts, params, *a, **kw)

    monkeypatch.setattr(Engine, "generate", generate_spy)
    cfg = SpecBenchConfig(workloads=("agent",), batch_sizes=(2,), drafters=("ngram",), max_tokens=10,
                          prompt_len=16, turns=2, requests=3, spec_adaptive=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (agent,) = spec_bench.bench_spec(cfg, progress=False)
    finally:
        torch.set_num_threads(n)
    assert agent.requests == 4 and spec_bench.requests_per_row(2, 3) == 4
    # the gate's defaults (8 requests, 4 waves at least): batch 1 runs 8 prompts, batch 64 four waves
    assert [spec_bench.requests_per_row(b, 8, 4) for b in (1, 4, 16, 64)] == [8, 16, 64, 256]
    plain = [w for is_plain, w in waves if is_plain]
    assert [len(w) for w in plain] == [2] * 4  # 2 waves x 2 turns
    # a wave's second turn resends its first turn's prompts, before the next wave starts
    first, second, third = plain[0], plain[1], plain[2]
    assert all(b[:len(a)] == a for a, b in zip(first, second))
    assert not any(c[:len(a)] == a for a, c in zip(first, third))
    # every measured token is counted: 4 requests x 10 tokens x 2 turns per run
    assert agent.identical
    wall_ms = sum(v[1] for k, v in agent.time_spec.items() if k != "draft")
    assert wall_ms == pytest.approx(1e3 * 4 * 10 * 2 / agent.tokens_per_s_spec, abs=0.01)
    # code: four different prompts, the first two the ones a one-wave row runs
    from k3rt.backend.tokenizer import load_tokenizer

    tok = load_tokenizer("k3-tiny")
    code = spec_bench._prompts(replace(cfg, workloads=("code",)), tok, "code", 2)
    assert len(code) == 4 and len({tuple(p) for p in code}) == 4
    assert code[:2] == spec_bench._prompts(replace(cfg, workloads=("code",), requests=1), tok, "code", 2)


def test_bench_code_prompts_are_the_drafters_held_out_prompts() -> None:
    """The bench cannot import k3rt.training (serving code); its code prompts must still be the held-out
    windows the drafter's evaluation draws."""
    from k3rt.backend.bench.spec_bench import CODE_MODULES, _code_prompts
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.training.corpus import HELDOUT_MODULES
    from k3rt.training.dspark import code_prompts

    assert CODE_MODULES == HELDOUT_MODULES
    assert _code_prompts(load_tokenizer("k3-tiny"), 3, 32, seed=5) == code_prompts("heldout", 3, 32, seed=5)


def test_bench_spec_cli_refuses_a_bad_list(capsys) -> None:
    assert main(["bench", "spec", "--batch-sizes", "1,x"]) == 2
    assert "batch_sizes" in capsys.readouterr().err



def test_a_drafter_that_raises_is_counted_and_voids_the_bench(monkeypatch) -> None:
    """Regression (session 20, H200): the bench's timing wrapper of propose_scored took one argument after the
    scheduler began passing two; every drafter call raised, the scheduler decoded without drafts as it should, and
    the gate printed a full table of plain-decoding rows under the drafter's name. The engine counts such calls
    (stats, /metrics k3rt_spec_drafter_errors) and the bench refuses a measured run that had any."""
    from k3rt.backend.bench import spec_bench
    from k3rt.backend.spec.ngram import NgramDrafter

    def broken(self, queries):
        raise ValueError("a drafter bug")

    monkeypatch.setattr(NgramDrafter, "propose", broken)
    cfg = SpecBenchConfig(workloads=("code",), batch_sizes=(1,), drafters=("ngram",), max_tokens=6,
                          spec_adaptive=False, requests=1)
    with pytest.raises(RuntimeError, match=r"the drafter raised in \d+ calls of a measured run"):
        spec_bench.bench_spec(cfg, progress=False)


def _spec_gate_module():
    """benchmarks/spec_gate.py as a module (the script puts benchmarks/ first on the path: not for the other tests)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_gate.py"
    spec = importlib.util.spec_from_file_location("spec_gate", path)
    gate = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(gate)
    finally:
        sys.path[:] = saved
    return gate


def test_the_gates_plain_spread_is_the_noise_of_a_rows_plain_runs() -> None:
    """Each drafter of a (workload, batch) ran plain runs of one configuration: their max / min - 1 is the row's
    noise floor, per (workload, batch)."""
    gate = _spec_gate_module()
    rows = [{"workload": w, "batch": b, "drafter": d, "tokens_per_s_plain": t}
            for w, b, d, t in [("code", 64, "ngram", 18026.0), ("code", 64, "suffix", 17393.0),
                               ("code", 64, "dspark", 21761.0), ("chat", 64, "ngram", 30000.0), ("code", 1, "ngram", 900.0)]]
    gate.add_plain_spread(rows)
    assert [round(r["plain_spread"], 4) for r in rows] == [0.2511] * 3 + [0.0, 0.0]


def test_the_gates_correctness_check_fails_a_row_that_never_verified() -> None:
    """benchmarks/spec_gate.py's check (regression, session 22: its 18 rows with the controller on verified 0 times
    on the H200 and still said "identical"): every row identical, and each every-step row must have verified."""
    from types import SimpleNamespace

    gate = _spec_gate_module()
    row = lambda drafter, identical=True, verifies=3: SimpleNamespace(  # noqa: E731
        workload="code", batch=1, drafter=drafter, identical=identical, verifies=verifies)
    assert gate.check_verdict([row("ngram", verifies=0)], [row("ngram")]) == (True, [])
    assert gate.check_verdict([row("ngram")], [row("ngram"), row("dspark", verifies=0)]) == (True, ["code/b1/dspark"])
    assert gate.check_verdict([row("ngram", identical=False)], [row("ngram")]) == (False, [])
