"""The DSpark drafter in the engine (issue 16 §1): target states recorded by the runners, the batched drafter
pass, the confidence-scheduled verify length, and `--spec dspark` / `--spec-model`.

- TargetStates keeps the newest contiguous window of kept positions (unit).
- On tiny random checkpoints of both architectures, reference runner and the GPU runner's torch-op path: every
  DraftQuery.hidden the scheduler hands the drafter equals the dense forward's states at the request's last
  positions (so decode rows, prefill chunks, cache hits and verify runs record exactly the kept rows), and
  greedy speculative output equals plain output token for token, under chunked prefill, prefix-cache hits,
  n > 1, preemption, abort and an oracle that makes most drafts accepted.
- The shipped k3-tiny + k3-tiny-dspark: bf16 greedy identity and tau > 1; the CLI flags and their errors.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from k3rt.backend.engine import Engine
from k3rt.backend.models.loader import CheckpointError
from k3rt.backend.spec.base import Drafter
from k3rt.backend.spec.dspark.checkpoint import save_drafter
from k3rt.backend.spec.dspark.drafter import DSparkDrafter
from k3rt.backend.spec.dspark.model import DSparkConfig, DSparkModel
from k3rt.backend.spec.dspark.target import dense_states
from k3rt.backend.spec.target_states import TargetStates
from k3rt.config import EngineConfig, SpecConfig
from k3rt.models import MODELS_DIR, resolve_drafter_dir
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import assert_at_rest, drain, make_engine, run
from tests.backend.test_spec import _params, _reference, _refs, _workload, arch  # noqa: F401 (fixture)
from tests.backend.threads import single_thread  # noqa: F401  (autouse fixture)



# ---- the store ----

def test_target_states_keep_the_newest_contiguous_window() -> None:
    s = TargetStates((1, 2), window=3)
    rows = torch.arange(20, dtype=torch.float32)[:, None]  # row p holds position p
    s.record(0, 0, rows[0:5])  # a prefill chunk: the last 3 kept
    assert s.get(0)[:, 0].tolist() == [2, 3, 4] and s.end(0) == 5
    s.record(0, 5, rows[5:6])  # a decode
    assert s.get(0)[:, 0].tolist() == [3, 4, 5] and s.end(0) == 6
    s.record(0, 4, rows[4:6])  # recomputing from 4 (after a preemption): rows from 4 on replaced
    assert s.get(0)[:, 0].tolist() == [3, 4, 5] and s.end(0) == 6
    s.record(0, 9, rows[9:10])  # a gap (positions skipped by a cache hit): the old rows go
    assert s.get(0)[:, 0].tolist() == [9] and s.end(0) == 10
    s.record(1, 0, rows[0:1])
    s.check({0, 1})
    with pytest.raises(AssertionError, match=r"ended requests \[1\]"):
        s.check({0})
    s.release(1)
    s.release(1)  # twice is fine (finish and abort paths both release)
    assert len(s) == 1 and s.get(1) is None and s.end(1) is None
    rows[9] = -1.0  # the store holds copies
    assert s.get(0)[:, 0].tolist() == [9]


def test_target_states_pool_equals_rebuilding_each_window() -> None:
    """The pooled store (one [slots, 2 x window, F] buffer, records of a step in one indexed write, rows moved to a
    slot's front when they reach its end, the pool doubled when full) holds what rebuilding each request's window
    per record held: random decodes, prefill chunks, verify runs, recomputes after a preemption, gaps after cache
    hits, releases and new requests, several requests per record_many."""
    import random

    W, rng = 5, random.Random(3)
    s, want, end = TargetStates((1,), window=W), {}, {}
    peak = moved = 0

    def oracle(rid: int, start: int, m: int) -> None:
        pos = list(range(start, start + m))[-W:]
        old = want.get(rid, [])
        if old and end[rid] >= pos[0]:
            before = [p for p in old if p < pos[0]][-(W - len(pos)):] if len(pos) < W else []
            pos = before + pos
        want[rid], end[rid] = pos, start + m

    for _ in range(600):
        spans, used = [], set()
        for _ in range(rng.randint(1, 4)):
            rid = rng.randrange(12)
            if rid in used:
                continue
            used.add(rid)
            e = end.get(rid, 0)
            kind = rng.random()
            start = (e - rng.randint(0, 3) if kind < 0.15 else e + rng.randint(1, 4) if kind < 0.25 else e)
            m = rng.choice([1, 1, 1, 2, 3, 8]) if e else rng.randint(1, 9)
            spans.append((rid, max(start, 0), m))
        rows = torch.cat([torch.arange(st, st + m, dtype=torch.float32)[:, None] * torch.ones(1, 3)
                          for _, st, m in spans])
        bases = {rid: h[1] for rid, h in s._held.items()}
        s.record_many(spans, rows)
        # rows kept from before (lo before the record's first position) under a new base: moved to the front
        moved += sum(rid in bases and s._held[rid][1] != bases[rid] and s._held[rid][2] < st + m - min(m, W)
                     for rid, st, m in spans)
        for rid, st, m in spans:
            oracle(rid, st, m)
        peak = max(peak, len(want))
        if rng.random() < 0.05:
            gone = rng.choice(sorted(want))
            s.release(gone)
            want.pop(gone), end.pop(gone)
        s.check(set(want))
        for rid, pos in want.items():
            got = s.get(rid)
            assert got[:, 0].tolist() == pos and s.held(rid) == len(pos) and s.end(rid) == end[rid], rid
            assert torch.equal(got[:, 2], got[:, 0])  # every feature of the row
    assert len(s) == len(want)
    assert peak > 8 and s._pool.shape[0] == 16  # more requests held at once than the first pool's 8 slots: it grew
    assert moved > 0  # and some request's rows reached its slot's end and moved to the front


# ---- the engine on tiny random checkpoints ----

def _random_drafter(folder: Path, model, *, seed: int = 0, threshold: float = 0.0, min_verify: int = 1) -> Path:
    """The current drafter shape in small: context tokens and a copy head (so the engine's queries must carry
    the window's token ids), with a window longer than the shortest prompts (masked left padding)."""
    cfg = model.cfg
    L = cfg.num_hidden_layers
    dcfg = DSparkConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size,
                        target_layers=(1, L), context_len=12, block_size=5, num_layers=1, num_heads=2, head_dim=16,
                        intermediate_size=64, markov_rank=4, confidence_hidden=8, confidence_threshold=threshold,
                        min_verify=min_verify, context_tokens=True, copy_dim=8)
    d = DSparkModel(dcfg)
    d.init_weights(seed)
    return save_drafter(d, folder, dtype=torch.float32)


class _CheckedDrafter(DSparkDrafter):
    """The real batched pass, after checking that every query's states are the dense forward's at the request's
    last positions; with `refs`, the drafts are then replaced by the true continuation (seeded noise), so most
    verifies accept a prefix and the accepted-row bookkeeping is exercised."""

    def __init__(self, inner: DSparkDrafter, target, refs=None, noise: float = 0.25, *, atol: float = 2e-3,
                 every_other: bool = False) -> None:
        """every_other: draft nothing on every second call, so those steps are plain decodes (CUDA graphs)."""
        self.__dict__.update(inner.__dict__)
        self.target, self.refs, self.rng = target, refs, random.Random(7)
        self.atol, self.every_other, self.calls = atol, every_other, 0
        self.checked = 0
        self.errors: list[str] = []

    # the scheduler asks propose_scored: the base class's, over this propose (no confidences: drafts are replaced)
    propose_scored = Drafter.propose_scored

    def propose(self, queries):
        # the scheduler turns a drafter's exception into "no drafts this step": failures are kept and asserted on
        for q in queries:
            try:
                # every speculating decode has its states, ending right before its anchor (no preemption here)
                assert q.hidden is not None, f"request {q.rid} at {len(q.token_ids)} tokens has no target states"
                ids = torch.tensor(list(q.token_ids[:-1]), device=q.hidden.device)[None]
                _, dense = dense_states(self.target, ids, self.target_layers)
                want = dense[0, -q.hidden.shape[0]:].float()
                torch.testing.assert_close(q.hidden.float(), want, atol=self.atol, rtol=self.atol)
                self.checked += 1
            except AssertionError as e:
                self.errors.append(str(e))
        out = super().propose(queries)
        self.calls += 1
        if self.every_other and self.calls % 2 == 0:
            return [[] for _ in queries]
        if self.refs is None:
            return out
        drafted = []
        for q, d in zip(queries, out):
            full = self.refs[tuple(q.token_ids[:q.prompt_len])]
            cont = full[len(q.token_ids):len(q.token_ids) + len(d)]
            drafted.append([self.rng.randrange(512) if self.rng.random() < 0.25 else t for t in cont])
        return drafted


def _dspark_engine(arch, folder: Path, *, runner: str = "model", k: int = 5, cache: dict | None = None, **engine):
    cache = {"num_pages": 512, **(cache or {})}
    return make_engine(arch.ckpt, runner=runner, model=arch.model, budget=64,
                       engine={"spec": SpecConfig(method="dspark", num_tokens=k, model=str(folder), adaptive=False),
                               **engine}, **cache)


@pytest.mark.parametrize("runner, oracle", [("model", False), ("model", True), ("gpu", True), ("pieces", True)],
                         ids=["reference-drafts", "reference-oracle", "gpu-path-torch-ops-oracle",
                              "gpu-path-pieces-oracle"])
def test_dspark_states_are_exact_and_greedy_output_is_identical(arch, tmp_path, runner, oracle) -> None:
    """pieces: the GPU runner's steps with prefill rows or verify runs through the piecewise forward (run
    eagerly), whose pieces tap the target states the drafter reads."""
    r1, r2 = _workload(seed=3)
    p1, p2 = _params(len(r1), 16), _params(len(r2), 16)
    ref1, ref2 = _reference(arch, r1, p1), _reference(arch, r2, p2)
    folder = _random_drafter(tmp_path / "drafter", arch.model)
    engine = {"kernels": False, "cuda_graphs": False} if runner in ("gpu", "pieces") else {}
    if runner == "pieces":
        engine["mixed_pieces_eager"] = True
    eng = _dspark_engine(arch, folder, runner="gpu" if runner == "pieces" else runner, **engine)
    mixed = getattr(getattr(eng.runner, "inner", eng.runner), "mixed", None)
    if runner == "pieces":
        assert mixed is not None
        forms = []
        mixed_run = mixed.run
        mixed.run = lambda step: forms.append(bool(step.verify_seqs)) or mixed_run(step)
    drafter = _CheckedDrafter(eng.scheduler.drafter, arch.model, _refs(r1 + r2, ref1 + ref2) if oracle else None)
    eng.scheduler.drafter = drafter
    out1 = run(eng, r1, p1)
    out2 = run(eng, r2, p2)
    assert [o.output_ids for o in out1] == ref1
    assert [o.output_ids for o in out2] == ref2
    s = eng.stats
    assert not drafter.errors, drafter.errors[:3]
    assert drafter.checked > 20 and s.spec_verifies > 0
    assert sum(o.cached_tokens for o in out2) > 0  # the repeats hit the prefix cache
    if oracle:
        assert s.spec_accepted_tokens > s.spec_verifies  # most verifies accepted something
    if runner == "pieces":  # prefill steps and verify steps both ran through the pieces
        assert forms.count(True) > 5 and forms.count(False) > 2, forms
    assert len(eng.target_states) == 0  # every finished request's states were freed
    assert_at_rest(eng)


@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_preemption_mid_speculation_keeps_exact_states(arch, tmp_path) -> None:
    """A tiny poisoned pool: requests are preempted (their live state donated) and resumed; the recomputed
    rows replace the old ones and every query's states are still the dense forward's."""
    r1, r2 = _workload(seed=3)
    prompts, params = r1 + r2, _params(len(r1), 24) + _params(len(r2), 24)
    ref = _reference(arch, prompts, params)
    folder = _random_drafter(tmp_path / "drafter", arch.model)
    eng = _dspark_engine(arch, folder, cache={"num_pages": 14, "poison_freed": True})
    drafter = _CheckedDrafter(eng.scheduler.drafter, arch.model, _refs(prompts, ref))
    eng.scheduler.drafter = drafter
    assert [o.output_ids for o in run(eng, prompts, params)] == ref
    assert not drafter.errors, drafter.errors[:3]
    assert eng.stats.preemptions > 0 and eng.stats.spec_accepted_tokens > 0 and drafter.checked > 10
    assert_at_rest(eng)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_gpu_runner_triton_interpreter_states_and_identity(arch, tmp_path) -> None:
    """The GPU runner with its Triton kernels (the interpreter on the CPU): the taps inside GpuForward's K3
    path give the dense forward's states, and greedy output is the plain output."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the compiled path is what runs")
    r1, _ = _workload(seed=3)
    prompts, params = [r1[2], r1[3]], _params(2, 8)
    ref = _reference(arch, prompts, params)
    folder = _random_drafter(tmp_path / "drafter", arch.model)
    eng = _dspark_engine(arch, folder, runner="gpu", kernels=True, cuda_graphs=False)
    drafter = _CheckedDrafter(eng.scheduler.drafter, arch.model, _refs(prompts, ref))
    eng.scheduler.drafter = drafter
    assert [o.output_ids for o in run(eng, prompts, params)] == ref
    assert not drafter.errors, drafter.errors[:3]
    assert drafter.checked > 2 and eng.stats.spec_accepted_tokens > 0
    assert_at_rest(eng)


@pytest.mark.gpu
def test_gpu_runner_cuda_graph_taps_and_identity(arch, tmp_path) -> None:
    """On CUDA with decode graphs: every other step drafts nothing, so plain decode steps replay the graphs and
    their taps (captured inside the graph) feed the next query; states match the dense forward, output the
    plain output."""
    import copy

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = copy.deepcopy(arch.model).cuda()
    r1, _ = _workload(seed=3)
    prompts, params = r1[:4], _params(4, 24)
    ref = _reference(arch, prompts, params)
    folder = _random_drafter(tmp_path / "drafter", arch.model)
    eng = make_engine(arch.ckpt, runner="gpu", model=model, budget=64, num_pages=256,
                      engine={"device": "cuda",
                              "spec": SpecConfig(method="dspark", num_tokens=5, model=str(folder), adaptive=False)})
    assert eng.runner.inner.graphs  # decode graphs captured, with the taps
    drafter = _CheckedDrafter(eng.scheduler.drafter, model, _refs(prompts, ref), atol=2e-2, every_other=True)
    eng.scheduler.drafter = drafter
    replays = []
    replay = eng.runner.inner._replay
    eng.runner.inner._replay = lambda seqs, size, *rest: replays.append(size) or replay(seqs, size, *rest)
    assert [o.output_ids for o in run(eng, prompts, params)] == ref
    assert not drafter.errors, drafter.errors[:3]
    assert replays and drafter.checked > 10 and eng.stats.spec_accepted_tokens > 0
    # the verify steps replayed their graphs too (taps from inside them), and the drafter's pass its own
    assert eng.runner.inner.verify_graph_replays > 0 and drafter.graphs is not None
    assert len(eng.target_states) == 0


@pytest.mark.gpu
def test_drafter_pass_in_cuda_graphs_equals_the_eager_pass(arch, tmp_path) -> None:
    """The drafter's pass replayed from its CUDA graphs (graph.py, one per batch bucket), with its left-to-right
    steps in the fused kernel (kernels/spec, the default on CUDA), gives the eager torch pass's drafts and
    confidences (fp32) for batches inside a bucket, at a bucket's edge and above every bucket (there eagerly,
    still fused); the fused eager pass gives them too."""
    import copy

    from k3rt.backend.spec.base import DraftQuery

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = copy.deepcopy(arch.model).cuda()
    folder = _random_drafter(tmp_path / "drafter", arch.model)
    eager = DSparkDrafter.from_folder(folder, model, fused=False)
    fused = DSparkDrafter.from_folder(folder, model)
    graphed = DSparkDrafter.from_folder(folder, model, graph_sizes=(1, 2, 4, 8))
    assert eager.graphs is None and sorted(graphed.graphs.graphs) == [1, 2, 4, 8]
    assert graphed.fused and graphed.graphs.fused and fused.fused and not eager.fused
    cfg = eager.model.cfg
    width = len(cfg.target_layers) * cfg.target_hidden_size
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 8, 9, 2):  # 9: above every bucket (eager); 2 after 9: the static inputs are refilled
        ctx = torch.randn(n, cfg.context_len, width, generator=gen).cuda()
        # the window's token ids (context positions, then the anchor): a drafter with context tokens or a copy
        # head reads them, and the rows must end right before the anchor
        ids = torch.randint(0, cfg.vocab_size, (n, cfg.context_len + 1), generator=gen).cuda()
        anchors = ids[:, -1].contiguous()
        queries = [DraftQuery(i, ids[i].tolist(), cfg.context_len, cfg.block_size, hidden=ctx[i]) for i in range(n)]
        assert graphed.propose(queries) == eager.propose(queries), n
        assert fused.propose(queries) == eager.propose(queries), n
        if n <= 8:
            extra = {}
            if eager.model.needs_tokens:
                extra = dict(ctx_tokens=ids, ctx_valid=torch.ones(n, cfg.context_len, dtype=torch.bool, device="cuda"))
            tokens, conf = graphed.graphs.draft(ctx, anchors, **extra)
            want_tokens, _, want_conf = eager.model.draft(ctx, anchors, eager.embed, eager.lm_head, **extra)
            assert torch.equal(tokens, want_tokens)
            torch.testing.assert_close(conf, want_conf, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["kimi_linear"], indirect=True)
def test_confidence_zero_is_a_plain_decode_and_abort_frees_states(arch, tmp_path) -> None:
    """threshold 1 with min_verify 0: the confidence head turns every request's speculation off (no verify
    step at all); an abort mid-run leaves no target states behind."""
    prompts = [list(range(3, 40)), list(range(50, 70))]
    params = _params(2, 20)
    ref = _reference(arch, prompts, params)
    off = _random_drafter(tmp_path / "off", arch.model, threshold=1.0, min_verify=0)
    eng = _dspark_engine(arch, off)
    assert [o.output_ids for o in run(eng, prompts, params)] == ref
    assert eng.stats.spec_verifies == 0
    on = _random_drafter(tmp_path / "on", arch.model)
    eng = _dspark_engine(arch, on)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        eng.step()
        eng.check()
    assert len(eng.target_states) == 2 and eng.stats.spec_verifies > 0
    eng.abort(rids[0])
    done = drain(eng)
    assert done[rids[0]].finish_reason == "abort" and done[rids[1]].output_ids == ref[1]
    assert len(eng.target_states) == 0
    assert_at_rest(eng)


@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_sampled_requests_speculate_with_dspark(arch, tmp_path) -> None:
    """temperature > 0 with a seed: the verifier's rejection sampling runs on dspark drafts (its
    distribution is tested in test_spec.py with a table drafter); runs end, tokens are in the vocabulary."""
    folder = _random_drafter(tmp_path / "d", arch.model)
    eng = _dspark_engine(arch, folder)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)]
    out = run(eng, [list(range(5, 30))] * 3, params)
    assert all(len(o.output_ids) == 12 and all(0 <= t < 512 for t in o.output_ids) for o in out)
    assert eng.stats.spec_verifies > 0
    assert_at_rest(eng)


# ---- configuration errors ----

@pytest.mark.parametrize("arch", ["kimi_linear"], indirect=True)
def test_drafter_that_does_not_fit_the_target_is_refused_by_name(arch, tmp_path) -> None:
    # the shipped k3-tiny drafter against a tiny target: vocabulary / width / layer ids disagree
    with pytest.raises(CheckpointError, match="target_layers|target_hidden_size|vocab_size"):
        _dspark_engine(arch, MODELS_DIR / "k3-tiny-dspark", k=4)
    folder = _random_drafter(tmp_path / "d", arch.model)
    with pytest.raises(ValueError, match="spec_tokens: .*block_size=5"):
        _dspark_engine(arch, folder, k=6)
    with pytest.raises(ValueError, match="spec_model: no DSpark drafter ships with"):
        make_engine(arch.ckpt, runner="model", model=arch.model, engine={"spec": SpecConfig(method="dspark")})
    with pytest.raises(ValueError, match="spec_model: .* --spec dspark only"):
        SpecConfig(method="ngram", model=str(folder))
    with pytest.raises(ValueError, match="null runner"):
        make_engine(arch.ckpt, runner="null", engine={"spec": SpecConfig(method="dspark", model=str(folder))})


def test_the_shipped_drafter_is_the_default_for_k3_tiny() -> None:
    assert resolve_drafter_dir(None, "k3-tiny") == MODELS_DIR / "k3-tiny-dspark"
    assert resolve_drafter_dir("k3-tiny-dspark", "/elsewhere") == MODELS_DIR / "k3-tiny-dspark"
    with pytest.raises(ValueError, match="spec_model: /nope is not a folder"):
        resolve_drafter_dir("/nope", "k3-tiny")


# ---- the shipped k3-tiny and its drafter ----

def test_shipped_k3_tiny_dspark_greedy_identity_and_tau() -> None:
    """bf16 k3-tiny with its shipped drafter (default folder): speculative greedy output equals plain output
    token for token, and the drafter's accepted drafts make tau > 1."""
    from k3rt.backend.tokenizer import load_tokenizer

    model_dir = MODELS_DIR / "k3-tiny"
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode_prompt(p) for p in ("def fibonacci(n):", "import os\n\ndef read_lines(path):")]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = Engine(EngineConfig(model=str(model_dir)))
    ref = [o.output_ids for o in plain.generate(prompts, params)]
    eng = Engine(EngineConfig(model=str(model_dir), spec=SpecConfig(method="dspark", num_tokens=7, adaptive=False)))
    assert eng.cfg.spec.model == str(MODELS_DIR / "k3-tiny-dspark")
    out = eng.generate(prompts, params)
    assert [o.output_ids for o in out] == ref
    assert eng.stats.spec_verifies > 0 and eng.stats.spec_tau > 1.0, eng.stats
    assert sum(o.spec_accepted_tokens for o in out) == eng.stats.spec_accepted_tokens
    eng.check()
    assert len(eng.target_states) == 0


def test_cli_generate_with_spec_dspark(capsys) -> None:
    from k3rt.cli import main

    assert main(["generate", "--prompt", "def add(a, b):", "--max-tokens", "12", "--json", "--spec", "dspark",
                 "--spec-tokens", "7"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12 and out["spec"]["verifies"] > 0
    assert main(["generate", "--prompt", "x", "--spec", "ngram", "--spec-model", "k3-tiny-dspark"]) == 2
    assert "spec_model" in capsys.readouterr().err


def test_serve_flags_resolve_the_drafter_and_its_block_size() -> None:
    from k3rt.cli import _spec_config, build_parser

    a = build_parser().parse_args(["serve", "--spec", "dspark"])
    spec = _spec_config(a)
    assert spec.model == str(MODELS_DIR / "k3-tiny-dspark") and spec.num_tokens == 7
    a = build_parser().parse_args(["serve", "--spec", "dspark", "--spec-tokens", "3", "--spec-confidence", "0"])
    spec = _spec_config(a)
    assert spec.num_tokens == 3 and spec.confidence_threshold == 0.0
    a = build_parser().parse_args(["serve", "--spec", "suffix"])
    assert _spec_config(a).num_tokens == 4 and _spec_config(a).model is None
    with pytest.raises(ValueError, match="spec_confidence"):
        _spec_config(build_parser().parse_args(["serve", "--spec", "dspark", "--spec-confidence", "2"]))


@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_a_probe_planned_before_any_request_had_states_is_owed_again(arch, tmp_path) -> None:
    """Regression (session 22's H200 gate, batch 1): the probe owed to the governor's return was planned a step
    ahead (overlap: Scheduler.drafts_next), when recording had only just resumed, so no request had states, the step
    drafted nothing and the probe was spent: the DSpark drafter never verified again after its first three. Such a
    probe is now owed again, and the first step with states probes."""
    from k3rt.backend.spec.cost import Ema
    from k3rt.backend.spec.gate import Plan, Why

    prompts, params = [list(range(3, 40))], _params(1, 48)
    ref = _reference(arch, prompts, params)
    folder = _random_drafter(tmp_path / "drafter", arch.model)
    # synchronous steps: the plan a step ahead (overlap's drafts_next) is set by hand below
    eng = make_engine(arch.ckpt, runner="model", model=arch.model, budget=64, num_pages=512,
                      engine={"spec": SpecConfig(method="dspark", num_tokens=5, model=str(folder)), "overlap": False})
    g = eng.gate
    rid = eng.add_request(prompts[0], params[0])
    while eng.requests[rid].num_output < 2:
        eng.step()
    # costs where drafting does not pay (only a probe verifies), the method measured
    g.costs.plain[1], g.costs.verify[1], g.costs.draft[1] = Ema(1.0, 2, 10**6), Ema(3.0, 2, 10**6), Ema(0.5, 2)
    g.observe_step = g.observe_draft = g.observe_rate = lambda *a, **k: None
    for _ in range(g.cfg.explore_samples):
        g.observe(-1, 5, 0)
    g.finish(-1)
    eng.target_states.release(rid)  # as after a period with the governor off: no states, recording resumed
    verifies = eng.stats.spec_verifies
    eng.scheduler._next_plan = Plan(True, Why.PROBE)  # the probe drafts_next planned a step ahead
    steps = 0
    while eng.scheduler._next_plan is not None:  # the step that takes the plan up
        eng.step()
        steps += 1
        assert steps < 4
    assert eng.stats.spec_verifies == verifies and 1 in g._owed  # nothing to draft: owed again
    # recording resumed: the request drafts again once its states hold MIN_STATE_ROWS positions, and the first step
    # that can probes
    from k3rt.backend.scheduler.scheduler import MIN_STATE_ROWS

    held = []
    for _ in range(MIN_STATE_ROWS + 3):
        eng.step()
        if eng.stats.spec_verifies > verifies:
            break
        held.append(eng.target_states.get(rid).shape[0])
    assert eng.stats.spec_verifies == verifies + 1 and not g._owed
    need = min(MIN_STATE_ROWS, eng.target_states.window)  # this drafter's window may be shorter
    assert held[-1] == need and held == list(range(2, need + 1)), held  # not a step before
    done = drain(eng)
    assert done[rid].output_ids == ref[0]
    assert_at_rest(eng)


@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_a_request_without_states_is_not_asked_and_is_no_drafting_outcome(arch, tmp_path) -> None:
    """Regression (session 19's H200 gate, batch 16): a request whose target states were not recorded (the
    governor had speculation off, so recording was paused) went to the drafter anyway, came back without drafts,
    and the scheduler counted that as a drafting step that gained nothing; every request did so when drafting was
    allowed again, the controller's yield fell to ~0.004 and it never judged drafting worth it (0 verifies at
    batch 16, where drafting with 8 rounds ran 1.4-1.9x plain with the controller off). Such a request now
    decodes plainly without being asked, and the controller hears nothing of it."""
    from k3rt.backend.spec.cost import Ema

    prompts, params = [list(range(3, 40)), list(range(50, 70))], _params(2, 48)
    ref = _reference(arch, prompts, params)
    folder = _random_drafter(tmp_path / "drafter", arch.model)
    eng = make_engine(arch.ckpt, runner="model", model=arch.model, budget=64, num_pages=512,
                      engine={"spec": SpecConfig(method="dspark", num_tokens=5, model=str(folder))})
    g = eng.gate
    for b in (1, 2):  # costs where drafting pays, so every step with states drafts
        g.costs.plain[b], g.costs.verify[b], g.costs.draft[b] = Ema(1.0, 1), Ema(1.1, 1), Ema(0.05, 1)
    g.observe_step = g.observe_draft = lambda *a, **k: None
    for _ in range(g.cfg.explore_samples):
        g.observe(-1, 4, 4)
    g.finish(-1)
    asked, observed = [], []
    propose, observe = eng.scheduler.drafter.propose_scored, g.observe
    eng.scheduler.drafter.propose_scored = lambda qs, full=False: (
        asked.append([(q.rid, q.hidden is None) for q in qs]) or propose(qs, full))
    g.observe = lambda rid, *a, **k: observed.append(rid) or observe(rid, *a, **k)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.stats.spec_verifies < 2:
        eng.step()
    eng.target_states.release(rids[0])  # its states gone, as when recording was paused
    asked.clear(), observed.clear()
    eng.step()
    assert asked and all(not none for qs in asked for _, none in qs), asked  # never asked without states
    assert rids[0] not in observed and rids[1] in observed
    # every request without states, recording paused (as the governor leaves it when it had speculation off):
    # with the governor allowing drafting, recording resumes, and drafting once MIN_STATE_ROWS positions are held
    from k3rt.backend.scheduler.scheduler import MIN_STATE_ROWS

    for r in rids:
        eng.target_states.release(r)
    eng.target_states.paused = True
    verifies = eng.stats.spec_verifies
    g.governor = None  # the costs above decide, not this machine's step times
    for _ in range(MIN_STATE_ROWS + 3):
        eng.step()
    assert eng.stats.spec_verifies > verifies
    done = drain(eng)
    assert [done[r].output_ids for r in rids] == ref
    assert len(eng.target_states) == 0
    assert_at_rest(eng)


def test_a_request_drafts_once_its_states_hold_enough_positions() -> None:
    """Regression (session 22): after recording resumed, a request drafted from a window of 1-2 recorded states;
    replayed on held-out code on the CPU, k3-tiny's drafter drafts at tau 1.8-2.0 from those against 3.5 from its
    full window, and a probe there judged speculation not worth it. A request now drafts once MIN_STATE_ROWS
    positions are held (all of a shorter request's), ending at its next fed position (within `slack`)."""
    from types import SimpleNamespace

    from k3rt.backend.scheduler.scheduler import MIN_STATE_ROWS, Scheduler

    ts = TargetStates([0], window=128)
    sched = SimpleNamespace(target_states=ts)
    ready = lambda req, slack=0: Scheduler._states_ready(sched, req, slack)  # noqa: E731
    req = SimpleNamespace(rid=1, num_computed=100)
    assert not ready(req)  # nothing recorded
    ts.record(1, 100 - 5, torch.zeros(5, 4))  # 5 positions since recording resumed
    assert MIN_STATE_ROWS == 16 and not ready(req)
    ts.record(1, 100, torch.zeros(11, 4))  # 16 held, but ending 11 positions past the request's next one
    assert not ready(req)
    req.num_computed = 111
    assert ready(req) and not ready(SimpleNamespace(rid=1, num_computed=113), 1) and ready(
        SimpleNamespace(rid=1, num_computed=112), 1)  # a step in flight: one position short is ready
    short = SimpleNamespace(rid=2, num_computed=9)
    ts.record(2, 0, torch.zeros(9, 4))  # a 9-token request holds all of its states
    assert ready(short)


def test_recording_resumes_over_the_last_steps_of_a_hold_off() -> None:
    """Scheduler._plan pauses a model drafter's target-state recording while the governor has speculation off, but
    not over the last MIN_STATE_ROWS steps of its hold: the trial of speculation after it starts with states."""
    from types import SimpleNamespace

    from k3rt.backend.scheduler.scheduler import MIN_STATE_ROWS, Scheduler
    from k3rt.backend.spec.gate import Plan, Why

    asked = []
    gate = SimpleNamespace(plan=lambda batch, rids, model_free: Plan(False, Why.OFF),
                           resumes_within=lambda batch, steps: asked.append(steps) or left[0] <= steps)
    sched = SimpleNamespace(gate=gate, stats=SimpleNamespace(spec_plan_whys={}), target_states=TargetStates([0], 128))
    left = [40]
    Scheduler._plan(sched, 4, [])
    assert sched.target_states.paused and asked == [MIN_STATE_ROWS]
    left = [MIN_STATE_ROWS]
    Scheduler._plan(sched, 4, [])
    assert not sched.target_states.paused and sched.stats.spec_plan_whys == {"off": 2}


def test_window_fill_benchmark_smoke(tmp_path) -> None:
    """benchmarks/dspark_window_fill.py (the replay behind MIN_STATE_ROWS) on 2 prompts: a tau per window size, and
    the drafter drafts better from its full window than from one held row."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "wf.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "dspark_window_fill.py"), "--prompts", "2",
                    "--gen-len", "16", "--rows", "1,128", "--out", str(out)], check=True, capture_output=True,
                   timeout=300)
    res = json.loads(out.read_text())
    assert res["context_len"] == 128 and set(res["tau_by_rows"]) == {"1", "128"}
    assert 1.0 <= res["tau_by_rows"]["1"] < res["tau_by_rows"]["128"] <= 1 + res["k"]
