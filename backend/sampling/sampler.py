"""Reference sampler: temperature, top-k, top-p, min-p, per-request seeded generators.

Greedy (temperature 0) is argmax and takes no random numbers, so it is exactly deterministic.
"""

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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, V] fp32, one row per request -> one token id per row."""
    out = []
    for row, p, g in zip(logits, params, generators):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        probs = torch.softmax(filter_logits(row.float(), p), -1)
        out.append(int(torch.multinomial(probs, 1, generator=g)))
    return out


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)
