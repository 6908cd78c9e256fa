"""Piecewise graphs for steps with prefill rows (backend/runner/gpu/pieces.py, issue 18).

CPU: the piecewise form run eagerly (the replayed path less the capture: padding rows, static boundary buffers,
eager cores on the real rows) equals the eager step: logits and every cache page, over two consecutive steps (a
chunk continuing, decodes advancing, a snapshot), on the torch-op path and the Triton interpreter, for both
architectures (K3: attention residuals cross the boundaries); the engine's greedy tokens with it equal the
reference runner's; the pieces (with the Triton kernels) issue no op that reads device values on the host.
GPU: the replayed pieces against the eager step, bf16, requests continuing across steps.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.tiny import make_tiny, two_layer_overrides
from k3rt.backend.runner.gpu.pieces import Boundary, PiecewiseForward, mixed_buckets_for
from k3rt.backend.runner.gpu.step import StepSeq
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import staggered

HAS_CUDA = torch.cuda.is_available()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def _two_steps(eng, seed: int, num_decodes: int, verify: bool = False) -> list[list[StepSeq]]:
    """Two consecutive steps over fresh random cache contents: decodes at random contexts beside a new request's
    21-token chunk, then the decodes' next tokens beside the chunk's 43-token continuation (which ends with a
    snapshot at 64). The pool is filled with small random values. verify: the first decode's second step is a
    verify run of 1 + 4 tokens."""
    pool, bs = eng.pool, eng.layout.block_size
    per_set = eng.layout.pages_per_state_set
    g = torch.Generator().manual_seed(seed)
    decs = []
    for _ in range(num_decodes):
        ctx = int(torch.randint(1, 2 * bs, (1,), generator=g))
        decs.append(StepSeq([int(torch.randint(3, 500, (1,), generator=g))], ctx, pool.allocate(-(-(ctx + 2) // bs)),
                            pool.allocate(per_set), True))
    prompt = torch.randint(3, 500, (64,), generator=g).tolist()
    table, states = pool.allocate(-(-64 // bs)), pool.allocate(per_set)
    snap = [(64, pool.allocate(per_set))]  # the KDA state after the chunk, into a state set of its own
    first = decs + [StepSeq(prompt[:21], 0, table, states, False)]
    second = [StepSeq([int(torch.randint(3, 500, (1,), generator=g))], d.start + 1, d.block_table, d.state_pages, True)
              for d in decs] + [StepSeq(prompt[21:], 21, table, states, True, snap)]
    if verify:  # the first decode verifies 4 drafts in the second step: its states stay, its commit inputs kept
        d = second[0]
        second[0] = StepSeq(d.token_ids + torch.randint(3, 500, (4,), generator=g).tolist(), d.start, d.block_table,
                            d.state_pages, True, verify=True)
    # the MLA view last: its pairs read as fp32 state are finite where a state's halves read as latents need not be
    for v in pool.conv + pool.rec + pool.mla:
        if v is not None:
            v.copy_(0.1 * torch.randn(v.shape, generator=g))
    return [first, second]


def _piecewise_equals_eager(eng, steps: list[list[StepSeq]], logits_rel: float, pool_tol: float) -> None:
    runner, pool = eng.runner, eng.pool
    before = [t.clone() for t in pool.tensors]

    def run(forward, tapped) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
        for t, b in zip(pool.tensors, before):
            t.copy_(b)
        outs, kept = [], []
        for seqs in steps:
            step = runner._build(seqs, [])
            outs.append(forward(step).clone())
            # the taps and the verify runs' commit inputs, as each forward left them
            kept.append(({i: t.clone() for i, t in tapped().items()},
                         {i: [t.clone() for t in ts] for i, ts in step.verify_inputs.items()}))
        return outs, [t.clone() for t in pool.tensors], kept

    want, want_pool, want_kept = run(lambda step: runner.fwd(step), lambda: runner.fwd.tapped)
    assert runner.mixed is not None
    got, got_pool, got_kept = run(lambda step: runner.mixed.run(step), lambda: runner.mixed.tapped)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel(g, w) < logits_rel
        if logits_rel <= 1e-4:  # fp32; in bf16 a near-tie may flip
            assert torch.equal(g.argmax(-1), w.argmax(-1))
    for (gt, gv), (wt, wv) in zip(got_kept, want_kept):
        assert gt.keys() == wt.keys() == runner.fwd.taps and gv.keys() == wv.keys()
        for i in wt:
            assert gt[i].shape == wt[i].shape and rel(gt[i], wt[i]) < logits_rel
        for i in wv:
            for a, b in zip(gv[i], wv[i]):
                assert a.shape == b.shape and rel(a, b) < logits_rel
    for a, b, old in zip(got_pool, want_pool, before):
        # the pages the eager steps left alone stay bit for bit as they were (padding rows wrote no page)
        untouched = (b == old).all(dim=1)
        assert untouched.any() and torch.equal(a[untouched], old[untouched])
        # and the cores wrote the others as the eager steps did (bit patterns viewed as fp32)
        a, b = a.view(torch.float32), b.view(torch.float32)
        if pool_tol <= 1e-4:
            torch.testing.assert_close(a, b, rtol=pool_tol, atol=pool_tol)
        else:  # bf16: a routing flip in one row may move its later layers' latents more than elementwise bounds
            assert rel(a, b) < pool_tol


@pytest.mark.parametrize("kernels", [False, True], ids=["torch_ops", "interpreter"])
@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_piecewise_form_run_eagerly_equals_the_eager_step(arch, kernels, tmp_path) -> None:
    """fp32: two consecutive mixed steps (3 decodes + a chunk of 21, then + its 43-token continuation with a
    snapshot) through the pieces padded to buckets 32 and 64 equal the eager steps, logits and caches."""
    if kernels and HAS_CUDA:
        pytest.skip("on a GPU the replayed pieces are tested (test_replayed_mixed_steps_equal_eager_on_cuda)")
    # the interpreter runs two layers (each kind once): its cost is per layer
    ckpt = make_tiny(tmp_path / arch, arch=arch, dtype="float32", seed=9,
                     overrides=two_layer_overrides(arch) if kernels else None)
    eng = Engine(replace(engine_config_for_tests(str(ckpt), num_pages=64), runner="gpu", kernels=kernels,
                         cuda_graphs=False))
    eng.runner.mixed = PiecewiseForward(eng.runner.fwd, (32, 64, 128))
    steps = _two_steps(eng, seed=3, num_decodes=3)
    _piecewise_equals_eager(eng, steps, logits_rel=1e-5, pool_tol=1e-5)
    assert eng.runner.mixed.runs == 2 and eng.runner.mixed.replays == 0
    # the boundary buffers: one per name, as tall as the largest bucket, shared by every layer of a kind
    bufs = eng.runner.mixed.buf.bufs
    assert {b.shape[0] for b in bufs.values()} == {128}
    assert {"kda.qkv", "kda.o", "mla.q", "mla.o", "final"} <= bufs.keys()


@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_piecewise_form_taps_target_states_and_runs_verify_runs(arch, tmp_path) -> None:
    """fp32, torch ops: a model drafter's taps (the first layer's input, a middle one, the final norm's output)
    and a verify run of 1 + 4 tokens in the mixed step: through the pieces the tapped states, the verify run's
    kept commit inputs, the logits and the caches equal the eager step's (the pieces were off with a dspark
    drafter, and for verify runs, until session 15)."""
    ckpt = make_tiny(tmp_path / arch, arch=arch, dtype="float32", seed=9)
    eng = Engine(replace(engine_config_for_tests(str(ckpt), num_pages=64), runner="gpu", kernels=False,
                         cuda_graphs=False))
    L = len(eng.runner.fwd.layers)
    eng.runner.fwd.taps = frozenset({0, L // 2, L})
    eng.runner.mixed = PiecewiseForward(eng.runner.fwd, (32, 64, 128))
    steps = _two_steps(eng, seed=4, num_decodes=3, verify=True)
    assert eng.runner._build(steps[1], []).verify_seqs == [0]
    _piecewise_equals_eager(eng, steps, logits_rel=1e-5, pool_tol=1e-5)
    assert eng.runner.mixed.runs == 2 and {"tap0", f"tap{L // 2}"} <= eng.runner.mixed.buf.bufs.keys()
    assert eng.runner._mixed_bucket(eng.runner._build(steps[1], [])) == 64  # the runner takes the pieces for it


def test_engine_greedy_with_mixed_steps_run_piecewise_equals_reference(tmp_path) -> None:
    """The runner routes steps with prefill rows (requests arriving while others decode, a prompt over several
    chunks, prompt logprob rows) through the pieces: the reference engine's greedy tokens and prompt logprobs."""
    ckpt = make_tiny(tmp_path / "m", arch="k3", dtype="float32", seed=9)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 70, 130, 1, 33, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(**over):
        cfg = replace(engine_config_for_tests(str(ckpt), num_pages=128), **over)
        eng = Engine(replace(cfg, scheduler=replace(cfg.scheduler, max_num_batched_tokens=64)))
        if over["runner"] == "gpu":
            eng.runner.mixed = PiecewiseForward(eng.runner.fwd, mixed_buckets_for(64))
        rids, out, scores, step = [], {}, {}, 0
        while len(rids) < len(prompts) or eng.has_unfinished:
            if len(rids) < len(prompts) and step % 2 == 0:
                rids.append(eng.add_request(prompts[len(rids)], params, prompt_logprobs_from=2 if len(rids) == 2
                                            else None))
            for o in eng.step():
                if o.finished:
                    out[o.rid], scores[o.rid] = o.output_ids, o.prompt_logprobs
            step += 1
        eng.check()
        return [out[r] for r in rids], scores[rids[2]], eng.runner

    want, want_scores, _ = run(runner="model")
    got, got_scores, runner = run(runner="gpu", kernels=False, cuda_graphs=False)
    assert got == want
    assert got_scores.keys() == want_scores.keys()
    assert max(abs(got_scores[k] - want_scores[k]) for k in want_scores) < 1e-4
    assert runner.mixed.runs >= 8  # most steps were mixed


def test_mixed_buckets_follow_the_token_budget() -> None:
    assert mixed_buckets_for(2048)[-1] == 2048 and mixed_buckets_for(2000)[-1] == 2048
    assert mixed_buckets_for(100) == (32, 64, 96, 128)
    assert mixed_buckets_for(10_000)[-1] == 4096  # larger steps run eagerly
    with pytest.raises(ValueError, match="max_tokens: must be >= 1"):
        mixed_buckets_for(0)


def test_boundary_buffers_are_shared_and_typed() -> None:
    buf = Boundary(8, torch.device("cpu"))
    a = buf.put("x", torch.ones(3, 2))
    b = buf.put("x", torch.full((5, 2), 2.0))
    assert a.data_ptr() == b.data_ptr() and buf.bufs["x"].shape == (8, 2)
    assert torch.equal(buf.bufs["x"][:5], torch.full((5, 2), 2.0)) and torch.equal(buf.bufs["x"][5:], torch.zeros(3, 2))
    assert buf.put("x", b) is b  # already in place: no copy
    with pytest.raises(ValueError, match="boundary 'x'"):
        buf.put("x", torch.ones(2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_replayed_mixed_steps_equal_eager_on_cuda(arch, tmp_path) -> None:
    """bf16 on CUDA: mixed steps replayed from the captured pieces (40 decodes + a chunk, then the decodes' next
    tokens + the chunk's continuation with a snapshot: the states and KV the eager cores wrote in step one feed
    step two) give the eager steps' logits within bf16 tolerance and the same caches; the engine then runs its
    mixed steps from the graphs and gives the reference engine's fp32 greedy tokens."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    ckpt = make_tiny(tmp_path / arch, arch=arch, dtype="float32", seed=9)
    eng = Engine(replace(engine_config_for_tests(str(ckpt), num_pages=512, kv_dtype="bfloat16", conv_dtype="bfloat16"),
                         device="cuda", dtype="bfloat16", runner="gpu"))
    mixed = eng.runner.mixed
    assert mixed is not None and set(mixed.graphs) == set(mixed.buckets)
    steps = _two_steps(eng, seed=4, num_decodes=40)
    _piecewise_equals_eager(eng, steps, logits_rel=2e-2, pool_tol=2e-2)
    assert mixed.replays == 2

    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 70, 130, 1, 33, 9, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(**over):
        cfg = replace(engine_config_for_tests(str(ckpt), num_pages=256), **over)
        # every arrival admitted at once (no admission batching): most steps mix
        e = Engine(replace(cfg, scheduler=replace(cfg.scheduler, max_num_batched_tokens=128, prefill_delay_steps=0)))
        return staggered(e, prompts, params, every=2), e.runner

    got, runner = run(runner="gpu", device="cuda")
    assert runner.mixed is not None and runner.mixed.replays >= 8  # 9 mixed steps of 30 (the same run on the CPU)
    want, _ = run(runner="model")
    assert got == want


# torch ops that read device values on the host or size their output by them: a capture would fail on them or
# bake in one step's values
_HOST_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave",
             "bincount", "is_nonzero", "equal"}


@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_pieces_read_nothing_back_on_the_host(arch, tmp_path) -> None:
    """Capture safety of what the graphs hold, on the CPU: every piece of every bucket, with the Triton kernels
    (launches counted, not run), issues no torch op that reads device values on the host or has a data-dependent
    shape (the MoE router and grouped experts, norms, the attention-residual mix, the projections)."""
    from tests.backend.test_gpu_runner import _LaunchWork

    ckpt = make_tiny(tmp_path / arch, arch=arch, dtype="float32", seed=9)
    eng = Engine(replace(engine_config_for_tests(str(ckpt), num_pages=64), runner="gpu", cuda_graphs=False))
    assert eng.runner.fwd.k.triton
    mixed = PiecewiseForward(eng.runner.fwd, (32, 64))
    for n in mixed.buckets:
        for j in range(mixed.num_layers + 1):
            # the boundary buffers (a capture allocates none); what the kernels would write there does not matter
            # to which ops the piece issues, so under the interpreter its launches are skipped here too
            with _LaunchWork():
                mixed._piece(j, 64)
            with _LaunchWork() as work:
                mixed._piece(j, n)
            assert work.triton > 0 and not _HOST_OPS & set(work.torch_ops), (n, j, work.torch_ops)


@pytest.mark.gpu
def test_a_long_prefill_takes_the_split_router_inside_the_pieces_on_cuda(tmp_path, monkeypatch) -> None:
    """bf16 on CUDA with a 2,048-token budget: the 1,100-token prompt's steps pad to buckets of >= 1,024 rows, whose
    captured pieces compute the router's logits from the weight's bf16 parts (KernelConfig.split_router_min_rows);
    the engine gives the greedy tokens of the same engine with torch's fp32 router (the split only ever replaces
    that router, bf16 activations being what it takes; a reference engine in fp32 would differ by bf16 rounding)."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    from functools import partial

    import k3rt.backend.runner.gpu.ffn as ffn
    import k3rt.backend.runner.gpu.runner as runner_mod

    rows: list[int] = []
    real = ffn.split_router

    def spy(x, parts):
        rows.append(x.shape[0])
        return real(x, parts)
    monkeypatch.setattr(ffn, "split_router", spy)
    ckpt = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="float32", seed=9)
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1100, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run():
        cfg = replace(engine_config_for_tests(str(ckpt), num_pages=512, kv_dtype="bfloat16", conv_dtype="bfloat16"),
                      runner="gpu", device="cuda", dtype="bfloat16")
        e = Engine(replace(cfg, scheduler=replace(cfg.scheduler, max_num_batched_tokens=2048, prefill_delay_steps=0)))
        return staggered(e, prompts, params, every=1), e.runner

    got, runner = run()
    assert runner.mixed is not None and max(runner.mixed.buckets) >= 1024 and runner.mixed.replays >= 1
    assert rows and min(rows) >= 1024  # captured (a replay calls no Python), and only at prefill sizes
    monkeypatch.setattr(runner_mod, "KernelConfig", partial(runner_mod.KernelConfig, split_router_min_rows=0))
    n = len(rows)
    want, _ = run()
    assert len(rows) == n  # the fp32 router throughout
    assert got == want
