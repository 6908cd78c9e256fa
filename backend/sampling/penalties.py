"""Repetition, frequency and presence penalties over a batch of rows, each with its own token history.

Order follows vLLM: repetition (HF semantics, over prompt + output), then frequency and presence
(OpenAI semantics, over output only). Rows whose penalties are all off are returned bit-for-bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from k3rt.sampling_params import SamplingParams


def _token_counts(ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """ids: R sequences of token ids -> counts: [R, V] float32, occurrences of each token per row."""
    lengths = torch.tensor([len(s) for s in ids], dtype=torch.long)
    flat = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < vocab_size):
        raise ValueError(f"token ids: must be in [0, {vocab_size}), got [{int(flat.min())}, {int(flat.max())}]")
    rows = torch.repeat_interleave(torch.arange(len(ids)), lengths)
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.float32)
    counts.index_put_((rows, flat), torch.ones(flat.numel()), accumulate=True)
    return counts.to(device)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits: [B, V] fp32 -> penalized logits (a new tensor); one params / prompt / output per row.

    Only rows with a penalty on are touched; their token histories are counted here, on the CPU,
    from the id sequences (an engine that keeps running counts on the device can replace this).
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    vocab_size, device = logits.shape[1], logits.device
    index = torch.tensor(rows, dtype=torch.long, device=device)

    def per_row(name: str) -> torch.Tensor:  # [R, 1]
        return torch.tensor([getattr(params[i], name) for i in rows], dtype=torch.float32, device=device)[:, None]

    x = logits[index]  # [R, V]
    output_counts = _token_counts([output_ids[i] for i in rows], vocab_size, device)  # [R, V]
    prompt_seen = _token_counts([prompt_ids[i] for i in rows], vocab_size, device) > 0
    seen = prompt_seen | (output_counts > 0)
    rep = per_row("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - per_row("frequency_penalty") * output_counts - per_row("presence_penalty") * (output_counts > 0)
    out = logits.clone()
    out[index] = x
    return out
