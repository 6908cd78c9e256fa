"""Fused KDA decode step (Triton): short conv + SiLU, l2norm, gate, beta, the delta-rule update
and, optionally, the gated output RMSNorm.

One launch does one layer's decode step for a batch of N sequences, one token each. Per (sequence,
head, V slice) a program:
  1. runs the depthwise causal conv (width W) on this head's q and k channels and its slice of the
     v channels from the cached W-1 pre-conv inputs, applies SiLU;
  2. normalizes q and k (`x / sqrt(sum x^2 + 1e-6)`), scales q by `scale` (K^-0.5);
  3. computes the per-channel log decay g from the raw f_b_proj output (softplus or lower-bound
     form, model-facts §1.1) and beta = sigmoid(b);
  4. updates its [K, D/v_split] columns of the fp32 state S in place (model-facts §1.2):
         S' = diag(exp g) S;  S = S' + beta k (v - S'^T k)^T;  o = S^T q
     walking them in [K, BV] tiles (value columns are independent in the update);
  5. with o_gate/o_norm_weight, writes rmsnorm(o) * weight * sigmoid(gate) over the head's D values.

Splitting a head's V over programs (v_split > 1) lets N=1 launch H*v_split programs instead of H.
Each program recomputes the head's cheap q/k conv; the v-channel conv cache is written by the
program owning those channels. The q/k cache and the norm need the whole head, so the programs of a
head count their arrivals in an int32 workspace and the last to arrive shifts the q/k cache (every
reader of it is done by then), applies the norm to the fp32 o row the others left in scratch, and
zeroes the counter again. No host sync, no data-dependent shapes: CUDA-graph safe.

The split programs run at one warp by default, and then (`load_order`) issue every load before the
first reduction, count in for the shift as soon as their windows are loaded when there is no norm
(the count's latency then hides behind the update), and, while one wave holds every program, take
the conv's operands one vector per window row and issue the state tile's loads before a fence and
every load the math waits on (ptxas would otherwise start the math first and the tile would go out
a trip late): at N = 1 the step is a chain of round trips to memory, and each of these removes one.

The oracle is `ref.py` (`kda_recurrent`, the gates, `l2norm`), `short_conv/ref.py`
(`causal_conv1d`) and `backend/layers/norm.py` (`rms_norm_gated`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, pdl_kwargs, poison_like, set_poison  # noqa: F401  (re-exported)
from k3rt.kernels.common import CTA_FENCE as _FENCE
from k3rt.kernels.common import fence_cta as _fence_cta
from k3rt.kernels.kda.triton_step import (
    _conv_hist,
    _conv_shift_store,
    _conv_taps,
    _conv_window,
    _decay,
    _delta_step,
    _gate_beta,
    _gate_consts,
    _gate_weight,
    _hist_rows,
    _norm_gate_row,
    _shift_store,
    _shift_store_rows,
    _silu_conv,
    _silu_conv_rows,
    _taps_rows,
)

_LOWER_BOUND_MIN = -5.0
# default_v_split: heads split over V while N * H <= _SPLIT_HEADS (H200, session 38: N = 8 and 16 at H = 32 ran
# 12.9 / 24.3 us split against 18.1 / 25.7 whole), each program at most _MAX_SPLIT_COLS value columns (one 1-warp
# tile), and narrower until _TARGET_PROGRAMS programs run (about 2 per SM), never below _MIN_SPLIT_COLS columns
_SPLIT_HEADS = 512
_TARGET_PROGRAMS = 256
_MIN_SPLIT_COLS = 16
_MAX_SPLIT_COLS = 32
# default_block_v: unsplit heads walk their state in 32-column tiles up to this many (sequence, head) programs
# and in 64-column tiles above. H200, H=32 D=128, CUDA graph (kernels.py --decode-sweep; NOTES.md runs 1 and 5):
# N=16 25.4 us at 32 against 27.4 at 64; N=64 96.3 against 85.4; N=256 352.9 against 313.5
_NARROW_TILE_PROGRAMS = 512
# load_order: the state tile's loads pinned beside the windows' up to this many programs (one wave at one warp). H200,
# same process (session 39): N = 1 (256 programs) 5.20 -> 4.77 us, N = 2 6.25 -> 6.18; N = 8 (1,024) 12.9 -> 13.0 and
# with the norm 13.5 -> 14.1, N = 16 24.3 -> 24.9
_PIN_PROGRAMS = 256


def _slots_contiguous(t: Tensor) -> bool:
    """Each slot t[i] is one contiguous block (the page pool's views: slots a page apart). From the strides
    alone: indexing t[0] costs two dispatched ops, and the eager mixed step asks this of every layer's pools."""
    if t.shape[0] == 0:
        return True
    expected = 1  # the stride a contiguous slot has in this dim (size-1 dims may have any, as is_contiguous says)
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return t.stride(0) >= expected


# not specialized per step (kernels/common.py, Compiles): slots, a view of the packed step (count_ptr too, which is the
# slots where no counter is used); b's row stride (a column view's, or H where a mixed step gathered its rows: one
# scalar per head, never a vector load)
@triton.jit(do_not_specialize=["stride_b_n"], do_not_specialize_on_alignment=["slot_ptr", "count_ptr"])
def _kda_decode_kernel(
    qkv_ptr, stride_qkv_n,  # [N, 3*H*D] pre-conv q|k|v
    conv_w_ptr,  # [3*H*D, W] fp32
    conv_state_ptr, stride_cs_slot,  # [num_slots, W-1, 3*H*D], rows of a slot contiguous
    f_ptr, stride_f_n,  # [N, H*D] raw f_b_proj output
    a_log_ptr,  # [H] fp32
    dt_bias_ptr,  # [H*D] fp32
    b_ptr, stride_b_n,  # [N, H] raw b_proj output
    state_ptr, stride_state_slot,  # [num_slots, H, D, D] fp32, each slot contiguous
    slot_ptr,  # [N] int32/int64
    o_ptr,  # [N, H, D]
    gate_ptr, stride_gate_n, stride_gate_h,  # [N, H, D] output gate (NORM only)
    norm_w_ptr,  # [D] output norm weight (NORM only)
    raw_ptr,  # [N, H, D] fp32 scratch: o before the norm (NORM); SPLIT_NORM: [N, H, NV] fp32 out, sum of o^2 a program
    count_ptr,  # [N*H] int32, zero between launches: programs of a head past their windows (EARLY) or done (NV > 1)
    scale,
    lower_bound,
    eps,
    H: tl.constexpr,
    D: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BVS: tl.constexpr,
    NV: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    PROBE: tl.constexpr = 0,
    HOIST: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    PIN: tl.constexpr = False,
    SPLIT_NORM: tl.constexpr = False,
    LATE_WAIT: tl.constexpr = False,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)  # this program owns value columns [i_v*BVS, (i_v+1)*BVS) of the head
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < D
    row = (i_n * H + i_h).to(tl.int64) * D
    o_row = o_ptr + row
    C = 3 * H * D
    x_row = qkv_ptr + i_n.to(tl.int64) * stride_qkv_n
    q_ch = i_h * D + offs_k
    k_ch = H * D + q_ch
    f_row = f_ptr + i_n.to(tl.int64) * stride_f_n
    b_row = b_ptr + i_n.to(tl.int64) * stride_b_n
    gate_row = gate_ptr + i_n.to(tl.int64) * stride_gate_n + i_h * stride_gate_h
    if USE_PDL and not LATE_WAIT:
        gdc_wait()
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    # LATE_WAIT (pinned, PDL): everything the kernel before us does not write (the slot, the state tile, the conv
    # windows, the taps and gate constants) loads before gdc_wait, in the shadow of that kernel's tail; the inputs it
    # writes (x, f, b, the output gate) after. The state and conv cache were last written by this layer's previous
    # step, a launch at least two back: each PDL launch triggers its dependents only after its own wait, so every
    # launch before the one we follow is complete when we start.
    if HOIST:
        # Every load issued before the first reduction or layout change: on sm_90 each of those is a shared-memory
        # round trip behind a barrier, and a load placed after one waits for every load before it. The loads that
        # do not need the slot go out before its value returns, the rest right after it. (Otherwise the N = 1 step
        # is four dependent trips to memory in a row, SASS of session 38: x_q, then x_k, then the windows, then
        # the gates.)
        # Pinned (PIN, W <= 4), the conv's operands come as one vector per window row, all in the channels'
        # layout: see _taps_rows. (Unpinned that form lost: H100, N = 8 15.6 -> 16.8 us; session 39.)
        if not LATE_WAIT:
            x_q = tl.load(x_row + q_ch, mask=mask_k, other=0.0)
            x_k = tl.load(x_row + k_ch, mask=mask_k, other=0.0)
        if not PIN:
            taps_q = _conv_taps(conv_w_ptr, q_ch, mask_k, W, WP)
            taps_k = _conv_taps(conv_w_ptr, k_ch, mask_k, W, WP)
            decay, beta = _gate_beta(f_row, dt_bias_ptr, a_log_ptr, b_row, i_h, offs_k, mask_k, lower_bound, D,
                                     USE_LOWER_BOUND)
        offs_v = i_v * BVS + tl.arange(0, BV)
        v_ch = 2 * H * D + i_h * D + offs_v
        if PIN:
            tq0, tq1, tq2, tq3 = _taps_rows(conv_w_ptr, q_ch, mask_k, W)
            tk0, tk1, tk2, tk3 = _taps_rows(conv_w_ptr, k_ch, mask_k, W)
        # the first tile's v channels too (the loop loads each next tile's with its state)
        if not LATE_WAIT:
            x_v = tl.load(x_row + v_ch, mask=offs_v < D, other=0.0)
        if PIN:
            tv0, tv1, tv2, tv3 = _taps_rows(conv_w_ptr, v_ch, offs_v < D, W)
        else:
            taps_v = _conv_taps(conv_w_ptr, v_ch, offs_v < D, W, WP)
        if SPLIT_NORM and not LATE_WAIT:  # the first tile's norm weight and gate
            gw = _gate_weight(gate_row, norm_w_ptr, offs_v, offs_v < D)
    if slot < 0:
        if USE_PDL and LATE_WAIT:
            gdc_wait()  # the kernel before us may still read o
        # padding entry: zero output, no state touched
        for v0 in tl.static_range(0, BVS, BV):
            offs_v = i_v * BVS + v0 + tl.arange(0, BV)
            zero = tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty)
            tl.store(o_row + offs_v, zero, mask=offs_v < D)
        if SPLIT_NORM:
            tl.store(raw_ptr + (i_n * H + i_h) * NV + i_v, 0.0)
    else:
        s_base = state_ptr + slot * stride_state_slot + i_h * (D * D)
        cs = conv_state_ptr + slot * stride_cs_slot
        if PREFETCH:
            # split heads (small N, latency bound): issue the first state tile's load before the conv
            # and gate loads so their latencies overlap, and each next tile's before this one's update.
            # Unsplit at 4 warps (large N, bandwidth bound) this cost 15-45% on the H200 (NOTES.md, run 2),
            # so there the tile loads stay in the loop.
            offs_v = i_v * BVS + tl.arange(0, BV)
            s_next = tl.load(s_base + offs_k[:, None] * D + offs_v[None, :],
                             mask=mask_k[:, None] & (offs_v < D)[None, :], other=0.0)
        if HOIST:
            if PIN:
                # Pinned: the state tile's loads (PREFETCH, above) go out before every load the math waits on. ptxas
                # otherwise starts the gate and conv math before issuing them (it moves arithmetic past a fence
                # freely; only memory operations are held), so they went out a round trip to memory late (SASS of
                # session 39). The gates' operands, too, come after the fence. Only while a wave holds every program
                # (load_order): with programs queued behind, the late loads' latency hides behind the others'.
                if LATE_WAIT:
                    dt, a = _gate_consts(dt_bias_ptr, a_log_ptr, i_h, offs_k, mask_k, D)
                    hv0, hv1, hv2 = _hist_rows(cs, v_ch, offs_v < D, C, W)
                    hq0, hq1, hq2 = _hist_rows(cs, q_ch, mask_k, C, W)
                    hk0, hk1, hk2 = _hist_rows(cs, k_ch, mask_k, C, W)
                    if _FENCE:  # issued before the wait (ptxas would sink them past it)
                        _fence_cta(i_h)
                    if USE_PDL:
                        gdc_wait()
                    x_q = tl.load(x_row + q_ch, mask=mask_k, other=0.0)
                    x_k = tl.load(x_row + k_ch, mask=mask_k, other=0.0)
                    x_v = tl.load(x_row + v_ch, mask=offs_v < D, other=0.0)
                    f_raw = tl.load(f_row + i_h * D + offs_k, mask=mask_k, other=0.0)
                    b_raw = tl.load(b_row + i_h)
                    if SPLIT_NORM:
                        gw = _gate_weight(gate_row, norm_w_ptr, offs_v, offs_v < D)
                else:
                    if _FENCE:
                        _fence_cta(i_h)
                    dt, a = _gate_consts(dt_bias_ptr, a_log_ptr, i_h, offs_k, mask_k, D)
                    f_raw = tl.load(f_row + i_h * D + offs_k, mask=mask_k, other=0.0)
                    b_raw = tl.load(b_row + i_h)
                    hv0, hv1, hv2 = _hist_rows(cs, v_ch, offs_v < D, C, W)
                    hq0, hq1, hq2 = _hist_rows(cs, q_ch, mask_k, C, W)
                    hk0, hk1, hk2 = _hist_rows(cs, k_ch, mask_k, C, W)
                win_q, win_k = (hq1, hq2, x_q), (hk1, hk2, x_k)  # the rows the shifted cache keeps
            else:
                hist_v = _conv_hist(cs, v_ch, offs_v < D, C, W, WP)
                win_q = _conv_window(_conv_hist(cs, q_ch, mask_k, C, W, WP), x_q, W, WP)
                win_k = _conv_window(_conv_hist(cs, k_ch, mask_k, C, W, WP), x_k, W, WP)
        else:
            win_q = _conv_window(_conv_hist(cs, q_ch, mask_k, C, W, WP),
                                 tl.load(x_row + q_ch, mask=mask_k, other=0.0), W, WP)
            win_k = _conv_window(_conv_hist(cs, k_ch, mask_k, C, W, WP),
                                 tl.load(x_row + k_ch, mask=mask_k, other=0.0), W, WP)
            taps_q = _conv_taps(conv_w_ptr, q_ch, mask_k, W, WP)
            taps_k = _conv_taps(conv_w_ptr, k_ch, mask_k, W, WP)
        cnt = count_ptr + (i_n * H + i_h)
        if PIN and EARLY and (PROBE & 1) == 0:
            # the early count (below) before the conv math, its latency behind that math
            tl.debug_barrier()
            first = tl.atomic_add(cnt, 1, sem="release", scope="gpu")
        if PIN:
            decay = _decay(f_raw, dt, a, lower_bound, USE_LOWER_BOUND)
            beta = tl.sigmoid(b_raw.to(tl.float32))
            q = _silu_conv_rows(hq0, hq1, hq2, x_q, tq0, tq1, tq2, tq3, W)
            k = _silu_conv_rows(hk0, hk1, hk2, x_k, tk0, tk1, tk2, tk3, W)
        else:
            q = _silu_conv(win_q, taps_q)
            k = _silu_conv(win_k, taps_k)
        if NV == 1:
            # a value may be held (and loaded) by several threads: all must have read the cache
            # before any overwrites it
            tl.debug_barrier()
            _shift_store(win_q, cs, q_ch, mask_k, C, W, WP, PIN)
            _shift_store(win_k, cs, k_ch, mask_k, C, W, WP, PIN)
        elif EARLY and not PIN and (PROBE & 1) == 0:
            # The head's q/k cache may be shifted only once every program of the head has read it: each counts
            # itself in as soon as its windows are loaded, and the last to arrive shifts, after its update, so the
            # count's latency hides behind the update instead of ending the program. Release only: it orders this
            # program's loads of the cache (all threads', by the barrier) before the count, and does not hold back
            # the loads after it as an acquire would; the last one's stores depend on the count it reads and so
            # cannot happen before it. (With PIN it comes before the conv math, above.)
            tl.debug_barrier()
            first = tl.atomic_add(cnt, 1, sem="release", scope="gpu")
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        if not HOIST:
            decay, beta = _gate_beta(f_row, dt_bias_ptr, a_log_ptr, b_row, i_h, offs_k, mask_k, lower_bound, D,
                                     USE_LOWER_BOUND)

        if USE_PDL:
            gdc_launch_dependents()  # dependents may start their prologue; they gdc_wait for us
        raw_row = raw_ptr + row
        ss = tl.zeros([], dtype=tl.float32)  # SPLIT_NORM: sum of o^2 over this program's columns
        # value columns are independent in the update: walk the state in [BK, BV] tiles
        for v0 in tl.static_range(0, BVS, BV):
            offs_v = i_v * BVS + v0 + tl.arange(0, BV)
            mask_v = offs_v < D
            s_ptrs = s_base + offs_k[:, None] * D + offs_v[None, :]
            mask2 = mask_k[:, None] & mask_v[None, :]
            if PIN:
                v = _silu_conv_rows(hv0, hv1, hv2, x_v, tv0, tv1, tv2, tv3, W)
                sv1, sv2, sx_v = hv1, hv2, x_v  # this tile's window rows to store, below
                if v0 + BV < BVS:  # the next tile's v channels, with its state below
                    v_ch = v_ch + BV
                    x_v = tl.load(x_row + v_ch, mask=offs_v + BV < D, other=0.0)
                    tv0, tv1, tv2, tv3 = _taps_rows(conv_w_ptr, v_ch, offs_v + BV < D, W)
                    hv0, hv1, hv2 = _hist_rows(cs, v_ch, offs_v + BV < D, C, W)
            elif HOIST:
                win_v = _conv_window(hist_v, x_v, W, WP)
                v = _silu_conv(win_v, taps_v)
                if v0 + BV < BVS:  # the next tile's v channels, with its state below
                    v_ch = v_ch + BV
                    x_v = tl.load(x_row + v_ch, mask=offs_v + BV < D, other=0.0)
                    taps_v = _conv_taps(conv_w_ptr, v_ch, offs_v + BV < D, W, WP)
                    hist_v = _conv_hist(cs, v_ch, offs_v + BV < D, C, W, WP)
            if PREFETCH:
                S = s_next  # S: [BK, BV] fp32
                if v0 + BV < BVS:
                    s_next = tl.load(s_ptrs + BV, mask=mask_k[:, None] & (offs_v + BV < D)[None, :], other=0.0)
            if not HOIST:
                v_ch = 2 * H * D + i_h * D + offs_v
                win_v = _conv_window(_conv_hist(cs, v_ch, mask_v, C, W, WP),
                                     tl.load(x_row + v_ch, mask=mask_v, other=0.0), W, WP)
                v = _silu_conv(win_v, _conv_taps(conv_w_ptr, v_ch, mask_v, W, WP))
            tl.debug_barrier()
            # these v channels belong to this program alone
            if PIN:
                _shift_store_rows(cs, sv1, sv2, sx_v, 2 * H * D + i_h * D + offs_v, mask_v, C, W)
            else:
                _conv_shift_store(win_v, cs, 2 * H * D + i_h * D + offs_v, mask_v, C, W, WP)
            if not PREFETCH:
                S = tl.load(s_ptrs, mask=mask2, other=0.0)  # S: [BK, BV] fp32
            S, o = _delta_step(S, q, k, v, decay, beta)
            tl.store(s_ptrs, S, mask=mask2)
            if NORM:
                tl.store(raw_row + offs_v, o, mask=mask_v)
            elif SPLIT_NORM:
                if not HOIST or v0 > 0:
                    gw = _gate_weight(gate_row, norm_w_ptr, offs_v, mask_v)
                ss += tl.sum(o * o, axis=0)  # masked columns: o = 0
                tl.store(o_row + offs_v, (o * gw).to(o_ptr.dtype.element_ty), mask=mask_v)
            else:
                tl.store(o_row + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
        if SPLIT_NORM:
            tl.store(raw_ptr + (i_n * H + i_h) * NV + i_v, ss)

        if NV > 1 and EARLY and (PROBE & 1) == 0:
            if first == NV - 1:  # every program of the head has read the q/k cache
                _shift_store(win_q, cs, q_ch, mask_k, C, W, WP, PIN)
                _shift_store(win_k, cs, k_ch, mask_k, C, W, WP, PIN)
                tl.store(cnt, 0)  # ready for the next launch
        elif NV > 1 and (PROBE & 1) == 0:
            # The head's q/k cache may be overwritten, and its norm taken, only once every program
            # of the head has read the cache and written its o columns: the last one to arrive
            # does both. The barrier orders all threads' accesses before the release.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == NV - 1:
                _shift_store(win_q, cs, q_ch, mask_k, C, W, WP, PIN)
                _shift_store(win_k, cs, k_ch, mask_k, C, W, WP, PIN)
                if NORM:
                    _norm_gate_row(raw_row, gate_row, norm_w_ptr, o_row, offs_k, mask_k, eps, D)
                tl.store(cnt, 0)  # ready for the next launch
        elif NORM:
            tl.debug_barrier()  # the row's tiles were written by other threads of this program
            _norm_gate_row(raw_row, gate_row, norm_w_ptr, o_row, offs_k, mask_k, eps, D)


def _launch_decode(
    qkv_pre: Tensor, conv_weight: Tensor, conv_state: Tensor, f: Tensor, A_log: Tensor,
    dt_bias: Tensor, b: Tensor, state: Tensor, slot_indices: Tensor, out: Tensor,
    o_gate: Tensor | None, o_norm_weight: Tensor | None, raw: Tensor | None, counts: Tensor | None,
    lower_bound: float | None, scale: float, eps: float, use_pdl: bool, num_warps: int, block_v: int,
    v_split: int, prefetch: bool, probe: int = 0, pin: bool | None = None, split_norm: bool = False,
    late_wait: bool = False, early: bool | None = None,
) -> None:
    """split_norm: raw is the [N, H, v_split] fp32 partials (kda_decode_split_norm), not the [N, H, D] scratch.
    late_wait (pinned programs only): the loads that the kernel before this one does not write go out before the PDL
    wait (kda_decode's docstring). early: load_order's EARLY overridden (timing; only where load_order allows it)."""
    N = qkv_pre.shape[0]
    _, H, D, _ = state.shape
    W = conv_weight.shape[1]
    gated = o_gate is not None
    norm = gated and not split_norm  # the norm in this launch
    # contract (the public function has already raised ValueError on user-facing mismatches)
    assert qkv_pre.shape == (N, 3 * H * D) and qkv_pre.stride(1) == 1
    assert conv_weight.shape == (3 * H * D, W) and conv_weight.is_contiguous()
    assert conv_weight.dtype == torch.float32 and W >= 2
    assert conv_state.shape[1:] == (W - 1, 3 * H * D) and conv_state[0].is_contiguous()
    assert f.shape == (N, H * D) and f.stride(1) == 1
    assert A_log.numel() == H and A_log.dtype == torch.float32 and A_log.is_contiguous()
    assert dt_bias.numel() == H * D and dt_bias.dtype == torch.float32 and dt_bias.is_contiguous()
    assert b.shape == (N, H) and b.stride(1) == 1
    assert state.shape[2:] == (D, D) and state.dtype == torch.float32 and state[0].is_contiguous()
    assert slot_indices.shape == (N,) and slot_indices.dtype in (torch.int32, torch.int64)
    assert out.shape == (N, H, D) and out.is_contiguous()
    assert D % v_split == 0 and triton.next_power_of_2(D // v_split) == D // v_split
    if gated:
        assert o_gate.shape == (N, H, D) and o_gate.stride(2) == 1
        assert o_norm_weight.shape == (D,) and o_norm_weight.is_contiguous()
        assert raw.shape == ((N, H, v_split) if split_norm else (N, H, D)) and raw.dtype == torch.float32
        assert raw.is_contiguous()
    if v_split > 1:
        assert counts.dtype == torch.int32 and counts.numel() >= N * H and counts.is_contiguous()
    if N == 0:
        return
    bvs = D // v_split if v_split > 1 else triton.next_power_of_2(D)
    hoist, auto_early, auto_pin = load_order(prefetch, num_warps, v_split, norm, N * H * v_split, W)
    early = auto_early if early is None else (early and auto_early)
    pin = auto_pin if pin is None else pin
    assert not pin or (hoist and W <= 4)
    late_wait = pin and late_wait
    _kda_decode_kernel[(N, H, v_split)](
        qkv_pre, qkv_pre.stride(0), conv_weight, conv_state, conv_state.stride(0), f, f.stride(0), A_log, dt_bias,
        b, b.stride(0), state, state.stride(0), slot_indices, out,
        o_gate if gated else out, o_gate.stride(0) if gated else 0, o_gate.stride(1) if gated else 0,
        o_norm_weight if gated else out, raw if gated else out, counts if v_split > 1 else slot_indices,
        scale, 0.0 if lower_bound is None else float(lower_bound), eps,
        H=H, D=D, BK=triton.next_power_of_2(D), BV=min(block_v, bvs), BVS=bvs, NV=v_split,
        W=1 if probe & 2 else W, WP=1 if probe & 2 else triton.next_power_of_2(W),
        USE_LOWER_BOUND=lower_bound is not None, NORM=norm, USE_PDL=use_pdl and not INTERPRET,
        PREFETCH=prefetch, PROBE=probe, HOIST=hoist, EARLY=early, PIN=pin, SPLIT_NORM=split_norm,
        LATE_WAIT=late_wait, num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )


def load_order(prefetch: bool, num_warps: int, v_split: int, norm: bool, programs: int, conv_width: int
               ) -> tuple[bool, bool, bool]:
    """The kernel's (HOIST, EARLY, PIN): one-warp split programs take every load up front and, without the norm,
    count in for the q/k cache shift as soon as their windows are loaded. While one wave holds every program
    (<= _PIN_PROGRAMS) and the conv is at most 4 wide, the program is pinned: its conv operands come one vector per
    window row (_taps_rows), and its state tile's loads go out before a CTA fence and every load the math waits on.
    H100, N = 1, 8 programs a head (session 38, same process, unpinned):
    6.20 us -> 5.75 hoisted, 5.67 early, 5.32 both (4.75 with PDL, against 5.49); N = 4 at 4 programs a head 14.30 ->
    9.43. At 2 warps hoisting lost (5.96 -> 6.38), and with the norm so did the early count (a second atomic then:
    6.22 hoisted against 6.68 with both). Pinning: see _PIN_PROGRAMS (H100, same process, session 39:
    N = 1 5.03 -> 4.63 us, 6.10 -> 5.62 with the norm; unpinned programs with the row vectors lost, N = 8 15.6 ->
    16.8)."""
    hoist = prefetch and num_warps == 1
    early = hoist and v_split > 1 and not norm
    return hoist, early, hoist and programs <= _PIN_PROGRAMS and conv_width <= 4


def default_block_v(N: int, H: int, v_split: int) -> int:
    """Value columns per state tile: narrow tiles while few unsplit programs run (more of them resident per SM
    with the tile in registers), wider ones once the grid is several waves deep (fewer, longer loads)."""
    return 32 if v_split == 1 and N * H <= _NARROW_TILE_PROGRAMS else 64


def default_num_warps(D: int, v_split: int) -> int:
    """Warps per program: 1 for split heads' slices of <= 32 value columns (every default split: the tile's key axis
    stays in one warp, so its reductions are shuffles with no barrier, and the launcher then issues every load up
    front), else 4. H100, N = 1, 8 programs a head (session 38, same process): 5.32 us at 1 warp against 5.96 at 2;
    N = 4, 4 programs a head: 9.43 against 11.50 for the earlier default (2 a head, 4 warps). Wider tiles at fewer
    warps spill (2 programs a head, 32-column tiles of 64 columns, 1 warp: 165 us against 25 at N = 16)."""
    return 1 if v_split > 1 and D // v_split <= _MAX_SPLIT_COLS else 4


def default_v_split(N: int, H: int, D: int) -> int:
    """Programs per head: for N * H <= _SPLIT_HEADS, slices of at most _MAX_SPLIT_COLS value columns (one-warp
    programs, all loads up front), narrower until _TARGET_PROGRAMS programs run; 1 above (the grid is full and
    splitting would only repeat the q/k conv). H200, H = 32, D = 128 (session 38, kernels.py --decode-sweep): 32-column
    programs at N = 4 / 8 / 16 ran 8.31 / 12.89 / 24.26 us, 16-column ones 8.96 / 16.35 / 38.93; at N = 1 both 5.1."""
    if N * H > _SPLIT_HEADS:
        return 1
    split = max(1, D // _MAX_SPLIT_COLS)
    while N * H * split < _TARGET_PROGRAMS and D // (2 * split) >= _MIN_SPLIT_COLS:
        split *= 2
    return split


def kda_decode_workspace(max_batch: int, num_heads: int, device: torch.device | str) -> Tensor:
    """Zeroed per-head arrival counters for `kda_decode(..., workspace=)` with V split over programs.

    The kernel returns every counter to zero before it exits, so one workspace serves every layer
    and every step (allocate it once, outside CUDA-graph capture). Without one, each split launch
    allocates and zeroes its own (a memset per call).
    """
    return torch.zeros(max_batch * num_heads, dtype=torch.int32, device=device)


def kda_decode(
    qkv_pre: Tensor,
    conv_weight: Tensor,
    conv_state: Tensor,
    f: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    b: Tensor,
    state: Tensor,
    slot_indices: Tensor,
    *,
    lower_bound: float | None = None,
    scale: float | None = None,
    out: Tensor | None = None,
    use_pdl: bool = False,
    num_warps: int | None = None,
    block_v: int | None = None,
    o_gate: Tensor | None = None,
    o_norm_weight: Tensor | None = None,
    o_norm_eps: float = 1e-5,
    v_split: int | None = None,
    workspace: Tensor | None = None,
    prefetch: bool | None = None,
    probe: int = 0,
    pin: bool | None = None,
    norm_partials: Tensor | None = None,
    late_wait: bool = False,
    early: bool | None = None,
) -> Tensor:
    """One fused KDA decode step for N sequences (one token each) of one layer.

    Args:
        qkv_pre: [N, 3*H*D] pre-conv q|k|v projections (activation dtype; rows may be strided).
        conv_weight: [3*H*D, W] fp32 depthwise taps; column W-1 multiplies the current token.
        conv_state: [num_slots, W-1, 3*H*D] previous pre-conv inputs, oldest first; updated in place. Each slot contiguous; the slot stride is free (page-pool views).
        f: [N, H*D] raw f_b_proj output.
        A_log: [H] fp32 (the checkpoint's [1, 1, H, 1] is accepted).
        dt_bias: [H*D] fp32 (an [H, D] view is accepted).
        b: [N, H] raw b_proj output (beta = sigmoid(b)).
        state: [num_slots, H, D, D] fp32 recurrent state (key rows, value columns); updated in place; each slot contiguous, any slot stride.
        slot_indices: [N] int32/int64 slot of each sequence; a negative entry is padding: its output
            row is zero and no state is touched.
        lower_bound: None for the softplus gate, else the bounded gate's lower bound (-5 <= lb < 0).
        scale: query scale; None means D**-0.5.
        out: optional [N, H, D] output buffer (activation dtype).
        use_pdl: launch with programmatic dependent launch (GPU only; ignored by the interpreter).
        o_gate: optional [N, H, D] (or [N, H*D]) output gate, last dim contiguous (a column slice of
            a fused projection is fine). With o_norm_weight, the output is the KDA output norm
            `rms_norm_gated(o, o_gate, o_norm_weight, o_norm_eps)` (backend/layers/norm.py),
            computed in fp32 from the unrounded o.
        o_norm_weight: [D] output norm weight (any float dtype); given together with o_gate.
        o_norm_eps: the output norm's eps (Kimi: rms_norm_eps, 1e-5).
        v_split: programs per head, each owning D/v_split value columns (a power of two dividing
            D); None picks `default_v_split(N, H, D)`.
        num_warps, block_v: launch tuning (num_warps None: `default_num_warps`; block_v: value columns per state
            tile; None: `default_block_v` when v_split is None too, else 64).
        workspace: int32 counters from `kda_decode_workspace(>= N, H)`, zero between launches; used
            when v_split > 1 (None allocates zeroed counters per call).
        prefetch: load each state tile one step ahead of its update (None: when V is split over programs).
            Triton's software-pipelined tile loop (async copies of the next tiles) lost to it and to the plain
            loop at every shape (H200, N = 16 / 64: 29.9-35.1 / 112-127 us against 24.9 / 86.2; session 37).
        probe: timing only, results wrong by design (benchmarks/kernels.py's decode sweep): bit 1 skips the split
            heads' arrival (no atomic; the q/k conv cache is not shifted and the norm not taken), bit 2 runs the conv
            at width 1 (no conv cache read or written, wrong taps), so the default minus a probe is about what that
            part costs at N = 1, where the step is a chain of dependent loads.
        pin: the pinned program form (`load_order`: the state tile's loads before a fence and every load the math
            waits on, the conv's operands one vector per window row); None: while one wave holds every program.
            True needs the hoisted form (prefetch at one warp) and a conv at most 4 wide. Same results either way.
        norm_partials: with o_gate and o_norm_weight, the output norm split in two (`kda_decode_split_norm`, which
            sizes it): an fp32 [N, H, v_split] buffer that gets each program's sum of o^2 over its value columns,
            and the output is then o * weight * sigmoid(gate) without the rms factor. No program waits for the
            head's others (the fused norm's arrival: ~0.9 us of the N = 1 step, session 39); the consumer applies
            the factor (kernels/linear skinny_linear(row_rms=)).
        late_wait: with use_pdl, pinned programs (`pin`) load everything the kernel before them does not write
            (slot, state tile, conv windows, taps, gate constants) before the PDL wait, and x, f, b and the gate
            after it. Only where the state and conv cache were last written at least two launches back and the
            kernel directly before this one does not write them (a layer's decode step; not a loop of decode
            calls on one state). Without use_pdl: the same load order, no wait (the interpreter's tests).
        early: timing only: False moves the split programs' q/k-cache count from right after their windows
            (`load_order`'s EARLY, without the norm) to the end, as with the norm. Same results.

    Returns:
        o: [N, H, D] in qkv_pre.dtype: the raw recurrence output, or its gated RMSNorm when o_gate
            and o_norm_weight are given. Padding rows are zero either way.
    """
    if state.dim() != 4 or state.dtype != torch.float32:
        raise ValueError(
            f"state must be fp32 [num_slots, H, D, D], got {state.dtype} {list(state.shape)}"
        )
    num_slots, H, D, Dv = state.shape
    if D != Dv:
        raise ValueError(f"state must be [num_slots, H, D, D] with K == V, got {list(state.shape)}")
    if qkv_pre.dim() != 2 or qkv_pre.shape[1] != 3 * H * D:
        raise ValueError(f"qkv_pre must be [N, 3*H*D]=[N, {3 * H * D}], got {list(qkv_pre.shape)}")
    N = qkv_pre.shape[0]
    if conv_weight.dim() == 3 and conv_weight.shape[1] == 1:
        conv_weight = conv_weight.squeeze(1)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != 3 * H * D or conv_weight.shape[1] < 2:
        raise ValueError(
            f"conv_weight must be [3*H*D, W]=[{3 * H * D}, W>=2], got {list(conv_weight.shape)}"
        )
    W = conv_weight.shape[1]
    if conv_weight.dtype != torch.float32:
        raise ValueError(f"conv_weight must be fp32, got {conv_weight.dtype}")
    if tuple(conv_state.shape) != (num_slots, W - 1, 3 * H * D) or not _slots_contiguous(conv_state):
        raise ValueError(
            f"conv_state must be [num_slots, W-1, 3*H*D]={[num_slots, W - 1, 3 * H * D]} with each slot "
            f"contiguous (any slot stride), got {list(conv_state.shape)} strides {conv_state.stride()}"
        )
    check(f, "f", (N, H * D))
    check(b, "b", (N, H))
    if A_log.numel() != H or A_log.dtype != torch.float32:
        raise ValueError(f"A_log must be fp32 with H={H} values, got {A_log.dtype} {list(A_log.shape)}")
    if dt_bias.numel() != H * D or dt_bias.dtype != torch.float32:
        raise ValueError(
            f"dt_bias must be fp32 with H*D={H * D} values, got {dt_bias.dtype} {list(dt_bias.shape)}"
        )
    if slot_indices.shape != (N,) or slot_indices.dtype not in (torch.int32, torch.int64) \
            or (N > 1 and slot_indices.stride(0) != 1):
        raise ValueError(
            f"slot_indices must be contiguous int32/int64 [N]=[{N}], got {slot_indices.dtype} "
            f"{list(slot_indices.shape)} strides {slot_indices.stride()}"
        )
    if lower_bound is not None and not (_LOWER_BOUND_MIN <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must satisfy -5 <= lower_bound < 0, got {lower_bound}")
    if not _slots_contiguous(state):
        raise ValueError(f"state must have each slot contiguous (any slot stride), got strides {state.stride()}")
    for name, t in (("qkv_pre", qkv_pre), ("f", f), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    o_gate, o_norm_weight = _check_norm(o_gate, o_norm_weight, N, H, D)
    pinned = v_split is not None
    v_split = default_v_split(N, H, D) if v_split is None else int(v_split)
    if v_split < 1 or D % v_split != 0 or (D // v_split) & (D // v_split - 1):
        raise ValueError(f"v_split must be a power of two dividing D={D} into powers of two, got {v_split}")
    if prefetch is None:
        prefetch = v_split > 1
    if probe not in (0, 1, 2, 3):
        raise ValueError(f"probe must be 0-3 (timing only), got {probe}")
    if block_v is None:
        # a caller that pins v_split pins the tile too (the batch-invariant mode: one launch shape at any N)
        block_v = 64 if pinned else default_block_v(N, H, v_split)
    block_v = int(block_v)
    if num_warps is None:
        num_warps = default_num_warps(D, v_split)
    if pin and not (prefetch and num_warps == 1 and W <= 4):
        raise ValueError(f"pin=True needs prefetch at num_warps=1 and a conv at most 4 wide, got prefetch={prefetch} "
                         f"num_warps={num_warps} W={W}")
    counts = None
    if v_split > 1:
        if workspace is None:
            workspace = kda_decode_workspace(N, H, qkv_pre.device)
        elif workspace.dtype != torch.int32 or workspace.numel() < N * H or not workspace.is_contiguous():
            raise ValueError(
                f"workspace must be contiguous int32 with >= N*H={N * H} elements, "
                f"got {workspace.dtype} {list(workspace.shape)}"
            )
        counts = workspace
    tensors = (qkv_pre, conv_weight, conv_state, f, A_log, dt_bias, b, state, slot_indices, o_gate,
               o_norm_weight, counts)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if out is None:
        out = torch.empty(N, H, D, dtype=qkv_pre.dtype, device=qkv_pre.device)
        poison_like(out)
    elif tuple(out.shape) != (N, H, D) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [N, H, D]={[N, H, D]}, got {list(out.shape)}")
    raw = None
    if norm_partials is not None:
        if o_gate is None:
            raise ValueError("norm_partials needs o_gate and o_norm_weight")
        if (tuple(norm_partials.shape) != (N, H, v_split) or norm_partials.dtype != torch.float32
                or not norm_partials.is_contiguous() or norm_partials.device != qkv_pre.device):
            raise ValueError(f"norm_partials must be contiguous fp32 [N, H, v_split]={[N, H, v_split]} on "
                             f"{qkv_pre.device}, got {norm_partials.dtype} {list(norm_partials.shape)}")
        raw = norm_partials
    elif o_gate is not None:
        raw = poison_like(torch.empty(N, H, D, dtype=torch.float32, device=qkv_pre.device))
    _launch_decode(
        qkv_pre, conv_weight, conv_state, f, A_log.contiguous().view(H), dt_bias.contiguous().view(H * D),
        b, state, slot_indices, out, o_gate, o_norm_weight, raw, counts, lower_bound,
        D**-0.5 if scale is None else float(scale), float(o_norm_eps), use_pdl, num_warps, block_v, v_split,
        bool(prefetch), probe=probe, pin=pin, split_norm=norm_partials is not None, late_wait=late_wait,
        early=early,
    )
    return out


def kda_decode_split_norm(qkv_pre: Tensor, conv_weight: Tensor, conv_state: Tensor, f: Tensor, A_log: Tensor,
                          dt_bias: Tensor, b: Tensor, state: Tensor, slot_indices: Tensor, *, o_gate: Tensor,
                          o_norm_weight: Tensor, v_split: int | None = None, **kwargs) -> tuple[Tensor, Tensor]:
    """`kda_decode` with its gated output norm left to the consumer: -> (y [N, H, D] in qkv_pre.dtype, partials
    [N, H, P] fp32), y = o * o_norm_weight * sigmoid(o_gate) and partials the sums of o^2 over the P programs' value
    columns, so that rms_norm_gated(o, o_gate, o_norm_weight, eps) = y * rsqrt(partials.sum(-1) / D + eps)
    (kernels/linear: `skinny_linear(y, w, row_rms=(partials, eps))` applies that factor in o_proj's launch, and
    `skinny_linear_ref` is its oracle). Other arguments as kda_decode's."""
    N, H, D = qkv_pre.shape[0], state.shape[1], state.shape[2]
    v_split = default_v_split(N, H, D) if v_split is None else int(v_split)
    partials = torch.empty(N, H, v_split, dtype=torch.float32, device=qkv_pre.device)
    y = kda_decode(qkv_pre, conv_weight, conv_state, f, A_log, dt_bias, b, state, slot_indices, o_gate=o_gate,
                   o_norm_weight=o_norm_weight, v_split=v_split, norm_partials=partials, **kwargs)
    return y, partials


def _check_norm(o_gate: Tensor | None, o_norm_weight: Tensor | None, N: int, H: int, D: int
                ) -> tuple[Tensor | None, Tensor | None]:
    """Validate the optional output-norm operands; returns (o_gate as [N, H, D], weight as [D])."""
    if (o_gate is None) != (o_norm_weight is None):
        raise ValueError("o_gate and o_norm_weight must be given together")
    if o_gate is None:
        return None, None
    if o_gate.dim() == 2 and tuple(o_gate.shape) == (N, H * D) and o_gate.stride(-1) == 1:
        o_gate = o_gate.view(N, H, D)
    if tuple(o_gate.shape) != (N, H, D) or o_gate.stride(-1) != 1:
        raise ValueError(
            f"o_gate must be [N, H, D]=[{N}, {H}, {D}] (or [N, H*D]) with a contiguous last dim, "
            f"got {list(o_gate.shape)} strides {o_gate.stride()}"
        )
    if o_norm_weight.numel() != D or not o_norm_weight.is_floating_point():
        raise ValueError(f"o_norm_weight must be a float tensor of D={D} values, got {list(o_norm_weight.shape)}")
    return o_gate, o_norm_weight.contiguous().view(D)
