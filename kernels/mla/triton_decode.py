"""MLA decode (Triton): absorbed attention over the paged latent cache, flash-decoding style.

Every head of a sequence attends to the same latent entries [c (L) ; k_pe (R)] (MQA over one
576-wide head), so a program owns a block of BLOCK_H heads and loads each KV tile once for all of
them: scores are a tensor-core dot [BLOCK_H, L+R] x [L+R, BLOCK_N] and the value product
[BLOCK_H, BLOCK_N] x [BLOCK_N, L] reuses the c part of the same tile. Accumulation is fp32.

The context is split into num_splits ranges (grid axis 2) so that small batches still fill the
GPU. The split length ceil(seq_len / num_splits), rounded up to whole tiles, is computed inside the
kernel from seq_lens, so one launch (and one CUDA graph) serves any lengths. Each split writes its
normalized partial output and log2-sum-exp; splits past the end write a neutral partial (output 0,
lse -inf). A second small kernel combines the partials. With num_splits == 1 the first kernel
writes the output directly and no combine runs. num_splits is a runtime argument, so graphs
captured with different split counts share two compiled variants (plus one combine per power of 2).

The oracle is `ref.py::mla_decode_ref`. A seq_len of 0 is a padding row and gives a zero output.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs, poison_like

_LOG2E = 1.4426950408889634
# A split also writes BLOCK_H*L fp32 of partial output (64 KB at Kimi's shape, about 57 tokens of
# KV), so splits shorter than this spend more on partials than they gain in parallelism.
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 256


@triton.jit
def _mla_decode_split_kernel(
    q_ptr, stride_q_n, stride_q_h,  # [N, H, L+R]
    kv_ptr,  # [num_pages, block_size, L+R], contiguous
    block_table_ptr, stride_bt_n,  # [N, max_blocks] int32
    seq_lens_ptr,  # [N] int32
    o_ptr, stride_o_n, stride_o_h,  # WRITE_OUT: out [N, H, L]; else partial [N, S, H, L] fp32
    lse_ptr,  # [N, S, H] fp32 (partials only)
    qk_scale,  # scale * log2(e)
    H,
    block_size,
    num_splits,  # S, a runtime value: a new split count needs no recompile
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_OUT: tl.constexpr,  # num_splits == 1: normalize and store the output directly
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)

    if USE_PDL:
        gdc_wait()  # q and the current token's cache entry come from the previous kernels
    seq_len = tl.load(seq_lens_ptr + i_n)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = i_s * chunk
    end = tl.minimum(start + chunk, seq_len)

    q_rows = q_ptr + i_n.to(tl.int64) * stride_q_n + offs_h[:, None] * stride_q_h
    q_c = tl.load(q_rows + offs_l[None, :], mask=mask_h[:, None], other=0.0)  # [BLOCK_H, L]
    q_pe = tl.load(q_rows + L + offs_r[None, :], mask=mask_h[:, None], other=0.0)  # [BLOCK_H, R]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
    bt_row = block_table_ptr + i_n.to(tl.int64) * stride_bt_n
    # Every tile starts before `end`, so each holds at least one live token and m_i is finite
    # after the first one.
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        # a tile may straddle pages (block_size need not be a multiple of BLOCK_N): page per row
        page = tl.load(bt_row + pos // block_size, mask=mask_n, other=0).to(tl.int64)
        rows = kv_ptr + (page * block_size + pos % block_size) * (L + R)  # [BLOCK_N]
        c = tl.load(rows[:, None] + offs_l[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, L]
        pe = tl.load(rows[:, None] + L + offs_r[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, R]
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    if USE_PDL:
        gdc_launch_dependents()

    # empty range (padding row, or a split past the end): l_i == 0, acc == 0 -> output 0
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if WRITE_OUT:
        o_rows = o_ptr + i_n.to(tl.int64) * stride_o_n + offs_h[:, None] * stride_o_h
        tl.store(o_rows + offs_l[None, :], o.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])
    else:
        row = (i_n.to(tl.int64) * num_splits + i_s) * H + offs_h  # [BLOCK_H] rows of [N, S, H]
        tl.store(o_ptr + row[:, None] * L + offs_l[None, :], o, mask=mask_h[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=mask_h)


@triton.jit
def _mla_decode_combine_kernel(
    part_ptr,  # [N, S, H, L] fp32
    lse_ptr,  # [N, S, H] fp32, log2 domain
    o_ptr, stride_o_n, stride_o_h,  # [N, H, L]
    H,
    num_splits,
    L: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # next_power_of_2(num_splits)
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_l = tl.arange(0, L)
    if USE_PDL:
        gdc_wait()
    base = i_n.to(tl.int64) * num_splits * H + i_h  # row (n, s=0, h); split s adds s*H
    offs_s = tl.arange(0, SPLITS_P2)
    lse = tl.load(lse_ptr + base + offs_s * H, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: every weight is 0, output 0
    denom = tl.sum(tl.exp2(lse - m), axis=0)
    acc = tl.zeros([L], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        mask_s = ss < num_splits
        w = tl.exp2(tl.load(lse_ptr + base + ss * H, mask=mask_s, other=float("-inf")) - m)  # [BLOCK_S]
        part = tl.load(part_ptr + (base + ss * H)[:, None] * L + offs_l[None, :], mask=mask_s[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    if USE_PDL:
        gdc_launch_dependents()
    o = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_ptr + i_n.to(tl.int64) * stride_o_n + i_h * stride_o_h + offs_l, o.to(o_ptr.dtype.element_ty))


def _block_h(num_heads: int) -> int:
    # tl.dot needs M >= 16; past 32 heads the [BLOCK_H, L] fp32 accumulator no longer fits registers
    return min(32, max(16, triton.next_power_of_2(num_heads)))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def mla_decode_num_splits(batch_size: int, num_heads: int, max_context: int, num_sms: int | None = None) -> int:
    """Splits per sequence so that batch_size * head_blocks * splits programs fill the GPU.

    Among grids of at most two waves, picks the one with the highest (wave efficiency x fill of
    the first wave), the fewest splits on ties; never splits below MIN_TOKENS_PER_SPLIT tokens of
    `max_context` (a hint: the longest context the launch will see). A Python-only computation.
    """
    if num_sms is None:
        num_sms = _num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else 132
    base = max(1, batch_size) * triton.cdiv(num_heads, _block_h(num_heads))
    max_splits = max(1, min(MAX_SPLITS, max_context // MIN_TOKENS_PER_SPLIT))
    best, best_score = 1, 0.0
    for s in range(1, max_splits + 1):
        programs = base * s
        waves = triton.cdiv(programs, num_sms)
        if waves > 2 and s > 1:
            break
        score = programs / (waves * num_sms) * min(1.0, programs / num_sms)
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


def _check_pow2(value: int, name: str) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of 2 >= 16, got {value}")


def mla_decode(
    q: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    *,
    kv_lora_rank: int,
    num_splits: int | None = None,
    out: Tensor | None = None,
    use_pdl: bool = False,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """Absorbed MLA decode, one query token per sequence, over the paged latent cache.

    CUDA-graph safe: no host synchronization; all sizes come from shapes and Python ints.

    Args:
        q: [N, H, L+R] absorbed queries [q_nope @ W_UK ; q_pe] (bf16/fp16/fp32; last dim contiguous).
        kv_cache: [num_pages, block_size, L+R] contiguous latent entries [c ; k_pe], q's dtype.
            Token p of sequence n is kv_cache[block_table[n, p // block_size], p % block_size].
        block_table: [N, max_blocks] int32 (last dim contiguous).
        seq_lens: [N] int32 context lengths including the current token (already in the cache);
            0 marks a padding row (zero output). Must not exceed max_blocks * block_size.
        scale: softmax scale ((P+R)^-0.5 for Kimi).
        kv_lora_rank: L; L and R = q.shape[-1] - L must be powers of 2 >= 16.
        num_splits: context splits per sequence (a Python int, fixed per launch / graph). None
            uses `mla_decode_num_splits` with max_blocks * block_size as the context hint.
        out: optional preallocated contiguous [N, H, L] output in q's dtype.
        use_pdl: launch with programmatic dependent launch (GPU only).
        block_n, block_h, num_warps, num_stages: tuning overrides (tokens and heads per tile, a
            power of 2 >= 16 each; launch config).

    Returns:
        out: [N, H, L] in q.dtype, softmax(scale * q·kv^T) · kv[:, :L] per head.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, L+R], got shape {list(q.shape)}")
    N, H, D = q.shape
    L, R = kv_lora_rank, D - kv_lora_rank
    _check_pow2(L, "kv_lora_rank")
    _check_pow2(R, "q.shape[-1] - kv_lora_rank (the rope dim R)")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must have a contiguous last dim, got strides {q.stride()}")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != D:
        raise ValueError(f"kv_cache must be [num_pages, block_size, L+R={D}], got {list(kv_cache.shape)}")
    if kv_cache.dtype != q.dtype or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous {q.dtype}, got {kv_cache.dtype} "
                         f"(contiguous={kv_cache.is_contiguous()})")
    if block_table.dim() != 2 or block_table.shape[0] != N:
        raise ValueError(f"block_table must be [N={N}, max_blocks], got {list(block_table.shape)}")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be int32 with a contiguous last dim, got {block_table.dtype} "
                         f"strides {block_table.stride()}")
    check(seq_lens, "seq_lens", (N,), torch.int32)
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    check_same_device(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens, out=out)
    block_size = kv_cache.shape[1]
    if num_splits is None:
        num_sms = _num_sms(q.device.index) if q.is_cuda else None
        num_splits = mla_decode_num_splits(N, H, block_table.shape[1] * block_size, num_sms)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if out is None:
        out = poison_like(torch.empty(N, H, L, dtype=q.dtype, device=q.device))
    else:
        check(out, "out", (N, H, L), q.dtype)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    if N == 0:
        return out

    block_h = block_h or _block_h(H)
    if block_n is None:
        block_n = 16 if INTERPRET else 32
    fp32 = q.dtype == torch.float32
    if num_splits == 1:
        part, lse = out, out  # lse unused: the kernel writes the output directly
    else:
        part = poison_like(torch.empty(N, num_splits, H, L, dtype=torch.float32, device=q.device))
        lse = poison_like(torch.empty(N, num_splits, H, dtype=torch.float32, device=q.device))
    _mla_decode_split_kernel[(N, triton.cdiv(H, block_h), num_splits)](
        q, q.stride(0), q.stride(1), kv_cache, block_table, block_table.stride(0), seq_lens,
        part, out.stride(0), out.stride(1), lse, float(scale) * _LOG2E, H, block_size, num_splits,
        L=L, R=R, BLOCK_H=block_h, BLOCK_N=block_n, WRITE_OUT=num_splits == 1,
        DOT_PRECISION="ieee" if fp32 else "tf32", USE_PDL=use_pdl and not INTERPRET,
        num_warps=num_warps or (4 if block_h <= 16 else 8), num_stages=num_stages or 2,
        **pdl_kwargs(use_pdl),
    )
    if num_splits > 1:
        splits_p2 = triton.next_power_of_2(num_splits)
        _mla_decode_combine_kernel[(N, H)](
            part, lse, out, out.stride(0), out.stride(1), H, num_splits,
            L=L, SPLITS_P2=splits_p2, BLOCK_S=min(8, splits_p2),
            USE_PDL=use_pdl and not INTERPRET, num_warps=4, **pdl_kwargs(use_pdl),
        )
    return out
