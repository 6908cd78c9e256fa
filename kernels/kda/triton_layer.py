"""One token's whole KDA layer in one persistent launch: the fused input projection, the low-rank gate's
up-projections, the conv + gates + delta-rule step + gated output norm, o_proj, and the decoder layer's residual add
and next norm (`kda_layer_one_token`; batch-1 decode).

Why: at batch 1 the 48B's KDA layer is five launches (the fused input GEMM on cuBLAS 17.3 us, the block-diagonal
up-projection 3.7, `kda_decode` 6.3, o_proj's GEMV ~7.9, the add + norm ~1.8: ~37 us against ~20 us for its ~85 MB;
session 39's profile on the H200, o_proj from session 4's kernels_linear.py run). Each launch ramps up and drains,
and the decode step is a chain of round trips to memory with the HBM idle.

Here G programs, all resident (kernels/persistent.py), take items in grid-stride order. Each program:
  1. computes its items of the input projection's low-rank and b rows (g_a, f_a, b: the rows the gates need first),
     arrives at LOW_DONE, then its items of the q|k|v rows, arrives at PROJ_DONE;
  2. waits for LOW_DONE, computes its items of the up-projections (gate and f rows: each a GEMV of its block's D
     columns of w_up against g_a or f_a), arrives at UP_DONE;
  3. waits for PROJ_DONE and UP_DONE, runs its (head, V slice) items of the decode step (`triton_step`'s pieces,
     the `kda_decode` kernel's math): conv of the head's q and k channels and of its slice's v channels from the
     cached window, SiLU, l2norm, gates, the state tile's delta-rule update in place, o's slice to an fp32 scratch,
     the slice's v window shifted; the slice that arrives last at its head's counter shifts the q/k window (every
     reader is done), takes the gated norm over the head's o (`_norm_gate_row`) and arrives at HEADS_DONE;
  4. (PREFETCH) asks the L2 for its first o_proj item's rows, waits for HEADS_DONE (all H heads), computes its
     o_proj items, adds the residual (rounded), and arrives at ALL_DONE; the last applies the next norm over the row
     and zeroes the counters.
The early rows come first, so the up-projections' wait is over long before the q|k|v rows end.

Roundings: the runner's decode path (`kda_project`, `kda_decode` with the gated norm, o_proj, `add_norm`): the
projections rounded to x.dtype, the decode step's fp32 math, o rounded, o_proj's output rounded, the residual add
rounded, then RMSNorm as kernels/norm rounds it. The GEMVs sum over K in another order than cuBLAS. No atomics touch
data. Oracle: those kernels in sequence (tests/kernels/test_kda_layer.py).

The interpreter runs programs one after another: there `phased=True` runs steps 1, 2, 3 and 4 as four launches
(PHASE 0-3), the launch boundaries standing for the waits (the head counters still pick each head's last slice).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs, poison_like
from k3rt.kernels.kda.triton_step import (
    _conv_hist, _conv_shift_store, _conv_taps, _conv_window, _delta_step, _gate_beta, _norm_gate_row, _silu_conv,
)
from k3rt.kernels.linear.triton_gemv import rows_dot, rows_dot_step
from k3rt.kernels.persistent import arrive, last_arrival, launch_persistent, prefetch_l2, row_rms_norm, wait

# The launch's counters: int32 words, zero between launches (constexpr globals: the kernels read them, host code
# their .value); words HEAD0 .. HEAD0 + H - 1 count each head's slices
LOW_DONE = tl.constexpr(0)  # arrivals: every program after its low-rank and b rows,
PROJ_DONE = tl.constexpr(1)  # after its q|k|v rows,
UP_DONE = tl.constexpr(2)  # after its up-projection rows,
HEADS_DONE = tl.constexpr(3)  # each head's last slice, after the head's norm (H in all),
ALL_DONE = tl.constexpr(4)  # every program after its o_proj rows (the last applies the norm, zeroes words 0-4)
STALLED = tl.constexpr(5)  # sticky: waits that gave up (kernels/persistent.py)
HEAD0 = tl.constexpr(8)
ALL_PHASES = tl.constexpr(4)


def kda_layer_sync_words(num_heads: int) -> int:
    """The counters a layer of num_heads heads needs (the caller's zeroed int32 buffer)."""
    return HEAD0.value + num_heads


@dataclass(frozen=True)
class KdaLayerTiles:
    """Item sizes and the launch shape (kernels/moe/triton_layer.py's LayerTiles says why they are small)."""

    rows: int = 4  # GEMV rows an item (input projection, o_proj); a multiple of num_warps
    # the up-projections' rows an item: their rows are short (D), so more of them a program keeps bytes in flight
    # (2P rows: about one item a program at the 48B)
    up_rows: int = 16
    v_split: int = 4  # a head's value columns over this many items (the decode step)
    # the decode step's state tile and windows set the registers (sm_90: 128 a thread at 4 warps and 4 slices, 216
    # at 2 warps), so 4 programs of 4 warps an SM: 16 warps streaming the GEMVs
    num_warps: int = 4
    per_sm: int = 4
    prefetch: bool = True  # the first o_proj item's rows asked of the L2 before the wait for the heads


DEFAULT_TILES = KdaLayerTiles()
# Alternatives the benchmark times (benchmarks/kernels.py --kda-layer); none timed yet
CANDIDATES = (DEFAULT_TILES, KdaLayerTiles(prefetch=False), KdaLayerTiles(v_split=8), KdaLayerTiles(v_split=2),
              KdaLayerTiles(rows=2, num_warps=2, per_sm=6, v_split=8), KdaLayerTiles(per_sm=3),
              KdaLayerTiles(up_rows=4))
INTERPRET_TILES = KdaLayerTiles(rows=2, up_rows=4, num_warps=2, per_sm=1, v_split=2)
# the launcher's tiles by default (exported as kernels.kda.KDA_LAYER_TILES: the runner's fit check)
KDA_LAYER_TILES = INTERPRET_TILES if INTERPRET else DEFAULT_TILES


@triton.jit
def _head_item(proj_ptr, up_ptr, conv_w_ptr, cs, s_base, a_log_ptr, dt_bias_ptr, raw_ptr, o_ptr, norm_o_w_ptr,
               sync_ptr, h, v, scale, lower_bound, eps_o, P: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
               WP: tl.constexpr, NV: tl.constexpr, BVS: tl.constexpr, OFF_B: tl.constexpr,
               USE_LOWER_BOUND: tl.constexpr, GRID: tl.constexpr):
    """Head h's value columns [v * BVS, (v + 1) * BVS): the decode step (module docstring, step 3)."""
    C: tl.constexpr = 3 * P
    offs_k = tl.arange(0, D)
    all_k = offs_k < D
    q_ch = h * D + offs_k
    k_ch = P + q_ch
    offs_v = v * BVS + tl.arange(0, BVS)
    v_ch = 2 * P + h * D + offs_v
    all_v = offs_v < D
    win_q = _conv_window(_conv_hist(cs, q_ch, all_k, C, W, WP), tl.load(proj_ptr + q_ch), W, WP)
    win_k = _conv_window(_conv_hist(cs, k_ch, all_k, C, W, WP), tl.load(proj_ptr + k_ch), W, WP)
    win_v = _conv_window(_conv_hist(cs, v_ch, all_v, C, W, WP), tl.load(proj_ptr + v_ch), W, WP)
    q = _silu_conv(win_q, _conv_taps(conv_w_ptr, q_ch, all_k, W, WP))
    k = _silu_conv(win_k, _conv_taps(conv_w_ptr, k_ch, all_k, W, WP))
    x_v = _silu_conv(win_v, _conv_taps(conv_w_ptr, v_ch, all_v, W, WP))
    q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    decay, beta = _gate_beta(up_ptr + P, dt_bias_ptr, a_log_ptr, proj_ptr + OFF_B, h, offs_k, all_k, lower_bound, D,
                             USE_LOWER_BOUND)
    s_ptrs = s_base + h * (D * D) + offs_k[:, None] * D + offs_v[None, :]
    S, o = _delta_step(tl.load(s_ptrs), q, k, x_v, decay, beta)
    tl.store(s_ptrs, S)
    tl.store(raw_ptr + h * D + offs_v, o)
    tl.debug_barrier()  # every thread has read the windows: this slice's v channels are its own to shift
    _conv_shift_store(win_v, cs, v_ch, all_v, C, W, WP)
    if last_arrival(sync_ptr + HEAD0 + h, NV):  # every slice of the head has read the q/k window and written its o
        _conv_shift_store(win_q, cs, q_ch, all_k, C, W, WP)
        _conv_shift_store(win_k, cs, k_ch, all_k, C, W, WP)
        _norm_gate_row(raw_ptr + h * D, up_ptr + h * D, norm_o_w_ptr, o_ptr + h * D, offs_k, all_k, eps_o, D)
        tl.store(sync_ptr + HEAD0 + h, 0)
        if GRID:
            arrive(sync_ptr + HEADS_DONE)


@triton.jit(do_not_specialize=["G"])  # one binary for grid_for's sizing and the launch (persistent.py)
def _kda_layer_kernel(
    x_ptr,  # [HID] x.dtype: the layer's (normed) input row
    w_in_ptr,  # [R_IN, HID] q|k|v (3P) | g_a (D) | f_a (D) | b (H) | pad
    w_up_ptr,  # [2P, 2D]: [[g_b, 0], [0, f_b]] (the diagonal blocks are read)
    conv_w_ptr,  # [3P, W] fp32
    conv_ptr, stride_cs_slot,  # [slots, W-1, 3P] the conv windows (a slot contiguous)
    a_log_ptr, dt_bias_ptr,  # [H], [P] fp32
    state_ptr, stride_state_slot,  # [slots, H, D, D] fp32 (a slot contiguous)
    slot_ptr,  # [1] int: the sequence's slot
    norm_o_w_ptr,  # [D] the output norm's weight
    wo_ptr,  # [HID, P] o_proj
    res_ptr, norm_w_ptr,  # [HID] the residual stream, the next norm's weight
    proj_ptr, up_ptr,  # [R_IN], [2P] x.dtype scratch: the projections (gate | f after the up-projections)
    raw_ptr,  # [P] fp32 scratch: o before the norm
    o_ptr,  # [P] x.dtype scratch: the gated, normed o (o_proj's input)
    sync_ptr,  # [HEAD0 + H] int32, zero on entry and on exit
    out_ptr, res_out_ptr,  # [HID] x.dtype: the normed row, the new residual stream
    scale, lower_bound, eps_o, eps, G,
    HID: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    NV: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    ROWS: tl.constexpr,
    UP_ROWS: tl.constexpr,
    BLOCK_KX: tl.constexpr,  # the GEMVs' K steps: over HID, over D (the up-projections), over P (o_proj)
    BLOCK_KD: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    BLOCK_HID: tl.constexpr,
    LINES_P: tl.constexpr,  # PREFETCH: 128-byte lines of an o_proj row, to a power of two
    PREFETCH: tl.constexpr,
    PHASE: tl.constexpr,  # 0-3: that step alone (phased launches); ALL_PHASES: all, with the waits
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    GRID: tl.constexpr = PHASE == ALL_PHASES
    P: tl.constexpr = H * D
    EARLY: tl.constexpr = 2 * D + H  # g_a, f_a, b: after q|k|v in w_in, first in the items
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    n_early = tl.cdiv(EARLY, ROWS)
    if USE_PDL:
        gdc_wait()
    if PHASE == 0 or GRID:
        for i in range(pid, n_early, G):
            r = 3 * P + i * ROWS + tl.arange(0, ROWS)
            ok = r < 3 * P + EARLY
            tl.store(proj_ptr + r, rows_dot(w_in_ptr, r.to(tl.int64), ok, x_ptr, HID, HID, BLOCK_KX).to(DTYPE),
                     mask=ok)
        if GRID:
            arrive(sync_ptr + LOW_DONE)
        for i in range(pid, 3 * P // ROWS, G):
            r = i * ROWS + tl.arange(0, ROWS)
            tl.store(proj_ptr + r, rows_dot(w_in_ptr, r.to(tl.int64), r < 3 * P, x_ptr, HID, HID, BLOCK_KX).to(DTYPE))
        if GRID:
            arrive(sync_ptr + PROJ_DONE)
            wait(sync_ptr + LOW_DONE, sync_ptr + STALLED, G)
    if PHASE == 1 or GRID:
        for i in range(pid, 2 * P // UP_ROWS, G):  # gate rows (block 0: g_a), then f rows (block 1: f_a)
            r = i * UP_ROWS + tl.arange(0, UP_ROWS)
            blk = (i * UP_ROWS) // P
            y = rows_dot(w_up_ptr + blk * D, r.to(tl.int64), r < 2 * P, proj_ptr + 3 * P + blk * D, 2 * D, D,
                         BLOCK_KD)
            tl.store(up_ptr + r, y.to(DTYPE))
        if GRID:
            arrive(sync_ptr + UP_DONE)
            wait(sync_ptr + PROJ_DONE, sync_ptr + STALLED, G)
            wait(sync_ptr + UP_DONE, sync_ptr + STALLED, G)
    if PHASE == 2 or GRID:
        slot = tl.load(slot_ptr).to(tl.int64)
        cs = conv_ptr + slot * stride_cs_slot
        s_base = state_ptr + slot * stride_state_slot
        for i in range(pid, H * NV, G):
            _head_item(proj_ptr, up_ptr, conv_w_ptr, cs, s_base, a_log_ptr, dt_bias_ptr, raw_ptr, o_ptr, norm_o_w_ptr,
                       sync_ptr, i // NV, i % NV, scale, lower_bound, eps_o, P, D, W, WP, NV, D // NV, 3 * P + 2 * D,
                       USE_LOWER_BOUND, GRID)
    if PHASE == 3 or GRID:
        if USE_PDL:
            gdc_launch_dependents()
        for i in range(pid, tl.cdiv(HID, ROWS), G):
            r = i * ROWS + tl.arange(0, ROWS)
            ok = r < HID
            if GRID and i == pid:
                if PREFETCH:  # o_proj's rows of this item while the last heads finish
                    offs = tl.arange(0, LINES_P) * (128 * 8 // wo_ptr.dtype.element_ty.primitive_bitwidth)
                    prefetch_l2(wo_ptr + r.to(tl.int64)[:, None] * P + offs[None, :], ok[:, None] & (offs < P)[None, :])
                wait(sync_ptr + HEADS_DONE, sync_ptr + STALLED, H)
            y = rows_dot(wo_ptr, r.to(tl.int64), ok, o_ptr, P, P, BLOCK_KP).to(DTYPE)
            h = (y.to(tl.float32) + tl.load(res_ptr + r, mask=ok).to(tl.float32)).to(DTYPE)
            tl.store(res_out_ptr + r, h, mask=ok)
        if last_arrival(sync_ptr + ALL_DONE, G):
            row_rms_norm(res_out_ptr, norm_w_ptr, out_ptr, eps, HID, BLOCK_HID)
            words = tl.arange(0, 8)
            tl.store(sync_ptr + words, tl.zeros([8], dtype=tl.int32), mask=words < STALLED)


def kda_layer_fits(rows: int, low_rank: bool, num_heads: int, head_dim: int, hidden: int, tiles: KdaLayerTiles) -> bool:
    """Whether `kda_layer_one_token` takes this layer: one token, the low-rank gates (w_up), a power-of-two head_dim
    the V split divides, a row the norm's one program holds."""
    from k3rt.kernels.moe.triton_experts import NORM_MAX_D

    P = num_heads * head_dim
    return (rows == 1 and low_rank and head_dim & (head_dim - 1) == 0 and head_dim % tiles.v_split == 0
            and P % tiles.rows == 0 and P % tiles.up_rows == 0 and hidden <= NORM_MAX_D)


def kda_layer_one_token(
    x: Tensor,
    w_in: Tensor,
    w_up: Tensor,
    conv_weight: Tensor,
    conv_pool: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state_pool: Tensor,
    slot: Tensor,
    o_norm_weight: Tensor,
    o_proj: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    sync: Tensor,
    *,
    o_norm_eps: float,
    eps: float,
    lower_bound: float | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    tiles: KdaLayerTiles | None = None,
    programs: int | None = None,
    phased: bool | None = None,
    use_pdl: bool = False,
) -> tuple[Tensor, Tensor]:
    """One token's KDA layer in one launch (module docstring): (RMSNorm(residual + o_proj(kda(x))) * norm_weight,
    residual + o_proj(kda(x))), both [1, HID] x.dtype; the conv window and the state of `slot` updated in place.

    Args:
        x: [1, HID] the layer's normed input row (bf16/fp16/fp32, contiguous).
        w_in: [R, HID] the fused input projection (backend/runner/gpu/kda.py KdaWeights.w_in): q|k|v (3P rows, P = H
            * D), g_a (D), f_a (D), b (H), any padding rows after.
        w_up: [2P, 2D] [[g_b, 0], [0, f_b]] (KdaWeights.w_up, the low-rank gates).
        conv_weight: [3P, W] fp32; conv_pool: [slots, W-1, 3P] (each slot contiguous).
        A_log: [H], dt_bias: [P] fp32; state_pool: [slots, H, D, D] fp32 (each slot contiguous).
        slot: [1] int32/int64 on the device: the sequence's slot in both pools.
        o_norm_weight: [D] the output norm's weight; o_norm_eps its eps.
        o_proj: [HID, P]; residual: [1, HID]; norm_weight: [HID] the next norm's, eps its eps.
        sync: [kda_layer_sync_words(H)] int32 zeros, owned by the caller (one launch in flight per buffer); left zero.
        lower_bound: the bounded gate's lower bound, None for softplus (`kda_decode`).
        out, residual_out: optional [1, HID] outputs.
        tiles, programs, phased, use_pdl: as kernels/moe `moe_layer_one_token`'s.
    """
    t = tiles or KDA_LAYER_TILES
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, HID], got {list(x.shape)}")
    HID = x.shape[1]
    _, H, D, _ = state_pool.shape
    P, W = H * D, conv_weight.shape[1]
    if not kda_layer_fits(1, True, H, D, HID, t):
        raise ValueError(f"kda_layer_one_token: head_dim {D} (a power of two, divisible by v_split {t.v_split}), "
                         f"H * D = {P} (divisible by {t.rows} and {t.up_rows} rows) and hidden {HID} within the "
                         f"norm's row")
    if w_in.shape[0] < 3 * P + 2 * D + H or w_in.shape[1] != HID or not w_in.is_contiguous():
        raise ValueError(f"w_in must be contiguous [>= {3 * P + 2 * D + H}, {HID}], got {list(w_in.shape)}")
    for name, tensor, shape, dtype in (
            ("w_up", w_up, (2 * P, 2 * D), x.dtype), ("conv_weight", conv_weight, (3 * P, W), torch.float32),
            ("A_log", A_log, (H,), torch.float32), ("dt_bias", dt_bias, (P,), torch.float32),
            ("o_norm_weight", o_norm_weight, (D,), None), ("o_proj", o_proj, (HID, P), x.dtype),
            ("residual", residual, (1, HID), x.dtype), ("norm_weight", norm_weight, (HID,), None),
            ("sync", sync, (kda_layer_sync_words(H),), torch.int32)):
        check(tensor, name, shape, dtype)
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if w_in.dtype != x.dtype:
        raise ValueError(f"w_in must be {x.dtype}, got {w_in.dtype}")
    if conv_pool.shape[1:] != (W - 1, 3 * P) or not conv_pool[0].is_contiguous():
        raise ValueError(f"conv_pool must be [slots, {W - 1}, {3 * P}] with each slot contiguous, got "
                         f"{list(conv_pool.shape)}")
    if state_pool.dtype != torch.float32 or state_pool.shape[3] != D or not state_pool[0].is_contiguous():
        raise ValueError(f"state_pool must be fp32 [slots, H, D, D] with each slot contiguous, got "
                         f"{state_pool.dtype} {list(state_pool.shape)}")
    if slot.numel() != 1 or slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot must be one int32/int64 index, got {slot.dtype} {list(slot.shape)}")
    check_same_device(x=x, w_in=w_in, conv_pool=conv_pool, state_pool=state_pool, slot=slot, o_proj=o_proj, sync=sync)
    new = lambda *shape, dtype=x.dtype: poison_like(torch.empty(*shape, dtype=dtype, device=x.device))  # noqa: E731
    out = new(1, HID) if out is None else out
    residual_out = new(1, HID) if residual_out is None else residual_out
    args = (x, w_in, w_up, conv_weight, conv_pool, conv_pool.stride(0), A_log, dt_bias, state_pool,
            state_pool.stride(0),
            slot, o_norm_weight, o_proj, residual, norm_weight, new(w_in.shape[0]), new(2 * P),
            new(P, dtype=torch.float32), new(P), sync, out, residual_out, float(D ** -0.5),
            0.0 if lower_bound is None else float(lower_bound), float(o_norm_eps), float(eps))
    consts = dict(HID=HID, H=H, D=D, W=W, WP=triton.next_power_of_2(W), NV=t.v_split,
                  USE_LOWER_BOUND=lower_bound is not None, ROWS=t.rows, UP_ROWS=t.up_rows,
                  BLOCK_KX=rows_dot_step(w_in, HID),
                  BLOCK_KD=rows_dot_step(w_up, D), BLOCK_KP=rows_dot_step(o_proj, P),
                  BLOCK_HID=triton.next_power_of_2(HID),
                  LINES_P=triton.next_power_of_2(triton.cdiv(P * o_proj.element_size(), 128)))
    launch_persistent(_kda_layer_kernel, args, consts, phases=ALL_PHASES.value, device=x.device,
                      num_warps=t.num_warps, per_sm=t.per_sm, phased=phased, programs=programs,
                      grid_consts=dict(PREFETCH=t.prefetch, USE_PDL=use_pdl and not INTERPRET),
                      phased_consts=dict(PREFETCH=False, USE_PDL=False), launch_kw=pdl_kwargs(use_pdl))
    return out, residual_out
