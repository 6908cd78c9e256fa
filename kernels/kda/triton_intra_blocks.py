"""KDA chunk-prefill intra step on 16 x 16 blocks (`kda_chunk_fwd(..., intra="blocks")`).

The fused intra kernel (triton_chunk.py) holds whole [64, 128] fp32 tiles: 255 registers on sm_90 at 8 warps, one
program per SM, and its stages run as one long dependent chain with nothing beside it to hide the latencies (~40 us
a program on the H200, against ~1 us of tensor-core work; kernels/kda/NOTES.md, session 24). Here one program per
(chunk, head) works on the chunk's four 16-row sub-chunks and on K in slices of BKS columns, one row block at a
time, so that few tiles are live at once (the aim: more programs per SM):

  0. Over the K slices: Gc (the in-chunk cumsum of g) into the fp32 scratch gc, exp(Gc_last), the rows' squared
     norms, and each sub-chunk's decay span_i = c_i - c_{i+1} (c_i: Gc just above sub-chunk i, c_0 = 0).
  1. Per row block i, over the K slices, for j <= i:
         raw_kk[i, j] += (k_i exp(Gc_i - c_i)) (k_j exp(c_i - Gc_j))^T,   raw_qk[i, j] likewise with q_i.
     Both exponentials are <= 1 for j < i (g <= 0: Gc falls); on the diagonal the column side reaches exp(span_i),
     so it is clamped there, and a sub-chunk whose span exceeds SAFE_SPAN (a steep gate) gets its diagonal block
     exactly, elementwise (`_exact_diag_block`), instead. Then the norms and beta: L_ij = beta_i rk_i raw_kk rk_j
     (strictly lower on the diagonal) into the fp32 scratch akk, Aqk_ij = scale rq_i raw_qk rk_j into aqk (zeros
     above the diagonal).
  2. (I + L)^-1 by blocks, stably (no power series; NOTES.md "After run 4"): D_i = (I + L_ii)^-1 by forward
     substitution (the fused kernel's code), X_ij = -D_i sum_{j <= m < i} L_im X_mj, each into akk over L_ij.
  3. Per row block i, over the K slices: qg_i = qn_i exp(Gc_i), kd_i = kn_i exp(Gc_last - Gc_i) and
     W_i = sum_{j <= i} X_ij beta_j kn_j exp(Gc_j); over V slices U_i = sum_{j <= i} X_ij beta_j v_j.
The state pass reads the same scratch (qg, kd, w, u, aqk, gl) as after the fused kernel. The decomposition (16-row
sub-chunks, K slices, the block inverse) is the one fla's chunk_kda uses; own code. Oracle: `ref.kda_chunked`.
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
def _c_above(gc_buf, I: tl.constexpr, offs, BK: tl.constexpr, BC: tl.constexpr):
    """c_I: Gc of the row just above sub-chunk I ([BKS]; 0 above the first)."""
    if I == 0:
        return tl.zeros(offs.shape, dtype=tl.float32)
    else:
        return tl.load(gc_buf + (I * BC - 1) * BK + offs)


@triton.jit
def _pair(acc_kk, acc_qk, ke_i, qe_i, k_h, stride_kt, gc_buf, c_i, n_valid, offs, J: tl.constexpr,
          K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, SAFE_SPAN: tl.constexpr, DOT16: tl.constexpr,
          PREC: tl.constexpr):
    """One K slice of block (i, J): columns k_J exp(c_i - Gc_J), clamped at exp(SAFE_SPAN) (only the diagonal block
    reaches past 1; a steep one is recomputed exactly)."""
    k_j = _rows(k_h, stride_kt, J * BC, n_valid, offs, K, BC)
    kt = tl.trans(k_j * tl.exp(tl.minimum(c_i[None, :] - _gc_rows(gc_buf, J * BC, offs, BK, BC), SAFE_SPAN)))
    return acc_kk + _dot(ke_i, kt, DOT16, PREC), acc_qk + _dot(qe_i, kt, DOT16, PREC)


@triton.jit
def _store_block(ptr, tile, i: tl.constexpr, j: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    loc = tl.arange(0, BC)
    tl.store(ptr + (i * BC + loc)[:, None] * C + (j * BC + loc)[None, :], tile.to(ptr.dtype.element_ty))


@triton.jit
def _load_block(ptr, i: tl.constexpr, j: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
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
def _beta(b_h, stride_bt, I: tl.constexpr, n_valid, BC: tl.constexpr):
    loc = I * BC + tl.arange(0, BC)
    return tl.load(b_h + loc.to(tl.int64) * stride_bt, mask=loc < n_valid, other=0.0)


@triton.jit
def _norms(sq_ptr, I: tl.constexpr, BC: tl.constexpr):
    """(rk, rq / scale) of sub-chunk I from the squared norms phase 0 stored: [2, C] fp32 (k row, then q row)."""
    loc = I * BC + tl.arange(0, BC)
    return 1.0 / tl.sqrt(tl.load(sq_ptr + loc) + 1e-6), 1.0 / tl.sqrt(tl.load(sq_ptr + 4 * BC + loc) + 1e-6)


@triton.jit
def _row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_ptr, span_ptr,
               akk_buf, aqk_buf, n_valid, scale, I: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
               BKS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, SAFE_SPAN: tl.constexpr, DOT16: tl.constexpr,
               PREC: tl.constexpr):
    """Phase 1 for row block I: L's blocks (I, 0..I) into akk, Aqk's row (I, 0..3) into aqk."""
    zb = tl.zeros([BC, BC], dtype=tl.float32)
    kk0, kk1, kk2, kk3, qk0, qk1, qk2, qk3 = zb, zb, zb, zb, zb, zb, zb, zb
    for ks in range(0, BK, BKS):
        offs = ks + tl.arange(0, BKS)
        c_i = _c_above(gc_buf, I, offs, BK, BC)
        e = tl.exp(_gc_rows(gc_buf, I * BC, offs, BK, BC) - c_i[None, :])
        ke = _rows(k_h, stride_kt, I * BC, n_valid, offs, K, BC) * e
        qe = _rows(q_h, stride_qt, I * BC, n_valid, offs, K, BC) * e
        kk0, qk0 = _pair(kk0, qk0, ke, qe, k_h, stride_kt, gc_buf, c_i, n_valid, offs, 0, K, BK, BC, SAFE_SPAN,
                         DOT16, PREC)
        if I >= 1:
            kk1, qk1 = _pair(kk1, qk1, ke, qe, k_h, stride_kt, gc_buf, c_i, n_valid, offs, 1, K, BK, BC,
                             SAFE_SPAN, DOT16, PREC)
        if I >= 2:
            kk2, qk2 = _pair(kk2, qk2, ke, qe, k_h, stride_kt, gc_buf, c_i, n_valid, offs, 2, K, BK, BC,
                             SAFE_SPAN, DOT16, PREC)
        if I >= 3:
            kk3, qk3 = _pair(kk3, qk3, ke, qe, k_h, stride_kt, gc_buf, c_i, n_valid, offs, 3, K, BK, BC,
                             SAFE_SPAN, DOT16, PREC)
    loc = tl.arange(0, BC)
    rk_i, rq_i = _norms(sq_ptr, I, BC)
    rq_i = rq_i * scale
    b_i = _beta(b_h, stride_bt, I, n_valid, BC)
    row_kk = (b_i * rk_i)[:, None]
    # the diagonal block: the dots' or, for a steep sub-chunk, the exact elementwise sums
    if I == 0:
        d_kk, d_qk = kk0, qk0
    elif I == 1:
        d_kk, d_qk = kk1, qk1
    elif I == 2:
        d_kk, d_qk = kk2, qk2
    else:
        d_kk, d_qk = kk3, qk3
    if tl.load(span_ptr + I) > SAFE_SPAN:
        ri = I * BC + loc
        d_kk, d_qk = _exact_diag_block(q_h, k_h, g_h, ri, stride_qt, stride_kt, stride_gt, ri < n_valid,
                                       ri < n_valid, K, BK, 16, BC, True)
    d_kk = tl.where(loc[:, None] > loc[None, :], d_kk * row_kk * rk_i[None, :], 0.0)
    d_qk = tl.where(loc[:, None] >= loc[None, :], d_qk * rq_i[:, None] * rk_i[None, :], 0.0)
    _store_block(akk_buf, d_kk, I, I, C, BC)
    _store_block(aqk_buf, d_qk, I, I, C, BC)
    if I >= 1:
        rk_j, _ = _norms(sq_ptr, 0, BC)
        _store_block(akk_buf, kk0 * row_kk * rk_j[None, :], I, 0, C, BC)
        _store_block(aqk_buf, qk0 * rq_i[:, None] * rk_j[None, :], I, 0, C, BC)
    if I >= 2:
        rk_j, _ = _norms(sq_ptr, 1, BC)
        _store_block(akk_buf, kk1 * row_kk * rk_j[None, :], I, 1, C, BC)
        _store_block(aqk_buf, qk1 * rq_i[:, None] * rk_j[None, :], I, 1, C, BC)
    if I >= 3:
        rk_j, _ = _norms(sq_ptr, 2, BC)
        _store_block(akk_buf, kk2 * row_kk * rk_j[None, :], I, 2, C, BC)
        _store_block(aqk_buf, qk2 * rq_i[:, None] * rk_j[None, :], I, 2, C, BC)
    if I <= 2:
        _store_block(aqk_buf, zb, I, 3, C, BC)
    if I <= 1:
        _store_block(aqk_buf, zb, I, 2, C, BC)
    if I == 0:
        _store_block(aqk_buf, zb, I, 1, C, BC)


@triton.jit
def _out_block(q_h, k_h, v_h, b_h, stride_qt, stride_kt, stride_vt, stride_bt, gc_buf, sq_ptr, akk_buf, qg_buf,
               kd_buf, w_buf, u_buf, n_valid, scale, I: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               BKS: tl.constexpr, BV: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
               DOT16: tl.constexpr, PREC: tl.constexpr):
    """Phase 3 for row block I: qg, kd, W and U rows from X's blocks (I, 0..I) in akk."""
    # T = X diag(beta): block (I, j)'s columns times beta_j
    x0 = _load_block(akk_buf, I, 0, C, BC) * _beta(b_h, stride_bt, 0, n_valid, BC)[None, :]
    x1 = x0
    x2 = x0
    x3 = x0
    if I >= 1:
        x1 = _load_block(akk_buf, I, 1, C, BC) * _beta(b_h, stride_bt, 1, n_valid, BC)[None, :]
    if I >= 2:
        x2 = _load_block(akk_buf, I, 2, C, BC) * _beta(b_h, stride_bt, 2, n_valid, BC)[None, :]
    if I >= 3:
        x3 = _load_block(akk_buf, I, 3, C, BC) * _beta(b_h, stride_bt, 3, n_valid, BC)[None, :]
    rk0, _ = _norms(sq_ptr, 0, BC)
    rk1, _ = _norms(sq_ptr, 1, BC)
    rk2, _ = _norms(sq_ptr, 2, BC)
    rk3, _ = _norms(sq_ptr, 3, BC)
    rk_i, rq_i = _norms(sq_ptr, I, BC)
    for ks in range(0, BK, BKS):
        offs = ks + tl.arange(0, BKS)
        g_last = tl.load(gc_buf + (C - 1) * BK + offs)
        gc_i = _gc_rows(gc_buf, I * BC, offs, BK, BC)
        q_i = _rows(q_h, stride_qt, I * BC, n_valid, offs, K, BC)
        _row_out(qg_buf, q_i * (rq_i * scale)[:, None] * tl.exp(gc_i), I * BC, offs, BK, BC)
        kn_i = _rows(k_h, stride_kt, I * BC, n_valid, offs, K, BC) * rk_i[:, None]
        _row_out(kd_buf, kn_i * tl.exp(g_last[None, :] - gc_i), I * BC, offs, BK, BC)
        kg = _rows(k_h, stride_kt, 0, n_valid, offs, K, BC) * rk0[:, None] * tl.exp(_gc_rows(gc_buf, 0, offs, BK, BC))
        w = _dot(x0, kg, DOT16, PREC)
        if I >= 1:
            kg = _rows(k_h, stride_kt, BC, n_valid, offs, K, BC) * rk1[:, None] * tl.exp(
                _gc_rows(gc_buf, BC, offs, BK, BC))
            w += _dot(x1, kg, DOT16, PREC)
        if I >= 2:
            kg = _rows(k_h, stride_kt, 2 * BC, n_valid, offs, K, BC) * rk2[:, None] * tl.exp(
                _gc_rows(gc_buf, 2 * BC, offs, BK, BC))
            w += _dot(x2, kg, DOT16, PREC)
        if I >= 3:
            kg = _rows(k_h, stride_kt, 3 * BC, n_valid, offs, K, BC) * rk3[:, None] * tl.exp(
                _gc_rows(gc_buf, 3 * BC, offs, BK, BC))
            w += _dot(x3, kg, DOT16, PREC)
        _row_out(w_buf, w, I * BC, offs, BK, BC)
    for vs in range(0, BV, BVS):
        offs = vs + tl.arange(0, BVS)
        u = _dot(x0, _rows(v_h, stride_vt, 0, n_valid, offs, V, BC), DOT16, PREC)
        if I >= 1:
            u += _dot(x1, _rows(v_h, stride_vt, BC, n_valid, offs, V, BC), DOT16, PREC)
        if I >= 2:
            u += _dot(x2, _rows(v_h, stride_vt, 2 * BC, n_valid, offs, V, BC), DOT16, PREC)
        if I >= 3:
            u += _dot(x3, _rows(v_h, stride_vt, 3 * BC, n_valid, offs, V, BC), DOT16, PREC)
        _row_out(u_buf, u, I * BC, offs, BV, BC)


# not specialized per step (kernels/common.py, Compiles): the chunk tables are views of the packed step
@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _kda_intra_blocks_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    qg_ptr, kd_ptr, w_ptr,  # out [NC, H, C, BK]
    u_ptr,  # out [NC, H, C, BV]
    aqk_ptr,  # out [NC, H, C, C]
    gl_ptr,  # out [NC, H, BK] fp32
    gc_ptr,  # fp32 scratch [NC, H, C, BK]: Gc
    akk_ptr,  # fp32 scratch [NC, H, C, C]: L, then X = (I + L)^-1
    sq_ptr,  # fp32 scratch [NC, H, 2, C]: the rows' squared norms (k, then q)
    span_ptr,  # fp32 scratch [NC, H, 4]: each sub-chunk's decay span
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
    BV: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    DOT16: tl.constexpr, PREC: tl.constexpr, PREC_INV: tl.constexpr, SAFE_SPAN: tl.constexpr,
):
    tl.static_assert(C == 4 * BC, "four sub-chunks per chunk")
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, n_valid = _chunk_rows(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, C)
    scr = i_c.to(tl.int64) * H + i_h
    q_h = q_ptr + t0 * stride_qt + i_h * stride_qh
    k_h = k_ptr + t0 * stride_kt + i_h * stride_kh
    v_h = v_ptr + t0 * stride_vt + i_h * stride_vh
    g_h = g_ptr + t0 * stride_gt + i_h * stride_gh
    b_h = beta_ptr + t0 * stride_bt + i_h * stride_bh
    gc_buf = gc_ptr + scr * (C * BK)
    akk_buf = akk_ptr + scr * (C * C)
    aqk_buf = aqk_ptr + scr * (C * C)
    sq_buf = sq_ptr + scr * (2 * C)
    rows = tl.arange(0, C)

    # 0. Gc, exp(Gc_last), squared norms, spans
    sk = tl.zeros([C], dtype=tl.float32)
    sq = tl.zeros([C], dtype=tl.float32)
    span = tl.zeros([4], dtype=tl.float32)
    sub = tl.arange(0, 4)
    for ks in range(0, BK, BKS):
        offs = ks + tl.arange(0, BKS)
        g = _rows(g_h, stride_gt, 0, n_valid, offs, K, C)  # [C, BKS]
        gc = tl.cumsum(g, axis=0)
        tl.store(gc_buf + rows[:, None] * BK + offs[None, :], gc)
        tl.store(gl_ptr + scr * BK + offs, tl.exp(tl.sum(g, axis=0)))
        kr = _rows(k_h, stride_kt, 0, n_valid, offs, K, C)
        qr = _rows(q_h, stride_qt, 0, n_valid, offs, K, C)
        sk += tl.sum(kr * kr, axis=1)
        sq += tl.sum(qr * qr, axis=1)
        # span_i = max_d (c_i - c_{i+1}) = max_d -(sum of g over sub-chunk i)
        s4 = -tl.sum(tl.reshape(g, (4, BC, BKS)), axis=1)  # [4, BKS]
        span = tl.maximum(span, tl.max(s4, axis=1))
    tl.store(sq_buf + rows, sk)
    tl.store(sq_buf + C + rows, sq)
    tl.store(span_ptr + scr * 4 + sub, span)
    tl.debug_barrier()

    # 1. L and Aqk, one row block at a time
    _row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_buf, span_ptr + scr * 4,
               akk_buf, aqk_buf, n_valid, scale, 0, K, BK, BKS, C, BC, SAFE_SPAN, DOT16, PREC)
    _row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_buf, span_ptr + scr * 4,
               akk_buf, aqk_buf, n_valid, scale, 1, K, BK, BKS, C, BC, SAFE_SPAN, DOT16, PREC)
    _row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_buf, span_ptr + scr * 4,
               akk_buf, aqk_buf, n_valid, scale, 2, K, BK, BKS, C, BC, SAFE_SPAN, DOT16, PREC)
    _row_block(q_h, k_h, g_h, b_h, stride_qt, stride_kt, stride_gt, stride_bt, gc_buf, sq_buf, span_ptr + scr * 4,
               akk_buf, aqk_buf, n_valid, scale, 3, K, BK, BKS, C, BC, SAFE_SPAN, DOT16, PREC)
    tl.debug_barrier()

    # 2. (I + L)^-1: the diagonal blocks by forward substitution, all four at once (rows read back from akk)
    _diag_block_inverses(akk_buf, C, BC)
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
    tl.debug_barrier()

    # 3. qg, kd, W, U, one row block at a time
    qg_buf, kd_buf, w_buf = qg_ptr + scr * (C * BK), kd_ptr + scr * (C * BK), w_ptr + scr * (C * BK)
    u_buf = u_ptr + scr * (C * BV)
    _out_block(q_h, k_h, v_h, b_h, stride_qt, stride_kt, stride_vt, stride_bt, gc_buf, sq_buf, akk_buf, qg_buf, kd_buf,
               w_buf, u_buf, n_valid, scale, 0, K, V, BK, BKS, BV, BVS, C, BC, DOT16, PREC)
    _out_block(q_h, k_h, v_h, b_h, stride_qt, stride_kt, stride_vt, stride_bt, gc_buf, sq_buf, akk_buf, qg_buf, kd_buf,
               w_buf, u_buf, n_valid, scale, 1, K, V, BK, BKS, BV, BVS, C, BC, DOT16, PREC)
    _out_block(q_h, k_h, v_h, b_h, stride_qt, stride_kt, stride_vt, stride_bt, gc_buf, sq_buf, akk_buf, qg_buf, kd_buf,
               w_buf, u_buf, n_valid, scale, 2, K, V, BK, BKS, BV, BVS, C, BC, DOT16, PREC)
    _out_block(q_h, k_h, v_h, b_h, stride_qt, stride_kt, stride_vt, stride_bt, gc_buf, sq_buf, akk_buf, qg_buf, kd_buf,
               w_buf, u_buf, n_valid, scale, 3, K, V, BK, BKS, BV, BVS, C, BC, DOT16, PREC)


def launch_intra_blocks(q, k, v, g, beta, cu, t_seq, t_idx, qg, kd, w, u, aqk, gl, gc, akk, sq, span, *,
                        scale: float, block_k: int, block_v: int, num_warps: int, num_stages: int, dot16: bool,
                        prec: str, prec_inv: str, sub: int, safe_span: float) -> None:
    """One launch over all NC chunks x H heads. The buffers are _launch_chunk's: the state pass's scratch (qg, kd,
    w, u, aqk, gl) and this path's fp32 gc [NC, H, C, BK], akk [NC, H, C, C], sq [NC, H, 2, C], span [NC, H, 4]."""
    NC, H, C, BK = qg.shape
    BV = u.shape[3]
    K, V = k.shape[2], v.shape[2]
    assert C == 4 * sub and akk.shape == (NC, H, C, C) and gc.shape == (NC, H, C, BK)
    assert sq.shape == (NC, H, 2, C) and span.shape == (NC, H, 4)
    assert all(t.dtype == torch.float32 for t in (gc, akk, sq, span))
    assert BK % block_k == 0 and BV % block_v == 0
    _kda_intra_blocks_kernel[(NC, H)](
        q, k, v, g, beta,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        cu, t_seq, t_idx,
        qg, kd, w, u, aqk, gl, gc, akk, sq, span,
        scale,
        H=H, K=K, V=V, BK=BK, BKS=block_k, BV=BV, BVS=block_v, C=C, BC=sub,
        DOT16=dot16, PREC=prec, PREC_INV=prec_inv, SAFE_SPAN=safe_span,
        num_warps=num_warps, num_stages=num_stages,
    )
