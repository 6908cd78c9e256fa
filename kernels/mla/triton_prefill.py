"""MLA prefill / extend (Triton): expanded-form varlen causal attention, FlashAttention-2 style.

Per head the key is [k_nope_h (P) ; k_pe (R)] with k_pe shared by all heads, so the score is two
tensor-core dots (q_nope·k_nope + q_pe·k_pe) and k_pe is never expanded per head in memory. A
program owns BLOCK_M queries of one (sequence, head) and streams the keys it may see in BLOCK_N
tiles with an online softmax; accumulation is fp32.

Sequence i's len_q queries are the last len_q of its len_k keys (a cached prefix, then the new
tokens), so local query j sits at absolute position len_k - len_q + j. Key tiles wholly below the
query block's first position need no mask and run in a separate, mask-free loop; only the tiles
crossing the diagonal (and the end of the keys) are masked.

The oracle is `ref.py::mla_prefill_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from k3rt.kernels.common import INTERPRET, check, check_same_device, poison_like, tma_ok

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q_n, q_p, k_n, k_p, v, mask_s, qk_scale,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile [BLOCK_N] of the online softmax (k_n [BLOCK_N, P], k_p [BLOCK_N, R], v [BLOCK_N, V] loaded);
    mask_s: [BLOCK_M, BLOCK_N] visible (MASKED). The scale is folded into the exponent's multiply-add."""
    s = tl.dot(q_n, tl.trans(k_n), input_precision=DOT_PRECISION)
    s = tl.dot(q_p, tl.trans(k_p), acc=s, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] unscaled
    if MASKED:
        s = tl.where(mask_s, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_tile(kn_ptr, kpe_ptr, v_ptr, kn_base, kpe_base, v_base, stride_kn_t, stride_kpe_t, stride_v_t,
               row0, n0, i_h, offs_n, offs_p, offs_r, offs_v, len_k,
               P: tl.constexpr, R: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, TMA: tl.constexpr):
    """Keys n0 .. n0+BLOCK_N of the sequence whose first key row is row0. TMA: through the tensor descriptors
    (rows past the sequence are other sequences' finite rows or the descriptor's zero fill; the caller masks
    their scores); else pointer loads, masked past len_k when MASKED."""
    if TMA:
        k_n = kn_ptr.load([row0 + n0, i_h, 0]).reshape(BLOCK_N, P)
        k_p = kpe_ptr.load([row0 + n0, 0])
        v = v_ptr.load([row0 + n0, i_h, 0]).reshape(BLOCK_N, V)
    else:
        kk = (n0 + offs_n).to(tl.int64)
        kn_rows = kn_base + kk * stride_kn_t
        kpe_rows = kpe_base + kk * stride_kpe_t
        v_rows = v_base + kk * stride_v_t
        if MASKED:
            mask_k = (n0 + offs_n) < len_k
            k_n = tl.load(kn_rows[:, None] + offs_p[None, :], mask=mask_k[:, None], other=0.0)
            k_p = tl.load(kpe_rows[:, None] + offs_r[None, :], mask=mask_k[:, None], other=0.0)
            v = tl.load(v_rows[:, None] + offs_v[None, :], mask=mask_k[:, None], other=0.0)
        else:
            k_n = tl.load(kn_rows[:, None] + offs_p[None, :])  # [BLOCK_N, P]
            k_p = tl.load(kpe_rows[:, None] + offs_r[None, :])  # [BLOCK_N, R]
            v = tl.load(v_rows[:, None] + offs_v[None, :])  # [BLOCK_N, V]
    return k_n, k_p, v


# not specialized per step (kernels/common.py, Compiles): cu_q, cu_k: views of the packed step
@triton.jit(do_not_specialize_on_alignment=["cu_q_ptr", "cu_k_ptr"])
def _mla_prefill_kernel(
    q_ptr, stride_q_t, stride_q_h,  # [Tq, H, P+R]
    kn_ptr, stride_kn_t, stride_kn_h,  # [Tk, H, P]
    kpe_ptr, stride_kpe_t,  # [Tk, R]
    v_ptr, stride_v_t, stride_v_h,  # [Tk, H, V]
    o_ptr, stride_o_t, stride_o_h,  # [Tq, H, V]
    cu_q_ptr, cu_k_ptr,  # [B+1] int32
    qk_scale,  # scale * log2(e)
    P: tl.constexpr,
    R: tl.constexpr,
    V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    # the longest query blocks (most keys) launch first, so they do not form the tail
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_b = tl.program_id(1)
    i_h = tl.program_id(2)
    q_begin = tl.load(cu_q_ptr + i_b)
    len_q = tl.load(cu_q_ptr + i_b + 1) - q_begin
    k_begin = tl.load(cu_k_ptr + i_b)
    len_k = tl.load(cu_k_ptr + i_b + 1) - k_begin
    if i_m * BLOCK_M >= len_q:
        return
    offs_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < len_q
    offs_p = tl.arange(0, P)
    offs_r = tl.arange(0, R)
    offs_v = tl.arange(0, V)
    q_rows = q_ptr + (q_begin + offs_m).to(tl.int64) * stride_q_t + i_h * stride_q_h
    q_n = tl.load(q_rows[:, None] + offs_p[None, :], mask=mask_m[:, None], other=0.0)  # [BLOCK_M, P]
    q_p = tl.load(q_rows[:, None] + P + offs_r[None, :], mask=mask_m[:, None], other=0.0)  # [BLOCK_M, R]
    q_pos = (len_k - len_q) + offs_m  # absolute positions; rows past len_q see every key

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V], dtype=tl.float32)
    # keys below the block's first position are visible to every query in it
    first_pos = len_k - len_q + i_m * BLOCK_M
    full_end = (tl.minimum(first_pos, len_k) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(len_k, first_pos + BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    kn_base = kn_ptr
    kpe_base = kpe_ptr
    v_base = v_ptr
    if not TMA:  # descriptors take coordinates instead
        kn_base = kn_ptr + k_begin.to(tl.int64) * stride_kn_t + i_h * stride_kn_h
        kpe_base = kpe_ptr + k_begin.to(tl.int64) * stride_kpe_t
        v_base = v_ptr + k_begin.to(tl.int64) * stride_v_t + i_h * stride_v_h
    for n0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k_n, k_p, v = _load_tile(kn_ptr, kpe_ptr, v_ptr, kn_base, kpe_base, v_base, stride_kn_t, stride_kpe_t,
                                 stride_v_t, k_begin, n0, i_h, offs_n, offs_p, offs_r, offs_v, len_k,
                                 P, R, V, BLOCK_N, MASKED=False, TMA=TMA)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q_n, q_p, k_n, k_p, v, None, qk_scale,
                                     MASKED=False, DOT_PRECISION=DOT_PRECISION)
    # key 0 is visible to every row, so no row is fully masked before it has a finite max
    for n0 in range(full_end, hi, BLOCK_N):
        k_idx = n0 + offs_n
        mask_s = (k_idx[None, :] <= q_pos[:, None]) & (k_idx < len_k)[None, :]
        k_n, k_p, v = _load_tile(kn_ptr, kpe_ptr, v_ptr, kn_base, kpe_base, v_base, stride_kn_t, stride_kpe_t,
                                 stride_v_t, k_begin, n0, i_h, offs_n, offs_p, offs_r, offs_v, len_k,
                                 P, R, V, BLOCK_N, MASKED=True, TMA=TMA)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q_n, q_p, k_n, k_p, v, mask_s, qk_scale,
                                     MASKED=True, DOT_PRECISION=DOT_PRECISION)
    o = acc / l_i[:, None]
    o_rows = o_ptr + (q_begin + offs_m).to(tl.int64) * stride_o_t + i_h * stride_o_h
    tl.store(o_rows[:, None] + offs_v[None, :], o.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])


def _check_pow2(value: int, name: str) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of 2 >= 16, got {value}")


def mla_prefill(
    q: Tensor,
    k_nope: Tensor,
    k_pe: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    *,
    out: Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tma: bool = False,
    warp_specialize: bool = False,
) -> Tensor:
    """Expanded-form varlen causal MLA attention for prefill and extend.

    No host synchronization: the grid comes from shapes and max_seqlen_q.

    Args:
        q: [Tq, H, P+R] [q_nope ; q_pe] (bf16/fp16/fp32; last dim contiguous, rows may be strided).
        k_nope: [Tk, H, P], q's dtype, last dim contiguous.
        k_pe: [Tk, R], shared by all heads, q's dtype, last dim contiguous.
        v: [Tk, H, V], q's dtype, last dim contiguous. P, R and V must be powers of 2 >= 16.
        cu_seqlens_q, cu_seqlens_k: [B+1] int32 prefix sums; sequence i's queries are the last
            len_q of its len_k >= len_q keys (a cached prefix of len_k - len_q tokens first).
        max_seqlen_q: >= every len_q (query blocks past it are not computed).
        max_seqlen_k: >= every len_k (not needed by the kernel; kept for the varlen convention).
        scale: softmax scale ((P+R)^-0.5 for Kimi).
        out: optional preallocated [Tq, H, V] in q's dtype (last dim contiguous).
        block_m, block_n, num_warps, num_stages: tuning overrides.
        tma: load the key tiles through TMA tensor descriptors (needs an sm90+ GPU, 16-byte aligned bases and row
            strides; falls back to pointer loads otherwise). H200, 48B shape (benchmarks/RESULTS.md session 29):
            1.04-1.10x at 8K-32K tokens; the GPU runner passes KernelConfig.mla_prefill_tma (on).
            warp_specialize: ask Triton to warp-specialize the unmasked key loop (no gain measured: 1.00x
            alone, 1.02-1.05x with TMA against TMA's 1.04-1.09x; 4 warps fail to compile).

    Returns:
        out: [Tq, H, V] in q.dtype.
    """
    if q.dim() != 3 or k_nope.dim() != 3 or v.dim() != 3 or k_pe.dim() != 2:
        raise ValueError(f"expected q [Tq, H, P+R], k_nope [Tk, H, P], k_pe [Tk, R], v [Tk, H, V]; got "
                         f"{list(q.shape)}, {list(k_nope.shape)}, {list(k_pe.shape)}, {list(v.shape)}")
    Tq, H, D = q.shape
    Tk, _, P = k_nope.shape
    R, V = D - P, v.shape[2]
    for value, name in ((P, "k_nope.shape[-1] (P)"), (R, "q.shape[-1] - P (R)"), (V, "v.shape[-1] (V)")):
        _check_pow2(value, name)
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    check(k_nope, "k_nope", (Tk, H, P), q.dtype)
    check(k_pe, "k_pe", (Tk, R), q.dtype)
    check(v, "v", (Tk, H, V), q.dtype)
    for name, t in (("q", q), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    B = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_q.dim() != 1 or B < 0:
        raise ValueError(f"cu_seqlens_q must be [B+1], got {list(cu_seqlens_q.shape)}")
    check(cu_seqlens_q, "cu_seqlens_q", (B + 1,), torch.int32)
    check(cu_seqlens_k, "cu_seqlens_k", (B + 1,), torch.int32)
    if not (cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous()):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be contiguous")
    if max_seqlen_q < 0 or max_seqlen_k < max_seqlen_q:
        raise ValueError(f"need 0 <= max_seqlen_q <= max_seqlen_k, got {max_seqlen_q}, {max_seqlen_k}")
    check_same_device(q=q, k_nope=k_nope, k_pe=k_pe, v=v, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, out=out)
    if out is None:
        out = poison_like(torch.empty(Tq, H, V, dtype=q.dtype, device=q.device))
    else:
        check(out, "out", (Tq, H, V), q.dtype)
        if out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    if B == 0 or max_seqlen_q == 0 or H == 0:
        return out

    if block_m is None:
        block_m = 16 if INTERPRET else 128
    if block_n is None:
        block_n = 16 if INTERPRET else 64
    kn_arg, kpe_arg, v_arg = k_nope, k_pe, v
    use_tma = tma and tma_ok(k_nope, k_pe, v)
    if use_tma:
        kn_arg = TensorDescriptor(k_nope, list(k_nope.shape), list(k_nope.stride()), [block_n, 1, P])
        kpe_arg = TensorDescriptor(k_pe, list(k_pe.shape), list(k_pe.stride()), [block_n, R])
        v_arg = TensorDescriptor(v, list(v.shape), list(v.stride()), [block_n, 1, V])
    _mla_prefill_kernel[(triton.cdiv(max_seqlen_q, block_m), B, H)](
        q, q.stride(0), q.stride(1), kn_arg, k_nope.stride(0), k_nope.stride(1), kpe_arg, k_pe.stride(0),
        v_arg, v.stride(0), v.stride(1), out, out.stride(0), out.stride(1), cu_seqlens_q, cu_seqlens_k,
        float(scale) * _LOG2E, P=P, R=R, V=V, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TMA=use_tma, WARP_SPECIALIZE=warp_specialize,
        num_warps=num_warps or (4 if block_m <= 64 else 8), num_stages=num_stages or 3,
    )
    return out
