"""Tensor parallelism in the fused GPU runner.

CPU (gloo; the runner's torch-op path, kernels=False, no graphs): TP2 and TP2 with expert parallelism
give TP1's tokens through the engine for both archs (the workload of test_tp.py: concurrent requests,
a seeded sampled one, prefix-cache hits), with really two processes each running the GPU runner on its
shard; k3 at TP2 with expert parallelism through the Triton kernels (run by the interpreter) gives the
reference TP1 tokens; the piecewise forward of steps with prefill rows run eagerly on both ranks
(EngineConfig.mixed_pieces_eager) gives TP1's tokens, rank 0's plans naming the bucket each worker must take too,
and a worker refuses a plan whose bucket is not its own; a killed worker fails the engine; the plan -> StepSeq
conversion the workers use rebuilds rank 0's logits rows; the fast all-reduce hook and its refusals.
GPU (`gpu`, two CUDA devices; skipped with fewer): TP2 with the Triton kernels and the collectives
captured in the decode graphs and the pieces (NCCL, or the opt-in symmetric-memory all-reduce; or the pieces
run eagerly) gives TP1's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.distributed.plan import PlanSeq, StepPlan
from k3rt.backend.runner.gpu.runner import GpuModelRunner
from k3rt.backend.runner.gpu.step import StepSeq
from k3rt.backend.runner.gpu.tp import plan_seqs
from tests.backend.engine_fixtures import greedy, make_engine, run, tiny_checkpoint
from tests.backend.test_tp import no_new_processes, workload  # noqa: F401  (fixture)
from tests.backend.threads import single_thread  # noqa: F401  (autouse: rank 0 runs in this process)


def gpu_engine(ckpt, tp: int, *, ep: int | bool = 1, device: str = "cpu", **over):
    engine = {"tp": tp, "ep": ep, "device": device, "kernels": device == "cuda", "cuda_graphs": device == "cuda"}
    return make_engine(ckpt, runner="gpu", budget=256, engine=engine | over)


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def tp1(request, tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory, request.param)
    eng = gpu_engine(ckpt, 1)
    outputs, cached = workload(eng)
    eng.close()
    return ckpt, outputs, cached


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 2)], ids=["tp2", "tp2-ep", "tp4-ep2"])
def test_gpu_runner_tp2_matches_tp1(tp1, tp, ep, no_new_processes):  # noqa: F811
    """TP2, TP2 with whole experts per rank, and TP4 with two expert groups (each expert split over two ranks)."""
    ckpt, want, want_cached = tp1
    eng = gpu_engine(ckpt, tp, ep=ep)
    try:
        runner = eng.runner.inner if hasattr(eng.runner, "inner") else eng.runner
        assert isinstance(runner, GpuModelRunner) and len(runner.sender.workers.procs) == tp - 1
        assert runner.model.model.layers[0].self_attn.num_heads == eng.model_cfg.kda.num_heads // tp
        got, cached = workload(eng)
        assert got == want
        assert cached == want_cached
    finally:
        eng.close()


def test_gpu_runner_tp2_ep_triton_kernels_in_the_interpreter(tmp_path_factory, monkeypatch, no_new_processes):  # noqa: F811
    """The kernel path under TP2 with expert parallelism (the router and grouped-expert kernels on local ids,
    MLA/KDA kernels on half the heads, LatentMoE's tail) gives the reference TP1 tokens: k3, Triton kernels
    run by the interpreter on CPU in both ranks (the worker inherits TRITON_INTERPRET)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ckpt = tiny_checkpoint(tmp_path_factory, "k3", two_layers=True)
    prompts = [[(i * 37 + 11) % 512 for i in range(40)], [5, 9, 2, 7]]
    ref = make_engine(ckpt, runner="model", budget=256)
    want = [o.output_ids for o in run(ref, prompts, greedy(4))]
    eng = gpu_engine(ckpt, 2, ep=True, kernels=True)
    try:
        assert eng.runner.inner.kernels.triton
        assert [o.output_ids for o in run(eng, prompts, greedy(4))] == want
    finally:
        eng.close()


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_gpu_runner_tp2_pieces_run_eagerly_match_tp1(tp1, ep, no_new_processes):  # noqa: F811
    """mixed_pieces_eager: every rank builds the piecewise forward from the config and runs its pieces eagerly (the
    replayed path less the capture: padded buckets, boundary buffers, the o_proj/MoE/embedding all-reduces inside
    the pieces over gloo). TP2 (and TP2 with expert parallelism) gives TP1's eager tokens and prefix-cache hits.
    Rank 0 ran every step with prefill rows piecewise (one of them chunks beside decodes, round two's resuming
    from the prefix cache); each worker checked its own bucket against the one rank 0's plan named, so a worker
    that ran a step another way (or not through the pieces) would have failed the engine."""
    ckpt, want, want_cached = tp1
    eng = gpu_engine(ckpt, 2, ep=ep, mixed_pieces_eager=True)
    try:
        runner = eng.runner.inner
        assert runner.mixed is not None and not runner.mixed.graphs
        got, cached = workload(eng)
        assert got == want
        assert cached == want_cached
        prefill = [s for s in eng.runner.steps if s.chunks]
        assert runner.mixed.runs == len(prefill) and runner.mixed.replays == 0
        assert any(s.decodes for s in prefill), "no step mixed a prefill chunk with decodes"
    finally:
        eng.close()


def test_worker_refuses_a_plan_in_another_bucket(tmp_path):
    """A worker runs a plan's step piecewise only in the bucket rank 0 named: a plan naming another bucket, or no
    pieces where this rank would take them (or the reverse), raises before the forward (on GPUs the ranks'
    collectives would otherwise differ in shape: a hang, or sums of unrelated rows)."""
    from dataclasses import replace

    from k3rt.backend.engine import Engine, engine_config_for_tests
    from k3rt.backend.models.tiny import make_tiny
    from k3rt.backend.runner.gpu.tp import run_worker_plan

    ckpt = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="float32", seed=9)
    cfg = engine_config_for_tests(str(ckpt), num_pages=64)
    eng = Engine(replace(cfg, runner="gpu", kernels=False, cuda_graphs=False, mixed_pieces_eager=True))
    runner, pool = eng.runner, eng.pool
    assert runner.mixed is not None and runner.mixed.buckets[:2] == (32, 64)
    per_set = eng.layout.pages_per_state_set
    decodes = tuple(PlanSeq(40, 1, tuple(pool.allocate(1)), tuple(pool.allocate(per_set))) for _ in range(2))
    chunk = PlanSeq(0, 21, tuple(pool.allocate(1)), tuple(pool.allocate(per_set)))
    mixed = StepPlan(seqs=decodes + (chunk,), token_ids=tuple(range(3, 26)), logits_rows=(0, 1, 22))
    with pytest.raises(RuntimeError, match="rank 0 runs this 23-token step piecewise in bucket 64, this rank "
                                           "piecewise in bucket 32"):
        run_worker_plan(runner, replace(mixed, mixed=64))
    with pytest.raises(RuntimeError, match="without the pieces, this rank piecewise in bucket 32"):
        run_worker_plan(runner, mixed)
    decode_only = StepPlan(seqs=decodes, token_ids=(3, 4), logits_rows=(0, 1))
    with pytest.raises(RuntimeError, match="piecewise in bucket 32, this rank without the pieces"):
        run_worker_plan(runner, replace(decode_only, mixed=32))
    assert runner.mixed.runs == 0  # refused before the forward
    run_worker_plan(runner, replace(mixed, mixed=32))
    run_worker_plan(runner, decode_only)
    assert runner.mixed.runs == 1


# imported by the worker processes only (their PYTHONPATH): each pads every step to its largest piecewise bucket
_WORKER_IN_ANOTHER_BUCKET = """
from k3rt.backend.runner.gpu.pieces import PiecewiseForward

PiecewiseForward.bucket = lambda self, num_tokens: self.buckets[-1]
"""


def test_worker_in_another_bucket_fails_the_engine(tmp_path, tmp_path_factory, monkeypatch, no_new_processes):  # noqa: F811
    """End to end: a worker whose pieces choose another bucket than rank 0's (patched into the worker process alone,
    by a sitecustomize on its PYTHONPATH) fails the engine at its first such step with an error naming both
    choices, instead of all-reducing tensors of other shapes (gloo aborts the worker; NCCL may hang or sum
    unrelated rows)."""
    import os
    import time

    from k3rt.backend.distributed.group import TPFailure

    (tmp_path / "sitecustomize.py").write_text(_WORKER_IN_ANOTHER_BUCKET)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    eng = gpu_engine(tiny_checkpoint(tmp_path_factory, "kimi_linear"), 2, mixed_pieces_eager=True)
    try:
        assert eng.runner.inner.mixed.bucket(40) == 64  # rank 0 (this process) is not patched
        with pytest.raises(TPFailure):
            run(eng, [list(range(3, 43))], greedy(2))
        # the step's error names the worker's reason once the worker has exited (within the second rank 0 waits
        # for it, unless the machine is slow): the worker set is asked directly, without that race
        deadline = time.monotonic() + 30
        while (lost := eng.runner.inner.sender.workers.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 0 runs this 40-token step piecewise in bucket 64, this rank piecewise in bucket 256" in lost, lost
    finally:
        eng.close()


def test_mixed_pieces_eager_is_refused_where_no_pieces_run():
    from k3rt.config import EngineConfig, SpecConfig

    assert EngineConfig(model="m", runner="gpu", kernels=False, mixed_pieces_eager=True).mixed_pieces_eager
    for over in ({"runner": "model"}, {"mixed_graphs": False}, {"deterministic": True, "kernels": True}):
        with pytest.raises(ValueError, match="mixed_pieces_eager"):
            EngineConfig(**({"model": "m", "runner": "gpu", "kernels": False, "mixed_pieces_eager": True} | over))


def _staggered(eng) -> tuple[list[list[int]], int, dict[int, float]]:
    """A 70-token prompt, then (after its prefill and first decode) a second prompt sharing its first 64 tokens,
    scored from its 65th: that step mixes the new chunk, resumed from the prefix cache, with the first request's
    decode, and gathers prompt-logprob rows beside the sampled ones.
    -> (both outputs, the second request's cached tokens, its prompt logprobs)."""
    first = [(i * 37 + 11) % 512 for i in range(70)]
    rids, outs, step = [eng.add_request(first, greedy(4))], {}, 0
    while len(outs) < 2:
        if step == 2:
            rids.append(eng.add_request(first[:64] + [5, 9, 2], greedy(3), prompt_logprobs_from=65))
        outs.update((o.rid, o) for o in eng.step() if o.finished)
        eng.check()
        step += 1
    return [outs[r].output_ids for r in rids], outs[rids[1]].cached_tokens, outs[rids[1]].prompt_logprobs


def test_gpu_runner_tp2_ep_pieces_with_triton_kernels_in_the_interpreter(tmp_path_factory, monkeypatch,
                                                                          no_new_processes):  # noqa: F811
    """The pieces as the GPU runs them under TP, less the capture: k3 at TP2 with expert parallelism, the Triton
    kernels (interpreter) inside the pieces on both ranks (router, grouped experts on local ids, LatentMoE's tail,
    the projections) and in the eager cores between them; a step mixing a prefix-cache-resumed chunk with a decode
    (with prompt-logprob rows) gives the reference TP1 tokens and prompt logprobs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ckpt = tiny_checkpoint(tmp_path_factory, "k3", two_layers=True)
    want, want_cached, want_scores = _staggered(make_engine(ckpt, runner="model", budget=256))
    eng = gpu_engine(ckpt, 2, ep=True, kernels=True, mixed_pieces_eager=True)
    try:
        assert eng.runner.inner.kernels.triton
        got, cached, scores = _staggered(eng)
        assert got == want and cached == want_cached == 64
        assert scores.keys() == want_scores.keys() == {65, 66}
        assert max(abs(scores[k] - want_scores[k]) for k in want_scores) < 1e-4
        prefill = [s for s in eng.runner.steps if s.chunks]
        assert eng.runner.inner.mixed.runs == len(prefill) == 2 and prefill[1].decodes
    finally:
        eng.close()


def test_plan_seqs_rebuilds_the_logits_rows():
    """Sampled last rows first (in sequence order), then scored rows, one of them a non-sampled sequence's
    last row: the rebuilt StepSeqs give back exactly the plan's rows; the graph size survives the codec."""
    from k3rt.backend.runner.gpu.step import pack_step

    plan = StepPlan(seqs=(PlanSeq(0, 3, (1,), (5,)), PlanSeq(7, 1, (2, 3), (6,)), PlanSeq(0, 2, (4,), (7,), ((2, (9,)),))),
                    token_ids=(10, 11, 12, 13, 14, 15), logits_rows=(3, 2, 4, 5), graph=0)
    plan = StepPlan.unpack(plan.pack())
    seqs, extra = plan_seqs(plan)
    assert [s.needs_logits for s in seqs] == [False, True, False] and extra == [2, 4, 5]
    assert seqs[2] == StepSeq([14, 15], 0, [4], [7], False, [(2, [9])])
    meta, (h64, _) = pack_step(seqs, block_size=64, conv_width=4, num_groups=1, extra_logit_rows=extra)
    rows = h64[sum(meta.sizes64[:6]):sum(meta.sizes64[:7])]
    assert rows.tolist() == list(plan.logits_rows)
    assert StepPlan.unpack(StepPlan(seqs=plan.seqs, token_ids=plan.token_ids, graph=16).pack()).graph == 16
    assert StepPlan.unpack(StepPlan(seqs=plan.seqs, token_ids=plan.token_ids, mixed=64).pack()).mixed == 64
    with pytest.raises(ValueError, match="token_ids"):
        plan_seqs(StepPlan(seqs=plan.seqs, token_ids=(1, 2)))


def test_fast_all_reduce_hook():
    """TPContext.all_reduce lets its fast path take a message (no NCCL/gloo call: none is initialized here)
    and falls back to the process group when the fast path declines; the symmetric-memory path is refused
    where it cannot run, naming the field."""
    from k3rt.backend.distributed import TPContext
    from k3rt.backend.distributed.symm_all_reduce import SymmAllReduce
    from k3rt.config import DistConfig, EngineConfig

    taken = TPContext(0, 2, fast_all_reduce=lambda x: x.mul_(2) is not None)
    assert taken.all_reduce(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    declined = TPContext(0, 2, fast_all_reduce=lambda x: False)
    with pytest.raises((RuntimeError, ValueError)):  # reached torch.distributed, which has no group here
        declined.all_reduce(torch.ones(3))
    with pytest.raises(ValueError, match="symm_all_reduce"):
        EngineConfig(model="m", tp=2, device="cpu", dist=DistConfig(symm_all_reduce=True))
    with pytest.raises(ValueError, match="symm_all_reduce"):
        DistConfig(nnodes=2, master_port=1, symm_all_reduce=True)
    with pytest.raises(ValueError, match="symm_all_reduce"):
        SymmAllReduce(None, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["nccl", "symm-mem", "pieces-eager"])
@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_gpu_runner_tp2_cuda_graphs_equal_tp1(arch, mode, tmp_path_factory):
    """Two GPUs: Triton kernels, the collectives (NCCL, or the symmetric-memory all-reduce) inside the
    captured decode graphs and the captured pieces of the prompts' step (pieces-eager: the same pieces run
    eagerly on both ranks, never captured), logits gathered to rank 0 after the replay; greedy tokens equal
    TP1's on one GPU (fp32 tiny checkpoint)."""
    from k3rt.config import DistConfig

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    ckpt = tiny_checkpoint(tmp_path_factory, arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 70, 130, 9)]
    over = {"symm-mem": {"dist": DistConfig(symm_all_reduce=True)}, "pieces-eager": {"mixed_pieces_eager": True}}
    outs = {}
    for tp in (1, 2):
        eng = gpu_engine(ckpt, tp, device="cuda", **(over.get(mode, {}) if tp == 2 else {}))
        try:
            outs[tp] = [o.output_ids for o in run(eng, prompts, greedy(24))]
            if tp == 2:
                runner = eng.runner.inner if hasattr(eng.runner, "inner") else eng.runner
                assert runner.graphs, "no decode graphs were captured"
                # the prompts' prefill went through the pieces on rank 0 (replayed unless eager), in the buckets
                # the workers checked theirs against
                assert runner.mixed is not None and runner.mixed.runs >= 1
                assert runner.mixed.replays == (0 if mode == "pieces-eager" else runner.mixed.runs)
        finally:
            eng.close()
    assert outs[2] == outs[1]


def test_gpu_runner_killed_worker_fails_engine(tmp_path_factory, no_new_processes):  # noqa: F811
    """The GPU runner forwards the engine's between-step check to its plan channel: a killed worker fails
    the engine within the deadline, naming it, and the next step is refused."""
    from tests.backend.test_tp import assert_killed_worker_fails

    assert_killed_worker_fails(gpu_engine(tiny_checkpoint(tmp_path_factory, "kimi_linear"), 2))
