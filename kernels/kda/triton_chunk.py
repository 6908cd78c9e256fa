"""Chunked KDA prefill (Triton) over a varlen batch, WY/UT-transform form (model-facts §1.3).

Two launches:
  1. `_kda_chunk_intra_kernel`, one program per (chunk, head), all chunks of all sequences in
     parallel. It normalizes q/k, takes the in-chunk cumsum Gc of the log decay, builds
         L[i, j]   = beta_i sum_d k_i[d] exp(Gc_i - Gc_j)[d] k_j[d]      (j < i)
         Aqk[i, j] = sum_d q_i[d] exp(Gc_i - Gc_j)[d] k_j[d]             (j <= i)
     then Tm = (I + L)^-1 diag(beta) by forward substitution, W = Tm (exp(Gc) * K), U = Tm V.
     Off-diagonal 16x16 blocks use tensor-core dots with the decay split at the first row r0 of
     the row block, exp(Gc_i - Gc_r0) * exp(Gc_r0 - Gc_j): both factors are <= 1 because
     j < r0 <= i, so nothing overflows whatever the gate. The diagonal blocks are exact
     elementwise sums. Everything is written to fp32 scratch indexed [chunk, head, row, ...];
     tail chunks are zero-padded (q = k = v = 0, g = 0, beta = 0), which leaves the state exact.
  2. `_kda_chunk_state_kernel`, one program per (V tile, sequence, head), walks the chunks of its
     sequence in order with the state tile S [K, BV] in registers:
         Vnew = U - W S;  O = (q exp(Gc)) S + Aqk Vnew;  S = exp(Gc_last) S + (k exp(Gc_last - Gc))^T Vnew
     It reads the initial state from state[slot], writes the final one back in place, and writes
     prefix-cache snapshots (the state after a chunk boundary) to their destination slots.

The oracle is `ref.kda_chunked` / `ref.kda_recurrent`. Dots take fp32 operands; on the GPU they run
as tf32 unless `precision="ieee"` (the interpreter always computes in full fp32).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.kda.triton_decode import INTERPRET, check, poison_like

CHUNK = 64  # C: tokens per chunk
SUB = 16  # BC: rows per sub-block of the intra-chunk matrices
_EPS = 1e-6


@triton.jit
def _kda_chunk_intra_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # inputs, heads folded in via the strides below
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    cu_ptr,  # [N+1] int32 token offsets
    chunk_seq_ptr, chunk_idx_ptr,  # [NC] int32: sequence of each chunk, chunk index inside it
    qg_ptr, kd_ptr, w_ptr, gc_ptr,  # scratch [NC, H, C, BK] (kd: [NC, H, BK, C]); gc fp32
    u_ptr,  # scratch [NC, H, C, BVF] fp32
    akk_ptr, aqk_ptr,  # scratch [NC, H, C, C] fp32
    nrm_ptr,  # scratch [NC, H, 2, C] fp32: scale/|q_i|, 1/|k_i|
    gl_ptr,  # scratch [NC, H, BK] fp32: exp(Gc_last)
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BKS: tl.constexpr, BKW: tl.constexpr, BVF: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr,
    PREC: tl.constexpr, PREC_INV: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    NB: tl.constexpr = C // BC
    seq = tl.load(chunk_seq_ptr + i_c)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    t0 = bos + tl.load(chunk_idx_ptr + i_c).to(tl.int64) * C
    n_valid = eos - t0  # rows >= n_valid are padding: q = k = v = 0, g = 0, beta = 0

    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    rows = tl.arange(0, C)
    m_row = rows < n_valid
    offs_w = tl.arange(0, BKW)  # column slice used by the whole-chunk [C, *] passes (steps 1 and 5)
    scr = i_c.to(tl.int64) * H + i_h
    tile_w = rows[:, None] * BK + offs_w[None, :]  # offsets of a [C, BKW] slice of a [C, BK] scratch tile
    q_h = q_ptr + t0 * stride_qt + i_h * stride_qh  # row 0 of this chunk, this head
    k_h = k_ptr + t0 * stride_kt + i_h * stride_kh
    off_qw = rows[:, None] * stride_qt + offs_w[None, :]
    off_kw = rows[:, None] * stride_kt + offs_w[None, :]
    gc_buf = gc_ptr + scr * (C * BK)
    nrm = nrm_ptr + scr * (2 * C)
    akk_base = akk_ptr + scr * (C * C)
    aqk_base = aqk_ptr + scr * (C * C)

    # 1. row norms of q and k; in-chunk cumsum Gc of the log decay; in [C, BKW] column slices
    ssq = tl.zeros([C], dtype=tl.float32)
    ssk = tl.zeros([C], dtype=tl.float32)
    g_h = g_ptr + t0 * stride_gt + i_h * stride_gh
    for k0 in range(0, BK, BKW):
        m_w = m_row[:, None] & (k0 + offs_w < K)[None, :]
        x = tl.load(q_h + k0 + off_qw, mask=m_w, other=0.0).to(tl.float32)
        ssq += tl.sum(x * x, axis=1)
        x = tl.load(k_h + k0 + off_kw, mask=m_w, other=0.0).to(tl.float32)
        ssk += tl.sum(x * x, axis=1)
        x = tl.load(g_h + k0 + rows.to(tl.int64)[:, None] * stride_gt + offs_w[None, :], mask=m_w, other=0.0)
        tl.store(gc_buf + k0 + tile_w, tl.cumsum(x, axis=0))
    tl.store(nrm + rows, scale / tl.sqrt(ssq + 1e-6))
    tl.store(nrm + C + rows, 1.0 / tl.sqrt(ssk + 1e-6))
    tl.debug_barrier()

    # 2. L (beta-scaled, strictly lower) and Aqk (lower, diagonal included) in BC x BC blocks.
    loc = tl.arange(0, BC)
    off_rk = loc[:, None] * BK + offs_k[None, :]  # [BC, BK] rows of a [C, BK] scratch tile
    off_rs = loc[:, None] * BK + tl.arange(0, BKS)[None, :]  # [BC, BKS]
    off_qk = loc[:, None] * stride_qt + offs_k[None, :]  # [BC, BK] rows of the q / k inputs
    off_kk = loc[:, None] * stride_kt + offs_k[None, :]
    off_qs = loc[:, None] * stride_qt + tl.arange(0, BKS)[None, :]
    off_ks = loc[:, None] * stride_kt + tl.arange(0, BKS)[None, :]
    off_cc = loc[:, None] * C + loc[None, :]  # [BC, BC] block of a [C, C] tile
    off_b = loc.to(tl.int64) * stride_bt
    tri = loc[:, None, None] >= loc[None, :, None]  # [BC, BC, 1]
    strict = loc[:, None] > loc[None, :]
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    for r in range(NB):
        r0 = r * BC
        m_r = loc < n_valid - r0
        br = tl.load(beta_ptr + (t0 + r0) * stride_bt + i_h * stride_bh + off_b, mask=m_r, other=0.0)
        rq = tl.load(nrm + r0 + loc)
        rk = tl.load(nrm + C + r0 + loc)
        # 2a. diagonal block, exact: sum_d x_i[d] exp(Gc_i[d] - Gc_j[d]) k_j[d] (<= 1 for i >= j)
        a_kk = tl.zeros([BC, BC], dtype=tl.float32)
        a_qk = tl.zeros([BC, BC], dtype=tl.float32)
        for k0 in range(0, BK, BKS):
            m_s = m_r[:, None] & (k0 + tl.arange(0, BKS) < K)[None, :]
            kr = tl.load(k_h + r0 * stride_kt + k0 + off_ks, mask=m_s, other=0.0).to(tl.float32) * rk[:, None]
            qr = tl.load(q_h + r0 * stride_qt + k0 + off_qs, mask=m_s, other=0.0).to(tl.float32) * rq[:, None]
            gr = tl.load(gc_buf + r0 * BK + k0 + off_rs)
            e = tl.exp(tl.where(tri, gr[:, None, :] - gr[None, :, :], float("-inf")))  # [BC, BC, BKS]
            ke = e * kr[None, :, :]
            a_kk += tl.sum(kr[:, None, :] * ke, axis=2)
            a_qk += tl.sum(qr[:, None, :] * ke, axis=2)
        tl.store(akk_base + r0 * (C + 1) + off_cc, tl.where(strict, a_kk * br[:, None], 0.0))
        tl.store(aqk_base + r0 * (C + 1) + off_cc, a_qk.to(aqk_ptr.dtype.element_ty))
        # 2b. blocks left of the diagonal: tensor-core dots with the decay split at row r0,
        # exp(Gc_i - Gc_r0) <= 1 and exp(Gc_r0 - Gc_j) <= 1 since j < r0 <= i
        if r > 0:
            m_rk = m_r[:, None] & mask_k[None, :]
            gref = tl.load(gc_buf + r0 * BK + offs_k)  # [BK]
            er = tl.exp(tl.load(gc_buf + r0 * BK + off_rk) - gref[None, :])
            kr = tl.load(k_h + r0 * stride_kt + off_kk, mask=m_rk, other=0.0).to(tl.float32)
            kr = kr * (rk[:, None] * er)
            qr = tl.load(q_h + r0 * stride_qt + off_qk, mask=m_rk, other=0.0).to(tl.float32)
            qr = qr * (rq[:, None] * er)
            for c in range(r):
                c0 = c * BC
                m_ck = (loc < n_valid - c0)[:, None] & mask_k[None, :]
                kc = tl.load(k_h + c0 * stride_kt + off_kk, mask=m_ck, other=0.0).to(tl.float32)
                ec = tl.exp(gref[None, :] - tl.load(gc_buf + c0 * BK + off_rk))
                kc = kc * (tl.load(nrm + C + c0 + loc)[:, None] * ec)
                a_kk = tl.dot(kr, tl.trans(kc), input_precision=PREC) * br[:, None]
                tl.store(akk_base + (r0 * C + c0) + off_cc, a_kk)
                a_qk = tl.dot(qr, tl.trans(kc), input_precision=PREC)
                tl.store(aqk_base + (r0 * C + c0) + off_cc, a_qk.to(aqk_ptr.dtype.element_ty))
        for c in range(r + 1, NB):
            tl.store(akk_base + (r0 * C + c * BC) + off_cc, zero)
            tl.store(aqk_base + (r0 * C + c * BC) + off_cc, zero.to(aqk_ptr.dtype.element_ty))
    tl.debug_barrier()

    # 3. invert the NB unit-lower diagonal blocks of I + L together, by forward substitution:
    #    X_i = e_i - sum_{m<i} L_im X_m (rows local to each block)
    blk_id = tl.arange(0, NB)
    off_d = (blk_id * (BC * (C + 1)))[:, None] + loc[None, :]  # [NB, BC]: row 0 of each diagonal block
    x_d = tl.where(loc[None, :, None] == loc[None, None, :], 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    for i in range(1, BC):
        l_i = tl.load(akk_base + i * C + off_d)  # [NB, BC]: row i of each block
        new = tl.where(loc[None, :] == i, 1.0, 0.0) - tl.sum(l_i[:, :, None] * x_d, axis=1)  # [NB, BC]
        x_d = tl.where(loc[None, :, None] == i, new[:, None, :], x_d)
    tl.debug_barrier()
    tl.store(akk_base + off_d[:, None, :] + (loc * C)[None, :, None], x_d)  # L's diagonal blocks are done
    tl.debug_barrier()

    # 4. whole inverse: with D^-1 the block-diagonal inverse and A the blocks below it,
    #    (D + A)^-1 = sum_n (-D^-1 A)^n D^-1, a finite sum since D^-1 A is strictly block-lower
    m = tl.load(akk_base + rows[:, None] * C + rows[None, :])
    same = (rows // BC)[:, None] == (rows // BC)[None, :]
    d_inv = tl.where(same, m, 0.0)
    p = tl.dot(d_inv, tl.where(same, 0.0, m), input_precision=PREC_INV)
    x_inv = d_inv
    for _ in tl.static_range(NB - 1):
        x_inv = d_inv - tl.dot(p, x_inv, input_precision=PREC_INV)

    # 5. Tm = (I + L)^-1 diag(beta); W = Tm (exp(Gc) k); U = Tm v; qg = q exp(Gc); kd = k exp(Gc_last - Gc)
    b_all = tl.load(beta_ptr + (t0 + rows).to(tl.int64) * stride_bt + i_h * stride_bh,
                    mask=m_row, other=0.0).to(tl.float32)
    tm = x_inv * b_all[None, :]
    v_h = v_ptr + t0 * stride_vt + i_h * stride_vh
    off_vw = rows[:, None] * stride_vt + offs_w[None, :]
    tile_v = rows[:, None] * BVF + offs_w[None, :]
    for v0 in range(0, BVF, BKW):
        m_w = m_row[:, None] & (v0 + offs_w < V)[None, :]
        x = tl.load(v_h + v0 + off_vw, mask=m_w, other=0.0).to(tl.float32)
        u = tl.dot(tm, x, input_precision=PREC)
        tl.store(u_ptr + scr * (C * BVF) + v0 + tile_v, u.to(u_ptr.dtype.element_ty))
    rk = tl.load(nrm + C + rows)[:, None]
    rq = tl.load(nrm + rows)[:, None]
    for k0 in range(0, BK, BKW):
        m_w = m_row[:, None] & (k0 + offs_w < K)[None, :]
        gc = tl.load(gc_buf + k0 + tile_w)
        g_last = tl.load(gc_buf + (C - 1) * BK + k0 + offs_w)
        x = tl.load(k_h + k0 + off_kw, mask=m_w, other=0.0).to(tl.float32) * rk
        w = tl.dot(tm, x * tl.exp(gc), input_precision=PREC)
        tl.store(w_ptr + scr * (C * BK) + k0 + tile_w, w.to(w_ptr.dtype.element_ty))
        kd = x * tl.exp(g_last[None, :] - gc)  # stored transposed: the state update's A operand
        tl.store(kd_ptr + scr * (BK * C) + (k0 + offs_w)[None, :] * C + rows[:, None], kd.to(kd_ptr.dtype.element_ty))
        tl.store(gl_ptr + scr * BK + k0 + offs_w, tl.exp(g_last))
        x = tl.load(q_h + k0 + off_qw, mask=m_w, other=0.0).to(tl.float32)
        qg = x * (rq * tl.exp(gc))
        tl.store(qg_ptr + scr * (C * BK) + k0 + tile_w, qg.to(qg_ptr.dtype.element_ty))


@triton.jit
def _kda_chunk_state_kernel(
    o_ptr, stride_ot, stride_oh,  # [T_total, H, V]
    cu_ptr,  # [N+1] int32
    chunk_off_ptr,  # [N] int32: global index of each sequence's first chunk
    slot_ptr,  # [N] int32/int64: state slot (negative: zero start, final state not stored)
    init_ptr,  # [N] int32: 1 = read the initial state from the slot, 0 = start from zeros
    snap_ptr,  # [NC] int32: slot that receives the state after this chunk, or -1
    state_ptr,  # [num_slots, H, K, V] fp32
    qg_ptr, kd_ptr, w_ptr, u_ptr, aqk_ptr, gl_ptr,  # scratch from the intra kernel
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
    C: tl.constexpr,
    PREC: tl.constexpr,
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
    S = tl.load(state_ptr + slot * (H * K * V) + s_off, mask=mask_s & use_init, other=0.0)  # [BK, BV]

    for ic in range(tl.cdiv(eos - bos, C)):
        t0 = bos + ic * C
        scr = (c0 + ic) * H + i_h
        # block pointers: no per-element pointer tensors in registers (scratch tiles are padded);
        # 16-bit scratch only halves the traffic: the dots always take fp32 operands (tf32 on the
        # GPU). 16-bit dot operands here hit out-of-bounds shared-memory reads in Triton 3.6 on
        # sm_90 (found with compute-sanitizer).
        w = tl.load(tl.make_block_ptr(w_ptr + scr * (C * BK), (C, BK), (BK, 1), (0, 0), (C, BK), (1, 0)))
        qg = tl.load(tl.make_block_ptr(qg_ptr + scr * (C * BK), (C, BK), (BK, 1), (0, 0), (C, BK), (1, 0)))
        kd_t = tl.load(tl.make_block_ptr(kd_ptr + scr * (BK * C), (BK, C), (C, 1), (0, 0), (BK, C), (1, 0)))
        u = tl.load(tl.make_block_ptr(u_ptr + scr * (C * BVF), (C, BVF), (BVF, 1), (0, i_v * BV), (C, BV), (1, 0)))
        a_qk = tl.load(tl.make_block_ptr(aqk_ptr + scr * (C * C), (C, C), (C, 1), (0, 0), (C, C), (1, 0)))
        w, qg, kd_t = w.to(tl.float32), qg.to(tl.float32), kd_t.to(tl.float32)
        u, a_qk = u.to(tl.float32), a_qk.to(tl.float32)
        g_last = tl.load(gl_ptr + scr * BK + offs_k)  # [BK], exp(Gc_last)

        v_new = u - tl.dot(w, S, input_precision=PREC)  # [C, BV]
        o = tl.dot(qg, S, input_precision=PREC)
        o = tl.dot(a_qk, v_new, o, input_precision=PREC)
        p_o = tl.make_block_ptr(o_ptr + t0 * stride_ot + i_h * stride_oh, (eos - t0, V), (stride_ot, 1),
                                (0, i_v * BV), (C, BV), (1, 0))  # rows past the sequence end are clipped
        tl.store(p_o, o.to(o_ptr.dtype.element_ty), boundary_check=(0, 1))
        # (k exp(Gc_last - Gc))^T is stored pre-transposed by the intra kernel
        S = tl.dot(kd_t, v_new, S * g_last[:, None], input_precision=PREC)  # [BK, BV]
        dest = tl.load(snap_ptr + c0 + ic).to(tl.int64)
        tl.store(state_ptr + dest * (H * K * V) + s_off, S, mask=mask_s & (dest >= 0))
    tl.store(state_ptr + slot * (H * K * V) + s_off, S, mask=mask_s & (slot >= 0))


def _chunk_tables(
    seqlens: list[int],
    snapshot_positions: Sequence[Sequence[int]] | None,
    snapshot_slots: Sequence[Sequence[int]] | None,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host-side tables: (chunk_seq, chunk_idx, chunk_off, snap) as Python int lists."""
    chunk_seq: list[int] = []
    chunk_idx: list[int] = []
    chunk_off: list[int] = []
    for i, n in enumerate(seqlens):
        chunk_off.append(len(chunk_seq))
        nc = -(-n // CHUNK)
        chunk_seq += [i] * nc
        chunk_idx += range(nc)
    snap = [-1] * len(chunk_seq)
    if snapshot_positions is not None:
        if snapshot_slots is None or len(snapshot_slots) != len(seqlens) or len(snapshot_positions) != len(seqlens):
            raise ValueError(
                f"snapshot_positions and snapshot_slots must both hold one list per sequence (N={len(seqlens)}), "
                f"got {None if snapshot_positions is None else len(snapshot_positions)} and "
                f"{None if snapshot_slots is None else len(snapshot_slots)}"
            )
        for i, (pos, dst) in enumerate(zip(snapshot_positions, snapshot_slots)):
            if len(pos) != len(dst):
                raise ValueError(
                    f"sequence {i}: {len(pos)} snapshot positions but {len(dst)} snapshot slots"
                )
            for p, d in zip(pos, dst):
                p, d = int(p), int(d)
                if not (0 < p <= seqlens[i]) or (p % CHUNK != 0 and p != seqlens[i]):
                    raise ValueError(
                        f"sequence {i}: snapshot position must satisfy 0 < p <= T={seqlens[i]} and be a "
                        f"multiple of {CHUNK} or equal T; got {p}"
                    )
                if d < 0:
                    raise ValueError(f"sequence {i}: snapshot slot must be >= 0, got {d}")
                c = chunk_off[i] + -(-p // CHUNK) - 1
                if snap[c] != -1:
                    raise ValueError(f"sequence {i}: two snapshots at position {p}")
                snap[c] = d
    elif snapshot_slots is not None:
        raise ValueError("snapshot_slots given without snapshot_positions")
    return chunk_seq, chunk_idx, chunk_off, snap


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
    scratch_dtype: torch.dtype = torch.float32,
    block_v: int = 32,
    num_warps_intra: int = 8,
    num_warps_state: int = 8,
    num_stages_state: int = 1,
) -> Tensor:
    """Chunked KDA prefill over a packed varlen batch; states are read and written in place.

    Args:
        q, k: [T_total, H, K] after conv + SiLU (not normalized: l2norm and scale happen inside).
            Any float dtype; the last dim must be contiguous (views like qkv.unbind are fine).
        v: [T_total, H, V], same dtype as q.
        g: [T_total, H, K] fp32 log decay (<= 0), already gated.
        beta: [T_total, H] fp32, already through the sigmoid.
        cu_seqlens: [N+1] int32 token offsets of the N sequences (on the device).
        state: [num_slots, H, K, V] fp32. Sequence i starts from state[slot_indices[i]] (or zeros,
            see has_initial_state) and its final state is written back there.
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
        precision: "tf32" (default), "tf32x3" or "ieee" for the fp32 dots on the GPU.
        scratch_dtype: storage dtype of the per-chunk intermediates the sequential pass reads
            (torch.float32, or torch.bfloat16 / torch.float16 for half their traffic; the dots
            still take fp32 operands and the state stays fp32).
        block_v, num_warps_*, num_stages_state: launch tuning.

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
    if not state.is_contiguous():
        raise ValueError("state must be contiguous")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 [N+1], got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    N = cu_seqlens.numel() - 1
    if slot_indices.shape != (N,) or slot_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_indices must be int32/int64 [N]=[{N}], got {slot_indices.dtype} {list(slot_indices.shape)}"
        )
    if precision not in ("tf32", "ieee", "tf32x3"):
        raise ValueError(f"precision must be 'tf32', 'tf32x3' or 'ieee', got {precision!r}")
    if scratch_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"scratch_dtype must be float32, bfloat16 or float16, got {scratch_dtype}")
    if K > 256 or V > 256:
        raise ValueError(f"head dims must be <= 256, got K={K}, V={V}")
    if cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.tolist()  # one device sync
    elif isinstance(cu_seqlens_cpu, Tensor):
        cu_seqlens_cpu = cu_seqlens_cpu.tolist()
    cu = [int(x) for x in cu_seqlens_cpu]
    if len(cu) != N + 1 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T_total={T} with N+1={N + 1} entries, got {cu}")
    seqlens = [b - a for a, b in zip(cu, cu[1:])]
    chunk_seq, chunk_idx, chunk_off, snap = _chunk_tables(seqlens, snapshot_positions, snapshot_slots)
    NC = len(chunk_seq)
    dev = q.device

    if out is None:
        out = poison_like(torch.empty(T, H, V, dtype=v.dtype, device=dev))
    elif tuple(out.shape) != (T, H, V) or out.stride(-1) != 1 or out.dtype != v.dtype:
        raise ValueError(f"out must be {v.dtype} [T_total, H, V]=[{T}, {H}, {V}], got {out.dtype} {list(out.shape)}")
    if has_initial_state is None:
        init = [1] * N
    else:
        if has_initial_state.shape != (N,):
            raise ValueError(f"has_initial_state must be [N]=[{N}], got {list(has_initial_state.shape)}")
        init = None
    # one host->device copy for all the int tables
    host = chunk_seq + chunk_idx + chunk_off + snap + (init if init is not None else [])
    tables = torch.tensor(host, dtype=torch.int32)
    # pinned: a pageable host-to-device copy would wait for the stream (a host sync per layer)
    tables = (tables.pin_memory() if dev.type == "cuda" else tables).to(dev, non_blocking=True)
    t_seq, t_idx = tables[:NC], tables[NC:2 * NC]
    t_off, t_snap = tables[2 * NC:2 * NC + N], tables[2 * NC + N:3 * NC + N]
    t_init = tables[3 * NC + N:] if init is not None else has_initial_state.to(device=dev, dtype=torch.int32)
    cu_dev = cu_seqlens.to(torch.int32) if cu_seqlens.device == dev else torch.tensor(cu, dtype=torch.int32, device=dev)
    slots = slot_indices.to(dev)

    BK = max(16, triton.next_power_of_2(K))
    BVF = max(16, triton.next_power_of_2(V))
    BV = min(max(16, block_v), BVF)
    scale = K**-0.5 if scale is None else float(scale)
    prec = "ieee" if INTERPRET else precision
    # the block-inverse merge amplifies operand rounding: never below tf32x3 there
    prec_inv = "ieee" if INTERPRET or precision == "ieee" else "tf32x3"
    _launch_chunk(q, k, v, g, beta, out, cu_dev, t_seq, t_idx, t_off, slots, t_init, t_snap, state,
                  NC, N, H, K, V, BK, BV, BVF, scale, prec, prec_inv, num_warps_intra, num_warps_state,
                  num_stages_state, scratch_dtype)
    return out


def _launch_chunk(q, k, v, g, beta, out, cu, t_seq, t_idx, t_off, slots, t_init, t_snap, state,
                  NC, N, H, K, V, BK, BV, BVF, scale, prec, prec_inv, nw_intra, nw_state, ns_state,
                  scratch_dtype) -> None:
    assert q.shape == k.shape == g.shape == (q.shape[0], H, K) and v.shape == out.shape == (q.shape[0], H, V)
    assert q.stride(2) == k.stride(2) == v.stride(2) == g.stride(2) == beta.stride(1) == out.stride(2) == 1
    assert g.dtype == beta.dtype == state.dtype == torch.float32 and state.is_contiguous()
    assert cu.dtype == torch.int32 and cu.shape == (N + 1,)
    assert t_seq.shape == t_idx.shape == t_snap.shape == (NC,) and t_off.shape == t_init.shape == slots.shape == (N,)
    assert BK >= K and BVF >= V and BVF % BV == 0
    if NC == 0:
        return
    dev = q.device
    C = CHUNK

    def buf(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return poison_like(torch.empty(*shape, dtype=dtype, device=dev))

    sd = scratch_dtype  # what the state kernel reads: qg, kd, w, u, aqk
    qg, kd, w = buf(NC, H, C, BK, dtype=sd), buf(NC, H, BK, C, dtype=sd), buf(NC, H, C, BK, dtype=sd)
    gc = buf(NC, H, C, BK)
    u, akk, aqk = buf(NC, H, C, BVF, dtype=sd), buf(NC, H, C, C), buf(NC, H, C, C, dtype=sd)
    nrm, gl = buf(NC, H, 2, C), buf(NC, H, BK)
    _kda_chunk_intra_kernel[(NC, H)](
        q, k, v, g, beta,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        cu, t_seq, t_idx,
        qg, kd, w, gc, u, akk, aqk, nrm, gl,
        scale,
        H=H, K=K, V=V, BK=BK, BKS=min(BK, 16), BKW=min(BK, BVF, 32), BVF=BVF, C=C, BC=SUB,
        PREC=prec, PREC_INV=prec_inv,
        num_warps=nw_intra,
    )
    _kda_chunk_state_kernel[(BVF // BV, N, H)](
        out, out.stride(0), out.stride(1),
        cu, t_off, slots, t_init, t_snap, state,
        qg, kd, w, u, aqk, gl,
        H=H, K=K, V=V, BK=BK, BV=BV, BVF=BVF, C=C, PREC=prec,
        num_warps=nw_state, num_stages=ns_state,
    )
