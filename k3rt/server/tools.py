"""Tool calls: Kimi's tool-call tokens parsed out of generated ids, and grammars for forced calls.

Kimi's chat template declares the tools in a `tool_declare` system turn and an assistant turn calls them as

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...<|tool_calls_section_end|>

where every marker is one special token and `functions.NAME:IDX` is the call's id (IDX counts the calls
of the conversation). `tool_choice="auto"` parses that section from the token ids (`KimiToolParser`).
A forced call cannot go through those markers (a grammar never produces special tokens), so
`tool_choice` naming a function constrains the output to the function's argument schema, and
"required" to a JSON array of `{"name", "parameters"}` objects (`required_schema`); the server then
reports the output as tool calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

_CALL_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+?)(?::(?P<idx>\d+))?\s*$")
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")


@dataclass(frozen=True)
class ParsedCall:
    id: str  # as the model wrote it, e.g. "functions.get_weather:0"
    name: str
    arguments: str  # JSON text as generated (not re-serialized)


def call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


def count_calls(messages: Sequence[Any]) -> int:
    """Tool calls made so far in the conversation: the IDX of the next call."""
    return sum(len(m.tool_calls or []) for m in messages if m.role == "assistant")


class KimiToolParser:
    """Finds Kimi tool calls in a choice's generated ids, one update at a time (`feed`)."""

    def __init__(self, marker_ids: dict[str, int], decode: Callable[[list[int]], str]) -> None:
        self.ids = marker_ids
        self._decode = decode
        self.section_begin_id = marker_ids[SECTION_BEGIN]
        self._state = "text"  # text -> section -> call_id -> arguments -> section ... -> done
        self._call_ids: list[int] = []
        self._arg_ids: list[int] = []
        self.calls: list[ParsedCall] = []

    @classmethod
    def create(cls, special_token_id: Callable[[str], int | None],
               decode: Callable[[list[int]], str]) -> KimiToolParser | None:
        """A parser, or None when the vocabulary lacks Kimi's tool-call tokens."""
        ids = {m: special_token_id(m) for m in MARKERS}
        if any(v is None for v in ids.values()):
            return None
        return cls(ids, decode)  # type: ignore[arg-type]

    @property
    def in_section(self) -> bool:
        return self._state != "text"

    def feed(self, token_ids: Sequence[int]) -> list[ParsedCall]:
        """Consume generated ids; returns the calls completed by them."""
        done: list[ParsedCall] = []
        ids = self.ids
        for t in token_ids:
            if self._state == "text":
                if t == self.section_begin_id:
                    self._state = "section"
            elif self._state == "section":
                if t == ids[CALL_BEGIN]:
                    self._state, self._call_ids, self._arg_ids = "call_id", [], []
                elif t == ids[SECTION_END]:
                    self._state = "done"
            elif self._state == "call_id":
                if t == ids[ARGUMENT_BEGIN]:
                    self._state = "arguments"
                else:
                    self._call_ids.append(t)
            elif self._state == "arguments":
                if t == ids[CALL_END]:
                    self._state = "section"
                    call = self._parse(self._call_ids, self._arg_ids)
                    if call is not None:
                        self.calls.append(call)
                        done.append(call)
                else:
                    self._arg_ids.append(t)
        return done

    def _parse(self, id_tokens: list[int], arg_tokens: list[int]) -> ParsedCall | None:
        raw_id = self._decode(id_tokens).strip()
        m = _CALL_ID.match(raw_id)
        if m is None:
            return None
        return ParsedCall(raw_id, m.group("name"), self._decode(arg_tokens).strip())


def function_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


def required_schema(functions: Sequence[tuple[str, dict[str, Any] | None]], *, parallel: bool = True) -> dict[str, Any]:
    """JSON schema for tool_choice "required": one call (or, with `parallel`, one or more calls) of the given
    (name, parameters) functions."""
    variants = [{"type": "object", "properties": {"name": {"const": name}, "parameters": function_schema(params)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, params in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) pairs of a "required"-mode output, or None if it is not complete JSON."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list):
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        out.append((c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False, separators=(",", ":"))))
    return out
