"""Constrained decoding: GrammarSpec, both grammar backends on both tokenizer kinds, the batch bitmask.

A seeded random "model" drives each matcher: every step it fills the mask, unpacks the bits here in plain Python,
picks one allowed token (EOS with probability 1/3 when allowed), and checks that a disallowed token is refused
and leaves the state unchanged.
The decoded output must then satisfy the constraint as an independent checker sees it (jsonschema, re).
"""
from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from k3rt.backend.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    create_grammar_backend,
    fill_batch_bitmask,
)
from k3rt.backend.tokenizer import Tokenizer, load_tokenizer, write_tiny_tiktoken_tokenizer, write_tiny_tokenizer

VOCAB_SIZE = 1000  # not a multiple of 32: the last mask word is partly past the vocabulary
BACKENDS = ["llguidance", "outlines"]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
# [0-9], not \d: both backends read \d as any Unicode decimal digit, and a walk produced U+16133, a digit
# newer than the Unicode tables of Python 3.11's re.
PHONE_REGEX = r"[0-9]{3}-[a-z]+"
CHOICES = ("yes", "no", "nope", "maybe so", "a.b|c", "(x)*", "é")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grammar_tokenizers")
    write_tiny_tokenizer(root / "hf", vocab_size=VOCAB_SIZE, seed=0)
    write_tiny_tiktoken_tokenizer(root / "tiktoken", vocab_size=VOCAB_SIZE, seed=0)
    return {"hf": root / "hf", "tiktoken": root / "tiktoken"}


@pytest.fixture(scope="module", params=["hf", "tiktoken"])
def tokenizer(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> Tokenizer:
    return load_tokenizer(tiny_dirs[request.param])


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> Iterator[GrammarBackend]:
    backend = create_grammar_backend(request.param, tokenizer)
    yield backend
    backend.close()


def allowed_ids(mask_row: torch.Tensor) -> list[int]:
    """Token ids whose bit is set, read word by word with Python ints (independent of the sampler's unpack)."""
    ids = []
    for w, word in enumerate(mask_row.tolist()):
        word &= 0xFFFFFFFF
        while word:
            low = word & -word
            ids.append(w * 32 + low.bit_length() - 1)
            word ^= low
    return ids


def new_row(backend: GrammarBackend) -> torch.Tensor:
    # start from all ones so a bit the matcher fails to clear shows up
    return torch.full((backend.num_mask_words,), -1, dtype=torch.int32)


def random_walk(matcher: GrammarMatcher, backend: GrammarBackend, tokenizer: Tokenizer, seed: int,
                max_steps: int = 2000) -> list[int]:
    """Drive `matcher` to termination with a seeded random model; returns the accepted ids without EOS."""
    rng = random.Random(seed)
    eos_ids = set(tokenizer.eos_token_ids)
    never = set(tokenizer.special_token_ids) - eos_ids
    first_byte = [b"\xff" if t in tokenizer.special_token_ids else tokenizer.token_bytes(t)[:1]
                  for t in range(tokenizer.vocab_size)]
    first_byte += [b"\xff"] * (backend.vocab_size - tokenizer.vocab_size)  # ids the tokenizer does not have
    out: list[int] = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return out
        row = new_row(backend)
        matcher.fill_bitmask(row)
        allowed = allowed_ids(row)
        assert allowed, f"no token allowed after {tokenizer.decode(out)!r}"
        assert max(allowed) < tokenizer.vocab_size, "a bit at or past the vocabulary is set"
        assert not never & set(allowed), "a special token is allowed"
        allowed_set = set(allowed)

        # llguidance's mask also leaves out non-canonical tokenizations of text the grammar forces (only "lu"
        # after '"b' when "blue" is forced), which accept() still takes; so probe with a token that starts
        # with a byte no allowed token starts with (0xFF, never in UTF-8 text, marks special and padding ids).
        first_bytes = {first_byte[t] for t in allowed if t not in eos_ids}
        disallowed = rng.choice([
            t for t in range(backend.vocab_size) if t not in allowed_set and first_byte[t] not in first_bytes
        ])
        assert not matcher.accept(disallowed), f"token {disallowed} accepted but not in the mask"
        again = new_row(backend)
        matcher.fill_bitmask(again)
        assert torch.equal(again, row), "a refused token changed the matcher's state"

        eos_allowed = sorted(eos_ids & allowed_set)
        text_ids = [t for t in allowed if t not in eos_ids]
        if eos_allowed and (not text_ids or rng.random() < 1 / 3):
            token = rng.choice(eos_allowed)
        else:
            token = rng.choice(text_ids)
        assert matcher.accept(token)
        if token not in eos_ids:
            out.append(token)
    raise AssertionError(f"not terminated after {max_steps} steps: {tokenizer.decode(out)!r}")


CASES = {
    "json_schema": (GrammarSpec.json_schema(PERSON_SCHEMA),
                    lambda text: jsonschema.validate(json.loads(text), PERSON_SCHEMA)),
    "regex": (GrammarSpec.regex(PHONE_REGEX), lambda text: re.fullmatch(PHONE_REGEX, text) or pytest.fail(text)),
    "choice": (GrammarSpec.choice(CHOICES), lambda text: text in CHOICES or pytest.fail(text)),
    "json_object": (GrammarSpec.json_object(), lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_model_output_satisfies_the_grammar(
    backend: GrammarBackend, tokenizer: Tokenizer, case: str, seed: int
) -> None:
    spec, check = CASES[case]
    matcher = backend.matcher(backend.compile(spec))
    text = tokenizer.decode(random_walk(matcher, backend, tokenizer, seed))
    check(text)
    assert matcher.is_terminated()


def test_llguidance_lark_and_numeric_bounds(tokenizer: Tokenizer) -> None:
    backend = create_grammar_backend("llguidance", tokenizer)
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}},
               "required": ["n"]}
    lark_grammar = backend.compile(GrammarSpec.lark(lark))
    bounded_grammar = backend.compile(GrammarSpec.json_schema(bounded))
    for seed in range(3):
        text = tokenizer.decode(random_walk(lark_grammar.matcher(), backend, tokenizer, seed))
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text
        text = tokenizer.decode(random_walk(bounded_grammar.matcher(), backend, tokenizer, seed))
        jsonschema.validate(json.loads(text), bounded)
    with pytest.raises(GrammarError, match=r"invalid Lark grammar.*unknown name: \"nothing\""):
        backend.compile(GrammarSpec.lark("start: nothing"))
    backend.close()


def test_complete_choice_allows_exactly_the_eos_ids(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = backend.compile(GrammarSpec.choice(["yes", "nope"])).matcher()
    assert not matcher.accept(tokenizer.eos_token_ids[0]), "EOS before the output is complete"
    for token in tokenizer.encode("yes"):
        assert not matcher.is_terminated()
        assert matcher.accept(token)
    assert matcher.is_terminated()
    row = new_row(backend)
    matcher.fill_bitmask(row)
    assert allowed_ids(row) == sorted(tokenizer.eos_token_ids)
    assert not matcher.accept(tokenizer.encode("x")[0])
    assert matcher.accept(tokenizer.eos_token_ids[-1])
    assert matcher.is_terminated()
    assert not matcher.accept(tokenizer.eos_token_ids[0]), "nothing follows an accepted EOS"
    matcher.rollback(1)  # the EOS: back to the complete "yes"
    assert matcher.is_terminated()
    matcher.fill_bitmask(row)
    assert allowed_ids(row) == sorted(tokenizer.eos_token_ids)
    matcher.rollback(len(tokenizer.encode("yes")))
    matcher.fill_bitmask(row)
    assert set(tokenizer.encode("yes")[:1]) <= set(allowed_ids(row))
    assert not matcher.is_terminated()


def _accepts(backend: GrammarBackend, tokenizer: Tokenizer, schema: dict[str, Any], text: str) -> bool:
    """Whether a fresh matcher for `schema` takes `text`'s tokens and then an EOS."""
    matcher = backend.compile(GrammarSpec.json_schema(schema)).matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.accept(tokenizer.eos_token_ids[0])


# pydantic's model_json_schema() says nothing about other properties; a weak model kept writing keys until
# max_tokens under llguidance (instructor's JSON_SCHEMA mode against k3rt serve, tests/compat)
LISTED = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "inner": {"type": "object", "properties": {"b": {"type": "integer"}}}},
          "required": ["a"]}


def test_only_declared_properties_are_generated(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    assert _accepts(backend, tokenizer, LISTED, '{"a":1}')
    assert _accepts(backend, tokenizer, LISTED, '{"a":1,"inner":{"b":2}}')
    assert not _accepts(backend, tokenizer, LISTED, '{"a":1,"c":2}')
    assert not _accepts(backend, tokenizer, LISTED, '{"a":1,"inner":{"b":2,"c":3}}')
    in_list = {"type": "array", "items": {"anyOf": [LISTED, {"type": "null"}]}}
    assert _accepts(backend, tokenizer, in_list, '[{"a":1},null]')
    assert not _accepts(backend, tokenizer, in_list, '[{"a":1,"c":2}]')
    if backend.name == "llguidance":  # outlines-core's regex cannot express open objects
        opened = {**LISTED, "additionalProperties": True}
        assert _accepts(backend, tokenizer, opened, '{"a":1,"c":2}')
        typed = {**LISTED, "additionalProperties": {"type": "string"}}
        assert _accepts(backend, tokenizer, typed, '{"a":1,"c":"x"}')
        assert not _accepts(backend, tokenizer, typed, '{"a":1,"c":2}')


def test_closed_schema_leaves_combined_objects_open() -> None:
    from k3rt.backend.grammar.base import closed_schema

    a = {"type": "object", "properties": {"a": {"type": "integer"}}}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}}
    out = closed_schema({"allOf": [a, b], "$defs": {"A": a}})
    # each allOf member declares part of the object: closed, they would forbid each other's keys
    assert out["allOf"] == [a, b] and out["$defs"]["A"] == {**a, "additionalProperties": False}
    beside = closed_schema({**a, "anyOf": [b]})
    assert beside == {**a, "anyOf": [b]}  # closing either would forbid the other's key
    assert closed_schema({"type": "object"}) == {"type": "object"}  # no properties listed: any object
    assert "additionalProperties" not in a  # the input is not changed


def test_out_of_range_ids_are_refused(backend: GrammarBackend) -> None:
    matcher = backend.compile(GrammarSpec.json_object()).matcher()
    assert not matcher.accept(-1)
    assert not matcher.accept(backend.vocab_size)
    assert not matcher.accept(backend.vocab_size + 100)


def test_rollback_restores_earlier_masks(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    matcher = backend.compile(GrammarSpec.regex(PHONE_REGEX)).matcher()
    masks = []
    for token in tokenizer.encode("123-abc"):
        row = new_row(backend)
        matcher.fill_bitmask(row)
        masks.append(row)
        assert matcher.accept(token)
    assert matcher.accept(tokenizer.eos_token_ids[0])
    assert matcher.is_terminated()
    matcher.rollback(1)  # the EOS
    assert not matcher.is_terminated()
    matcher.rollback(2)
    row = new_row(backend)
    matcher.fill_bitmask(row)
    assert torch.equal(row, masks[-2])
    matcher.rollback(len(masks) - 2)
    matcher.fill_bitmask(row)
    assert torch.equal(row, masks[0])


@pytest.mark.parametrize("pattern", ["(abc", "a{3", "[z-a]"])
def test_invalid_regex_is_named(backend: GrammarBackend, pattern: str) -> None:
    spec = GrammarSpec.regex(pattern)
    with pytest.raises(GrammarError, match="invalid regex") as raised:
        backend.validate(spec)
    assert pattern in str(raised.value)
    with pytest.raises(GrammarError, match="invalid regex"):
        backend.compile(spec)  # the failure is cached and raised again


@pytest.mark.parametrize("schema, word", [
    ({"type": "foo"}, "foo"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "$defs"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
], ids=["bad-type", "bad-ref", "unknown-format"])
def test_invalid_schema_is_named(backend: GrammarBackend, schema: dict[str, Any], word: str) -> None:
    with pytest.raises(GrammarError, match="invalid JSON schema") as raised:
        backend.validate(GrammarSpec.json_schema(schema, strict=True))
    assert word in str(raised.value)


@pytest.mark.parametrize("name, schema, keyword", [
    ("llguidance", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ("outlines", {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}, "minimum"),
], ids=["llguidance", "outlines"])
def test_strict_rejects_unenforced_keywords(tokenizer: Tokenizer, name: str, schema: dict[str, Any],
                                            keyword: str) -> None:
    backend = create_grammar_backend(name, tokenizer)
    with pytest.raises(GrammarError, match=keyword):
        backend.validate(GrammarSpec.json_schema(schema, strict=True))
    backend.validate(GrammarSpec.json_schema(schema, strict=False))  # lenient: the keyword is ignored
    backend.close()


def test_outlines_rejects_lark(tokenizer: Tokenizer) -> None:
    backend = create_grammar_backend("outlines", tokenizer)
    with pytest.raises(GrammarError, match="not supported by the outlines backend"):
        backend.compile(GrammarSpec.lark('start: "a"'))
    backend.close()


def test_compile_cache_returns_the_same_object(backend: GrammarBackend) -> None:
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    compiled = backend.compile(spec)
    same_key = GrammarSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert same_key.key == spec.key and same_key is not spec
    assert backend.compile(same_key) is compiled
    assert backend.compile(GrammarSpec.json_schema(spec.payload, strict=True)) is not compiled  # type: ignore[arg-type]


def test_compile_cache_is_lru_bounded(tokenizer: Tokenizer) -> None:
    backend = create_grammar_backend("llguidance", tokenizer, cache_size=2)
    a, b, c = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
    first_a = backend.compile(a)
    first_b = backend.compile(b)
    assert backend.compile(a) is first_a  # a is now the most recent
    backend.compile(c)  # evicts b
    assert backend.compile(a) is first_a
    assert backend.compile(b) is not first_b
    backend.close()


class _FakeGrammar(CompiledGrammar):
    def matcher(self) -> GrammarMatcher:
        raise NotImplementedError


class _GatedBackend(GrammarBackend):
    """A backend whose builds wait for `release`, to test the compile time limit deterministically."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__(vocab_size=64, compile_timeout_s=0.05)
        self.release = threading.Event()
        self.num_builds = 0

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        self.num_builds += 1
        self.release.wait(10)
        return _FakeGrammar(spec)


def test_compile_time_limit() -> None:
    backend = _GatedBackend()
    spec = GrammarSpec.regex("a")
    with pytest.raises(GrammarError, match=r"took longer than 0.05 s"):
        backend.compile(spec)
    with pytest.raises(GrammarError, match="took longer than"):
        backend.validate(spec)
    backend.release.set()
    compiled = backend.compile(spec, timeout_s=5)
    assert compiled.spec == spec
    assert backend.num_builds == 1, "a timed-out build is awaited again, not restarted"
    backend.close()


def test_fill_batch_bitmask_rows(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    grammars = [backend.compile(spec) for spec, _ in CASES.values()]
    matchers: list[GrammarMatcher | None] = [None, *(g.matcher() for g in grammars), None]
    assert matchers[2] is not None and matchers[2].accept(tokenizer.encode("1")[0])  # the regex, one digit in
    mask = torch.zeros(len(matchers), backend.num_mask_words, dtype=torch.int32)
    fill_batch_bitmask(matchers, mask)
    for row, matcher in enumerate(matchers):
        if matcher is None:
            assert (mask[row] == -1).all()
            continue
        expected = new_row(backend)
        matcher.fill_bitmask(expected)
        assert torch.equal(mask[row], expected)
        assert allowed_ids(mask[row]) and max(allowed_ids(mask[row])) < tokenizer.vocab_size
    with pytest.raises(ValueError, match="one row per matcher"):
        fill_batch_bitmask(matchers, mask[:-1])


def test_fill_batch_bitmask_mixed_backends(tokenizer: Tokenizer) -> None:
    backends = [create_grammar_backend(name, tokenizer) for name in BACKENDS]
    matchers = [backends[0].compile(GrammarSpec.regex(PHONE_REGEX)).matcher(), None,
                backends[1].compile(GrammarSpec.choice(CHOICES)).matcher()]
    mask = torch.zeros(3, backends[0].num_mask_words, dtype=torch.int32)
    fill_batch_bitmask(matchers, mask)
    for row, (matcher, backend) in enumerate(zip(matchers, [backends[0], None, backends[1]])):
        if matcher is None or backend is None:
            assert (mask[row] == -1).all()
            continue
        expected = new_row(backend)
        matcher.fill_bitmask(expected)
        assert torch.equal(mask[row], expected)
    for backend in backends:
        backend.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_model_vocab_wider_than_the_tokenizer(tokenizer: Tokenizer, name: str) -> None:
    backend = create_grammar_backend(name, tokenizer, vocab_size=VOCAB_SIZE + 50)
    assert backend.num_mask_words == (VOCAB_SIZE + 50 + 31) // 32
    matcher = backend.compile(GrammarSpec.json_object()).matcher()
    mask = torch.full((2, backend.num_mask_words), -1, dtype=torch.int32)
    fill_batch_bitmask([matcher, None], mask)
    assert max(allowed_ids(mask[0])) < tokenizer.vocab_size
    assert not matcher.accept(VOCAB_SIZE + 10)
    text = tokenizer.decode(random_walk(matcher, backend, tokenizer, seed=0))
    assert isinstance(json.loads(text), dict)
    with pytest.raises(ValueError, match="vocab_size"):
        create_grammar_backend(name, tokenizer, vocab_size=VOCAB_SIZE - 1)
    backend.close()


def test_mask_row_contract(backend: GrammarBackend) -> None:
    matcher = backend.compile(GrammarSpec.json_object()).matcher()
    with pytest.raises(ValueError, match="mask_row"):
        matcher.fill_bitmask(torch.zeros(backend.num_mask_words + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="mask_row"):
        matcher.fill_bitmask(torch.zeros(backend.num_mask_words, dtype=torch.int64))


def test_spec_round_trip_and_key() -> None:
    specs = [
        GrammarSpec.json_schema(PERSON_SCHEMA, strict=True),
        GrammarSpec.json_object(),
        GrammarSpec.regex(PHONE_REGEX),
        GrammarSpec.choice(list(CHOICES)),
        GrammarSpec.lark('start: "a"'),
    ]
    for spec in specs:
        again = GrammarSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        assert again == spec and again.key == spec.key and hash(again) == hash(spec)
    assert specs[3].payload == CHOICES  # a list is stored as a tuple
    reordered = GrammarSpec.json_schema(dict(reversed(list(PERSON_SCHEMA.items()))), strict=True)
    assert reordered.key == specs[0].key
    assert GrammarSpec.json_schema(PERSON_SCHEMA).key != specs[0].key  # strict is part of the key
    assert GrammarSpec.regex("a").key != GrammarSpec.lark("a").key
    assert len({spec.key for spec in specs}) == len(specs)


@pytest.mark.parametrize("data, message", [
    ({"kind": "xml", "payload": "x"}, "grammar kind"),
    ({"kind": "regex", "payload": ""}, "non-empty string"),
    ({"kind": "choice", "payload": []}, "non-empty list"),
    ({"kind": "choice", "payload": ["a", 1]}, "non-empty list"),
    ({"kind": "json_schema", "payload": "{}"}, "must be a JSON object"),
    ({"kind": "json_schema", "payload": {"x": {1, 2}}}, "not JSON-serializable"),
    ({"kind": "json_object", "payload": {}}, "takes no payload"),
    ({"kind": "regex", "payload": "a", "strict": "yes"}, "strict"),
    ({"kind": "regex", "payload": "a", "extra": 1}, "unknown fields"),
    ({"payload": "a"}, "missing field 'kind'"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_spec_rejects_bad_input(data: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.from_dict(data)


def test_unknown_backend_names_the_field(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="grammar_backend.*'xgrammar'"):
        create_grammar_backend("xgrammar", tokenizer)
