"""Triton compile churn of the GPU runner: steps of new prompt lengths and batch compositions ask no kernel for a
binary it has not built (kernels/common.py, "Compiles"; kernels/jit_probe.py).

CPU: the runner with every kernel under the interpreter; `LaunchKeys` computes the key each launch would
compile under on the GPU (the same binder and do_not_specialize lists), so the churn is checked here.
GPU: the compiled binaries themselves (JITFunction caches), with CUDA graphs on, over many varied steps.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.tiny import make_tiny
from k3rt.sampling_params import SamplingParams

HAS_CUDA = torch.cuda.is_available()


def _stream(eng: Engine, lens: list[int], rng: random.Random, *, every: int = 2, max_tokens: int = 3) -> None:
    """Requests of these prompt lengths arriving one every `every` steps while the earlier ones decode (mixed
    steps: decodes beside a prefill), then the rest decoded to the end."""
    queue = [[rng.randrange(3, 500) for _ in range(n)] for n in lens]
    step = 0
    while queue or eng.has_unfinished:
        if queue and step % every == 0:
            eng.add_request(queue.pop(0), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        eng.step()
        step += 1


def test_new_prompt_lengths_and_batches_ask_for_no_new_binary_in_the_interpreter(tmp_path) -> None:
    """After a warm-up of two waves, waves of other lengths (odd, multiples of 16, one token) and batch sizes
    (1 to 3 decodes, mixed steps) launch every kernel with keys it already has. Before the kernels' lists, the
    row counts (== 1, % 16) and the packed step's index pointers (alignment) each made new keys."""
    if HAS_CUDA:
        pytest.skip("on a GPU the compiled caches are checked (test_varied_steps_compile_nothing_new_on_cuda)")
    from k3rt.kernels.jit_probe import LaunchKeys

    ckpt = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="float32", seed=9)
    eng = Engine(replace(engine_config_for_tests(str(ckpt), num_pages=128), runner="gpu", kernels=True,
                         cuda_graphs=False))
    rng = random.Random(0)
    with LaunchKeys() as rec:
        _stream(eng, [5, 17, 3, 12], rng)
        warm = rec.counts()
        _stream(eng, [32, 1, 9, 16], rng, every=1)
        new, churn = rec.new_since(warm), rec.runtime_churn()
    assert warm.keys() >= {"kda.triton_decode._kda_decode_kernel", "mla.triton_prefill._mla_prefill_kernel",
                           "moe.triton_experts._moe_gate_up_kernel", "norm.triton_norm._rms_norm_fwd_kernel"}
    assert churn == {}
    assert new == {}, {k: rec.churn(k) for k in new}


@pytest.mark.gpu
def test_varied_steps_compile_nothing_new_on_cuda(tmp_path) -> None:
    """A tiny random model in bf16 on CUDA, CUDA graphs on: a warm-up of one prompt per power-of-two length
    (1..256) arriving while others decode, then 40 prompts of random lengths 1..300 arriving at random
    intervals: nothing compiles because of an argument's per-step value (runtime_churn empty), and at most a
    few binaries in all, tile choices by size (e.g. MoE align's BP by the pairs' power of two)."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    from k3rt.kernels.jit_probe import LaunchKeys, compiled_counts

    ckpt = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="bfloat16", seed=3)
    cfg = replace(engine_config_for_tests(str(ckpt), num_pages=2048, kv_dtype="bfloat16", conv_dtype="bfloat16"),
                  device="cuda", dtype="bfloat16", runner="gpu", kernels=True, cuda_graphs=True)
    eng = Engine(cfg)
    rng = random.Random(1)
    with LaunchKeys() as rec:
        _stream(eng, [2 ** i for i in range(9)], rng, every=1, max_tokens=4)
        _stream(eng, [rng.randrange(1, 301) for _ in range(8)], rng, every=3, max_tokens=8)
        torch.cuda.synchronize()
        warm = compiled_counts()
        for _ in range(5):
            _stream(eng, [rng.randrange(1, 301) for _ in range(8)], rng, every=rng.randrange(1, 4),
                    max_tokens=rng.randrange(2, 9))
        torch.cuda.synchronize()
        after = compiled_counts()
    new = {k: n - warm.get(k, 0) for k, n in after.items() if n > warm.get(k, 0)}
    assert rec.runtime_churn() == {}, rec.runtime_churn()
    assert sum(new.values()) <= 4, {k: rec.churn(k) for k in new}
