"""The short conv of a packed varlen step over row-index windows, and the windows' store into the cache.

The GPU runner's general KDA form names every row's conv window as rows of ext = [the sequences' cached
windows ; the step's pre-conv rows] (backend/runner/gpu/step.py conv_idx, conv_tail_idx, snap_conv_idx).
The torch reference (`ref.causal_conv1d_rows`, `ref.conv_windows_store`) builds ext and loops over the taps
(about fifteen launches per layer); these read the cached rows straight from their slots instead:
  `causal_conv1d_rows_fwd`: one program per (block of rows, block of channels), fp32 sum over the taps in order
    (cached rows rounded to x's dtype first, as the reference's ext holds them), SiLU, stored in x's dtype;
  `conv_windows_store_fwd`: one program per (window, block of channels) loads its W-1 rows, then stores them to its
    destination slot. A window reads only its own sequence's cached rows, so the new windows of distinct
    sequences never race; snapshot windows must be stored before the sequences' new windows overwrite the
    rows they read (two calls).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import poison_like

_BT = 16  # rows per conv program
_BC = 128  # channels per program


@triton.jit
def _ext_rows(x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, r, m_r, ch, m_c, num_old,
              W1: tl.constexpr):
    """Rows r of ext [len(r), len(ch)] fp32: cached rows (r < num_old, rounded to x's dtype) or rows of x."""
    old = r < num_old
    s = tl.load(slot_ptr + r // W1, mask=m_r & old, other=0).to(tl.int64)
    a = tl.load(cs_ptr + (s * stride_cs_s + (r % W1) * stride_cs_w)[:, None] + ch[None, :],
                mask=(m_r & old)[:, None] & m_c[None, :], other=0.0)
    b = tl.load(x_ptr + ((r - num_old) * stride_x)[:, None] + ch[None, :],
                mask=(m_r & ~old)[:, None] & m_c[None, :], other=0.0)
    return tl.where(old[:, None], a.to(x_ptr.dtype.element_ty).to(tl.float32), b.to(tl.float32))


@triton.jit
def _causal_conv1d_rows_fwd_kernel(
    x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, idx_ptr, w_ptr, y_ptr,
    T, C, num_old,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    m_r = rows < T
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = ch < C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for tap in tl.static_range(W):
        r = tl.load(idx_ptr + rows.to(tl.int64) * W + tap, mask=m_r, other=0)
        v = _ext_rows(x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, r, m_r, ch, m_c, num_old, W - 1)
        acc += v * tl.load(w_ptr + ch * W + tap, mask=m_c, other=0.0)[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + ch[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_r[:, None] & m_c[None, :])


@triton.jit
def _conv_windows_store_kernel(
    x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, idx_ptr, dest_ptr,
    C, num_old,
    W1: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BW)
    m_j = j < W1
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = ch < C
    r = tl.load(idx_ptr + m * W1 + j, mask=m_j, other=0)
    rows = _ext_rows(x_ptr, stride_x, cs_ptr, stride_cs_s, stride_cs_w, slot_ptr, r, m_j, ch, m_c, num_old, W1)
    d = tl.load(dest_ptr + m).to(tl.int64)
    tl.store(cs_ptr + d * stride_cs_s + (j * stride_cs_w)[:, None] + ch[None, :],
             rows.to(cs_ptr.dtype.element_ty), mask=m_j[:, None] & m_c[None, :])


def _check(x: Tensor, conv_state: Tensor, slots: Tensor, idx: Tensor, cols: int, idx_name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with a contiguous last dim, got {list(x.shape)} strides {x.stride()}")
    C = x.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[2] != C or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state must be [S, W-1, C={C}] with a contiguous last dim, got "
                         f"{list(conv_state.shape)} strides {conv_state.stride()}")
    if conv_state.shape[1] != cols - (idx_name == "idx"):
        raise ValueError(f"conv_state holds W-1={conv_state.shape[1]} rows per slot, {idx_name} has {cols} columns")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 [B], got {slots.dtype} {list(slots.shape)}")
    if idx.dim() != 2 or idx.dtype != torch.int64 or not idx.is_contiguous():
        raise ValueError(f"{idx_name} must be contiguous int64 [rows, {cols}], got {idx.dtype} {list(idx.shape)}")


def causal_conv1d_rows_fwd(x: Tensor, conv_state: Tensor, slots: Tensor, idx: Tensor, weight: Tensor) -> Tensor:
    """`ref.causal_conv1d_rows` in one launch: x [T, C], conv_state [S, W-1, C] (any slot stride), slots [B],
    idx [T, W] int64, weight [C, W] fp32 contiguous -> silu(conv) [T, C] in x.dtype. No host sync."""
    W = weight.shape[1] if weight.dim() == 2 else 0
    _check(x, conv_state, slots, idx, W, "idx")
    T, C = x.shape
    if weight.shape != (C, W) or weight.dtype != torch.float32 or not weight.is_contiguous() or W < 2:
        raise ValueError(f"weight must be contiguous fp32 [C={C}, W>=2], got {weight.dtype} {list(weight.shape)}")
    if idx.shape[0] != T:
        raise ValueError(f"idx must have T={T} rows, got {idx.shape[0]}")
    y = poison_like(torch.empty(T, C, dtype=x.dtype, device=x.device))
    if T:
        _causal_conv1d_rows_fwd_kernel[(triton.cdiv(T, _BT), triton.cdiv(C, _BC))](
            x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), slots, idx, weight, y,
            T, C, slots.shape[0] * (W - 1), W=W, BT=_BT, BC=_BC,
        )
    return y


def conv_windows_store_fwd(x: Tensor, conv_state: Tensor, slots: Tensor, idx: Tensor, dest: Tensor) -> None:
    """`ref.conv_windows_store` in one launch: conv_state[dest[m]] = ext[idx[m]] for idx [M, W-1] int64, dest [M].
    The destinations must not hold rows another window of the same call reads (module docstring)."""
    W1 = conv_state.shape[1] if conv_state.dim() == 3 else 0
    _check(x, conv_state, slots, idx, W1, "idx (windows)")
    if dest.shape != (idx.shape[0],) or dest.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dest must be int32/int64 [M={idx.shape[0]}], got {dest.dtype} {list(dest.shape)}")
    C = x.shape[1]
    if idx.shape[0]:
        _conv_windows_store_kernel[(idx.shape[0], triton.cdiv(C, _BC))](
            x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), slots, idx, dest,
            C, slots.shape[0] * W1, W1=W1, BW=triton.next_power_of_2(W1), BC=_BC,
        )
