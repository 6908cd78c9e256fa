"""Sampling for a step's logits: greedy batches take one argmax on the device; everything else goes
through the batched sampler (penalties, grammar bitmask, logprobs), shared with the reference runner."""

from __future__ import annotations

import torch

from k3rt.backend.runner.sampling import sample_requests
from k3rt.backend.sampling.sampler import Sampler


def _plain_greedy(r) -> bool:
    p = r.params
    return (p.temperature == 0 and r.grammar is None and p.logprobs is None and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty)


def sample_step(sampler: Sampler, logits: torch.Tensor, reqs: list) -> dict[int, int]:
    if reqs and all(_plain_greedy(r) for r in reqs):
        return {r.rid: t for r, t in zip(reqs, torch.argmax(logits, dim=-1).tolist())}
    return sample_requests(sampler, logits, reqs)
