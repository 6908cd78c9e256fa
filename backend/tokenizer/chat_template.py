"""Render a model's Jinja chat template the way HF `apply_chat_template` does, without transformers.

Templates ship with checkpoints and are untrusted code, so they run in jinja2's immutable sandbox. The
environment matches HF's: `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter
that does not HTML-escape and accepts `indent`, `separators`, `sort_keys` and `ensure_ascii`, and the globals
`raise_exception`, `strftime_now` and `namespace`. This module knows nothing about token ids: it produces text.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's built-in tojson escapes <, >, & and ' for HTML, which would change the prompt the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token variables (`bos_token`, `eos_token`, ...) it may use.

    `source` is one template, or named templates as HF allows (`"default"`, and `"tool_use"` which is preferred
    when tools are passed). Templates are compiled on construction, so syntax errors surface at load time.
    """

    def __init__(self, source: str | dict[str, str], *, special_tokens: dict[str, str]) -> None:
        env = _make_environment()
        named = source if isinstance(source, dict) else {"default": source}
        self._templates = {name: env.from_string(text) for name, text in named.items()}
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`. Keys whose value is None are dropped from each message first (as HF
        does), because OpenAI clients send `content: null` beside `tool_calls`. Extra `kwargs` become template
        variables and override the special-token names. Raises `jinja2.TemplateError` if the template calls
        `raise_exception` (e.g. for a role it does not support)."""
        template = self._select(has_tools=bool(tools))
        cleaned = [{key: value for key, value in message.items() if value is not None} for message in messages]
        variables = {**self._special_tokens, **kwargs}
        return template.render(
            messages=cleaned, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    def _select(self, *, has_tools: bool) -> jinja2.Template:
        if has_tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise ValueError(f"no 'default' chat template among the named templates {sorted(self._templates)}")
