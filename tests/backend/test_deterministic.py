"""The deterministic (batch-invariant) mode on the CPU reference runner (issue 20 part 6).

Acceptance: 64 mixed requests sent concurrently give byte-identical greedy tokens to the same requests
run one at a time, three times over. The concurrent rounds also change the two other things a token
must not depend on: prefill chunking (a 64-token budget splits prompts the reference runs whole) and
prefix-cache hits (rounds 2 and 3 reuse the snapshots round 1 left, at other boundaries). Without the
mode the same comparison differs (test_default_mode_depends_on_the_batch), so the main test can fail.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.layers.batch_invariant import ROW_TILE, invariant_linear
from k3rt.backend.models.tiny import make_tiny, two_layer_overrides
from k3rt.config import SchedulerConfig
from k3rt.sampling_params import SamplingParams
from tests.backend.threads import single_thread  # noqa: F401  (autouse fixture)



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # bf16 weights and activations: the rounding that makes batch composition visible in greedy tokens
    return make_tiny(tmp_path_factory.mktemp("tiny-det"), arch="k3", seed=3, dtype="bfloat16",
                     overrides=two_layer_overrides("k3"))  # each kind of layer once


def _workload(n: int = 64) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts of 1..200 tokens; every third extends a shared 150-token base (prefix-cache hits at
    several lengths), the rest are random; 8..24 greedy tokens each."""
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, 500, (150,), generator=g).tolist()
    prompts, params = [], []
    for i in range(n):
        m = int(torch.randint(1, 200, (1,), generator=g))
        tail = torch.randint(3, 500, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append(base[:m] + tail if i % 3 == 0 else torch.randint(3, 500, (m,), generator=g).tolist())
        params.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(torch.randint(8, 25, (1,), generator=g))))
    return prompts, params


def _engine(ckpt, *, deterministic: bool, budget: int, prefix_cache: bool) -> Engine:
    cfg = engine_config_for_tests(str(ckpt), num_pages=512, enable_prefix_cache=prefix_cache)
    # the checkpoint's bf16 compute and caches, not the tests' fp32 default
    cfg = replace(cfg, dtype=None, deterministic=deterministic,
                  cache=replace(cfg.cache, kv_dtype=None, conv_dtype=None),
                  scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    return Engine(cfg)


def _one_at_a_time(ckpt, prompts, params, *, deterministic: bool) -> list[list[int]]:
    # each prompt in one chunk, alone in its steps, never a cache hit
    eng = _engine(ckpt, deterministic=deterministic, budget=2048, prefix_cache=False)
    return [eng.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params)]


def _concurrent_rounds(ckpt, prompts, params, rounds: int, *, deterministic: bool) -> list[list[list[int]]]:
    eng = _engine(ckpt, deterministic=deterministic, budget=64, prefix_cache=True)
    outs = []
    for _ in range(rounds):
        outs.append([o.output_ids for o in eng.generate(prompts, params)])
        eng.check()
    return outs


def test_64_concurrent_equal_one_at_a_time_three_times(ckpt) -> None:
    prompts, params = _workload()
    alone = _one_at_a_time(ckpt, prompts, params, deterministic=True)
    rounds = _concurrent_rounds(ckpt, prompts, params, 3, deterministic=True)
    for r, outs in enumerate(rounds):
        diff = [i for i in range(len(prompts)) if outs[i] != alone[i]]
        assert not diff, f"round {r}: requests {diff} differ from their one-at-a-time output"


def test_default_mode_depends_on_the_batch(ckpt) -> None:
    """The comparison above has teeth: without the mode, some request's tokens change with the batch."""
    prompts, params = _workload()
    alone = _one_at_a_time(ckpt, prompts, params, deterministic=False)
    outs = _concurrent_rounds(ckpt, prompts, params, 1, deterministic=False)[0]
    assert any(outs[i] != alone[i] for i in range(len(prompts)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", [(64, 96), (384, 1024), (512, 384)], ids=["64x96", "384x1024", "512x384"])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype, k, n) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(300, k, generator=g).to(dtype)
    alone = torch.cat([invariant_linear(x[i:i + 1], w) for i in range(4)])
    for m in (1, 2, 3, ROW_TILE - 1, ROW_TILE + 1, 48, 100, 300):
        assert torch.equal(invariant_linear(x[:m], w)[:min(m, 4)], alone[:min(m, 4)]), m
    # the rows sit elsewhere in their tile when other rows come first
    shifted = invariant_linear(torch.cat([x[100:105], x[:4]]), w)[5:]
    assert torch.equal(shifted, alone)
    torch.testing.assert_close(invariant_linear(x, w).float(), (x.float() @ w.float().t()),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


def _gpu_runner_engine(ckpt, device: str, *, budget: int, prefix_cache: bool, deterministic: bool = True) -> Engine:
    cfg = engine_config_for_tests(str(ckpt), num_pages=256, enable_prefix_cache=prefix_cache)
    return Engine(replace(cfg, runner="gpu", device=device, kernels=True, cuda_graphs=device != "cpu",
                          deterministic=deterministic, scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def _with_logprobs(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[tuple[int, float]]]:
    """(token, logprob) of every generated token: the logprob compares the logits bit for bit, which
    the tokens of a tiny fp32 model alone would not (its greedy choices rarely sit on a rounding tie)."""
    rids = [eng.add_request(p, replace(sp, logprobs=0)) for p, sp in zip(prompts, params)]
    got: dict[int, list[tuple[int, float]]] = {r: [] for r in rids}
    done: set[int] = set()
    while len(done) < len(rids):
        for o in eng.step():
            got[o.rid] += list(zip(o.new_token_ids, o.logprobs or []))
            if o.finished:
                done.add(o.rid)
    return [got[r] for r in rids]


def _gpu_runner_case(ckpt, device: str, prompts: list[list[int]], params: list[SamplingParams], rounds: int,
                     *, deterministic: bool = True) -> list[list[int]]:
    """Requests whose (token, logprob) sequences differ between a concurrent round and one at a time."""
    alone_eng = _gpu_runner_engine(ckpt, device, budget=2048, prefix_cache=False, deterministic=deterministic)
    alone = [_with_logprobs(alone_eng, [p], [sp])[0] for p, sp in zip(prompts, params)]
    eng = _gpu_runner_engine(ckpt, device, budget=64, prefix_cache=True, deterministic=deterministic)
    diffs = []
    for _ in range(rounds):
        outs = _with_logprobs(eng, prompts, params)
        eng.check()
        diffs.append([i for i in range(len(prompts)) if outs[i] != alone[i]])
    return diffs


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case; the gpu-marked case runs on the device")
def test_gpu_runner_interpreter_concurrent_equal_one_at_a_time(tmp_path) -> None:
    """The GPU runner's batch-invariant mode under TRITON_INTERPRET at a tiny fp32 shape: a mixed batch
    (a 70-token prompt split at the 64-token budget, a prefix-cache hit on its first 64 tokens, a short
    prompt decoding alongside) equals each request run alone in one chunk, twice (the second round
    from the cache). Kept this small because every KDA token is a kernel launch in the interpreter."""
    ckpt = make_tiny(tmp_path / "k3", arch="k3", seed=5, dtype="float32", overrides=two_layer_overrides("k3"))
    g = torch.Generator().manual_seed(2)
    long = torch.randint(3, 500, (70,), generator=g).tolist()
    prompts = [long, torch.randint(3, 500, (3,), generator=g).tolist(), long[:66] + [7, 8]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in (3, 5, 3)]
    assert _gpu_runner_case(ckpt, "cpu", prompts, params, rounds=2) == [[], []]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_gpu_runner_64_concurrent_equal_one_at_a_time_three_times(arch, tmp_path) -> None:
    """On the device: the acceptance workload through the GPU runner (Triton kernels, decode graphs),
    bf16 checkpoint, three concurrent rounds against one-at-a-time."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ckpt = make_tiny(tmp_path / arch, arch=arch, seed=3, dtype="bfloat16")
    prompts, params = _workload()
    # the checkpoint's bf16 throughout: the Triton MLA kernel reads the cache in the compute dtype
    bf16 = dict(num_pages=512, kv_dtype=None, conv_dtype=None)
    alone_eng = Engine(replace(engine_config_for_tests(str(ckpt), enable_prefix_cache=False, **bf16),
                               dtype=None, runner="gpu", device="cuda", deterministic=True))
    alone = [alone_eng.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params)]
    eng = Engine(replace(engine_config_for_tests(str(ckpt), **bf16), dtype=None, runner="gpu", device="cuda",
                         deterministic=True, scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    for r in range(3):
        outs = [o.output_ids for o in eng.generate(prompts, params)]
        assert outs == alone, f"round {r}: {[i for i in range(len(outs)) if outs[i] != alone[i]]} differ"


def test_generate_path_equals_engine(ckpt) -> None:
    """`k3rt generate --deterministic` (the single-sequence model path, contiguous cache) gives the
    tokens the engine gives the same prompt in a batch: both are the one canonical computation."""
    from k3rt.backend.generate import generate
    from k3rt.backend.models.loader import load_model

    prompts, params = _workload(6)
    batched = _concurrent_rounds(ckpt, prompts, params, 1, deterministic=True)[0]
    model = load_model(ckpt)
    model.set_batch_invariant(True)
    for p, sp, want in zip(prompts, params, batched):
        assert list(generate(model, p, sp)) == want


def test_gpu_runner_deterministic_needs_kernels(ckpt) -> None:
    cfg = engine_config_for_tests(str(ckpt))
    with pytest.raises(ValueError, match="deterministic"):
        replace(cfg, runner="gpu", kernels=False, deterministic=True)
