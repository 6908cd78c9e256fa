"""Fused KDA decode step (Triton): short conv + SiLU, l2norm, gate, beta and the delta-rule update.

One launch does one layer's decode step for a batch of N sequences, one token each. Per (sequence,
head) a program:
  1. runs the depthwise causal conv (width W) on this head's q, k and v channels from the cached
     W-1 pre-conv inputs, applies SiLU, and shifts the new input into the conv cache in place;
  2. normalizes q and k (`x / sqrt(sum x^2 + 1e-6)`), scales q by `scale` (K^-0.5);
  3. computes the per-channel log decay g from the raw f_b_proj output (softplus or lower-bound
     form, model-facts §1.1) and beta = sigmoid(b);
  4. updates the fp32 state S [K, V] in place (model-facts §1.2):
         S' = diag(exp g) S;  S = S' + beta k (v - S'^T k)^T;  o = S^T q.

The oracle is `ref.py` (`kda_recurrent`, the gates, `l2norm`) plus `short_conv/ref.py`
(`causal_conv1d`). One program owns a whole head and walks the state in [K, BV] tiles (value
columns are independent in the update). The head is not split over programs: every V tile needs the
head's whole q/k conv window, and splitting would race on the in-place conv-cache update. So small
batches launch only N*H programs (N=1, H=32: 32 of 132 SMs), the main gap to fla at N=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, poison_like, set_poison  # noqa: F401  (re-exported)

_LOWER_BOUND_MIN = -5.0


@triton.jit
def _conv_silu_step(x_row, w_ptr, cs_ptr, ch, mask, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Causal conv of one token on channels `ch`, then SiLU; shifts the conv cache in place.

    x_row: the token's pre-conv row; cs_ptr: this slot's cache [W-1, C] (oldest first);
    w_ptr: conv weight [C, W] fp32; WP = next_pow2(W). Returns fp32 [len(ch)].
    """
    r = tl.arange(0, WP)
    # window rows 0..W-2 come from the cache, row W-1 is the token itself
    hist = tl.load(cs_ptr + r[:, None] * C + ch[None, :], mask=(r < W - 1)[:, None] & mask[None, :], other=0.0)
    x = tl.load(x_row + ch, mask=mask, other=0.0)
    win = tl.where((r == W - 1)[:, None], x.to(tl.float32)[None, :], hist.to(tl.float32))  # [WP, len(ch)]
    taps = tl.load(w_ptr + ch[None, :] * W + r[:, None], mask=(r < W)[:, None] & mask[None, :], other=0.0)
    acc = tl.sum(win * taps, axis=0)
    # A value may be held (and loaded) by several threads; all of them must have read the cache
    # before any thread overwrites it.
    tl.debug_barrier()
    # new cache row r-1 = window row r, for r = 1..W-1
    tl.store(cs_ptr + (r[:, None] - 1) * C + ch[None, :], win.to(cs_ptr.dtype.element_ty),
             mask=((r >= 1) & (r < W))[:, None] & mask[None, :])
    return acc * tl.sigmoid(acc)


@triton.jit
def _kda_decode_kernel(
    qkv_ptr, stride_qkv_n,  # [N, 3*H*D] pre-conv q|k|v
    conv_w_ptr,  # [3*H*D, W] fp32
    conv_state_ptr,  # [num_slots, W-1, 3*H*D]
    f_ptr, stride_f_n,  # [N, H*D] raw f_b_proj output
    a_log_ptr,  # [H] fp32
    dt_bias_ptr,  # [H*D] fp32
    b_ptr, stride_b_n,  # [N, H] raw b_proj output
    state_ptr,  # [num_slots, H, D, D] fp32
    slot_ptr,  # [N] int32/int64
    o_ptr,  # [N, H, D]
    scale,
    lower_bound,
    H: tl.constexpr,
    D: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < D
    o_row = o_ptr + (i_n * H + i_h).to(tl.int64) * D
    if USE_PDL:
        gdc_wait()
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    if slot < 0:
        # padding entry: zero output, no state touched
        for v0 in tl.static_range(0, D, BV):
            offs_v = v0 + tl.arange(0, BV)
            zero = tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty)
            tl.store(o_row + offs_v, zero, mask=offs_v < D)
    else:
        C = 3 * H * D
        x_row = qkv_ptr + i_n.to(tl.int64) * stride_qkv_n
        cs = conv_state_ptr + slot * ((W - 1) * C)
        q = _conv_silu_step(x_row, conv_w_ptr, cs, i_h * D + offs_k, mask_k, C, W, WP)
        k = _conv_silu_step(x_row, conv_w_ptr, cs, H * D + i_h * D + offs_k, mask_k, C, W, WP)
        q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)

        x = tl.load(f_ptr + i_n.to(tl.int64) * stride_f_n + i_h * D + offs_k, mask=mask_k, other=0.0)
        x = x.to(tl.float32) + tl.load(dt_bias_ptr + i_h * D + offs_k, mask=mask_k, other=0.0)
        a = tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
        if USE_LOWER_BOUND:
            g = lower_bound * tl.sigmoid(a * x)
        else:
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            g = -a * softplus
        decay = tl.exp(g)  # [BK]
        beta = tl.sigmoid(tl.load(b_ptr + i_n.to(tl.int64) * stride_b_n + i_h).to(tl.float32))

        if USE_PDL:
            gdc_launch_dependents()  # dependents may start their prologue; they gdc_wait for us
        s_base = state_ptr + (slot * H + i_h) * (D * D)
        # value columns are independent in the update: walk the state in [BK, BV] tiles
        for v0 in tl.static_range(0, D, BV):
            offs_v = v0 + tl.arange(0, BV)
            mask_v = offs_v < D
            v = _conv_silu_step(x_row, conv_w_ptr, cs, 2 * H * D + i_h * D + offs_v, mask_v, C, W, WP)
            s_ptrs = s_base + offs_k[:, None] * D + offs_v[None, :]
            mask2 = mask_k[:, None] & mask_v[None, :]
            S = tl.load(s_ptrs, mask=mask2, other=0.0)  # S: [BK, BV] fp32
            S = S * decay[:, None]
            kv = tl.sum(S * k[:, None], axis=0)  # S'^T k: [BV]
            u = beta * (v - kv)
            S = S + k[:, None] * u[None, :]
            o = tl.sum(S * q[:, None], axis=0)  # S^T q: [BV]
            tl.store(s_ptrs, S, mask=mask2)
            tl.store(o_row + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def _launch_decode(
    qkv_pre: Tensor, conv_weight: Tensor, conv_state: Tensor, f: Tensor, A_log: Tensor,
    dt_bias: Tensor, b: Tensor, state: Tensor, slot_indices: Tensor, out: Tensor,
    lower_bound: float | None, scale: float, use_pdl: bool, num_warps: int, block_v: int,
) -> None:
    N = qkv_pre.shape[0]
    _, H, D, _ = state.shape
    W = conv_weight.shape[1]
    # contract (the public function has already raised ValueError on user-facing mismatches)
    assert qkv_pre.shape == (N, 3 * H * D) and qkv_pre.stride(1) == 1
    assert conv_weight.shape == (3 * H * D, W) and conv_weight.is_contiguous()
    assert conv_weight.dtype == torch.float32 and W >= 2
    assert conv_state.shape[1:] == (W - 1, 3 * H * D) and conv_state.is_contiguous()
    assert f.shape == (N, H * D) and f.stride(1) == 1
    assert A_log.numel() == H and A_log.dtype == torch.float32 and A_log.is_contiguous()
    assert dt_bias.numel() == H * D and dt_bias.dtype == torch.float32 and dt_bias.is_contiguous()
    assert b.shape == (N, H) and b.stride(1) == 1
    assert state.shape[2:] == (D, D) and state.dtype == torch.float32 and state.is_contiguous()
    assert slot_indices.shape == (N,) and slot_indices.dtype in (torch.int32, torch.int64)
    assert out.shape == (N, H, D) and out.is_contiguous()
    if N == 0:
        return
    _kda_decode_kernel[(N, H)](
        qkv_pre, qkv_pre.stride(0), conv_weight, conv_state, f, f.stride(0), A_log, dt_bias,
        b, b.stride(0), state, slot_indices, out, scale,
        0.0 if lower_bound is None else float(lower_bound),
        H=H, D=D, BK=triton.next_power_of_2(D), BV=min(block_v, triton.next_power_of_2(D)),
        W=W, WP=triton.next_power_of_2(W),
        USE_LOWER_BOUND=lower_bound is not None, USE_PDL=use_pdl and not INTERPRET,
        num_warps=num_warps, **({"launch_pdl": True} if use_pdl and not INTERPRET else {}),
    )


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
    num_warps: int = 4,
    block_v: int = 32,
) -> Tensor:
    """One fused KDA decode step for N sequences (one token each) of one layer.

    Args:
        qkv_pre: [N, 3*H*D] pre-conv q|k|v projections (activation dtype; rows may be strided).
        conv_weight: [3*H*D, W] fp32 depthwise taps; column W-1 multiplies the current token.
        conv_state: [num_slots, W-1, 3*H*D] previous pre-conv inputs, oldest first; updated in place.
        f: [N, H*D] raw f_b_proj output.
        A_log: [H] fp32 (the checkpoint's [1, 1, H, 1] is accepted).
        dt_bias: [H*D] fp32 (an [H, D] view is accepted).
        b: [N, H] raw b_proj output (beta = sigmoid(b)).
        state: [num_slots, H, D, D] fp32 recurrent state (key rows, value columns); updated in place.
        slot_indices: [N] int32/int64 slot of each sequence; a negative entry is padding: its output
            row is zero and no state is touched.
        lower_bound: None for the softplus gate, else the bounded gate's lower bound (-5 <= lb < 0).
        scale: query scale; None means D**-0.5.
        out: optional [N, H, D] output buffer (activation dtype).
        use_pdl: launch with programmatic dependent launch (GPU only; ignored by the interpreter).

    Returns:
        o: [N, H, D] in qkv_pre.dtype (not yet through the gated RMSNorm).
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
    if tuple(conv_state.shape) != (num_slots, W - 1, 3 * H * D) or not conv_state.is_contiguous():
        raise ValueError(
            f"conv_state must be contiguous [num_slots, W-1, 3*H*D]={[num_slots, W - 1, 3 * H * D]}, "
            f"got {list(conv_state.shape)} (contiguous={conv_state.is_contiguous()})"
        )
    check(f, "f", (N, H * D))
    check(b, "b", (N, H))
    if A_log.numel() != H or A_log.dtype != torch.float32:
        raise ValueError(f"A_log must be fp32 with H={H} values, got {A_log.dtype} {list(A_log.shape)}")
    if dt_bias.numel() != H * D or dt_bias.dtype != torch.float32:
        raise ValueError(
            f"dt_bias must be fp32 with H*D={H * D} values, got {dt_bias.dtype} {list(dt_bias.shape)}"
        )
    if slot_indices.shape != (N,) or slot_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_indices must be int32/int64 [N]=[{N}], got {slot_indices.dtype} {list(slot_indices.shape)}"
        )
    if lower_bound is not None and not (_LOWER_BOUND_MIN <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must satisfy -5 <= lower_bound < 0, got {lower_bound}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous")
    for name, t in (("qkv_pre", qkv_pre), ("f", f), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    devices = {t.device for t in (qkv_pre, conv_weight, conv_state, f, A_log, dt_bias, b, state, slot_indices)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if out is None:
        out = torch.empty(N, H, D, dtype=qkv_pre.dtype, device=qkv_pre.device)
        poison_like(out)
    elif tuple(out.shape) != (N, H, D) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [N, H, D]={[N, H, D]}, got {list(out.shape)}")
    _launch_decode(
        qkv_pre, conv_weight, conv_state, f, A_log.contiguous().view(H), dt_bias.contiguous().view(H * D),
        b, state, slot_indices, out, lower_bound, D**-0.5 if scale is None else float(scale),
        use_pdl, num_warps, block_v,
    )
    return out
