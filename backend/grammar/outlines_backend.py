"""The alternative grammar backend: outlines-core, a regex compiled into a token-level DFA index.

Everything becomes one regex first (json_schema through `build_regex_from_schema`, compact JSON with no
whitespace, like the llguidance backend), then `Index` walks the DFA over the whole vocabulary, so compiling is
slow for large regexes or vocabularies (seconds) while each step only reads a precomputed state. Lark grammars
are not supported. outlines-core does not enforce some JSON-schema keywords (numeric bounds, uniqueItems, ...);
a strict spec that uses them is rejected instead of silently loosened. json_object allows objects nested two
levels deep: a recursion-free regex for deeper nesting builds a DFA of hundreds of thousands of states.

outlines-core knows one EOS id and cannot advance past it; this module allows every id in `eos_token_ids` once
the output is complete and tracks the accepted EOS itself. `outlines_core.kernels.torch` is not used: it is
`torch.compile`d and its first call takes ~20 s on CPU.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, build_regex_from_schema

from k3rt.backend.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    check_bitmask_row,
    choice_regex,
    shorten,
)
from k3rt.backend.tokenizer import Tokenizer

# Keywords build_regex_from_schema accepts but does not encode into the regex, where ignoring them can produce
# output the schema rejects (checked against outlines-core 0.2.14).
_UNENFORCED_KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "uniqueItems", "contains", "minContains", "maxContains",
    "minProperties", "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas",
    "not", "if", "then", "else",
})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")


def _json_object_regex() -> str:
    scalar = f"{STRING}|{NUMBER}|{BOOLEAN}|{NULL}"

    def obj(value: str) -> str:
        member = f"{STRING}:(?:{value})"
        return rf"\{{(?:{member}(?:,{member})*)?\}}"

    def arr(value: str) -> str:
        return rf"\[(?:(?:{value})(?:,(?:{value}))*)?\]"

    return obj(f"{scalar}|{obj(scalar)}|{arr(scalar)}")


JSON_OBJECT_REGEX = _json_object_regex()


def _unenforced_keywords(schema: Any, path: str = "#") -> Iterator[str]:
    """JSON pointers of the keywords in `schema` (and its subschemas) that outlines-core ignores."""
    if not isinstance(schema, dict):
        return
    for keyword in sorted(_UNENFORCED_KEYWORDS & schema.keys()):
        yield f"{path}/{keyword}"
    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield from _unenforced_keywords(sub, f"{path}/{keyword}/{name}")
    for keyword in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield from _unenforced_keywords(sub, f"{path}/{keyword}/{i}")
    for keyword in _SUBSCHEMAS:
        sub = schema.get(keyword)
        if isinstance(sub, list):  # draft-4 tuple form of items
            for i, item in enumerate(sub):
                yield from _unenforced_keywords(item, f"{path}/{keyword}/{i}")
        else:
            yield from _unenforced_keywords(sub, f"{path}/{keyword}")


def spec_regex(spec: GrammarSpec) -> str:
    """The regex outlines-core compiles for `spec`; raises GrammarError for what it cannot express."""
    if spec.kind == "json_schema":
        if spec.strict and (ignored := list(_unenforced_keywords(spec.payload))):
            raise GrammarError(
                f"invalid JSON schema: the outlines backend does not enforce {', '.join(ignored[:5])}"
                f"{' ...' if len(ignored) > 5 else ''} (use strict=false to ignore them, or the llguidance backend)"
            )
        try:
            return build_regex_from_schema(json.dumps(spec.payload), whitespace_pattern="")
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {shorten(str(e))}") from None
    if spec.kind == "json_object":
        return JSON_OBJECT_REGEX
    if spec.kind == "regex":
        assert isinstance(spec.payload, str)
        return spec.payload
    if spec.kind == "choice":
        assert isinstance(spec.payload, tuple)
        return choice_regex(spec.payload)
    raise GrammarError(f"{spec.kind} grammars are not supported by the outlines backend (use grammar_backend="
                       f"'llguidance')")


def _regex_error(spec: GrammarSpec, pattern: str, error: ValueError) -> GrammarError:
    what = "invalid regex" if spec.kind == "regex" else f"invalid {spec.kind}"
    # outlines-core's syntax errors say only "error building NFA"; Python's parser usually says where
    try:
        re.compile(pattern)
        detail = str(error)
    except re.error as e:
        detail = f"{e} ({error})"
    return GrammarError(f"{what} {shorten(pattern, 200)!r}: {shorten(detail)}")


def _token_row(token_ids: list[int], num_words: int) -> torch.Tensor:
    """An int32 mask row with exactly `token_ids` set."""
    words = [0] * num_words
    for token_id in token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


@functools.lru_cache(maxsize=8)
def _vocabulary(tokenizer: Tokenizer) -> Vocabulary:
    # Special tokens (EOS included) are left out: no regex may produce them.
    token_ids: dict[bytes, list[int]] = {}
    for token_id in range(tokenizer.vocab_size):
        data = tokenizer.token_bytes(token_id)
        if token_id not in tokenizer.special_token_ids and data:
            token_ids.setdefault(data, []).append(token_id)
    return Vocabulary(tokenizer.eos_token_ids[0], token_ids)


class OutlinesGrammar(CompiledGrammar):
    def __init__(self, spec: GrammarSpec, index: Index, backend: OutlinesBackend) -> None:
        super().__init__(spec)
        self.index = index
        self.eos_token_ids = backend.eos_token_ids
        self.vocab_size = backend.vocab_size
        self.num_words = backend.num_mask_words
        self.max_rollback = backend.max_rollback
        self.eos_row = _token_row(list(backend.eos_token_ids), backend.num_mask_words)
        # state id -> whether EOS is the only token allowed there; filled as matchers reach final states
        self._terminal_states: dict[int, bool] = {}

    def is_terminal_state(self, state: int) -> bool:
        terminal = self._terminal_states.get(state)
        if terminal is None:
            terminal = set(self.index.get_allowed_tokens(state)) <= set(self.eos_token_ids)
            self._terminal_states[state] = terminal
        return terminal

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)


class OutlinesMatcher(GrammarMatcher):
    def __init__(self, grammar: OutlinesGrammar) -> None:
        self._grammar = grammar
        self._guide = Guide(grammar.index, max_rollback=grammar.max_rollback)
        self._ended = False  # an EOS id was accepted

    def fill_bitmask(self, mask_row: torch.Tensor) -> None:
        grammar = self._grammar
        check_bitmask_row(mask_row, grammar.num_words)
        if self._ended:
            mask_row.copy_(grammar.eos_row)
            return
        self._guide.write_mask_into(mask_row.data_ptr(), grammar.num_words, 4)  # clears the whole row first
        if self._guide.is_finished():
            mask_row.bitwise_or_(grammar.eos_row)

    def accept(self, token_id: int) -> bool:
        if self._ended or not 0 <= token_id < self._grammar.vocab_size:
            return False
        if token_id in self._grammar.eos_token_ids:
            self._ended = self._guide.is_finished()
            return self._ended
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # no transition: the state is unchanged
            return False
        return True

    def is_terminated(self) -> bool:
        return self._ended or (
            self._guide.is_finished() and self._grammar.is_terminal_state(self._guide.get_state())
        )

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"rollback: num_tokens must be >= 0, got {num_tokens}")
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens:
            try:
                self._guide.rollback_state(num_tokens)
            except ValueError as e:
                raise ValueError(f"rollback: cannot undo {num_tokens} tokens: {e}") from None


class OutlinesBackend(GrammarBackend):
    """json_schema, json_object, regex and choice through outlines-core's regex index."""

    name = "outlines"

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int | None = None, max_rollback: int = 32,
                 **backend_options: Any) -> None:
        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size: must be >= the tokenizer's {tokenizer.vocab_size}, got {vocab_size}")
        super().__init__(vocab_size=vocab_size, **backend_options)
        self.vocabulary = _vocabulary(tokenizer)
        self.eos_token_ids = tokenizer.eos_token_ids
        self.max_rollback = max_rollback

    def _build(self, spec: GrammarSpec) -> OutlinesGrammar:
        pattern = spec_regex(spec)
        try:
            index = Index(pattern, self.vocabulary)
        except ValueError as e:
            raise _regex_error(spec, pattern, e) from None
        return OutlinesGrammar(spec, index, self)
