"""Every error the server returns, as OpenAI's error object:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`.

`APIError` is raised anywhere on the request path and rendered by the app's exception handler. Messages
start with the offending field (`"temperature: must be in [0, 2], got 5"`) and `param` names it, so a
client can tell what to fix without reading server logs.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import orjson
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An HTTP error with an OpenAI error body. `headers` (e.g. Retry-After) go on the response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(param: str | None, why: str, *, code: str | None = None) -> APIError:
    """400 whose message starts with the field: `bad_request("top_p", "must be in (0, 1], got 2")`."""
    return APIError(400, f"{param}: {why}" if param else why, param=param, code=code)


# OpenAI's fields are snake_case; pydantic also puts the tried union member into `loc` ("str",
# "list[str]", "NamedToolChoice", "literal[...]"), which is not a field
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_NOT_FIELDS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# error types whose message says what was wrong with the input (or there is none): no ", got ..."
_NO_INPUT = frozenset({"missing", "prompt_type", "json_too_deep"})


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and _FIELD.match(item) and item not in _NOT_FIELDS:
            parts.append(("." if parts else "") + item)
        else:
            break
    return "".join(parts) or None


def _head(value: Any, size: int) -> Any:
    """A small copy of the beginning of `value`, so that a huge input is never serialized whole."""
    if isinstance(value, (str, bytes)):
        return value[:size]
    if isinstance(value, (list, dict)):
        if size < 4:
            return "..."
        items = list(itertools.islice(value.items() if isinstance(value, dict) else value, size // 4))
        return dict((k, _head(v, size // 4)) for k, v in items) if isinstance(value, dict) else \
            [_head(v, size // 4) for v in items]
    return value


def _json_text(value: Any, limit: int = 80) -> str:
    value = _head(value, limit)
    try:
        return orjson.dumps(value, default=repr).decode()[:limit]
    except TypeError:  # an integer beyond 64 bits (orjson's `default` is not asked about those)
        return repr(value)[:limit]


# the JSON parser's error: "<what> at line L column C" (C counts bytes from 1)
_JSON_POSITION = re.compile(r"^(?:Invalid JSON: )?(.*) at line (\d+) column (\d+)$")
# a string (possibly cut off by the end of the text) or one structural character
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)|[{}\[\],:]')
JSON_MAX_DEPTH = 200  # the parser's recursion limit: containers nested inside the body's top-level object
_PATH_KEYS = 3  # a JSON error names the field down to this many keys (free-form content below is not a field)


def _json_path_at(body: bytes, offset: int) -> tuple[str | int, ...]:
    """The keys and indices leading to byte `offset` of `body`, from a scan of its strings and brackets
    (the parse failed, so there is no object to ask). Stops after `_PATH_KEYS` keys, or twice as many parts."""
    stack: list[list[Any]] = []  # [kind, key or index, expecting a key]; kind "{" or "["
    for m in _JSON_TOKEN.finditer(body, 0, offset):
        t = m.group()
        if t[:1] == b'"':
            if stack and stack[-1][0] == "{" and stack[-1][2]:
                try:
                    stack[-1][1] = json.loads(t) if len(t) <= 256 else None
                except ValueError:
                    stack[-1][1] = None
        elif t in (b"{", b"["):
            stack.append(["{", None, True] if t == b"{" else ["[", 0, False])
        elif t in (b"}", b"]"):
            if stack:
                stack.pop()
        elif t == b":" and stack:
            stack[-1][2] = False
        elif t == b"," and stack:
            if stack[-1][0] == "{":
                stack[-1][1:] = [None, True]
            else:
                stack[-1][1] += 1
    path: list[str | int] = []
    for kind, where, _ in stack if stack and stack[0][0] == "{" else []:
        if where is None or (kind == "{" and not isinstance(where, str)) or len(path) == 2 * _PATH_KEYS:
            break
        path.append(where)
        if sum(isinstance(p, str) for p in path) == _PATH_KEYS:
            break
    return tuple(path)


def _json_error(e: dict[str, Any], body: bytes | None) -> APIError:
    """A JSON syntax error, naming the field it is in when the body shows it."""
    m = _JSON_POSITION.match(e["msg"])
    what = m.group(1) if m else e["msg"]
    path: tuple[str | int, ...] = ()
    if m and body is not None:
        line, column = int(m.group(2)), int(m.group(3))
        start = 0
        for _ in range(line - 1):
            start = body.find(b"\n", start) + 1
        if start or line == 1:
            path = _json_path_at(body, min(start + column, len(body)))
    if what == "recursion limit exceeded":
        # the field, not the chain of indices down to where the parser gave up
        while path and isinstance(path[-1], int):
            path = path[:-1]
        what, code = f"JSON nested more than {JSON_MAX_DEPTH} levels deep", "json_too_deep"
    elif "surrogate" in what or "hex escape" in what:
        what, code = (f"invalid unicode: {what} (a \\ud800-\\udfff escape must be one half of a surrogate "
                      f"pair; a lone surrogate is not a character)"), "invalid_unicode"
    elif "unicode" in what:
        what, code = f"invalid unicode: {what} (the body must be UTF-8)", "invalid_unicode"
    else:
        what, code = f"not valid JSON: {what}", "invalid_json"
    param = _param_of(path)
    if param is None:
        return APIError(400, f"the request body is not valid JSON: {what.removeprefix('not valid JSON: ')}",
                        code=code)
    return APIError(400, f"{param}: {what}", param=param, code=code)


def from_validation_error(errors: list[dict[str, Any]], body: bytes | None = None) -> APIError:
    """A pydantic ValidationError's `errors()` -> one 400 naming the first bad field (and how many more).
    `body`: the JSON text that was parsed, to find the field a syntax error is in."""
    if any(e["type"] == "json_invalid" for e in errors):
        return _json_error(next(e for e in errors if e["type"] == "json_invalid"), body)
    first = errors[0]
    param = _param_of(tuple(first["loc"]))
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {first['msg']}", code="invalid_body")
    got_text = "" if first["type"] in _NO_INPUT else f", got {_json_text(first.get('input'))}"
    same = [e for e in errors if _param_of(tuple(e["loc"])) == param]
    if len(same) > 1:
        # a union field yields one error per member type it tried
        tried = "; ".join(dict.fromkeys(e["msg"] for e in same[:4]))
        msg = f"{param}: matches none of the accepted types ({tried}){got_text}"
    else:
        msg = f"{param}: {first['msg']}{got_text}"
    others = sorted({p for e in errors if (p := _param_of(tuple(e["loc"]))) and p != param})
    if others:
        msg += f" (also invalid: {', '.join(others[:5])})"
    return APIError(400, msg, param=param, code="invalid_value" if first["type"] != "missing" else "missing_field")
