"""KDA over the first n_i of R tokens per sequence in ONE launch (Triton): the verify graph form's pass and
its commit (backend/runner/gpu/kda.py, `KernelConfig.kda_verify_launch = "multi"`).

`kda_decode_multi` runs the decode step (conv + SiLU, l2norm, gates, delta rule, optional gated RMSNorm;
the helpers of triton_step.py, so the per-token math is the decode kernel's) over tokens 0..n_i-1 of row
block i of an [N, R] block, n_i read from a device tensor (clamped to 0..R), starting from the sequence's
live conv window and recurrent state. Per (sequence, head, V slice) a program keeps its [K, D/v_split]
state tile in registers across the tokens (as `kda_verify` does) and builds each token's conv window from
the live cache rows and the block's earlier rows, so nothing live is read after it is written. Then:

  commit=False (the verify pass): nothing is written back; the live state and conv cache stay at the
    block's start. No state per position either (the rollback the issue asks for: the pre-verify state
    is the live one, the kept inputs re-derive the state after the accepted prefix);
  commit=True (the commit): the state after n_i tokens and the conv window after them are written in
    place; n_i = 0 leaves the slot exactly as it was.

Rows t >= n_i of the output are zero. A V-split head's q/k conv cache rows and its norm need the whole
head, so (as in kda_decode) the programs of a head count their arrivals in an int32 workspace and the
last to arrive writes the q/k rows and normalizes the head's rows. No host sync, shapes fixed by (N, R):
CUDA-graph safe. Equal to n_i successive `kda_decode` calls (tests/kernels/test_kda_multi.py).

Two forms of the token loop (`hoist`): each token's conv windows, gates and norms loaded and computed inside the
loop, one dependent round of loads per token, and the norm a row at a time (the default); or every token's conv,
norms and gates first as [R, D] tiles (one round of loads), the loop then only the recurrence with each token's
rows picked out of the tiles, and the norm over all rows at once. The per-element operations are the same
(bit-identical under the interpreter). Session 33 built the second without a GPU: benchmarks/kda_multi.py times both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, pdl_kwargs, poison_like
from k3rt.kernels.kda.triton_step import (_conv_taps, _decay, _delta_step, _gate_beta_with, _gate_consts,
                                          _norm_gate_row, _silu_conv)
from k3rt.kernels.kda.triton_verify import _verify_window, check_token_block


@triton.jit
def _store_window_tail(win, cs_ptr, ch, mask, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Window rows 1..W-1 as the new cache rows 0..W-2 (triton_step's _conv_shift_store, `mask` 2-D)."""
    r = tl.arange(0, WP)
    tl.store(cs_ptr + (r[:, None] - 1) * C + ch[None, :], win.to(cs_ptr.dtype.element_ty),
             mask=((r >= 1) & (r < W))[:, None] & mask)


@triton.jit
def _conv_rows(x_seq, stride_xt, cs_ptr, rr, live, ch, mask, taps, C: tl.constexpr, W: tl.constexpr,
               WP: tl.constexpr):
    """SiLU(conv) of every drafted position rr at once (rows past `live` zero): [RP, len(ch)] fp32. Position t's
    window is _verify_window's (rows t-(W-1) .. t; those before the block from the live cache), each row the sum
    over its window of win * taps in _silu_conv's order."""
    w = tl.arange(0, WP)
    p = rr[:, None] - (W - 1) + w[None, :]  # [RP, WP]
    in_win = ((w < W)[None, :] & live[:, None])[:, :, None] & mask[None, None, :]
    hist = tl.load(cs_ptr + tl.maximum(p + W - 1, 0)[:, :, None] * C + ch[None, None, :],
                   mask=in_win & (p < 0)[:, :, None], other=0.0)
    tok = tl.load(x_seq + tl.maximum(p, 0).to(tl.int64)[:, :, None] * stride_xt + ch[None, None, :],
                  mask=in_win & (p >= 0)[:, :, None], other=0.0)
    win = tl.where((p < 0)[:, :, None], hist.to(tl.float32), tok.to(tl.float32))
    acc = tl.sum(win * taps[None, :, :], axis=1)
    return acc * tl.sigmoid(acc)


@triton.jit
def _delta_rule_token(S, q, k, v, decay, beta, raw_ptr, o_seq, i_n, i_h, t, offs_v, mask_v, R: tl.constexpr,
                      H: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    """Token t's update of the [BK, BV] state tile, in the decode kernel's order, and its output row (into the fp32
    scratch when the head is normalized after). Returns the new state tile."""
    S, o = _delta_step(S, q, k, v, decay, beta)
    if NORM:
        tl.store(raw_ptr + ((i_n.to(tl.int64) * R + t) * H + i_h) * D + offs_v, o, mask=mask_v)
    else:
        tl.store(o_seq + t * (H * D) + offs_v, o.to(o_seq.dtype.element_ty), mask=mask_v)
    return S


@triton.jit
def _row(x, sel):
    """Row `sel` (a one-hot [RP] mask) of a [RP, M] register tile, as [M] (the other rows add exact zeros)."""
    return tl.sum(tl.where(sel[:, None], x, 0.0), axis=0)


@triton.jit
def _norm_gate_rows(raw_seq, gate_seq, stride_gate_t, w_ptr, o_seq, rr, live, offs, mask, eps, HD: tl.constexpr,
                    D: tl.constexpr):
    """_norm_gate_row over every live row rr of one head at once (raw and o rows HD apart): one round of loads
    instead of one per row."""
    m = live[:, None] & mask[None, :]
    x = tl.load(raw_seq + rr[:, None] * HD + offs[None, :], mask=m, other=0.0, cache_modifier=".cg")
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    gt = tl.load(gate_seq + rr[:, None] * stride_gate_t + offs[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_seq + rr[:, None] * HD + offs[None, :],
             (x * rstd[:, None] * w[None, :] * tl.sigmoid(gt)).to(o_seq.dtype.element_ty), mask=m)


# not specialized per step (kernels/common.py, Compiles): slots, token counts: views of the packed step or per-step
# tensors (count_ptr too, which is the slots where no counter is used)
@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "n_ptr", "count_ptr"])
def _kda_multi_kernel(
    qkv_ptr, stride_qkv_n, stride_qkv_t,  # [N, R, 3*H*D] pre-conv q|k|v
    conv_w_ptr,  # [3*H*D, W] fp32
    conv_state_ptr, stride_cs_slot,  # [num_slots, W-1, 3*H*D], each slot contiguous
    f_ptr, stride_f_n, stride_f_t,  # [N, R, H*D]
    a_log_ptr, dt_bias_ptr,  # [H], [H*D] fp32
    b_ptr, stride_b_n, stride_b_t,  # [N, R, H]
    state_ptr, stride_state_slot,  # [num_slots, H, D, D] fp32, each slot contiguous
    slot_ptr,  # [N]
    n_ptr,  # [N] tokens to run per sequence
    o_ptr,  # [N, R, H, D]
    gate_ptr, stride_gate_n, stride_gate_t, stride_gate_h,  # [N, R, H, D] (NORM only)
    norm_w_ptr,  # [D] (NORM only)
    raw_ptr,  # [N, R, H, D] fp32 scratch (NORM only)
    count_ptr,  # [N*H] int32, zero between launches (NV > 1 with NORM or COMMIT)
    scale, lower_bound, eps,
    R: tl.constexpr, RP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, NORM: tl.constexpr, COMMIT: tl.constexpr, HOIST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < D
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < D
    C = 3 * H * D
    if USE_PDL:
        gdc_wait()
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(n_ptr + i_n).to(tl.int32), 0), R)
    n = tl.where(slot < 0, 0, n)  # padding entry: zero output, nothing touched
    o_seq = o_ptr + i_n.to(tl.int64) * (R * H * D) + i_h * D
    zero = tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty)
    for t in range(n, R):
        tl.store(o_seq + t * (H * D) + offs_v, zero, mask=mask_v)
    if slot >= 0:
        x_seq = qkv_ptr + i_n.to(tl.int64) * stride_qkv_n
        cs = conv_state_ptr + slot * stride_cs_slot
        q_ch = i_h * D + offs_k
        k_ch = H * D + q_ch
        v_ch = 2 * H * D + i_h * D + offs_v
        mask2 = mask_k[:, None] & mask_v[None, :]
        s_ptrs = state_ptr + slot * stride_state_slot + i_h * (D * D) + offs_k[:, None] * D + offs_v[None, :]
        S = tl.load(s_ptrs, mask=mask2, other=0.0)  # [BK, BV] fp32, in registers across the tokens
        if USE_PDL:
            gdc_launch_dependents()
        # the taps and gate constants once, not per token: the same per-token operations (compiled, the results stay
        # within an fp32 ulp of kda_decode's, as before: tests/kernels/test_kda_multi.py)
        taps_q = _conv_taps(conv_w_ptr, q_ch, mask_k, W, WP)
        taps_k = _conv_taps(conv_w_ptr, k_ch, mask_k, W, WP)
        taps_v = _conv_taps(conv_w_ptr, v_ch, mask_v, W, WP)
        dt, a = _gate_consts(dt_bias_ptr, a_log_ptr, i_h, offs_k, mask_k, D)
        rr = tl.arange(0, RP)
        if HOIST:
            # every token's conv, norms and gates first, as [RP, .] tiles (one round of loads, none of it waits for
            # the state); the loop below then runs only the recurrence, each token's rows picked out of the tiles
            live = rr < n
            Q = _conv_rows(x_seq, stride_qkv_t, cs, rr, live, q_ch, mask_k, taps_q, C, W, WP)
            K = _conv_rows(x_seq, stride_qkv_t, cs, rr, live, k_ch, mask_k, taps_k, C, W, WP)
            V = _conv_rows(x_seq, stride_qkv_t, cs, rr, live, v_ch, mask_v, taps_v, C, W, WP)
            Q = Q * (scale / tl.sqrt(tl.sum(Q * Q, axis=1) + 1e-6))[:, None]
            K = K / tl.sqrt(tl.sum(K * K, axis=1) + 1e-6)[:, None]
            f_seq = f_ptr + i_n.to(tl.int64) * stride_f_n + i_h * D
            fx = tl.load(f_seq + rr[:, None] * stride_f_t + offs_k[None, :], mask=live[:, None] & mask_k[None, :],
                         other=0.0)
            DEC = _decay(fx, dt[None, :], a, lower_bound, USE_LOWER_BOUND)
            BETA = tl.sigmoid(tl.load(b_ptr + i_n.to(tl.int64) * stride_b_n + rr * stride_b_t + i_h, mask=live,
                                      other=0.0).to(tl.float32))
            for t in range(n):
                sel = rr == t
                beta = tl.sum(tl.where(sel, BETA, 0.0), axis=0)
                S = _delta_rule_token(S, _row(Q, sel), _row(K, sel), _row(V, sel), _row(DEC, sel), beta, raw_ptr,
                                      o_seq, i_n, i_h, t, offs_v, mask_v, R, H, D, NORM)
        else:
            for t in range(n):
                win_q = _verify_window(x_seq, stride_qkv_t, cs, t, q_ch, mask_k, C, W, WP)
                win_k = _verify_window(x_seq, stride_qkv_t, cs, t, k_ch, mask_k, C, W, WP)
                win_v = _verify_window(x_seq, stride_qkv_t, cs, t, v_ch, mask_v, C, W, WP)
                q = _silu_conv(win_q, taps_q)
                k = _silu_conv(win_k, taps_k)
                v = _silu_conv(win_v, taps_v)
                q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
                k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
                decay, beta = _gate_beta_with(f_ptr + i_n.to(tl.int64) * stride_f_n + t * stride_f_t, dt, a,
                                              b_ptr + i_n.to(tl.int64) * stride_b_n + t * stride_b_t,
                                              i_h, offs_k, mask_k, lower_bound, D, USE_LOWER_BOUND)
                S = _delta_rule_token(S, q, k, v, decay, beta, raw_ptr, o_seq, i_n, i_h, t, offs_v, mask_v, R, H, D,
                                      NORM)
        if COMMIT:
            tl.store(s_ptrs, S, mask=mask2)
            # the window after n tokens is the one of token n-1; these v channels are this program's alone
            # (it read the cache rows already, inside the loop: the barrier orders its threads)
            tl.debug_barrier()
            win_v = _verify_window(x_seq, stride_qkv_t, cs, n - 1, v_ch, mask_v, C, W, WP)
            tl.debug_barrier()
            _store_window_tail(win_v, cs, v_ch, mask_v[None, :] & (n > 0), C, W, WP)
        if NORM or (COMMIT and NV > 1):
            # the q/k cache rows and the norm need every program of the head done: the last one does both
            tl.debug_barrier()
            last = True
            if NV > 1:
                cnt = count_ptr + (i_n * H + i_h)
                last = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == NV - 1
            if last:
                if COMMIT:
                    win_q = _verify_window(x_seq, stride_qkv_t, cs, n - 1, q_ch, mask_k, C, W, WP)
                    win_k = _verify_window(x_seq, stride_qkv_t, cs, n - 1, k_ch, mask_k, C, W, WP)
                    tl.debug_barrier()
                    _store_window_tail(win_q, cs, q_ch, mask_k[None, :] & (n > 0), C, W, WP)
                    _store_window_tail(win_k, cs, k_ch, mask_k[None, :] & (n > 0), C, W, WP)
                if NORM and HOIST:
                    _norm_gate_rows(raw_ptr + (i_n.to(tl.int64) * R * H + i_h) * D,
                                    gate_ptr + i_n.to(tl.int64) * stride_gate_n + i_h * stride_gate_h,
                                    stride_gate_t, norm_w_ptr, o_seq, rr, rr < n, offs_k, mask_k, eps, H * D, D)
                elif NORM:
                    for t in range(n):
                        nt = i_n.to(tl.int64) * R + t
                        _norm_gate_row(raw_ptr + (nt * H + i_h) * D,
                                       gate_ptr + i_n.to(tl.int64) * stride_gate_n + t * stride_gate_t
                                       + i_h * stride_gate_h,
                                       norm_w_ptr, o_seq + t * (H * D), offs_k, mask_k, eps, D)
                if NV > 1:
                    tl.store(count_ptr + (i_n * H + i_h), 0)  # ready for the next launch
        elif COMMIT:
            # one program per head: it alone reads and writes the head's q/k rows
            tl.debug_barrier()
            win_q = _verify_window(x_seq, stride_qkv_t, cs, n - 1, q_ch, mask_k, C, W, WP)
            win_k = _verify_window(x_seq, stride_qkv_t, cs, n - 1, k_ch, mask_k, C, W, WP)
            tl.debug_barrier()
            _store_window_tail(win_q, cs, q_ch, mask_k[None, :] & (n > 0), C, W, WP)
            _store_window_tail(win_k, cs, k_ch, mask_k[None, :] & (n > 0), C, W, WP)


def kda_decode_multi(
    qkv_pre: Tensor,
    conv_weight: Tensor,
    conv_state: Tensor,
    f: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    b: Tensor,
    state: Tensor,
    slot_indices: Tensor,
    num_tokens: Tensor,
    *,
    commit: bool,
    lower_bound: float | None = None,
    scale: float | None = None,
    out: Tensor | None = None,
    o_gate: Tensor | None = None,
    o_norm_weight: Tensor | None = None,
    o_norm_eps: float = 1e-5,
    v_split: int | None = None,
    workspace: Tensor | None = None,
    use_pdl: bool = False,
    num_warps: int = 4,
    hoist: bool = False,
) -> Tensor:
    """KDA decode over the first num_tokens[i] of R tokens of each of N sequences, one launch.

    Equal to num_tokens[i] successive `kda_decode` calls on sequence i's slot; with commit=False the live
    state and conv cache are left untouched (the calls ran on a copy), with commit=True they end as the
    calls leave them.

    Args:
        qkv_pre: [N, R, 3*H*D] pre-conv q|k|v (1 <= R <= 16; last dim contiguous; a [N*R, 3*H*D] projection
            column slice viewed as [N, R, -1] is fine).
        conv_weight: [3*H*D, W] fp32 depthwise taps.
        conv_state: [num_slots, W-1, 3*H*D] live conv caches; each slot contiguous, any slot stride.
        f: [N, R, H*D] raw f_b_proj output. b: [N, R, H] raw b_proj output.
        A_log: [H] fp32. dt_bias: [H*D] fp32.
        state: [num_slots, H, D, D] fp32 live recurrent states; each slot contiguous, any slot stride.
        slot_indices: [N] int32/int64; a negative entry is padding (zero output, nothing touched).
        num_tokens: [N] int32/int64 on the device: tokens to run per sequence, clamped to 0..R; rows past
            it are zero in the output.
        commit: write the state and conv window after num_tokens[i] tokens into the slot (False: write
            nothing back).
        lower_bound, scale, out ([N, R, H, D]), o_gate ([N, R, H, D] or [N, R, H*D]), o_norm_weight,
            o_norm_eps, workspace: as in kda_verify.
        v_split: programs per head (a power of two dividing D); None picks `default_v_split`, at least
            D/32 (the state tile lives in registers across the tokens).

    Returns:
        o: [N, R, H, D] in qkv_pre.dtype.
    """
    blk = check_token_block(qkv_pre, conv_weight, conv_state, f, A_log, dt_bias, b, state, slot_indices,
                            lower_bound, o_gate, o_norm_weight, v_split, workspace,
                            need_counts=o_gate is not None or commit, slot_strides=True)
    N, R, H, D, W = blk.N, blk.R, blk.H, blk.D, blk.W
    conv_weight, o_gate, o_norm_weight, norm, v_split, counts = (blk.conv_weight, blk.o_gate, blk.o_norm_weight,
                                                                 blk.norm, blk.v_split, blk.counts)
    if num_tokens.shape != (N,) or num_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_tokens must be int32/int64 [N]=[{N}], got {num_tokens.dtype} {list(num_tokens.shape)}")
    dev = qkv_pre.device
    devices = {t.device for t in (qkv_pre, conv_weight, conv_state, f, A_log, dt_bias, b, state, slot_indices,
                                  num_tokens, o_gate, o_norm_weight, counts, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if out is None:
        out = poison_like(torch.empty(N, R, H, D, dtype=qkv_pre.dtype, device=dev))
    elif tuple(out.shape) != (N, R, H, D) or out.dtype != qkv_pre.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {qkv_pre.dtype} {[N, R, H, D]}, got {out.dtype} {list(out.shape)}")
    raw = poison_like(torch.empty(N, R, H, D, dtype=torch.float32, device=dev)) if norm else None
    if N > 0:
        _kda_multi_kernel[(N, H, v_split)](
            qkv_pre, qkv_pre.stride(0), qkv_pre.stride(1), conv_weight, conv_state, conv_state.stride(0),
            f, f.stride(0), f.stride(1), A_log.contiguous().view(H), dt_bias.contiguous().view(H * D),
            b, b.stride(0), b.stride(1), state, state.stride(0), slot_indices, num_tokens, out,
            o_gate if norm else out, *(o_gate.stride()[:3] if norm else (0, 0, 0)),
            o_norm_weight if norm else out, raw if norm else out, counts if counts is not None else slot_indices,
            D**-0.5 if scale is None else float(scale), 0.0 if lower_bound is None else float(lower_bound),
            float(o_norm_eps),
            R=R, RP=triton.next_power_of_2(R), H=H, D=D, BK=triton.next_power_of_2(D), BV=D // v_split, NV=v_split,
            W=W, WP=triton.next_power_of_2(W), USE_LOWER_BOUND=lower_bound is not None, NORM=norm, COMMIT=commit,
            HOIST=hoist, USE_PDL=use_pdl and not INTERPRET, num_warps=num_warps, **pdl_kwargs(use_pdl),
        )
    return out
