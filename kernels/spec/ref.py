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
