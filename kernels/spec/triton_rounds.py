"""A device round's bookkeeping in three launches (Triton): backend/runner/gpu/rounds.py's greedy acceptance,
drafter-window shift and step advance, which are its torch oracles (`greedy_accept` with `accept_round`'s
updates, `shift_window`, `advance_step`).

Why: at batch 1 a round is launch-bound. On the H200 (session 23's profile of `--spec-rounds 8`) a round ran
~545 kernels, of which these three steps were ~70 small torch ops (cumprod, gathers, cats, wheres, copies) at
a few microseconds each in the round graph. Here:

  round_accept   one program per sequence: the chain acceptance of its argmax row against the fed drafts, the
                 stop-id and budget cut, then kept, the new anchor, budget and live flag, in place;
  round_shift    programs over (sequence, feature block): the drafter window's rows moved up by the kept count
                 and the round's tapped states appended (each program owns its columns, so the in-place move
                 is safe: every row is read before the barrier, written after it); the first feature block's
                 program also shifts the window's token ids and valid flags;
  round_advance  one program per sequence: the next round's ids, positions and cache slots, the context length
                 and the number of drafts.

Integer math only (the window's states are moved, never computed): equal to the torch ops bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _round_accept_kernel(am_ptr, fed_ptr, nd_ptr, stops_ptr, budget_ptr, live_ptr, anchor_ptr, kept_ptr,
                         P, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    ps = tl.arange(0, BLOCK_P)
    rmask = rs < R
    am = tl.load(am_ptr + s * R + rs, mask=rmask, other=-1)
    # fed[j + 1]: the draft row j's argmax is checked against
    nxt = tl.load(fed_ptr + s * R + rs + 1, mask=rs + 1 < R, other=-2)
    nd = tl.load(nd_ptr + s)
    match = (am == nxt) & (rs < nd) & (rs < R - 1)
    # accepted drafts: the leading run of matches = the first mismatch's index (R - 1 when all match)
    accepted = tl.min(tl.where(match | (rs >= R - 1), R - 1, rs), axis=0)
    stops = tl.load(stops_ptr + s * P + ps, mask=ps < P, other=-1)
    hit = tl.sum(((am[:, None] == stops[None, :]) & (stops[None, :] >= 0)).to(tl.int32), axis=1) > 0
    first_stop = tl.min(tl.where(hit & (rs <= accepted) & rmask, rs, R), axis=0)
    budget = tl.load(budget_ptr + s)
    live = tl.load(live_ptr + s).to(tl.int1)
    cut = tl.minimum(tl.minimum(accepted, first_stop).to(tl.int64), budget - 1)
    kept = tl.where(live, cut + 1, 0)
    ended = live & ((first_stop == cut) | (budget - kept <= 0))
    last = tl.sum(tl.where(rs == kept - 1, am, 0), axis=0)
    anchor = tl.where(kept > 0, last, tl.load(anchor_ptr + s))
    tl.store(anchor_ptr + s, anchor)
    tl.store(budget_ptr + s, budget - kept)
    tl.store(live_ptr + s, (live & (ended == 0)).to(live_ptr.dtype.element_ty))
    tl.store(kept_ptr + s, kept)


def round_accept(argmax: Tensor, fed: Tensor, num_drafts: Tensor, stops: Tensor, budget: Tensor, live: Tensor,
                 anchors: Tensor, kept: Tensor) -> None:
    """In place: greedy_accept's kept [S] into `kept`, and accept_round's updates of anchors, budget and live.
    argmax, fed [S, R] int64 contiguous; num_drafts, budget, anchors, kept [S] int64; live [S] bool; stops [S, P]
    int64 (-1 pads), contiguous."""
    S, R = argmax.shape
    for name, t in (("argmax", argmax), ("fed", fed), ("stops", stops)):
        if not t.is_contiguous() or t.dtype != torch.int64 or t.shape[0] != S:
            raise ValueError(f"{name}: expected a contiguous int64 [{S}, ...], got {t.dtype} {tuple(t.shape)}")
    if fed.shape != (S, R):
        raise ValueError(f"fed: expected [{S}, {R}], got {tuple(fed.shape)}")
    if S == 0:
        return
    P = stops.shape[1]
    _round_accept_kernel[(S,)](argmax, fed, num_drafts, stops, budget, live, anchors, kept, P, R=R,
                               BLOCK_R=triton.next_power_of_2(R), BLOCK_P=triton.next_power_of_2(max(P, 1)),
                               num_warps=1)


@triton.jit
def _round_shift_kernel(ctx_ptr, taps_ptr, tok_ptr, valid_ptr, fed_ptr, kept_ptr, anchor_ptr, F,
                        W: tl.constexpr, R: tl.constexpr, HAS_TOKENS: tl.constexpr,
                        BLOCK_W: tl.constexpr, BLOCK_F: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    fb = tl.program_id(1)
    kept = tl.load(kept_ptr + s)
    if kept > 0:
        ws = tl.arange(0, BLOCK_W)
        fs = fb * BLOCK_F + tl.arange(0, BLOCK_F)
        src = ws + kept  # row w takes the old row w + kept, or the round's fed row w + kept - W
        wmask = ws < W
        fmask = fs < F
        old = src < W
        m2 = (wmask & old)[:, None] & fmask[None, :]
        a = tl.load(ctx_ptr + s * W * F + src[:, None] * F + fs[None, :], mask=m2, other=0.0)
        t2 = (wmask & ~old)[:, None] & fmask[None, :]
        b = tl.load(taps_ptr + s * R * F + (src - W)[:, None] * F + fs[None, :], mask=t2, other=0.0)
        new = tl.where(old[:, None], a, b.to(ctx_ptr.dtype.element_ty))
        # the ids and flags (W elements each) are read by every feature block's program, written by the first's
        v_old = tl.load(valid_ptr + s * W + src, mask=wmask & old, other=1)
        k_old = tl.load(tok_ptr + s * (W + 1) + src, mask=wmask & old & HAS_TOKENS, other=0)
        k_fed = tl.load(fed_ptr + s * R + (src - W), mask=wmask & ~old, other=0)
        tl.debug_barrier()  # every thread's reads of the old rows are done before any row is overwritten
        tl.store(ctx_ptr + s * W * F + ws[:, None] * F + fs[None, :], new, mask=wmask[:, None] & fmask[None, :])
        if fb == 0:
            tl.store(valid_ptr + s * W + ws, tl.where(old, v_old, 1).to(valid_ptr.dtype.element_ty), mask=wmask)
            if HAS_TOKENS:
                tl.store(tok_ptr + s * (W + 1) + ws, tl.where(old, k_old, k_fed), mask=wmask)
                tl.store(tok_ptr + s * (W + 1) + W, tl.load(anchor_ptr + s))


def round_shift(ctx: Tensor, tokens: Tensor | None, valid: Tensor, taps: Tensor, fed: Tensor, kept: Tensor,
                anchor: Tensor) -> None:
    """shift_window in place: ctx [S, W, F], tokens [S, W + 1] int64 or None, valid [S, W] bool, taps [S, R, F]
    (any float dtype: cast to ctx's), fed [S, R] int64, kept and anchor [S] int64; all contiguous."""
    S, W, F = ctx.shape
    R = fed.shape[1]
    for name, t in (("ctx", ctx), ("valid", valid), ("taps", taps), ("fed", fed)) + (
            (("tokens", tokens),) if tokens is not None else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if taps.shape != (S, R, F):
        raise ValueError(f"taps: expected [{S}, {R}, {F}], got {tuple(taps.shape)}")
    if S == 0:
        return
    block_w = triton.next_power_of_2(W)
    block_f = max(16, min(triton.next_power_of_2(F), 8192 // block_w))
    _round_shift_kernel[(S, triton.cdiv(F, block_f))](
        ctx, taps, tokens if tokens is not None else fed, valid, fed, kept, anchor, F, W=W, R=R,
        HAS_TOKENS=tokens is not None, BLOCK_W=block_w, BLOCK_F=block_f, num_warps=4)


@triton.jit
def _round_advance_kernel(ids_ptr, pos_ptr, slot_ptr, lens_ptr, table_ptr, stride_table, kept_ptr, anchor_ptr,
                          drafts_ptr, stride_drafts, real_ptr, limit_ptr, nd_ptr, block_size,
                          R: tl.constexpr, BLOCK_R: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    real = tl.load(real_ptr + s).to(tl.int1)
    if real:
        rs = tl.arange(0, BLOCK_R)
        rmask = rs < R
        kept = tl.load(kept_ptr + s)
        p = tl.minimum(tl.load(pos_ptr + s * R).to(tl.int64) + kept + rs, tl.load(limit_ptr + s))
        d = tl.load(drafts_ptr + s * stride_drafts + rs - 1, mask=rmask & (rs > 0), other=0)
        ids = tl.where(rs == 0, tl.load(anchor_ptr + s), d)
        page = tl.load(table_ptr + s * stride_table + p // block_size, mask=rmask, other=0).to(tl.int64)
        tl.store(ids_ptr + s * R + rs, ids.to(ids_ptr.dtype.element_ty), mask=rmask)
        tl.store(pos_ptr + s * R + rs, p.to(pos_ptr.dtype.element_ty), mask=rmask)
        tl.store(slot_ptr + s * R + rs, (page * block_size + p % block_size).to(slot_ptr.dtype.element_ty),
                 mask=rmask)
        tl.store(lens_ptr + s, (tl.load(lens_ptr + s) + kept).to(lens_ptr.dtype.element_ty))
        tl.store(nd_ptr + s, R - 1)
    else:
        tl.store(nd_ptr + s, 0)


def round_advance(ids: Tensor, pos: Tensor, kv_slot: Tensor, ctx_lens: Tensor, table: Tensor, kept: Tensor,
                  anchor: Tensor, drafts: Tensor, block_size: int, real: Tensor, limit: Tensor,
                  num_drafts: Tensor) -> None:
    """advance_step in place, and num_drafts [S] set to R - 1 for the real sequences (0 for the rest): ids, pos,
    kv_slot [S, R] contiguous; ctx_lens [S]; table [S, max_blocks] (last dim contiguous); kept, anchor, limit [S]
    int64; drafts [S, >= R - 1] int64 (last dim contiguous); real [S] bool."""
    S, R = ids.shape
    for name, t in (("ids", ids), ("pos", pos), ("kv_slot", kv_slot)):
        if t.shape != (S, R) or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous [{S}, {R}], got {tuple(t.shape)} {t.stride()}")
    if drafts.shape[1] < R - 1 or table.stride(1) != 1 or drafts.stride(1) != 1:
        raise ValueError(f"drafts [S, >= {R - 1}] and table need a contiguous last dim, got {tuple(drafts.shape)}")
    if S == 0:
        return
    _round_advance_kernel[(S,)](ids, pos, kv_slot, ctx_lens, table, table.stride(0), kept, anchor, drafts,
                                drafts.stride(0), real, limit, num_drafts, block_size, R=R,
                                BLOCK_R=triton.next_power_of_2(R), num_warps=1)
