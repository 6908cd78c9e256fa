"""Sequence-level unlikelihood training against greedy repetition loops (Welleck et al. 2019,
"Neural Text Generation with Unlikelihood Training", §5).

Why: k3-tiny knows where a function ends (given the true body, EOS is its top token at the end in
about three of four held-out functions), yet about half of its greedy completions never end: they
fall into a loop, one line or phrase repeated until the token cap. Maximum likelihood on the corpus
cannot see this failure, because it only ever conditions on real text; the loop lives in the model's
own outputs. So the model is shown its own runaway completions and the tokens that repeat are made
less likely where they repeated.

The pieces, each pure or nearly so:
- `repeated_ngram_mask`: which tokens of a completion complete an n-gram already seen earlier in the
  same completion (the candidates of Welleck's sequence-level loss).
- `runaway_sequences`: from greedy completions (`function_test.engine_completions`), the prompt +
  completion ids of those that ran into the token cap without ending, each with its mask. Completions
  that ended are left alone: a repeated line inside a finished function is often legitimate code.
- `UnlikelihoodBatch`: such sequences right-padded into [B, T] windows for the dense path.
- `unlikelihood_loss`: sum over masked targets of -log(1 - p(target)), and the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.training.train import window_logits


def repeated_ngram_mask(ids: Sequence[int], start: int, n: int) -> list[bool]:
    """Per position of `ids`: True where t >= start and the n tokens ending at t (all at or after `start`)
    already occurred, as the same n consecutive tokens, ending at an earlier position s >= start + n - 1.
    The prompt (before `start`) is neither marked nor searched: a completion that restates its
    docstring is not a loop."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    mask = [False] * len(ids)
    seen: set[tuple[int, ...]] = set()
    for t in range(start + n - 1, len(ids)):
        gram = tuple(ids[t - n + 1:t + 1])
        if gram in seen:
            mask[t] = True
        else:
            seen.add(gram)
    return mask


@dataclass(frozen=True)
class RunawaySequence:
    ids: list[int]  # prompt + completion
    mask: list[bool]  # per position of ids: a target whose probability is pushed down

    @property
    def num_marked(self) -> int:
        return sum(self.mask)


def runaway_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[tuple[dict, list[int]]], *,
                      n: int) -> list[RunawaySequence]:
    """The completions cut at the token cap (`stop == "length"`) that repeat at least one n-gram, as
    prompt + completion ids with `repeated_ngram_mask` over the completion."""
    out = []
    for prompt, (result, gen) in zip(prompts, completions, strict=True):
        if result["stop"] != "length":
            continue
        ids = [*prompt, *gen]
        mask = repeated_ngram_mask(ids, len(prompt), n)
        if any(mask):
            out.append(RunawaySequence(ids, mask))
    return out


@dataclass(frozen=True)
class UnlikelihoodBatch:
    """Sequences as next-token windows: inputs [B, T], targets [B, T], mask [B, T] (True where the target
    is a marked token), right-padded to the longest; padding is never marked."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def build(seqs: Sequence[RunawaySequence], pad_id: int) -> "UnlikelihoodBatch":
        t = max(len(s.ids) for s in seqs) - 1
        ids = torch.full((len(seqs), t + 1), pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), t + 1, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, :len(s.ids)] = torch.tensor(s.ids)
            mask[i, :len(s.ids)] = torch.tensor(s.mask)
        return UnlikelihoodBatch(ids[:, :-1], ids[:, 1:], mask[:, 1:])

    def to(self, device: torch.device) -> "UnlikelihoodBatch":
        return UnlikelihoodBatch(*(x.to(device, non_blocking=True) for x in (self.inputs, self.targets, self.mask)))


def unlikelihood_loss(model: KimiForCausalLM, batch: UnlikelihoodBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over marked targets of -log(1 - p(target)), number of marked targets). p comes from a float32
    log-softmax; 1 - p is floored at 1e-6 so a token the model is certain of gives a finite, large loss."""
    logp = F.log_softmax(window_logits(model, batch.inputs).float(), dim=-1)
    p = logp.gather(1, batch.targets.reshape(-1, 1)).squeeze(1).exp()
    m = batch.mask.reshape(-1)
    loss = -torch.log((1.0 - p).clamp(min=1e-6))
    return (loss * m).sum(), m.sum()
