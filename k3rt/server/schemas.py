"""Request bodies of the OpenAI-compatible endpoints, as pydantic models parsed strictly from JSON.

Strict: a string is never coerced into a number or a bool, NaN and infinities are rejected, and every
field has OpenAI's type. Unknown top-level fields of a request are collected (`unknown_fields`): a known field
that would change sampling or the output and that k3rt does not implement (`UNSERVED_FIELDS`) is a 400 naming
it; any other is accepted, logged, and named in the response's `X-K3rt-Ignored-Fields` header (clients send
newer OpenAI fields than we know: metadata, store, ...). Unknown fields of nested objects are ignored.
Range checks that need more than a type live in `SamplingFields.sampling_params` and in chat.py /
completions.py, so each error names its field and the limit. Responses are plain dicts (see chat.py).
Lists stop at their first bad item and `prompt`'s shape is read off its first item, so a bad body of
millions of items costs no more to refuse than a good one costs to accept.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.types import FailFast
from pydantic_core import PydanticCustomError

from k3rt.sampling_params import MAX_LOGPROBS

MAX_N = 128  # OpenAI's limit on choices per request
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; more costs nothing here)
MAX_STOP_LEN = 1024  # characters per stop string
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of one logit_bias (each costs a Python check and a scatter)
MAX_SCHEMA_DEPTH = 100  # levels of objects / arrays in a JSON schema, tool parameters or call arguments


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _switch_point(self) -> Any:
        # pydantic-core validates a whole body in one call that holds the GIL (300K messages: 250 ms). A
        # Python call per object is a point where the interpreter may hand the GIL over (every
        # sys.getswitchinterval(), 5 ms), so a big body parsed in a worker thread leaves the event loop running.
        return self


class _FailFast(FailFast):
    # hashable, so that it may sit inside a Union (typing deduplicates union members by hash)
    __hash__ = object.__hash__


_T = TypeVar("_T")
# Every list stops at its first bad item. Otherwise a list of millions of bad items collects millions of
# errors, and a union tries each list member in turn: `[1, "a", "a", ...]` as a 6 MB prompt took 67 s of
# GIL-holding validation.
_List = Annotated[list[_T], _FailFast()]


def _nesting(value: Any, limit: int) -> int:
    """Levels of objects and arrays in `value` (a scalar has 0), counted up to limit + 1."""
    depth, level = 0, [value]
    while depth <= limit:
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            break
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _check_nesting(value: Any) -> Any:
    if value is not None and _nesting(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise PydanticCustomError("json_too_deep", "nested more than {limit} levels deep",
                                  {"limit": MAX_SCHEMA_DEPTH})
    return value


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchemaFormat(_Strict):
    name: str = "output"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    _nesting = field_validator("schema_")(_check_nesting)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _nesting = field_validator("parameters")(_check_nesting)


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ContentPart(_Strict):
    # only "text" is served; other part types are rejected by chat.py with the part's index
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any]

    _nesting = field_validator("arguments")(_check_nesting)


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | _List[ContentPart] | None = None
    name: str | None = None
    tool_calls: _List[ToolCall] | None = None
    tool_call_id: str | None = None


class SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM-style extensions)."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | _List[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: _List[int] | None = None
    regex: str | None = None
    choice: _List[str] | None = None
    cache_salt: str | None = None
    speculative: bool = True  # false: no draft tokens for this request on a speculative server
    return_token_ids: bool = False  # debug: add prompt_token_ids and per-choice token_ids to the response
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    min_tokens: int = 0  # vLLM's: EOS and stop_token_ids cannot end the output before this many tokens


class _Request(SamplingFields):
    # top-level unknown fields are kept (in model_extra) so the endpoint can refuse or report them
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, populate_by_name=True)


# Fields other servers (vLLM, SGLang, newer OpenAI) accept that would change what is sampled or returned,
# and that k3rt does not implement: refused (400) rather than dropped.
UNSERVED_FIELDS = frozenset({
    "use_beam_search", "length_penalty", "early_stopping", "bad_words", "allowed_token_ids",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
    "guided_decoding_backend", "structured_outputs", "json_schema", "ebnf", "stop_regex", "typical_p",
    "top_a", "tfs", "epsilon_cutoff", "eta_cutoff", "mirostat_mode", "mirostat_tau", "mirostat_eta",
    "dry_multiplier", "xtc_probability", "logits_processors", "truncate_prompt_tokens", "prompt_logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
    "min_p_tokens", "functions", "function_call", "prediction", "modalities", "audio", "reasoning_effort",
    "n_probs", "no_repeat_ngram_size", "continue_final_message", "add_generation_prompt", "chat_template",
    "chat_template_kwargs", "documents", "priority", "vllm_xargs", "max_new_tokens", "thinking",
})


def unknown_fields(req: BaseModel) -> list[str]:
    """The request's unknown top-level fields, sorted; raises a 400 naming the first one in UNSERVED_FIELDS."""
    from k3rt.server.errors import bad_request

    extra = sorted(req.model_extra or ())
    for name in extra:
        if name in UNSERVED_FIELDS:
            raise bad_request(name, "is not supported by k3rt (it would change sampling or the output, so it is "
                              "refused rather than ignored)", code="unsupported_field")
    return extra


class ChatCompletionRequest(_Request):
    messages: _List[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: _List[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(_Request):
    # str | list[str] | list[int] | list[list[int]], checked by `_prompt_shape`: pydantic's union would
    # validate a 5M-id list three times over (list[str] fails, list[int], list[list[int]] fails)
    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        return check_prompt_shape(prompt)


def check_prompt_shape(prompt: Any) -> Any:
    """A string, or a list whose first item decides the rest: strings, token ids, or lists of token ids.
    A plain Python loop, so a big body's check (in a worker thread) lets the event loop run. Raises
    PydanticCustomError ("prompt_type")."""
    if isinstance(prompt, str) or prompt == []:
        return prompt
    if not isinstance(prompt, list):
        raise PydanticCustomError("prompt_type", _PROMPT_TYPES)
    if type(prompt[0]) is list:
        for i, ids in enumerate(prompt):
            if type(ids) is not list:
                raise PydanticCustomError("prompt_type", f"item [{i}]: {_PROMPT_TYPES}")
            _check_items(ids, int, f"[{i}]", "a token id (an integer)")
        return prompt
    if type(prompt[0]) is str:
        _check_items(prompt, str, "", "a string")
    else:
        _check_items(prompt, int, "", "a token id (an integer)")
    return prompt


_PROMPT_TYPES = "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _check_items(items: list[Any], kind: type, where: str, what: str) -> None:
    bad = next((i for i, x in enumerate(items) if type(x) is not kind), None)
    if bad is not None:
        raise PydanticCustomError("prompt_type", "item {where}[{index}] must be {what}, like the first one; got {got}",
                                  {"where": where, "index": bad, "what": what, "got": repr(items[bad])[:40]})


def check_common(req: SamplingFields) -> None:
    """Range checks OpenAI documents for the shared fields; raises APIError naming the field."""
    from k3rt.server.errors import bad_request

    if not 1 <= req.n <= MAX_N:
        raise bad_request("n", f"must be in [1, {MAX_N}], got {req.n}")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise bad_request("temperature", f"must be in [0, 2], got {req.temperature}")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise bad_request("top_p", f"must be in (0, 1], got {req.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if not -2.0 <= v <= 2.0:
            raise bad_request(name, f"must be in [-2, 2], got {v}")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "only allowed when stream is true")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise bad_request("seed", f"must be in [0, 2^63), got {req.seed}")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request("stop", f"at most {MAX_STOP} stop strings, got {len(stops)}")
    for s in stops:
        if not s or len(s) > MAX_STOP_LEN:
            raise bad_request("stop", f"each stop string must have 1 to {MAX_STOP_LEN} characters, got {len(s)}")
    if req.choice is not None and (not req.choice or not all(req.choice)):
        raise bad_request("choice", "must be a non-empty list of non-empty strings")
    if req.regex is not None and not req.regex:
        raise bad_request("regex", "must be a non-empty pattern")
    if req.regex is not None and (len(req.regex) - len(req.regex.rstrip("\\"))) % 2:
        # llguidance drops a dangling escape ("a\\" would constrain the output to "a")
        raise bad_request("regex", "ends in an unfinished escape (a lone trailing backslash); write \\\\ for a "
                          "literal backslash", code="invalid_grammar")
    if not 0 <= req.top_k < 2**31:
        raise bad_request("top_k", f"must be in [0, 2^31) (0 disables), got {req.top_k}")
    if not 0.0 <= req.min_p <= 1.0:
        raise bad_request("min_p", f"must be in [0, 1], got {req.min_p}")
    if not 0.01 <= req.repetition_penalty <= 10.0:
        raise bad_request("repetition_penalty", f"must be in [0.01, 10], got {req.repetition_penalty}")
    for t in req.stop_token_ids or ():
        if not 0 <= t < 2**31:
            raise bad_request("stop_token_ids", f"token ids must be in [0, 2^31), got {t}")


_TOKEN_KEY = re.compile(r"\s*-?[0-9]{1,18}\s*")


def logit_bias(bias: dict[str, Any] | None, vocab_size: int, param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as SamplingParams.logit_bias; 400 naming `param` for a key that
    is not a token id of the vocabulary or a bias outside [-100, 100]."""
    from k3rt.sampling_params import MAX_LOGIT_BIAS
    from k3rt.server.errors import bad_request

    if bias and len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise bad_request(param, f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    out = []
    for key, value in (bias or {}).items():
        token = int(key) if _TOKEN_KEY.fullmatch(key) else None
        if token is None or not 0 <= token < vocab_size:
            raise bad_request(param, f"key {key[:40]!r} is not a token id in [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad_request(param, f"the bias of token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                              f"{MAX_LOGIT_BIAS:g}], got {value!r}")
        out.append((token, float(value)))
    return tuple(out)


def stop_list(req: SamplingFields) -> tuple[str, ...]:
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


__all__ = ["MAX_LOGPROBS", "MAX_N", "ChatCompletionRequest", "CompletionRequest", "Message", "SamplingFields",
           "Tool", "check_common", "stop_list"]
