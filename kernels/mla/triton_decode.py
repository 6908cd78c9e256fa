"""MLA decode (Triton): absorbed attention over the paged latent cache, flash-decoding style.

Every head of a sequence attends to the same latent entries [c (L) ; k_pe (R)] (MQA over one
576-wide head), so a program owns a block of BLOCK_H heads (all 32 of Kimi's at TP 1) and reads
each KV tile once for all of them. The "tokens" layout puts the tile's tokens on the
dot's M dimension: scores^T = [c ; k_pe] [BLOCK_N, L+R] x q^T [L+R, BLOCK_H] and
acc^T [L, BLOCK_H] += c^T [L, BLOCK_N] x p^T [BLOCK_N, BLOCK_H], both reading the tile from shared
memory, so with BLOCK_N = 64 both dots lower to Hopper wgmma (with 32 heads on M, as in the
"heads" layout, M < 64 and Triton falls back to mma.sync). Accumulation is fp32.

Loads: the tile rows are gathered through the block table (a tile may straddle pages), which
defeats Triton's pipeliner at useful depths (it keeps one or two buffers and issues the next copy
after the dots, so memory and math do not overlap). PREFETCH instead carries the next tile in
registers: its loads are issued during the current tile's math (after its score dot, or before it),
and the page ids are fetched one tile further ahead so the prefetch never waits on the table.

The context is split into num_splits ranges (grid axis 2) so that small batches still fill the
GPU. The split length ceil(seq_len / num_splits), rounded up to whole tiles, is computed inside the
kernel from seq_lens, so one launch (and one CUDA graph) serves any lengths. Each split writes its
normalized partial output and log2-sum-exp; splits past the end write a neutral partial (output 0,
lse -inf). A second small kernel merges the partials exactly (log-sum-exp weights). (Only the
"heads" kernel writes the output directly when num_splits == 1.) num_splits is a runtime
argument, so graphs captured with different split counts share the compiled kernels.

The default launch is the paged kernel of triton_decode_paged.py (page-aligned tiles, so Triton
keeps the next tile's copy in flight during the math); the gathered-row kernels here are the
fallback (paged=False). `mla_decode_config` picks the launch (kernel, layout, tiles, warps, stages,
splits) from batch size, heads and context; the oracle is `ref.py::mla_decode_ref`. A seq_len of 0 is a padding row and
gives a zero output.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs, poison_like
from k3rt.kernels.mla.gluon_decode import GLUON_LAYOUTS, PIPELINES, TOKENS_BLOCK_N, gluon_block_h, launch_gluon_decode
from k3rt.kernels.mla.triton_decode_paged import (
    _mla_decode_balanced_combine_kernel, _mla_decode_balanced_kernel, _mla_decode_paged_kernel,
)
from k3rt.kernels.mla.triton_decode_tma import _mla_decode_tma_kernel

_LOG2E = 1.4426950408889634
# A split also writes BLOCK_H*L fp32 of partial output (64 KB at Kimi's shape, about 57 tokens of
# KV), so splits shorter than this spend more on partials than they gain in parallelism.
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 256
COMBINE_SPLITS = 32  # the combine's splits a step (past it, with wide_combine, all MAX_SPLITS in one pass)
# The balanced schedule keeps every sequence's length in each program's registers (N_P2 of them).
MAX_BALANCED_BATCH = 1024


@triton.jit
def _split_range(seq_lens_ptr, i_n, i_s, num_splits, BLOCK_N: tl.constexpr):
    """Token range [start, end) of split i_s of sequence i_n: equal shares rounded up to whole tiles."""
    seq_len = tl.load(seq_lens_ptr + i_n)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = i_s * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _tile_pages(bt_row, pos, end, block_size):
    """Page id of each token position of a tile (0 at positions >= end, which load nothing)."""
    return tl.load(bt_row + pos // block_size, mask=pos < end, other=0)


@triton.jit
def _load_tile(kv_ptr, pages, pos, end, block_size, L: tl.constexpr, R: tl.constexpr):
    """The tile's latent rows: c [BLOCK_N, L] and k_pe [BLOCK_N, R], zeros at positions >= end."""
    rows = kv_ptr + (pages.to(tl.int64) * block_size + pos % block_size) * (L + R)
    mask = (pos < end)[:, None]
    c = tl.load(rows[:, None] + tl.arange(0, L)[None, :], mask=mask, other=0.0)
    pe = tl.load(rows[:, None] + L + tl.arange(0, R)[None, :], mask=mask, other=0.0)
    return c, pe


# not specialized per step (kernels/common.py, Compiles): the table's width (longest context) and the split count vary
# per step; table and lengths are views of the packed step
@triton.jit(
    do_not_specialize=["stride_bt_n", "num_splits"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"],
)
def _mla_decode_split_tokens_kernel(
    q_ptr, stride_q_n, stride_q_h,  # [N, H, L+R]
    kv_ptr,  # [num_pages, block_size, L+R], contiguous
    block_table_ptr, stride_bt_n,  # [N, max_blocks] int32
    seq_lens_ptr,  # [N] int32
    part_ptr,  # [N, S, H, L] partial outputs, fp32 or q's dtype (also for one split: see the launcher)
    lse_ptr,  # [N, S, H] fp32
    qk_scale,  # scale * log2(e)
    H,
    block_size,
    num_splits,  # S, a runtime value: a new split count needs no recompile
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,  # 0: load in the iteration (Triton pipelines); 1: next tile after the
    #                          score dot; 2: next tile before the score dot
):
    i_n = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_t = tl.arange(0, BLOCK_N)

    if USE_PDL:
        gdc_wait()  # q and the current token's cache entry come from the previous kernels
    start, end = _split_range(seq_lens_ptr, i_n, i_s, num_splits, BLOCK_N)
    bt_row = block_table_ptr + i_n.to(tl.int64) * stride_bt_n
    if PREFETCH > 0:
        c_next, pe_next = _load_tile(kv_ptr, _tile_pages(bt_row, start + offs_t, end, block_size),
                                     start + offs_t, end, block_size, L, R)
        pages_next = _tile_pages(bt_row, start + BLOCK_N + offs_t, end, block_size)

    # q^T: heads on the dots' N dimension
    q_cols = q_ptr + i_n.to(tl.int64) * stride_q_n + offs_h[None, :] * stride_q_h
    qt_c = tl.load(q_cols + tl.arange(0, L)[:, None], mask=mask_h[None, :], other=0.0)  # [L, BLOCK_H]
    qt_pe = tl.load(q_cols + L + tl.arange(0, R)[:, None], mask=mask_h[None, :], other=0.0)  # [R, BLOCK_H]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([L, BLOCK_H], dtype=tl.float32)
    # Every tile starts before `end`, so each holds at least one live token and m_i is finite
    # after the first one.
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_t
        if PREFETCH > 0:
            c = c_next
            pe = pe_next
        else:
            c, pe = _load_tile(kv_ptr, _tile_pages(bt_row, pos, end, block_size), pos, end, block_size, L, R)
        if PREFETCH == 2:
            c_next, pe_next = _load_tile(kv_ptr, pages_next, pos + BLOCK_N, end, block_size, L, R)
            pages_next = _tile_pages(bt_row, pos + 2 * BLOCK_N, end, block_size)
        s = tl.dot(c, qt_c, input_precision=DOT_PRECISION)
        s = tl.dot(pe, qt_pe, acc=s, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_H]
        if PREFETCH == 1:
            c_next, pe_next = _load_tile(kv_ptr, pages_next, pos + BLOCK_N, end, block_size, L, R)
            pages_next = _tile_pages(bt_row, pos + 2 * BLOCK_N, end, block_size)
        s = tl.where((pos < end)[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(c), p.to(c.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    if USE_PDL:
        gdc_launch_dependents()

    # empty range (padding row, or a split past the end): l_i == 0, acc == 0 -> output 0
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[None, :]
    row = (i_n.to(tl.int64) * num_splits + i_s) * H + offs_h  # [BLOCK_H] rows of [N, S, H]
    tl.store(part_ptr + row[:, None] * L + tl.arange(0, L)[None, :], tl.trans(o).to(part_ptr.dtype.element_ty),
             mask=mask_h[:, None])
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + row, lse, mask=mask_h)


# not specialized per step (kernels/common.py, Compiles): the table's width (longest context) and the split count vary
# per step; table and lengths are views of the packed step
@triton.jit(
    do_not_specialize=["stride_bt_n", "num_splits"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"],
)
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
    """layout="heads" (the launch before the tokens layout; tests/kernels/test_mla_sm90_build.py builds
    it): heads on the dots' M (mma.sync at 32 heads), loads pipelined by Triton (num_stages)."""
    i_n = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)

    if USE_PDL:
        gdc_wait()  # q and the current token's cache entry come from the previous kernels
    start, end = _split_range(seq_lens_ptr, i_n, i_s, num_splits, BLOCK_N)

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
        tl.store(o_ptr + row[:, None] * L + offs_l[None, :], o.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=mask_h)


# not specialized per step (kernels/common.py, Compiles): the split count varies per step
@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_combine_kernel(
    part_ptr,  # [N, S, H, L] fp32, or the output's dtype (partial_dtype="input")
    lse_ptr,  # [N, S, H] fp32, log2 domain
    o_ptr, stride_o_n, stride_o_h,  # [N, H, L]
    H,
    num_splits,
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,  # a program merges BLOCK_L columns of one head (grid axis 2 covers L)
    BLOCK_S: tl.constexpr,  # splits per loop iteration (fixed: no constexpr follows the step's split count)
    USE_PDL: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    if USE_PDL:
        gdc_wait()
    base = i_n.to(tl.int64) * num_splits * H + i_h  # row (n, s=0, h); split s adds s*H
    # One pass over the splits in BLOCK_S chunks (a fixed constexpr: one sized by the split count made a binary per
    # power of two, i.e. a compile each time a longer context or another batch size changed the split count; k3-tiny
    # on the H200 inside a measured run of `k3rt bench spec`, session 16), the running max rescaling what is summed
    # so far: each chunk's lse and partial loads go out together, where a first pass for the max made every chunk's
    # lse load a dependent trip to memory before any partial was read (132 splits at batch 1 and 32K: 9 of them).
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        mask_s = ss < num_splits
        lse = tl.load(lse_ptr + base + ss * H, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
        part = tl.load(part_ptr + (base + ss * H)[:, None] * L + offs_l[None, :], mask=mask_s[:, None],
                       other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all splits so far empty: every weight 0
        alpha = tl.exp2(m - m_ref)  # 0 while m is -inf
        w = tl.exp2(lse - m_ref)
        denom = denom * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        m = m_new
    if USE_PDL:
        gdc_launch_dependents()
    o = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_ptr + i_n.to(tl.int64) * stride_o_n + i_h * stride_o_h + offs_l, o.to(o_ptr.dtype.element_ty))


def _block_h(num_heads: int) -> int:
    # tl.dot needs N >= 16; past 32 heads the [L, BLOCK_H] fp32 accumulator no longer fits registers
    return min(32, max(16, triton.next_power_of_2(num_heads)))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def mla_decode_num_splits(batch_size: int, num_heads: int, max_context: int, num_sms: int | None = None,
                          max_waves: int = 2, block_h: int | None = None) -> int:
    """Splits per sequence so that batch_size * head_blocks * splits programs fill the GPU.

    Among grids of at most `max_waves` waves of num_sms programs, picks the one with the highest (wave
    efficiency x fill of the first wave), the fewest splits on ties; never splits below MIN_TOKENS_PER_SPLIT
    tokens of `max_context` (a hint: the longest context the launch will see). Two waves for the Triton kernels
    (two programs share an SM, so two waves run as one); one for the Gluon kernel (one program an SM: a second
    wave is a second round, and more splits only add partials to merge). block_h: heads a program (None: the
    Triton default's). A Python-only computation.
    """
    if num_sms is None:
        num_sms = _num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else 132
    base = max(1, batch_size) * triton.cdiv(num_heads, block_h or _block_h(num_heads))
    max_splits = max(1, min(MAX_SPLITS, max_context // MIN_TOKENS_PER_SPLIT))
    best, best_score = 1, 0.0
    for s in range(1, max_splits + 1):
        programs = base * s
        waves = triton.cdiv(programs, num_sms)
        if waves > max_waves and s > 1:
            break
        score = programs / (waves * num_sms) * min(1.0, programs / num_sms)
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


def gluon_num_splits(batch_size: int, num_heads: int, max_context: int, num_sms: int | None, gluon_layout: str,
                     block_h: int) -> int:
    """The Gluon kernel's splits where the caller gives none: one program an SM, so one wave (H100, session 42:
    16x32K at 8 splits 88.6 % of copy bandwidth, at the two-wave rule's 16 85.0 %; H200, session 44, tokens layout:
    82.7 against 81.0 %, 64x128K at 2 splits 98.5 against 95.9 at 4)."""
    return mla_decode_num_splits(batch_size, num_heads, max_context, num_sms, max_waves=1,
                                 block_h=gluon_block_h(gluon_layout, block_h))


_PREFETCH = {"none": 0, "after_scores": 1, "before_scores": 2}
_LAYOUTS = ("tokens", "heads")
_SCHEDULES = ("split", "balanced")
_PARTIAL_DTYPES = ("fp32", "input")


@dataclass(frozen=True)
class MlaDecodeConfig:
    """One launch of `mla_decode` (the combine's launch follows from num_splits)."""

    num_splits: int  # context splits per sequence (grid axis 2)
    layout: str = "tokens"  # "tokens": tile tokens on the dots' M (wgmma); "heads": heads on M
    block_n: int = 64  # tokens per KV tile
    block_h: int = 32  # heads per program (all of a sequence's heads read each tile once); 64 at 32 heads pads
    #                    the paged kernel's M to wgmma's 64 rows (8 warps: the fp32 accumulator needs two warpgroups)
    prefetch: str = "after_scores"  # "tokens" only: "none" (Triton's pipeliner, num_stages),
    #                                 "after_scores" / "before_scores" (next tile in registers)
    num_warps: int = 8
    num_stages: int = 1
    paged: bool = False  # page-aligned tiles, page ids carried one tile ahead (triton_decode_paged.py):
    #                      the KV copies then overlap the math; either layout, no register prefetch
    max_registers: int | None = None  # ptxas register cap per thread (Triton's maxnreg): at <= 128 with 8
    #                                   warps two programs share an SM, one's math hiding the other's loads
    schedule: str = "split"  # paged only. "split": num_splits equal ranges per sequence (grid N x S);
    #                          "balanced": num_splits work programs share all sequences' tiles evenly
    #                          (FlashMLA's schedule), so ragged lengths load every program alike
    partial_dtype: str = "fp32"  # the splits' normalized partial outputs: "fp32", or "input" (q's dtype: half
    #                              the bytes written and read back by the combine, 8.6 MB at batch 1 and 132
    #                              splits, for one more rounding of each partial before the exact merge)
    tma: bool = False  # paged split schedule only: KV tiles copied by TMA (triton_decode_tma.py) instead of
    #                    per-thread cp.async; needs block_size a multiple of block_n
    gluon: bool = False  # split schedule only: the Gluon kernel (gluon_decode.py, in gluon_layout: TMA ring of
    #                      num_stages KV tiles, one program an SM; layout/num_warps/prefetch unused, block_h used by
    #                      the tokens layout only); GPU only (sm_90+, bf16/fp16), block_size a multiple of block_n or
    #                      of half of it
    wide_combine: bool = True  # past 32 splits (small batches at long contexts) the combine merges up to MAX_SPLITS
    #                            in one pass over 32-column blocks (4x the programs) instead of 32-split steps: batch
    #                            1's 132 splits at 32K took five dependent steps, 10.8 of 35 us on the H100. H100
    #                            (benchmarks/RESULTS.md session 43): batch 1 at 8K / 32K / 128K 22.6 -> 18.6,
    #                            36.6 -> 29.3, 86.1 -> 77.6 us; at <= 32 splits the launch is the two-step one's
    gluon_pipeline: str = "serial"  # gluon only: how a tile's MMAs overlap (gluon_decode.PIPELINES): "serial",
    #                                 "pv" (p . c in flight through the next scores), "two_tile" (also the next
    #                                 tile's scores through this tile's softmax; num_stages >= 3)
    gluon_layout: str = "heads"  # gluon only: wgmma's M (gluon_decode.GLUON_LAYOUTS): "heads" (padded to 64, two
    #                              warpgroups), "tokens" (the tile's tokens for the scores, the latent columns for
    #                              p . c; block_h heads (16 or 32) on N unpadded, one warpgroup, 64-token tiles, serial)

    def __post_init__(self) -> None:
        if not isinstance(self.num_splits, int) or self.num_splits < 1:
            raise ValueError(f"num_splits must be an int >= 1, got {self.num_splits!r}")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {self.layout!r}")
        if self.prefetch not in _PREFETCH:
            raise ValueError(f"prefetch must be one of {tuple(_PREFETCH)}, got {self.prefetch!r}")
        _check_pow2(self.block_n, "block_n")
        _check_pow2(self.block_h, "block_h")
        if self.max_registers is not None and not (isinstance(self.max_registers, int)
                                                   and 24 <= self.max_registers <= 255):
            raise ValueError(f"max_registers must be an int in [24, 255] or None, got {self.max_registers!r}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
        if self.tma and not (self.paged and self.schedule == "split"):
            raise ValueError(f"tma=True needs paged=True and schedule='split', got paged={self.paged}, "
                             f"schedule={self.schedule!r}")
        if self.gluon and (self.schedule != "split" or self.tma):
            raise ValueError(f"gluon=True needs schedule='split' and tma=False (it copies by TMA itself), got "
                             f"schedule={self.schedule!r}, tma={self.tma}")
        if self.gluon_pipeline not in PIPELINES:
            raise ValueError(f"gluon_pipeline must be one of {PIPELINES}, got {self.gluon_pipeline!r}")
        if self.gluon_pipeline != "serial" and not self.gluon:
            raise ValueError(f"gluon_pipeline={self.gluon_pipeline!r} is a choice of the Gluon kernel: it needs "
                             f"gluon=True")
        if self.gluon_layout not in GLUON_LAYOUTS:
            raise ValueError(f"gluon_layout must be one of {GLUON_LAYOUTS}, got {self.gluon_layout!r}")
        if self.gluon_layout != "heads" and not self.gluon:
            raise ValueError(f"gluon_layout={self.gluon_layout!r} is a choice of the Gluon kernel: it needs gluon=True")
        if self.gluon_layout == "tokens" and self.block_h not in (16, 32):
            raise ValueError(f"gluon_layout='tokens' takes block_h 16 or 32 (wgmma's N), got {self.block_h}")
        if self.gluon_layout == "tokens" and (self.block_n != TOKENS_BLOCK_N or self.gluon_pipeline != "serial"):
            raise ValueError(f"gluon_layout='tokens' takes block_n={TOKENS_BLOCK_N} (wgmma's M) and gluon_pipeline="
                             f"'serial', got block_n={self.block_n}, gluon_pipeline={self.gluon_pipeline!r}")
        if self.gluon and self.gluon_pipeline == "two_tile" and self.num_stages < 3:
            raise ValueError(f"gluon_pipeline='two_tile' needs num_stages >= 3, got {self.num_stages}")
        if self.partial_dtype not in _PARTIAL_DTYPES:
            raise ValueError(f"partial_dtype must be one of {_PARTIAL_DTYPES}, got {self.partial_dtype!r}")
        if self.schedule == "balanced" and not self.paged:
            raise ValueError("schedule='balanced' needs paged=True (the gathered-row kernels split per sequence)")
        if self.paged and self.prefetch != "none":
            raise ValueError(f"paged tiles are pipelined by Triton (num_stages): prefetch must be 'none', "
                             f"got {self.prefetch!r}")


@functools.lru_cache(maxsize=256)
def mla_decode_config(batch_size: int, num_heads: int, max_context: int,
                      num_sms: int | None = None) -> MlaDecodeConfig:
    """The default launch for a batch: the paged kernel (triton_decode_paged.py) with heads on the dots'
    M, 32-token page-aligned tiles, 3 stages (two KV tiles in shared memory, one in flight during the
    math), 4 warps, all heads (up to 32) per program, and `mla_decode_num_splits`.

    4 warps and 110 KB of shared memory let two programs share an SM, so one's softmax and barriers
    overlap the other's copies and dots: the best of 15 launches on the H200 (benchmarks/RESULTS.md,
    2026-12-02: 65-71 % of copy bandwidth at batch >= 16 and context >= 32K, against 45 % for the
    gathered-row kernel; with 8 warps the same tiles ran at 40 %).

    Only the split count depends on the batch: the tiles, and so the order of the sums, do not, which
    the batch-invariant mode (one split) relies on. The gathered-row kernels stay selectable
    (paged=False) as the fallback.
    """
    return MlaDecodeConfig(
        num_splits=mla_decode_num_splits(batch_size, num_heads, max_context, num_sms),
        layout="heads",
        block_n=16 if INTERPRET else 32,  # the interpreter's cost grows with the tile
        block_h=_block_h(num_heads),
        prefetch="none",
        num_warps=4,
        num_stages=3,
        paged=True,
    )


def mla_decode_balanced_programs(num_heads: int, cfg: MlaDecodeConfig, num_sms: int | None = None) -> int:
    """Work programs per head block for the balanced schedule: one per program slot of the GPU (two per
    SM at 4 warps, the launch that fits two; else one), whatever the batch and lengths."""
    if num_sms is None:
        num_sms = _num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else 132
    per_sm = 2 if cfg.num_warps <= 4 else 1
    return max(1, per_sm * num_sms // triton.cdiv(num_heads, cfg.block_h))


def _mla_decode_balanced(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                         L: int, R: int, cfg: MlaDecodeConfig, out: Tensor, use_pdl: bool) -> Tensor:
    """The balanced schedule's two launches (triton_decode_paged.py): cfg.num_splits work programs per head
    block, each over an equal share of all sequences' tiles, then the merge of each sequence's partials."""
    N, H, _ = q.shape
    if N > MAX_BALANCED_BATCH:
        raise ValueError(f"schedule='balanced' takes at most {MAX_BALANCED_BATCH} sequences, got N={N}")
    P = cfg.num_splits
    block_size = kv_cache.shape[1]
    rows = P + N - 1  # program p's partial of sequence n is row p + n
    part = poison_like(torch.empty(rows, H, L, dtype=_partial_dtype(cfg, q), device=q.device))
    lse = poison_like(torch.empty(rows, H, dtype=torch.float32, device=q.device))
    pdl = use_pdl and not INTERPRET
    min_tiles = triton.cdiv(MIN_TOKENS_PER_SPLIT, cfg.block_n)
    n_p2 = triton.next_power_of_2(N)
    meta = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(use_pdl))
    if cfg.max_registers is not None and not INTERPRET:
        meta["maxnreg"] = cfg.max_registers
    _mla_decode_balanced_kernel[(P, triton.cdiv(H, cfg.block_h))](
        q, q.stride(0), q.stride(1), kv_cache, block_table, block_table.stride(0), seq_lens, part, lse,
        float(scale) * _LOG2E, N, H, block_size, min_tiles,
        L=L, R=R, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, N_P2=n_p2,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        HEADS_ON_M=cfg.layout == "heads", **meta)
    p_p2 = triton.next_power_of_2(P)
    block_l = min(L, 128)
    _mla_decode_balanced_combine_kernel[(N, H, L // block_l)](
        part, lse, out, out.stride(0), out.stride(1), seq_lens, N, H, block_size, P, min_tiles,
        L=L, BLOCK_L=block_l, BLOCK_N=cfg.block_n, N_P2=n_p2, P_P2=p_p2, BLOCK_S=min(16, p_p2),
        USE_PDL=pdl, num_warps=4, **pdl_kwargs(use_pdl),
    )
    return out


def _partial_dtype(cfg: MlaDecodeConfig, q: Tensor) -> torch.dtype:
    return torch.float32 if cfg.partial_dtype == "fp32" else q.dtype


def _check_pow2(value: int, name: str) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
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
    layout: str | None = None,
    prefetch: str | None = None,
    paged: bool | None = None,
    max_registers: int | None = None,
    schedule: str | None = None,
    partial_dtype: str | None = None,
    tma: bool | None = None,
    gluon: bool | None = None,
    gluon_pipeline: str | None = None,
    gluon_layout: str | None = None,
    wide_combine: bool | None = None,
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
            uses `mla_decode_num_splits` with max_blocks * block_size as the context hint. With
            schedule="balanced": the work programs per head block (None: `mla_decode_balanced_programs`).
        out: optional preallocated contiguous [N, H, L] output in q's dtype.
        use_pdl: launch with programmatic dependent launch (GPU only).
        block_n, block_h, num_warps, num_stages, layout, prefetch, paged, max_registers, schedule,
        partial_dtype, tma, gluon, gluon_pipeline, gluon_layout, wide_combine: tuning overrides of `mla_decode_config`'s
            choice (see `MlaDecodeConfig`).

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
    cfg = mla_decode_config(N, H, block_table.shape[1] * block_size, _num_sms(q.device.index) if q.is_cuda else None)
    overrides = dict(num_splits=num_splits, block_n=block_n, block_h=block_h, num_warps=num_warps,
                     num_stages=num_stages, layout=layout, prefetch=prefetch, paged=paged,
                     max_registers=max_registers, schedule=schedule, partial_dtype=partial_dtype, tma=tma,
                     gluon=gluon, gluon_pipeline=gluon_pipeline, gluon_layout=gluon_layout,
                     wide_combine=wide_combine)
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if cfg.gluon and num_splits is None:
        cfg = replace(cfg, num_splits=gluon_num_splits(N, H, block_table.shape[1] * block_size,
                                                       _num_sms(q.device.index) if q.is_cuda else None,
                                                       cfg.gluon_layout, cfg.block_h))
    if out is None:
        out = poison_like(torch.empty(N, H, L, dtype=q.dtype, device=q.device))
    else:
        check(out, "out", (N, H, L), q.dtype)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    if N == 0:
        return out
    if cfg.schedule == "balanced":
        if num_splits is None:  # the split heuristic's count means splits per sequence: here, programs
            cfg = replace(cfg, num_splits=mla_decode_balanced_programs(
                H, cfg, _num_sms(q.device.index) if q.is_cuda else None))
        return _mla_decode_balanced(q, kv_cache, block_table, seq_lens, scale, L, R, cfg, out, use_pdl)

    S = cfg.num_splits
    # The tokens kernel always writes partials: its direct-output epilogue (the bf16 convert) spilled
    # registers at the 48B shape, so one split also goes through the combine (64 KB per sequence).
    direct = S == 1 and cfg.layout == "heads" and not cfg.paged and not cfg.gluon
    if direct:
        part, lse = out, out  # lse unused: the kernel writes the output directly
    else:
        part = poison_like(torch.empty(N, S, H, L, dtype=_partial_dtype(cfg, q), device=q.device))
        lse = poison_like(torch.empty(N, S, H, dtype=torch.float32, device=q.device))
    pdl = use_pdl and not INTERPRET
    args = (q, q.stride(0), q.stride(1), kv_cache, block_table, block_table.stride(0), seq_lens,
            part, out.stride(0), out.stride(1), lse, float(scale) * _LOG2E, H, block_size, S)
    meta = dict(L=L, R=R, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_PDL=pdl,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(use_pdl))
    if cfg.max_registers is not None and not INTERPRET:  # a compile option: the interpreter has no registers
        meta["maxnreg"] = cfg.max_registers
    grid = (N, triton.cdiv(H, cfg.block_h), S)
    if cfg.gluon:
        launch_gluon_decode(q, kv_cache, block_table, seq_lens, float(scale) * _LOG2E, part, lse, S, cfg.block_n,
                            cfg.num_stages, cfg.gluon_pipeline, cfg.gluon_layout, cfg.block_h)
    elif cfg.tma:
        if block_size % cfg.block_n:
            raise ValueError(f"tma=True needs kv_cache's block_size ({block_size}) to be a multiple of block_n "
                             f"({cfg.block_n}): a TMA box has no row mask, so tiles must not straddle pages")
        rows = kv_cache.view(-1, L + R)  # the pool as token rows; the boxes start at page * block_size + offset
        descs = (TensorDescriptor.from_tensor(rows[:, :L], [cfg.block_n, L]),
                 TensorDescriptor.from_tensor(rows[:, L:], [cfg.block_n, R]))
        args = args[:4] + descs + args[4:8] + args[10:]  # no output strides: partials only
        _mla_decode_tma_kernel[grid](*args, HEADS_ON_M=cfg.layout == "heads", **meta)
    elif cfg.paged:
        args = args[:8] + args[10:]  # no output strides: partials only
        _mla_decode_paged_kernel[grid](*args, HEADS_ON_M=cfg.layout == "heads", **meta)
    elif cfg.layout == "tokens":
        args = args[:8] + args[10:]  # no output strides: partials only
        _mla_decode_split_tokens_kernel[grid](*args, PREFETCH=_PREFETCH[cfg.prefetch], **meta)
    else:
        _mla_decode_split_kernel[grid](*args, WRITE_OUT=direct, **meta)
    if not direct:
        # wide_combine: past 32 splits one pass over up to MAX_SPLITS (see MlaDecodeConfig); two fixed binaries,
        # never one per split count
        wide = cfg.wide_combine and S > COMBINE_SPLITS
        block_s, block_l = (MAX_SPLITS, min(L, 32)) if wide else (COMBINE_SPLITS, min(L, 128))
        _mla_decode_combine_kernel[(N, H, L // block_l)](
            part, lse, out, out.stride(0), out.stride(1), H, S,
            L=L, BLOCK_L=block_l, BLOCK_S=block_s,
            USE_PDL=pdl, num_warps=4, **pdl_kwargs(use_pdl),
        )
    return out
