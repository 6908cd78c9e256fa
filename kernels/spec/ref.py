"""Plain-torch oracle of the DSpark drafter's greedy left-to-right steps (backend/spec/dspark/model.py).

The block pass gives every draft j its base logits at once; what stays sequential is small: draft j's
logits get a Markov bias from the token drafted at j - 1, optionally a copy mix, then an argmax, and the
confidence head reads the same previous token. Per request, for j = 0 .. k-1 (prev_0 = the anchor):

  code   = markov_in[prev]                                  [R]   (Markov head only)
  step   = base[j] + round(markov_out @ code)               [V]   (rounded to the table's dtype, as the
                                                                   torch path's linear output is)
  copy head: g = gate[j] if copy[j] has mass (its sum > 0.5) else 0
         p = clamp((1 - g) softmax(step) + g copy[j], 1e-12);  step = log p;  top = max p / sum p
  token  = argmax step (ties: the lowest index, as torch.argmax)
  a      = conf_pre[j] + conf_prev @ code + conf_top * round(top)       [C]
  conf   = sigmoid(conf_out . silu(a) + conf_out_bias)
  prev   = token

conf_pre is the confidence MLP's hidden layer over the draft state plus its bias, computed for all k
drafts at once outside the loop (one matmul); the loop adds the columns that read the previous token's
code and the top probability. Everything here is fp32 math on the given tensors.

Below it, the torch form of a device round's bookkeeping (backend/runner/gpu/rounds.py runs them without the
kernels; triton_rounds.py fuses them): `greedy_accept`, `shift_window`, `advance_step`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class DraftHeads:
    """The drafter's left-to-right heads, as the kernel reads them (views of the model's parameters)."""

    markov_in: Tensor | None  # [V, R] token -> Markov code (None: no Markov head)
    markov_out: Tensor | None  # [V, R] code -> logit bias
    conf_prev: Tensor | None  # [C, R] the confidence hidden layer's columns over the code (None with no Markov head)
    conf_top: Tensor | None  # [C] its column over the top probability (None: no copy head)
    conf_out: Tensor  # [C] the output layer's weight
    conf_out_bias: Tensor  # [1]


def greedy_draft(base: Tensor, anchor_ids: Tensor, conf_pre: Tensor, heads: DraftHeads,
                 copy: Tensor | None = None, gate: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """base [B, k, V] fp32 block logits, anchor_ids [B] int64, conf_pre [B, k, C], copy [B, k, V] fp32 copy
    distributions and gate [B, k] fp32 (both or neither) -> (tokens [B, k] int64, confidence [B, k] fp32)."""
    prev = anchor_ids
    tokens, conf = [], []
    for j in range(base.shape[1]):
        step = base[:, j].float()
        acc = conf_pre[:, j].float()
        if heads.markov_in is not None:
            code = heads.markov_in[prev].float()  # [B, R]
            step = step + (code @ heads.markov_out.float().T).to(heads.markov_out.dtype).float()
            acc = acc + code @ heads.conf_prev.float().T
        if copy is not None:
            g = (gate[:, j] * (copy[:, j].sum(-1) > 0.5))[:, None]
            p = ((1 - g) * torch.softmax(step, -1) + g * copy[:, j]).clamp(min=1e-12)
            step = p.log()
            top = p.amax(-1) / p.sum(-1)
            acc = acc + top.to(heads.conf_top.dtype).float()[:, None] * heads.conf_top.float()
        tok = step.argmax(-1)
        conf.append(torch.sigmoid(F.silu(acc) @ heads.conf_out.float() + heads.conf_out_bias.float()))
        tokens.append(tok)
        prev = tok
    return torch.stack(tokens, 1), torch.stack(conf, 1)


# ---- a device round's bookkeeping (backend/runner/gpu/rounds.py; fused in triton_rounds.py) ----


def greedy_accept(argmax: torch.Tensor, fed: torch.Tensor, num_drafts: torch.Tensor, stop_ids: torch.Tensor,
                  budget: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify round's greedy outcome per sequence.

    argmax [S, R]: the target's argmax at each row; fed [S, R]: the fed tokens (anchor, then drafts);
    num_drafts [S]: real drafts per sequence (rows past 1 + num_drafts are padding); stop_ids [S, P]: each
    sequence's stop token ids (-1 pads); budget [S]: tokens it may still emit; live [S] bool (budget > 0).
    -> (kept [S]: tokens the round emits = fed tokens the state keeps (0 when not live), ended [S] bool).
    The emitted tokens are argmax[:, :kept]: a draft accepted at row j equals row j's argmax."""
    S, R = argmax.shape
    j = torch.arange(R - 1, device=argmax.device)
    match = (argmax[:, :-1] == fed[:, 1:]) & (j[None, :] < num_drafts[:, None])
    accepted = match.to(torch.int64).cumprod(1).sum(1)  # [S]
    idx = torch.arange(R, device=argmax.device)
    stop = (argmax[:, :, None] == stop_ids[:, None, :]).any(-1) & (idx[None, :] <= accepted[:, None])
    first_stop = torch.where(stop, idx[None, :], R).amin(1)  # R: none
    cut = torch.minimum(torch.minimum(accepted, first_stop), budget - 1)
    kept = torch.where(live, cut + 1, 0)
    ended = live & ((first_stop == cut) | (budget - kept <= 0))
    return kept, ended


def shift_window(ctx: torch.Tensor, tokens: torch.Tensor | None, valid: torch.Tensor, taps: torch.Tensor,
                 fed: torch.Tensor, kept: torch.Tensor, anchor: torch.Tensor) -> None:
    """In place: the drafter's window after a round that kept `kept` [n] of each sequence's fed rows.
    ctx [n, W, F]: states of the W positions before the anchor, oldest first; tokens [n, W + 1]: their ids, then
    the anchor's; valid [n, W]: rows that hold a state (left padding of short requests is not); taps [n, R, F]:
    the round's states of its fed rows; fed [n, R]: the fed ids; anchor [n]: the new anchor (the last emitted
    token; where kept is 0 the window stays as it was)."""
    n, W, F = ctx.shape
    idx = kept[:, None] + torch.arange(W, device=ctx.device)[None, :]  # [n, W] rows of [old window | fed rows]
    ctx.copy_(torch.cat([ctx, taps.to(ctx.dtype)], 1).gather(1, idx[:, :, None].expand(n, W, F)))
    if tokens is not None:
        shifted = torch.cat([tokens[:, :W], fed], 1).gather(1, idx)
        tokens[:, :W] = shifted
        tokens[:, W] = torch.where(kept > 0, anchor, tokens[:, W])
    valid.copy_(torch.cat([valid, torch.ones_like(fed, dtype=valid.dtype)], 1).gather(1, idx))


def advance_step(ids: torch.Tensor, pos: torch.Tensor, kv_slot: torch.Tensor, ctx_lens: torch.Tensor,
                 table: torch.Tensor, kept: torch.Tensor, anchor: torch.Tensor, drafts: torch.Tensor,
                 block_size: int, real: torch.Tensor, limit: torch.Tensor) -> None:
    """In place, for the sequences of a verify-form step (views [S, R] of its ids, positions and cache rows;
    ctx_lens [S] int32; table [S, max_blocks] int32): the next round feeds the anchor and R - 1 drafts at the
    positions right after the kept tokens. real [S] bool: the sequences to move (pad sequences stay put).
    limit [S]: each sequence's last position (prompt + max_tokens - 1): rows past it are fed there instead.
    A row at that position or past it can only yield a token beyond max_tokens, and nothing kept ever reads
    what it writes, so the rounds touch no page past the request's own reach (the scheduler allocated pages
    up to it, and it is within the model's length)."""
    R = ids.shape[1]
    start = pos[:, 0] + kept
    p = torch.minimum(start[:, None] + torch.arange(R, device=pos.device)[None, :], limit[:, None])
    new_ids = torch.cat([anchor[:, None], drafts[:, :R - 1]], 1)
    slots = table.gather(1, p // block_size).to(torch.int64) * block_size + p % block_size
    m = real[:, None]
    ids.copy_(torch.where(m, new_ids, ids))
    pos.copy_(torch.where(m, p, pos))
    kv_slot.copy_(torch.where(m, slots, kv_slot))
    ctx_lens.add_(torch.where(real, kept, 0).to(ctx_lens.dtype))
