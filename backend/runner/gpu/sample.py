"""Sampling for the GPU runner's logits, on the device.

  plain greedy batches: one argmax;
  otherwise: the Triton sampler (`k3rt.kernels.sampling.sample`: penalties over the per-request
    token statistics kept on the device (penalties.py), bitmask, temperature, top-k/top-p/min-p, a
    philox draw keyed by (request seed, tokens generated so far), logprobs), with the per-row
    parameters sent in one copy;
  on the CPU, or when penalty state rows run out: the batched host-assisted sampler shared with the
    reference runner.
Either way the step's only synchronization is reading the tokens (and logprobs) back.
"""

from __future__ import annotations

import random

import torch

from k3rt.backend.device import to_device
from k3rt.backend.runner.gpu.ops import kernel
from k3rt.backend.runner.gpu.penalties import PenaltyState
from k3rt.backend.runner.sampling import accept_grammar, allowed_mask, sample_requests, under_min_tokens
from k3rt.backend.sampling.sampler import Sampler


def _plain_greedy(r) -> bool:
    p = r.params
    return (p.greedy and r.grammar is None and p.logprobs is None and not p.logit_bias and not _penalized(r)
            and not under_min_tokens(r))


def _penalized(r) -> bool:
    p = r.params
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def _seed(r) -> int:
    """The request's philox seed: its own, or one drawn once and kept (reproducible within the run)."""
    s = r.sampled.device_seed
    if s is None:
        s = r.params.seed if r.params.seed is not None else random.getrandbits(62)
        r.sampled.device_seed = s
    return s


def sample_step(sampler: Sampler, logits: torch.Tensor, reqs: list, *, use_kernels: bool = True,
                penalties: PenaltyState | None = None) -> dict[int, int]:
    if not reqs:
        return {}  # a step of prefill chunks that all stop before their prompt's end samples nothing
    if all(_plain_greedy(r) for r in reqs):
        return {r.rid: t for r, t in zip(reqs, torch.argmax(logits, dim=-1).tolist())}
    fn = kernel("sampling", "sample") if use_kernels and logits.is_cuda else None
    if fn is None or any(r.params.logit_bias for r in reqs):  # the Triton sampler has no logit bias
        return sample_requests(sampler, logits, reqs)
    out = device_sample(fn, logits, reqs, penalties)
    return sample_requests(sampler, logits, reqs) if out is None else out


def sample_on_device(logits: torch.Tensor, reqs: list, *, use_kernels: bool = True,
                     penalties: PenaltyState | None = None) -> torch.Tensor | None:
    """The batch's sampled tokens left on the device (int64 [len(reqs)]), for overlap scheduling: when no row
    needs host work after sampling (grammar, logprobs, logit bias); else None (use `sample_step`)."""
    if all(_plain_greedy(r) for r in reqs):
        return torch.argmax(logits, dim=-1)
    fn = kernel("sampling", "sample") if use_kernels and logits.is_cuda else None
    if fn is None or any(r.grammar is not None or r.params.logprobs is not None or r.params.logit_bias
                         or _penalized(r) for r in reqs):
        return None
    launched = _device_sample_launch(fn, logits, reqs, penalties)
    return None if launched is None else launched[0].token_ids.to(torch.int64)


def device_sample(fn, logits: torch.Tensor, reqs: list, penalties: PenaltyState | None) -> dict[int, int] | None:
    """One call of the Triton sampler `fn` for the batch; None when penalties need state rows that are
    not available (no PenaltyState, or every row taken)."""
    launched = _device_sample_launch(fn, logits, reqs, penalties)
    if launched is None:
        return None
    res, nlp = launched
    tokens = res.token_ids.tolist()
    if nlp is not None:
        chosen, tops, ids = res.logprobs.tolist(), res.top_logprobs.tolist(), res.top_ids.tolist()
    for i, (r, tok) in enumerate(zip(reqs, tokens)):
        accept_grammar(r, tok)
        if nlp is not None and r.params.logprobs is not None:
            k = r.params.logprobs
            r.sampled.logprob, r.sampled.top_logprobs = chosen[i], list(zip(ids[i][:k], tops[i][:k]))
    return {r.rid: t for r, t in zip(reqs, tokens)}


def _device_sample_launch(fn, logits: torch.Tensor, reqs: list, penalties: PenaltyState | None):
    """Queue the Triton sampler `fn` for the batch without reading anything back: (result, number of
    logprobs asked for or None); None when penalty state rows are not available."""
    dev = logits.device
    ps = [r.params for r in reqs]
    pen_kw: dict = {}
    rows = None
    pen = [r for r in reqs if _penalized(r)]
    if pen:
        got = penalties.rows_for(pen) if penalties is not None else None
        if got is None:
            return None
        # rows without penalties read any state row (0): their neutral values (1, 0, 0) change nothing
        row_of = dict(zip((r.rid for r in pen), got))
        rows = [row_of.get(r.rid, 0) for r in reqs]
    floats = torch.tensor([[p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                            p.presence_penalty] for p in ps], dtype=torch.float32)
    ints = torch.tensor([[p.top_k, _seed(r), len(r.token_ids) - r.prompt_len, rows[i] if rows else 0,
                          int(_penalized(r))] for i, (p, r) in enumerate(zip(ps, reqs))], dtype=torch.int64)
    floats, ints = to_device(floats, dev).t().contiguous(), to_device(ints, dev).t().contiguous()
    if rows is not None:
        pen_kw = dict(repetition_penalty=floats[3], frequency_penalty=floats[4], presence_penalty=floats[5],
                      prompt_mask=penalties.prompt_mask, output_counts=penalties.output_counts, penalty_rows=ints[3])
    mask = allowed_mask(reqs, logits.shape[1])
    if mask is not None:
        mask = to_device(mask, dev)
    nlp = max((p.logprobs for p in ps if p.logprobs is not None), default=None)
    filters = any(p.top_k > 1 or p.top_p < 1.0 or p.min_p > 0.0 for p in ps)
    res = fn(logits.contiguous(), floats[0], ints[0].to(torch.int32), floats[1], floats[2], ints[1], ints[2],
             allowed_mask=mask, apply_filters=filters, num_logprobs=nlp, **pen_kw)
    if rows is not None:
        # only the penalized rows own their state row; the others read row 0 and add 0 to it
        penalties.add_tokens(ints[3], res.token_ids, ints[4])
    return res, nlp
