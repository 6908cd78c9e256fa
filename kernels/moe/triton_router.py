"""Kimi MoE router top-k (Triton): sigmoid, biased grouped top-k selection, un-biased weights.

One program per token holds the token's E scores in registers (E <= 512) and picks the experts by
repeated argmax, so the k ids come out in descending order of biased score, like torch.topk. With
num_expert_group > 1 the group score is the sum of the group's two largest biased scores (max, then
max again with the argmax masked, which equals torch.topk(2).sum on ties too); the topk_group best
groups are kept, the rest masked to -inf before the top-k. The oracle is `ref.py::route_ref`. The
router GEMM (x @ W_gate^T, fp32) stays a cuBLAS matmul outside.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs

MAX_EXPERTS = 512


@triton.jit
def _moe_route_kernel(
    logits_ptr, stride_lt,  # [T, E] fp32
    bias_ptr,  # [E] fp32
    w_ptr, ids_ptr,  # [T, K] fp32 / int32, contiguous
    scaling,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_PER: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    if USE_PDL:
        gdc_wait()
    row = logits_ptr + t.to(tl.int64) * stride_lt
    s = tl.sigmoid(tl.load(row + offs_e, mask=mask_e, other=0.0).to(tl.float32))  # [BLOCK_E]
    bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    sel = tl.where(mask_e, s + bias, float("-inf"))
    if GROUPS > 1:
        PER: tl.constexpr = E // GROUPS
        # the same scores again, laid out [group, member] for the per-group top-2
        offs_g = tl.arange(0, BLOCK_G)
        offs_j = tl.arange(0, BLOCK_PER)
        mask2 = (offs_g < GROUPS)[:, None] & (offs_j < PER)[None, :]
        e2 = offs_g[:, None] * PER + offs_j[None, :]
        s2 = tl.sigmoid(tl.load(row + e2, mask=mask2, other=0.0).to(tl.float32))
        sel2 = tl.where(mask2, s2 + tl.load(bias_ptr + e2, mask=mask2, other=0.0).to(tl.float32), float("-inf"))
        top1 = tl.max(sel2, axis=1)
        arg1 = tl.argmax(sel2, axis=1, tie_break_left=True)
        top2 = tl.max(tl.where(offs_j[None, :] == arg1[:, None], float("-inf"), sel2), axis=1)
        gscore = tl.where(offs_g < GROUPS, top1 + top2, float("-inf"))  # [BLOCK_G]
        keep = tl.zeros([BLOCK_E], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(gscore, axis=0, tie_break_left=True)
            keep = keep | ((offs_e // PER) == g)
            gscore = tl.where(offs_g == g, float("-inf"), gscore)
        sel = tl.where(keep, sel, float("-inf"))
    if USE_PDL:
        gdc_launch_dependents()
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        e = tl.argmax(sel, axis=0, tie_break_left=True)
        ids = tl.where(offs_k == i, e, ids)
        w = tl.where(offs_k == i, tl.sum(tl.where(offs_e == e, s, 0.0), axis=0), w)
        sel = tl.where(offs_e == e, float("-inf"), sel)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    w = w * scaling
    tl.store(w_ptr + t.to(tl.int64) * K + offs_k, w, mask=offs_k < K)
    tl.store(ids_ptr + t.to(tl.int64) * K + offs_k, ids, mask=offs_k < K)


def moe_route(
    logits: Tensor,
    bias: Tensor,
    *,
    top_k: int,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
    out_weights: Tensor | None = None,
    out_ids: Tensor | None = None,
    use_pdl: bool = False,
    num_warps: int = 1,
) -> tuple[Tensor, Tensor]:
    """Router top-k for T tokens over E experts (Kimi sigmoid router, model-facts §6).

    Args:
        logits: [T, E] fp32 router logits x @ W_gate^T (rows may be strided; last dim contiguous).
        bias: [E] fp32 e_score_correction_bias (selection only).
        top_k: experts per token (Kimi uses 8, K3 16).
        num_expert_group, topk_group: grouped selection; E must divide into the groups and the kept
            groups must hold at least top_k experts.
        renormalize: divide the k weights by their sum (+1e-20) before scaling.
        scaling: routed_scaling_factor.
        out_weights, out_ids: optional preallocated [T, top_k] fp32 / int32 contiguous outputs.
        use_pdl: launch with programmatic dependent launch (GPU only).
        num_warps: one warp by default: the repeated argmax reductions then stay inside a warp
            (H200, E=256: fastest at T = 1, 64 and 4096; benchmarks/kernels_moe.py --route-only).

    Returns:
        (weights [T, top_k] fp32, ids [T, top_k] int32), ids in descending biased-score order.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be fp32 [T, E] with a contiguous last dim, got {logits.dtype} "
                         f"{list(logits.shape)} strides {logits.stride()}")
    T, E = logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"logits: E must be in [1, {MAX_EXPERTS}], got {E}")
    check(bias, "bias", (E,), torch.float32)
    if not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    if num_expert_group < 1 or E % num_expert_group:
        raise ValueError(f"num_expert_group must divide E={E}, got {num_expert_group}")
    per = E // num_expert_group
    if num_expert_group > 1 and per < 2:
        raise ValueError(f"num_expert_group={num_expert_group} leaves {per} expert per group; need >= 2")
    if not 1 <= topk_group <= num_expert_group or topk_group * per < top_k:
        raise ValueError(f"topk_group must be in [1, num_expert_group={num_expert_group}] and keep >= top_k="
                         f"{top_k} experts ({per} per group), got {topk_group}")
    for name, t, dtype in (("out_weights", out_weights, torch.float32), ("out_ids", out_ids, torch.int32)):
        if t is not None:
            check(t, name, (T, top_k), dtype)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
    check_same_device(logits=logits, bias=bias, out_weights=out_weights, out_ids=out_ids)
    w = out_weights if out_weights is not None else torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = out_ids if out_ids is not None else torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return w, ids
    _moe_route_kernel[(T,)](
        logits, logits.stride(0), bias, w, ids, float(scaling),
        E=E, BLOCK_E=triton.next_power_of_2(E), K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
        GROUPS=num_expert_group, BLOCK_G=triton.next_power_of_2(num_expert_group),
        BLOCK_PER=triton.next_power_of_2(per), TOPK_GROUP=topk_group,
        RENORMALIZE=bool(renormalize), USE_PDL=use_pdl and not INTERPRET,
        num_warps=num_warps, **pdl_kwargs(use_pdl),
    )
    return w, ids
