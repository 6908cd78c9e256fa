"""KDA chunk-prefill intra step on 16 x 16 blocks, in four launches (`kda_chunk_fwd(..., intra="blocks")`).

The fused intra kernel (triton_chunk.py) holds whole [64, 128] fp32 tiles: 255 registers on sm_90 at 8 warps, one
program per SM, and its stages run as one long dependent chain with nothing beside it to hide the latencies (~40 us
a program on the H200, against ~1 us of tensor-core work; kernels/kda/NOTES.md, session 24). Session 29 wrote this
path as one program per (chunk, head) walking the blocks; it took 255 registers too (the row-block phase's loop).
So each phase is its own launch here, and the two heavy ones run one small program per 16 x 16 block or 16-row
block, many resident per SM, so that one program's load latencies hide behind another's work:

  0. per (chunk, head), over the K slices: Gc (the in-chunk cumsum of g) into the fp32 scratch gc, exp(Gc_last),
     and each sub-chunk's decay span_i = c_i - c_{i+1} (c_i: Gc just above sub-chunk i, c_0 = 0); the rows' squared
     norms too unless phase 1's row-block programs take them (`norms_in_l`, kda_chunk_fwd's default: then this
     launch reads only g; or per (chunk, K slice, head): `gc_sliced`);
  1. per (chunk, block (i, j), head) (or per row block i, all its j at once: `l_rows`, the default), over the K
     slices:
         raw_kk[i, j] = (k_i exp(Gc_i - c_i)) (k_j exp(c_i - Gc_j))^T,   raw_qk[i, j] likewise with q_i.
     Both exponentials are <= 1 for j < i (g <= 0: Gc falls); on the diagonal the column side reaches exp(span_i),
     so it is clamped there. Then the norms and beta: L_ij = beta_i rk_i raw_kk rk_j (strictly lower on the
     diagonal) into the fp32 scratch akk, Aqk_ij = scale rq_i raw_qk rk_j into aqk; the programs of blocks above
     the diagonal write Aqk's zeros (the row-block form writes the whole row, zeros past the diagonal block);
  2. per (chunk, head): a sub-chunk whose span exceeds SAFE_SPAN (a steep gate) gets its diagonal blocks of L and
     Aqk again, exactly, elementwise (`_exact_diag_block`; here rather than in phase 1, whose many programs would
     otherwise all hold that path's registers: 168 against 94 at one warp on sm_90); then (I + L)^-1 by blocks,
     stably (no power series; NOTES.md "After run 4"): D_i = (I + L_ii)^-1 by forward substitution (the fused
     kernel's code), X_ij = -D_i sum_{j <= m < i} L_im X_mj, each into akk over L_ij;
  3. per (chunk, row block i, head) (or per row block and slice: `sliced_out`), over the K slices:
     qg_i = qn_i exp(Gc_i), kd_i = kn_i exp(Gc_last - Gc_i) and W_i = sum_{j <= i} X_ij beta_j kn_j exp(Gc_j);
     over V slices U_i = sum_{j <= i} X_ij beta_j v_j: each one dot of X's row block i (the blocks past i masked to
     zero) against all C rows.
The state pass reads the same scratch (qg, kd, w, u, aqk, gl) as after the fused kernel. The decomposition (16-row
sub-chunks, K slices, the block inverse, a launch per stage) is the one fla's chunk_kda uses; own code. Oracle:
`ref.kda_chunked`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rt.kernels.kda.triton_chunk import _chunk_rows, _diag_block_inverses, _dot, _exact_diag_block


@triton.jit
def _rows(ptr, stride, r0, n_valid, offs, ncols, BC: tl.constexpr):
    """Rows r0 .. r0+BC (those < n_valid; others 0), columns offs (< ncols) of a row-strided input, in fp32."""
    ri = r0 + tl.arange(0, BC)
    m = (ri < n_valid)[:, None] & (offs < ncols)[None, :]
    return tl.load(ptr + ri[:, None].to(tl.int64) * stride + offs[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _gc_rows(gc_buf, r0, offs, BK: tl.constexpr, BC: tl.constexpr):
    ri = r0 + tl.arange(0, BC)
    return tl.load(gc_buf + ri[:, None] * BK + offs[None, :])


@triton.jit
def _gc_tile(g_h, stride_gt, n_valid, offs, K: tl.constexpr, C: tl.constexpr):
    """(g, Gc = its in-chunk cumsum) of the chunk's rows, columns offs: what phase 0 writes to gc, computed where it
    is read instead (`fuse_gc`)."""
    g = _rows(g_h, stride_gt, 0, n_valid, offs, K, C)
    return g, tl.cumsum(g, axis=0)


@triton.jit
def _block_rows(x, i, BC: tl.constexpr):
    """Rows of sub-chunk i (i * BC .. i * BC + BC) of a [4 * BC, M] register tile, as [BC, M] (the other sub-chunks
    add exact zeros)."""
    x3 = tl.reshape(x, (4, BC, x.shape[1]))
    return tl.sum(tl.where((tl.arange(0, 4) == i)[:, None, None], x3, 0.0), axis=0)


@triton.jit
def _spans(g, BC: tl.constexpr):
    """Each sub-chunk's decay span over these columns of the chunk's g rows [4 * BC, M]: max_d -(sum of g over its
    rows), [4] (phase 0's, and phase 1's with fuse_gc)."""
    return tl.max(-tl.sum(tl.reshape(g, (4, BC, g.shape[1])), axis=1), axis=1)


@triton.jit
def _one_row(x, r):
    """Row r of a [C, M] register tile as [M] (zeros when r is not a row: c_0 = 0 above the first sub-chunk)."""
    return tl.sum(tl.where((tl.arange(0, x.shape[0]) == r)[:, None], x, 0.0), axis=0)


@triton.jit
def _store_block(ptr, tile, i, j, C: tl.constexpr, BC: tl.constexpr):
    loc = tl.arange(0, BC)
    tl.store(ptr + (i * BC + loc)[:, None] * C + (j * BC + loc)[None, :], tile.to(ptr.dtype.element_ty))


@triton.jit
def _load_block(ptr, i, j, C: tl.constexpr, BC: tl.constexpr):
    loc = tl.arange(0, BC)
    return tl.load(ptr + (i * BC + loc)[:, None] * C + (j * BC + loc)[None, :])


@triton.jit
def _lx(akk_buf, i: tl.constexpr, m: tl.constexpr, j: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
        PREC_INV: tl.constexpr):
    """L_im X_mj from the scratch (L below the diagonal, X on and, once computed, below it)."""
    return tl.dot(_load_block(akk_buf, i, m, C, BC), _load_block(akk_buf, m, j, C, BC), input_precision=PREC_INV)


@triton.jit
def _dinv(akk_buf, i: tl.constexpr, t, C: tl.constexpr, BC: tl.constexpr, PREC_INV: tl.constexpr):
    """X_ii t (X_ii = (I + L_ii)^-1, on the scratch's diagonal)."""
    return tl.dot(_load_block(akk_buf, i, i, C, BC), t, input_precision=PREC_INV)


@triton.jit
def _row_out(ptr, tile, r0, offs, W: tl.constexpr, BC: tl.constexpr):
    """Rows r0 .. r0+BC, columns offs of a [C, W] scratch tile (every row: padding rows hold zeros)."""
    ri = r0 + tl.arange(0, BC)
    tl.store(ptr + ri[:, None] * W + offs[None, :], tile.to(ptr.dtype.element_ty))


@triton.jit
def _beta(b_h, stride_bt, i, n_valid, BC: tl.constexpr):
    loc = i * BC + tl.arange(0, BC)
    return tl.load(b_h + loc.to(tl.int64) * stride_bt, mask=loc < n_valid, other=0.0)


@triton.jit
def _rnorm(sq_ptr, r0, N: tl.constexpr):
    """1 / ||row|| (l2norm's eps) of rows r0 .. r0+N from their squared norms in the scratch."""
    return 1.0 / tl.sqrt(tl.load(sq_ptr + r0 + tl.arange(0, N)) + 1e-6)


@triton.jit
def _norms(sq_ptr, i, BC: tl.constexpr):
    """(rk, rq / scale) of sub-chunk i from the squared norms phase 0 stored: [2, C] fp32 (k row, then q row)."""
    return _rnorm(sq_ptr, i * BC, BC), _rnorm(sq_ptr, 4 * BC + i * BC, BC)


@triton.jit
def _row_side(q_h, k_h, stride_qt, stride_kt, gc_buf, i, n_valid, offs, K: tl.constexpr, BK: tl.constexpr,
              BC: tl.constexpr):
    """Sub-chunk i's side of L's and Aqk's dots, one K slice: (c_i, k_i exp(Gc_i - c_i), q_i exp(Gc_i - c_i)), c_i
    Gc of the row just above sub-chunk i (0 above the first), so every factor is <= 1."""
    c_i = tl.load(gc_buf + (i * BC - 1) * BK + offs, mask=(offs < BK) & (i > 0), other=0.0)
    e = tl.exp(_gc_rows(gc_buf, i * BC, offs, BK, BC) - c_i[None, :])
    return (c_i, _rows(k_h, stride_kt, i * BC, n_valid, offs, K, BC) * e,
            _rows(q_h, stride_qt, i * BC, n_valid, offs, K, BC) * e)


@triton.jit
def _scale_store(akk_buf, aqk_buf, kk, qk, b_h, stride_bt, sq_buf, n_valid, scale, i, j, C: tl.constexpr,
                 BC: tl.constexpr):
    """Block (i, j) of the raw sums to L (beta_i rk_i kk rk_j; strictly lower on the diagonal) into akk and Aqk
    (scale rq_i qk rk_j; lower on the diagonal) into aqk."""
    loc = tl.arange(0, BC)
    rk_i, rq_i = _norms(sq_buf, i, BC)
    rk_j, _ = _norms(sq_buf, j, BC)
    b_i = _beta(b_h, stride_bt, i, n_valid, BC)
    low = (loc[:, None] > loc[None, :]) | (i > j)
    kk = tl.where(low, kk * (b_i * rk_i)[:, None] * rk_j[None, :], 0.0)
    qk = tl.where(low | (loc[:, None] == loc[None, :]), qk * (rq_i * scale)[:, None] * rk_j[None, :], 0.0)
    _store_block(akk_buf, kk, i, j, C, BC)
    _store_block(aqk_buf, qk, i, j, C, BC)


@triton.jit
def _program(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, i_h, H: tl.constexpr, C: tl.constexpr):
    """(first token, real rows, scratch row) of the program's (chunk, head)."""
    t0, n_valid = _chunk_rows(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, C)
    return t0, n_valid, i_c.to(tl.int64) * H + i_h


@triton.jit
def _phase0(q_h, k_h, g_h, stride_qt, stride_kt, stride_gt, n_valid, scr, gc_ptr, gl_ptr, sq_buf, span_ptr,
            K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
            STORE_GC: tl.constexpr, NORMS: tl.constexpr = True):
    """Phase 0's outputs for one (chunk, head), over the K slices: exp(Gc_last) into gl, (NORMS) the rows' squared
    norms into sq_buf (k, then q), the sub-chunks' spans into span, and (STORE_GC) Gc itself into gc."""
    rows = tl.arange(0, C)
    sk = tl.zeros([C], dtype=tl.float32)
    sq = tl.zeros([C], dtype=tl.float32)
    span = tl.zeros([4], dtype=tl.float32)
    for ks in range(0, BK, BKS):
        offs = ks + tl.arange(0, BKS)
        g = _rows(g_h, stride_gt, 0, n_valid, offs, K, C)  # [C, BKS]
        if STORE_GC:
            tl.store(gc_ptr + scr * (C * BK) + rows[:, None] * BK + offs[None, :], tl.cumsum(g, axis=0))
        tl.store(gl_ptr + scr * BK + offs, tl.exp(tl.sum(g, axis=0)))
        if NORMS:
            kr = _rows(k_h, stride_kt, 0, n_valid, offs, K, C)
            qr = _rows(q_h, stride_qt, 0, n_valid, offs, K, C)
            sk += tl.sum(kr * kr, axis=1)
            sq += tl.sum(qr * qr, axis=1)
        # span_i = max_d (c_i - c_{i+1}) = max_d -(sum of g over sub-chunk i)
        span = tl.maximum(span, _spans(g, BC))
    if NORMS:
        tl.store(sq_buf + rows, sk)
        tl.store(sq_buf + C + rows, sq)
    tl.store(span_ptr + scr * 4 + tl.arange(0, 4), span)


# not specialized per step (kernels/common.py, Compiles): the chunk tables are views of the packed step
@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _blocks_gc_kernel(
    q_ptr, k_ptr, g_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh,
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    gl_ptr,  # out [NC, H, BK] fp32: exp(Gc_last)
    gc_ptr,  # out [NC, H, C, BK] fp32: Gc
    sq_ptr,  # out [NC, H, 2, C] fp32: the rows' squared norms (k, then q)
    span_ptr,  # out [NC, H, 4] fp32: each sub-chunk's decay span
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    NORMS: tl.constexpr,
):
    """Phase 0, one program per (chunk, head); without NORMS (`norms_in_l`) q and k are not read here: phase 1's
    row-block programs take the norms from the rows they load."""
    tl.static_assert(C == 4 * BC, "four sub-chunks per chunk")
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, n_valid, scr = _program(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, i_h, H, C)
    _phase0(q_ptr + t0 * stride_qt + i_h * stride_qh, k_ptr + t0 * stride_kt + i_h * stride_kh,
            g_ptr + t0 * stride_gt + i_h * stride_gh, stride_qt, stride_kt, stride_gt, n_valid, scr, gc_ptr, gl_ptr,
            sq_ptr + scr * (2 * C), span_ptr, K, BK, BKS, C, BC, True, NORMS)


@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _blocks_gc_slice_kernel(
    g_ptr, stride_gt, stride_gh,
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    gl_ptr,  # out [NC, H, BK] fp32: exp(Gc_last)
    gc_ptr,  # out [NC, H, C, BK] fp32: Gc
    span_ptr,  # out [NC, H, BK // BKS, 4] fp32: each sub-chunk's decay span over this slice's columns
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
):
    """Phase 0 without the norms (`launch_intra_blocks(gc_sliced=True)`, with norms_in_l): one program per (chunk, K
    slice, head), all independent, instead of one per (chunk, head) walking the slices one after another; the spans
    stay per slice (the inverse's launch takes their max)."""
    tl.static_assert(C == 4 * BC, "four sub-chunks per chunk")
    NKS: tl.constexpr = BK // BKS
    i_c, i_s, i_h = tl.program_id(0) // NKS, tl.program_id(0) % NKS, tl.program_id(1)
    t0, n_valid, scr = _program(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, i_h, H, C)
    offs = i_s * BKS + tl.arange(0, BKS)
    g = _rows(g_ptr + t0 * stride_gt + i_h * stride_gh, stride_gt, 0, n_valid, offs, K, C)  # [C, BKS]
    rows = tl.arange(0, C)
    tl.store(gc_ptr + scr * (C * BK) + rows[:, None] * BK + offs[None, :], tl.cumsum(g, axis=0))
    tl.store(gl_ptr + scr * BK + offs, tl.exp(tl.sum(g, axis=0)))
    tl.store(span_ptr + (scr * NKS + i_s) * 4 + tl.arange(0, 4), _spans(g, BC))


@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _blocks_pair_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh,
    stride_bt, stride_bh,
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    gc_ptr, sq_ptr,  # phase 0's
    akk_ptr,  # out [NC, H, C, C] fp32: L on and below the diagonal blocks
    aqk_ptr,  # out [NC, H, C, C]
    scale,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    DOT16: tl.constexpr, PREC: tl.constexpr, SAFE_SPAN: tl.constexpr,
):
    """Phase 1, one program per (chunk, block (i, j) of the 4 x 4, head); axis 0 is chunk * 16 + block, so that
    consecutive programs share their chunk's rows and Gc in L2."""
    i_c, i_p, i_h = tl.program_id(0) // 16, tl.program_id(0) % 16, tl.program_id(1)
    i, j = i_p // 4, i_p % 4
    t0, n_valid, scr = _program(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, i_h, H, C)
    aqk_buf = aqk_ptr + scr * (C * C)
    if j > i:
        _store_block(aqk_buf, tl.zeros([BC, BC], dtype=tl.float32), i, j, C, BC)
        return
    q_h = q_ptr + t0 * stride_qt + i_h * stride_qh
    k_h = k_ptr + t0 * stride_kt + i_h * stride_kh
    gc_buf = gc_ptr + scr * (C * BK)
    sq_buf = sq_ptr + scr * (2 * C)
    kk = tl.zeros([BC, BC], dtype=tl.float32)
    qk = tl.zeros([BC, BC], dtype=tl.float32)
    for ks in range(0, BK, BKS):
        offs = ks + tl.arange(0, BKS)
        c_i, ke, qe = _row_side(q_h, k_h, stride_qt, stride_kt, gc_buf, i, n_valid, offs, K, BK, BC)
        # the columns, clamped at exp(SAFE_SPAN): only the diagonal block reaches past 1 (a steep one is redone
        # exactly by the inverse's launch, which keeps that path's registers out of these many programs)
        col = tl.exp(tl.minimum(c_i[None, :] - _gc_rows(gc_buf, j * BC, offs, BK, BC), SAFE_SPAN))
        kt = tl.trans(_rows(k_h, stride_kt, j * BC, n_valid, offs, K, BC) * col)
        kk += _dot(ke, kt, DOT16, PREC)
        qk += _dot(qe, kt, DOT16, PREC)
    _scale_store(akk_ptr + scr * (C * C), aqk_buf, kk, qk, beta_ptr + t0 * stride_bt + i_h * stride_bh, stride_bt,
                 sq_buf, n_valid, scale, i, j, C, BC)


@triton.jit
def _store_l_row(akk_ptr, aqk_ptr, scr, kk, qk, i, rk_i, rq_i, rk, b_i, scale, C: tl.constexpr, BC: tl.constexpr):
    """Row block i of the raw sums [BC, C] to L (beta_i rk_i kk rk_j, strictly below the diagonal, zeros past it)
    into akk and Aqk (scale rq_i qk rk_j, on and below the diagonal) into aqk, whole rows."""
    loc = tl.arange(0, BC)
    cols = tl.arange(0, C)
    below = (cols[None, :] // BC < i) | ((cols[None, :] // BC == i) & (loc[:, None] > cols[None, :] % BC))
    diag = (cols[None, :] // BC == i) & (loc[:, None] == cols[None, :] % BC)
    rows = (i * BC + loc)[:, None] * C + cols[None, :]
    kk = tl.where(below, kk * (b_i * rk_i)[:, None] * rk[None, :], 0.0)
    qk = tl.where(below | diag, qk * (rq_i * scale)[:, None] * rk[None, :], 0.0)
    tl.store(akk_ptr + scr * (C * C) + rows, kk)
    tl.store(aqk_ptr + scr * (C * C) + rows, qk.to(aqk_ptr.dtype.element_ty))


@triton.jit
def _l_row_slice(kk, qk, q_h, k_h, stride_qt, stride_kt, gc_buf, kr, gc_all, i, n_valid, offs, K: tl.constexpr,
                 BK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, DOT16: tl.constexpr, PREC: tl.constexpr,
                 SAFE_SPAN: tl.constexpr, FUSE_GC: tl.constexpr):
    """Row block i's sums over one K slice, added to (kk, qk) [BC, C], with the chunk's k rows kr and (FUSE_GC) Gc
    rows gc_all [C, BKS] (else None: phase 0's, loaded here): the row side relative to c_i (Gc just above block i), one dot against all C rows, the columns past
    block i zeroed before it (their exp(c_i - Gc_j) would exceed 1) and the rest clamped at exp(SAFE_SPAN) (a steep
    diagonal block is redone exactly by the inverse's launch)."""
    if FUSE_GC:
        c_i = _one_row(gc_all, i * BC - 1)
        e = tl.exp(_block_rows(gc_all, i, BC) - c_i[None, :])
        ke = _rows(k_h, stride_kt, i * BC, n_valid, offs, K, BC) * e
        qe = _rows(q_h, stride_qt, i * BC, n_valid, offs, K, BC) * e
    else:
        c_i, ke, qe = _row_side(q_h, k_h, stride_qt, stride_kt, gc_buf, i, n_valid, offs, K, BK, BC)
        gc_all = _gc_rows(gc_buf, 0, offs, BK, C)
    cols = tl.arange(0, C)
    col = tl.where((cols < (i + 1) * BC)[:, None], tl.exp(tl.minimum(c_i[None, :] - gc_all, SAFE_SPAN)), 0.0)
    kt = tl.trans(kr * col)
    return kk + _dot(ke, kt, DOT16, PREC), qk + _dot(qe, kt, DOT16, PREC)


@triton.jit
def _l_row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_buf, gl_ptr, span_ptr,
                 akk_ptr, aqk_ptr, scr, i, n_valid, scale, K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                 C: tl.constexpr, BC: tl.constexpr, DOT16: tl.constexpr, PREC: tl.constexpr, SAFE_SPAN: tl.constexpr,
                 FUSE_GC: tl.constexpr, NORMS_HERE: tl.constexpr):
    """Row block i of L and Aqk [BC, C] over the K slices, stored (_store_l_row). Gc from phase 0's scratch, or
    (FUSE_GC) the cumsum of the chunk's g rows per K slice. NORMS_HERE (one row block per program, with FUSE_GC or
    norms_in_l): the row block's squared norms, the same values as phase 0's, taken from the rows this loop loads and
    stored for phase 3, and with FUSE_GC the other outputs phase 0 would have written besides gc: its sub-chunk's span
    and (block 0) exp(Gc_last); else the norms are read back from sq."""
    kk = tl.zeros([BC, C], dtype=tl.float32)
    qk = tl.zeros([BC, C], dtype=tl.float32)
    sk = tl.zeros([C], dtype=tl.float32)  # NORMS_HERE: every row's squared k norm, and block i's k and q ones
    sk_i = tl.zeros([BC], dtype=tl.float32)
    sq_i = tl.zeros([BC], dtype=tl.float32)
    span = tl.zeros([4], dtype=tl.float32)
    for ks in range(0, BK, BKS):
        offs = ks + tl.arange(0, BKS)
        kr = _rows(k_h, stride_kt, 0, n_valid, offs, K, C)
        if FUSE_GC:
            g, gc_all = _gc_tile(g_h, stride_gt, n_valid, offs, K, C)
            if NORMS_HERE:  # the same operations as phase 0's
                span = tl.maximum(span, _spans(g, BC))
                tl.store(gl_ptr + scr * BK + offs, tl.exp(tl.sum(g, axis=0)), mask=(offs < BK) & (i == 0))
        else:
            gc_all = None  # phase 0's: _l_row_slice loads them after the row side (2 registers fewer on sm_90)
        if NORMS_HERE:
            kr_i = _rows(k_h, stride_kt, i * BC, n_valid, offs, K, BC)
            qr_i = _rows(q_h, stride_qt, i * BC, n_valid, offs, K, BC)
            sk += tl.sum(kr * kr, axis=1)
            sk_i += tl.sum(kr_i * kr_i, axis=1)
            sq_i += tl.sum(qr_i * qr_i, axis=1)
        kk, qk = _l_row_slice(kk, qk, q_h, k_h, stride_qt, stride_kt, gc_buf, kr, gc_all, i, n_valid, offs, K, BK, C,
                              BC, DOT16, PREC, SAFE_SPAN, FUSE_GC)
    if NORMS_HERE:
        loc = tl.arange(0, BC)
        tl.store(sq_buf + i * BC + loc, sk_i)
        tl.store(sq_buf + C + i * BC + loc, sq_i)
        if FUSE_GC:
            tl.store(span_ptr + scr * 4 + tl.arange(0, 4), span, mask=tl.arange(0, 4) == i)
        rk_i, rq_i, rk = 1.0 / tl.sqrt(sk_i + 1e-6), 1.0 / tl.sqrt(sq_i + 1e-6), 1.0 / tl.sqrt(sk + 1e-6)  # _rnorm's
    else:
        rk_i, rq_i = _norms(sq_buf, i, BC)
        rk = _rnorm(sq_buf, 0, C)
    _store_l_row(akk_ptr, aqk_ptr, scr, kk, qk, i, rk_i, rq_i, rk, _beta(b_h, stride_bt, i, n_valid, BC), scale, C, BC)


@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _blocks_lrow_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_bt,
    stride_bh,
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    gc_ptr, sq_ptr,  # phase 0's (FUSE_GC: sq written here, gc unused)
    gl_ptr, span_ptr,  # FUSE_GC only: written here (phase 0's outputs otherwise)
    akk_ptr,  # out [NC, H, C, C] fp32: L by row blocks (zeros past the diagonal block)
    aqk_ptr,  # out [NC, H, C, C]
    scale,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    DOT16: tl.constexpr, PREC: tl.constexpr, SAFE_SPAN: tl.constexpr, FUSE_GC: tl.constexpr, CHUNK: tl.constexpr,
    NORMS_L: tl.constexpr = False,
):
    """Phase 1 by row blocks (`launch_intra_blocks(l_rows=True)`): one program per (chunk, row block i, head)
    computes L's and Aqk's whole row block [BC, C], one dot per K slice against all C rows, instead of i + 1 block
    programs that each reload the row side. Axis 0 is chunk * 4 + i.
    FUSE_GC (`launch_intra_blocks(fuse_gc=True)`): no phase 0 launch; Gc is the cumsum of the chunk's g rows, taken
    here per K slice (and again in phase 3), and this launch writes what phase 0 would have besides gc, the same
    values: the rows' squared norms, the sub-chunks' spans and exp(Gc_last).
    CHUNK (`launch_intra_blocks(l_chunk=True)`): one program per (chunk, head), its four row blocks one after
    another, the same operations (bit-equal in the interpreter). The row-block programs of a chunk run on different
    SMs, so each brings the chunk's k and Gc rows from the L2 (at 8 x 4K tokens of the 48B layer ~3 GB against
    ~0.8); here row blocks 1-3 find them in this SM's L1 (48 KB a K pass), at row-block registers (the four blocks'
    sums side by side took 255 on sm_90 and a stack at 4 warps). With FUSE_GC the norms, spans and exp(Gc_last) come
    from a first pass over the K slices, stored, and read back as phase 0's are.
    NORMS_L (`launch_intra_blocks(norms_in_l=True)`, row-block programs): the rows' squared norms are taken here from
    the k and q rows this launch loads, not by phase 0 (which then reads only g: ~1 GB less at 64K tokens of the 48B
    layer), and stored for phase 3."""
    tl.static_assert(C == 4 * BC, "four sub-chunks per chunk")
    tl.static_assert(not (NORMS_L and CHUNK), "norms_in_l: row-block programs")
    if CHUNK:
        i_c, i_h = tl.program_id(0), tl.program_id(1)
    else:
        i_c, i_h = tl.program_id(0) // 4, tl.program_id(1)
    t0, n_valid, scr = _program(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, i_h, H, C)
    q_h = q_ptr + t0 * stride_qt + i_h * stride_qh
    k_h = k_ptr + t0 * stride_kt + i_h * stride_kh
    g_h = g_ptr + t0 * stride_gt + i_h * stride_gh
    b_h = beta_ptr + t0 * stride_bt + i_h * stride_bh
    gc_buf = gc_ptr + scr * (C * BK)
    sq_buf = sq_ptr + scr * (2 * C)
    if CHUNK:
        if FUSE_GC:  # phase 0's outputs but gc first, in a pass of their own (its registers apart from the sums')
            _phase0(q_h, k_h, g_h, stride_qt, stride_kt, stride_gt, n_valid, scr, gc_ptr, gl_ptr, sq_buf, span_ptr, K,
                    BK, BKS, C, BC, False)
            tl.debug_barrier()  # the norms are read back below, by other threads
        for i in tl.static_range(4):
            _l_row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_buf, gl_ptr,
                         span_ptr, akk_ptr, aqk_ptr, scr, i, n_valid, scale, K, BK, BKS, C, BC, DOT16, PREC,
                         SAFE_SPAN, FUSE_GC, False)
    else:
        _l_row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_buf, gl_ptr,
                     span_ptr, akk_ptr, aqk_ptr, scr, tl.program_id(0) % 4, n_valid, scale, K, BK, BKS, C, BC, DOT16,
                     PREC, SAFE_SPAN, FUSE_GC, FUSE_GC or NORMS_L)


@triton.jit
def _below_diag_inverse_regs(akk_buf, C: tl.constexpr, BC: tl.constexpr, PREC_INV: tl.constexpr):
    """X's blocks below the diagonal, X_ij = -X_ii sum_{j <= m < i} L_im X_mj, from one load of the six L blocks
    and the four X_ii (the substitution's, on the diagonal), all issued before the first dot, and stored at the end:
    the products and their order are the row-at-a-time path's (bit-equal), without its stores and reloads."""
    tl.static_assert(C == 4 * BC, "four sub-chunks per chunk")
    d0, d1 = _load_block(akk_buf, 0, 0, C, BC), _load_block(akk_buf, 1, 1, C, BC)
    d2, d3 = _load_block(akk_buf, 2, 2, C, BC), _load_block(akk_buf, 3, 3, C, BC)
    l10, l20 = _load_block(akk_buf, 1, 0, C, BC), _load_block(akk_buf, 2, 0, C, BC)
    l21, l30 = _load_block(akk_buf, 2, 1, C, BC), _load_block(akk_buf, 3, 0, C, BC)
    l31, l32 = _load_block(akk_buf, 3, 1, C, BC), _load_block(akk_buf, 3, 2, C, BC)
    x10 = -tl.dot(d1, tl.dot(l10, d0, input_precision=PREC_INV), input_precision=PREC_INV)
    x21 = -tl.dot(d2, tl.dot(l21, d1, input_precision=PREC_INV), input_precision=PREC_INV)
    x20 = -tl.dot(d2, tl.dot(l20, d0, input_precision=PREC_INV) + tl.dot(l21, x10, input_precision=PREC_INV),
                  input_precision=PREC_INV)
    x32 = -tl.dot(d3, tl.dot(l32, d2, input_precision=PREC_INV), input_precision=PREC_INV)
    x31 = -tl.dot(d3, tl.dot(l31, d1, input_precision=PREC_INV) + tl.dot(l32, x21, input_precision=PREC_INV),
                  input_precision=PREC_INV)
    x30 = -tl.dot(d3, tl.dot(l30, d0, input_precision=PREC_INV) + tl.dot(l31, x10, input_precision=PREC_INV)
                  + tl.dot(l32, x20, input_precision=PREC_INV), input_precision=PREC_INV)
    _store_block(akk_buf, x10, 1, 0, C, BC)
    _store_block(akk_buf, x20, 2, 0, C, BC)
    _store_block(akk_buf, x21, 2, 1, C, BC)
    _store_block(akk_buf, x30, 3, 0, C, BC)
    _store_block(akk_buf, x31, 3, 1, C, BC)
    _store_block(akk_buf, x32, 3, 2, C, BC)


@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _blocks_inverse_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh,
    stride_bt, stride_bh,
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    sq_ptr, span_ptr,  # phase 0's
    akk_ptr,  # in: L (phase 1), out: X = (I + L)^-1
    aqk_ptr,  # phase 1's; a steep sub-chunk's diagonal block is rewritten
    scale,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    PREC_INV: tl.constexpr, SAFE_SPAN: tl.constexpr, REGS: tl.constexpr, NSPAN: tl.constexpr = 1,
):
    """Phase 2, one program per (chunk, head): first the diagonal blocks of steep sub-chunks (span > SAFE_SPAN)
    exactly, elementwise, over phase 1's clamped ones; then X = (I + L)^-1 over L in the akk scratch.
    REGS (`launch_intra_blocks(inverse_regs=True)`): the same values with fewer dependent round trips through the
    scratch. The diagonal blocks' substitution reads its rows from registers (one load, not one per row), and the
    blocks below are computed from one load of L's six blocks and X's diagonal, kept in registers, and stored
    once, with no store, barrier and reload between X's block rows: about 3 waits on memory instead of about 22."""
    tl.static_assert(C == 4 * BC, "four sub-chunks per chunk")
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    scr = i_c.to(tl.int64) * H + i_h
    akk_buf = akk_ptr + scr * (C * C)
    # the sub-chunks' spans: [NSPAN, 4] partial maxima (one row per K slice with gc_sliced), their max
    sub = tl.arange(0, 4)
    spans = tl.max(tl.load(span_ptr + scr * (NSPAN * 4) + tl.arange(0, NSPAN)[:, None] * 4 + sub[None, :]), axis=0)
    if tl.max(spans, axis=0) > SAFE_SPAN:
        t0, n_valid = _chunk_rows(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, C)
        q_h = q_ptr + t0 * stride_qt + i_h * stride_qh
        k_h = k_ptr + t0 * stride_kt + i_h * stride_kh
        g_h = g_ptr + t0 * stride_gt + i_h * stride_gh
        for i in tl.static_range(4):
            if tl.sum(tl.where(sub == i, spans, 0.0), axis=0) > SAFE_SPAN:
                ri = i * BC + tl.arange(0, BC)
                kk, qk = _exact_diag_block(q_h, k_h, g_h, ri, stride_qt, stride_kt, stride_gt, ri < n_valid,
                                           ri < n_valid, K, BK, 8, BC, True)
                _scale_store(akk_buf, aqk_ptr + scr * (C * C), kk, qk, beta_ptr + t0 * stride_bt + i_h * stride_bh,
                             stride_bt, sq_ptr + scr * (2 * C), n_valid, scale, i, i, C, BC)
        tl.debug_barrier()  # the substitution reads the rewritten blocks back
    # the diagonal blocks by forward substitution, all four at once (rows read back from akk)
    _diag_block_inverses(akk_buf, C, BC, REGS=REGS)
    if REGS:
        _below_diag_inverse_regs(akk_buf, C, BC, PREC_INV)
        return
    # the blocks below, a row at a time: X_ij = -X_ii sum_{j <= m < i} L_im X_mj, each X_ij stored over L_ij once
    # no later block of its row reads L_ij (few tiles live at once: the rows come back from the scratch)
    x10 = -_dinv(akk_buf, 1, _lx(akk_buf, 1, 0, 0, C, BC, PREC_INV), C, BC, PREC_INV)
    _store_block(akk_buf, x10, 1, 0, C, BC)
    tl.debug_barrier()
    x21 = -_dinv(akk_buf, 2, _lx(akk_buf, 2, 1, 1, C, BC, PREC_INV), C, BC, PREC_INV)
    x20 = -_dinv(akk_buf, 2, _lx(akk_buf, 2, 0, 0, C, BC, PREC_INV) + _lx(akk_buf, 2, 1, 0, C, BC, PREC_INV), C, BC,
                 PREC_INV)
    tl.debug_barrier()
    _store_block(akk_buf, x21, 2, 1, C, BC)
    _store_block(akk_buf, x20, 2, 0, C, BC)
    tl.debug_barrier()
    x32 = -_dinv(akk_buf, 3, _lx(akk_buf, 3, 2, 2, C, BC, PREC_INV), C, BC, PREC_INV)
    x31 = -_dinv(akk_buf, 3, _lx(akk_buf, 3, 1, 1, C, BC, PREC_INV) + _lx(akk_buf, 3, 2, 1, C, BC, PREC_INV), C, BC,
                 PREC_INV)
    x30 = -_dinv(akk_buf, 3, _lx(akk_buf, 3, 0, 0, C, BC, PREC_INV) + _lx(akk_buf, 3, 1, 0, C, BC, PREC_INV)
                 + _lx(akk_buf, 3, 2, 0, C, BC, PREC_INV), C, BC, PREC_INV)
    tl.debug_barrier()
    _store_block(akk_buf, x32, 3, 2, C, BC)
    _store_block(akk_buf, x31, 3, 1, C, BC)
    _store_block(akk_buf, x30, 3, 0, C, BC)


@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _blocks_out_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    gc_ptr, sq_ptr, akk_ptr,  # phases 0 and 2's
    qg_ptr, kd_ptr, w_ptr,  # out [NC, H, C, BK]
    u_ptr,  # out [NC, H, C, BV]
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    BVS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, DOT16: tl.constexpr, PREC: tl.constexpr,
    SLICED: tl.constexpr, FUSE_GC: tl.constexpr, ROWS: tl.constexpr,
):
    """Phase 3, one program per (chunk, row block i, head) (ROWS = BC): qg, kd, W and U rows from X's blocks
    (i, 0..i). SLICED: one program per (chunk, row block i and one K or V slice, head) instead, each doing one
    slice's loop iteration (BK / BKS + BV / BVS programs per row block: more and smaller programs). FUSE_GC: Gc from
    the chunk's g rows per K slice (see _blocks_lrow_kernel), not from phase 0's gc.
    ROWS = C (`launch_intra_blocks(out_chunk=True)`): one program per (chunk, head) for all C rows, T = X diag(beta)
    one [C, C] tile, W and U one [C, C] x [C, *] dot per slice. The row-block programs each load the chunk's k, v
    and Gc rows for their dot, so those reach the SMs four times (at 8 x 4K tokens of the 48B layer ~4.2 GB from the
    L2 against ~1.05 here). The same elementwise operations per row; the dots' rows the same sums (interpreter:
    equal up to the order the host's matmul takes them in)."""
    tl.static_assert((ROWS == BC) or ((ROWS == C) and not SLICED), "row blocks, or the whole chunk unsliced")
    NKS: tl.constexpr = BK // BKS
    NS: tl.constexpr = NKS + BV // BVS
    NB: tl.constexpr = C // ROWS  # row tiles per chunk
    NP: tl.constexpr = NB * NS if SLICED else NB  # programs per (chunk, head), axis 0 = chunk * NP + program
    i_c, i_p, i_h = tl.program_id(0) // NP, tl.program_id(0) % NP, tl.program_id(1)
    if SLICED:
        i, s = i_p // NS, i_p % NS
        k_lo = tl.minimum(s, NKS) * BKS
        k_hi = tl.where(s < NKS, k_lo + BKS, k_lo)
        v_lo = tl.maximum(s - NKS, 0) * BVS
        v_hi = tl.where(s < NKS, v_lo, v_lo + BVS)
    else:
        i = i_p
        k_lo, k_hi, v_lo, v_hi = 0, BK, 0, BV
    r0 = i * ROWS
    t0, n_valid, scr = _program(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, i_h, H, C)
    q_h = q_ptr + t0 * stride_qt + i_h * stride_qh
    k_h = k_ptr + t0 * stride_kt + i_h * stride_kh
    v_h = v_ptr + t0 * stride_vt + i_h * stride_vh
    g_h = g_ptr + t0 * stride_gt + i_h * stride_gh
    b_h = beta_ptr + t0 * stride_bt + i_h * stride_bh
    gc_buf = gc_ptr + scr * (C * BK)
    sq_buf = sq_ptr + scr * (2 * C)
    rk_i, rq_i = _rnorm(sq_buf, r0, ROWS), _rnorm(sq_buf, C + r0, ROWS)
    # T = X diag(beta), the tile's rows: their blocks (i, j <= i) in one [ROWS, C] tile, the blocks above the
    # diagonal masked (akk holds no X there), so that W and U are one dot per slice over the chunk's C rows instead
    # of i + 1 dependent dots over 16
    rows = r0 + tl.arange(0, ROWS)
    cols = tl.arange(0, C)
    past = cols < r0 + ROWS
    if ROWS == C:
        lower = cols[None, :] // BC <= rows[:, None] // BC
    else:  # one row block: a column mask (a 2D one costs the sliced programs 40 registers on sm_90)
        lower = past[None, :]
    t_row = tl.load(akk_ptr + scr * (C * C) + rows[:, None] * C + cols[None, :], mask=lower, other=0.0)
    t_row = t_row * tl.load(b_h + cols.to(tl.int64) * stride_bt, mask=past & (cols < n_valid), other=0.0)[None, :]
    rk_all = _rnorm(sq_buf, 0, C)
    for ks in range(k_lo, k_hi, BKS):
        offs = ks + tl.arange(0, BKS)
        if FUSE_GC:
            gc_all = _gc_tile(g_h, stride_gt, n_valid, offs, K, C)[1]
            g_last = _one_row(gc_all, C - 1)
            gc_i = gc_all if ROWS == C else _block_rows(gc_all, i, BC)
        else:
            g_last = tl.load(gc_buf + (C - 1) * BK + offs)
            gc_i = _gc_rows(gc_buf, r0, offs, BK, ROWS)
            gc_all = gc_i if ROWS == C else _gc_rows(gc_buf, 0, offs, BK, C)
        q_i = _rows(q_h, stride_qt, r0, n_valid, offs, K, ROWS)
        _row_out(qg_ptr + scr * (C * BK), q_i * (rq_i * scale)[:, None] * tl.exp(gc_i), r0, offs, BK, ROWS)
        kn_i = _rows(k_h, stride_kt, r0, n_valid, offs, K, ROWS) * rk_i[:, None]
        _row_out(kd_ptr + scr * (C * BK), kn_i * tl.exp(g_last[None, :] - gc_i), r0, offs, BK, ROWS)
        # kn_j exp(Gc_j) of every row (rows past the tile's blocks meet T's zeros)
        if ROWS == C:
            kg = kn_i * tl.exp(gc_all)
        else:
            kg = _rows(k_h, stride_kt, 0, n_valid, offs, K, C) * rk_all[:, None] * tl.exp(gc_all)
        _row_out(w_ptr + scr * (C * BK), _dot(t_row, kg, DOT16, PREC), r0, offs, BK, ROWS)
    for vs in range(v_lo, v_hi, BVS):
        offs = vs + tl.arange(0, BVS)
        u = _dot(t_row, _rows(v_h, stride_vt, 0, n_valid, offs, V, C), DOT16, PREC)
        _row_out(u_ptr + scr * (C * BV), u, r0, offs, BV, ROWS)


def span_rows(BK: int, block_k_gc: int, gc_sliced: bool) -> int:
    """Rows of 4 spans per (chunk, head) in the span scratch: one per K slice of the sliced Gc launch (a slice no
    wider than the head's BK), else one."""
    return BK // min(block_k_gc, BK) if gc_sliced else 1


def launch_intra_blocks(q, k, v, g, beta, cu, t_seq, t_idx, qg, kd, w, u, aqk, gl, gc, akk, sq, span, *,
                        scale: float, block_k: int, block_v: int, num_warps: int, num_stages: int, dot16: bool,
                        prec: str, prec_inv: str, sub: int, safe_span: float, sliced_out: bool = False,
                        l_rows: bool = True, fuse_gc: bool = False, inverse_regs: bool = False,
                        out_chunk: bool = False, num_warps_out_chunk: int = 4, l_chunk: bool = False,
                        num_warps_l_chunk: int = 4, maxnreg_l: int | None = None, num_warps_gc: int = 4,
                        block_k_gc: int | None = None, num_warps_inverse: int = 1,
                        num_warps_out: int | None = None, norms_in_l: bool = False, gc_sliced: bool = False,
                        block_k_out: int | None = None, num_stages_out: int | None = None) -> None:
    """Four launches over the NC chunks x H heads. The buffers are _launch_chunk's: the state pass's scratch (qg, kd,
    w, u, aqk, gl) and this path's fp32 gc [NC, H, C, BK] (None with fuse_gc), akk [NC, H, C, C], sq [NC, H, 2, C],
    span [NC, H, 4].
    num_warps / num_stages: the block (phase 1) and row-block (phase 3) programs'; num_warps_gc / block_k_gc (None:
    block_k): phase 0's warps and K slice; num_warps_inverse: phase 2's warps; num_warps_out (None: num_warps):
    phase 3's row-block programs' warps.
    sliced_out: phase 3 as one program per (chunk, row block and K or V slice, head). l_rows: phase 1 one program
    per row block of L and Aqk (`_blocks_lrow_kernel`); False: per 16 x 16 block (`_blocks_pair_kernel`). fuse_gc
    (with l_rows): three launches, no phase 0: phases 1 and 3 take Gc from g's rows themselves and phase 1 writes sq,
    span and gl (gc is neither written nor read: ~1 GB of fp32 traffic each way at 64K tokens of the 48B layer).
    inverse_regs: phase 2 with its blocks in registers (`_blocks_inverse_kernel` REGS; the same values).
    out_chunk: phase 3 one program per (chunk, head) at num_warps_out_chunk warps (`_blocks_out_kernel` ROWS = C: the
    chunk's k, v and Gc rows read once, not once per row block; not with sliced_out). l_chunk: phase 1 one program
    per (chunk, head) at num_warps_l_chunk warps (`_blocks_lrow_kernel` CHUNK: the same, its k and Gc rows read once for
    the four row blocks; with l_rows). maxnreg_l: the L launch's register cap (with l_rows; Triton's maxnreg; None:
    ptxas's choice)."""
    NC, H, C, BK = qg.shape
    BV = u.shape[3]
    K, V = k.shape[2], v.shape[2]
    if gc is None:  # fuse_gc: no gc scratch; the kernels take a placeholder pointer they never touch
        assert fuse_gc, "gc: phase 0's scratch is needed unless fuse_gc"
        gc = gl
    else:
        assert gc.shape == (NC, H, C, BK)
    assert C == 4 * sub and akk.shape == (NC, H, C, C)
    bk_gc = block_k_gc or block_k
    nspan = span_rows(BK, bk_gc, gc_sliced)
    assert sq.shape == (NC, H, 2, C) and span.shape == (NC, H, 4 * nspan)
    assert all(t.dtype == torch.float32 for t in (gc, akk, sq, span))
    assert BK % block_k == 0 and BV % block_v == 0
    tables = (cu, t_seq, t_idx)
    if fuse_gc and not l_rows:
        raise ValueError("fuse_gc: needs l_rows (the 16 x 16 block programs read phase 0's gc)")
    if l_chunk and not l_rows:
        raise ValueError("l_chunk: a form of l_rows (the row blocks of one chunk in one program)")
    if norms_in_l and (not l_rows or l_chunk or fuse_gc):
        raise ValueError("norms_in_l: a form of the row-block L launch (l_rows, not l_chunk or fuse_gc)")
    if gc_sliced and not norms_in_l:
        raise ValueError("gc_sliced: with norms_in_l (the sliced Gc programs take no norms)")
    if gc_sliced:
        _blocks_gc_slice_kernel[(NC * nspan, H)](
            g, g.stride(0), g.stride(1), *tables, gl, gc, span, H=H, K=K, BK=BK, BKS=bk_gc, C=C, BC=sub,
            num_warps=num_warps_gc)
    elif not fuse_gc:
        _blocks_gc_kernel[(NC, H)](
            q, k, g, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1), *tables,
            gl, gc, sq, span, H=H, K=K, BK=BK, BKS=bk_gc, C=C, BC=sub, NORMS=not norms_in_l,
            num_warps=num_warps_gc)
    if l_rows:
        cap = {} if maxnreg_l is None else {"maxnreg": maxnreg_l}
        _blocks_lrow_kernel[(NC if l_chunk else NC * 4, H)](
            q, k, g, beta, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), *tables, gc, sq, gl, span, akk, aqk, scale, H=H, K=K, BK=BK, BKS=block_k,
            C=C, BC=sub, DOT16=dot16, PREC=prec, SAFE_SPAN=safe_span, FUSE_GC=fuse_gc, CHUNK=l_chunk, NORMS_L=norms_in_l,
            num_warps=num_warps_l_chunk if l_chunk else num_warps, num_stages=num_stages, **cap)
    else:
        _blocks_pair_kernel[(NC * 16, H)](
            q, k, g, beta, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), *tables, gc, sq, akk, aqk, scale,
            H=H, K=K, BK=BK, BKS=block_k, C=C, BC=sub, DOT16=dot16, PREC=prec, SAFE_SPAN=safe_span,
            num_warps=num_warps, num_stages=num_stages)
    _blocks_inverse_kernel[(NC, H)](
        q, k, g, beta, q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), *tables, sq, span, akk, aqk, scale,
        H=H, K=K, BK=BK, C=C, BC=sub, PREC_INV=prec_inv, SAFE_SPAN=safe_span, REGS=inverse_regs, NSPAN=nspan,
        num_warps=num_warps_inverse)
    if out_chunk:
        if sliced_out:
            raise ValueError("out_chunk: one program per (chunk, head); sliced_out splits the row-block programs")
    bks_out, bvs_out = (block_k, block_v) if block_k_out is None else (min(block_k_out, BK), min(block_k_out, BV))
    n_out = 1 if out_chunk else 4 * (BK // bks_out + BV // bvs_out) if sliced_out else 4
    _blocks_out_kernel[(NC * n_out, H)](
        q, k, v, g, beta, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), *tables, gc, sq, akk, qg, kd, w, u, scale,
        H=H, K=K, V=V, BK=BK, BKS=bks_out, BV=BV, BVS=bvs_out, C=C, BC=sub,
        DOT16=dot16, PREC=prec, SLICED=sliced_out, FUSE_GC=fuse_gc, ROWS=C if out_chunk else sub,
        num_warps=num_warps_out_chunk if out_chunk else (num_warps_out or num_warps),
        num_stages=num_stages_out or num_stages)
