"""Single-sequence generation on the reference path: one prefill, then cached decode steps.

This is what `k3rt generate` runs. It keeps an incremental KDA state and MLA cache in a
ContiguousCache; the engine core replaces it with the paged, batched scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.sampling.sampler import make_generator, sample
from k3rt.sampling_params import SamplingParams


def generate(model: KimiForCausalLM, prompt_ids: Sequence[int], params: SamplingParams,
             eos_token_ids: Sequence[int] = ()) -> Iterator[int]:
    """Yield generated token ids until a stop token (yielded) or max_tokens."""
    if not prompt_ids:
        raise ValueError("prompt: must contain at least one token")
    limit = model.cfg.max_position_embeddings
    if len(prompt_ids) + params.max_tokens > limit:
        raise ValueError(f"prompt: {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceed the context length {limit}")
    device = model.lm_head.weight.device
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    gen = make_generator(params.seed, device)
    cache = model.new_cache(device)
    n = len(prompt_ids)
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    logits = model(ids, ForwardBatch([n], [0], [cache], logits_indices=torch.tensor([n - 1], device=device)))
    out: list[int] = []
    for step in range(params.max_tokens):
        tok = sample(logits, [params], [gen], [prompt_ids], [out])[0]
        out.append(tok)
        yield tok
        if tok in stops or step + 1 == params.max_tokens:
            return
        logits = model(torch.tensor([tok], device=device), ForwardBatch([1], [n + step], [cache]))
