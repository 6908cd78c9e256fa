"""Row-index windows over a packed varlen step, read in place: the store of new conv windows into the cache.

The GPU runner's general KDA form names every row's conv window as rows of ext = [the sequences' cached
windows ; the step's pre-conv rows] (backend/runner/gpu/step.py conv_idx, conv_tail_idx, snap_conv_idx). The
torch references (`ref.causal_conv1d_rows`, `ref.conv_windows_store`) build ext; the kernels read the cached
rows straight from their slots instead (`_ext_rows`, which the conv of `kda.triton_prep` shares):
  `conv_windows_store_fwd`: one program per (window, block of channels) loads its W-1 rows, then stores them to
    its destination slot. A window reads only its own sequence's cached rows, so the new windows of distinct
    sequences never race; snapshot windows must be stored before the sequences' new windows overwrite the
    rows they read (two calls), and every conv reading the cached rows must run before.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import INTERPRET


_BC = 256 if INTERPRET else 128  # channels per program (the interpreter's cost is per program)


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


# not specialized per step (kernels/common.py, Compiles): num_old: the step's sequences times W-1; slots, idx, dest:
# views of the packed step
@triton.jit(do_not_specialize=["num_old"], do_not_specialize_on_alignment=["slot_ptr", "idx_ptr", "dest_ptr"])
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


def check_rows(x: Tensor, conv_state: Tensor, slots: Tensor, idx: Tensor, cols: int, idx_name: str,
               extra_col: bool = False) -> None:
    """The checks of a call over row-index windows, each error naming the argument (extra_col: idx holds the
    row itself after its W-1 window rows, the conv's; else only the W-1, a stored window's)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with a contiguous last dim, got {list(x.shape)} strides {x.stride()}")
    C = x.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[2] != C or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state must be [S, W-1, C={C}] with a contiguous last dim, got "
                         f"{list(conv_state.shape)} strides {conv_state.stride()}")
    if conv_state.shape[1] != cols - extra_col:
        raise ValueError(f"conv_state holds W-1={conv_state.shape[1]} rows per slot, {idx_name} has {cols} columns")
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 [B], got {slots.dtype} {list(slots.shape)}")
    if idx.dim() != 2 or idx.dtype != torch.int64 or not idx.is_contiguous():
        raise ValueError(f"{idx_name} must be contiguous int64 [rows, {cols}], got {idx.dtype} {list(idx.shape)}")


def conv_windows_store_fwd(x: Tensor, conv_state: Tensor, slots: Tensor, idx: Tensor, dest: Tensor) -> None:
    """`ref.conv_windows_store` in one launch: conv_state[dest[m]] = ext[idx[m]] for idx [M, W-1] int64, dest [M].
    The destinations must not hold rows another window of the same call reads (module docstring)."""
    W1 = conv_state.shape[1] if conv_state.dim() == 3 else 0
    check_rows(x, conv_state, slots, idx, W1, "idx")
    if dest.shape != (idx.shape[0],) or dest.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"dest must be int32/int64 [M={idx.shape[0]}], got {dest.dtype} {list(dest.shape)}")
    C = x.shape[1]
    if idx.shape[0]:
        _conv_windows_store_kernel[(idx.shape[0], triton.cdiv(C, _BC))](
            x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), slots, idx, dest,
            C, slots.shape[0] * W1, W1=W1, BW=triton.next_power_of_2(W1), BC=_BC,
        )
