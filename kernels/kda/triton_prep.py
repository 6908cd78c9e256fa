"""The chunked (general) form's inputs to the recurrence, in one launch: the short conv of the step's rows
over their row-index windows (SiLU), and the decay gate and beta.

Programs over (block of rows, block of columns): the first column blocks take the conv's channels (windows as
rows of [cached windows ; the step's rows], read in place: `short_conv.triton_rows._ext_rows`; a row block whose
windows are all its rows' natural ones inside the step, as most of a long prompt's are, reads the taps straight
from x after one load of its indices: the dependent index loads, not the bytes, were the indexed path's cost,
session 29), the rest the
gate's H*D columns (the block right after the conv's also writes beta). Per element the math of the torch
references (`short_conv.ref.causal_conv1d_rows`; `ref.kda_gate_softplus` / `ref.kda_gate_lower_bound` and a
sigmoid for beta) as the decode kernel computes it (softplus as log(1 + exp(x)) below its threshold 20), where
those references take about 25 launches per layer. The cached windows are only read: storing the new ones is
`short_conv.conv_windows_store_fwd`, after this launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import INTERPRET, poison_like
from k3rt.kernels.short_conv.triton_rows import _ext_rows, check_rows

# rows and columns per program; the interpreter's cost is per program, so it takes larger tiles
_BT = 64 if INTERPRET else 16
_BC = 256 if INTERPRET else 128
# the one-sequence path's columns: 16 x 256 tiles 0.283 against 0.310 ms at 8K rows of the 48B layer, a tie at 32K
# (0.903 / 0.905; H200, benchmarks/kda_prep.py, RESULTS.md session 29)
_BC_ONE_SEQ = 256


@triton.jit
def _natural_taps(acc, x_ptr, stride_x, cw_ptr, r64, m_r, ch, m_c, W: tl.constexpr):
    """acc + the conv of rows whose windows are their natural ones inside the step (row t's taps: x rows
    t - W + 1 .. t), read straight from x: the fp32 sum over the taps in order, as the reference's addcmul_."""
    for tap in tl.static_range(W):
        v = tl.load(x_ptr + (r64 + (tap - (W - 1)))[:, None] * stride_x + ch[None, :],
                    mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        acc += v * tl.load(cw_ptr + ch * W + tap, mask=m_c, other=0.0)[None, :]
    return acc


# not specialized per step (kernels/common.py, Compiles): T, num_old: the step's rows and old windows; slots, idx:
# views of the packed step. b's row stride stays specialized (a row of H heads is one vector load at the 48B
# shape): the runner keeps it a multiple of 16 (backend/runner/gpu/kda.py ROW_ALIGN)
@triton.jit(do_not_specialize=["T", "num_old"], do_not_specialize_on_alignment=["slot_ptr", "idx_ptr"])
def _kda_chunk_prep_kernel(
    x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, idx_ptr, cw_ptr, y_ptr,  # the conv
    f_ptr, stride_f, b_ptr, stride_b, a_log_ptr, dt_ptr, g_ptr, beta_ptr, lower_bound,  # the gate
    T, C, num_old, conv_blocks,
    W: tl.constexpr, WP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BH: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, ONE_SEQ: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    m_r = rows < T
    r64 = rows.to(tl.int64)
    pc = tl.program_id(1)
    if pc < conv_blocks:
        ch = pc * BC + tl.arange(0, BC)
        m_c = ch < C
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        if ONE_SEQ and tl.program_id(0) * BT >= W - 1:
            # one sequence, every window inside the step's rows: row t's taps are rows t-W+1 .. t, no index loads
            acc = _natural_taps(acc, x_ptr, stride_x, cw_ptr, r64, m_r, ch, m_c, W)
        elif ONE_SEQ:
            for tap in tl.static_range(W):  # fp32 sum over the taps in order, as the reference's addcmul_
                # conv_idx of one sequence is ext row t + tap (its W-1 cached rows first)
                v = _ext_rows(x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, rows + tap, m_r, ch, m_c,
                              num_old, W - 1)
                acc += v * tl.load(cw_ptr + ch * W + tap, mask=m_c, other=0.0)[None, :]
        else:
            # the block's windows in one load; when each is its row's natural window inside the step's rows (ext rows
            # num_old + t - W + 1 .. num_old + t, all >= num_old: a sequence's rows past its first W - 1 in this
            # step), the taps are read straight from x as in the one-sequence path, else through the indices
            taps = tl.arange(0, WP)
            m_t = m_r[:, None] & (taps < W)[None, :]
            # a load per tap, gathered into [BT, WP]: one 2D load vectorizes only where idx_ptr's alignment is known,
            # which it is not at launch (a view of the packed step: tests/kernels/test_specialize_sm90_build.py)
            idx = tl.zeros([BT, WP], dtype=tl.int64)
            for tap in tl.static_range(W):
                col = tl.load(idx_ptr + r64 * W + tap, mask=m_r, other=0).to(tl.int64)
                idx = tl.where(taps[None, :] == tap, col[:, None], idx)
            natural = ((idx == num_old + r64[:, None] - (W - 1) + taps[None, :]) & (idx >= num_old)) | ~m_t
            if tl.min(natural.to(tl.int32)) == 1:
                acc = _natural_taps(acc, x_ptr, stride_x, cw_ptr, r64, m_r, ch, m_c, W)
            else:
                for tap in tl.static_range(W):
                    r = tl.sum(tl.where(taps[None, :] == tap, idx, 0), axis=1)
                    v = _ext_rows(x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, r, m_r, ch, m_c,
                                  num_old, W - 1)
                    acc += v * tl.load(cw_ptr + ch * W + tap, mask=m_c, other=0.0)[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + r64[:, None] * C + ch[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=m_r[:, None] & m_c[None, :])
    else:
        cols = (pc - conv_blocks) * BC + tl.arange(0, BC)
        m_c = cols < H * D
        m = m_r[:, None] & m_c[None, :]
        x = tl.load(f_ptr + r64[:, None] * stride_f + cols[None, :], mask=m, other=0.0).to(tl.float32)
        x = x + tl.load(dt_ptr + cols, mask=m_c, other=0.0)[None, :]
        a = tl.exp(tl.load(a_log_ptr + cols // D, mask=m_c, other=0.0))[None, :]
        if USE_LOWER_BOUND:
            g = lower_bound * tl.sigmoid(a * x)
        else:
            g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        tl.store(g_ptr + r64[:, None] * (H * D) + cols[None, :], g, mask=m)
        if pc == conv_blocks:
            oh = tl.arange(0, BH)
            mb = m_r[:, None] & (oh < H)[None, :]
            bb = tl.load(b_ptr + r64[:, None] * stride_b + oh[None, :], mask=mb, other=0.0).to(tl.float32)
            tl.store(beta_ptr + r64[:, None] * H + oh[None, :], tl.sigmoid(bb), mask=mb)


def kda_chunk_prep(qkv: Tensor, conv_state: Tensor, slots: Tensor, conv_idx: Tensor, conv_weight: Tensor,
                   f: Tensor, A_log: Tensor, dt_bias: Tensor, b: Tensor,
                   lower_bound: float | None = None, *, one_seq: bool = False, block_t: int | None = None,
                   block_c: int | None = None, num_warps: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The conv (SiLU) of the step's pre-conv rows and the gate and beta, in one launch. No host sync.

    Args:
        qkv: [T, C] pre-conv rows (last dim contiguous; a column view is fine).
        conv_state: [S, W-1, C] cached windows (any slot stride, rows contiguous); slots: [B] the step's
            sequences' slots in it. Only read.
        conv_idx: [T, W] int64 rows of ext = [conv_state[slots] as B*(W-1) rows ; qkv] forming each row's
            window, oldest first (`short_conv.ref.causal_conv1d_rows`).
        conv_weight: [C, W] fp32 contiguous.
        f: [T, H*D] raw f_b_proj output; b: [T, H] raw b_proj output (last dims contiguous).
        A_log: [H] fp32; dt_bias: [H*D] fp32 (both contiguous).
        lower_bound: None for the softplus gate, else the bounded gate's lower bound (-5 <= lb < 0).
        one_seq: the step is one sequence and conv_idx its natural windows (row t: ext rows t .. t+W-1, as
            backend/runner/gpu/step.py builds them for one sequence), so the kernel computes the taps' rows
            instead of loading them (slots must hold one slot). The caller vouches for conv_idx.
        block_t, block_c, num_warps: tile overrides (rows and columns per program).

    Returns:
        y [T, C] in qkv.dtype, g [T, H, D] fp32 log decay, beta [T, H] fp32.
    """
    W = conv_weight.shape[1] if conv_weight.dim() == 2 else 0
    check_rows(qkv, conv_state, slots, conv_idx, W, "conv_idx", extra_col=True)
    T, C = qkv.shape
    if conv_weight.shape != (C, W) or conv_weight.dtype != torch.float32 or not conv_weight.is_contiguous() or W < 2:
        raise ValueError(f"conv_weight must be contiguous fp32 [C={C}, W>=2], got {conv_weight.dtype} "
                         f"{list(conv_weight.shape)}")
    if conv_idx.shape[0] != T:
        raise ValueError(f"conv_idx must have T={T} rows, got {conv_idx.shape[0]}")
    H = A_log.numel()
    if f.dim() != 2 or f.shape[0] != T or H == 0 or f.shape[1] % H:
        raise ValueError(f"f must be [T={T}, H*D] with H={H} (A_log's size), got {list(f.shape)}")
    P = f.shape[1]
    D = P // H
    if b.shape != (T, H):
        raise ValueError(f"b must be [T, H]=[{T}, {H}], got {list(b.shape)}")
    if dt_bias.numel() != P:
        raise ValueError(f"dt_bias must hold H*D={P} values, got {list(dt_bias.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32, got {t.dtype} (contiguous: {t.is_contiguous()})")
    for name, t in (("f", f), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if lower_bound is not None and not (-5.0 <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must satisfy -5 <= lower_bound < 0, got {lower_bound}")
    if one_seq and slots.shape[0] != 1:
        raise ValueError(f"one_seq needs slots to hold one sequence's slot, got {slots.shape[0]}")
    dev = qkv.device
    y = poison_like(torch.empty(T, C, dtype=qkv.dtype, device=dev))
    g = poison_like(torch.empty(T, H, D, dtype=torch.float32, device=dev))
    beta = poison_like(torch.empty(T, H, dtype=torch.float32, device=dev))
    if T:
        bt, bc = block_t or _BT, block_c or (_BC_ONE_SEQ if one_seq else _BC)
        conv_blocks = triton.cdiv(C, bc)
        _kda_chunk_prep_kernel[(triton.cdiv(T, bt), conv_blocks + triton.cdiv(P, bc))](
            qkv, qkv.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), slots, conv_idx, conv_weight,
            y, f, f.stride(0), b, b.stride(0), A_log, dt_bias, g, beta,
            0.0 if lower_bound is None else float(lower_bound), T, C, slots.shape[0] * (W - 1), conv_blocks,
            W=W, WP=triton.next_power_of_2(W), H=H, D=D, BT=bt, BC=bc, BH=triton.next_power_of_2(H),
            USE_LOWER_BOUND=lower_bound is not None,
            ONE_SEQ=one_seq, num_warps=num_warps or 4,
        )
    return y, g, beta
