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
from k3rt.backend.models.tiny import make_tiny, two_layer_overrides

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

    ckpt = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="float32", seed=9,
                     overrides=two_layer_overrides("kimi_linear"))  # every kernel, once per step
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
    40 prompts of random lengths 1..300 in waves at random arrival spacings. The measured phase compiles no more
    than a few binaries, each a tile the launcher picks by size that the warm-up did not reach (the
    skinny GEMV's BLOCK_M, a power of two of the rows; MoE align's BP, of the pairs); the message names them.
    runtime_churn is not asserted empty on CUDA: the skinny GEMV runs at one call site per weight, and its N and
    output stride (and the pointers' dtypes) differ between weights, which the H200 run of session 12 showed
    (k3-tiny: 0 binaries compiled in the measured phase, the GEMV's N/stride_ym/w_ptr/y_ptr varying by weight)."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    ckpt = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="bfloat16", seed=3)
    cfg = replace(engine_config_for_tests(str(ckpt), num_pages=2048, kv_dtype="bfloat16", conv_dtype="bfloat16"),
                  device="cuda", dtype="bfloat16", runner="gpu", kernels=True, cuda_graphs=True)
    res = run_churn(Engine(cfg), ChurnConfig(seed=1))
    assert res["warmup"].keys  # the probe saw the launches (binaries may predate it: other tests' compiles)
    assert sum(res["measured"].binaries.values()) <= 4, res["measured_churn"]


def test_kda_row_slices_and_gathers_keep_16_element_row_strides(tmp_path) -> None:
    """The fused KDA (and MLA) projections are padded to a multiple of ROW_ALIGN columns, so a row slice of any
    of their column views starts 16-byte aligned whatever the start row, and a gathered b keeps such a stride:
    without this the tiny models' odd widths (k3-tiny: 1,092 columns, H = 4) gave the kernels reading them a
    binary per parity of a mixed step's first rest row, and one more for gathered rows."""
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.models.kda import KimiDeltaAttention
    from k3rt.backend.models.mla import MultiHeadLatentAttention
    from k3rt.backend.runner.gpu.kda import KdaWeights, _gather_rows, kda_project
    from k3rt.backend.runner.gpu.mla import MlaWeights
    from k3rt.backend.runner.gpu.ops import ROW_ALIGN, KernelConfig

    model = load_model(make_tiny(tmp_path / "m", arch="kimi_linear", dtype="float32", seed=9), dtype="float32",
                       progress=False)
    attn = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    w = KdaWeights.of(attn, 0, 0)
    assert w.w_in.shape[0] % ROW_ALIGN == 0 and sum(w.splits) == w.w_in.shape[0]
    assert sum(w.splits[:4]) % ROW_ALIGN != 0  # the tiny model's own width is odd: the pad is what aligns it
    x = torch.randn(7, model.cfg.hidden_size)
    qkv, gate, f, b = kda_project(attn, w, x, KernelConfig(triton=False))
    want = (attn.q_proj(x), attn.b_proj(x))  # the projections themselves, through the modules (shared rows)
    assert torch.allclose(qkv[:, :want[0].shape[1]], want[0], atol=1e-5) and torch.allclose(b, want[1], atol=1e-5)
    assert all(t.stride(0) % ROW_ALIGN == 0 for t in (qkv, gate, f, b))
    rows = torch.tensor([5, 0, 3])
    g = _gather_rows(b, rows)
    assert torch.equal(g, b[rows]) and g.stride(0) % ROW_ALIGN == 0
    mla = next(m for m in model.modules() if isinstance(m, MultiHeadLatentAttention))
    wm = MlaWeights.of(mla, 0)
    assert wm.w_in.shape[0] % ROW_ALIGN == 0 and sum(wm.splits) == wm.w_in.shape[0]
    assert torch.equal(wm.w_in[:wm.splits[0]], (mla.q_proj if mla.cfg.q_lora_rank is None else mla.q_a_proj).weight)


def test_specialize_all_brings_back_a_key_per_row_count_class() -> None:
    """The comparison switch of benchmarks/jit_churn.py: inside specialize_all the norm kernel's row count is
    specialized again (== 1, other, % 16: three keys for 1, 3 and 16 rows), outside it is one key."""
    if HAS_CUDA:
        pytest.skip("needs kernels not yet launched in the process (the interpreter's are never bound)")
    from k3rt.kernels.jit_probe import LaunchKeys, specialize_all
    from k3rt.kernels.norm import rms_norm

    w = torch.ones(64)

    def keys() -> int:
        with LaunchKeys() as rec:
            for n in (1, 3, 16):
                rms_norm(torch.randn(n, 64), w, 1e-5)
        return rec.counts()["norm.triton_norm._rms_norm_fwd_kernel"]

    assert keys() == 1
    with specialize_all():
        assert keys() == 3
    assert keys() == 1


def test_the_mla_split_combine_key_does_not_follow_the_split_count() -> None:
    """Regression (session 16, the H200 inside a measured `k3rt bench spec` run of plain k3-tiny at batch 16): the
    MLA split decode's combine took the next power of two of the split count as a constexpr, so a longer context
    (more splits) compiled another binary mid-run. Other split counts: one key, the same output."""
    if HAS_CUDA:
        pytest.skip("needs kernels not yet launched in the process (the interpreter's are never bound)")
    from k3rt.kernels.jit_probe import LaunchKeys
    from k3rt.kernels.mla import mla_decode

    g = torch.Generator().manual_seed(0)
    N, H, L, R, bs = 2, 16, 64, 16, 16
    kv = torch.randn(8, bs, L + R, generator=g)
    q = torch.randn(N, H, L + R, generator=g)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([50, 64], dtype=torch.int32)
    with LaunchKeys() as rec:
        outs = [mla_decode(q, kv, table, lens, 0.1, kv_lora_rank=L, num_splits=s) for s in (2, 3, 5)]
    assert rec.counts()["mla.triton_decode._mla_decode_combine_kernel"] == 1, \
        rec.churn("mla.triton_decode._mla_decode_combine_kernel")
    assert torch.allclose(outs[0], outs[1], atol=1e-5) and torch.allclose(outs[0], outs[2], atol=1e-5)
