"""The DSpark drafter's greedy left-to-right steps with the vocabulary split over programs (Triton).

triton_draft.py walks a request's k drafts in one program: at batch 1 that is one SM streaming every draft's
8192 logits and [8192, R] Markov slice tile after tile, ~144 us a pass on the H200 (session 24's profile,
eight ~18 us drafts), a latency chain. Here a draft is one or two launches of P programs per request, each
owning one BLOCK_V slice of the vocabulary, and the cross-slice step (softmax normalizer, argmax) goes through
a small partials buffer:

  no copy head: one launch per draft. Each program takes its slice's argmax (base + Markov bias) and writes it;
    the last program of the request to arrive (an atomic counter) reduces the P partials to the token and
    runs the confidence MLP's tail.
  copy head: two launches per draft. `_split_stats` writes the slice's logits to a [B, V] scratch row and its
    online-softmax max / sum and copy mass; `_split_mix` reads every slice's stats (P numbers), mixes its slice
    (p = (1 - g) softmax + g copy), takes the argmax of log p with max p and sum p, and the last program reduces
    as above.

The next draft's launch reads the token the last one wrote (its Markov code): launches on one stream are
ordered, so no grid-wide barrier is needed (and the Triton interpreter, which runs programs one after another,
runs the same code). Per-element math is triton_draft.py's (`_step_tile`); the cross-slice sums add in another
order, so on fp32 inputs a token differs from ref.py's only where two candidates differ by such a rounding.
Ties go to the lowest index as in torch.argmax: each slice keeps its lowest index among its maximum, the
reduction the lowest among the slices holding the overall maximum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import poison_like
from k3rt.kernels.spec.ref import DraftHeads
from k3rt.kernels.spec.triton_draft_tile import _step_tile

# BLOCK_V per program by default, below and from SPLIT_WIDE_BATCH requests. H200, k3-tiny's drafter (V 8192, rank
# 32, copy head, k 7), one pass from a graph (benchmarks/dspark_pass.py, session 25): at batch 1 / 4 / 16 / 64
# 512-wide slices 58.6 / 63.3 / 73.1 / 134.2 us, 1024-wide 63.0 / 66.5 / 69.7 / 120.6 us; the one-program kernel
# 140.9 / 143.3 / 144.0 / 149.5 us (its best tile)
SPLIT_BLOCK_V = (512, 1024)
SPLIT_WIDE_BATCH = 16


def split_tile(V: int, R: int, B: int = 1) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the split form for vocabulary V, Markov rank R (0: none) and B requests."""
    block_v = max(16, min(SPLIT_BLOCK_V[B >= SPLIT_WIDE_BATCH], triton.next_power_of_2(V)))
    elems = block_v * triton.next_power_of_2(max(R, 1))
    return block_v, 8 if elems >= 8192 else 4


@triton.jit
def _prev_code(anchor_ptr, tok_ptr, b, j, K, min_ptr, rs, rmask, R, HAS_MARKOV: tl.constexpr):
    """The Markov code of draft j's previous token (the anchor for j = 0), zeros without a Markov head."""
    code = tl.zeros(rs.shape, dtype=tl.float32)
    if HAS_MARKOV:
        prev_tok = tl.load(tok_ptr + b * K + j - 1, mask=j > 0, other=0)
        prev = tl.where(j > 0, prev_tok, tl.load(anchor_ptr + b)).to(tl.int64)
        code = tl.load(min_ptr + prev * R + rs, mask=rmask, other=0.0).to(tl.float32)
    return code


@triton.jit
def _reduce_and_finish(best_ptr, idx_ptr, sum_ptr, max_ptr, b, bj, P, code, rs, rmask, pre_ptr, C,
                       cprev_ptr, stride_cprev, ctop_ptr, stride_ctop, cout_ptr, cout_b_ptr, tok_ptr, conf_ptr,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_MARKOV: tl.constexpr,
                       HAS_COPY: tl.constexpr):
    """The last program of a request: the token from the P slices' (best, index) and the confidence MLP's tail
    (with a copy head, top = max p / sum p from the slices' partial max and sum)."""
    ps = tl.arange(0, BLOCK_P)
    pmask = ps < P
    best = tl.load(best_ptr + b * P + ps, mask=pmask, other=float("-inf"))
    idx = tl.load(idx_ptr + b * P + ps, mask=pmask, other=2147483647)
    token = tl.min(tl.where(best == tl.max(best, axis=0), idx, 2147483647), axis=0)
    cs = tl.arange(0, BLOCK_C)
    cmask = cs < C
    acc = tl.load(pre_ptr + bj * C + cs, mask=cmask, other=0.0).to(tl.float32)
    if HAS_COPY:
        p_sum = tl.sum(tl.load(sum_ptr + b * P + ps, mask=pmask, other=0.0), axis=0)
        p_max = tl.max(tl.load(max_ptr + b * P + ps, mask=pmask, other=0.0), axis=0)
        top = (p_max / p_sum).to(ctop_ptr.dtype.element_ty).to(tl.float32)
        acc += top * tl.load(ctop_ptr + cs * stride_ctop, mask=cmask, other=0.0).to(tl.float32)
    if HAS_MARKOV:
        wp = tl.load(cprev_ptr + cs[:, None] * stride_cprev + rs[None, :], mask=cmask[:, None] & rmask[None, :],
                     other=0.0)
        acc += tl.sum(wp.to(tl.float32) * code[None, :], axis=1)
    hid = acc * tl.sigmoid(acc)
    w_out = tl.load(cout_ptr + cs, mask=cmask, other=0.0).to(tl.float32)
    tl.store(conf_ptr + bj, tl.sigmoid(tl.sum(hid * w_out, axis=0) + tl.load(cout_b_ptr).to(tl.float32)))
    tl.store(tok_ptr + bj, token.to(tl.int64))


@triton.jit
def _arrive_last(cnt_ptr, b, P):
    """True in the last program of request b to get here (its counter back to 0 for the next launch); the
    barrier orders every thread's partial stores before the release."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
    return arrived == P - 1


# not specialized per step (kernels/common.py, Compiles): anchors: a per-step slice; j: the draft
@triton.jit(do_not_specialize=["j"], do_not_specialize_on_alignment=["anchor_ptr"])
def _split_stats_kernel(
    base_ptr, anchor_ptr, tok_ptr, copy_ptr, scr_ptr, min_ptr, mout_ptr,
    stat_ptr,  # [3, B, P] fp32: each slice's max, sum of exp(x - max), copy mass
    j, B, K, V, R, P,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, HAS_MARKOV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    rs = tl.arange(0, BLOCK_R)
    rmask = rs < R
    code = _prev_code(anchor_ptr, tok_ptr, b, j, K, min_ptr, rs, rmask, R, HAS_MARKOV)
    offs = p * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < V
    row = (b * K + j) * V
    x = _step_tile(base_ptr, row, mout_ptr, code, offs, valid, rs, rmask, R, HAS_MARKOV)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    tl.store(scr_ptr + b * V + offs, x, mask=valid)
    tl.store(stat_ptr + b * P + p, m)
    tl.store(stat_ptr + (B + b) * P + p, s)
    tl.store(stat_ptr + (2 * B + b) * P + p, tl.sum(tl.load(copy_ptr + row + offs, mask=valid, other=0.0), axis=0))


@triton.jit(do_not_specialize=["j"], do_not_specialize_on_alignment=["anchor_ptr"])
def _split_pick_kernel(
    base_ptr, anchor_ptr, pre_ptr, copy_ptr, gate_ptr, scr_ptr, min_ptr, mout_ptr,
    cprev_ptr, stride_cprev, ctop_ptr, stride_ctop, cout_ptr, cout_b_ptr,
    stat_ptr,  # [3, B, P] fp32 (HAS_COPY): _split_stats' output
    part_ptr,  # [3, B, P] fp32: each slice's best value, sum p, max p
    idx_ptr,  # [B, P] int32: each slice's best index
    cnt_ptr,  # [B] int32, zero between launches
    tok_ptr, conf_ptr,
    j, B, K, V, R, C, P,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_MARKOV: tl.constexpr, HAS_COPY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    bj = b * K + j
    rs = tl.arange(0, BLOCK_R)
    rmask = rs < R
    code = _prev_code(anchor_ptr, tok_ptr, b, j, K, min_ptr, rs, rmask, R, HAS_MARKOV)
    offs = p * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < V
    row = bj * V
    p_sum = 0.0
    p_max = 0.0
    if HAS_COPY:
        ps = tl.arange(0, BLOCK_P)
        pmask = ps < P
        ms = tl.load(stat_ptr + b * P + ps, mask=pmask, other=float("-inf"))
        m_all = tl.max(ms, axis=0)
        ss = tl.load(stat_ptr + (B + b) * P + ps, mask=pmask, other=0.0)
        inv_s = 1.0 / tl.sum(ss * tl.exp(ms - m_all), axis=0)
        mass = tl.sum(tl.load(stat_ptr + (2 * B + b) * P + ps, mask=pmask, other=0.0), axis=0)
        # a draft with no position to copy from keeps softmax(step) whatever its gate says
        g = tl.load(gate_ptr + bj) * tl.where(mass > 0.5, 1.0, 0.0)
        x = tl.load(scr_ptr + b * V + offs, mask=valid, other=float("-inf"))
        cp = tl.load(copy_ptr + row + offs, mask=valid, other=0.0)
        pr = tl.maximum((1.0 - g) * (tl.exp(x - m_all) * inv_s) + g * cp, 1e-12)
        # the argmax of log p, not of p: two p that log rounds together tie, as in the torch path
        val = tl.where(valid, tl.log(pr), float("-inf"))
        pr = tl.where(valid, pr, 0.0)
        p_sum = tl.sum(pr, axis=0)
        p_max = tl.max(pr, axis=0)
    else:
        val = _step_tile(base_ptr, row, mout_ptr, code, offs, valid, rs, rmask, R, HAS_MARKOV)
    best = tl.max(val, axis=0)
    tl.store(part_ptr + b * P + p, best)
    tl.store(part_ptr + (B + b) * P + p, p_sum)
    tl.store(part_ptr + (2 * B + b) * P + p, p_max)
    # the slice's lowest index holding its maximum (an all -inf slice: its first index, never the overall pick
    # unless every slice is all -inf, where ref.py's argmax gives 0 too)
    tl.store(idx_ptr + b * P + p, tl.min(tl.where(val == best, offs, 2147483647), axis=0))
    if _arrive_last(cnt_ptr, b, P):
        _reduce_and_finish(part_ptr, idx_ptr, part_ptr + B * P, part_ptr + 2 * B * P, b, bj, P, code, rs, rmask,
                           pre_ptr, C, cprev_ptr, stride_cprev, ctop_ptr, stride_ctop, cout_ptr, cout_b_ptr,
                           tok_ptr, conf_ptr, BLOCK_P, BLOCK_C, HAS_MARKOV, HAS_COPY)
        tl.store(cnt_ptr + b, 0)


def greedy_draft_split(base: Tensor, anchor_ids: Tensor, conf_pre: Tensor, heads: DraftHeads, copy: Tensor | None,
                       gate: Tensor | None, tokens: Tensor, confidence: Tensor, tile: tuple[int, int]) -> None:
    """k (no copy head) or 2k launches (copy head) of P = cdiv(V, BLOCK_V) programs per request, tile =
    (BLOCK_V, num_warps); `triton_draft.greedy_draft` has checked the contract. Never syncs (CUDA-graph safe:
    the workspaces are allocated here, the counter zeroed by one fill)."""
    B, K, V = base.shape
    C = conf_pre.shape[2]
    R = heads.markov_in.shape[1] if heads.markov_in is not None else 1
    if B == 0:
        return
    block_v, num_warps = tile
    P = triton.cdiv(V, block_v)
    dev = base.device
    part = poison_like(torch.empty(3, B, P, dtype=torch.float32, device=dev))
    idx = poison_like(torch.empty(B, P, dtype=torch.int32, device=dev))
    cnt = torch.zeros(B, dtype=torch.int32, device=dev)
    has_markov, has_copy = heads.markov_in is not None, copy is not None
    dummy = base
    m_in = heads.markov_in if has_markov else dummy
    m_out = heads.markov_out if has_markov else dummy
    c_prev = heads.conf_prev if has_markov else dummy
    c_top = heads.conf_top if has_copy else dummy
    consts = dict(BLOCK_V=block_v, BLOCK_R=triton.next_power_of_2(R), HAS_MARKOV=has_markov, num_warps=num_warps,
                  enable_fp_fusion=False)
    scratch = stats = dummy
    if has_copy:
        scratch = poison_like(torch.empty(B, V, dtype=torch.float32, device=dev))
        stats = poison_like(torch.empty(3, B, P, dtype=torch.float32, device=dev))
    for j in range(K):
        if has_copy:
            _split_stats_kernel[(B, P)](base, anchor_ids, tokens, copy, scratch, m_in, m_out, stats, j, B, K, V, R, P,
                                        **consts)
        _split_pick_kernel[(B, P)](
            base, anchor_ids, conf_pre, copy if has_copy else dummy, gate if has_copy else dummy, scratch, m_in,
            m_out, c_prev, heads.conf_prev.stride(0) if has_markov else 0, c_top,
            heads.conf_top.stride(0) if has_copy else 0, heads.conf_out, heads.conf_out_bias, stats, part, idx, cnt,
            tokens, confidence, j, B, K, V, R, C, P,
            BLOCK_C=triton.next_power_of_2(C), BLOCK_P=triton.next_power_of_2(P), HAS_COPY=has_copy, **consts)
