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

from k3rt.backend.bench.jit_churn import ChurnConfig, run_churn, stream
from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.tiny import make_tiny

HAS_CUDA = torch.cuda.is_available()


def _prompts(lens: list[int], rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lens]


def test_new_prompt_lengths_and_batches_ask_for_no_new_binary_in_the_interpreter(tmp_path) -> None:
    """After a warm-up wave, a wave of other lengths (odd, multiples of 16, one token) and batch sizes
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
        stream(eng, _prompts([5, 17, 3, 12], rng), every=2, max_tokens=3)
        warm = rec.counts()
        stream(eng, _prompts([32, 1, 9, 16], rng), every=1, max_tokens=3)
        new, churn = rec.new_since(warm), rec.runtime_churn()
    assert warm.keys() >= {"kda.triton_decode._kda_decode_kernel", "mla.triton_prefill._mla_prefill_kernel",
                           "moe.triton_experts._moe_gate_up_kernel", "norm.triton_norm._rms_norm_fwd_kernel"}
    assert churn == {}
    assert new == {}, {k: rec.churn(k) for k in new}


@pytest.mark.gpu
def test_varied_steps_compile_nothing_new_on_cuda(tmp_path) -> None:
    """A tiny random model in bf16 on CUDA, CUDA graphs on, through backend/bench/jit_churn.py's workload: a
    warm-up of one prompt per power-of-two length (1..256) arriving one per step while the others decode, then
    40 prompts of random lengths 1..300 in waves at random arrival spacings. No per-step argument is
    specialized in any launch (runtime_churn empty), and the measured phase compiles at most a few binaries,
    each a tile the launcher picks by size that the warm-up did not reach (the skinny GEMV's BLOCK_M, a power of
    two of the rows; MoE align's BP, of the pairs); the message names them."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    ckpt = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="bfloat16", seed=3)
    cfg = replace(engine_config_for_tests(str(ckpt), num_pages=2048, kv_dtype="bfloat16", conv_dtype="bfloat16"),
                  device="cuda", dtype="bfloat16", runner="gpu", kernels=True, cuda_graphs=True)
    res = run_churn(Engine(cfg), ChurnConfig(seed=1))
    assert res["runtime_churn"] == {}
    assert res["warmup"].keys  # the probe saw the launches (binaries may predate it: other tests' compiles)
    assert sum(res["measured"].binaries.values()) <= 4, res["measured_churn"]
