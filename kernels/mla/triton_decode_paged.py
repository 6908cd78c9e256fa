"""MLA decode (Triton), paged tiles: page-aligned KV tiles so the next tile's copy overlaps the math.

Why a second kernel: in the gathered-row kernels of triton_decode.py a tile's rows are gathered
through the block table (one page id per row, a tile may straddle pages). Triton's pipeliner counts
that page-id load as a level of load indirection, and with it the KV tile's copy is issued at the end
of the iteration and waited for (`async_wait num = 0`) at the top of the next (the sm_90 TTGIR shows
it), so memory and math run in series: about 45 % of copy bandwidth on the H200.

Here a tile never straddles a page: the tiles of a sequence are numbered page by page (a page of
block_size tokens holds cdiv(block_size, BLOCK_N) tiles, the last one masked when BLOCK_N does not
divide block_size), so a tile needs one page id. That id is loaded one iteration ahead and carried
through the loop: the pipeliner follows load chains only within an iteration (a scalar page-id load
in the same iteration still counts as indirection), so the KV copy counts as a direct load and gets
the loop's full latency: at num_stages = 3 two shared buffers, tile i+1 streaming in while tile i is
multiplied (tests/kernels/test_mla_sm90_build.py checks the wait inside the loop leaves it pending).

Two layouts (HEADS_ON_M): heads on the dots' M (the default: q in registers, mma.sync at 32 heads,
s [BLOCK_H, BLOCK_N] = q · [c ; k_pe]^T, acc [BLOCK_H, L] += p · c), or the tile's tokens on M
(both dots wgmma from shared memory at BLOCK_N >= 64, s^T = [c ; k_pe] · q^T, acc^T += c^T · p^T;
measured slower: its q^T and three 64-token buffers do not fit, and at two buffers the copy runs in
series again). All BLOCK_H heads of a sequence share each tile (read once). Accumulation in fp32.
With heads on M and BLOCK_H = 64 at Kimi's 32 heads (half the rows masked to zero: FlashMLA pads the same
way) and 8 warps, both dots lower to wgmma reading the KV tile straight from shared memory, q held there
too (72 KB): twice the MMA work but none of mma.sync's ldmatrix traffic; one program per SM. The sm_90
TTGIR shows one more cost: a dot whose result feeds another dot gets all warps along M (warpsPerCTA
[8, 1]), so both warpgroups compute the same 64 x BLOCK_N scores, and only the second dot splits its N
([4, 2]). At 32 heads on M (mma.sync, the default) the 4 warps split the score dot's N instead ([1, 4]),
so every warp reads all of q from shared memory for each tile (4 x 36 KB per 32-token tile), and p goes
through shared memory into the second dot. Benchmarked as variants (benchmarks/kernels_mla.py).

Split-KV: the tiles of a sequence are cut into num_splits equal ranges of whole tiles (computed in
the kernel from seq_lens, so one launch and one CUDA graph serve any lengths); each split writes its
normalized partial and log2-sum-exp, and `triton_decode._mla_decode_combine_kernel` merges them
exactly. A split with no tiles (past the end, or a padding row with seq_len 0) writes the neutral
partial (0, -inf). The launcher is `triton_decode.mla_decode` (paged=True, its default).

Balanced schedule (schedule="balanced", `_mla_decode_balanced_kernel`): instead of S splits of every
sequence, P work programs each take an equal share of all sequences' tiles laid end to end, so ragged
lengths load every program alike (FlashMLA's schedule); its combine finds each sequence's partials
from the same plan. Tested against the oracle; not yet measured on a GPU, so not the default.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _num_tiles(seq_len, block_size, tiles_per_page, BLOCK_N: tl.constexpr):
    """Tiles of a sequence, numbered page by page (a page's last tile is partial when BLOCK_N does not
    divide block_size); works on scalars and on vectors of lengths."""
    full_pages = seq_len // block_size
    return full_pages * tiles_per_page + tl.cdiv(seq_len - full_pages * block_size, BLOCK_N)


@triton.jit
def _load_q(q_ptr, stride_q_n, stride_q_h, i_n, offs_h, mask_h, L: tl.constexpr, R: tl.constexpr,
            HEADS_ON_M: tl.constexpr):
    """q [BLOCK_H, L] and [BLOCK_H, R] with heads on M (the dots' A operand from registers), else q^T."""
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    if HEADS_ON_M:
        q_rows = q_ptr + i_n.to(tl.int64) * stride_q_n + offs_h[:, None] * stride_q_h
        q_c = tl.load(q_rows + offs_l[None, :], mask=mask_h[:, None], other=0.0)  # [BLOCK_H, L]
        q_pe = tl.load(q_rows + L + offs_r[None, :], mask=mask_h[:, None], other=0.0)  # [BLOCK_H, R]
    else:  # heads on the dots' N, tile tokens on M (wgmma at BLOCK_N >= 64)
        q_cols = q_ptr + i_n.to(tl.int64) * stride_q_n + offs_h[None, :] * stride_q_h
        q_c = tl.load(q_cols + offs_l[:, None], mask=mask_h[None, :], other=0.0)  # [L, BLOCK_H]
        q_pe = tl.load(q_cols + L + offs_r[:, None], mask=mask_h[None, :], other=0.0)  # [R, BLOCK_H]
    return q_c, q_pe


@triton.jit
def _tile_update(q_c, q_pe, c, pe, live, acc, m_i, l_i, qk_scale, DOT_PRECISION: tl.constexpr,
                 HEADS_ON_M: tl.constexpr):
    """One tile of the online softmax: scores q . [c ; pe]^T, then (acc, m, l) updated; rows where `live` is
    false score -inf (their c rows must be finite: zeros from a masked load). HEADS_ON_M: q [BLOCK_H, *],
    acc [BLOCK_H, L]; else the tile's tokens on M: q^T [*, BLOCK_H], acc^T [L, BLOCK_H]."""
    if HEADS_ON_M:
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    else:
        s = tl.dot(c, q_c, input_precision=DOT_PRECISION)
        s = tl.dot(pe, q_pe, acc=s, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_H]
        s = tl.where(live[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(c), p.to(c.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(q_c, q_pe, kv_ptr, bt_row, seq_len, t_start, t_end, block_size, tiles_per_page, qk_scale,
                  L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, HEADS_ON_M: tl.constexpr):
    """Online softmax over tiles [t_start, t_end) of one sequence: (acc, m, l), acc unnormalized, in
    the layout of HEADS_ON_M ([BLOCK_H, L], else [L, BLOCK_H]), m and l in the log2 domain."""
    offs_t = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    if HEADS_ON_M:
        acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
    else:
        acc = tl.zeros([L, BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)

    # The page id of each tile is loaded one iteration ahead and carried: the pipeliner follows load
    # chains only inside one iteration, so the KV copy counts as a direct load and gets the loop's
    # full latency (a page id loaded in the same iteration would halve it: see the module docstring).
    page = tl.load(bt_row + t_start // tiles_per_page, mask=t_start < t_end, other=0)
    # Every tile holds at least one live token (a page's tiles stop at its last live row), so m_i is
    # finite after the first one.
    for t in range(t_start, t_end):
        slot = t // tiles_per_page
        row = (t - slot * tiles_per_page) * BLOCK_N + offs_t  # [BLOCK_N] rows of the page
        live = (row < block_size) & (slot * block_size + row < seq_len)
        rows = kv_ptr + (page.to(tl.int64) * block_size + row) * (L + R)
        page = tl.load(bt_row + (t + 1) // tiles_per_page, mask=t + 1 < t_end, other=0)  # the next tile's
        c = tl.load(rows[:, None] + offs_l[None, :], mask=live[:, None], other=0.0)  # [BLOCK_N, L]
        pe = tl.load(rows[:, None] + L + offs_r[None, :], mask=live[:, None], other=0.0)  # [BLOCK_N, R]
        acc, m_i, l_i = _tile_update(q_c, q_pe, c, pe, live, acc, m_i, l_i, qk_scale, DOT_PRECISION, HEADS_ON_M)
    return acc, m_i, l_i


@triton.jit
def _store_partial(part_ptr, lse_ptr, slot, H, offs_h, mask_h, acc, m_i, l_i, L: tl.constexpr,
                   HEADS_ON_M: tl.constexpr):
    """The normalized partial and its log2-sum-exp into row `slot` of [*, H, L] / [*, H]; an empty
    range (l == 0, acc == 0) writes the neutral partial (0, -inf)."""
    has = l_i > 0.0
    out_row = slot.to(tl.int64) * H + offs_h  # [BLOCK_H]
    if HEADS_ON_M:
        o = acc / tl.where(has, l_i, 1.0)[:, None]
    else:
        o = tl.trans(acc / tl.where(has, l_i, 1.0)[None, :])
    tl.store(part_ptr + out_row[:, None] * L + tl.arange(0, L)[None, :], o.to(part_ptr.dtype.element_ty),
             mask=mask_h[:, None])
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + out_row, lse, mask=mask_h)


# not specialized per step (kernels/common.py, Compiles): the table's width (longest context) and the split count vary
# per step; table and lengths are views of the packed step
@triton.jit(
    do_not_specialize=["stride_bt_n", "num_splits"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"],
)
def _mla_decode_paged_kernel(
    q_ptr, stride_q_n, stride_q_h,  # [N, H, L+R]
    kv_ptr,  # [num_pages, block_size, L+R], contiguous
    block_table_ptr, stride_bt_n,  # [N, max_blocks] int32
    seq_lens_ptr,  # [N] int32
    part_ptr,  # [N, S, H, L] normalized partial outputs: fp32, or q's dtype (partial_dtype="input")
    lse_ptr,  # [N, S, H] fp32, log2 domain
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
    HEADS_ON_M: tl.constexpr,  # heads on the dots' M (mma.sync) instead of the tile's tokens (wgmma)
):
    i_n = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H

    if USE_PDL:
        gdc_wait()  # q and the current token's cache entry come from the previous kernels
    seq_len = tl.load(seq_lens_ptr + i_n)
    tiles_per_page = tl.cdiv(block_size, BLOCK_N)
    chunk = tl.cdiv(_num_tiles(seq_len, block_size, tiles_per_page, BLOCK_N), num_splits)
    t_start = i_s * chunk
    t_end = tl.minimum(t_start + chunk, _num_tiles(seq_len, block_size, tiles_per_page, BLOCK_N))
    bt_row = block_table_ptr + i_n.to(tl.int64) * stride_bt_n
    q_c, q_pe = _load_q(q_ptr, stride_q_n, stride_q_h, i_n, offs_h, mask_h, L, R, HEADS_ON_M)
    acc, m_i, l_i = _attend_tiles(q_c, q_pe, kv_ptr, bt_row, seq_len, t_start, t_end, block_size, tiles_per_page,
                                  qk_scale, L, R, BLOCK_H, BLOCK_N, DOT_PRECISION, HEADS_ON_M)
    if USE_PDL:
        gdc_launch_dependents()
    # no tiles (padding row, or a split past the end): the neutral partial
    _store_partial(part_ptr, lse_ptr, i_n * num_splits + i_s, H, offs_h, mask_h, acc, m_i, l_i, L, HEADS_ON_M)


@triton.jit
def _balanced_plan(seq_lens_ptr, N, block_size, num_programs, min_tiles, BLOCK_N: tl.constexpr,
                   N_P2: tl.constexpr):
    """The balanced schedule, recomputed from seq_lens by every program that needs it (no host sync, so
    one CUDA graph serves any lengths): the tiles of all sequences in order, cut into num_programs equal
    ranges of `per` tiles (at least min_tiles). Returns the lengths, tile counts and inclusive tile
    prefix sums ([N_P2] vectors), the total and `per`."""
    offs = tl.arange(0, N_P2)
    lens = tl.load(seq_lens_ptr + offs, mask=offs < N, other=0)
    tiles = _num_tiles(lens, block_size, tl.cdiv(block_size, BLOCK_N), BLOCK_N)
    cu = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    per = tl.maximum(tl.cdiv(total, num_programs), min_tiles)
    return lens, tiles, cu, total, per


# not specialized per step (kernels/common.py, Compiles): the batch and the table's width vary per step; table and
# lengths are views of the packed step
@triton.jit(
    do_not_specialize=["stride_bt_n", "N"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr"],
)
def _mla_decode_balanced_kernel(
    q_ptr, stride_q_n, stride_q_h,  # [N, H, L+R]
    kv_ptr,  # [num_pages, block_size, L+R], contiguous
    block_table_ptr, stride_bt_n,  # [N, max_blocks] int32
    seq_lens_ptr,  # [N] int32
    part_ptr,  # [P + N - 1, H, L] fp32 (or q's dtype): program p's partial of sequence n in row p + n
    lse_ptr,  # [P + N - 1, H] fp32, log2 domain
    qk_scale,  # scale * log2(e)
    N,
    H,
    block_size,
    min_tiles,  # the fewest tiles a program takes (a partial costs about as much as a tile)
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_P2: tl.constexpr,  # next_power_of_2(N)
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    HEADS_ON_M: tl.constexpr,
):
    """Balanced split-KV (FlashMLA's schedule, in a grid of P work programs): program p takes the global
    tiles [p * per, (p + 1) * per) of all sequences' tiles laid end to end, so every program streams the
    same number of KV bytes however ragged the lengths, and writes one partial per sequence it touches.
    Along the global order both p and n only grow and each step grows one of them, so p + n names each
    (program, sequence) pair once: P + N - 1 partial rows in all."""
    i_p = tl.program_id(0)
    i_hb = tl.program_id(1)
    offs_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_seq = tl.arange(0, N_P2)
    tiles_per_page = tl.cdiv(block_size, BLOCK_N)

    if USE_PDL:
        gdc_wait()  # q and the current token's cache entry come from the previous kernels
    lens, tiles, cu, total, per = _balanced_plan(seq_lens_ptr, N, block_size, tl.num_programs(0), min_tiles,
                                                 BLOCK_N, N_P2)
    g = i_p * per
    g_end = tl.minimum(g + per, total)
    while g < g_end:
        # the first sequence ending past g (sequences without tiles, padding rows among them, end at or
        # before it and are passed over)
        i_n = tl.sum((cu <= g).to(tl.int32), axis=0)
        here = offs_seq == i_n
        seq_end = tl.sum(tl.where(here, cu, 0), axis=0)
        seq_start = seq_end - tl.sum(tl.where(here, tiles, 0), axis=0)
        seq_len = tl.sum(tl.where(here, lens, 0), axis=0)
        stop = tl.minimum(g_end, seq_end)
        q_c, q_pe = _load_q(q_ptr, stride_q_n, stride_q_h, i_n, offs_h, mask_h, L, R, HEADS_ON_M)
        bt_row = block_table_ptr + i_n.to(tl.int64) * stride_bt_n
        acc, m_i, l_i = _attend_tiles(q_c, q_pe, kv_ptr, bt_row, seq_len, g - seq_start, stop - seq_start, block_size,
                                      tiles_per_page, qk_scale, L, R, BLOCK_H, BLOCK_N, DOT_PRECISION, HEADS_ON_M)
        _store_partial(part_ptr, lse_ptr, i_p + i_n, H, offs_h, mask_h, acc, m_i, l_i, L, HEADS_ON_M)
        g = stop
    if USE_PDL:
        gdc_launch_dependents()


# not specialized per step (kernels/common.py, Compiles): the batch varies per step; the lengths are a view of the
# packed step
@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _mla_decode_balanced_combine_kernel(
    part_ptr,  # [P + N - 1, H, L] fp32, or the output's dtype (partial_dtype="input")
    lse_ptr,  # [P + N - 1, H] fp32, log2 domain
    o_ptr, stride_o_n, stride_o_h,  # [N, H, L]
    seq_lens_ptr,
    N,
    H,
    block_size,
    num_programs,  # P of the attention launch
    min_tiles,
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,  # a program merges BLOCK_L columns of one head (grid axis 2 covers L)
    BLOCK_N: tl.constexpr,
    N_P2: tl.constexpr,
    P_P2: tl.constexpr,  # next_power_of_2(P): a sequence has at most P partials
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Sequence n's partials are rows p + n for the programs p whose tile ranges meet its tiles,
    p = first .. last with first = start // per, last = (end - 1) // per; merged exactly by
    log-sum-exp weights. A sequence without tiles (seq_len 0) gets a zero output."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    offs_l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    if USE_PDL:
        gdc_wait()
    lens, tiles, cu, total, per = _balanced_plan(seq_lens_ptr, N, block_size, num_programs, min_tiles,
                                                 BLOCK_N, N_P2)
    here = tl.arange(0, N_P2) == i_n
    seq_end = tl.sum(tl.where(here, cu, 0), axis=0)
    seq_tiles = tl.sum(tl.where(here, tiles, 0), axis=0)
    first = (seq_end - seq_tiles) // tl.maximum(per, 1)
    count = tl.where(seq_tiles > 0, (seq_end - 1) // tl.maximum(per, 1) - first + 1, 0)
    base = first + i_n  # partial row of the first program
    offs_s = tl.arange(0, P_P2)
    lse = tl.load(lse_ptr + (base + offs_s).to(tl.int64) * H + i_h, mask=offs_s < count, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no partials: every weight is 0, output 0
    denom = tl.sum(tl.exp2(lse - m), axis=0)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for s0 in range(0, count, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        mask_s = ss < count
        rows = (base + ss).to(tl.int64) * H + i_h
        w = tl.exp2(tl.load(lse_ptr + rows, mask=mask_s, other=float("-inf")) - m)  # [BLOCK_S]
        part = tl.load(part_ptr + rows[:, None] * L + offs_l[None, :], mask=mask_s[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * part, axis=0)
    if USE_PDL:
        gdc_launch_dependents()
    o = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_ptr + i_n.to(tl.int64) * stride_o_n + i_h * stride_o_h + offs_l, o.to(o_ptr.dtype.element_ty))
