"""KDA over T drafted tokens per sequence for speculative verification (Triton), and the commit.

`kda_verify` runs the decode step (conv + SiLU, l2norm, gates, delta rule, optional gated RMSNorm;
see triton_decode.py) over T tokens of each of N sequences, starting from the sequence's live state,
WITHOUT writing the live recurrent state or conv cache. After every position t it writes the state
and the conv window into per-position scratch (DESIGN.md §8, the fallback: one state per drafted
position), so once the sampler knows how many drafted tokens each sequence accepted, `kda_commit`
copies the state of the last accepted position into the live slot.

Per (sequence, head, V slice) a program keeps its [K, D/v_split] state tile in registers across
the T positions and recomputes the head's q/k conv, norms and gates (cheap) at each one. Nothing
it reads is written in the launch, so the V split needs no ordering; only the fused norm, which
needs a whole head row, counts arrivals as in kda_decode (the last program of a head normalizes
all T rows from an fp32 scratch).

Both launchers are CUDA-graph safe: no host sync, shapes fixed by (N, T).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, pdl_kwargs, poison_like
from k3rt.kernels.kda.triton_decode import (
    _LOWER_BOUND_MIN,
    _check_norm,
    _slots_contiguous,
    default_v_split,
    kda_decode_workspace,
)
from k3rt.kernels.kda.triton_step import _conv_silu, _delta_step, _gate_beta, _norm_gate_row

MAX_DRAFT = 16


@triton.jit
def _verify_window(x_seq, stride_xt, cs_ptr, t, ch, mask, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """The conv window of drafted position t on channels `ch`: [WP, len(ch)] fp32. Window row r
    holds position p = t - (W-1) + r: the live cache row p + W-1 when p < 0, else drafted token p."""
    r = tl.arange(0, WP)
    p = t - (W - 1) + r
    in_win = (r < W)[:, None] & mask[None, :]
    hist = tl.load(cs_ptr + tl.maximum(p + W - 1, 0)[:, None] * C + ch[None, :],
                   mask=in_win & (p < 0)[:, None], other=0.0)
    tok = tl.load(x_seq + tl.maximum(p, 0).to(tl.int64)[:, None] * stride_xt + ch[None, :],
                  mask=in_win & (p >= 0)[:, None], other=0.0)
    return tl.where((p < 0)[:, None], hist.to(tl.float32), tok.to(tl.float32))


# not specialized per step (kernels/common.py, Compiles): slots, a view of the packed step (count_ptr too, which is the
# slots where no counter is used)
@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "count_ptr"])
def _kda_verify_kernel(
    qkv_ptr, stride_qkv_n, stride_qkv_t,  # [N, T, 3*H*D] pre-conv q|k|v
    conv_w_ptr,  # [3*H*D, W] fp32
    conv_state_ptr,  # [num_slots, W-1, 3*H*D], read only
    f_ptr, stride_f_n, stride_f_t,  # [N, T, H*D]
    a_log_ptr, dt_bias_ptr,  # [H], [H*D] fp32
    b_ptr, stride_b_n, stride_b_t,  # [N, T, H]
    state_ptr,  # [num_slots, H, D, D] fp32, read only
    slot_ptr,  # [N]
    o_ptr,  # [N, T, H, D]
    states_out_ptr,  # [N, T, H, D, D] fp32
    conv_out_ptr,  # [N, T, W-1, 3*H*D]
    gate_ptr, stride_gate_n, stride_gate_t, stride_gate_h,  # [N, T, H, D] (NORM only)
    norm_w_ptr,  # [D] (NORM only)
    raw_ptr,  # [N, T, H, D] fp32 scratch (NORM only)
    count_ptr,  # [N*H] int32, zero between launches (NORM with NV > 1 only)
    scale, lower_bound, eps,
    T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr,
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
    o_seq = o_ptr + i_n.to(tl.int64) * (T * H * D) + i_h * D
    if slot < 0:
        # padding entry: zero output; no scratch written
        zero = tl.zeros([BV], dtype=tl.float32).to(o_ptr.dtype.element_ty)
        for t in range(T):
            tl.store(o_seq + t * (H * D) + offs_v, zero, mask=mask_v)
    else:
        x_seq = qkv_ptr + i_n.to(tl.int64) * stride_qkv_n
        cs = conv_state_ptr + slot * ((W - 1) * C)
        q_ch = i_h * D + offs_k
        k_ch = H * D + q_ch
        v_ch = 2 * H * D + i_h * D + offs_v
        mask2 = mask_k[:, None] & mask_v[None, :]
        s_tile = offs_k[:, None] * D + offs_v[None, :]
        S = tl.load(state_ptr + (slot * H + i_h) * (D * D) + s_tile, mask=mask2, other=0.0)  # [BK, BV]
        if USE_PDL:
            gdc_launch_dependents()
        r = tl.arange(0, WP)
        shift = (r[:, None] - 1) * C  # window row r is row r-1 of the conv cache after this token
        m_shift = ((r >= 1) & (r < W))[:, None]
        m_qk = m_shift & (mask_k & (i_v == 0))[None, :]  # one program per head writes the q/k rows
        for t in range(T):
            nt = i_n.to(tl.int64) * T + t
            win_q = _verify_window(x_seq, stride_qkv_t, cs, t, q_ch, mask_k, C, W, WP)
            win_k = _verify_window(x_seq, stride_qkv_t, cs, t, k_ch, mask_k, C, W, WP)
            win_v = _verify_window(x_seq, stride_qkv_t, cs, t, v_ch, mask_v, C, W, WP)
            c_out = conv_out_ptr + nt * ((W - 1) * C) + shift
            tl.store(c_out + q_ch[None, :], win_q.to(conv_out_ptr.dtype.element_ty), mask=m_qk)
            tl.store(c_out + k_ch[None, :], win_k.to(conv_out_ptr.dtype.element_ty), mask=m_qk)
            tl.store(c_out + v_ch[None, :], win_v.to(conv_out_ptr.dtype.element_ty), mask=m_shift & mask_v[None, :])
            q = _conv_silu(win_q, conv_w_ptr, q_ch, mask_k, W, WP)
            k = _conv_silu(win_k, conv_w_ptr, k_ch, mask_k, W, WP)
            v = _conv_silu(win_v, conv_w_ptr, v_ch, mask_v, W, WP)
            q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
            decay, beta = _gate_beta(f_ptr + i_n.to(tl.int64) * stride_f_n + t * stride_f_t, dt_bias_ptr,
                                     a_log_ptr, b_ptr + i_n.to(tl.int64) * stride_b_n + t * stride_b_t,
                                     i_h, offs_k, mask_k, lower_bound, D, USE_LOWER_BOUND)
            S, o = _delta_step(S, q, k, v, decay, beta)
            tl.store(states_out_ptr + (nt * H + i_h) * (D * D) + s_tile, S, mask=mask2)
            if NORM:
                tl.store(raw_ptr + (nt * H + i_h) * D + offs_v, o, mask=mask_v)
            else:
                tl.store(o_seq + t * (H * D) + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
        if NORM:
            # the norm needs the head's whole row: the last program of the head to finish applies it
            tl.debug_barrier()
            last = True
            if NV > 1:
                cnt = count_ptr + (i_n * H + i_h)
                last = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == NV - 1
            if last:
                for t in range(T):
                    nt = i_n.to(tl.int64) * T + t
                    _norm_gate_row(raw_ptr + (nt * H + i_h) * D,
                                   gate_ptr + i_n.to(tl.int64) * stride_gate_n + t * stride_gate_t
                                   + i_h * stride_gate_h,
                                   norm_w_ptr, o_seq + t * (H * D), offs_k, mask_k, eps, D)
                if NV > 1:
                    tl.store(count_ptr + (i_n * H + i_h), 0)  # ready for the next launch


# not specialized per step (kernels/common.py, Compiles): accepted, slots: per-step vectors (slices)
@triton.jit(do_not_specialize_on_alignment=["accepted_ptr", "slot_ptr"])
def _kda_commit_kernel(
    accepted_ptr,  # [N] int32: accepted drafted tokens; 0 (or out of 1..T) leaves the slot as is
    slot_ptr,  # [N]
    states_out_ptr,  # [N, T, H, D, D] fp32
    conv_out_ptr,  # [N, T, W-1, C]
    state_ptr,  # [num_slots, H, D, D] fp32
    conv_state_ptr,  # [num_slots, W-1, C]
    T: tl.constexpr, H: tl.constexpr, DD: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
    BS: tl.constexpr, BC: tl.constexpr, USE_PDL: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    if USE_PDL:
        gdc_wait()
    j = tl.load(accepted_ptr + i_n)
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    if (j > 0) & (j <= T) & (slot >= 0):
        src = i_n.to(tl.int64) * T + (j - 1)
        s_src = states_out_ptr + (src * H + i_h) * DD
        s_dst = state_ptr + (slot * H + i_h) * DD
        for e0 in range(0, DD, BS):
            e = e0 + tl.arange(0, BS)
            tl.store(s_dst + e, tl.load(s_src + e, mask=e < DD), mask=e < DD)
        # this head's program copies channels [i_h*C/H, (i_h+1)*C/H) of every conv row
        CH: tl.constexpr = C // H
        for row in range(W - 1):
            c_src = conv_out_ptr + (src * (W - 1) + row) * C + i_h * CH
            c_dst = conv_state_ptr + (slot * (W - 1) + row) * C + i_h * CH
            for c0 in range(0, CH, BC):
                c = c0 + tl.arange(0, BC)
                tl.store(c_dst + c, tl.load(c_src + c, mask=c < CH), mask=c < CH)


class VerifyOutput(NamedTuple):
    o: Tensor  # [N, T, H, D] activation dtype
    states_out: Tensor  # [N, T, H, D, D] fp32: the recurrent state after each drafted position
    conv_out: Tensor  # [N, T, W-1, 3*H*D] conv_state dtype: the conv cache after each position


class TokenBlock(NamedTuple):
    """A multi-token KDA launch's checked inputs (`check_token_block`)."""

    N: int
    R: int  # tokens per sequence
    H: int
    D: int
    W: int
    C: int  # 3*H*D
    conv_weight: Tensor  # [C, W]
    o_gate: Tensor | None  # [N, R, H, D]
    o_norm_weight: Tensor | None
    norm: bool
    v_split: int
    counts: Tensor | None  # the workspace's per-head counters when the launch needs them


def check_token_block(qkv_pre: Tensor, conv_weight: Tensor, conv_state: Tensor, f: Tensor, A_log: Tensor,
                      dt_bias: Tensor, b: Tensor, state: Tensor, slot_indices: Tensor, lower_bound: float | None,
                      o_gate: Tensor | None, o_norm_weight: Tensor | None, v_split: int | None,
                      workspace: Tensor | None, *, need_counts: bool, slot_strides: bool,
                      tokens_name: str = "R (tokens per sequence)") -> TokenBlock:
    """The input checks `kda_verify` and `kda_decode_multi` share: shapes, dtypes and layouts of an [N, R] block of
    tokens over fp32 states, each error naming the argument. slot_strides: the states and conv caches may have
    any slot stride (each slot contiguous), else they must be contiguous. need_counts: the launch counts
    program arrivals per head (the fused norm, or a commit, with v_split > 1)."""
    if qkv_pre.dim() != 3:
        raise ValueError(f"qkv_pre must be [N, R, 3*H*D], got {list(qkv_pre.shape)}")
    contiguous = _slots_contiguous if slot_strides else Tensor.is_contiguous
    layout = "with each slot contiguous" if slot_strides else "contiguous"
    if state.dim() != 4 or state.dtype != torch.float32 or state.shape[2] != state.shape[3] or not contiguous(state):
        raise ValueError(f"state must be fp32 [num_slots, H, D, D], {layout}, got {state.dtype} "
                         f"{list(state.shape)} strides {state.stride()}")
    num_slots, H, D, _ = state.shape
    N, R, C = qkv_pre.shape
    if C != 3 * H * D:
        raise ValueError(f"qkv_pre must be [N, R, 3*H*D]=[N, R, {3 * H * D}], got {list(qkv_pre.shape)}")
    if not 1 <= R <= MAX_DRAFT:
        raise ValueError(f"{tokens_name} must be in 1..{MAX_DRAFT}, got {R}")
    if conv_weight.dim() == 3 and conv_weight.shape[1] == 1:
        conv_weight = conv_weight.squeeze(1)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != C or conv_weight.shape[1] < 2 \
            or conv_weight.dtype != torch.float32 or not conv_weight.is_contiguous():
        raise ValueError(f"conv_weight must be contiguous fp32 [3*H*D, W]=[{C}, W>=2], got "
                         f"{conv_weight.dtype} {list(conv_weight.shape)}")
    W = conv_weight.shape[1]
    if tuple(conv_state.shape) != (num_slots, W - 1, C) or not contiguous(conv_state):
        raise ValueError(f"conv_state must be [num_slots, W-1, 3*H*D]={[num_slots, W - 1, C]}, {layout}, got "
                         f"{list(conv_state.shape)} strides {conv_state.stride()}")
    check(f, "f", (N, R, H * D))
    check(b, "b", (N, R, H))
    for name, t in (("qkv_pre", qkv_pre), ("f", f), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if A_log.numel() != H or A_log.dtype != torch.float32:
        raise ValueError(f"A_log must be fp32 with H={H} values, got {A_log.dtype} {list(A_log.shape)}")
    if dt_bias.numel() != H * D or dt_bias.dtype != torch.float32:
        raise ValueError(f"dt_bias must be fp32 with H*D={H * D} values, got {dt_bias.dtype} {list(dt_bias.shape)}")
    if slot_indices.shape != (N,) or slot_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_indices must be int32/int64 [N]=[{N}], got {slot_indices.dtype} "
                         f"{list(slot_indices.shape)}")
    if lower_bound is not None and not (_LOWER_BOUND_MIN <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must satisfy -5 <= lower_bound < 0, got {lower_bound}")
    if o_gate is not None and tuple(o_gate.shape) == (N, R, H * D) and o_gate.stride(-1) == 1:
        o_gate = o_gate.view(N, R, H, D)
    if o_gate is not None and (tuple(o_gate.shape) != (N, R, H, D) or o_gate.stride(-1) != 1):
        raise ValueError(f"o_gate must be [N, R, H, D]=[{N}, {R}, {H}, {D}] (or [N, R, H*D]) with a contiguous "
                         f"last dim, got {list(o_gate.shape)}")
    if o_gate is not None:
        _, o_norm_weight = _check_norm(o_gate[:, 0], o_norm_weight, N, H, D)
    elif o_norm_weight is not None:
        raise ValueError("o_gate and o_norm_weight must be given together")
    # the state tile lives in registers across all R tokens: keep it at <= 32 columns
    v_split = max(default_v_split(N, H, D), D // 32) if v_split is None else int(v_split)
    if v_split < 1 or D % v_split != 0 or (D // v_split) & (D // v_split - 1):
        raise ValueError(f"v_split must be a power of two dividing D={D} into powers of two, got {v_split}")
    counts = None
    if need_counts and v_split > 1:
        if workspace is None:
            workspace = kda_decode_workspace(N, H, qkv_pre.device)
        elif workspace.dtype != torch.int32 or workspace.numel() < N * H or not workspace.is_contiguous():
            raise ValueError(f"workspace must be contiguous int32 with >= N*H={N * H} elements, "
                             f"got {workspace.dtype} {list(workspace.shape)}")
        counts = workspace
    return TokenBlock(N, R, H, D, W, C, conv_weight, o_gate, o_norm_weight, o_gate is not None, v_split, counts)


def kda_verify(
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
    states_out: Tensor | None = None,
    conv_out: Tensor | None = None,
    o_gate: Tensor | None = None,
    o_norm_weight: Tensor | None = None,
    o_norm_eps: float = 1e-5,
    v_split: int | None = None,
    workspace: Tensor | None = None,
    use_pdl: bool = False,
    num_warps: int = 4,
) -> VerifyOutput:
    """KDA over T drafted tokens per sequence from the live state, leaving the live state untouched.

    Equal to T successive `kda_decode` calls on a copy of the slot's state and conv cache, with the
    state and conv cache after every call recorded.

    Args:
        qkv_pre: [N, T, 3*H*D] pre-conv q|k|v of the drafted tokens (1 <= T <= 16; last dim
            contiguous; a [N*T, 3*H*D] projection output viewed as [N, T, -1] is fine).
        conv_weight: [3*H*D, W] fp32 depthwise taps.
        conv_state: [num_slots, W-1, 3*H*D] live conv caches; read only.
        f: [N, T, H*D] raw f_b_proj output.
        A_log: [H] fp32. dt_bias: [H*D] fp32.
        b: [N, T, H] raw b_proj output.
        state: [num_slots, H, D, D] fp32 live recurrent states; read only.
        slot_indices: [N] int32/int64; a negative entry is padding (zero output, scratch not written).
        lower_bound, scale: as in kda_decode.
        out: optional [N, T, H, D] output buffer (qkv_pre.dtype).
        states_out: optional [N, T, H, D, D] fp32 buffer for the per-position states.
        conv_out: optional [N, T, W-1, 3*H*D] buffer (conv_state.dtype) for the per-position caches.
        o_gate, o_norm_weight, o_norm_eps: the fused gated RMSNorm as in kda_decode; o_gate is
            [N, T, H, D] (or [N, T, H*D]) with a contiguous last dim.
        v_split: programs per head (power of two dividing D); None picks `default_v_split`, at
            least D/32.
        workspace: int32 counters (`kda_decode_workspace(>= N, H)`), used with the norm and v_split > 1.

    Returns:
        VerifyOutput(o, states_out, conv_out).
    """
    blk = check_token_block(qkv_pre, conv_weight, conv_state, f, A_log, dt_bias, b, state, slot_indices,
                            lower_bound, o_gate, o_norm_weight, v_split, workspace, need_counts=o_gate is not None,
                            slot_strides=False, tokens_name="T (drafted tokens per sequence)")
    N, T, H, D, W, C = blk.N, blk.R, blk.H, blk.D, blk.W, blk.C
    conv_weight, o_gate, o_norm_weight, norm, v_split, counts = (blk.conv_weight, blk.o_gate, blk.o_norm_weight,
                                                                 blk.norm, blk.v_split, blk.counts)
    dev = qkv_pre.device
    devices = {t.device for t in (qkv_pre, conv_weight, conv_state, f, A_log, dt_bias, b, state, slot_indices,
                                  o_gate, o_norm_weight, counts, out, states_out, conv_out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    out = _buffer(out, "out", (N, T, H, D), qkv_pre.dtype, dev)
    states_out = _buffer(states_out, "states_out", (N, T, H, D, D), torch.float32, dev)
    conv_out = _buffer(conv_out, "conv_out", (N, T, W - 1, C), conv_state.dtype, dev)
    raw = poison_like(torch.empty(N, T, H, D, dtype=torch.float32, device=dev)) if norm else None

    # contract of the launch
    assert qkv_pre.stride(2) == f.stride(2) == b.stride(2) == 1
    assert A_log.numel() == H and dt_bias.numel() == H * D
    if N > 0:
        _kda_verify_kernel[(N, H, v_split)](
            qkv_pre, qkv_pre.stride(0), qkv_pre.stride(1), conv_weight, conv_state,
            f, f.stride(0), f.stride(1), A_log.contiguous().view(H), dt_bias.contiguous().view(H * D),
            b, b.stride(0), b.stride(1), state, slot_indices, out, states_out, conv_out,
            o_gate if norm else out, *(o_gate.stride()[:3] if norm else (0, 0, 0)),
            o_norm_weight if norm else out, raw if norm else out, counts if counts is not None else slot_indices,
            D**-0.5 if scale is None else float(scale), 0.0 if lower_bound is None else float(lower_bound),
            float(o_norm_eps),
            T=T, H=H, D=D, BK=triton.next_power_of_2(D), BV=D // v_split, NV=v_split, W=W,
            WP=triton.next_power_of_2(W), USE_LOWER_BOUND=lower_bound is not None, NORM=norm,
            USE_PDL=use_pdl and not INTERPRET, num_warps=num_warps, **pdl_kwargs(use_pdl),
        )
    return VerifyOutput(out, states_out, conv_out)


def _buffer(t: Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> Tensor:
    if t is None:
        return poison_like(torch.empty(shape, dtype=dtype, device=dev))
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    return t


def kda_commit(
    states_out: Tensor,
    conv_out: Tensor,
    accepted: Tensor,
    slot_indices: Tensor,
    state: Tensor,
    conv_state: Tensor,
    *,
    use_pdl: bool = False,
) -> None:
    """Copy, per sequence, the state and conv cache after its last accepted drafted token into its
    live slot, in place: position accepted[i]-1 of `kda_verify`'s scratch. accepted[i] == 0 (or any
    value outside 1..T) and negative slots leave the slot as is. No host sync (CUDA-graph safe).

    Args:
        states_out: [N, T, H, D, D] fp32 from kda_verify.
        conv_out: [N, T, W-1, 3*H*D] from kda_verify.
        accepted: [N] int32 number of drafted tokens accepted (the bonus token is not one of them).
        slot_indices: [N] int32/int64 live slots (the ones kda_verify read).
        state: [num_slots, H, D, D] fp32 live states.
        conv_state: [num_slots, W-1, 3*H*D] live conv caches (conv_out's dtype).
    """
    if states_out.dim() != 5 or states_out.dtype != torch.float32 or not states_out.is_contiguous():
        raise ValueError(f"states_out must be contiguous fp32 [N, T, H, D, D], got {states_out.dtype} "
                         f"{list(states_out.shape)}")
    N, T, H, D, _ = states_out.shape
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, D, D) or state.dtype != torch.float32 \
            or not state.is_contiguous():
        raise ValueError(f"state must be contiguous fp32 [num_slots, {H}, {D}, {D}], got {state.dtype} "
                         f"{list(state.shape)}")
    num_slots = state.shape[0]
    C = 3 * H * D
    if conv_out.dim() != 4 or conv_out.shape[:2] != (N, T) or conv_out.shape[3] != C or not conv_out.is_contiguous():
        raise ValueError(f"conv_out must be contiguous [N, T, W-1, 3*H*D]=[{N}, {T}, W-1, {C}], "
                         f"got {list(conv_out.shape)}")
    W = conv_out.shape[2] + 1
    if tuple(conv_state.shape) != (num_slots, W - 1, C) or conv_state.dtype != conv_out.dtype \
            or not conv_state.is_contiguous():
        raise ValueError(f"conv_state must be contiguous {conv_out.dtype} {[num_slots, W - 1, C]}, "
                         f"got {conv_state.dtype} {list(conv_state.shape)}")
    if accepted.shape != (N,) or accepted.dtype != torch.int32:
        raise ValueError(f"accepted must be int32 [N]=[{N}], got {accepted.dtype} {list(accepted.shape)}")
    if slot_indices.shape != (N,) or slot_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_indices must be int32/int64 [N]=[{N}], got {slot_indices.dtype} "
                         f"{list(slot_indices.shape)}")
    devices = {t.device for t in (states_out, conv_out, accepted, slot_indices, state, conv_state)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if N == 0:
        return
    _kda_commit_kernel[(N, H)](
        accepted, slot_indices, states_out, conv_out, state, conv_state,
        T=T, H=H, DD=D * D, C=C, W=W, BS=min(4096, triton.next_power_of_2(D * D)),
        BC=min(256, triton.next_power_of_2(C // H)), USE_PDL=use_pdl and not INTERPRET,
        num_warps=4, **pdl_kwargs(use_pdl),
    )
