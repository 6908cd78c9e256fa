"""Batched token sampler: one call turns a [B, V] logits batch into one token per row.

Stages, each a batched tensor op with per-row parameters (a row whose stage is off is left bit-exact):
  1. allowed_mask (grammar bitmask): disallowed tokens -> -inf; then logit_bias added (OpenAI semantics)
  2. penalties: repetition over prompt + output, frequency / presence over output (penalties.py)
  3. temperature; greedy rows (temperature 0 or top_k 1) take the argmax here and draw nothing
  4. top-k, then min-p, then top-p over what survives (order and tie rules of ref.filter_logits)
  5. draw by exponential race: argmax(p / q) with q ~ Exp(1) per token picks token i with probability
     p_i. A seeded row fills its q from its own generator, so its tokens depend only on its seed and
     its logits, never on which requests share the batch or in what order; unseeded rows share one
     draw from torch's default generator.

Logprobs are log_softmax after stages 1-3: grammar mask, logit bias, penalties and temperature applied (rows with
temperature 0 use 1), top-k / min-p / top-p not applied. They describe the distribution the sampler
chose from while tokens outside the nucleus keep finite values, so the top-N alternatives stay
informative. vLLM's default (raw model logprobs) differs on penalized or temperature-scaled rows.

The sampler knows SamplingParams and token id histories; it knows nothing of requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from k3rt.backend.sampling.bitmask import apply_token_bitmask
from k3rt.backend.sampling.penalties import apply_penalties
from k3rt.sampling_params import SamplingParams


class SampleOutput(NamedTuple):
    token_ids: list[int]
    # per row, the sampled token's logprob; None when no row set params.logprobs
    logprobs: list[float] | None
    # per row, params.logprobs (token id, logprob) pairs, most likely first ([] where logprobs is None);
    # None when no row set params.logprobs
    top_logprobs: list[list[tuple[int, float]]] | None


def filter_batch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then min-p, then top-p, each with per-row parameters.

    Args:
        logits: [B, V] fp32, temperature already applied.
        top_k: [B] int64, 0 (or >= V) = off; tokens tied with the k-th value are kept.
        top_p: [B] fp32, 1 = off; keeps the smallest most-likely set whose mass reaches top_p.
        min_p: [B] fp32, 0 = off; drops tokens with probability below min_p * p_max.
    Returns:
        [B, V] logits with dropped tokens at -inf (a new tensor); rows with all three off are unchanged.
    """
    vocab_size = logits.shape[1]
    neg_inf = float("-inf")
    sorted_x, order = logits.sort(-1, descending=True)  # [B, V]
    k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    kth = sorted_x.gather(1, (k - 1)[:, None])  # [B, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, neg_inf)
    probs = sorted_x.softmax(-1)
    sorted_x = sorted_x.masked_fill(probs < min_p[:, None] * probs[:, :1], neg_inf)
    probs = sorted_x.softmax(-1)
    # Drop a token once the mass before it reaches top_p. top_p = 1 becomes inf so that cumsum
    # rounding past 1.0 can never cut the tail of an unfiltered row.
    threshold = torch.where(top_p >= 1.0, float("inf"), top_p)[:, None]
    sorted_x = sorted_x.masked_fill(probs.cumsum(-1) - probs >= threshold, neg_inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_x)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [B, V] -> a new [B, V] with each row's params.logit_bias added at its token ids; a banned
    (-inf) token stays banned. Raises ValueError for a token id outside [0, V)."""
    rows, cols, biases = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            if not 0 <= t < logits.shape[1]:
                raise ValueError(f"logit_bias: token id {t} outside the vocabulary [0, {logits.shape[1]})")
            rows.append(i)
            cols.append(t)
            biases.append(float(b))
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


class Sampler:
    """The engine's sampler for one vocabulary on one device; holds no per-request state."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        # normalizes "cuda" to "cuda:0" so device equality checks mean what they say
        self.device = torch.empty(0, device=device).device

    def sample_batch(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None], prompt_ids: Sequence[Sequence[int]],
                     output_ids: Sequence[Sequence[int]], allowed_mask: torch.Tensor | None = None) -> SampleOutput:
        """Pick one token per row.

        Args:
            logits: [B, V] fp32 on self.device; not modified.
            params, generators, prompt_ids, output_ids: one entry per row. A generator (on self.device)
                is required for reproducible rows; None draws from torch's default generator. Rows may
                share a generator; they then draw from it in row order.
            allowed_mask: [B, ceil(V/32)] int32 bit-packed allowed tokens (bitmask.py), or None.
        Returns:
            SampleOutput; logprobs as described in the module docstring.
        Raises:
            ValueError: on mismatched shapes / lengths / devices, or a mask row that allows no token.
        """
        self._check(logits, params, generators, prompt_ids, output_ids)
        x = self.process(logits, params, prompt_ids, output_ids, allowed_mask)
        token_ids = x.argmax(-1)  # [B]; final for greedy rows
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            index = torch.tensor(sampled, dtype=torch.long, device=self.device)
            token_ids[index] = self._draw(x[index], [params[i] for i in sampled], [generators[i] for i in sampled])
        tokens = token_ids.tolist()
        if all(p.logprobs is None for p in params):
            return SampleOutput(tokens, None, None)
        return SampleOutput(tokens, *_logprobs(x, token_ids, [p.logprobs or 0 for p in params]))

    def process(self, logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                output_ids: Sequence[Sequence[int]], allowed_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Stages 1-3 (grammar mask, logit_bias, penalties, temperature): [B, V] logits -> processed [B, V]
        logits, whose argmax is the greedy token and whose log_softmax gives the logprobs. Speculative
        verification (backend/spec/rejection.py) runs every verified position through this same function."""
        x = logits
        if allowed_mask is not None:
            x = apply_token_bitmask(x, allowed_mask)
            alive = (x > float("-inf")).any(-1)  # [B]
            if not bool(alive.all()):
                raise ValueError(f"allowed_mask: rows {(~alive).nonzero().flatten().tolist()} allow no token")
        if any(p.logit_bias for p in params):
            x = apply_logit_bias(x, params)
        x = apply_penalties(x, params, prompt_ids, output_ids)
        if any(p.temperature not in (0.0, 1.0) for p in params):
            temperature = [p.temperature if p.temperature > 0.0 else 1.0 for p in params]
            x = x / torch.tensor(temperature, dtype=torch.float32, device=self.device)[:, None]
        return x

    def target_probs(self, x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Stage 4 and the softmax: processed logits [S, V] of sampled (non-greedy) rows -> the exact
        distribution [S, V] that `sample_batch` draws each row's token from."""
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            x = filter_batch(x, torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device),
                             torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
                             torch.tensor([p.min_p for p in params], dtype=torch.float32, device=self.device))
        return x.softmax(-1)

    def _draw(self, x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
        """x: [S, V] temperature-scaled logits of the sampled rows -> [S] int64 token ids."""
        probs = self.target_probs(x, params)  # [S, V]
        q = torch.empty_like(probs)
        shared = [j for j, g in enumerate(generators) if g is None]
        for j, g in enumerate(generators):
            if g is not None:
                q[j].exponential_(generator=g)
        if len(shared) == len(generators):
            q.exponential_()
        elif shared:
            q[torch.tensor(shared, device=self.device)] = torch.empty(len(shared), q.shape[1], device=self.device).exponential_()
        # exponential_ may return exactly 0; a filtered token (p = 0) would then give 0/0 = NaN, which argmax picks
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(-1)

    def _check(self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
               prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size or logits.dtype != torch.float32:
            raise ValueError(f"logits: expected float32 [B, {self.vocab_size}], got {logits.dtype} {list(logits.shape)}")
        if logits.device != self.device:
            raise ValueError(f"logits: expected device {self.device}, got {logits.device}")
        rows = logits.shape[0]
        for name, seq in (("params", params), ("generators", generators), ("prompt_ids", prompt_ids),
                          ("output_ids", output_ids)):
            if len(seq) != rows:
                raise ValueError(f"{name}: expected {rows} entries (one per logits row), got {len(seq)}")
        for i, (p, g) in enumerate(zip(params, generators)):
            if g is not None and not p.greedy and torch.empty(0, device=g.device).device != self.device:
                raise ValueError(f"generators[{i}]: expected device {self.device}, got {g.device}")


def _logprobs(x: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """x: [B, V] processed logits, token_ids: [B] -> (sampled logprob per row, top-num_top[i] pairs per row)."""
    logprobs = x.log_softmax(-1)  # [B, V]
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    n = min(max(num_top), x.shape[1])
    if n == 0:
        return chosen, [[] for _ in num_top]
    values, ids = logprobs.topk(n, -1)  # [B, n]
    values, ids = values.tolist(), ids.tolist()
    return chosen, [list(zip(ids[i][:k], values[i][:k])) for i, k in enumerate(num_top)]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           prompt_ids: Sequence[Sequence[int]] | None = None, output_ids: Sequence[Sequence[int]] | None = None) -> list[int]:
    """One-call form of Sampler.sample_batch for the reference path: logits [B, V] (any float dtype) -> token ids.

    prompt_ids / output_ids may be omitted only when no row sets a penalty.
    """
    if (prompt_ids is None or output_ids is None) and any(p.has_penalties for p in params):
        raise ValueError("prompt_ids, output_ids: required when a row sets a repetition/frequency/presence penalty")
    empty: list[Sequence[int]] = [()] * len(params)
    sampler = Sampler(logits.shape[-1], logits.device)
    return sampler.sample_batch(logits.float(), params, generators, empty if prompt_ids is None else prompt_ids,
                                empty if output_ids is None else output_ids).token_ids


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one request's seeded draws (None: unseeded, shares torch's default generator)."""
    if seed is None:
        return None
    # "cuda" -> "cuda:0": a generator's device must compare equal to the sampler's normalized one
    return torch.Generator(device=torch.empty(0, device=device).device).manual_seed(seed)
