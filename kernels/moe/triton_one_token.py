"""One token's routed (and shared) experts in two launches instead of three (`fused_experts(one_token=True)`).

Batch-1 decode of the Kimi-Linear-48B reads 9 experts' weights per MoE layer (8 routed + 1 shared, ~127 MB) and the
three launches of the grouped path (gate/up, down, the slots' sum) took 38.9 us against a 27.4-30 us floor on the
H200 (benchmarks/RESULTS.md, session 25): each launch ramps up and drains, and the down GEMM cannot start before
every gate/up program has finished. Here:

  1. `_moe_one_token_kernel`, one program per (slot, BLOCK_N columns of I): the gate and up tiles of the slot's
     expert against x (one valid row of a 16-row MMA tile), the activation, h rounded to x.dtype as the grouped
     path stores it; then, still in the program, that h slice against the down weight's matching columns, every
     D row: a partial [D] per (slot, column tile), in fp32, to a scratch;
  2. `_moe_one_token_reduce_kernel`, one program per BLOCK_D outputs: per slot, its partials summed in a fixed
     order, times the routing weight (1 for a shared expert) and rounded to x.dtype (the grouped path's per-pair
     output), then the slots summed in slot order in fp32, as `sum_slots`.
The rounding points are the grouped path's; the down product's fp32 sum runs over I in another order (column
tiles, then their sum). No atomics: bit-reproducible. Oracle: `ref.py::fused_experts_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, pdl_kwargs, poison_like
from k3rt.kernels.moe.triton_experts import _act_mul, _gate_up_loop

# columns of I per program (9 slots x 1024 / 32 = 288 programs at the 48B shape), the K step of the gate/up loop,
# the D rows of the down loop's step; the reduce's D block
BLOCK_N, BLOCK_K, BLOCK_D, REDUCE_D = 32, 128, 128, 64
INTERPRET_BLOCKS = (16, 16, 16, 16)


@triton.jit
def _moe_one_token_kernel(
    x_ptr,  # [1, D]
    w13_ptr,  # [E, 2I, D] contiguous
    w2_ptr,  # [E, D, I] contiguous
    ids_ptr,  # [TOPK] int32 routed experts of the token's slots
    part_ptr,  # [SLOTS, NT, D] fp32 out: per slot and column tile, the down product's partial
    D, I, beta, lin_beta, E_ROUTED,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_K: tl.constexpr,
    SITU: tl.constexpr,
    LIN_SAT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(I, BLOCK_N)
    slot = pid // n_tiles
    pid_n = pid % n_tiles
    if USE_PDL:
        gdc_wait()
    # slots past the routed ones are the shared experts, after the routed ones in the stacks
    e = tl.where(slot < TOPK, tl.load(ids_ptr + tl.minimum(slot, TOPK - 1)), E_ROUTED + slot - TOPK).to(tl.int64)
    one = tl.arange(0, 16) == 0  # the token is row 0 of a 16-row MMA tile; the other rows are zeros
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    a_ptrs = x_ptr + tl.zeros([16], dtype=tl.int32)[:, None] + tl.arange(0, BLOCK_K)[None, :]
    acc_g, acc_u = _gate_up_loop(a_ptrs, w13_ptr, e, offs_n, one, n_ok, tl.zeros([16, BLOCK_N], dtype=tl.float32),
                                 tl.zeros([16, BLOCK_N], dtype=tl.float32), D, I, BLOCK_K, EVEN_K, DOT_PRECISION)
    # h as the grouped path stores it (x.dtype); columns past I are zero (their gate and up are)
    h = _act_mul(acc_g, acc_u, beta, lin_beta, SITU, LIN_SAT).to(x_ptr.dtype.element_ty)
    if USE_PDL:
        gdc_launch_dependents()
    # the down product over this program's columns of I, BLOCK_D rows of w2[e] at a time
    offs_d = tl.arange(0, BLOCK_D)
    b_ptrs = w2_ptr + e * D * I + offs_d[None, :].to(tl.int64) * I + offs_n[:, None]  # [BN, BD]
    out = part_ptr + (slot * n_tiles + pid_n).to(tl.int64) * D + offs_d
    for d0 in range(0, D, BLOCK_D):
        d_ok = d0 + offs_d < D
        b = tl.load(b_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        y = tl.dot(h, b, input_precision=DOT_PRECISION)  # [16, BD], row 0 the token's
        tl.store(out, tl.sum(tl.where(one[:, None], y, 0.0), axis=0), mask=d_ok)
        b_ptrs += BLOCK_D * I
        out += BLOCK_D


@triton.jit
def _moe_one_token_reduce_kernel(part_ptr, topk_w_ptr, out_ptr, D, NT, SLOTS: tl.constexpr, TOPK: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    rows = tl.arange(0, BLOCK_T)
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(SLOTS):
        part = tl.load(part_ptr + (s * NT + rows)[:, None].to(tl.int64) * D + offs[None, :],
                       mask=(rows < NT)[:, None] & d_ok[None, :], other=0.0)
        y = tl.sum(part, axis=0)
        if s < TOPK:
            y = y * tl.load(topk_w_ptr + s)
        acc += y.to(out_ptr.dtype.element_ty).to(tl.float32)  # the per-pair output's rounding
    if USE_PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def fused_experts_one_token(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, *,
                            situ: bool, beta: float, lin_beta: float | None, out: Tensor, shared_experts: int,
                            use_pdl: bool) -> Tensor:
    """`fused_experts` for T == 1 (its checks done by the caller): out [1, D] = the k routed slots' and the S shared
    experts' outputs summed (see the module docstring)."""
    T, D = x.shape
    assert T == 1
    E, I = w13.shape[0], w13.shape[1] // 2
    k, S = topk_ids.shape[1], shared_experts
    bn, bk, bd, rd = INTERPRET_BLOCKS if INTERPRET else (BLOCK_N, BLOCK_K, BLOCK_D, REDUCE_D)
    bn = min(bn, max(16, triton.next_power_of_2(I)))
    bk = min(bk, max(16, triton.next_power_of_2(D)))
    nt = triton.cdiv(I, bn)
    part = poison_like(torch.empty(k + S, nt, D, dtype=torch.float32, device=x.device))
    pdl = use_pdl and not INTERPRET
    _moe_one_token_kernel[((k + S) * nt,)](
        x, w13, w2, topk_ids, part, D, I, float(beta), float(lin_beta or 1.0), E - S,
        TOPK=k, BLOCK_N=bn, BLOCK_K=bk, BLOCK_D=bd, EVEN_K=D % bk == 0, SITU=situ,
        LIN_SAT=situ and lin_beta is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl, num_warps=4, num_stages=4,
        **pdl_kwargs(use_pdl),
    )
    _moe_one_token_reduce_kernel[(triton.cdiv(D, rd),)](
        part, topk_weights, out, D, nt, SLOTS=k + S, TOPK=k, BLOCK_T=max(2, triton.next_power_of_2(nt)), BLOCK_D=rd,
        USE_PDL=pdl, num_warps=4, **pdl_kwargs(use_pdl),
    )
    return out
