"""Fused routed experts (Triton): out[t] = sum_j w[t, j] * w2[e] act_and_mul(w13[e] x[t]), e = ids[t, j].

Four steps, every buffer sized from T*k, E and the tile config (no host sync, CUDA-graph safe):
  1. `triton_align.moe_align_fwd`: pairs p = t*k + j sorted by expert, each expert's run padded to
     BLOCK_M rows, the expert of each block;
  2. gate/up grouped GEMM: per (block, BLOCK_N columns of I) program, gather x rows, accumulate the
     gate and the up tile in fp32 against w13[e], apply SiLU/SiTU and the product in the epilogue,
     store h [slot, I] in x.dtype (padding rows come out as act(0) * 0 = 0);
  3. down grouped GEMM: h rows of a block against w2[e] in fp32, times the pair's routing weight,
     stored per pair in x.dtype: y [P, D] (row p = t*k + j);
  4. the sum over the k slots of each token, in slot order, in fp32.
No atomics anywhere, so the result is bit-reproducible. Oracle: `ref.py::fused_experts_ref`.

Decode (few rows per expert) is bandwidth-bound: BLOCK_M = 16 rows (one MMA tile; most rows are padding),
narrow N tiles so the selected experts' weights are spread over many programs and streamed once.
Prefill is compute-bound: BLOCK_M 64/128, wide tiles for the tensor cores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs, poison_like, tma_ok
from k3rt.kernels.moe.triton_align import moe_align_fwd, moe_align_grouped
from k3rt.model_config import ActivationConfig


class SumNorm(NamedTuple):
    """The experts' sum's epilogue (`norm=` of the fused-experts launchers; a plain (weight, eps) pair is one too):
    RMSNorm by weight / eps of each token's sum rounded to x's dtype (LatentMoE's routed_expert_norm), or, with
    residual, of residual + that rounded sum, rounded again, the new residual stream written to residual_out: the
    decoder layer's residual add and the next norm (kernels/norm's `rms_norm(residual=)`, its rounding order)."""

    weight: Tensor
    eps: float
    residual: Tensor | None = None  # [T, D] x.dtype, last dim contiguous
    residual_out: Tensor | None = None  # [T, D] x.dtype contiguous (may be residual itself)


# The expert GEMMs' arguments that change with the batch and the routing (pairs, tokens, block counts): not
# specialized, so one compile serves every step of a tile config (kernels/common.py, "Compiles"); D and I
# (model shape, in the address arithmetic) stay specialized
PER_STEP = ["P", "T", "NB_ROUTED", "NB_SHARED", "H_SHARED"]


@dataclass(frozen=True)
class ExpertTiles:
    """Tile config of the two grouped GEMMs (block_m is shared: it is the alignment's padding)."""

    block_m: int
    block_n1: int  # gate/up: columns of I per program (each program does a gate and an up tile)
    block_k1: int
    block_n2: int  # down: columns of D per program
    block_k2: int
    num_warps1: int
    num_warps2: int
    num_stages: int
    # the expert weights' tiles (and the down GEMM's h tiles) through TMA descriptors instead of pointer loads
    tma: bool = False
    # grouped tiles: the experts' runs are padded to tail.block_m rows only (not block_m), the tiles of block_m rows
    # take the runs' whole groups of block_m // tail.block_m blocks and a second launch of each GEMM in `tail`'s
    # config their leftover blocks (`moe_align_grouped`). 128-row tiles padded per expert waste 64 rows per expert
    # on average, a quarter of the rows at 8K tokens on the 48B (256 experts, 256 rows each); padding to 64
    # halves that
    tail: ExpertTiles | None = None


DECODE_TILES = ExpertTiles(16, 32, 128, 64, 128, 4, 4, 4)
PREFILL_TILES_64 = ExpertTiles(64, 64, 64, 128, 64, 4, 4, 3)
PREFILL_TILES_128 = ExpertTiles(128, 64, 64, 128, 64, 8, 8, 3, tma=True)
# 128-row tiles over runs padded to 64 rows, the runs' odd 64-row blocks in PREFILL_TILES_64's config (not timed yet)
PREFILL_TILES_128_GROUPED = ExpertTiles(128, 64, 64, 128, 64, 8, 8, 3, tma=True, tail=PREFILL_TILES_64)
# Alternatives the benchmark times against the defaults (and the gpu tests check for correctness).
DECODE_CANDIDATES = (
    DECODE_TILES,
    ExpertTiles(16, 64, 128, 64, 128, 4, 4, 4),
    ExpertTiles(16, 32, 256, 32, 256, 4, 4, 3),
    ExpertTiles(16, 16, 128, 32, 128, 2, 2, 4),
    ExpertTiles(16, 32, 128, 128, 64, 4, 4, 5),
    # more programs per expert at T=1 (9 experts x 32 column tiles fill 132 SMs unevenly)
    ExpertTiles(16, 16, 256, 32, 256, 4, 4, 3),
    ExpertTiles(16, 16, 128, 32, 128, 4, 4, 4),
    ExpertTiles(16, 32, 128, 32, 128, 4, 4, 4),
    ExpertTiles(16, 16, 256, 16, 256, 2, 2, 4),
    ExpertTiles(16, 32, 128, 64, 128, 4, 4, 4, tma=True),
)
# Alternatives timed against the defaults. Session 24 (H200, 48B shape, T = 8192, `kernels_moe.py --prefill-t 8192`)
# also timed BLOCK_M 64 with 4 stages, 4 stages at 128, down tiles 256 wide, K steps of 128 and gate/up tiles 32
# wide: each 7-53% slower than PREFILL_TILES_128 (itself at 51% of the matmul rate there)
PREFILL_CANDIDATES = (
    PREFILL_TILES_64, PREFILL_TILES_128, ExpertTiles(128, 128, 64, 128, 64, 8, 8, 3),
    # the weights' tiles (and the down GEMM's h) through TMA descriptors (session 29: PREFILL_TILES_128 with TMA
    # 1.05x / 1.07x the pointer loads at T = 8K / 32K, 48B shape; 64-row tiles 3% slower with it at 2K)
    ExpertTiles(128, 64, 64, 128, 64, 8, 8, 3),
    ExpertTiles(128, 64, 64, 128, 64, 8, 8, 4, tma=True),
    ExpertTiles(64, 64, 64, 128, 64, 4, 4, 3, tma=True),
    ExpertTiles(128, 128, 64, 128, 64, 8, 8, 3, tma=True),
    ExpertTiles(128, 64, 128, 128, 128, 8, 8, 3, tma=True),
    ExpertTiles(128, 64, 64, 256, 64, 8, 8, 3, tma=True),
    PREFILL_TILES_128_GROUPED,
    ExpertTiles(128, 64, 64, 128, 64, 8, 8, 3, tma=True, tail=ExpertTiles(32, 64, 64, 128, 64, 4, 4, 3)),
)
# Interpreter: small tiles keep the CPU runs short.
INTERPRET_TILES = ExpertTiles(16, 16, 16, 16, 16, 4, 4, 1)


def pick_tiles(num_pairs: int, num_experts: int, grouped: bool = False) -> ExpertTiles:
    """By the expected rows per expert: decode tiles up to 16 (48B: T <= 512), BLOCK_M 64 below
    256, then 128 (padding wastes under BLOCK_M / 2 rows per expert on average); grouped: those as
    PREFILL_TILES_128_GROUPED (the runs padded to 64 rows only)."""
    if INTERPRET:
        return INTERPRET_TILES
    rows = num_pairs / num_experts
    if rows <= 16:
        return DECODE_TILES
    if rows < 256:
        return PREFILL_TILES_64
    return PREFILL_TILES_128_GROUPED if grouped else PREFILL_TILES_128


@triton.jit
def _tanh(y):
    # tanh through sigmoid: libdevice.tanh does not run under the interpreter
    return 2.0 * tl.sigmoid(2.0 * y) - 1.0


@triton.jit
def _block_rows(pid_m, sorted_ptr, block_expert_ptr, P, T, NB_ROUTED, NB_SHARED, E_ROUTED,
                TOPK: tl.constexpr, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """Block pid_m's expert (-1: an unused routed block), its rows' pair ids (the down GEMM's output
    rows), token ids and validity: the aligned routed blocks first, then NB_SHARED blocks per shared
    expert covering every token in order (pair P + s*T + t). PAIR_BLOCKS (one token): routed block b is pair b
    alone, block_expert the routing ids themselves, sorted_ptr unread (`align_blocks`)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if pid_m < NB_ROUTED:
        e = tl.load(block_expert_ptr + pid_m)
        if PAIR_BLOCKS:
            pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, P)
        else:
            pair = tl.load(sorted_ptr + offs_m, mask=e >= 0, other=P)
        row_ok = pair < P
        tok = pair // TOPK
    else:
        e, tok, row_ok, pair = _shared_rows(pid_m - NB_ROUTED, P, T, NB_SHARED, E_ROUTED, BLOCK_M)
    return e, pair, tl.where(row_ok, tok, 0).to(tl.int64), row_ok


@triton.jit
def _shared_rows(j, P, T, NB_SHARED, E_ROUTED, BLOCK_M: tl.constexpr):
    """Shared tile j (NB_SHARED per shared expert, every token in order): (expert, tokens, validity, pairs
    P + s*T + t)."""
    tok = (j % NB_SHARED) * BLOCK_M + tl.arange(0, BLOCK_M)
    return E_ROUTED + j // NB_SHARED, tok, tok < T, P + (j // NB_SHARED) * T + tok


@triton.jit
def _tile_rows(pid_m, sorted_ptr, block_expert_ptr, table_ptr, P, T, NB_ROUTED, NB_SHARED, E_ROUTED, H_SHARED,
               TOPK: tl.constexpr, BLOCK_M: tl.constexpr, SUB_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
               GROUPED: tl.constexpr):
    """`_block_rows` with each tile's first row of h (int64), and GROUPED: routed tile pid_m covers BLOCK_M rows of
    one expert's run from the alignment's block table[pid_m] of SUB_M rows (-1: unused; `moe_align_grouped`).
    h: the routed rows at their sorted slots, the shared experts' tiles from row H_SHARED."""
    if GROUPED:
        if pid_m < NB_ROUTED:
            b0 = tl.load(table_ptr + pid_m)
            e = tl.load(block_expert_ptr + b0, mask=b0 >= 0, other=-1)
            h0 = b0.to(tl.int64) * SUB_M
            pair = tl.load(sorted_ptr + h0 + tl.arange(0, BLOCK_M), mask=e >= 0, other=P)
            row_ok = pair < P
            tok = pair // TOPK
        else:
            j = pid_m - NB_ROUTED
            e, tok, row_ok, pair = _shared_rows(j, P, T, NB_SHARED, E_ROUTED, BLOCK_M)
            h0 = H_SHARED + j.to(tl.int64) * BLOCK_M
        tok = tl.where(row_ok, tok, 0).to(tl.int64)
    else:
        e, pair, tok, row_ok = _block_rows(pid_m, sorted_ptr, block_expert_ptr, P, T, NB_ROUTED, NB_SHARED,
                                           E_ROUTED, TOPK, BLOCK_M, PAIR_BLOCKS)
        h0 = pid_m.to(tl.int64) * BLOCK_M
    return e, pair, tok, row_ok, h0


@triton.jit
def _gate_up_loop(a_ptrs, w13_ptr, e, offs_n, row_ok, n_ok, acc_g, acc_u, D, I, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc_g, acc_u += the rows at a_ptrs ([BM, BK] from column 0) against expert e's gate and up rows offs_n of w13
    [E, 2I, D] (pointer loads), over D in steps of BLOCK_K."""
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + e.to(tl.int64) * (2 * I) * D + offs_n[None, :].to(tl.int64) * D + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + I * D  # the up rows follow the gate rows
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k0 + offs_k < D
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _act_mul(acc_g, acc_u, beta, lin_beta, SITU: tl.constexpr, LIN_SAT: tl.constexpr):
    """act(gate) * up in fp32: SiLU, or SiTU (and the up branch's linear saturation)."""
    if SITU:
        gate = beta * _tanh(acc_g / beta) * tl.sigmoid(acc_g)
        if LIN_SAT:
            acc_u = lin_beta * _tanh(acc_u / lin_beta)
    else:
        gate = acc_g * tl.sigmoid(acc_g)
    return gate * acc_u


@triton.jit(do_not_specialize=PER_STEP)
def _moe_gate_up_kernel(
    x_ptr, stride_xt,  # [T, D]
    w13_ptr,  # [E, 2I, D] contiguous
    h_ptr,  # [S, I] contiguous, S = sorted slots
    sorted_ptr, block_expert_ptr,
    table_ptr,  # GROUPED: [NB_ROUTED] the routed tiles' first blocks (moe_align_grouped)
    P, D, I,
    beta, lin_beta,
    T, NB_ROUTED, NB_SHARED, E_ROUTED,  # shared blocks: after the NB_ROUTED routed ones, NB_SHARED per shared expert
    H_SHARED,  # h's first row of the shared experts' tiles
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB_M: tl.constexpr,  # the alignment's block (GROUPED; else BLOCK_M)
    GROUPED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SITU: tl.constexpr,
    LIN_SAT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(I, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if USE_PDL:
        gdc_wait()
    e, _, tok, row_ok, h0 = _tile_rows(pid_m, sorted_ptr, block_expert_ptr, table_ptr, P, T, NB_ROUTED, NB_SHARED,
                                       E_ROUTED, H_SHARED, TOPK, BLOCK_M, SUB_M, PAIR_BLOCKS, GROUPED)
    if e >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if TMA:  # w13_ptr: a descriptor over [E*2I, D] (columns past D zero-filled; rows past I masked at the store)
            g_row = e * (2 * I) + pid_n * BLOCK_N
            for k0 in range(0, D, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & (k0 + offs_k < D)[None, :], other=0.0)
                bg = w13_ptr.load([g_row, k0])  # [BN, BK]
                bu = w13_ptr.load([g_row + I, k0])
                acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, tl.trans(bu), acc_u, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
        else:
            acc_g, acc_u = _gate_up_loop(a_ptrs, w13_ptr, e, offs_n, row_ok, n_ok, acc_g, acc_u, D, I, BLOCK_K, EVEN_K,
                                         DOT_PRECISION)
        if USE_PDL:
            gdc_launch_dependents()
        h = _act_mul(acc_g, acc_u, beta, lin_beta, SITU, LIN_SAT)
        h_ptrs = h_ptr + (h0 + tl.arange(0, BLOCK_M))[:, None] * I + offs_n[None, :]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=PER_STEP)
def _moe_down_kernel(
    h_ptr,  # [S, I] contiguous
    w2_ptr,  # [E, D, I] contiguous
    y_ptr,  # [P, D] contiguous, row p = t*k + j
    topk_w_ptr,  # [P] fp32
    sorted_ptr, block_expert_ptr,
    table_ptr,  # GROUPED: as the gate/up kernel's
    P, D, I,
    T, NB_ROUTED, NB_SHARED, E_ROUTED,
    H_SHARED,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB_M: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(D, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if USE_PDL:
        gdc_wait()
    e, pair, _, row_ok, h0 = _tile_rows(pid_m, sorted_ptr, block_expert_ptr, table_ptr, P, T, NB_ROUTED, NB_SHARED,
                                        E_ROUTED, H_SHARED, TOPK, BLOCK_M, SUB_M, PAIR_BLOCKS, GROUPED)
    if e >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if TMA:  # h_ptr over [S, I], w2_ptr over [E*D, I]: descriptors (columns past I zero-filled)
            b_row = e * D + pid_n * BLOCK_N
            for k0 in range(0, I, BLOCK_K):
                a = h_ptr.load([h0.to(tl.int32), k0])  # [BM, BK]
                b = w2_ptr.load([b_row, k0])  # [BN, BK]
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        else:
            a_ptrs = h_ptr + (h0 + tl.arange(0, BLOCK_M))[:, None] * I + offs_k[None, :]
            b_ptrs = w2_ptr + e.to(tl.int64) * D * I + offs_n[None, :].to(tl.int64) * I + offs_k[:, None]
            for k0 in range(0, I, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
                else:
                    k_ok = k0 + offs_k < I
                    a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        if USE_PDL:
            gdc_launch_dependents()
        # routed rows: their routing weight; shared rows: 1; padding rows: 0
        w = tl.load(topk_w_ptr + pair, mask=row_ok & (pid_m < NB_ROUTED), other=1.0)
        y = acc * tl.where(row_ok, w, 0.0)[:, None]
        y_ptrs = y_ptr + pair[:, None].to(tl.int64) * D + offs_n[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# not specialized per step (kernels/common.py, Compiles): T, P: the step's tokens and pairs
@triton.jit(do_not_specialize=["T", "P"])
def _moe_sum_kernel(y_ptr, out_ptr, stride_ot, D, T, P, norm_w_ptr, eps, r_ptr, stride_r, h_ptr, TOPK: tl.constexpr,
                    SHARED: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr, NORM: tl.constexpr = False,
                    RESIDUAL: tl.constexpr = False):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    if USE_PDL:
        gdc_wait()
    row = y_ptr + t.to(tl.int64) * TOPK * D + offs
    acc = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        acc += tl.load(row + j * D, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(SHARED):  # the shared experts' rows P + s*T + t, after the routed slots
        acc += tl.load(y_ptr + (P + s * T + t).to(tl.int64) * D + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    if NORM:  # the whole row is here (BLOCK_D >= D): kernels/norm's rounding order on the sum rounded to x's dtype
        h = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        if RESIDUAL:  # the layer's residual add first, rounded, and that is the new residual stream (SumNorm)
            r = tl.load(r_ptr + t.to(tl.int64) * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(y_ptr.dtype.element_ty)
            tl.store(h_ptr + t.to(tl.int64) * D + offs, h, mask=mask)
            h = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
        acc = (h * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * tl.load(norm_w_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_act(act: ActivationConfig) -> None:
    if act.name == "silu":
        return
    if act.name != "situ" or act.situ_beta is None or act.situ_beta <= 0:
        raise ValueError(f"act must be silu, or situ with situ_beta > 0, got {act}")
    if act.situ_linear_beta is not None and act.situ_linear_beta <= 0:
        raise ValueError(f"act.situ_linear_beta must be > 0 or None, got {act.situ_linear_beta}")


def check_x(x: Tensor) -> tuple[int, int]:
    """x: [T, D] bf16/fp16/fp32 with a contiguous last dim -> (T, D)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(-1) != 1:
        raise ValueError(f"x must be bf16/fp16/fp32 [T, D] with a contiguous last dim, got {x.dtype} "
                         f"{list(x.shape)} strides {x.stride()}")
    return x.shape[0], x.shape[1]


def check_stacks(x: Tensor, w13: Tensor, w2: Tensor) -> tuple[int, int]:
    """Dense expert stacks for x [T, D]: w13 [E, 2I, D] and w2 [E, D, I], contiguous, x.dtype -> (E, I)."""
    D = x.shape[1]
    if w13.dim() != 3 or w13.shape[2] != D or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, D={D}], got {list(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    check(w13, "w13", (E, 2 * I, D), x.dtype)
    check(w2, "w2", (E, D, I), x.dtype)
    for name, t in (("w13", w13), ("w2", w2)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return E, I


def check_routing(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: ActivationConfig, shared_experts: int,
                  num_experts: int, out: Tensor | None, norm: SumNorm | tuple[Tensor, float] | None = None) -> int:
    """The arguments every fused-experts launcher shares besides the weights; -> k (slots per token)."""
    T, D = x.shape
    if norm is not None:
        norm = SumNorm(*norm)
        check(norm.weight, "norm weight", (D,), x.dtype)
        if not norm.weight.is_contiguous():
            raise ValueError("norm weight must be contiguous")
        if (norm.residual is None) != (norm.residual_out is None):
            raise ValueError("norm residual and residual_out must be given together")
        if norm.residual is not None:
            check(norm.residual, "norm residual", (T, D), x.dtype)
            check(norm.residual_out, "norm residual_out", (T, D), x.dtype)
            if norm.residual.stride(-1) != 1 or not norm.residual_out.is_contiguous():
                raise ValueError("norm residual must have a contiguous last dim and residual_out be contiguous")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [T={T}, k], got {list(topk_ids.shape)}")
    k = topk_ids.shape[1]
    check(topk_ids, "topk_ids", (T, k), torch.int32)
    check(topk_weights, "topk_weights", (T, k), torch.float32)
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    _check_act(act)
    if not 0 <= shared_experts < num_experts:
        raise ValueError(f"shared_experts must be in [0, E={num_experts}), got {shared_experts}")
    if out is not None:
        check(out, "out", (T, D), x.dtype)
        if out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    return k


@dataclass(frozen=True)
class ExpertBlocks:
    """The alignment of one launch and its scratch: the grouped GEMMs' rows and the per-pair outputs."""

    sorted_ids: Tensor
    block_expert: Tensor
    num_blocks: int  # tiles along M of the (first) launch: routed, then S * NB_SHARED shared
    args: tuple[int, int, int, int]  # T, NB_ROUTED, NB_SHARED, E_ROUTED (the kernels' _block_rows arguments)
    h: Tensor  # [rows, I] gate/up output: the routed rows at their sorted slots, then the shared experts' tiles
    y: Tensor  # [P + S*T, D] per-pair (and shared) outputs
    pair_blocks: bool = False  # routed block b is pair b alone (the kernels' PAIR_BLOCKS)
    h_shared: int = 0  # h's first row of the shared experts' tiles
    # grouped (`ExpertTiles.tail`): the first launch's routed tiles (groups of blocks) and the tail launch's
    big: Tensor | None = None
    small: Tensor | None = None


def check_call(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: ActivationConfig,
               shared_experts: int, out: Tensor | None,
               norm: SumNorm | tuple[Tensor, float] | None = None) -> tuple[int, int, int, int, int, Tensor]:
    """The checks of a call with stacked 16-bit/fp32 expert weights (`fused_experts`, grouped.py's
    `fused_experts_grouped`), each error naming the argument; -> (T, D, E, I, k, out), out allocated when None."""
    T, D = check_x(x)
    E, I = check_stacks(x, w13, w2)
    k = check_routing(x, topk_weights, topk_ids, act, shared_experts, E, out, norm)
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, out=out)
    if out is None:
        out = poison_like(torch.empty(T, D, dtype=x.dtype, device=x.device))
    return T, D, E, I, k, out


# pair blocks for several tokens while their expert weights read, one pair at a time, stay within this many bytes
# (a few hundred ns of bandwidth, against the alignment's ~3 us launch; k3-tiny's verify of 8 or 16 rows: 1.2 or
# 2.3 MB; never the 48B's 14 MB experts)
PAIR_BLOCKS_MAX_BYTES = 4 << 20


def align_blocks(x: Tensor, topk_ids: Tensor, num_experts: int, inter: int, shared_experts: int, block_m: int,
                 use_pdl: bool, group: int = 1, pair_blocks_bytes: int | None = None) -> ExpertBlocks:
    """The grouped GEMMs' blocks: the alignment (`moe_align_fwd`), or each pair as a block of one row in pair order
    (pair_blocks) for one token (its slots name k distinct experts, or under expert parallelism a repeated local
    expert at weight 0, which a block of its own computes the same) and for a few tokens of small experts
    (PAIR_BLOCKS_MAX_BYTES: an expert two pairs share is read twice). No alignment launch then (batch-1 decode
    and k3-tiny's verify steps: one launch fewer per MoE layer, ~3 us each on the H200); the per-pair outputs are
    the same. group > 1 (several tokens): the runs padded to block_m rows and the tables of tiles of group blocks
    and of the leftover blocks (`moe_align_grouped`); the shared experts' tiles then have group * block_m rows.
    pair_blocks_bytes: the bound for several tokens (None: PAIR_BLOCKS_MAX_BYTES; 0: one token only)."""
    T, D = x.shape
    P, S = topk_ids.numel(), shared_experts
    E_routed = num_experts - S
    # (a few tokens: the decode tiles only, whose 16-row blocks waste less than prefill tiles' on one row each)
    bound = PAIR_BLOCKS_MAX_BYTES if pair_blocks_bytes is None else pair_blocks_bytes
    pair_blocks = T == 1 or (group == 1 and block_m <= 16 and P * 3 * D * inter * x.element_size() <= bound)
    big = small = None
    if pair_blocks:
        block_expert = topk_ids.view(-1)
        sorted_ids = block_expert  # not read (PAIR_BLOCKS)
        group = 1
    elif group > 1:
        sorted_ids, block_expert, big, small = moe_align_grouped(topk_ids, E_routed, block_m, group, use_pdl=use_pdl)
    else:
        sorted_ids, block_expert = moe_align_fwd(topk_ids, E_routed, block_m, use_pdl=use_pdl)
    nb_routed = block_expert.numel() if big is None else big.numel()  # the first launch's routed tiles
    tile_m = block_m * group
    nb_shared = triton.cdiv(T, tile_m)
    h_shared = block_expert.numel() * block_m
    h = poison_like(torch.empty(h_shared + S * nb_shared * tile_m, inter, dtype=x.dtype, device=x.device))
    y = poison_like(torch.empty(P + S * T, D, dtype=x.dtype, device=x.device))
    return ExpertBlocks(sorted_ids, block_expert, nb_routed + S * nb_shared, (T, nb_routed, max(1, nb_shared),
                        E_routed), h, y, pair_blocks, h_shared, big, small)


# the widest row the sum's norm epilogue takes (one program per row holds it: the 48B's 2,304, a [4096] fp32 row
# across 4 warps); the plain sum's column block
NORM_MAX_D = 4096
SUM_BLOCK_D = 1024


def norm_after(y: Tensor, norm: SumNorm | tuple[Tensor, float], out: Tensor, use_pdl: bool) -> Tensor:
    """The SumNorm epilogue as kernels/norm's launch after the sum y (rows too wide for one program, or a sum that
    splits rows), into out."""
    from k3rt.kernels.norm import rms_norm

    n = SumNorm(*norm)
    if n.residual is None:
        return rms_norm(y, n.weight, n.eps, out=out, use_pdl=use_pdl)
    rms_norm(y, n.weight, n.eps, residual=n.residual, residual_out=n.residual_out, out=out, use_pdl=use_pdl)
    return out


def sum_slots(y: Tensor, out: Tensor, k: int, shared_experts: int, use_pdl: bool,
              norm: SumNorm | tuple[Tensor, float] | None = None) -> Tensor:
    """out[t] = the sum over token t's k routed slots, then its shared experts' rows, in fp32; with norm
    (SumNorm) RMSNorm of that sum rounded to y's dtype (after the residual add, with one), as kernels/norm rounds:
    in this launch where a row fits one program (D <= NORM_MAX_D), else by the norm kernel after."""
    T, D = out.shape
    if norm is not None and D > NORM_MAX_D:
        return norm_after(sum_slots(y, torch.empty_like(out), k, shared_experts, use_pdl), norm, out, use_pdl)
    n = None if norm is None else SumNorm(*norm)
    res = n is not None and n.residual is not None
    pdl = use_pdl and not INTERPRET
    block_d = triton.next_power_of_2(D) if n is not None else min(SUM_BLOCK_D, triton.next_power_of_2(D))
    _moe_sum_kernel[(T, triton.cdiv(D, block_d))](
        y, out, out.stride(0), D, T, T * k, n.weight if n else out, float(n.eps) if n else 0.0,
        n.residual if res else out, n.residual.stride(0) if res else 0, n.residual_out if res else out, TOPK=k,
        SHARED=shared_experts, BLOCK_D=block_d, USE_PDL=pdl, NORM=n is not None, RESIDUAL=res, num_warps=4,
        **pdl_kwargs(use_pdl),
    )
    return out


def fused_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    act: ActivationConfig,
    out: Tensor | None = None,
    shared_experts: int = 0,
    use_pdl: bool = False,
    tiles: ExpertTiles | None = None,
    grouped_tiles: bool = False,
    one_token: bool = False,
    norm: SumNorm | tuple[Tensor, float] | None = None,
    pair_blocks_bytes: int | None = None,
    gemv: bool = False,
) -> Tensor:
    """Routed experts of one MoE layer for T tokens (model-facts §6; SiTU §7.3).

    Args:
        x: [T, D] activations (bf16, fp16 or fp32; last dim contiguous). For LatentMoE, D is the
            latent width and x is already down-projected.
        w13: [E, 2I, D] contiguous, x.dtype: each expert's gate rows, then its up rows.
        w2: [E, D, I] contiguous, x.dtype.
        topk_weights: [T, k] fp32 contiguous routing weights (scaling included).
        topk_ids: [T, k] int32 contiguous, values in [0, E - shared_experts) (not checked: that would sync).
        act: silu, or situ with situ_beta (and optional situ_linear_beta).
        out: optional [T, D] x.dtype output (last dim contiguous).
        shared_experts: S >= 0: the last S experts of w13/w2 are shared experts every token runs with
            weight 1, summed after its routed slots. Their blocks (every token in order) follow the
            routed blocks directly: they take no part in the alignment, whose cost grows with the
            expert count rounded up to a power of two (256 routed + 1 shared would double it).
        use_pdl: chain the launches with programmatic dependent launch (GPU only).
        tiles: tile config override (benchmarks); default `pick_tiles(T*k + S*T, E, grouped_tiles)`.
        grouped_tiles: the default's 128-row tiles as PREFILL_TILES_128_GROUPED (KernelConfig.moe_grouped_tiles).
        one_token: with T == 1 and no tiles given, two launches instead of three (triton_one_token.py;
            KernelConfig.moe_one_token).
        norm: (weight [D] x.dtype, eps): RMSNorm of each token's sum (LatentMoE's routed_expert_norm), in the sum's
            launch where a row fits it (`sum_slots`; the one-token path's sum splits rows: the norm kernel after);
            the sum is rounded to x.dtype first, as the unfused layer rounds it. A SumNorm with a residual: the
            decoder layer's residual add and its next norm instead (the output is then the normed row, and the new
            residual stream goes to residual_out).
        pair_blocks_bytes: a few tokens' pairs as blocks of one row (no alignment) while their experts' weights,
            read once per pair, stay within this many bytes (`align_blocks`; None: PAIR_BLOCKS_MAX_BYTES; 0: one
            token only; KernelConfig.moe_pair_blocks_bytes).
        gemv: with T == 1 and no tiles given, the experts as GEMVs of a few weight rows a program
            (triton_gemv_experts.py: thousands of equal programs instead of 288 / 324 MMA tiles; KernelConfig.moe_gemv),
            then the same slot sum.

    Returns:
        [T, D] in x.dtype. Rounding: h and the per-pair outputs are stored in x.dtype (ref.py).
    """
    T, D, E, I, k, out = check_call(x, w13, w2, topk_weights, topk_ids, act, shared_experts, out, norm)
    P = T * k
    if P == 0:
        return out
    S = shared_experts
    if one_token and T == 1 and tiles is None:
        from k3rt.kernels.moe.triton_one_token import fused_experts_one_token  # imports this module

        y = fused_experts_one_token(x, w13, w2, topk_weights, topk_ids, situ=act.name == "situ",
                                    beta=act.situ_beta or 1.0, lin_beta=act.situ_linear_beta,
                                    out=out if norm is None else torch.empty_like(out), shared_experts=S,
                                    use_pdl=use_pdl)
        return y if norm is None else norm_after(y, norm, out, use_pdl)
    if gemv and T == 1 and tiles is None:
        from k3rt.kernels.moe.triton_gemv_experts import gemv_expert_outputs  # imports this module

        y = gemv_expert_outputs(x, w13, w2, topk_weights, topk_ids, situ=act.name == "situ",
                                beta=act.situ_beta or 1.0, lin_beta=act.situ_linear_beta, shared_experts=S,
                                use_pdl=use_pdl)
        return sum_slots(y, out, k, S, use_pdl, norm)
    cfg = tiles or pick_tiles(P + S * T, E, grouped_tiles)
    sub = cfg.tail or cfg  # the alignment's block
    b = align_blocks(x, topk_ids, E, I, S, sub.block_m, use_pdl, cfg.block_m // sub.block_m, pair_blocks_bytes)
    pdl = use_pdl and not INTERPRET
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    situ = act.name == "situ"
    grouped = b.big is not None
    T_, nb_routed, nb_shared, E_routed = b.args

    def gemms(t: ExpertTiles, table: Tensor, n_routed: int, n_shared: int) -> None:
        """Both GEMMs over n_routed routed tiles of t.block_m rows (table: their first blocks, when grouped) and
        n_shared shared tiles per shared expert."""
        bn1, bk1 = min(t.block_n1, triton.next_power_of_2(I)), min(t.block_k1, max(16, triton.next_power_of_2(D)))
        bn2, bk2 = min(t.block_n2, triton.next_power_of_2(D)), min(t.block_k2, max(16, triton.next_power_of_2(I)))
        w13_arg, w2_arg, h_arg = w13.view(E * 2 * I, D), w2.view(E * D, I), b.h
        tma = t.tma and tma_ok(w13_arg, w2_arg, h_arg)  # rows of D and I elements 16-byte aligned, a TMA device
        if tma:
            w13_arg = TensorDescriptor.from_tensor(w13_arg, [bn1, bk1])
            w2_arg = TensorDescriptor.from_tensor(w2_arg, [bn2, bk2])
            h_arg = TensorDescriptor.from_tensor(h_arg, [t.block_m, bk2])
        n_m = n_routed + S * n_shared
        rows = (T_, n_routed, max(1, n_shared), E_routed, b.h_shared)
        common = dict(TOPK=k, BLOCK_M=t.block_m, SUB_M=sub.block_m, GROUPED=grouped, USE_PDL=pdl,
                      PAIR_BLOCKS=b.pair_blocks, TMA=tma, num_stages=t.num_stages, **pdl_kwargs(use_pdl))
        _moe_gate_up_kernel[(n_m * triton.cdiv(I, bn1),)](
            x, x.stride(0), w13_arg, b.h, b.sorted_ids, b.block_expert, table, P, D, I,
            float(act.situ_beta or 1.0), float(act.situ_linear_beta or 1.0), *rows,
            BLOCK_N=bn1, BLOCK_K=bk1, EVEN_K=D % bk1 == 0, SITU=situ, LIN_SAT=situ and act.situ_linear_beta is not None,
            DOT_PRECISION=precision, num_warps=t.num_warps1, **common,
        )
        _moe_down_kernel[(n_m * triton.cdiv(D, bn2),)](
            h_arg, w2_arg, b.y, topk_weights, b.sorted_ids, b.block_expert, table, P, D, I, *rows,
            BLOCK_N=bn2, BLOCK_K=bk2, EVEN_K=I % bk2 == 0, DOT_PRECISION=precision, num_warps=t.num_warps2, **common,
        )

    if grouped:  # the runs' groups of blocks in cfg's tiles (and the shared experts), their leftovers in the tail's
        gemms(cfg, b.big, nb_routed, nb_shared)
        if b.small.numel():
            gemms(sub, b.small, b.small.numel(), 0)
    else:
        gemms(cfg, b.block_expert, nb_routed, nb_shared)
    return sum_slots(b.y, out, k, S, use_pdl, norm)
