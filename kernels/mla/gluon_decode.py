"""MLA decode in Gluon (Triton's explicit-layout dialect): heads on wgmma's M, KV tiles by TMA into a ring of
shared buffers, every layout chosen by hand.

Why Gluon: the Triton kernels of triton_decode_paged.py stop at 64-71 % of copy bandwidth at batch >= 16 and
27 % at batch 1 (benchmarks/RESULTS.md, sessions 9-10), limited per tile, not per byte. What Triton decides
there and cannot be told otherwise (the sm_90 TTGIR of session 10):
- with heads on M padded to 64 rows (wgmma), a dot whose result feeds another dot gets all 8 warps along M,
  so both warpgroups compute the same 64 x BLOCK_N scores (three times the tensor work of one score dot);
- at 32 heads on M (mma.sync, the default) every warp reads all of q from shared memory for every tile and
  p goes through shared memory; 13 CTA barriers per tile;
- the pipeliner keeps one KV copy in flight at most with the tiles 576 wide.
Here each choice is written down:
- scores s [BLOCK_H, BLOCK_N] = q_c . c^T + q_pe . pe^T with warps [4, 2]: each warpgroup computes half of the
  tile's tokens (no duplicated score work); both operands from shared memory (q stored there once);
- the softmax's row max and sum cross the two warpgroups (one exchange through shared memory each);
- acc [BLOCK_H, L] += p . c with warps [4, 2]: each warpgroup owns 256 of the 512 latent columns (128 fp32
  registers a thread), p from registers, c straight from the KV buffer the score dot read (the MMA reads it
  N-major);
- KV tiles come by TMA (a box of c and one of k_pe, SUB rows each, one or two per tile, completed on the stage's
  mbarrier) into STAGES buffers: the next tiles stream in while tile i is multiplied. The page ids are loaded one
  refill ahead so the issuing warps never wait on the block table;
- how a tile's MMAs overlap each other and the softmax is the PIPELINE choice (PIPELINES below).
Heads are padded to BLOCK_H = 64 rows (wgmma's M), as FlashMLA pads: rows >= H hold zero queries and are not
stored. One program per SM (8 warps, ~184 KB of shared memory at 32-token tiles and 3 stages).

A box never straddles a page (block_size a multiple of SUB, the launcher checks); a tile of two boxes may. A TMA
box has no row mask, and rows past a sequence's end inside its page may hold anything (NaN included: 0 * NaN
poisons p . c), so the loop covers the split's full tiles and the sequence's partial last tile goes through masked pointer loads
stored into a free buffer. Split-KV exactly as the Triton kernels (equal shares of whole tiles; each split
writes its normalized partial and log2-sum-exp, `triton_decode._mla_decode_combine_kernel` merges them; a
split with no tiles writes the neutral partial (0, -inf)).

A second layout (`gluon_layout="tokens"`, _mla_decode_gluon_tokens_kernel, session 43) turns the dots around so no
MMA row is a padded head: the scores as s^T = c . q^T (the tile's 64 tokens on M, 16 or 32 heads on N), p . c as
acc^T [L, heads] += c^T . p^T (the latent columns on M: L a multiple of 64), one warpgroup, q in half the shared
memory; the ring, the page loads, the partial last tile and the partials are the heads layout's.

GPU only (sm_90+): Gluon has no interpreter. The oracle is ref.py::mla_decode_ref; the CPU suite builds it for
sm_90 (tests/kernels/test_mla_gluon.py) and the GPU tests run it against the oracle.
"""
from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GLUON_BLOCK_H = 64  # wgmma's M: the heads of a program, padded with zero queries past H
# How a tile's MMAs overlap (the kernel's PIPELINE is the index): "serial" waits for each; "pv" leaves a tile's
# p . c in flight through the next tile's score dots; "two_tile" also starts the next tile's scores before this
# tile's softmax, so the tensor cores work while the softmax runs (FlashAttention-3's in-warpgroup pipelining).
PIPELINES = ("serial", "pv", "two_tile")
# Which dimension of the dots is wgmma's M (the kernel's choice, `gluon_layout`): "heads" (heads padded to 64 rows,
# two warpgroups; _mla_decode_gluon_kernel) or "tokens" (the tile's 64 tokens on M for the scores and the 512 latent
# columns for p . c, the heads on N unpadded; one warpgroup; _mla_decode_gluon_tokens_kernel)
GLUON_LAYOUTS = ("heads", "tokens")
TOKENS_BLOCK_N = 64  # the tokens layout's tile: wgmma's M
# the runner's launch of it (KernelConfig.mla_gluon): the best of the nine on the H100 (benchmarks/RESULTS.md,
# session 42: 64-token tiles at 2 stages, serial, at or past the Triton default from 32K up, 3 points behind at 8K;
# pv and two_tile 8-15 points behind serial)
GLUON_LAUNCH = dict(gluon=True, block_n=64, num_stages=2, gluon_pipeline="serial")


@gluon.jit
def _tile_pages(bt_row, t, t_full, block_size, BLOCK_N: gl.constexpr, SUB: gl.constexpr):
    """The page ids of tile t's boxes (two when a tile is two boxes of SUB rows: it may straddle a page), 0 past
    the split's full tiles."""
    live = t < t_full
    page_a = gl.load(bt_row + (t * BLOCK_N) // block_size, mask=live, other=0)
    if BLOCK_N > SUB:
        page_b = gl.load(bt_row + (t * BLOCK_N + SUB) // block_size, mask=live, other=0)
    else:
        page_b = page_a
    return page_a, page_b


@gluon.jit
def _issue_tile(c_desc, pe_desc, c_buf, pe_buf, bar, page_a, page_b, t, block_size, BLOCK_N: gl.constexpr,
                SUB: gl.constexpr):
    """Start tile t's copies (c and k_pe boxes of SUB rows, each inside one page) into one stage, completing on
    bar."""
    mbarrier.expect(bar, (BLOCK_N // SUB) * (c_desc.block_type.nbytes + pe_desc.block_type.nbytes))
    for k in gl.static_range(BLOCK_N // SUB):
        if k == 0:
            page = page_a
        else:
            page = page_b
        pos = t * BLOCK_N + k * SUB
        row0 = page * block_size + pos % block_size
        if BLOCK_N > SUB:
            tma.async_copy_global_to_shared(c_desc, [row0, 0], bar, c_buf.slice(k * SUB, SUB))
            tma.async_copy_global_to_shared(pe_desc, [row0, 0], bar, pe_buf.slice(k * SUB, SUB))
        else:
            tma.async_copy_global_to_shared(c_desc, [row0, 0], bar, c_buf)
            tma.async_copy_global_to_shared(pe_desc, [row0, 0], bar, pe_buf)


@gluon.jit
def _refill(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, page_a, page_b, t, t_start, t_full, block_size,
            STAGES: gl.constexpr, BLOCK_N: gl.constexpr, SUB: gl.constexpr):
    """Issue tile t (when it is one of the split's full tiles) into its stage of the ring, from the page ids loaded
    one refill ahead; the page ids of tile t + 1."""
    if t < t_full:
        jn = (t - t_start) % STAGES
        _issue_tile(c_desc, pe_desc, c_ring.index(jn), pe_ring.index(jn), bars.index(jn), page_a, page_b, t,
                    block_size, BLOCK_N, SUB)
    return _tile_pages(bt_row, t + 1, t_full, block_size, BLOCK_N, SUB)


@gluon.jit
def _split_tiles(seq_lens_ptr, i_n, i_s, num_splits, BLOCK_N: gl.constexpr):
    """Split i_s's share of sequence i_n: its tiles [t_start, t_end), the first tile holding rows past the end
    (t_full: tiles before it hold only live rows) and its count of full tiles."""
    seq_len = gl.load(seq_lens_ptr + i_n)
    num_tiles = gl.cdiv(seq_len, BLOCK_N)
    chunk = gl.cdiv(num_tiles, num_splits)
    t_start = i_s * chunk
    t_end = gl.minimum(t_start + chunk, num_tiles)
    t_full = gl.minimum(t_end, seq_len // BLOCK_N)
    return seq_len, t_start, t_end, t_full, gl.maximum(t_full - t_start, 0)


@gluon.jit
def _prologue(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, t_start, t_full, n_full, block_size,
              STAGES: gl.constexpr, BLOCK_N: gl.constexpr, SUB: gl.constexpr):
    """The ring's first STAGES tiles, one a stage; the page ids of the next refill (loaded one refill ahead so the
    issue never waits on the block table)."""
    for b in gl.static_range(STAGES):
        if b < n_full:
            page_a, page_b = _tile_pages(bt_row, t_start + b, t_full, block_size, BLOCK_N, SUB)
            _issue_tile(c_desc, pe_desc, c_ring.index(b), pe_ring.index(b), bars.index(b), page_a, page_b,
                        t_start + b, block_size, BLOCK_N, SUB)
    return _tile_pages(bt_row, t_start + STAGES, t_full, block_size, BLOCK_N, SUB)


@gluon.jit
def _load_q(q_ptr, stride_q_n, stride_q_h, i_n, i_hb, H, L: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr,
            layout: gl.constexpr):
    """Head block i_hb of sequence i_n's query: q_c [BLOCK_H, L] and q_pe [BLOCK_H, R], zero rows past H."""
    offs_h = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    mask_h = (offs_h < H)[:, None]
    q_rows = q_ptr + i_n.to(gl.int64) * stride_q_n + offs_h[:, None] * stride_q_h
    q_c = gl.load(q_rows + gl.arange(0, L, layout=gl.SliceLayout(0, layout))[None, :], mask=mask_h, other=0.0)
    q_pe = gl.load(q_rows + L + gl.arange(0, R, layout=gl.SliceLayout(0, layout))[None, :], mask=mask_h, other=0.0)
    return q_c, q_pe


@gluon.jit
def _last_tile_rows(kv_ptr, bt_row, t_full, seq_len, block_size, L: gl.constexpr, R: gl.constexpr,
                    BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The sequence's partial last tile (tile t_full) by masked pointer loads: c [BLOCK_N, L] and pe [BLOCK_N, R],
    zeros past the end (rows there may hold NaN, which a TMA box would copy), and its live row count."""
    n_live = seq_len - t_full * BLOCK_N
    offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    pos = t_full * BLOCK_N + offs_t
    live = offs_t < n_live
    pages = gl.load(bt_row + pos // block_size, mask=live, other=0)  # the tile may straddle a page
    rows = kv_ptr + (pages.to(gl.int64) * block_size + pos % block_size) * (L + R)
    c = gl.load(rows[:, None] + gl.arange(0, L, layout=gl.SliceLayout(0, layout))[None, :], mask=live[:, None],
                other=0.0)
    pe = gl.load(rows[:, None] + L + gl.arange(0, R, layout=gl.SliceLayout(0, layout))[None, :], mask=live[:, None],
                 other=0.0)
    return c, pe, n_live


@gluon.jit
def _issue_scores(qc_smem, qpe_smem, c_buf, pe_buf, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr):
    """Start s [BLOCK_H, BLOCK_N] = q_c . c^T + q_pe . pe^T (unscaled): two MMA groups, the token of both."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(qc_smem, c_buf.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(qpe_smem, pe_buf.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, n_live, qk_scale, dtype: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
             o_layout: gl.constexpr):
    """The online softmax's step over the scores s (rows >= n_live score -inf; their c rows must be finite): p as
    the A operand of p . c, the factor that rescales acc (in acc's row layout), the new max and sum."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s = gl.where((offs_n < n_live)[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return p_op, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), m_new, l_i


@gluon.jit
def _tile_update(qc_smem, qpe_smem, c_buf, pe_buf, n_live, acc, m_i, l_i, qk_scale, BLOCK_H: gl.constexpr,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, WAIT_PV: gl.constexpr):
    """One tile in series: the scores (their wait also completes a p . c left in flight), the softmax, then
    acc += p . c, waited for unless WAIT_PV is False (acc is then the MMA's token)."""
    s = _issue_scores(qc_smem, qpe_smem, c_buf, pe_buf, BLOCK_H, BLOCK_N, s_layout)
    s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc))
    p_op, alpha, m_i, l_i = _softmax(s, m_i, l_i, n_live, qk_scale, c_buf.dtype, BLOCK_N, s_layout, o_layout)
    acc = warpgroup_mma(p_op, c_buf, acc * alpha[:, None], is_async=True)
    if WAIT_PV:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, m_i, l_i


@gluon.jit(
    do_not_specialize=["stride_bt_n", "num_splits"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"],
)
def _mla_decode_gluon_kernel(
    q_ptr, stride_q_n, stride_q_h,  # [N, H, L+R]
    kv_ptr,  # [num_pages, block_size, L+R], contiguous (the partial last tile's pointer loads)
    c_desc,  # TMA descriptor over the cache as rows [num_pages * block_size, L+R], box [SUB, L] at column 0
    pe_desc,  # the same rows, box [SUB, R] at column L
    block_table_ptr, stride_bt_n,  # [N, max_blocks] int32
    seq_lens_ptr,  # [N] int32
    part_ptr,  # [N, S, H, L] normalized partials (fp32 or q's dtype)
    lse_ptr,  # [N, S, H] fp32, log2 domain
    qk_scale,  # scale * log2(e)
    H,
    block_size,  # a multiple of SUB
    num_splits,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_H: gl.constexpr,  # 64: wgmma's M, heads >= H padded with zero queries
    BLOCK_N: gl.constexpr,  # tokens per tile: SUB or 2 * SUB (two boxes, so a tile may straddle a page)
    SUB: gl.constexpr,  # rows of a TMA box (block_size a multiple of it: a box never straddles a page)
    STAGES: gl.constexpr,  # KV buffers in the ring: STAGES - 1 tiles in flight during a tile's math
    PIPELINE: gl.constexpr,  # 0 serial, 1 tile i's p . c in flight through tile i + 1's scores, 2 also tile
    #                          i + 1's scores in flight through tile i's softmax (PIPELINES)
    num_warps: gl.constexpr,  # 8: two warpgroups
):
    gl.static_assert(num_warps == 8, "two warpgroups: each owns half of the tile's tokens and of L")
    gl.static_assert(BLOCK_H == 64, "wgmma's M")
    gl.static_assert((BLOCK_N == SUB) or (BLOCK_N == 2 * SUB), "a tile is one or two TMA boxes")
    gl.static_assert((PIPELINE < 2) or (STAGES >= 3), "two_tile reads tile i + 1 while tile i - 1's stage refills")
    dtype: gl.constexpr = c_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, L // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[num_warps, 1], order=[1, 0])
    i_n = gl.program_id(0)
    i_hb = gl.program_id(1)
    i_s = gl.program_id(2)

    # q [BLOCK_H, L] and [BLOCK_H, R] into shared memory once (zero rows past H)
    q_c, q_pe = _load_q(q_ptr, stride_q_n, stride_q_h, i_n, i_hb, H, L, R, BLOCK_H, ld_layout)
    qc_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, L], gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], dtype),
                                        q_c)
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, R],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], dtype), q_pe)
    c_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, L], c_desc.layout)
    pe_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, R], pe_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()  # q's stores and the barriers' init before any async-proxy access

    seq_len, t_start, t_end, t_full, n_full = _split_tiles(seq_lens_ptr, i_n, i_s, num_splits, BLOCK_N)
    bt_row = block_table_ptr + i_n.to(gl.int64) * stride_bt_n
    page_a, page_b = _prologue(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, t_start, t_full, n_full, block_size,
                               STAGES, BLOCK_N, SUB)

    acc = gl.zeros([BLOCK_H, L], gl.float32, o_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    if PIPELINE == 0:  # serial: every MMA waited for; a tile's stage is refilled once both warpgroups are past it
        for i in range(n_full):
            j = i % STAGES
            mbarrier.wait(bars.index(j), (i // STAGES) & 1)
            acc, m_i, l_i = _tile_update(qc_smem, qpe_smem, c_ring.index(j), pe_ring.index(j), BLOCK_N, acc, m_i,
                                         l_i, qk_scale, BLOCK_H, BLOCK_N, s_layout, o_layout, True)
            gl.thread_barrier()
            page_a, page_b = _refill(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, page_a, page_b,
                                     t_start + i + STAGES, t_start, t_full, block_size, STAGES, BLOCK_N, SUB)
    elif PIPELINE == 1:  # tile i's p . c in flight through tile i + 1's score dots: one wait for both
        acc = warpgroup_mma_init(acc)  # carried as the in-flight MMA's token
        for i in range(n_full):
            j = i % STAGES
            mbarrier.wait(bars.index(j), (i // STAGES) & 1)
            acc, m_i, l_i = _tile_update(qc_smem, qpe_smem, c_ring.index(j), pe_ring.index(j), BLOCK_N, acc, m_i,
                                         l_i, qk_scale, BLOCK_H, BLOCK_N, s_layout, o_layout, False)
            if i >= 1:  # tile i - 1's p . c completed at tile i's scores: its stage takes tile i - 1 + STAGES
                gl.thread_barrier()
                page_a, page_b = _refill(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, page_a, page_b,
                                         t_start + i - 1 + STAGES, t_start, t_full, block_size, STAGES, BLOCK_N, SUB)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:  # two tiles: tile i + 1's scores in flight through tile i's softmax, tile i's p . c through tile i + 1's
        # tile 0's scores (when the split has no full tile they read a stale stage and are never used)
        mbarrier.wait(bars.index(0), 0, pred=n_full > 0)
        s = _issue_scores(qc_smem, qpe_smem, c_ring.index(0), pe_ring.index(0), BLOCK_H, BLOCK_N, s_layout)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        acc = warpgroup_mma_init(acc)
        for i in range(n_full):
            j = i % STAGES
            jn = (i + 1) % STAGES
            # tile i + 1's scores (past the last full tile: a stale stage, its barrier not waited, never used)
            mbarrier.wait(bars.index(jn), ((i + 1) // STAGES) & 1, pred=i + 1 < n_full)
            s_next = _issue_scores(qc_smem, qpe_smem, c_ring.index(jn), pe_ring.index(jn), BLOCK_H, BLOCK_N,
                                   s_layout)
            p_op, alpha, m_i, l_i = _softmax(s, m_i, l_i, BLOCK_N, qk_scale, dtype, BLOCK_N, s_layout, o_layout)
            # in flight, oldest first: tile i - 1's p . c, tile i + 1's two score groups; the first must be done
            # before acc is rescaled
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
            acc = warpgroup_mma(p_op, c_ring.index(j), acc * alpha[:, None], is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))  # the scores done; tile i's p . c in flight
            if i >= 1:  # tile i - 1's dots are done in both warpgroups: its stage takes tile i - 1 + STAGES
                gl.thread_barrier()
                page_a, page_b = _refill(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, page_a, page_b,
                                         t_start + i - 1 + STAGES, t_start, t_full, block_size, STAGES, BLOCK_N, SUB)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    if (t_full < t_end) & (t_full >= t_start):  # the sequence's partial last tile: masked rows, zeros past the end
        c, pe, n_live = _last_tile_rows(kv_ptr, bt_row, t_full, seq_len, block_size, L, R, BLOCK_N, ld_layout)
        jt = n_full % STAGES  # every issued copy has landed and been read: any stage is free
        gl.thread_barrier()  # both warpgroups are past their last read of it
        c_ring.index(jt).store(c)
        pe_ring.index(jt).store(pe)
        fence_async_shared()
        gl.thread_barrier()
        acc, m_i, l_i = _tile_update(qc_smem, qpe_smem, c_ring.index(jt), pe_ring.index(jt), n_live, acc, m_i, l_i,
                                     qk_scale, BLOCK_H, BLOCK_N, s_layout, o_layout, True)
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))

    # the normalized partial and its log2-sum-exp; no tiles (a padding row, a split past the end): (0, -inf)
    has = l_i > 0.0
    lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    l_o = gl.convert_layout(gl.where(has, l_i, 1.0), gl.SliceLayout(1, o_layout))
    o = acc / l_o[:, None]
    slot = (i_n * num_splits + i_s).to(gl.int64)
    offs_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    out_rows = part_ptr + (slot * H + offs_ho)[:, None] * L
    gl.store(out_rows + gl.arange(0, L, layout=gl.SliceLayout(0, o_layout))[None, :], o.to(part_ptr.dtype.element_ty),
             mask=(offs_ho < H)[:, None])
    offs_hs = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + slot * H + offs_hs, lse, mask=offs_hs < H)


@gluon.jit
def _tokens_tile(qc_smem, qpe_smem, c_buf, pe_buf, p_smem, n_live, acc, m_i, l_i, qk_scale, BLOCK_N: gl.constexpr,
                 layout: gl.constexpr):
    """One tile of the tokens layout, in series: s^T [BLOCK_N, BLOCK_H] = c . q_c^T + pe . q_pe^T, the online softmax
    over its rows (tokens >= n_live score -inf), p^T into shared memory, acc^T [L, BLOCK_H] += c^T . p^T."""
    BLOCK_H: gl.constexpr = qc_smem.shape[0]
    s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout)
    s = warpgroup_mma(c_buf, qc_smem.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(pe_buf, qpe_smem.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    s = gl.where((offs_n < n_live)[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()  # every warp's rows of p^T stored before the MMA reads them
    acc = warpgroup_mma(c_buf.permute((1, 0)), p_smem, acc * alpha[None, :], is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, m_new, l_i


@gluon.jit(
    do_not_specialize=["stride_bt_n", "num_splits"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"],
)
def _mla_decode_gluon_tokens_kernel(
    q_ptr, stride_q_n, stride_q_h,  # [N, H, L+R]
    kv_ptr,  # [num_pages, block_size, L+R], contiguous (the partial last tile's pointer loads)
    c_desc,  # TMA descriptor over the cache as rows [num_pages * block_size, L+R], box [SUB, L] at column 0
    pe_desc,  # the same rows, box [SUB, R] at column L
    block_table_ptr, stride_bt_n,  # [N, max_blocks] int32
    seq_lens_ptr,  # [N] int32
    part_ptr,  # [N, S, H, L] normalized partials (fp32 or q's dtype)
    lse_ptr,  # [N, S, H] fp32, log2 domain
    qk_scale,  # scale * log2(e)
    H,
    block_size,  # a multiple of SUB
    num_splits,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_H: gl.constexpr,  # heads a program (wgmma's N): H rounded up to a power of 2 >= 16, zero queries past H
    BLOCK_N: gl.constexpr,  # 64 tokens a tile: wgmma's M
    SUB: gl.constexpr,  # rows of a TMA box (block_size a multiple of it: a box never straddles a page)
    STAGES: gl.constexpr,  # KV buffers in the ring
    num_warps: gl.constexpr,  # 4: one warpgroup
):
    """The tokens layout: the score dot is s^T = c . q^T (tokens on M, heads on N), so no MMA row is a padded
    head: half the tensor work of the heads layout at 32 heads, and q takes half the shared memory. p . c is
    acc^T [L, BLOCK_H] += c^T . p^T: the KV buffer read M-major as the A operand, p^T through shared memory (the B
    operand is always there). The online softmax reduces over the tile's rows (dim 0). Ring, page loads and the
    partial last tile as in _mla_decode_gluon_kernel; serial (every MMA waited for)."""
    gl.static_assert(num_warps == 4, "one warpgroup: the tile's 64 tokens are its M")
    gl.static_assert(BLOCK_N == 64, "wgmma's M")
    gl.static_assert((BLOCK_N == SUB) or (BLOCK_N == 2 * SUB), "a tile is one or two TMA boxes")
    dtype: gl.constexpr = c_desc.dtype
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                               warps_per_cta=[num_warps, 1], order=[1, 0])
    i_n = gl.program_id(0)
    i_hb = gl.program_id(1)
    i_s = gl.program_id(2)

    c_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, L], c_desc.layout)
    pe_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, R], pe_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()

    # the first tiles' copies go out before q is loaded: at batch 1 every program has a few tiles only, and the
    # chain seq_len -> page ids -> copies is the longest of the prologue
    seq_len, t_start, t_end, t_full, n_full = _split_tiles(seq_lens_ptr, i_n, i_s, num_splits, BLOCK_N)
    bt_row = block_table_ptr + i_n.to(gl.int64) * stride_bt_n
    page_a, page_b = _prologue(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, t_start, t_full, n_full, block_size,
                               STAGES, BLOCK_N, SUB)

    q_c, q_pe = _load_q(q_ptr, stride_q_n, stride_q_h, i_n, i_hb, H, L, R, BLOCK_H, ld_layout)
    qc_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, L], gl.NVMMASharedLayout.get_default_for([BLOCK_H, L], dtype),
                                        q_c)
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, R],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], dtype), q_pe)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype))
    fence_async_shared()
    gl.thread_barrier()  # every warp's rows of q stored before any MMA reads them

    acc = gl.zeros([L, BLOCK_H], gl.float32, layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(0, layout))
    for i in range(n_full):
        j = i % STAGES
        mbarrier.wait(bars.index(j), (i // STAGES) & 1)
        acc, m_i, l_i = _tokens_tile(qc_smem, qpe_smem, c_ring.index(j), pe_ring.index(j), p_smem, BLOCK_N, acc, m_i,
                                     l_i, qk_scale, BLOCK_N, layout)
        gl.thread_barrier()  # every warp past its reads of stage j before the refill
        page_a, page_b = _refill(c_desc, pe_desc, c_ring, pe_ring, bars, bt_row, page_a, page_b,
                                 t_start + i + STAGES, t_start, t_full, block_size, STAGES, BLOCK_N, SUB)

    if (t_full < t_end) & (t_full >= t_start):  # the sequence's partial last tile: masked rows, zeros past the end
        c, pe, n_live = _last_tile_rows(kv_ptr, bt_row, t_full, seq_len, block_size, L, R, BLOCK_N, ld_layout)
        jt = n_full % STAGES  # every stage is free: the loop's last barrier is behind every warp's reads
        c_ring.index(jt).store(c)
        pe_ring.index(jt).store(pe)
        fence_async_shared()
        gl.thread_barrier()
        acc, m_i, l_i = _tokens_tile(qc_smem, qpe_smem, c_ring.index(jt), pe_ring.index(jt), p_smem, n_live, acc,
                                     m_i, l_i, qk_scale, BLOCK_N, layout)
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))

    has = l_i > 0.0
    lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / gl.where(has, l_i, 1.0)[None, :]
    slot = (i_n * num_splits + i_s).to(gl.int64)
    offs_ho = i_hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, layout))
    out = part_ptr + (slot * H + offs_ho)[None, :] * L + gl.arange(0, L, layout=gl.SliceLayout(1, layout))[:, None]
    gl.store(out, o.to(part_ptr.dtype.element_ty), mask=(offs_ho < H)[None, :])
    gl.store(lse_ptr + slot * H + offs_ho, lse, mask=offs_ho < H)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.lru_cache(maxsize=8)
def _sm_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _box_rows(block_size: int, block_n: int) -> int | None:
    """Rows of a TMA box: a tile is one box, or two where the page size is a multiple of half a tile only (the
    48B's 1888-token page: 59 x 32, so 64-token tiles are two boxes); None where neither fits a page."""
    return next((b for b in (block_n, block_n // 2) if b >= 8 and block_size % b == 0), None)


def _unfit(q: Tensor, block_size: int, block_n: int, layout: str = "heads",
           kv_lora_rank: int | None = None) -> str | None:
    """Why the Gluon kernel cannot take this launch, or None where it can."""
    if layout == "tokens" and kv_lora_rank is not None and kv_lora_rank % 64:
        return (f"gluon_layout='tokens' needs kv_lora_rank a multiple of 64 (the latent columns are wgmma's M in "
                f"c^T . p^T), got {kv_lora_rank}")
    if not q.is_cuda or _sm_major(q.device.index) < 9:
        return "the Gluon MLA decode (gluon=True) needs an sm_90+ GPU: Gluon kernels have no interpreter"
    if q.dtype not in _GL_DTYPES:
        return f"the Gluon MLA decode takes bf16 or fp16, got {q.dtype}"
    if _box_rows(block_size, block_n) is None:
        return (f"gluon=True needs kv_cache's block_size ({block_size}) to be a multiple of block_n ({block_n}) or "
                f"of half of it: a TMA box must not straddle a page")
    return None


def gluon_runs(q: Tensor, block_size: int, block_n: int, layout: str = "heads",
               kv_lora_rank: int | None = None) -> bool:
    """Whether the Gluon kernel takes this launch: an sm_90+ GPU, bf16/fp16, boxes that fit the pages (the tokens
    layout: kv_lora_rank a multiple of 64)."""
    return _unfit(q, block_size, block_n, layout, kv_lora_rank) is None


def gluon_block_h(layout: str, block_h: int) -> int:
    """Heads a program of the Gluon kernel: 64 (wgmma's M) in the heads layout; in the tokens layout the heads are
    wgmma's N, `block_h` of them (MlaDecodeConfig.block_h, 16 or 32: past 32 the [L, BLOCK_H] accumulator
    outgrows registers)."""
    return GLUON_BLOCK_H if layout == "heads" else block_h


def launch_gluon_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, qk_scale: float,
                        part: Tensor, lse: Tensor, num_splits: int, block_n: int, stages: int,
                        pipeline: str, layout: str, block_h: int) -> None:
    """The split kernel's launch (grid N x head blocks x num_splits) writing part [N, S, H, L] and lse [N, S, H];
    `triton_decode.mla_decode` checks the shapes and merges the partials. qk_scale is scale * log2(e)."""
    N, H, D = q.shape
    L = part.shape[-1]
    block_size = kv_cache.shape[1]
    why = _unfit(q, block_size, block_n, layout, L)
    if why is not None:
        raise ValueError(why)
    sub = _box_rows(block_size, block_n)  # a TMA box has no row mask: a box must not straddle a page
    dt = _GL_DTYPES[q.dtype]
    rows = kv_cache.view(-1, D)  # the pool as token rows; a tile's box starts at page * block_size + offset
    c_desc = TensorDescriptor.from_tensor(rows[:, :L], [sub, L], gl.NVMMASharedLayout.get_default_for([sub, L], dt))
    pe_desc = TensorDescriptor.from_tensor(rows[:, L:], [sub, D - L],
                                           gl.NVMMASharedLayout.get_default_for([sub, D - L], dt))
    block_h = gluon_block_h(layout, block_h)
    grid = (N, triton.cdiv(H, block_h), num_splits)
    args = (q, q.stride(0), q.stride(1), kv_cache, c_desc, pe_desc, block_table, block_table.stride(0), seq_lens,
            part, lse, qk_scale, H, block_size, num_splits)
    if layout == "tokens":
        _mla_decode_gluon_tokens_kernel[grid](*args, L=L, R=D - L, BLOCK_H=block_h, BLOCK_N=block_n, SUB=sub,
                                              STAGES=stages, num_warps=4)
    else:
        _mla_decode_gluon_kernel[grid](*args, L=L, R=D - L, BLOCK_H=block_h, BLOCK_N=block_n, SUB=sub, STAGES=stages,
                                       PIPELINE=PIPELINES.index(pipeline), num_warps=8)
