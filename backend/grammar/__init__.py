"""Constrained decoding: `GrammarSpec` -> `GrammarBackend.compile` -> per-request `GrammarMatcher` ->
`fill_batch_bitmask` for the sampler's `allowed_mask`. See base.py for the contracts.

The backend libraries (llguidance, outlines-core) are imported only by `create_grammar_backend`, so importing
this package needs neither them nor torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k3rt.backend.grammar.base import (
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    accept_or_error,
    fill_batch_bitmask,
)

if TYPE_CHECKING:
    from k3rt.backend.tokenizer import Tokenizer

GRAMMAR_BACKENDS = ("llguidance", "outlines")

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "create_grammar_backend",
    "accept_or_error",
    "fill_batch_bitmask",
]


def create_grammar_backend(name: str, tokenizer: Tokenizer, **options: Any) -> GrammarBackend:
    """The grammar backend `name` ("llguidance", the default choice, or "outlines") for `tokenizer`'s
    vocabulary. `options`: vocab_size (the logits width, default the tokenizer's), compile_timeout_s (5 s),
    cache_size (256 compiled grammars), compile_threads (2); llguidance also num_threads (mask filling),
    outlines also max_rollback (32 tokens)."""
    if name == "llguidance":
        from k3rt.backend.grammar.llguidance_backend import LlguidanceBackend

        return LlguidanceBackend(tokenizer, **options)
    if name == "outlines":
        from k3rt.backend.grammar.outlines_backend import OutlinesBackend

        return OutlinesBackend(tokenizer, **options)
    raise ValueError(f"grammar_backend: expected one of {', '.join(map(repr, GRAMMAR_BACKENDS))}, got {name!r}")
