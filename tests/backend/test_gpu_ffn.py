"""The GPU path's MoE block with the shared experts stacked after the routed ones (one grouped GEMM
pair for both) equals the module's own forward (routed experts + a separate shared MLP), for one and
for two shared experts; for one, the module's parameters become views of the stacks (no copy).

On the CPU the Triton kernels run under the interpreter (tests/conftest.py), fp32, tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.backend.models.moe import MoE  # noqa: E402
from k3rt.backend.models.tiny import TINY_CONFIGS, init_parameter  # noqa: E402
from k3rt.backend.runner.gpu.ffn import MoeWeights, moe_forward  # noqa: E402
from k3rt.backend.runner.gpu.ops import KernelConfig  # noqa: E402
from k3rt.model_config import parse_model_config  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_moe(arch: str, shared: int) -> MoE:
    cfg = parse_model_config({**TINY_CONFIGS[arch], "num_shared_experts": shared})
    moe = MoE(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(shared)
    for name, p in moe.named_parameters():
        init_parameter(name, p.data, g)
    with torch.no_grad():
        moe.e_score_correction_bias.normal_(0, 0.3, generator=g)
    return moe.to(DEV)


@pytest.mark.parametrize("shared", [1, 2])
def test_shared_experts_fused_into_the_grouped_gemms_equal_the_module(shared: int) -> None:
    moe = tiny_moe("kimi_linear", shared)
    x = torch.randn(7, moe.w13.shape[2], generator=torch.Generator().manual_seed(3)).to(DEV)
    with torch.no_grad():
        want = moe(x)
        w = MoeWeights.of(moe, KernelConfig(triton=True))
        assert w.shared_fused == shared and w.w13.shape[0] == moe.m.num_experts + shared
        got = moe_forward(moe, w, x, KernelConfig(triton=True))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
        assert torch.allclose(moe(x), want, rtol=0, atol=0)  # the module still computes the same
    ptr = w.w13.data_ptr()
    assert moe.w13.data_ptr() == ptr
    shares = moe.shared_experts.gate_up_proj.weight.untyped_storage().data_ptr() == ptr
    assert shares == (shared == 1)


def test_no_fusion_without_kernels_or_for_latent_moe() -> None:
    assert MoeWeights.of(tiny_moe("kimi_linear", 1), KernelConfig(triton=False)).shared_fused == 0
    assert MoeWeights.of(tiny_moe("k3", 1), KernelConfig(triton=True)).shared_fused == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_local_ids_for_the_grouped_gemms(rank: int) -> None:
    """Under --ep the grouped kernels index this rank's stack only: with the global ids mapped to local ones
    (other ranks' pairs at weight 0 onto an expert the token uses here) they give this rank's partial sum,
    as the module's expert loop does (the all-reduce adds the other ranks' experts)."""
    from k3rt.backend.distributed import TPContext
    from k3rt.backend.models.moe import route
    from k3rt.backend.runner.gpu.ffn import local_routing
    from k3rt.backend.runner.gpu.ops import kernel

    cfg = parse_model_config({**TINY_CONFIGS["kimi_linear"], "num_shared_experts": 1})
    moe = MoE(cfg, tp=TPContext(rank, 2), ep=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    for name, p in moe.named_parameters():
        init_parameter(name, p.data, g)
    moe = moe.to(DEV)
    x = torch.randn(9, moe.w13.shape[2], generator=torch.Generator().manual_seed(6)).to(DEV)
    with torch.no_grad():
        tw, ids = route(x, moe.gate_weight, moe.e_score_correction_bias, moe.m)
        mine = (ids >= moe.expert_offset) & (ids < moe.expert_offset + moe.num_local_experts)
        assert mine.any() and not mine.all()  # both ranks' experts are routed to
        want = moe.experts(x, tw, ids)
        ltw, lids = local_routing(tw, ids, moe.expert_offset, moe.num_local_experts)
        assert int(lids.min()) >= 0 and int(lids.max()) < moe.num_local_experts
        # another rank's pairs: weight 0, on an expert this token already uses here (no extra weights read)
        for t in range(x.shape[0]):
            used = set((ids[t][mine[t]] - moe.expert_offset).tolist()) or {0}
            assert set(lids[t].tolist()) <= used and (ltw[t][~mine[t]] == 0).all()
        got = kernel("moe", "fused_experts")(x, moe.w13, moe.w2, ltw, lids.to(torch.int32), act=moe.act)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def mxfp4_moe(latent: int, inter: int, seed: int = 7) -> MoE:
    """The tiny K3 LatentMoE with MXFP4 routed experts of latent width `latent` and intermediate `inter`."""
    from dataclasses import replace

    cfg = parse_model_config({**TINY_CONFIGS["k3"], "routed_expert_hidden_size": latent,
                              "moe_intermediate_size": inter})
    cfg = replace(cfg, moe=replace(cfg.moe, expert_format="mxfp4"))
    moe = MoE(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for name, p in moe.named_parameters():
        init_parameter(name, p.data, g)
    return moe.to(DEV)


def test_mxfp4_experts_run_planar_in_place_and_equal_the_module() -> None:
    """The runner's default MXFP4 path: the packed stacks repacked in place into planar words (the same
    storage: no more device memory), moe_forward through the planar kernel equal to the module's forward, and
    the module, now holding the words, still computing the same (its reference loop decodes them)."""
    moe = mxfp4_moe(256, 256)
    x = torch.randn(5, moe.routed_expert_down_proj.weight.shape[1], generator=torch.Generator().manual_seed(8)).to(DEV)
    k = KernelConfig(triton=True)
    with torch.no_grad():
        want = moe(x)
        ptrs = {n: getattr(moe, n).data_ptr() for n in ("w13_packed", "w2_packed")}
        w = MoeWeights.of(moe, k)
        assert w.planar is not None and w.mx is None and moe.expert_layout == "planar"
        assert {n for n, _ in moe.named_parameters()} >= {"w13_words", "w2_words"}
        assert not hasattr(moe, "w13_packed") and not hasattr(moe, "w2_packed")
        assert moe.w13_words.data_ptr() == ptrs["w13_packed"] == w.planar.w13_words.data_ptr()
        assert moe.w2_words.data_ptr() == ptrs["w2_packed"]
        assert torch.equal(moe(x), want)  # the reference loop reads the words back
        got = moe_forward(moe, w, x, k)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    with pytest.raises(ValueError, match="use_planar: needs MXFP4 experts in the packed layout"):
        moe.use_planar(w.planar.w13_words, w.planar.w2_words)


def test_mxfp4_experts_keep_dot_scaled_where_asked_or_where_planar_does_not_fit() -> None:
    moe = mxfp4_moe(256, 256)
    w = MoeWeights.of(moe, KernelConfig(triton=True, mxfp4_experts="dot_scaled"))
    assert w.planar is None and w.mx is not None and moe.expert_layout == "packed" and w.unfit is None
    w = MoeWeights.of(mxfp4_moe(32, 256), KernelConfig(triton=True))  # the tiny models' latent width
    assert w.planar is None and "K=32 is not a multiple of 256" in w.unfit
    big = mxfp4_moe(256, 256)
    with torch.no_grad():
        big.w2_scale[0, 0, 0] = 241  # a weight of 2^116: the planar group factor would overflow fp32
    w = MoeWeights.of(big, KernelConfig(triton=True))
    assert w.planar is None and "E8M0 exponent 241 > 240" in w.unfit and big.expert_layout == "packed"
    w = MoeWeights.of(mxfp4_moe(256, 256), KernelConfig(triton=False))  # kernels off: the module's loop
    assert w.planar is None and w.unfit is None
    with pytest.raises(ValueError, match="mxfp4_experts: must be one of"):
        KernelConfig(mxfp4_experts="planer")


def test_bf16_parts_sum_to_the_fp32_weight_exactly() -> None:
    """Three bf16 parts carry fp32's 24 significant bits (the router's split GEMM relies on it): their fp32 sum is
    the weight, bit for bit, across magnitudes."""
    from k3rt.backend.runner.gpu.ffn import bf16_parts

    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 64, generator=g) * torch.logspace(-20, 20, 64)
    parts = bf16_parts(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (48, 64)
    hi, mid, lo = parts.float().view(3, 16, 64)
    assert torch.equal(hi + mid + lo, w)


def test_the_router_parts_are_built_for_cuda_kernels_only() -> None:
    moe = tiny_moe("kimi_linear", 1)
    split = MoeWeights.of(moe, KernelConfig(triton=True)).gate_split
    assert (split is not None) == (DEV.type == "cuda")
    assert MoeWeights.of(tiny_moe("kimi_linear", 1), KernelConfig(triton=False)).gate_split is None
    assert MoeWeights.of(tiny_moe("kimi_linear", 1), KernelConfig(triton=True, batch_invariant=True)).gate_split is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1024, 8192])
def test_gpu_split_router_equals_the_fp32_router(rows: int) -> None:
    """The 48B router (256 x 2304 fp32) at prefill sizes: the split GEMM's logits within fp32 accumulation of the
    fp64 product, as torch's fp32 linear is, and the same top-8 experts for every row."""
    from k3rt.backend.runner.gpu.ffn import bf16_parts, split_router

    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(256, 2304, device="cuda", generator=g) * 2304 ** -0.5
    x = torch.randn(rows, 2304, device="cuda", generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    got, fp32 = split_router(x, bf16_parts(w)), torch.nn.functional.linear(x.float(), w)
    scale = exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 1e-5 * scale
    assert (fp32.double() - exact).abs().max().item() <= 1e-5 * scale
    assert torch.equal(got.topk(8).indices.sort(-1).values, fp32.topk(8).indices.sort(-1).values)
