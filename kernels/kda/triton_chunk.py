"""Chunked KDA prefill (Triton) over a varlen batch, WY/UT-transform form (model-facts §1.3).

Launches:
  1. `_kda_chunk_intra_kernel`, one program per (chunk, head), all chunks of all sequences in
     parallel, everything for one chunk in registers. It normalizes q/k, takes the in-chunk cumsum
     Gc of the log decay, and builds, one block of BC = 16 rows at a time,
         L[i, j]   = beta_i sum_d k_i[d] exp(Gc_i - Gc_j)[d] k_j[d]      (j < i)
         Aqk[i, j] = sum_d q_i[d] exp(Gc_i - Gc_j)[d] k_j[d]             (j <= i)
     as one [BC, K] x [K, C] tensor-core dot with the decay split at the block's first row r0:
     exp(Gc_i - Gc_r0) <= 1 on the row side, exp(Gc_r0 - Gc_j) on the column side, which is <= 1
     for j < r0 and at most exp(span) inside the block (span = max_d Gc_r0 - Gc_{r0+BC-1}). When
     the span exceeds SAFE_SPAN (a steep gate, possible with the softplus form) the diagonal block
     is computed exactly, elementwise, instead. Then (I + L)^-1 by forward substitution inside the
     16x16 diagonal blocks and a 4-term block series for the rest (step 3 says why not a power series), and
         W = (I + L)^-1 diag(beta) (exp(Gc) k),   U = (I + L)^-1 diag(beta) v,
     plus qg = q exp(Gc), kd = k exp(Gc_last - Gc), exp(Gc_last) and Aqk for the state pass.
     Tail chunks are zero-padded (q = k = v = 0, g = 0, beta = 0), which leaves the state exact.
     With intra="split" two launches of smaller programs compute the same scratch instead
     (triton_intra_split.py: per (chunk, 16-row block, head), then per (chunk, head)).
  2. `_kda_chunk_state_kernel`, one program per (V tile, sequence, head), walks the chunks of its
     sequence in order with the state tile S [K, BV] in registers:
         Vnew = U - W S;  O = qg S + Aqk Vnew;  S = exp(Gc_last) S + kd^T Vnew
     It reads the initial state from state[slot], writes the final one back in place, and writes
     prefix-cache snapshots (the state after a chunk boundary) to their destination slots.
     With split_output it stores S (before each chunk) and Vnew instead of O, and
  3. `_kda_chunk_out_kernel` (split_output only) computes O for all chunks in parallel.

Dots: with 16-bit activations and precision="tf32" (the GPU default) every dot takes bf16
operands with fp32 accumulation (the inverse: tf32); otherwise fp32 operands at `precision`
(the interpreter always computes in full fp32). The state is fp32 throughout.
The oracle is `ref.kda_chunked` / `ref.kda_recurrent`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.kda.chunk_tables import CHUNK, INTRA_FORMS, ChunkTables, chunk_tables
from k3rt.kernels.common import EXACT_DOTS
from k3rt.kernels.kda.triton_decode import _slots_contiguous, check, poison_like

DOT16_MIN_HEAD = 64  # narrowest head dim that takes 16-bit dot operands (see kda_chunk_fwd)
SUB = 16  # BC: rows per block of the intra-chunk matrices
# largest in-block decay (nats) for which the split exp(Gc_i - Gc_r0) * exp(Gc_r0 - Gc_j) is used on
# the diagonal blocks: exp(60) ~ 1e26 and exp(-60) ~ 1e-26 are far inside fp32/bf16 range
SAFE_SPAN = 60.0


@triton.jit
def _dot(a, b, DOT16: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 operands (DOT16) or fp32 operands at PREC."""
    if DOT16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _chunk_rows(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, C: tl.constexpr):
    """Chunk i_c of the step (its tables: sequence, index inside it): the token offset of its first row, and how
    many of its C rows are real (rows >= n_valid are padding: q = k = v = 0, g = 0, beta = 0)."""
    seq = tl.load(chunk_seq_ptr + i_c)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    t0 = bos + tl.load(chunk_idx_ptr + i_c).to(tl.int64) * C
    return t0, eos - t0


@triton.jit
def _exact_diag_block(q_h, k_h, g_h, ri, stride_qt, stride_kt, stride_g, m_r, m_gr,
                      K: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BC: tl.constexpr, CUMSUM: tl.constexpr):
    """A 16-row diagonal block of L and Aqk computed exactly, for a steep gate (in-block decay > SAFE_SPAN, where the
    dots' split exp(Gc_i - Gc_r0) exp(Gc_r0 - Gc_j) would overflow): the raw sums over d, elementwise,
        d_kk[i, j] = sum_d k_i[d] exp(Gc_i[d] - Gc_j[d]) k_j[d],   d_qk[i, j] = sum_d q_i[d] exp(...) k_j[d]
    for j <= i (each exp <= 1; zero above the diagonal), q and k un-normalized (the callers scale). The block's rows
    are ri of q_h / k_h / g_h; g_h holds Gc (CUMSUM False) or the raw log decay, summed here (CUMSUM True: only
    in-block differences of Gc matter). m_r: the block's real rows; m_gr: the g rows to read."""
    loc = tl.arange(0, BC)
    tri = loc[:, None, None] >= loc[None, :, None]  # [BC, BC, 1]
    d_kk = tl.zeros([BC, BC], dtype=tl.float32)
    d_qk = tl.zeros([BC, BC], dtype=tl.float32)
    for k0 in range(0, BK, BKS):
        offs = k0 + tl.arange(0, BKS)
        m_s = m_r[:, None] & (offs < K)[None, :]
        ks = tl.load(k_h + ri[:, None] * stride_kt + offs[None, :], mask=m_s, other=0.0).to(tl.float32)
        qs = tl.load(q_h + ri[:, None] * stride_qt + offs[None, :], mask=m_s, other=0.0).to(tl.float32)
        # columns >= K: Gc is 0 there (the fused kernel's scratch holds those zeros; raw g rows end at K)
        gs = tl.load(g_h + ri[:, None] * stride_g + offs[None, :], mask=m_gr[:, None] & (offs < K)[None, :],
                     other=0.0)
        if CUMSUM:
            gs = tl.cumsum(gs, axis=0)
        e = tl.exp(tl.where(tri, gs[:, None, :] - gs[None, :, :], float("-inf")))  # [BC, BC, BKS]
        ke = e * ks[None, :, :]
        d_kk += tl.sum(ks[:, None, :] * ke, axis=2)
        d_qk += tl.sum(qs[:, None, :] * ke, axis=2)
    return d_kk, d_qk


@triton.jit
def _diag_block_inverses(akk_buf, C: tl.constexpr, BC: tl.constexpr, SKIP: tl.constexpr = False,
                         REGS: tl.constexpr = False):
    """The C // BC unit-lower diagonal blocks I + L_ii of the [C, C] fp32 scratch akk_buf (L strictly lower there)
    replaced by their inverses, by forward substitution, all blocks at once: X_i = e_i - sum_{m<i} L_im X_m (rows
    local to each block, row i read back from the scratch). SKIP: identities instead (the fused kernel's timing
    probe). REGS: the blocks loaded once and row i taken from the registers, so the BC - 1 steps wait on one load,
    not on one each (the same values: a masked sum adds exact zeros). Ends with a barrier: the caller's threads may
    read any block after it."""
    NB: tl.constexpr = C // BC
    loc = tl.arange(0, BC)
    off_d = (tl.arange(0, NB) * (BC * (C + 1)))[:, None] + loc[None, :]  # [NB, BC]: row 0 of each diagonal block
    x_d = tl.where(loc[None, :, None] == loc[None, None, :], 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    if REGS:
        l_d = tl.load(akk_buf + off_d[:, None, :] + (loc * C)[None, :, None])  # [NB, BC, BC]: the blocks' rows
    if not SKIP:
        for i in range(1, BC):
            if REGS:
                l_i = tl.sum(tl.where(loc[None, :, None] == i, l_d, 0.0), axis=1)
            else:
                l_i = tl.load(akk_buf + i * C + off_d)  # [NB, BC]: row i of each block
            new = tl.where(loc[None, :] == i, 1.0, 0.0) - tl.sum(l_i[:, :, None] * x_d, axis=1)  # [NB, BC]
            x_d = tl.where(loc[None, :, None] == i, new[:, None, :], x_d)
    tl.debug_barrier()
    tl.store(akk_buf + off_d[:, None, :] + (loc * C)[None, :, None], x_d)
    tl.debug_barrier()


# not specialized per step (kernels/common.py, Compiles): the chunk tables are views of the packed step
@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _kda_chunk_intra_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # inputs, heads folded in via the strides below
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    cu_ptr,  # [N+1] int32 token offsets
    chunk_seq_ptr, chunk_idx_ptr,  # [NC] int32: sequence of each chunk, chunk index inside it
    qg_ptr, kd_ptr, w_ptr,  # out [NC, H, C, BK]: q exp(Gc) (normalized, scaled), k exp(Gc_last - Gc), W
    u_ptr,  # out [NC, H, C, BV]
    aqk_ptr,  # out [NC, H, C, C]
    gl_ptr,  # out [NC, H, BK] fp32: exp(Gc_last)
    gc_ptr, akk_ptr,  # fp32 scratch read back by this program: Gc [NC, H, C, BK], L [NC, H, C, C]
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr,
    DOT16: tl.constexpr, PREC: tl.constexpr, PREC_INV: tl.constexpr, SAFE_SPAN: tl.constexpr,
    PROBE: tl.constexpr = 0,
):
    # PROBE (timing only, results wrong; benchmarks/kernels.py's probe_* variants): bits that skip one stage each
    # to see where a program's time goes: 1 the L/Aqk blocks, 2 the diagonal blocks' substitution, 4 the block
    # series, 8 W and U, 16 the cumsum (Gc = g)
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    t0, n_valid = _chunk_rows(cu_ptr, chunk_seq_ptr, chunk_idx_ptr, i_c, C)  # rows >= n_valid: padding

    rows = tl.arange(0, C)
    m_row = rows < n_valid
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    m_ck = m_row[:, None] & mask_k[None, :]
    scr = i_c.to(tl.int64) * H + i_h
    q_h = q_ptr + t0 * stride_qt + i_h * stride_qh  # row 0 of this chunk, this head
    k_h = k_ptr + t0 * stride_kt + i_h * stride_kh
    g_h = g_ptr + t0 * stride_gt + i_h * stride_gh
    b_h = beta_ptr + t0 * stride_bt + i_h * stride_bh
    tile_k = rows[:, None] * BK + offs_k[None, :]  # a [C, BK] scratch tile
    gc_buf = gc_ptr + scr * (C * BK)
    akk_buf = akk_ptr + scr * (C * C)
    aqk_buf = aqk_ptr + scr * (C * C)

    # 1. whole chunk: Gc, norms, qg, kd, exp(Gc_last); k (normalized) and Gc stay live through step 2
    q = tl.load(q_h + rows[:, None] * stride_qt + offs_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
    k = tl.load(k_h + rows[:, None] * stride_kt + offs_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
    g = tl.load(g_h + rows[:, None].to(tl.int64) * stride_gt + offs_k[None, :], mask=m_ck, other=0.0)
    if (PROBE & 16) == 0:
        gc = tl.cumsum(g, axis=0)
    else:
        gc = g
    g_last = tl.sum(g, axis=0)  # Gc of the last row (padding rows add 0)
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6))[:, None]
    qg = q * (scale / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None] * tl.exp(gc)
    tl.store(gc_buf + tile_k, gc)
    tl.store(qg_ptr + scr * (C * BK) + tile_k, qg.to(qg_ptr.dtype.element_ty))
    tl.store(kd_ptr + scr * (C * BK) + tile_k, (k * tl.exp(g_last[None, :] - gc)).to(kd_ptr.dtype.element_ty))
    tl.store(gl_ptr + scr * BK + offs_k, tl.exp(g_last))
    tl.debug_barrier()

    # 2. L and Aqk, one block of BC rows at a time: [BC, K] x [K, C] with the decay split at row r0
    loc = tl.arange(0, BC)
    if (PROBE & 1) == 0:
        for r in tl.static_range(C // BC):
            r0 = r * BC
            ri = r0 + loc
            m_r = ri < n_valid
            m_rk = m_r[:, None] & mask_k[None, :]
            qr = tl.load(q_h + ri[:, None] * stride_qt + offs_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
            kr = tl.load(k_h + ri[:, None] * stride_kt + offs_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
            rq = scale / tl.sqrt(tl.sum(qr * qr, axis=1) + 1e-6)
            rk = 1.0 / tl.sqrt(tl.sum(kr * kr, axis=1) + 1e-6)
            br = tl.load(b_h + ri.to(tl.int64) * stride_bt, mask=m_r, other=0.0)
            gr = tl.load(gc_buf + ri[:, None] * BK + offs_k[None, :])
            gref = tl.load(gc_buf + r0 * BK + offs_k)
            span = tl.max(gref - tl.load(gc_buf + (r0 + BC - 1) * BK + offs_k), axis=0)
            lim = tl.where(span <= SAFE_SPAN, r0 + BC, r0)  # columns j < lim go through the dot
            er = tl.exp(gr - gref[None, :])  # <= 1
            kc_t = tl.trans(k * tl.exp(tl.where(rows[:, None] < lim, gref[None, :] - gc, float("-inf"))))
            a_qk = _dot(qr * (rq[:, None] * er), kc_t, DOT16, PREC)  # [BC, C]
            a_kk = _dot(kr * (rk[:, None] * er), kc_t, DOT16, PREC)
            a_qk = tl.where(rows[None, :] <= ri[:, None], a_qk, 0.0)
            a_kk = tl.where(rows[None, :] < ri[:, None], a_kk * br[:, None], 0.0)
            # a steep gate leaves the diagonal block to the exact path below: don't overwrite it
            keep = (rows[None, :] < lim) | (rows[None, :] >= r0 + BC)
            off_rc = ri[:, None] * C + rows[None, :]
            tl.store(akk_buf + off_rc, a_kk, mask=keep)
            tl.store(aqk_buf + off_rc, a_qk.to(aqk_ptr.dtype.element_ty), mask=keep)
            if span > SAFE_SPAN:
                # exact diagonal block, from the chunk's Gc (every row of it, padding included: loc < BC)
                d_kk, d_qk = _exact_diag_block(q_h, k_h, gc_buf, ri, stride_qt, stride_kt, BK, m_r, loc < BC,
                                               K, BK, BKS, BC, False)
                d_kk = tl.where(loc[:, None] > loc[None, :], d_kk * (br * rk)[:, None] * rk[None, :], 0.0)
                d_qk = d_qk * rq[:, None] * rk[None, :]
                off_d = ri[:, None] * C + ri[None, :]
                tl.store(akk_buf + off_d, d_kk)
                tl.store(aqk_buf + off_d, d_qk.to(aqk_ptr.dtype.element_ty))
    tl.debug_barrier()

    # 3. (I + L)^-1, stably: the NB unit-lower 16x16 diagonal blocks by forward substitution
    #    (X_i = e_i - sum_{m<i} L_im X_m, rows local to each block), then with D^-1 that block-diagonal
    #    inverse and A the blocks below it, (D + A)^-1 = sum_{n<NB} (-D^-1 A)^n D^-1 (D^-1 A is strictly
    #    block-lower). Not the power series of L itself (repeated squaring): with aligned keys and beta
    #    near 1 the entries of L^n grow like binomials and the series cancels catastrophically (relative
    #    error 1e16 against the oracle where this form gives 6e-7; tests/kernels/test_kda_triton.py).
    _diag_block_inverses(akk_buf, C, BC, SKIP=(PROBE & 2) != 0)
    m = tl.load(akk_buf + rows[:, None] * C + rows[None, :])
    same = (rows // BC)[:, None] == (rows // BC)[None, :]
    d_inv = tl.where(same, m, 0.0)
    x = d_inv
    if (PROBE & 4) == 0:
        p = tl.dot(d_inv, tl.where(same, 0.0, m), input_precision=PREC_INV)
        for _ in tl.static_range(C // BC - 1):
            x = d_inv - tl.dot(p, x, input_precision=PREC_INV)

    # 4. Tm = (I + L)^-1 diag(beta); W = Tm (exp(Gc) k); U = Tm v (k and Gc reloaded: fewer live registers
    #    through step 3)
    if (PROBE & 8) == 0:
        tm = x * tl.load(b_h + rows.to(tl.int64) * stride_bt, mask=m_row, other=0.0)[None, :]
        k = tl.load(k_h + rows[:, None] * stride_kt + offs_k[None, :], mask=m_ck, other=0.0).to(tl.float32)
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6))[:, None]
        w = _dot(tm, k * tl.exp(tl.load(gc_buf + tile_k)), DOT16, PREC)
        tl.store(w_ptr + scr * (C * BK) + tile_k, w.to(w_ptr.dtype.element_ty))
        offs_v = tl.arange(0, BV)
        v = tl.load(v_ptr + t0 * stride_vt + i_h * stride_vh + rows[:, None] * stride_vt + offs_v[None, :],
                    mask=m_row[:, None] & (offs_v < V)[None, :], other=0.0)
        u = _dot(tm, v, DOT16, PREC)
        tl.store(u_ptr + scr * (C * BV) + rows[:, None] * BV + offs_v[None, :], u.to(u_ptr.dtype.element_ty))


# not specialized per step (kernels/common.py, Compiles): the chunk tables and slots are views of the packed step
@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_off_ptr", "slot_ptr", "init_ptr", "snap_ptr"])
def _kda_chunk_state_kernel(
    o_ptr, stride_ot, stride_oh,  # [T_total, H, V]
    cu_ptr,  # [N+1] int32
    chunk_off_ptr,  # [N] int32: global index of each sequence's first chunk
    slot_ptr,  # [N] int32/int64: state slot (negative: zero start, final state not stored)
    init_ptr,  # [N] int32: 1 = read the initial state from the slot, 0 = start from zeros
    snap_ptr,  # [NC] int32: slot that receives the state after this chunk, or -1
    state_ptr, stride_s,  # [num_slots, H, K, V] fp32, each slot contiguous, slots stride_s apart
    qg_ptr, kd_ptr, w_ptr, u_ptr, aqk_ptr, gl_ptr,  # from the intra kernel
    h_ptr, vn_ptr,  # SPLIT_O only: out [NC, H, BK, BVF] state before each chunk, [NC, H, C, BVF] Vnew
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
    C: tl.constexpr,
    DOT16: tl.constexpr, PREC: tl.constexpr, SPLIT_O: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_h = tl.program_id(2)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off_ptr + i_n).to(tl.int64)
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    use_init = (tl.load(init_ptr + i_n) != 0) & (slot >= 0)

    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    s_off = i_h * (K * V) + offs_k[:, None] * V + offs_v[None, :]  # within one slot
    S = tl.load(state_ptr + slot * stride_s + s_off, mask=mask_s & use_init, other=0.0)  # [BK, BV]

    for ic in range(tl.cdiv(eos - bos, C)):
        t0 = bos + ic * C
        scr = (c0 + ic) * H + i_h
        # block pointers: no per-element pointer tensors in registers (scratch tiles are padded)
        w = tl.load(tl.make_block_ptr(w_ptr + scr * (C * BK), (C, BK), (BK, 1), (0, 0), (C, BK), (1, 0)))
        kd_t = tl.load(tl.make_block_ptr(kd_ptr + scr * (C * BK), (BK, C), (1, BK), (0, 0), (BK, C), (0, 1)))
        u = tl.load(tl.make_block_ptr(u_ptr + scr * (C * BVF), (C, BVF), (BVF, 1), (0, i_v * BV), (C, BV), (1, 0)))
        g_last = tl.load(gl_ptr + scr * BK + offs_k)  # [BK], exp(Gc_last)
        if SPLIT_O:
            p_h = tl.make_block_ptr(h_ptr + scr * (BK * BVF), (BK, BVF), (BVF, 1), (0, i_v * BV), (BK, BV), (1, 0))
            tl.store(p_h, S.to(h_ptr.dtype.element_ty))
        v_new = u.to(tl.float32) - _dot(w, S, DOT16, PREC)  # [C, BV]
        if SPLIT_O:
            p_vn = tl.make_block_ptr(vn_ptr + scr * (C * BVF), (C, BVF), (BVF, 1), (0, i_v * BV), (C, BV), (1, 0))
            tl.store(p_vn, v_new.to(vn_ptr.dtype.element_ty))
        else:
            qg = tl.load(tl.make_block_ptr(qg_ptr + scr * (C * BK), (C, BK), (BK, 1), (0, 0), (C, BK), (1, 0)))
            a_qk = tl.load(tl.make_block_ptr(aqk_ptr + scr * (C * C), (C, C), (C, 1), (0, 0), (C, C), (1, 0)))
            o = _dot(qg, S, DOT16, PREC) + _dot(a_qk, v_new, DOT16, PREC)
            p_o = tl.make_block_ptr(o_ptr + t0 * stride_ot + i_h * stride_oh, (eos - t0, V), (stride_ot, 1),
                                    (0, i_v * BV), (C, BV), (1, 0))  # rows past the sequence end are clipped
            tl.store(p_o, o.to(o_ptr.dtype.element_ty), boundary_check=(0, 1))
        S = S * g_last[:, None] + _dot(kd_t, v_new, DOT16, PREC)  # [BK, BV]
        dest = tl.load(snap_ptr + c0 + ic).to(tl.int64)
        tl.store(state_ptr + dest * stride_s + s_off, S, mask=mask_s & (dest >= 0))
    tl.store(state_ptr + slot * stride_s + s_off, S, mask=mask_s & (slot >= 0))


# not specialized per step (kernels/common.py, Compiles): the chunk tables are views of the packed step
@triton.jit(do_not_specialize_on_alignment=["cu_ptr", "chunk_seq_ptr", "chunk_idx_ptr"])
def _kda_chunk_out_kernel(
    o_ptr, stride_ot, stride_oh,  # [T_total, H, V]
    cu_ptr, chunk_seq_ptr, chunk_idx_ptr,
    qg_ptr, aqk_ptr, h_ptr, vn_ptr,  # intra and state kernel outputs
    H: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
    C: tl.constexpr, DOT16: tl.constexpr, PREC: tl.constexpr,
):
    """O = qg S + Aqk Vnew for one (V tile, chunk, head), S the state before the chunk."""
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    seq = tl.load(chunk_seq_ptr + i_c)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    t0 = tl.load(cu_ptr + seq).to(tl.int64) + tl.load(chunk_idx_ptr + i_c).to(tl.int64) * C
    scr = i_c.to(tl.int64) * H + i_h
    qg = tl.load(tl.make_block_ptr(qg_ptr + scr * (C * BK), (C, BK), (BK, 1), (0, 0), (C, BK), (1, 0)))
    a_qk = tl.load(tl.make_block_ptr(aqk_ptr + scr * (C * C), (C, C), (C, 1), (0, 0), (C, C), (1, 0)))
    s = tl.load(tl.make_block_ptr(h_ptr + scr * (BK * BVF), (BK, BVF), (BVF, 1), (0, i_v * BV), (BK, BV), (1, 0)))
    vn = tl.load(tl.make_block_ptr(vn_ptr + scr * (C * BVF), (C, BVF), (BVF, 1), (0, i_v * BV), (C, BV), (1, 0)))
    o = _dot(qg, s, DOT16, PREC) + _dot(a_qk, vn, DOT16, PREC)
    p_o = tl.make_block_ptr(o_ptr + t0 * stride_ot + i_h * stride_oh, (eos - t0, V), (stride_ot, 1),
                            (0, i_v * BV), (C, BV), (1, 0))
    tl.store(p_o, o.to(o_ptr.dtype.element_ty), boundary_check=(0, 1))


def kda_chunk_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    state: Tensor,
    slot_indices: Tensor,
    *,
    has_initial_state: Tensor | None = None,
    snapshot_positions: Sequence[Sequence[int]] | None = None,
    snapshot_slots: Sequence[Sequence[int]] | None = None,
    scale: float | None = None,
    cu_seqlens_cpu: Sequence[int] | Tensor | None = None,
    out: Tensor | None = None,
    precision: str = "tf32",
    scratch_dtype: torch.dtype | None = None,
    inv_precision: str | None = None,
    split_output: bool = False,
    intra: str = "fused",
    block_k_split: int = 16,
    num_warps_split: int = 4,
    num_stages_split: int = 1,
    block_k_blocks: int = 32,
    num_warps_blocks: int | None = None,
    num_stages_blocks: int = 2,
    sliced_out_blocks: bool = False,
    l_rows_blocks: bool = True,
    fuse_gc_blocks: bool = False,
    inverse_regs_blocks: bool = False,
    out_chunk_blocks: bool | None = None,
    num_warps_out_chunk: int = 4,
    l_chunk_blocks: bool = False,
    num_warps_l_chunk: int = 4,
    max_registers_l: int | None = None,
    num_warps_gc_blocks: int | None = None,
    block_k_gc_blocks: int | None = None,
    num_warps_inverse_blocks: int = 1,
    num_warps_out_blocks: int | None = None,
    norms_in_l_blocks: bool | None = None,
    gc_sliced_blocks: bool | None = None,
    block_k_out_blocks: int | None = None,
    num_stages_out_blocks: int | None = None,
    block_v: int = 32,
    block_v_out: int = 64,
    num_warps_intra: int = 8,
    num_warps_state: int = 4,
    num_stages_state: int | None = None,
    num_warps_out: int = 4,
    tables: ChunkTables | None = None,
    scratch: dict | None = None,
    probe: int = 0,
) -> Tensor:
    """Chunked KDA prefill over a packed varlen batch; states are read and written in place.

    Args:
        q, k: [T_total, H, K] after conv + SiLU (not normalized: l2norm and scale happen inside).
            Any float dtype; the last dim must be contiguous (views like qkv.unbind are fine).
        v: [T_total, H, V], same dtype as q.
        g: [T_total, H, K] fp32 log decay (<= 0), already gated.
        beta: [T_total, H] fp32, already through the sigmoid.
        cu_seqlens: [N+1] int32 token offsets of the N sequences (on the device).
        state: [num_slots, H, K, V] fp32, each slot contiguous (the slots may be further apart: a page
            pool's view). Sequence i starts from state[slot_indices[i]] (or zeros, see has_initial_state)
            and its final state is written back there.
        slot_indices: [N] int32/int64. A negative slot starts from zeros and stores no final state.
        has_initial_state: optional [N] bool/int tensor; False starts that sequence from zeros
            (its slot is still written). None means every sequence reads its slot.
        snapshot_positions: optional, per sequence, token counts p (multiples of 64, or the
            sequence length) after which the state is also written to the matching slot of
            `snapshot_slots` (prefix-cache snapshots).
        snapshot_slots: per sequence, destination slots matching snapshot_positions.
        scale: query scale; None means K**-0.5.
        cu_seqlens_cpu: the same offsets on the host, to avoid a device sync.
        out: optional [T_total, H, V] output buffer.
        precision: "tf32" (default): on the GPU, 16-bit activations take bf16 tensor-core dots
            (fp32 accumulation) and fp32 ones tf32 dots; "tf32x3" or "ieee": fp32 operands everywhere.
        scratch_dtype: storage dtype of the per-chunk intermediates the state pass reads (None:
            bfloat16 with bf16 dots, else float32; float16 is accepted too).
        inv_precision: input_precision of the (I + L)^-1 dots (None: "tf32" with bf16 dots, else
            "tf32x3", "ieee" when precision is "ieee").
        split_output: the state pass stores per-chunk states and Vnew, and a third, fully parallel
            launch computes the output (instead of the state pass computing it).
        intra: "fused" (this function's default): one intra program per (chunk, head); "split": two launches of
            smaller programs, per (chunk, 16-row block, head) then per (chunk, head) (triton_intra_split.py; no
            faster on the H200, session 14); "blocks" (the GPU runner's default, KernelConfig.kda_intra): four
            launches on 16 x 16 blocks and K slices, the heavy two one program per block or row block
            (triton_intra_blocks.py; 1.16-1.23x faster than fused on the H200, session 32). The state pass is the
            same after each.
        block_k_split, num_warps_split, num_stages_split: the split path's K slice of its first kernel, both
            kernels' warps, and the first kernel's software-pipelining stages (1: no cp.async prefetch of the
            next slice, 128 registers at the Kimi head; 2 or 3 prefetch, 168).
        block_k_blocks, num_warps_blocks, num_stages_blocks: the blocks path's K (and V) slice, and its block and
            row-block programs' warps (None: 2 on 16-bit dots, 4 on the fp32 form, whose output programs spill
            at 2; H200, 16K tokens bf16: 2.29 ms at 2 warps, 2.53 at 4, 2.48 at 1, 3.38 at 8, session 32) and
            stages; sliced_out_blocks: its row-block programs per K or V slice too;
            l_rows_blocks: L and Aqk one program per row block (False: per 16 x 16 block).
            fuse_gc_blocks: no launch for Gc (the in-chunk cumsum of g): L's and W/U's programs take it from g's
            rows themselves (with l_rows_blocks; the same values, no fp32 Gc scratch written or read).
            inverse_regs_blocks: the inverse launch with its blocks in registers (the same values, about 3 waits
            on the scratch per program instead of about 22).
            out_chunk_blocks: W/U's launch one program per (chunk, head) at num_warps_out_chunk warps, reading the
            chunk's k, v and Gc rows once instead of once per row block (not with sliced_out_blocks; sm_90 bf16:
            86 registers at 4 warps, 124 with fuse_gc_blocks, no spills; the fp32 form of heads under
            DOT16_MIN_HEAD spills there). None: on with 16-bit dots, at 3 stages (H200 at 64K tokens, session
            37: that launch 2.37 -> 1.76 ms, 8 x 4K 1.23 -> 0.92).
            l_chunk_blocks: L's and Aqk's launch one program per (chunk, head) at num_warps_l_chunk warps, its four
            row blocks one after another, so blocks 1-3 read the chunk's k and Gc rows from the L1 (with
            l_rows_blocks; the same values).
            max_registers_l: ptxas's register cap for the L launch, row-block or per-chunk (Triton's maxnreg;
            None: its own choice). sm_90 bf16: 254 per row block with fuse_gc_blocks at 2 warps (four programs per
            SM, where 139 without it fit seven; fuse_gc lost 30% on the H100, session 35); 168 fits six, spilling
            56 bytes, 128 eight, spilling 328.
            num_warps_gc_blocks, block_k_gc_blocks: the Gc launch's warps (None: see gc_sliced_blocks) and K slice
            (None: block_k_blocks);
            num_warps_inverse_blocks: the inverse launch's warps; num_warps_out_blocks: the W/U launch's row-block
            programs' warps (None: num_warps_blocks). Per-phase tuning (session 36): the phases' programs differ
            in size, so one warp count need not suit all. The inverse at 1 warp (16 x 16 dots; 168 registers on
            sm_90): 0.57 against 1.11 ms at 4 warps at 64K tokens on the H100 (session 36).
            norms_in_l_blocks: the rows' squared norms taken by L's row-block programs from the rows they load, so
            the Gc launch reads only g (the same values; None: on wherever it applies, l_rows_blocks without
            l_chunk_blocks or fuse_gc_blocks; H100 at 64K: Gc 1.54 -> 0.98 ms, L 2.05 -> 2.43, session 36).
            gc_sliced_blocks (with norms_in_l_blocks): the Gc launch one program per (chunk, K slice of
            block_k_gc_blocks, head), independent, instead of one per (chunk, head) walking the slices (None: with
            norms_in_l_blocks, and num_warps_gc_blocks None then 2, else 4; H200 session 37: Gc 0.95 -> 0.65 ms at
            64K tokens, 0.51 -> 0.34 at 8 x 4K).
            block_k_out_blocks, num_stages_out_blocks: the W/U launch's K and V slice and stages (None: the blocks
            path's, and 3 stages with out_chunk_blocks).
        block_v, block_v_out, num_warps_*, num_stages_state: launch tuning. num_warps_intra 8 (the fused
            intra kernel): 16% faster than 4 at 16K-64K tokens on the H200 (session 24; its [64, 128] fp32
            tiles spill at 4 warps, and 16 were slower again). num_stages_state (None: 3 with 16-bit scratch, the
            state pass prefetching two chunks ahead: its time 0.34 -> 0.26 ms at 8K tokens, 0.64 -> 0.43 at 16K,
            2.29 -> 1.57 at 64K on the H200, session 29; 2 with fp32 scratch, whose three stages exceed the
            shared memory; 4 exceed it at 16 bits; 16-column V tiles and 2 or 8 warps were slower).
        tables: the chunk tables already on the device (`chunk_tables.ChunkTables`, built and validated once
            per step by the GPU runner's step packer and shared by every layer): then cu_seqlens_cpu,
            has_initial_state and the snapshot arguments are not read (the tables hold them), and no
            host table is built or copied.
        scratch: a dict the caller keeps across calls of one shape (the GPU runner: one per step, shared by its
            KDA layers, which run one after another on one stream): the per-chunk intermediates are allocated
            into it once and reused. None: allocated per call.
        probe: timing probes only (the output is wrong when nonzero): bits that make the fused intra kernel
            skip one stage each (its PROBE), so a benchmark can see where its time goes.

    Returns:
        o: [T_total, H, V] in v.dtype.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T_total, H, K], got shape {list(q.shape)}")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (T, H):
        raise ValueError(f"v must be [T_total, H, V]=[{T}, {H}, V], got {list(v.shape)}")
    V = v.shape[2]
    check(k, "k", (T, H, K))
    check(g, "g", (T, H, K), torch.float32)
    check(beta, "beta", (T, H), torch.float32)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if state.dim() != 4 or state.shape[1:] != (H, K, V) or state.dtype != torch.float32:
        raise ValueError(
            f"state must be fp32 [num_slots, H, K, V]=[S, {H}, {K}, {V}], got {state.dtype} {list(state.shape)}"
        )
    if not _slots_contiguous(state):
        raise ValueError(f"state: each slot must be contiguous, slots at least a slot apart (a page pool's view "
                         f"is fine), got strides {state.stride()}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 [N+1], got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    N = cu_seqlens.numel() - 1
    if slot_indices.shape != (N,) or slot_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_indices must be int32/int64 [N]=[{N}], got {slot_indices.dtype} {list(slot_indices.shape)}"
        )
    for name, p in (("precision", precision), ("inv_precision", inv_precision)):
        if p not in ("tf32", "ieee", "tf32x3") and (p is not None or name == "precision"):
            raise ValueError(f"{name} must be 'tf32', 'tf32x3' or 'ieee', got {p!r}")
    if intra not in INTRA_FORMS:
        raise ValueError(f"intra must be one of {INTRA_FORMS}, got {intra!r}")
    if block_k_split not in (16, 32, 64, 128):
        raise ValueError(f"block_k_split must be 16, 32, 64 or 128, got {block_k_split}")
    if num_stages_split not in (1, 2, 3, 4):
        raise ValueError(f"num_stages_split must be 1 to 4, got {num_stages_split}")
    for name, on in (("fuse_gc_blocks", fuse_gc_blocks), ("inverse_regs_blocks", inverse_regs_blocks),
                     ("out_chunk_blocks", out_chunk_blocks), ("l_chunk_blocks", l_chunk_blocks),
                     ("norms_in_l_blocks", norms_in_l_blocks), ("gc_sliced_blocks", gc_sliced_blocks)):
        if on and intra != "blocks":
            raise ValueError(f"{name}: a form of intra='blocks', got intra={intra!r}")
    if scratch_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"scratch_dtype must be float32, bfloat16 or float16, got {scratch_dtype}")
    if K > 256 or V > 256:
        raise ValueError(f"head dims must be <= 256, got K={K}, V={V}")
    dev = q.device
    if out is None:
        out = poison_like(torch.empty(T, H, V, dtype=v.dtype, device=dev))
    elif tuple(out.shape) != (T, H, V) or out.stride(-1) != 1 or out.dtype != v.dtype:
        raise ValueError(f"out must be {v.dtype} [T_total, H, V]=[{T}, {H}, {V}], got {out.dtype} {list(out.shape)}")
    if tables is None:
        tables = _device_tables(cu_seqlens, cu_seqlens_cpu, T, N, has_initial_state, snapshot_positions,
                                snapshot_slots, dev)
    elif tables.chunk_off.shape != (N,) or tables.chunk_seq.shape != (tables.num_chunks,):
        raise ValueError(f"tables: chunk_off must be [N]=[{N}] and chunk_seq [num_chunks]=[{tables.num_chunks}], "
                         f"got {list(tables.chunk_off.shape)} and {list(tables.chunk_seq.shape)}")
    NC = tables.num_chunks
    cu_dev = cu_seqlens.to(device=dev, dtype=torch.int32)  # no copy when it already is
    slots = slot_indices if slot_indices.device == dev else slot_indices.to(dev)

    # the interpreter computes 16-bit dots wrongly: fp32 operands there (EXACT_DOTS; not with K3RT_GPU_NUMERICS).
    # The 16-bit dot path is verified on the H200 at K = V = 128 (the Kimi head); at K = V = 16 (the tiny test
    # checkpoints) the intra kernel hit an illegal memory access on the H200 (2026-11-30, not diagnosed), so heads
    # narrower than DOT16_MIN_HEAD take the fp32-scratch tf32 path.
    dot16 = (not EXACT_DOTS and precision == "tf32" and q.dtype in (torch.bfloat16, torch.float16)
             and min(K, V) >= DOT16_MIN_HEAD)
    prec = "ieee" if EXACT_DOTS else precision
    if inv_precision is None:
        inv_precision = "tf32" if dot16 else ("ieee" if precision == "ieee" else "tf32x3")
    prec_inv = "ieee" if EXACT_DOTS else inv_precision
    if scratch_dtype is None:
        scratch_dtype = torch.bfloat16 if dot16 else torch.float32
    if num_stages_state is None:
        num_stages_state = default_state_stages(scratch_dtype)
    if num_warps_blocks is None:
        num_warps_blocks = 2 if dot16 else 4
    if norms_in_l_blocks is None:  # on wherever the row-block L launch runs
        norms_in_l_blocks = intra == "blocks" and l_rows_blocks and not l_chunk_blocks and not fuse_gc_blocks
    if out_chunk_blocks is None:  # on with 16-bit dots (the fp32 form's per-chunk programs spill on sm_90)
        out_chunk_blocks = intra == "blocks" and dot16 and not sliced_out_blocks
    if num_stages_out_blocks is None and out_chunk_blocks:
        num_stages_out_blocks = 3
    if gc_sliced_blocks is None:  # on wherever the rows' norms leave the Gc launch
        gc_sliced_blocks = norms_in_l_blocks
    if num_warps_gc_blocks is None:
        num_warps_gc_blocks = 2 if gc_sliced_blocks else 4
    cfg = _Launch(
        BK=max(16, triton.next_power_of_2(K)), BVF=max(16, triton.next_power_of_2(V)),
        BV=block_v, BVO=block_v_out, scale=K**-0.5 if scale is None else float(scale),
        dot16=dot16, prec=prec, prec_inv=prec_inv, scratch_dtype=scratch_dtype, split_output=split_output,
        intra=intra, bk_split=block_k_split, nw_split=num_warps_split, ns_split=num_stages_split,
        bk_blocks=block_k_blocks, nw_blocks=num_warps_blocks, ns_blocks=num_stages_blocks,
        sliced_blocks=sliced_out_blocks, lrows_blocks=l_rows_blocks, fuse_gc_blocks=fuse_gc_blocks,
        inverse_regs_blocks=inverse_regs_blocks, out_chunk_blocks=out_chunk_blocks, nw_out_chunk=num_warps_out_chunk,
        l_chunk_blocks=l_chunk_blocks, nw_l_chunk=num_warps_l_chunk, maxnreg_l=max_registers_l,
        nw_gc_blocks=num_warps_gc_blocks, bk_gc_blocks=block_k_gc_blocks or block_k_blocks,
        nw_inverse_blocks=num_warps_inverse_blocks, nw_out_blocks=num_warps_out_blocks or num_warps_blocks,
        norms_in_l_blocks=norms_in_l_blocks, gc_sliced_blocks=gc_sliced_blocks, bk_out_blocks=block_k_out_blocks,
        ns_out_blocks=num_stages_out_blocks,
        nw_intra=num_warps_intra,
        nw_state=num_warps_state, ns_state=num_stages_state, nw_out=num_warps_out,
        probe=probe,
    )
    _launch_chunk(q, k, v, g, beta, out, cu_dev, tables.chunk_seq, tables.chunk_idx, tables.chunk_off, slots,
                  tables.init, tables.snap, state, NC, N, cfg, scratch)
    return out


def default_state_stages(scratch_dtype: torch.dtype) -> int:
    """The state pass's software-pipelining stages: 3 (two chunks prefetched) with 16-bit scratch; 2 with fp32,
    whose three stages need 262-279 KB of shared memory, over the H200's 227 (session 29's GPU tests)."""
    return 3 if scratch_dtype.itemsize == 2 else 2


def _device_tables(cu_seqlens: Tensor, cu_seqlens_cpu: Sequence[int] | Tensor | None, T: int, N: int,
                   has_initial_state: Tensor | None, snapshot_positions: Sequence[Sequence[int]] | None,
                   snapshot_slots: Sequence[Sequence[int]] | None, dev: torch.device) -> ChunkTables:
    """A call's own tables (no `tables` given): checked, built on the host, one host->device copy."""
    if cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.tolist()  # one device sync
    elif isinstance(cu_seqlens_cpu, Tensor):
        cu_seqlens_cpu = cu_seqlens_cpu.tolist()
    cu = [int(x) for x in cu_seqlens_cpu]
    if len(cu) != N + 1 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T_total={T} with N+1={N + 1} entries, got {cu}")
    seqlens = [b - a for a, b in zip(cu, cu[1:])]
    chunk_seq, chunk_idx, chunk_off, snap = chunk_tables(seqlens, snapshot_positions, snapshot_slots)
    NC = len(chunk_seq)
    if has_initial_state is not None and has_initial_state.shape != (N,):
        raise ValueError(f"has_initial_state must be [N]=[{N}], got {list(has_initial_state.shape)}")
    parts = [chunk_seq, chunk_idx, chunk_off, snap]
    if has_initial_state is None:
        parts.append(np.ones(N, dtype=np.int64))
    tables = torch.from_numpy(np.concatenate(parts).astype(np.int32))
    # pinned: a pageable host-to-device copy would wait for the stream (a host sync per call)
    tables = (tables.pin_memory() if dev.type == "cuda" else tables).to(dev, non_blocking=True)
    t_init = tables[3 * NC + N:] if has_initial_state is None else has_initial_state.to(device=dev, dtype=torch.int32)
    return ChunkTables(tables[:NC], tables[NC:2 * NC], tables[2 * NC:2 * NC + N], tables[2 * NC + N:3 * NC + N],
                       t_init, NC)


@dataclass(frozen=True)
class _Launch:
    """Resolved launch choices of one kda_chunk_fwd call."""

    BK: int  # K padded to a power of two
    BVF: int  # V padded to a power of two
    BV: int  # V tile of a state-pass program
    BVO: int  # V tile of an output-pass program
    scale: float
    dot16: bool  # bf16 dot operands
    prec: str  # input_precision of the fp32-operand dots
    prec_inv: str  # input_precision of the (I + L)^-1 dots
    scratch_dtype: torch.dtype
    split_output: bool
    intra: str  # "fused", "split" or "blocks"
    bk_split: int  # column slice of the split intra kernels
    nw_split: int
    ns_split: int  # num_stages of the split path's first kernel
    bk_blocks: int  # K (and V) slice of the blocks intra kernel
    nw_blocks: int
    ns_blocks: int
    sliced_blocks: bool  # the blocks path's phase 3 per (chunk, row block and slice, head)
    lrows_blocks: bool  # the blocks path's phase 1 per row block (else per 16 x 16 block)
    fuse_gc_blocks: bool  # the blocks path without its phase 0 launch (Gc where it is read)
    inverse_regs_blocks: bool  # the blocks path's inverse launch with its blocks in registers
    out_chunk_blocks: bool  # the blocks path's W/U launch one program per (chunk, head)
    nw_out_chunk: int  # its warps
    l_chunk_blocks: bool  # the blocks path's L/Aqk launch one program per (chunk, head)
    nw_l_chunk: int  # its warps
    maxnreg_l: int | None  # the blocks path's L launch's register cap
    nw_gc_blocks: int  # the blocks path's Gc launch's warps
    bk_gc_blocks: int  # and its K slice
    nw_inverse_blocks: int  # the blocks path's inverse launch's warps
    nw_out_blocks: int  # the blocks path's W/U row-block programs' warps
    norms_in_l_blocks: bool  # the blocks path's rows' squared norms in L's launch, not Gc's
    gc_sliced_blocks: bool  # the blocks path's Gc launch per (chunk, K slice, head)
    bk_out_blocks: int | None  # the blocks path's W/U launch's slice (None: bk_blocks)
    ns_out_blocks: int | None  # and stages (None: ns_blocks)
    nw_intra: int
    nw_state: int
    ns_state: int
    nw_out: int
    probe: int = 0  # the fused intra kernel's PROBE (timing only)


def _launch_chunk(q, k, v, g, beta, out, cu, t_seq, t_idx, t_off, slots, t_init, t_snap, state, NC, N,
                  cfg: _Launch, scratch: dict | None = None) -> None:
    T, H, K = q.shape
    V = v.shape[2]
    assert k.shape == g.shape == (T, H, K) and v.shape == out.shape == (T, H, V)
    assert q.stride(2) == k.stride(2) == v.stride(2) == g.stride(2) == beta.stride(1) == out.stride(2) == 1
    assert g.dtype == beta.dtype == state.dtype == torch.float32 and _slots_contiguous(state)
    assert cu.dtype == torch.int32 and cu.shape == (N + 1,)
    assert t_seq.shape == t_idx.shape == t_snap.shape == (NC,) and t_off.shape == t_init.shape == slots.shape == (N,)
    BK, BVF, C = cfg.BK, cfg.BVF, CHUNK
    BV, BVO = min(max(16, cfg.BV), BVF), min(max(16, cfg.BVO), BVF)
    assert BK >= K and BVF >= V and BVF % BV == 0 and BVF % BVO == 0
    if NC == 0:
        return
    dev = q.device

    def buf(name: str, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        key = (name, shape, dtype, dev)
        t = None if scratch is None else scratch.get(key)
        if t is None:
            t = torch.empty(*shape, dtype=dtype, device=dev)
            if scratch is not None:
                scratch[key] = t
        return poison_like(t)  # NaN again on every call when poisoning (tests): a reused buffer holds no old values

    sd = cfg.scratch_dtype  # what the state (and output) pass reads
    qg, kd, w, u = buf("qg", NC, H, C, BK, dtype=sd), buf("kd", NC, H, C, BK, dtype=sd), \
        buf("w", NC, H, C, BK, dtype=sd), buf("u", NC, H, C, BVF, dtype=sd)
    aqk, gl = buf("aqk", NC, H, C, C, dtype=sd), buf("gl", NC, H, BK)
    if cfg.intra == "split":
        from k3rt.kernels.kda import triton_intra_split  # imports this module: not at the top

        akk, kg = buf("akk", NC, H, C, C), buf("kg", NC, H, C, BK, dtype=sd)
        triton_intra_split.launch_intra_split(
            q, k, v, g, beta, cu, t_seq, t_idx, qg, kd, w, u, aqk, gl, akk, kg, scale=cfg.scale,
            block_k=min(cfg.bk_split, BK), num_warps=cfg.nw_split, num_stages=cfg.ns_split, dot16=cfg.dot16,
            prec=cfg.prec, prec_inv=cfg.prec_inv, sub=SUB, safe_span=SAFE_SPAN)
    elif cfg.intra == "blocks":
        from k3rt.kernels.kda import triton_intra_blocks  # imports this module: not at the top

        triton_intra_blocks.launch_intra_blocks(
            q, k, v, g, beta, cu, t_seq, t_idx, qg, kd, w, u, aqk, gl,
            None if cfg.fuse_gc_blocks else buf("gc", NC, H, C, BK),
            buf("akk", NC, H, C, C), buf("sq", NC, H, 2, C),
            buf("span", NC, H, 4 * triton_intra_blocks.span_rows(BK, cfg.bk_gc_blocks, cfg.gc_sliced_blocks)),
            scale=cfg.scale,
            block_k=min(cfg.bk_blocks, BK), block_v=min(cfg.bk_blocks, BVF), num_warps=cfg.nw_blocks,
            num_stages=cfg.ns_blocks, dot16=cfg.dot16, prec=cfg.prec, prec_inv=cfg.prec_inv, sub=SUB,
            safe_span=SAFE_SPAN, sliced_out=cfg.sliced_blocks, l_rows=cfg.lrows_blocks, fuse_gc=cfg.fuse_gc_blocks,
            inverse_regs=cfg.inverse_regs_blocks, out_chunk=cfg.out_chunk_blocks, num_warps_out_chunk=cfg.nw_out_chunk,
            l_chunk=cfg.l_chunk_blocks, num_warps_l_chunk=cfg.nw_l_chunk, maxnreg_l=cfg.maxnreg_l,
            num_warps_gc=cfg.nw_gc_blocks, block_k_gc=min(cfg.bk_gc_blocks, BK),
            num_warps_inverse=cfg.nw_inverse_blocks, num_warps_out=cfg.nw_out_blocks,
            norms_in_l=cfg.norms_in_l_blocks, gc_sliced=cfg.gc_sliced_blocks, block_k_out=cfg.bk_out_blocks,
            num_stages_out=cfg.ns_out_blocks)
    else:
        gc, akk = buf("gc", NC, H, C, BK), buf("akk", NC, H, C, C)
        _kda_chunk_intra_kernel[(NC, H)](
            q, k, v, g, beta,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
            cu, t_seq, t_idx,
            qg, kd, w, u, aqk, gl, gc, akk,
            cfg.scale,
            H=H, K=K, V=V, BK=BK, BKS=min(BK, 16), BV=BVF, C=C, BC=SUB,
            DOT16=cfg.dot16, PREC=cfg.prec, PREC_INV=cfg.prec_inv, SAFE_SPAN=SAFE_SPAN, PROBE=cfg.probe,
            num_warps=cfg.nw_intra,
        )
    split = cfg.split_output
    h, vn = (buf("h", NC, H, BK, BVF, dtype=sd), buf("vn", NC, H, C, BVF, dtype=sd)) if split else (gl, gl)
    _kda_chunk_state_kernel[(BVF // BV, N, H)](
        out, out.stride(0), out.stride(1),
        cu, t_off, slots, t_init, t_snap, state, state.stride(0),
        qg, kd, w, u, aqk, gl, h, vn,
        H=H, K=K, V=V, BK=BK, BV=BV, BVF=BVF, C=C, DOT16=cfg.dot16, PREC=cfg.prec, SPLIT_O=split,
        num_warps=cfg.nw_state, num_stages=cfg.ns_state,
    )
    if split:
        _kda_chunk_out_kernel[(BVF // BVO, NC, H)](
            out, out.stride(0), out.stride(1),
            cu, t_seq, t_idx,
            qg, aqk, h, vn,
            H=H, V=V, BK=BK, BV=BVO, BVF=BVF, C=C, DOT16=cfg.dot16, PREC=cfg.prec,
            num_warps=cfg.nw_out,
        )
