"""MLA decode (Triton), paged tiles copied by TMA: the tile loop of triton_decode_paged.py with the KV tiles
brought in by tensor-memory-accelerator copies instead of per-thread cp.async.

Why: in the cp.async kernel every thread computes and holds the addresses of its share of each 32 x 576
tile (pointer tensors, 64-bit) and issues its own copies; at 4 warps the build sits at 255 registers
with a spill slot, and the address math competes with the softmax for issue slots. A TMA copy is one
instruction naming a box of the cache (rows page * block_size + tile offset, columns [0, L) or [L, L+R)),
completed on an mbarrier, so the math warps only wait. FlashMLA loads its KV tiles the same way.

The box has no per-row mask: rows past a sequence's end inside its page are whatever the pool holds
(possibly never written, so possibly NaN, and 0 * NaN poisons p . c). So the loop covers only full tiles,
and the sequence's last tile, when partial, goes through the masked pointer loads after the loop.
This needs tiles that never straddle a page (block_size a multiple of BLOCK_N: the launcher checks).
Both layouts of the paged kernel (HEADS_ON_M); one split writes through the combine as the paged kernel
does. The oracle is ref.py::mla_decode_ref.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.mla.triton_decode_paged import _load_q, _store_partial, _tile_update


# not specialized per step (kernels/common.py, Compiles): the table's width (longest context) and the split count vary
# per step; table and lengths are views of the packed step
@triton.jit(
    do_not_specialize=["stride_bt_n", "num_splits"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"],
)
def _mla_decode_tma_kernel(
    q_ptr, stride_q_n, stride_q_h,  # [N, H, L+R]
    kv_ptr,  # [num_pages, block_size, L+R], contiguous (the masked last tile)
    c_desc,  # TMA descriptor over the cache as rows [num_pages * block_size, L+R], box [BLOCK_N, L] at column 0
    pe_desc,  # the same rows, box [BLOCK_N, R] at column L (a descriptor over the column slice)
    block_table_ptr, stride_bt_n,  # [N, max_blocks] int32
    seq_lens_ptr,  # [N] int32
    part_ptr,  # [N, S, H, L] normalized partials (fp32 or q's dtype)
    lse_ptr,  # [N, S, H] fp32, log2 domain
    qk_scale,  # scale * log2(e)
    H,
    block_size,  # a multiple of BLOCK_N
    num_splits,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    HEADS_ON_M: tl.constexpr,  # heads on the dots' M, else the tile's tokens (as in triton_decode_paged.py)
):
    i_n = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_t = tl.arange(0, BLOCK_N)

    if USE_PDL:
        gdc_wait()  # q and the current token's cache entry come from the previous kernels
    seq_len = tl.load(seq_lens_ptr + i_n)
    tiles_per_page = block_size // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N)  # tiles never straddle pages: position t * BLOCK_N starts tile t
    chunk = tl.cdiv(num_tiles, num_splits)
    t_start = i_s * chunk
    t_end = tl.minimum(t_start + chunk, num_tiles)
    t_full = tl.minimum(t_end, seq_len // BLOCK_N)  # tiles before this one hold only live rows
    bt_row = block_table_ptr + i_n.to(tl.int64) * stride_bt_n
    q_c, q_pe = _load_q(q_ptr, stride_q_n, stride_q_h, i_n, offs_h, mask_h, L, R, HEADS_ON_M)

    if HEADS_ON_M:
        acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
    else:
        acc = tl.zeros([L, BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    live = offs_t < BLOCK_N  # every row of a full tile
    # the page id is carried one tile ahead, as in triton_decode_paged.py, so the copy is a direct load
    page = tl.load(bt_row + t_start // tiles_per_page, mask=t_start < t_full, other=0)
    for t in range(t_start, t_full):
        slot = t // tiles_per_page
        row0 = (page * block_size + (t - slot * tiles_per_page) * BLOCK_N).to(tl.int32)
        page = tl.load(bt_row + (t + 1) // tiles_per_page, mask=t + 1 < t_full, other=0)
        c = c_desc.load([row0, 0])  # [BLOCK_N, L]
        pe = pe_desc.load([row0, 0])  # [BLOCK_N, R]
        acc, m_i, l_i = _tile_update(q_c, q_pe, c, pe, live, acc, m_i, l_i, qk_scale, DOT_PRECISION, HEADS_ON_M)
    if (t_full < t_end) & (t_full >= t_start):  # this split holds the sequence's last tile, partial: masked
        #                                           row loads (zeros past the end)
        tail_page = tl.load(bt_row + t_full // tiles_per_page)
        row = (t_full - (t_full // tiles_per_page) * tiles_per_page) * BLOCK_N + offs_t
        live = t_full * BLOCK_N + offs_t < seq_len
        rows = kv_ptr + (tail_page.to(tl.int64) * block_size + row) * (L + R)
        c = tl.load(rows[:, None] + tl.arange(0, L)[None, :], mask=live[:, None], other=0.0)
        pe = tl.load(rows[:, None] + L + tl.arange(0, R)[None, :], mask=live[:, None], other=0.0)
        acc, m_i, l_i = _tile_update(q_c, q_pe, c, pe, live, acc, m_i, l_i, qk_scale, DOT_PRECISION, HEADS_ON_M)
    if USE_PDL:
        gdc_launch_dependents()
    # no tiles (padding row, or a split past the end): the neutral partial
    _store_partial(part_ptr, lse_ptr, i_n * num_splits + i_s, H, offs_h, mask_h, acc, m_i, l_i, L, HEADS_ON_M)
