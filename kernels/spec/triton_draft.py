"""The DSpark drafter's greedy left-to-right steps in one launch (Triton): ref.py's loop, one program per
request.

Each program walks its request's k drafts in order (each needs the token before it) and the vocabulary in
BLOCK_V tiles, keeping running values per lane and reducing them across the tile once per pass. Without a
copy head one pass per draft: the tile's base logits plus the Markov bias (a [BLOCK_V, R] slice of
markov_out times the previous token's code), and a running argmax. With one, two passes: the first keeps
the online softmax's max and sum and the copy row's mass and writes the logits to a [V] scratch row, the
second reads them back (4 bytes a token, where recomputing would read the Markov slice again: 64 at k3-tiny's
rank 32 in bf16), mixes, and keeps the argmax of log p with max p and sum p for the top probability. Then
the confidence MLP's small tail.

Ties go to the lowest index, as torch.argmax's: a lane takes a later (larger) index only for a strictly
larger value, and the final reduction picks the lowest index among the lanes holding the maximum. On fp32
inputs the tokens equal ref.py's except where two logits differ by a rounding of the Markov dot product (its
sum order differs from a matmul's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import INTERPRET, check, check_same_device, poison_like
from k3rt.kernels.spec.ref import DraftHeads
from k3rt.kernels.spec.triton_draft_split import greedy_draft_split, split_tile
from k3rt.kernels.spec.triton_draft_tile import _step_tile

# [BLOCK_V, R] Markov slice per tile: at most this many elements (k3-tiny's rank 32: BLOCK_V 1024 over 16 warps,
# eight tiles for its 8192-token vocabulary). Per-lane running values keep the loop free of cross-warp
# reductions, so a tile costs about one L2 round trip: fewer, larger tiles cut the latency a program at batch 1
# waits through. Built for sm_90 without spills (tests/kernels/test_spec_sm90_build.py); BLOCK_V 256 at 8 warps
# and 512 at 16 build too (benchmarks/dspark_pass.py times them against the default: `tiles=`).
_TILE_ELEMS = 32768
# the split form by default up to this many requests (prefer_split): faster at every batch measured, 1 to 64
# (triton_draft_split.py's table)
SPLIT_MAX_BATCH = 64


def tiles(V: int, R: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) the launcher uses by default for vocabulary V and Markov rank R (0: no head)."""
    block_r = triton.next_power_of_2(max(R, 1))
    block_v = max(16, min(1024, triton.next_power_of_2(V), _TILE_ELEMS // block_r))
    elems = block_v * block_r
    return block_v, 16 if elems >= 16384 else 8 if elems >= 4096 else 4


# not specialized per step (kernels/common.py, Compiles): anchors: a per-step slice
@triton.jit(do_not_specialize_on_alignment=["anchor_ptr"])
def _greedy_draft_fwd_kernel(
    base_ptr,  # [B, K, V] fp32 contiguous
    anchor_ptr,  # [B] int64
    pre_ptr,  # [B, K, C] contiguous
    copy_ptr, gate_ptr,  # [B, K, V] fp32 contiguous, [B, K] fp32 contiguous (HAS_COPY)
    scr_ptr,  # [B, V] fp32 scratch: the draft's logits between the two passes (HAS_COPY)
    min_ptr, mout_ptr,  # [V, R] contiguous each (HAS_MARKOV)
    cprev_ptr, stride_cprev,  # [C, R] rows stride_cprev apart (HAS_MARKOV)
    ctop_ptr, stride_ctop,  # [C] elements stride_ctop apart (HAS_COPY)
    cout_ptr, cout_b_ptr,  # [C], [1]
    tok_ptr, conf_ptr,  # [B, K] int64, [B, K] fp32
    K, V, R, C,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_MARKOV: tl.constexpr,
    HAS_COPY: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    vs = tl.arange(0, BLOCK_V)
    rs = tl.arange(0, BLOCK_R)
    cs = tl.arange(0, BLOCK_C)
    rmask, cmask = rs < R, cs < C
    w_out = tl.load(cout_ptr + cs, mask=cmask, other=0.0).to(tl.float32)
    b_out = tl.load(cout_b_ptr).to(tl.float32)
    prev = tl.load(anchor_ptr + b).to(tl.int64)
    for j in range(K):
        bj = b * K + j
        row = bj * V
        code = tl.zeros([BLOCK_R], dtype=tl.float32)
        if HAS_MARKOV:
            code = tl.load(min_ptr + prev * R + rs, mask=rmask, other=0.0).to(tl.float32)
        # per-lane running values, reduced across the tile once per draft (no cross-warp reduction per tile);
        # each lane sees its indices in increasing order, so a strict > keeps its first maximum
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK_V], dtype=tl.int32)
        acc = tl.load(pre_ptr + bj * C + cs, mask=cmask, other=0.0).to(tl.float32)
        if HAS_COPY:
            m = tl.full([BLOCK_V], float("-inf"), tl.float32)
            s = tl.zeros([BLOCK_V], dtype=tl.float32)
            mass = tl.zeros([BLOCK_V], dtype=tl.float32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + vs
                valid = offs < V
                x = _step_tile(base_ptr, row, mout_ptr, code, offs, valid, rs, rmask, R, HAS_MARKOV)
                m_new = tl.maximum(m, x)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane past V so far: keep s at 0
                s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
                m = m_new
                mass += tl.load(copy_ptr + row + offs, mask=valid, other=0.0)
                tl.store(scr_ptr + b * V + offs, x, mask=valid)
            # the second pass reads the row other threads of this program wrote (a replicated layout stores once)
            tl.debug_barrier()
            m_all = tl.max(m, axis=0)
            inv_s = 1.0 / tl.sum(s * tl.exp(m - m_all), axis=0)
            # a draft with no position to copy from keeps softmax(step) whatever its gate says
            g = tl.load(gate_ptr + bj) * tl.where(tl.sum(mass, axis=0) > 0.5, 1.0, 0.0)
            p_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
            p_max = tl.zeros([BLOCK_V], dtype=tl.float32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + vs
                valid = offs < V
                x = tl.load(scr_ptr + b * V + offs, mask=valid, other=float("-inf"))
                cp = tl.load(copy_ptr + row + offs, mask=valid, other=0.0)
                p = tl.maximum((1.0 - g) * (tl.exp(x - m_all) * inv_s) + g * cp, 1e-12)
                # the argmax of log p, not of p: two p that log rounds together tie, as in the torch path
                lp = tl.where(valid, tl.log(p), float("-inf"))
                p = tl.where(valid, p, 0.0)
                take = lp > best
                best_i = tl.where(take, offs, best_i)
                best = tl.where(take, lp, best)
                p_sum += p
                p_max = tl.maximum(p_max, p)
            tl.debug_barrier()  # every read of the scratch row is done before the next draft overwrites it
            top = (tl.max(p_max, axis=0) / tl.sum(p_sum, axis=0)).to(ctop_ptr.dtype.element_ty).to(tl.float32)
            acc += top * tl.load(ctop_ptr + cs * stride_ctop, mask=cmask, other=0.0).to(tl.float32)
        else:
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + vs
                valid = offs < V
                x = _step_tile(base_ptr, row, mout_ptr, code, offs, valid, rs, rmask, R, HAS_MARKOV)
                take = x > best
                best_i = tl.where(take, offs, best_i)
                best = tl.where(take, x, best)
        # the row's maximum, then the lowest index holding it (torch.argmax's tie rule); an all -inf row gives 0
        token = tl.min(tl.where(best == tl.max(best, axis=0), best_i, 2147483647), axis=0)
        if HAS_MARKOV:
            wp = tl.load(cprev_ptr + cs[:, None] * stride_cprev + rs[None, :], mask=cmask[:, None] & rmask[None, :],
                         other=0.0)
            acc += tl.sum(wp.to(tl.float32) * code[None, :], axis=1)
        hid = acc * tl.sigmoid(acc)
        tl.store(conf_ptr + bj, tl.sigmoid(tl.sum(hid * w_out, axis=0) + b_out))
        tl.store(tok_ptr + bj, token.to(tl.int64))
        prev = token.to(tl.int64)


def greedy_draft_fwd(base: Tensor, anchor_ids: Tensor, conf_pre: Tensor, heads: DraftHeads, copy: Tensor | None,
                     gate: Tensor | None, scratch: Tensor | None, tokens: Tensor, confidence: Tensor,
                     tile: tuple[int, int]) -> None:
    """One launch of `_greedy_draft_fwd_kernel` with tile = (BLOCK_V, num_warps); `greedy_draft` has checked
    the contract. scratch: [B, V] fp32 with a copy head (else None)."""
    B, K, V = base.shape
    C = conf_pre.shape[2]
    R = heads.markov_in.shape[1] if heads.markov_in is not None else 1
    assert base.is_contiguous() and conf_pre.is_contiguous() and anchor_ids.is_contiguous()
    assert copy is None or (copy.is_contiguous() and gate.is_contiguous() and scratch.shape == (B, V)
                            and scratch.is_contiguous())
    assert heads.markov_in is None or (heads.markov_in.is_contiguous() and heads.markov_out.is_contiguous()
                                       and heads.conf_prev.stride(1) == 1)
    if B == 0:
        return
    block_v, num_warps = tile
    dummy = base
    _greedy_draft_fwd_kernel[(B,)](
        base, anchor_ids, conf_pre,
        copy if copy is not None else dummy, gate if gate is not None else dummy,
        scratch if scratch is not None else dummy,
        heads.markov_in if heads.markov_in is not None else dummy,
        heads.markov_out if heads.markov_out is not None else dummy,
        heads.conf_prev if heads.conf_prev is not None else dummy,
        heads.conf_prev.stride(0) if heads.conf_prev is not None else 0,
        heads.conf_top if heads.conf_top is not None else dummy,
        heads.conf_top.stride(0) if heads.conf_top is not None else 0,
        heads.conf_out, heads.conf_out_bias, tokens, confidence,
        K, V, R, C,
        BLOCK_V=block_v, BLOCK_R=triton.next_power_of_2(R), BLOCK_C=triton.next_power_of_2(C),
        HAS_MARKOV=heads.markov_in is not None, HAS_COPY=copy is not None,
        num_warps=num_warps, enable_fp_fusion=False,
    )


def prefer_split(B: int, V: int) -> bool:
    """Whether `greedy_draft` runs the split form (triton_draft_split.py) by default: compiled (the interpreter
    runs either only when asked), and few requests, where one program per request leaves the GPU idle."""
    return not INTERPRET and B <= SPLIT_MAX_BATCH and V >= 2048


def greedy_draft(base: Tensor, anchor_ids: Tensor, conf_pre: Tensor, heads: DraftHeads,
                 copy: Tensor | None = None, gate: Tensor | None = None, *,
                 tile: tuple[int, int] | None = None, split: bool | None = None) -> tuple[Tensor, Tensor]:
    """ref.greedy_draft: base [B, k, V] fp32, anchor_ids [B] int64, conf_pre [B, k, C], copy [B, k, V] fp32 and
    gate [B, k] fp32 (both or neither) -> (tokens [B, k] int64, confidence [B, k] fp32). split: one program per
    request in one launch (False), or the vocabulary split over programs, one or two launches per draft (True,
    triton_draft_split.py); default `prefer_split`. tile: (BLOCK_V, num_warps) instead of the form's default
    (`tiles(V, R)`, `split_tile(V, R, B)`; benchmarks). Never syncs (CUDA-graph safe)."""
    if base.dim() != 3:
        raise ValueError(f"base must be [B, k, V], got {list(base.shape)}")
    B, K, V = base.shape
    check(base, "base", (B, K, V), torch.float32)
    check(anchor_ids, "anchor_ids", (B,), torch.int64)
    if conf_pre.dim() != 3 or tuple(conf_pre.shape[:2]) != (B, K):
        raise ValueError(f"conf_pre must be [{B}, {K}, C], got {list(conf_pre.shape)}")
    C = conf_pre.shape[2]
    check(heads.conf_out, "heads.conf_out", (C,))
    check(heads.conf_out_bias, "heads.conf_out_bias", (1,))
    if (copy is None) != (gate is None):
        raise ValueError("copy, gate: pass both (a copy head) or neither")
    if copy is not None:
        check(copy, "copy", (B, K, V), torch.float32)
        check(gate, "gate", (B, K), torch.float32)
        if heads.conf_top is None:
            raise ValueError("heads.conf_top: a copy head's confidence reads the top probability; got None")
        check(heads.conf_top, "heads.conf_top", (C,))
    markov = (heads.markov_in is not None, heads.markov_out is not None, heads.conf_prev is not None)
    if len(set(markov)) != 1:
        raise ValueError("heads.markov_in, heads.markov_out, heads.conf_prev: all three (a Markov head) or none")
    if heads.markov_in is not None:
        R = heads.markov_in.shape[-1]
        check(heads.markov_in, "heads.markov_in", (V, R))
        check(heads.markov_out, "heads.markov_out", (V, R))
        check(heads.conf_prev, "heads.conf_prev", (C, R))
        for name in ("markov_in", "markov_out"):
            if not getattr(heads, name).is_contiguous():
                raise ValueError(f"heads.{name}: must be contiguous, got strides {getattr(heads, name).stride()}")
        if heads.conf_prev.stride(1) != 1:
            raise ValueError(f"heads.conf_prev: rows must be contiguous, got strides {heads.conf_prev.stride()}")
    check_same_device(base=base, anchor_ids=anchor_ids, conf_pre=conf_pre, copy=copy, gate=gate,
                      markov_in=heads.markov_in, conf_out=heads.conf_out)
    if split is None:
        split = prefer_split(B, V)
    rank = 0 if heads.markov_in is None else heads.markov_in.shape[1]
    if tile is None:
        tile = split_tile(V, rank, B) if split else tiles(V, rank)
    elif not (tile[0] >= 16 and tile[0] & (tile[0] - 1) == 0 and tile[1] in (1, 2, 4, 8, 16)):
        raise ValueError(f"tile: (BLOCK_V a power of 2 >= 16, num_warps in 1..16 a power of 2), got {tile}")
    tokens = torch.empty(B, K, dtype=torch.int64, device=base.device)
    if split:
        confidence = poison_like(torch.empty(B, K, dtype=torch.float32, device=base.device))
        greedy_draft_split(base.contiguous(), anchor_ids.contiguous(), conf_pre.contiguous(), heads,
                           None if copy is None else copy.contiguous(), None if gate is None else gate.contiguous(),
                           tokens, confidence, tile)
        return tokens, confidence
    scratch = None if copy is None else poison_like(torch.empty(B, V, dtype=torch.float32, device=base.device))
    confidence = poison_like(torch.empty(B, K, dtype=torch.float32, device=base.device))
    greedy_draft_fwd(base.contiguous(), anchor_ids.contiguous(), conf_pre.contiguous(), heads,
                     None if copy is None else copy.contiguous(), None if gate is None else gate.contiguous(),
                     scratch, tokens, confidence, tile)
    return tokens, confidence
