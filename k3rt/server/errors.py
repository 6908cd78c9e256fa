"""Every error the server returns, as OpenAI's error object:
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`.

`APIError` is raised anywhere on the request path and rendered by the app's exception handler. Messages
start with the offending field (`"temperature: must be in [0, 2], got 5"`) and `param` names it, so a
client can tell what to fix without reading server logs.
"""

from __future__ import annotations

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


def _json_text(value: Any) -> str:
    try:
        return orjson.dumps(value, default=repr).decode()
    except TypeError:  # an integer beyond 64 bits (orjson's `default` is not asked about those)
        return repr(value)


def from_validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A pydantic ValidationError's `errors()` -> one 400 naming the first bad field (and how many more)."""
    if any(e["type"] == "json_invalid" for e in errors):
        e = next(e for e in errors if e["type"] == "json_invalid")
        return APIError(400, f"the request body is not valid JSON: {e['msg']}", code="invalid_json")
    first = errors[0]
    param = _param_of(tuple(first["loc"]))
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {first['msg']}", code="invalid_body")
    got_text = "" if first["type"] == "missing" else f", got {_json_text(first.get('input'))[:80]}"
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
