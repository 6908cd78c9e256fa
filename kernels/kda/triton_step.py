"""One token's pieces of the KDA recurrence (Triton device functions), shared by the decode, verify and multi-token
kernels so that their sums run in one order: the short conv's window (as one [W, channels] tile, or one vector per
window row: `_taps_rows` and its kin, the pinned decode programs' form), the gates, the delta-rule step of a state
tile, the gated output norm of a head's row, and a CTA fence.

The oracle is `ref.py` (`kda_recurrent`, the gates, `l2norm`), `short_conv/ref.py` (`causal_conv1d`) and
`backend/layers/norm.py` (`rms_norm_gated`), through the kernels' tests.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_hist(cs_ptr, ch, mask, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """The cached W-1 pre-conv rows of channels `ch` (oldest first) from the cache [W-1, C]: [WP, len(ch)] in the
    cache's dtype, rows W-1.. zero."""
    r = tl.arange(0, WP)
    return tl.load(cs_ptr + r[:, None] * C + ch[None, :], mask=(r < W - 1)[:, None] & mask[None, :], other=0.0)


@triton.jit
def _conv_window(hist, x, W: tl.constexpr, WP: tl.constexpr):
    """The conv window of one token: [WP, len(x)] fp32, rows 0..W-2 the cached ones (_conv_hist), row W-1 the
    token's pre-conv row x."""
    r = tl.arange(0, WP)
    return tl.where((r == W - 1)[:, None], x.to(tl.float32)[None, :], hist.to(tl.float32))


@triton.jit
def _conv_taps(w_ptr, ch, mask, W: tl.constexpr, WP: tl.constexpr):
    """The depthwise conv's taps of channels `ch`: [WP, len(ch)] fp32 (rows past W zero)."""
    r = tl.arange(0, WP)
    return tl.load(w_ptr + ch[None, :] * W + r[:, None], mask=(r < W)[:, None] & mask[None, :], other=0.0)


@triton.jit
def _silu_conv(win, taps):
    """SiLU(sum_r win[r] * taps[r]): the conv output of the window's last row, fp32."""
    acc = tl.sum(win * taps, axis=0)
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_silu(win, w_ptr, ch, mask, W: tl.constexpr, WP: tl.constexpr):
    """SiLU(sum_r win[r] * w[ch, r]): the conv output of the window's last row, fp32."""
    return _silu_conv(win, _conv_taps(w_ptr, ch, mask, W, WP))


@triton.jit
def _conv_shift_store(win, cs_ptr, ch, mask, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Write window rows 1..W-1 as the new cache rows 0..W-2 (the cache after this token)."""
    r = tl.arange(0, WP)
    tl.store(cs_ptr + (r[:, None] - 1) * C + ch[None, :], win.to(cs_ptr.dtype.element_ty),
             mask=((r >= 1) & (r < W))[:, None] & mask[None, :])


@triton.jit
def _taps_rows(w_ptr, ch, mask, W: tl.constexpr):
    """_conv_taps as four [len(ch)] fp32 vectors (taps past W zero; W <= 4), each loaded in the channels' own layout:
    the [WP, len(ch)] tile's load takes another layout, and converting it is a shared-memory round trip that waits
    for the load, so every load after it goes out one trip to memory later (SASS of session 39)."""
    t0 = tl.load(w_ptr + ch * W, mask=mask, other=0.0)
    t1 = tl.load(w_ptr + ch * W + 1, mask=mask & (W > 1), other=0.0)
    t2 = tl.load(w_ptr + ch * W + 2, mask=mask & (W > 2), other=0.0)
    t3 = tl.load(w_ptr + ch * W + 3, mask=mask & (W > 3), other=0.0)
    return t0, t1, t2, t3


@triton.jit
def _hist_rows(cs_ptr, ch, mask, C: tl.constexpr, W: tl.constexpr):
    """_conv_hist as three [len(ch)] vectors, oldest first, in the cache's dtype (rows past W-2 zero; W <= 4)."""
    h0 = tl.load(cs_ptr + ch, mask=mask & (W > 1), other=0.0)
    h1 = tl.load(cs_ptr + C + ch, mask=mask & (W > 2), other=0.0)
    h2 = tl.load(cs_ptr + 2 * C + ch, mask=mask & (W > 3), other=0.0)
    return h0, h1, h2


@triton.jit
def _silu_conv_rows(h0, h1, h2, x, t0, t1, t2, t3, W: tl.constexpr):
    """_silu_conv of _conv_window(h, x) from the row vectors (W <= 4): the same products summed in the same order,
    row by row (the window's rows past W are zero there: adding them changes nothing)."""
    if W == 1:  # kda_decode(probe=2) only
        acc = x.to(tl.float32) * t0
    elif W == 2:
        acc = h0.to(tl.float32) * t0
        acc = acc + x.to(tl.float32) * t1
    else:
        acc = h0.to(tl.float32) * t0
        acc = acc + h1.to(tl.float32) * t1
        if W == 3:
            acc = acc + x.to(tl.float32) * t2
        else:
            acc = acc + h2.to(tl.float32) * t2
            acc = acc + x.to(tl.float32) * t3
    return acc * tl.sigmoid(acc)


@triton.jit
def _shift_store_rows(cs_ptr, h1, h2, x, ch, mask, C: tl.constexpr, W: tl.constexpr):
    """_conv_shift_store from the row vectors (W <= 4): window rows 1..W-1 as the new cache rows 0..W-2."""
    dt = cs_ptr.dtype.element_ty
    if W == 1:  # kda_decode(probe=2) only: no cache
        pass
    elif W == 2:
        tl.store(cs_ptr + ch, x.to(dt), mask=mask)
    else:
        tl.store(cs_ptr + ch, h1.to(dt), mask=mask)
        if W == 3:
            tl.store(cs_ptr + C + ch, x.to(dt), mask=mask)
        else:
            tl.store(cs_ptr + C + ch, h2.to(dt), mask=mask)
            tl.store(cs_ptr + 2 * C + ch, x.to(dt), mask=mask)


@triton.jit
def _shift_store(win, cs_ptr, ch, mask, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, ROWS: tl.constexpr):
    """The cache after this token from either window form: ROWS, the tuple (row 1, row 2, the token's row) of
    `_hist_rows` and x; else `_conv_window`'s tile."""
    if ROWS:
        _shift_store_rows(cs_ptr, win[0], win[1], win[2], ch, mask, C, W)
    else:
        _conv_shift_store(win, cs_ptr, ch, mask, C, W, WP)


@triton.jit
def _gate_consts(dt_ptr, a_log_ptr, i_h, offs_k, mask_k, D: tl.constexpr):
    """A head's gate constants: (dt_bias [BK], exp(A_log))."""
    return tl.load(dt_ptr + i_h * D + offs_k, mask=mask_k, other=0.0), tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))


@triton.jit
def _gate_beta(f_row, dt_ptr, a_log_ptr, b_row, i_h, offs_k, mask_k, lower_bound, D: tl.constexpr,
               USE_LOWER_BOUND: tl.constexpr):
    """(exp(g) [BK], beta): the per-key-channel decay and the update strength (model-facts §1.1)."""
    dt, a = _gate_consts(dt_ptr, a_log_ptr, i_h, offs_k, mask_k, D)
    return _gate_beta_with(f_row, dt, a, b_row, i_h, offs_k, mask_k, lower_bound, D, USE_LOWER_BOUND)


@triton.jit
def _gate_beta_with(f_row, dt, a, b_row, i_h, offs_k, mask_k, lower_bound, D: tl.constexpr,
                    USE_LOWER_BOUND: tl.constexpr):
    """_gate_beta with the head's constants already loaded (_gate_consts: a loop over tokens loads them once)."""
    x = tl.load(f_row + i_h * D + offs_k, mask=mask_k, other=0.0)
    beta = tl.sigmoid(tl.load(b_row + i_h).to(tl.float32))
    return _decay(x, dt, a, lower_bound, USE_LOWER_BOUND), beta


@triton.jit
def _decay(x, dt, a, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """exp(g) of raw f_b_proj values x (any shape whose last axis is the head's channels; dt [BK] broadcast)."""
    x = x.to(tl.float32) + dt
    if USE_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -a * softplus
    return tl.exp(g)


@triton.jit
def _gate_weight(gate_row, w_ptr, offs, mask):
    """weight * sigmoid(gate) over columns offs of one head, fp32 (SPLIT_NORM's factor)."""
    gt = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.sigmoid(gt)


@triton.jit
def _norm_gate_row(raw_row, gate_row, w_ptr, o_row, offs, mask, eps, D: tl.constexpr):
    """o = rmsnorm(raw) * weight * sigmoid(gate) over one head's D values, fp32 math."""
    x = tl.load(raw_row + offs, mask=mask, other=0.0, cache_modifier=".cg")
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    gt = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + offs, (x * rstd * w * tl.sigmoid(gt)).to(o_row.dtype.element_ty), mask=mask)



@triton.jit
def _delta_step(S, q, k, v, decay, beta):
    """One token's delta-rule update of a [BK, BV] state tile (model-facts §1.2): S' = diag(decay) S,
    S = S' + k (beta (v - S'^T k))^T, o = S^T q. Returns (S, o [BV]); the decode, verify and multi-token kernels all
    take it from here, so their sums run in one order."""
    S = S * decay[:, None]
    u = beta * (v - tl.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * u[None, :]
    return S, tl.sum(S * q[:, None], axis=0)
