"""Per-row reference for the batched filters in sampler.py: a readable loop body the tests compare against."""

from __future__ import annotations

import torch

from k3rt.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [V] fp32 -> temperature-scaled logits with filtered tokens at -inf."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        # drop a token when the mass BEFORE it already reaches top_p (the top token always stays)
        drop = (cum - torch.softmax(sorted_x, -1)) >= p.top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    return x
