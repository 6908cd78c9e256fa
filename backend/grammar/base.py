"""The grammar interface: what a constraint is (`GrammarSpec`), how a backend compiles it, and how a compiled
grammar masks one request's next token.

A `GrammarBackend` (llguidance or outlines-core) turns a `GrammarSpec` into a `CompiledGrammar` once per distinct
spec (LRU-cached by `spec.key`, built in a worker thread under a time limit). Each constrained request gets its
own `GrammarMatcher`; every decode step the scheduler calls `fill_batch_bitmask` over the batch, the sampler masks
the logits with it, and the sampled token goes back through `accept`.

Mask format (what `k3rt.backend.sampling.bitmask` unpacks): a row is ceil(V / 32) int32 words, token t is allowed
when bit (t % 32) of word (t // 32) is set. Constrained rows have every bit at or past V clear; unconstrained rows
are all ones. This module never imports torch, so a `GrammarSpec` can travel through torch-free processes.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")

DEFAULT_COMPILE_TIMEOUT_S = 5.0
DEFAULT_CACHE_SIZE = 256

# Size limits, checked when a spec is made (so a 400 names the field before anything compiles). A
# grammar compiles lazily: "a{1000000}" compiles in a millisecond and fails at its first token with
# llguidance's "too many expressions constructed" (measured: a repetition expanding to 100,000 positions,
# [a-z]{0,100000}, runs; a{1000000}, (a{1000}){1000} and a choice of one 1M-character string fail).
MAX_EXPANSION = 100_000  # positions a regex expands to (repetitions multiplied out), and choice characters
MAX_GRAMMAR_CHARS = 65_536  # regex / Lark text
MAX_CHOICES = 10_000
MAX_SCHEMA_BYTES = 1 << 20  # the JSON schema, serialized


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid regex / schema / Lark text, a feature the backend does not support,
    or a compile that ran past the time limit. Callers answer it with HTTP 400."""


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint, as the request asked for it. Plain data: JSON round-trips through to_dict/from_dict.

    kind and payload:
      "json_schema"  payload is the schema (a dict)
      "json_object"  payload is None: any JSON object
      "regex"        payload is the pattern (Rust `regex` syntax, matched against the whole output)
      "choice"       payload is the allowed strings (a tuple; a list is converted), matched literally
      "lark"         payload is a Lark grammar (llguidance dialect; the outlines backend rejects it)
    strict: json_schema only; True rejects schemas using keywords the backend would not enforce, False ignores
      those keywords (OpenAI's `strict` flag; False is its default too).
    key: a stable digest of (kind, payload, strict), the compile-cache key; equal specs have equal keys.
    """

    kind: str
    payload: dict[str, Any] | str | tuple[str, ...] | None = None
    strict: bool = False
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind: expected one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        payload = self.payload
        if self.kind == "json_schema" and not isinstance(payload, dict):
            raise GrammarError(f"json_schema: the schema must be a JSON object, got {type(payload).__name__}")
        if self.kind == "json_object" and payload is not None:
            raise GrammarError("json_object: takes no payload")
        if self.kind in ("regex", "lark") and not (isinstance(payload, str) and payload):
            raise GrammarError(f"{self.kind}: the payload must be a non-empty string, got {payload!r:.80}")
        if self.kind == "choice":
            if not isinstance(payload, (list, tuple)) or not payload or not all(isinstance(c, str) for c in payload):
                raise GrammarError(f"choice: the payload must be a non-empty list of strings, got {payload!r:.80}")
            payload = tuple(payload)
        if not isinstance(self.strict, bool):
            raise GrammarError(f"strict: expected a bool, got {self.strict!r}")
        try:
            canonical = json.dumps(
                [self.kind, payload, self.strict], sort_keys=True, separators=(",", ":"), ensure_ascii=False
            )
        except (TypeError, ValueError) as e:
            raise GrammarError(f"{self.kind}: the payload is not JSON-serializable ({e})") from None
        _check_size(self.kind, payload)  # after the serializability check: the schema size is measured in JSON
        # Normalizing during construction; the instance is never changed afterwards.
        object.__setattr__(self, "payload", payload)
        object.__setattr__(self, "key", hashlib.sha256(canonical.encode("utf-8")).hexdigest())

    def __hash__(self) -> int:
        return hash(self.key)

    @classmethod
    def json_schema(cls, schema: dict[str, Any], *, strict: bool = False) -> GrammarSpec:
        return cls("json_schema", schema, strict)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", tuple(choices))

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)

    def to_dict(self) -> dict[str, Any]:
        payload = list(self.payload) if isinstance(self.payload, tuple) else self.payload
        return {"kind": self.kind, "payload": payload, "strict": self.strict}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GrammarSpec:
        unknown = set(data) - {"kind", "payload", "strict"}
        if unknown:
            raise GrammarError(f"grammar spec: unknown fields {sorted(unknown)}")
        if "kind" not in data:
            raise GrammarError("grammar spec: missing field 'kind'")
        return cls(data["kind"], data.get("payload"), data.get("strict", False))


def _check_size(kind: str, payload: Any) -> None:
    """GrammarError naming the kind and the limit for a spec too large to compile or to run."""
    if kind in ("regex", "lark"):
        if len(payload) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{kind}: {len(payload)} characters (limit {MAX_GRAMMAR_CHARS})")
        size = regex_expansion(payload) if kind == "regex" else max(_repetition_counts(payload), default=0)
        if size > MAX_EXPANSION:
            raise GrammarError(f"{kind}: its repetitions expand to {size} positions (limit {MAX_EXPANSION}); "
                               "bound them more tightly")
    elif kind == "choice":
        if len(payload) > MAX_CHOICES:
            raise GrammarError(f"choice: {len(payload)} choices (limit {MAX_CHOICES})")
        chars = sum(map(len, payload))
        if chars > MAX_EXPANSION:
            raise GrammarError(f"choice: {chars} characters in all (limit {MAX_EXPANSION})")
    elif kind == "json_schema":
        size = len(json.dumps(payload, separators=(",", ":")).encode())
        if size > MAX_SCHEMA_BYTES:
            raise GrammarError(f"json_schema: {size} bytes (limit {MAX_SCHEMA_BYTES})")


_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _repetition_counts(text: str) -> list[int]:
    """Every bounded repetition count written in the text ({n} or {n,m})."""
    return [int(m.group(2) or m.group(1)) for m in _COUNT.finditer(text)]


def regex_expansion(pattern: str) -> int:
    """Positions `pattern` expands to with its bounded repetitions multiplied out (an unbounded one
    counts its minimum). Parsed with Python's regex parser; a pattern it cannot read (Rust-only syntax)
    is judged by its largest single count."""
    import re._parser as parser
    from re._constants import MAXREPEAT

    try:
        tree = parser.parse(pattern)
    except (re.error, OverflowError, RecursionError):
        return max(_repetition_counts(pattern), default=len(pattern))

    def size(items) -> int:
        total = 0
        for op, av in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = av
                total += max(lo if hi == MAXREPEAT else hi, 1) * size(sub)
            elif name == "SUBPATTERN":
                total += size(av[-1])
            elif name == "BRANCH":
                total += sum(size(b) for b in av[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                total += size(av[1])
            else:
                total += 1
            if total > 10 * MAX_EXPANSION:
                return total  # far past the limit: stop multiplying
        return total

    return size(tree)


def choice_regex(choices: Sequence[str]) -> str:
    """A regex (Rust `regex` syntax) matching exactly one of `choices`. Every character that is not an ASCII
    letter or digit is written as \\x{...}, so no choice text can act as regex syntax."""

    def escape(char: str) -> str:
        return char if char.isascii() and char.isalnum() else f"\\x{{{ord(char):x}}}"

    return "(?:" + "|".join("".join(escape(c) for c in choice) for choice in choices) + ")"


def shorten(message: str, limit: int = 600) -> str:
    """Library error messages can quote a whole generated regex; keep them readable in an HTTP 400."""
    return message if len(message) <= limit else message[:limit] + f"... ({len(message) - limit} more characters)"


def check_bitmask_row(mask_row: torch.Tensor, num_words: int) -> None:
    """Raise ValueError unless `mask_row` is a contiguous CPU int32 tensor of `num_words` words."""
    import torch

    if mask_row.dtype != torch.int32 or mask_row.shape != (num_words,) or not mask_row.is_contiguous() or (
        mask_row.device.type != "cpu"
    ):
        raise ValueError(
            f"mask_row: expected a contiguous CPU int32 tensor of shape [{num_words}], got {mask_row.dtype} "
            f"{list(mask_row.shape)} on {mask_row.device} (contiguous={mask_row.is_contiguous()})"
        )


class GrammarMatcher(ABC):
    """One request's position in its grammar. Not thread-safe: only the scheduler thread that owns the request
    calls it. After the grammar is complete (`is_terminated`), only EOS tokens are allowed."""

    @abstractmethod
    def fill_bitmask(self, mask_row: torch.Tensor) -> None:
        """Write the allowed next tokens into `mask_row` (int32 [ceil(V/32)], contiguous, CPU). Every bit is
        written: bits of disallowed tokens and bits at or past V are cleared."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`. Returns False, and leaves the state unchanged, if the grammar does not
        allow it here (an EOS id is allowed exactly when the output so far is complete). The mask may be
        stricter than this: llguidance masks out non-canonical tokenizations of text the grammar forces
        (e.g. "l" when "lue" is forced and "lu" is a token), which `accept` still takes."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar allows nothing but EOS (or EOS was accepted): the request must stop."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding). Raises ValueError if more tokens
        are asked for than the backend kept."""

    @classmethod
    def fill_bitmask_rows(cls, rows: Sequence[tuple[GrammarMatcher, int]], mask: torch.Tensor) -> None:
        """Fill `mask[row]` for each (matcher, row), all matchers of this class. Backends with a parallel fill
        override this."""
        for matcher, row in rows:
            matcher.fill_bitmask(mask[row])


class CompiledGrammar(ABC):
    """A grammar compiled against one vocabulary; shared by every request with the same spec."""

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar. Safe to call from any thread."""


def fill_batch_bitmask(matchers: Sequence[GrammarMatcher | None], mask: torch.Tensor) -> dict[int, str]:
    """Fill every row of `mask` (int32 [B, ceil(V/32)], contiguous, CPU; B == len(matchers)): row i from
    matchers[i], or all ones where matchers[i] is None (an unconstrained request). Matchers of one backend are
    filled together, so llguidance computes its rows in parallel.

    Returns {row: error} for the matchers that failed (raised, or allow no token at all: a grammar in an
    error state); their rows are left all ones, so the batch still samples, and the caller fails those
    requests alone. One request's grammar never takes the others' step down."""
    if mask.dim() != 2 or mask.shape[0] != len(matchers) or not mask.is_contiguous():
        raise ValueError(
            f"mask: expected a contiguous [{len(matchers)}, W] tensor (one row per matcher), got "
            f"{list(mask.shape)} (contiguous={mask.is_contiguous()})"
        )
    groups: dict[type[GrammarMatcher], list[tuple[GrammarMatcher, int]]] = {}
    for row, matcher in enumerate(matchers):
        if matcher is None:
            mask[row].fill_(-1)
        else:
            groups.setdefault(type(matcher), []).append((matcher, row))
    failed: dict[int, str] = {}
    for matcher_class, rows in groups.items():
        try:
            matcher_class.fill_bitmask_rows(rows, mask)
        except Exception:  # find which rows: fill them one by one
            for matcher, row in rows:
                try:
                    matcher.fill_bitmask(mask[row])
                except Exception as e:
                    failed[row] = f"grammar: {shorten(str(e))}"
        for _, row in rows:
            if row not in failed and not bool(mask[row].any()):
                failed[row] = "grammar: no token is allowed here (the grammar is in an error state)"
    for row in failed:
        mask[row].fill_(-1)
    return failed


def accept_or_error(matcher: GrammarMatcher, token_id: int) -> str | None:
    """matcher.accept(token_id); None on success, else why (a refusal of a token the mask allowed, or a
    backend error such as llguidance's "too many expressions constructed")."""
    try:
        if matcher.accept(token_id):
            return None
        return f"grammar: the grammar refused token {token_id}, which its own mask allowed"
    except Exception as e:
        return f"grammar: {shorten(str(e))}"


class GrammarBackend(ABC):
    """Compiles `GrammarSpec`s against one tokenizer's vocabulary.

    `compile` runs the backend's `_build` in a worker thread and waits at most `compile_timeout_s`; a build that
    runs longer is reported as a GrammarError but cannot be interrupted: it finishes in the background, its
    result lands in the cache, and a later `compile` of the same spec waits for that same build rather than
    starting another. Failed builds are cached too, so a repeated bad spec fails at once.
    `vocab_size` is the width of the logits (the model's vocabulary, at least the tokenizer's); ids the
    tokenizer does not have are never allowed by a constrained row.
    """

    name: ClassVar[str]

    def __init__(
        self,
        *,
        vocab_size: int,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        compile_threads: int = 2,
    ) -> None:
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s: must be > 0, got {compile_timeout_s}")
        if cache_size < 1:
            raise ValueError(f"cache_size: must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        self.num_mask_words = (vocab_size + 31) // 32
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix=f"k3rt-grammar-{self.name}")

    @abstractmethod
    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` (runs in a worker thread). Raises GrammarError for anything wrong with the spec."""

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Start compiling `spec` (or find it in the cache) without waiting. The future's exception is a
        GrammarError for a bad spec."""
        with self._cache_lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._build, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec, *, timeout_s: float | None = None) -> CompiledGrammar:
        """The compiled grammar for `spec`; the same object for every spec with the same key while it stays in
        the cache. Raises GrammarError for a bad spec or when compiling takes longer than `timeout_s`
        (default: the backend's `compile_timeout_s`)."""
        timeout_s = self.compile_timeout_s if timeout_s is None else timeout_s
        future = self.submit(spec)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeoutError:
            raise GrammarError(
                f"{spec.kind}: compiling the grammar took longer than {timeout_s:g} s ({self.name} backend)"
            ) from None
        except GrammarError as e:
            # a fresh exception each time: re-raising the cached one would grow its traceback forever
            raise GrammarError(*e.args) from None
        except Exception:
            with self._cache_lock:
                if self._cache.get(spec.key) is future:
                    del self._cache[spec.key]
            raise

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one request: `compiled.matcher()`."""
        return compiled.matcher()

    def validate(self, spec: GrammarSpec) -> None:
        """Raise GrammarError naming the problem if `spec` cannot be used with this backend: an invalid regex,
        schema or Lark grammar, an unsupported feature, or a compile past the time limit. It compiles the
        grammar (into the cache, so the request's own `compile` is then free)."""
        self.compile(spec)

    def close(self) -> None:
        """Stop the compile threads (a running build still finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


# subschemas that an output value must match by themselves (so closing one restricts only that value) ...
_OWN_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OWN_SUBSCHEMAS = ("items", "additionalProperties", "prefixItems")
# ... and the ones combined with their siblings: an object in `allOf`, or an `anyOf` / `oneOf` branch beside
# `properties`, is intersected with the others, so closing it would forbid the properties the others declare
_COMBINED = ("allOf", "anyOf", "oneOf")
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_schema(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on each object schema that declares `properties` and says
    nothing about other properties. A schema usually lists the fields it wants (pydantic's model_json_schema
    writes no additionalProperties), and constrained decoding that admits undeclared keys lets a model write
    them until max_tokens. outlines-core, xgrammar (SGLang's and vLLM's default) and OpenAI's strict mode
    generate only the declared properties; this gives llguidance the same meaning. A schema that wants other
    properties says so (`"additionalProperties": true` or a schema). Objects combined with others (an allOf
    member, an anyOf/oneOf branch beside `properties`, and the object beside them) are left as written, and
    so are conditions (not, if/then/else, contains), where closing would change what matches; `$defs` are
    closed where defined. Returns a new object; `schema` is not changed."""
    return _close(schema, combined=False)


def _close(node: Any, *, combined: bool) -> Any:
    if isinstance(node, list):
        return [_close(item, combined=combined) for item in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _OWN_SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: _close(sub, combined=False) for name, sub in node[key].items()}
    for key in _OWN_SUBSCHEMAS:
        if key in node and not isinstance(node[key], bool):
            out[key] = _close(node[key], combined=False)
    has_properties = isinstance(node.get("properties"), dict)
    for key in _COMBINED:
        if isinstance(node.get(key), list):
            out[key] = [_close(sub, combined=key == "allOf" or has_properties) for sub in node[key]]
    if has_properties and not combined and not any(k in node for k in (*_OPENERS, *_COMBINED)):
        out["additionalProperties"] = False
    return out
