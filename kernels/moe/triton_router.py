"""Kimi MoE router top-k (Triton): sigmoid, biased grouped top-k selection, un-biased weights.

One program per token holds the token's E scores in registers (E <= 512) and picks the experts by
repeated argmax, so the k ids come out in descending order of biased score, like torch.topk. With
num_expert_group > 1 the group score is the sum of the group's two largest biased scores (max, then
max again with the argmax masked, which equals torch.topk(2).sum on ties too); the topk_group best
groups are kept, the rest masked to -inf before the top-k. The oracle is `ref.py::route_ref`. The
router GEMM (x @ W_gate^T, fp32) stays a matmul outside (cuBLAS or the skinny GEMV), except for small routers:
`moe_route_from_x` computes a token's logits in its own program first ([E, D] products in fp32, summed over D),
one launch instead of two. That pays where the weight is a few KB (k3-tiny: 8 x 384, read by every token's
program from L2) and a decode forward is launch-bound; `fused_router_fits` bounds it (at the 48B's 256 x 2304 one
program would stream 2.4 MB).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs

MAX_EXPERTS = 512
# moe_route_from_x: at most this many router weights (E * D; fp32: 128 KB a program reads) and rows
FUSED_MAX_WEIGHTS = 32768
FUSED_MAX_ROWS = 16


def fused_router_fits(rows: int, num_experts: int, hidden: int, num_expert_group: int = 1) -> bool:
    """Whether `moe_route_from_x` takes these: a small router (every program reads the whole weight), few rows
    (decode and verify steps; a prefill's router is a GEMM), ungrouped selection."""
    return 1 <= rows <= FUSED_MAX_ROWS and num_experts * hidden <= FUSED_MAX_WEIGHTS and num_expert_group == 1


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
    _route_topk(logits_ptr, stride_lt, logits_ptr, 0, bias_ptr, w_ptr, ids_ptr, scaling, E, BLOCK_E, K, BLOCK_K, GROUPS,
                BLOCK_G, BLOCK_PER, TOPK_GROUP, RENORMALIZE, USE_PDL, False, 16)


# a kernel of its own, not a constexpr of the one above: its row stride (x's) and the logits' differ in alignment,
# which would give one kernel two specializations of stride_lt (tests/backend/test_jit_churn.py)
@triton.jit
def _moe_route_from_x_kernel(
    x_ptr, stride_x,  # [T, D] any float
    gate_ptr, D,  # the router weight [E, D] contiguous, any float
    bias_ptr, w_ptr, ids_ptr, scaling,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    _route_topk(x_ptr, stride_x, gate_ptr, D, bias_ptr, w_ptr, ids_ptr, scaling, E, BLOCK_E, K, BLOCK_K, 1, 1, 1, 1,
                RENORMALIZE, USE_PDL, True, BLOCK_D)


@triton.jit
def _route_topk(
    logits_ptr, stride_lt,  # [T, E] fp32 (FROM_X: x [T, D], any float)
    gate_ptr, D,  # FROM_X: the router weight [E, D] contiguous, any float; else unused
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
    FROM_X: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    if USE_PDL:
        gdc_wait()
    row = logits_ptr + t.to(tl.int64) * stride_lt
    if FROM_X:  # the logits x @ W^T in fp32 here: [E, BLOCK_D] products per step, summed over D at the end
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            ok_d = d0 + offs_d < D
            xd = tl.load(row + d0 + offs_d, mask=ok_d, other=0.0).to(tl.float32)
            wd = tl.load(gate_ptr + offs_e[:, None] * D + d0 + offs_d[None, :], mask=mask_e[:, None] & ok_d[None, :],
                         other=0.0).to(tl.float32)
            acc += wd * xd[None, :]
        s = tl.sigmoid(tl.sum(acc, axis=1))  # [BLOCK_E]
    else:
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
    w, ids = _select_topk(s, sel, scaling, K, BLOCK_K, RENORMALIZE)
    tl.store(w_ptr + t.to(tl.int64) * K + offs_k, w, mask=offs_k < K)
    tl.store(ids_ptr + t.to(tl.int64) * K + offs_k, ids, mask=offs_k < K)


@triton.jit
def _select_topk(s, sel, scaling, K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The k experts of largest biased score sel [BLOCK_E] (-inf: not eligible) by repeated argmax, in descending
    order (ties to the lower id, as torch.topk), and their weights from the un-biased scores s: -> (weights, ids),
    [BLOCK_K] fp32 / int32 (slots past K zero). Shared with triton_layer.py's persistent MoE layer."""
    offs_e = tl.arange(0, sel.shape[0])
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(K):
        e = tl.argmax(sel, axis=0, tie_break_left=True)
        ids = tl.where(offs_k == i, e, ids)
        sel = tl.where(offs_e == e, float("-inf"), sel)
    # the k weights in one [BLOCK_K, E] reduction after the loop, not one more reduction a step (each a CTA barrier
    # or two at several warps: the persistent MoE layer runs this in every program, at two warps)
    w = tl.sum(tl.where((offs_e[None, :] == ids[:, None]) & (offs_k < K)[:, None], s[None, :], 0.0), axis=1)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    return w * scaling, ids


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
    return _route(logits, None, logits.shape[1], bias, top_k, num_expert_group, topk_group, renormalize, scaling,
                  out_weights, out_ids, use_pdl, num_warps)


def moe_route_from_x(
    x: Tensor,
    gate_weight: Tensor,
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
    """`moe_route` of the logits x @ gate_weight^T, computed in the same launch (module docstring): fp32 products
    and sums whatever the inputs' dtype (the router's fp32 logits). Within `fused_router_fits` only.

    Args:
        x: [T, D] float activations (rows may be strided; last dim contiguous).
        gate_weight: [E, D] contiguous float router weight (Kimi keeps it fp32).
        bias, top_k, ...: as `moe_route`.
    """
    if x.dim() != 2 or not x.is_floating_point() or x.stride(-1) != 1:
        raise ValueError(f"x must be a float [T, D] tensor with a contiguous last dim, got {x.dtype} "
                         f"{list(x.shape)} strides {x.stride()}")
    T, D = x.shape
    E = check_gate_weight(gate_weight, D)
    if not fused_router_fits(max(T, 1), E, D, num_expert_group):
        raise ValueError(f"moe_route_from_x: T={T} rows, E={E} x D={D} weights, {num_expert_group} groups is past "
                         f"fused_router_fits (<= {FUSED_MAX_ROWS} rows, <= {FUSED_MAX_WEIGHTS} weights, one group)")
    check_same_device(x=x, gate_weight=gate_weight)
    return _route(x, gate_weight, E, bias, top_k, num_expert_group, topk_group, renormalize, scaling, out_weights,
                  out_ids, use_pdl, num_warps)


def check_gate_weight(gate_weight: Tensor, D: int) -> int:
    """A router weight for rows of D: a contiguous float [E, D] tensor -> E (ValueError naming what is wrong)."""
    if gate_weight.dim() != 2 or gate_weight.shape[1] != D or not gate_weight.is_floating_point():
        raise ValueError(f"gate_weight must be a float [E, D={D}] tensor, got {gate_weight.dtype} "
                         f"{list(gate_weight.shape)}")
    if not gate_weight.is_contiguous():
        raise ValueError("gate_weight must be contiguous")
    return gate_weight.shape[0]


def _route(rows: Tensor, gate_weight: Tensor | None, E: int, bias: Tensor, top_k: int, num_expert_group: int,
           topk_group: int, renormalize: bool, scaling: float, out_weights: Tensor | None, out_ids: Tensor | None,
           use_pdl: bool, num_warps: int) -> tuple[Tensor, Tensor]:
    """The checks and the launch of both forms: rows are the logits [T, E], or x [T, D] with gate_weight."""
    T = rows.shape[0]
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
    check_same_device(rows=rows, bias=bias, out_weights=out_weights, out_ids=out_ids)
    w = out_weights if out_weights is not None else torch.empty(T, top_k, dtype=torch.float32, device=rows.device)
    ids = out_ids if out_ids is not None else torch.empty(T, top_k, dtype=torch.int32, device=rows.device)
    if T == 0:
        return w, ids
    common = dict(E=E, BLOCK_E=triton.next_power_of_2(E), K=top_k, BLOCK_K=triton.next_power_of_2(top_k),
                  RENORMALIZE=bool(renormalize), USE_PDL=use_pdl and not INTERPRET, num_warps=num_warps,
                  **pdl_kwargs(use_pdl))
    if gate_weight is not None:  # moe_route_from_x (ungrouped: fused_router_fits)
        D = rows.shape[1]
        # the [BLOCK_E, BLOCK_D] fp32 products: at most 2048 (64 registers a thread at one warp)
        block_d = max(16, min(128, triton.next_power_of_2(max(D, 1)), 2048 // triton.next_power_of_2(E)))
        _moe_route_from_x_kernel[(T,)](rows, rows.stride(0), gate_weight, D, bias, w, ids, float(scaling),
                                       BLOCK_D=block_d, **common)
    else:
        _moe_route_kernel[(T,)](
            rows, rows.stride(0), bias, w, ids, float(scaling), GROUPS=num_expert_group,
            BLOCK_G=triton.next_power_of_2(num_expert_group), BLOCK_PER=triton.next_power_of_2(per),
            TOPK_GROUP=topk_group, **common,
        )
    return w, ids
