"""The default grammar backend: llguidance (Earley parser over a lazily built lexer; schemas compile in ms).

The vocabulary comes from k3rt's `Tokenizer.token_bytes`, so HF tokenizer.json and tiktoken vocabularies are
handled the same way; special tokens are marked so no grammar text can produce them, and every id in
`eos_token_ids` ends a complete output. One `LLMatcher` per spec is compiled and kept as a template; requests get
deep copies of it (~10 µs), which share its lexer cache.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance as llg

from k3rt.backend.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    check_bitmask_row,
    choice_regex,
    closed_schema,
    shorten,
)
from k3rt.backend.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

_WHAT = {
    "json_schema": "invalid JSON schema",
    "json_object": "invalid JSON object grammar",
    "regex": "invalid regex",
    "choice": "invalid choice",
    "lark": "invalid Lark grammar",
}


class _TokenizerView:
    """The duck-typed object `llguidance.TokenizerWrapper` reads: token bytes, EOS/BOS, specials, encode."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        # ids past the tokenizer (a model vocabulary padded for sharding) are empty and never allowed
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (vocab_size - tokenizer.vocab_size)
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), allow_special=False)


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llg.LLTokenizer:
    # Building the token trie takes ~1 s on a 160k vocabulary; tokenizers live as long as the process.
    view = _TokenizerView(tokenizer, vocab_size)
    return llg.LLTokenizer(llg.TokenizerWrapper(view), eos_token=list(tokenizer.eos_token_ids))


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) for `spec`."""
    if spec.kind == "json_schema":
        assert isinstance(spec.payload, dict)
        # undeclared properties are not generated, as with outlines-core (base.closed_schema says why)
        try:
            schema = closed_schema(spec.payload)
        except RecursionError:  # the HTTP routes cap nesting far below this; a DSL spec may not
            raise ValueError("the schema is nested too deeply") from None
        return llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "lenient": not spec.strict}
        )
    if spec.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    if spec.kind == "regex":
        assert isinstance(spec.payload, str)
        return llg.LLMatcher.grammar_from_regex(spec.payload)
    if spec.kind == "choice":
        assert isinstance(spec.payload, tuple)
        return llg.LLMatcher.grammar_from_regex(choice_regex(spec.payload))
    assert isinstance(spec.payload, str)
    return llg.LLMatcher.grammar_from_lark(spec.payload)


class LlguidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llg.LLMatcher, executor: llg.LLExecutor, eos_token_ids: tuple[int, ...],
                 vocab_size: int) -> None:
        self._matcher = matcher
        self._executor = executor
        self._eos_token_ids = eos_token_ids
        self._vocab_size = vocab_size
        self._num_words = (vocab_size + 31) // 32
        self._ended = False  # an EOS id was accepted
        # llguidance records an EOS in its history (for rollback) only if it was not already stopped
        self._eos_recorded = False

    def fill_bitmask(self, mask_row: torch.Tensor) -> None:
        check_bitmask_row(mask_row, self._num_words)
        self._matcher.unsafe_compute_mask_ptr(mask_row.data_ptr(), self._num_words * 4)

    def accept(self, token_id: int) -> bool:
        if self._ended or not 0 <= token_id < self._vocab_size:
            return False
        if token_id in self._eos_token_ids:
            # validate_tokens refuses EOS once the matcher is stopped, although the output is complete
            if not self._matcher.is_accepting():
                return False
            self._eos_recorded = not self._matcher.is_stopped()
            if self._eos_recorded:
                self._consume(token_id)
            self._ended = True
            return True
        # consume_token on a disallowed token leaves the matcher in a permanent error state; check first
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        self._consume(token_id)
        return True

    def _consume(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"llguidance refused token {token_id} it had validated: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        return self._ended or self._matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"rollback: num_tokens must be >= 0, got {num_tokens}")
        if num_tokens and self._ended:
            self._ended = False
            if not self._eos_recorded:
                num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"rollback: cannot undo {num_tokens} tokens: {self._matcher.get_error()}")

    @classmethod
    def fill_bitmask_rows(cls, rows: Sequence[tuple[GrammarMatcher, int]], mask: torch.Tensor) -> None:
        matchers = [m for m, _ in rows if isinstance(m, LlguidanceMatcher)]
        assert len(matchers) == len(rows), "fill_bitmask_rows: every matcher must be an LlguidanceMatcher"
        first = matchers[0]
        check_bitmask_row(mask[0], first._num_words)
        pairs = [(m._matcher, row) for m, (_, row) in zip(matchers, rows)]
        # llguidance's thread pool computes the rows in parallel, outside the GIL
        first._executor.unsafe_compute_mask_ptr(pairs, mask.data_ptr(), first._num_words * 4, mask.shape[0])


class LlguidanceGrammar(CompiledGrammar):
    def __init__(self, spec: GrammarSpec, template: llg.LLMatcher, backend: LlguidanceBackend) -> None:
        super().__init__(spec)
        self._template = template
        self._executor = backend.executor
        self._eos_token_ids = backend.eos_token_ids
        self._vocab_size = backend.vocab_size

    def matcher(self) -> LlguidanceMatcher:
        return LlguidanceMatcher(self._template.deep_copy(), self._executor, self._eos_token_ids, self._vocab_size)


class LlguidanceBackend(GrammarBackend):
    """json_schema, json_object, regex, choice and lark through llguidance. JSON comes out compact (no
    whitespace between tokens); `strict=False` ignores schema keywords llguidance does not implement."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int | None = None, num_threads: int | None = None,
                 **backend_options: Any) -> None:
        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size: must be >= the tokenizer's {tokenizer.vocab_size}, got {vocab_size}")
        super().__init__(vocab_size=vocab_size, **backend_options)
        self.ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        self.eos_token_ids = tokenizer.eos_token_ids
        # one mask-filling thread pool per backend (None: llguidance's default, 80% of the cores up to 32)
        self.executor = llg.LLExecutor(num_threads)

    def _build(self, spec: GrammarSpec) -> LlguidanceGrammar:
        try:
            text = grammar_text(spec)
        except ValueError as e:
            raise GrammarError(f"{_WHAT[spec.kind]}: {shorten(str(e))}") from None
        template = llg.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if template.is_error():
            raise GrammarError(f"{_WHAT[spec.kind]}: {shorten(template.get_error())}")
        return LlguidanceGrammar(spec, template, self)
