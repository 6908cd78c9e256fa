"""Fused routed experts with MXFP4 weights (Triton), dequantized in registers: weight-only W4A16 on Hopper.

The same four steps as `triton_experts.fused_experts` (alignment, gate/up grouped GEMM with the activation
in the epilogue, down grouped GEMM times the routing weight, per-token sum in slot order), with w13/w2
read as packed E2M1 bytes + E8M0 group scales (`mxfp4_ref.py` has the format). The products are computed
transposed, W [BN, BK] @ A^T [BK, BM]: the weight rows fill the MMA's M side, the few tokens its N side.

Two ways to multiply by a packed tile (`native`):
  - `tl.dot_scaled(w_packed, w_scale, "e2m1", a^T, None, "bf16")`: Triton's own E2M1 upcast feeding the
    tensor cores (compiled only; the default on the GPU);
  - the explicit dequant (the interpreter's path, and the alternative the benchmark times): the packed tile
    is split into its low nibbles (even K elements) and high nibbles (odd ones), the activation tile loaded
    as its even and odd K rows, so the product is dot(w_lo, a_lo) + dot(w_hi, a_hi) with no shuffle.
    A code decodes without a table: the fp16 with bits (sign << 15) | ((code & 7) << 9) is the E2M1 value
    times 2^-14 (exponent 0 lands on the fp16 subnormal exactly), and the scale 2^(s - 127) * 2^14 is the
    fp32 with exponent field s + 14.

Measured on the H200 (benchmarks/RESULTS.md, 2026-12-01): 23-30% of copy bandwidth at decode sizes, about
the time of the bf16 kernel that reads 3.8x the bytes. The kernel is ALU-bound on the upcast and the per-
element scale, not on memory (M = 1 and M = 16 take the same time; every tile config is within ~10%).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs, poison_like
from k3rt.kernels.moe.mxfp4_ref import GROUP
from k3rt.kernels.moe.triton_experts import (
    PER_STEP,
    ExpertTiles, _act_mul, _block_rows, align_blocks, check_routing, check_x, pick_tiles, SumNorm, sum_slots,
)
from k3rt.model_config import ActivationConfig

@dataclass(frozen=True)
class Mxfp4Tiles(ExpertTiles):
    """`ExpertTiles` plus `prefetch`: load step k+1's tiles before step k's math (software pipelining in
    registers, for loads the compiler's shared-memory pipeliner does not take: they feed the dequant, not a dot)."""

    prefetch: bool = False


# Decode tiles. The product is computed transposed, W [BN, BK] @ A^T [BK, BM]: the weight rows fill the MMA's
# M side and the few tokens its N side. BLOCK_K counts unpacked K elements (a multiple of 32).
MXFP4_DECODE_TILES = Mxfp4Tiles(16, 32, 128, 32, 128, 2, 2, 4)
MXFP4_DECODE_CANDIDATES = (
    MXFP4_DECODE_TILES,
    Mxfp4Tiles(16, 16, 128, 16, 128, 1, 1, 4),
    Mxfp4Tiles(16, 16, 256, 16, 256, 2, 2, 4),
    Mxfp4Tiles(16, 32, 256, 32, 256, 2, 2, 3),
    Mxfp4Tiles(16, 32, 128, 32, 128, 1, 1, 6),
    Mxfp4Tiles(16, 16, 128, 16, 128, 2, 2, 6),
    Mxfp4Tiles(16, 32, 64, 32, 64, 2, 2, 8),
    Mxfp4Tiles(16, 16, 64, 16, 64, 1, 1, 8),
    Mxfp4Tiles(16, 64, 64, 64, 64, 4, 4, 4),
    Mxfp4Tiles(16, 32, 128, 32, 128, 2, 2, 4, prefetch=True),
)
MXFP4_INTERPRET_TILES = Mxfp4Tiles(16, 16, 64, 16, 64, 4, 4, 1)


def mxfp4_tiles(num_pairs: int, num_experts: int) -> Mxfp4Tiles:
    if INTERPRET:
        return MXFP4_INTERPRET_TILES
    base = pick_tiles(num_pairs, num_experts)
    if base.block_m == 16:
        return MXFP4_DECODE_TILES
    # prefill: the bf16 tiles with the weight rows on the MMA's M side, BLOCK_K at least 64
    return Mxfp4Tiles(base.block_m, max(64, base.block_n1), max(64, base.block_k1), max(64, base.block_n2),
                      max(64, base.block_k2), base.num_warps1, base.num_warps2, base.num_stages)


@triton.jit
def _dequant(packed, scale, HIGH: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """packed uint8 [R, C], scale uint8 [R, C] (already gathered per element) -> the values of the low
    (HIGH=False) or high nibbles, in OUT_DTYPE."""
    code = (packed >> 4) if HIGH else (packed & 0xF)
    code = code.to(tl.int16)
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    v = bits.to(tl.float16, bitcast=True).to(tl.float32)
    # 2^(s - 127) * 2^14 = 2^(s - 113): the fp32 with exponent field s + 14 (valid for s <= 240)
    f = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    return (v * f).to(OUT_DTYPE)


@triton.jit
def _wt_dot(wq, ws, a_lo, a_hi, a, acc, NATIVE: tl.constexpr, A_FORMAT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BN, BM] += W [BN, BK] @ A^T [BK, BM], W given as packed bytes wq [BN, BK/2].
    NATIVE: tl.dot_scaled with the scales as [BN, BK/32] (ws) and A^T whole (a); else the explicit dequant
    with the per-byte scales (ws [BN, BK/2]) and A^T split in its even (a_lo) and odd (a_hi) K rows."""
    if NATIVE:
        acc = tl.dot_scaled(wq, ws, "e2m1", a, None, A_FORMAT, acc)
    else:
        dt = a_lo.dtype
        acc = tl.dot(_dequant(wq, ws, False, dt), a_lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(_dequant(wq, ws, True, dt), a_hi, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _a_tiles(xt_ptrs, xk_ptrs, k, mask, NATIVE: tl.constexpr):
    """A^T at K offset k: (a_lo, a_hi, a) = even rows, odd rows, all rows (only what the path uses is loaded)."""
    if NATIVE:
        a = tl.load(xk_ptrs + k, mask=mask, other=0.0)
        return a, a, a
    else:
        a_lo = tl.load(xt_ptrs + k, mask=mask, other=0.0)
        a_hi = tl.load(xt_ptrs + k + 1, mask=mask, other=0.0)
        return a_lo, a_hi, a_lo


@triton.jit
def _w_tiles(q_ptrs, s_ptrs, k, mask):
    """Packed bytes and scales of a weight tile at (unpacked) K offset k."""
    q = tl.load(q_ptrs + k // 2, mask=mask, other=0)
    sc = tl.load(s_ptrs + k // 32, mask=mask, other=0)
    return q, sc


@triton.jit(do_not_specialize=PER_STEP)
def _moe_gate_up_mxfp4_kernel(
    x_ptr, stride_xt,  # [T, D]
    wq_ptr,  # [E, 2I, D/2] uint8
    ws_ptr,  # [E, 2I, D/32] uint8
    h_ptr,  # [S, I]
    sorted_ptr, block_expert_ptr,
    P, D, I,
    beta, lin_beta,
    T, NB_ROUTED, NB_SHARED, E_ROUTED,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # unpacked K elements per step; D % BLOCK_K == 0 (checked by the launcher)
    SITU: tl.constexpr,
    LIN_SAT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NATIVE: tl.constexpr,  # tl.dot_scaled (compiled, bf16/fp16 activations); else the explicit dequant
    A_FORMAT: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(I, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if USE_PDL:
        gdc_wait()
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    e, _, tok, row_ok = _block_rows(pid_m, sorted_ptr, block_expert_ptr, P, T, NB_ROUTED, NB_SHARED, E_ROUTED,
                                    TOPK, BLOCK_M, PAIR_BLOCKS)
    if e >= 0:
        HALF: tl.constexpr = BLOCK_K // 2
        D2 = D // 2
        DG = D // 32
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        g_rows = e.to(tl.int64) * (2 * I) + offs_n[:, None].to(tl.int64)  # [BN, 1]; the up rows are + I
        offs_j = tl.arange(0, HALF)
        gq_ptrs = wq_ptr + g_rows * D2 + offs_j[None, :]  # [BN, HALF] packed bytes
        uq_ptrs = gq_ptrs + I * D2
        if NATIVE:
            offs_s = tl.arange(0, BLOCK_K // 32)[None, :]  # [1, BK/32] scales per row
        else:
            offs_s = offs_j[None, :] // 16  # [1, HALF]: each packed byte's scale
        gs_ptrs = ws_ptr + g_rows * DG + offs_s
        us_ptrs = gs_ptrs + I * DG
        # A^T tiles: [HALF, BM] even / odd K rows (explicit), [BK, BM] (native)
        xt_ptrs = x_ptr + tok[None, :] * stride_xt + 2 * offs_j[:, None]
        xk_ptrs = x_ptr + tok[None, :] * stride_xt + tl.arange(0, BLOCK_K)[:, None]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        a_mask = row_ok[None, :]
        w_mask = n_ok[:, None]
        if PREFETCH:
            # the next step's tiles are loaded before this step's math: the loads are consumed in registers
            # (not by a dot directly), so the compiler's shared-memory pipelining may not cover them
            a_lo, a_hi, a = _a_tiles(xt_ptrs, xk_ptrs, 0, a_mask, NATIVE)
            gq, gs = _w_tiles(gq_ptrs, gs_ptrs, 0, w_mask)
            uq, us = _w_tiles(uq_ptrs, us_ptrs, 0, w_mask)
            for k0 in range(0, D, BLOCK_K):
                more = k0 + BLOCK_K < D
                n_lo, n_hi, n_a = _a_tiles(xt_ptrs, xk_ptrs, k0 + BLOCK_K, a_mask & more, NATIVE)
                n_gq, n_gs = _w_tiles(gq_ptrs, gs_ptrs, k0 + BLOCK_K, w_mask & more)
                n_uq, n_us = _w_tiles(uq_ptrs, us_ptrs, k0 + BLOCK_K, w_mask & more)
                acc_g = _wt_dot(gq, gs, a_lo, a_hi, a, acc_g, NATIVE, A_FORMAT, DOT_PRECISION)
                acc_u = _wt_dot(uq, us, a_lo, a_hi, a, acc_u, NATIVE, A_FORMAT, DOT_PRECISION)
                a_lo, a_hi, a, gq, gs, uq, us = n_lo, n_hi, n_a, n_gq, n_gs, n_uq, n_us
        else:
            for k0 in range(0, D, BLOCK_K):
                a_lo, a_hi, a = _a_tiles(xt_ptrs, xk_ptrs, k0, a_mask, NATIVE)
                gq, gs = _w_tiles(gq_ptrs, gs_ptrs, k0, w_mask)
                uq, us = _w_tiles(uq_ptrs, us_ptrs, k0, w_mask)
                acc_g = _wt_dot(gq, gs, a_lo, a_hi, a, acc_g, NATIVE, A_FORMAT, DOT_PRECISION)
                acc_u = _wt_dot(uq, us, a_lo, a_hi, a, acc_u, NATIVE, A_FORMAT, DOT_PRECISION)
        if USE_PDL:
            gdc_launch_dependents()
        h = _act_mul(acc_g, acc_u, beta, lin_beta, SITU, LIN_SAT)  # [BN, BM]
        h_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + offs_n[:, None]
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[:, None])


@triton.jit(do_not_specialize=PER_STEP)
def _moe_down_mxfp4_kernel(
    h_ptr,  # [S, I]
    wq_ptr,  # [E, D, I/2] uint8
    ws_ptr,  # [E, D, I/32] uint8
    y_ptr,  # [P, D]
    topk_w_ptr,
    sorted_ptr, block_expert_ptr,
    P, D, I,
    T, NB_ROUTED, NB_SHARED, E_ROUTED,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # I % BLOCK_K == 0
    DOT_PRECISION: tl.constexpr,
    NATIVE: tl.constexpr,
    A_FORMAT: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(D, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    if USE_PDL:
        gdc_wait()
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    e, pair, _, row_ok = _block_rows(pid_m, sorted_ptr, block_expert_ptr, P, T, NB_ROUTED, NB_SHARED, E_ROUTED,
                                     TOPK, BLOCK_M, PAIR_BLOCKS)
    if e >= 0:
        HALF: tl.constexpr = BLOCK_K // 2
        I2 = I // 2
        IG = I // 32
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        rows = e.to(tl.int64) * D + offs_n[:, None].to(tl.int64)  # [BN, 1]
        offs_j = tl.arange(0, HALF)
        q_ptrs = wq_ptr + rows * I2 + offs_j[None, :]
        if NATIVE:
            s_ptrs = ws_ptr + rows * IG + tl.arange(0, BLOCK_K // 32)[None, :]
        else:
            s_ptrs = ws_ptr + rows * IG + offs_j[None, :] // 16
        ht_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + 2 * offs_j[:, None]  # [HALF, BM]
        hk_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + tl.arange(0, BLOCK_K)[:, None]  # [BK, BM]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        a_mask = offs_m[None, :] >= 0  # h rows are all allocated (padding rows hold zeros)
        w_mask = n_ok[:, None]
        if PREFETCH:
            a_lo, a_hi, a = _a_tiles(ht_ptrs, hk_ptrs, 0, a_mask, NATIVE)
            q, sc = _w_tiles(q_ptrs, s_ptrs, 0, w_mask)
            for k0 in range(0, I, BLOCK_K):
                more = k0 + BLOCK_K < I
                n_lo, n_hi, n_a = _a_tiles(ht_ptrs, hk_ptrs, k0 + BLOCK_K, a_mask & more, NATIVE)
                n_q, n_sc = _w_tiles(q_ptrs, s_ptrs, k0 + BLOCK_K, w_mask & more)
                acc = _wt_dot(q, sc, a_lo, a_hi, a, acc, NATIVE, A_FORMAT, DOT_PRECISION)
                a_lo, a_hi, a, q, sc = n_lo, n_hi, n_a, n_q, n_sc
        else:
            for k0 in range(0, I, BLOCK_K):
                a_lo, a_hi, a = _a_tiles(ht_ptrs, hk_ptrs, k0, a_mask, NATIVE)
                q, sc = _w_tiles(q_ptrs, s_ptrs, k0, w_mask)
                acc = _wt_dot(q, sc, a_lo, a_hi, a, acc, NATIVE, A_FORMAT, DOT_PRECISION)
        if USE_PDL:
            gdc_launch_dependents()
        w = tl.load(topk_w_ptr + pair, mask=row_ok & (pid_m < NB_ROUTED), other=1.0)
        y = acc * tl.where(row_ok, w, 0.0)[None, :]  # [BN, BM]
        y_ptrs = y_ptr + pair[None, :].to(tl.int64) * D + offs_n[:, None]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[None, :] & n_ok[:, None])


def native_scaled_dot(x: Tensor) -> bool:
    """Whether tl.dot_scaled can run: compiled (the interpreter has no dot_scaled) with bf16/fp16
    activations (dot_scaled takes no fp32 operand)."""
    return not INTERPRET and x.dtype in (torch.bfloat16, torch.float16)


def _block_k(tile_k: int, n: int) -> int:
    """The largest power of two <= tile_k dividing n (n is a multiple of 32; at least 64 when n allows)."""
    b = tile_k
    while b > 32 and n % b:
        b //= 2
    return b


def fused_experts_mxfp4(
    x: Tensor,
    w13_packed: Tensor,
    w13_scale: Tensor,
    w2_packed: Tensor,
    w2_scale: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    act: ActivationConfig,
    out: Tensor | None = None,
    norm: SumNorm | tuple[Tensor, float] | None = None,
    shared_experts: int = 0,
    use_pdl: bool = False,
    tiles: Mxfp4Tiles | None = None,
    native: bool | None = None,
) -> Tensor:
    """Routed experts of one MoE layer for T tokens with MXFP4 weights; the contract of
    `triton_experts.fused_experts` otherwise (oracle: `mxfp4_ref.fused_experts_mxfp4_ref`).

    Args:
        x: [T, D] bf16/fp16/fp32 activations, D % 32 == 0.
        w13_packed: [E, 2I, D/2] uint8, w13_scale: [E, 2I, D/32] uint8 (gate rows, then up rows).
        w2_packed: [E, D, I/2] uint8, w2_scale: [E, D, I/32] uint8; I % 32 == 0.
        native: use tl.dot_scaled (default: where it can run, `native_scaled_dot`); False: the explicit
            in-register dequant (what the interpreter runs; benchmarks compare the two on the GPU).
        the rest: as `fused_experts`.
    """
    T, D = check_x(x)
    if w13_packed.dim() != 3 or w13_packed.shape[2] * 2 != D or w13_packed.shape[1] % 2:
        raise ValueError(f"w13_packed must be [E, 2I, D/2={D // 2}] uint8, got {list(w13_packed.shape)}")
    E, I = w13_packed.shape[0], w13_packed.shape[1] // 2
    if D % GROUP or I % GROUP:
        raise ValueError(f"MXFP4 experts need D and I to be multiples of {GROUP}, got D={D}, I={I}")
    check(w13_packed, "w13_packed", (E, 2 * I, D // 2), torch.uint8)
    check(w13_scale, "w13_scale", (E, 2 * I, D // GROUP), torch.uint8)
    check(w2_packed, "w2_packed", (E, D, I // 2), torch.uint8)
    check(w2_scale, "w2_scale", (E, D, I // GROUP), torch.uint8)
    for name, t in (("w13_packed", w13_packed), ("w13_scale", w13_scale), ("w2_packed", w2_packed),
                    ("w2_scale", w2_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    k = check_routing(x, topk_weights, topk_ids, act, shared_experts, E, out, norm)
    check_same_device(x=x, w13_packed=w13_packed, w13_scale=w13_scale, w2_packed=w2_packed, w2_scale=w2_scale,
                      topk_weights=topk_weights, topk_ids=topk_ids, out=out)
    if out is None:
        out = poison_like(torch.empty(T, D, dtype=x.dtype, device=x.device))
    P = T * k
    if P == 0:
        return out
    S = shared_experts
    cfg = tiles or mxfp4_tiles(P + S * T, E)
    b = align_blocks(x, topk_ids, E, I, S, cfg.block_m, use_pdl)
    pdl = use_pdl and not INTERPRET
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    if native is None:
        native = native_scaled_dot(x)
    elif native and not native_scaled_dot(x):
        raise ValueError(f"native=True needs a compiled kernel and bf16/fp16 x, got {x.dtype}"
                         f"{' under the interpreter' if INTERPRET else ''}")
    a_format = "bf16" if x.dtype == torch.bfloat16 else "fp16"
    situ = act.name == "situ"
    bn1, bk1 = min(cfg.block_n1, triton.next_power_of_2(I)), _block_k(cfg.block_k1, D)
    _moe_gate_up_mxfp4_kernel[(b.num_blocks * triton.cdiv(I, bn1),)](
        x, x.stride(0), w13_packed, w13_scale, b.h, b.sorted_ids, b.block_expert, P, D, I,
        float(act.situ_beta or 1.0), float(act.situ_linear_beta or 1.0), *b.args,
        TOPK=k, BLOCK_M=cfg.block_m, BLOCK_N=bn1, BLOCK_K=bk1,
        SITU=situ, LIN_SAT=situ and act.situ_linear_beta is not None, DOT_PRECISION=precision,
        NATIVE=native, A_FORMAT=a_format, PREFETCH=cfg.prefetch, USE_PDL=pdl, PAIR_BLOCKS=b.pair_blocks,
        num_warps=cfg.num_warps1,
        num_stages=cfg.num_stages, **pdl_kwargs(use_pdl),
    )
    bn2, bk2 = min(cfg.block_n2, triton.next_power_of_2(D)), _block_k(cfg.block_k2, I)
    _moe_down_mxfp4_kernel[(b.num_blocks * triton.cdiv(D, bn2),)](
        b.h, w2_packed, w2_scale, b.y, topk_weights, b.sorted_ids, b.block_expert, P, D, I, *b.args,
        TOPK=k, BLOCK_M=cfg.block_m, BLOCK_N=bn2, BLOCK_K=bk2, DOT_PRECISION=precision,
        NATIVE=native, A_FORMAT=a_format, PREFETCH=cfg.prefetch, USE_PDL=pdl, PAIR_BLOCKS=b.pair_blocks,
        num_warps=cfg.num_warps2,
        num_stages=cfg.num_stages, **pdl_kwargs(use_pdl),
    )
    return sum_slots(b.y, out, k, S, use_pdl, norm)
