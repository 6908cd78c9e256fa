"""The drafter interface: propose up to k draft tokens per running request.

A drafter sees each request's token ids (prompt + generated, append-only) and, for model drafters
(DSpark, issue 16 §1), the target's hidden states at its newest run positions (backend/spec/target_states.py). It keeps whatever
per-request index it needs, keyed by request id, and drops it in `finish`. It knows nothing of pages,
states or sampling: the scheduler bounds k (remaining tokens, pages, the per-step draft budget) and
the verifier decides what is kept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from k3rt.backend.models.kimi import KimiForCausalLM
    from k3rt.config import SpecConfig


class DraftQuery(NamedTuple):
    rid: int
    token_ids: Sequence[int]  # prompt then generated tokens; only ever appended to
    prompt_len: int
    max_tokens: int  # propose at most this many (>= 1)
    # model drafters: target states at the last run positions, [positions, features]; DSpark reads
    # [context_len, len(target_layers) * hidden] (backend/spec/dspark/drafter.py, docs/dspark.md)
    hidden: torch.Tensor | None = None


class Proposal(NamedTuple):
    token_ids: list[int]  # the draft tokens, at most the query's max_tokens
    # per draft j, the drafter's estimate of P(draft j accepted | drafts before it were) (DSpark's confidence
    # head), or None when the drafter has none; the speculation controller (gate.py) trims by it
    accept_probs: list[float] | None = None


class Drafter(ABC):
    @abstractmethod
    def propose(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        """Draft tokens for each query (possibly none), at most query.max_tokens each, in query order."""

    def propose_scored(self, queries: Sequence[DraftQuery], full: bool = False) -> list[Proposal]:
        """`propose` with the drafter's acceptance estimates where it has them (the scheduler calls this).
        full: every draft the drafter has, up to query.max_tokens, with no cut of its own by confidence (the
        step's verify costs the same whatever it carries, e.g. a verify CUDA graph of K + 1 rows per request,
        so a cut only loses tokens; the speculation controller trims by the estimates)."""
        return [Proposal(list(d)) for d in self.propose(queries)]

    def finish(self, rid: int, token_ids: Sequence[int], prompt_len: int) -> None:
        """Request rid ended (finished or aborted) with these tokens: drop its index (a drafter may keep
        its output to draft for later requests)."""


def create_drafter(cfg: SpecConfig, target: KimiForCausalLM | None = None,
                   graph_sizes: tuple[int, ...] = ()) -> Drafter | None:
    """The drafter cfg.method names, or None when speculation is off. target: the model being served (dspark
    shares its embedding and LM head and checks its shapes against them; cfg.model must be resolved).
    graph_sizes: batch buckets a model drafter captures its pass for in CUDA graphs (dspark on CUDA only)."""
    if cfg.method is None:
        return None
    if cfg.method == "ngram":
        from k3rt.backend.spec.ngram import NgramDrafter

        return NgramDrafter(cfg.ngram_min, cfg.ngram_max)
    if cfg.method == "suffix":
        from k3rt.backend.spec.suffix import SuffixDrafter

        return SuffixDrafter(cfg)
    if cfg.method == "dspark":
        from k3rt.backend.spec.dspark.drafter import DSparkDrafter

        if target is None or cfg.model is None:
            raise ValueError("spec: the dspark drafter needs the target model and a drafter folder (spec_model)")
        return DSparkDrafter.from_folder(cfg.model, target, confidence_threshold=cfg.confidence_threshold,
                                         num_tokens=cfg.num_tokens, graph_sizes=graph_sizes)
    raise ValueError(f"spec: no drafter named {cfg.method!r}")
