"""One token's experts as GEMVs of a few weight rows a program (`fused_experts(gemv=True)`, KernelConfig.moe_gemv).

At batch 1 the 48B's MoE layer reads 9 experts' weights (8 routed + 1 shared, ~127 MB) and the grouped GEMMs run it
at ~72 % of copy bandwidth against 97-100 % from 16 tokens up (benchmarks/RESULTS.md, session 29: T = 1 37.8 us
against a 27.2 us floor). Their T = 1 grids are 288 gate/up programs (9 experts x 32 column tiles) and 324 down
programs on 132 SMs: 2.2 and 2.5 programs an SM, so a third of the SMs carry one more program than the rest, and
a program's tile is a 16-row MMA of which one row is the token's. Here each program owns a few weight rows and
walks their whole K unrolled (`kernels/linear` `rows_dot`: every K step's 16-byte loads in one basic block, a warp
a row, no MMA), so the grids are thousands of small equal programs (2,304 gate/up, 2,592 down at the 48B shape):

  1. `_gemv_gate_up_kernel`, one program per (slot, ROWS_1 columns of I): the slot's expert's gate and up rows
     (interleaved, 2 * ROWS_1 rows) against x, the activation, h rounded to x.dtype as the grouped path stores it;
  2. `_gemv_down_kernel`, one program per (slot, ROWS_2 rows of D): w2[e] rows against the slot's h, times the
     routing weight (1 for a shared expert), rounded to x.dtype: the grouped path's per-pair output;
  3. the grouped path's slot sum (`sum_slots`, its norm epilogue included).

The rounding points are the grouped path's; the fp32 sums over K run in another order (rows_dot's lanes). The
expert ids are read on the device (no sync). Oracle: `ref.py::fused_experts_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, pdl_kwargs, poison_like
from k3rt.kernels.linear.triton_gemv import rows_dot, rows_dot_step
from k3rt.kernels.moe.triton_experts import _act_mul

# weight rows a program: gate/up columns of I (2x that many rows, gate and up interleaved) and D rows of the down
# product; warps a program (at least one row a warp: rows_dot's K sums stay in a warp)
ROWS_1, ROWS_2, WARPS_1, WARPS_2 = 4, 8, 4, 4


@triton.jit
def _slot_rows(ids_ptr, n, TOPK: tl.constexpr, E_ROUTED, ROWS: tl.constexpr, USE_PDL: tl.constexpr):
    """This program's slot, its first output row of n (ROWS a program) and the slot's expert: the routed id for the
    first TOPK slots, then the shared experts in order (after the routed ones in the stacks); after the PDL wait
    (the ids, and the down GEMV's h, are the kernel before's)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n, ROWS)
    slot = pid // n_tiles
    if USE_PDL:
        gdc_wait()
    e = tl.where(slot < TOPK, tl.load(ids_ptr + tl.minimum(slot, TOPK - 1)), E_ROUTED + slot - TOPK).to(tl.int64)
    return slot, (pid % n_tiles) * ROWS, e


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, h_ptr, I, beta, lin_beta, E_ROUTED, D: tl.constexpr,
                         TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SITU: tl.constexpr,
                         LIN_SAT: tl.constexpr, USE_PDL: tl.constexpr):
    slot, c0, e = _slot_rows(ids_ptr, I, TOPK, E_ROUTED, ROWS, USE_PDL)
    # 2 * ROWS rows: row 2c is column c's gate row (e's row c of w13), 2c + 1 its up row (row I + c)
    r = tl.arange(0, 2 * ROWS)
    col = c0 + r // 2
    rows = e * 2 * I + col + (r % 2) * I
    y = rows_dot(w13_ptr, rows, col < I, x_ptr, D, D, BLOCK_K)  # [2 * ROWS] fp32
    gate, up = tl.split(tl.reshape(y, [ROWS, 2]))
    if USE_PDL:
        gdc_launch_dependents()
    h = _act_mul(gate, up, beta, lin_beta, SITU, LIN_SAT)
    offs = c0 + tl.arange(0, ROWS)
    tl.store(h_ptr + slot.to(tl.int64) * I + offs, h.to(h_ptr.dtype.element_ty), mask=offs < I)


@triton.jit
def _gemv_down_kernel(h_ptr, w2_ptr, ids_ptr, topk_w_ptr, y_ptr, D, E_ROUTED, I: tl.constexpr, TOPK: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    slot, d0, e = _slot_rows(ids_ptr, D, TOPK, E_ROUTED, ROWS, USE_PDL)
    offs = d0 + tl.arange(0, ROWS)
    y = rows_dot(w2_ptr, e * D + offs, offs < D, h_ptr + slot.to(tl.int64) * I, I, I, BLOCK_K)  # [ROWS] fp32
    if USE_PDL:
        gdc_launch_dependents()
    # routed slots: their routing weight; shared slots: 1
    w = tl.load(topk_w_ptr + tl.minimum(slot, TOPK - 1))
    y = y * tl.where(slot < TOPK, w, 1.0)
    tl.store(y_ptr + slot.to(tl.int64) * D + offs, y.to(y_ptr.dtype.element_ty), mask=offs < D)


def gemv_expert_outputs(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, *, situ: bool,
                        beta: float, lin_beta: float | None, shared_experts: int, use_pdl: bool,
                        rows: tuple[int, int, int, int] | None = None) -> Tensor:
    """The per-slot outputs y [k + S, D] (x.dtype, routing weight applied) of one token's k routed slots and S
    shared experts (`fused_experts` checked the call; its slot sum follows). rows: (ROWS_1, ROWS_2, WARPS_1,
    WARPS_2) override (benchmarks)."""
    T, D = x.shape
    assert T == 1
    E, I = w13.shape[0], w13.shape[1] // 2
    k, S = topk_ids.shape[1], shared_experts
    r1, r2, nw1, nw2 = rows or (ROWS_1, ROWS_2, WARPS_1, WARPS_2)
    h = poison_like(torch.empty(k + S, I, dtype=x.dtype, device=x.device))
    y = poison_like(torch.empty(k + S, D, dtype=x.dtype, device=x.device))
    pdl = use_pdl and not INTERPRET
    _gemv_gate_up_kernel[((k + S) * triton.cdiv(I, r1),)](
        x, w13, topk_ids, h, I, float(beta), float(lin_beta or 1.0), E - S, D=D, TOPK=k, ROWS=r1,
        BLOCK_K=rows_dot_step(w13, D), SITU=situ, LIN_SAT=situ and lin_beta is not None, USE_PDL=pdl, num_warps=nw1,
        num_stages=1, **pdl_kwargs(use_pdl),
    )
    _gemv_down_kernel[((k + S) * triton.cdiv(D, r2),)](
        h, w2, topk_ids, topk_weights, y, D, E - S, I=I, TOPK=k, ROWS=r2, BLOCK_K=rows_dot_step(w2, I), USE_PDL=pdl,
        num_warps=nw2, num_stages=1, **pdl_kwargs(use_pdl),
    )
    return y
