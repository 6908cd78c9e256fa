"""The DSL's user-facing primitives: `@function`, `gen`, `select`, roles. Shaped like `sglang.lang` so
programs port by changing the import. Expressions are inert values; appending one to a state
(`s += expr`) records ops. No torch.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3rt.frontend.ir import CHOICE_METHODS, Op

# gen() keyword -> SamplingParams field
_PARAM_NAMES = {"max_tokens": "max_tokens", "max_new_tokens": "max_tokens", "temperature": "temperature",
                "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
                "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                "ignore_eos": "ignore_eos", "seed": "seed", "stop_token_ids": "stop_token_ids"}


class Expr(ABC):
    """Something that can be appended to a program state."""

    @abstractmethod
    def ops(self) -> list[Op]:
        """The IR ops this expression records (state and line are filled in by the state)."""

    def __add__(self, other: Expr | str) -> "ExprList":
        return ExprList([self, _expr(other)])

    def __radd__(self, other: Expr | str) -> "ExprList":
        return ExprList([_expr(other), self])


@dataclass
class ExprList(Expr):
    items: list[Expr]

    def ops(self) -> list[Op]:
        return [op for e in self.items for op in e.ops()]

    def __add__(self, other: Expr | str) -> "ExprList":
        return ExprList([*self.items, _expr(other)])


@dataclass
class TextExpr(Expr):
    text: str

    def ops(self) -> list[Op]:
        return [Op("text", value=self.text)]


@dataclass
class GenExpr(Expr):
    name: str | None
    params: dict[str, Any]
    stop: list[str]
    grammar: dict[str, Any] | None

    def ops(self) -> list[Op]:
        return [Op("gen", name=self.name, params=self.params, stop=self.stop, grammar=self.grammar)]


@dataclass
class SelectExpr(Expr):
    name: str | None
    choices: list[str]
    method: str

    def ops(self) -> list[Op]:
        return [Op("select", name=self.name, choices=self.choices, method=self.method)]


@dataclass
class RoleExpr(Expr):
    role: str
    content: Expr | None  # None: only a begin or an end marker
    part: str = "both"  # "begin" | "end" | "both"

    def ops(self) -> list[Op]:
        ops = [Op("role_begin", value=self.role)] if self.part in ("begin", "both") else []
        if self.content is not None:
            ops += self.content.ops()
        if self.part in ("end", "both"):
            ops.append(Op("role_end", value=self.role))
        return ops


def _expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return TextExpr(x)
    raise TypeError(f"cannot append {type(x).__name__} to a program state (use str, gen, select or a role)")


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | list[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        repetition_penalty: float | None = None, ignore_eos: bool | None = None, seed: int | None = None,
        stop_token_ids: list[int] | None = None, regex: str | None = None,
        json_schema: dict | str | None = None, choices: list[str] | None = None,
        max_new_tokens: int | None = None) -> Expr:
    """Generate text into variable `name`. `regex` / `json_schema` constrain it; `choices` makes it a select."""
    if choices is not None:
        return select(name, choices)
    if regex is not None and json_schema is not None:
        raise ValueError("gen: give at most one of regex and json_schema")
    local = dict(max_tokens=max_tokens, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                 top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                 repetition_penalty=repetition_penalty, ignore_eos=ignore_eos, seed=seed, stop_token_ids=stop_token_ids)
    params = {_PARAM_NAMES[k]: v for k, v in local.items() if v is not None}
    grammar = None
    if regex is not None:
        import re

        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"regex: invalid pattern {regex!r}: {e}") from None
        grammar = {"kind": "regex", "payload": regex, "strict": True}
    elif json_schema is not None:
        schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        grammar = {"kind": "json_schema", "payload": schema, "strict": True}
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return GenExpr(name, params, stops, grammar)


def gen_int(name: str | None = None, **kw: Any) -> Expr:
    # [0-9], not \d: constraints use Rust regex semantics, where \d matches every Unicode digit
    return gen(name, regex=r"-?[0-9]+", **kw)


def gen_string(name: str | None = None, **kw: Any) -> Expr:
    return gen(name, regex=r'"[^"\n]*"', **kw)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: str = "token_length_normalized") -> Expr:
    """Pick one of `choices` by likelihood from the current state (scored in one batched pass)."""
    if not choices:
        raise ValueError("choices: select needs a non-empty list of strings")
    if temperature != 0.0:
        raise ValueError("temperature: select scores choices deterministically; only 0.0 is supported")
    if choices_method not in CHOICE_METHODS:
        raise ValueError(f"choices_method: {choices_method!r} not one of {CHOICE_METHODS}")
    return SelectExpr(name, [str(c) for c in choices], choices_method)


def _role(role: str) -> tuple[Callable[..., Expr], Callable[[], Expr], Callable[[], Expr]]:
    def whole(expr: Expr | str | None = None) -> Expr:
        return RoleExpr(role, None if expr is None else _expr(expr))

    whole.__doc__ = f"The {role} turn around `expr` (chat template text comes from the model)."
    return whole, lambda: RoleExpr(role, None, "begin"), lambda: RoleExpr(role, None, "end")


system, system_begin, system_end = _role("system")
user, user_begin, user_end = _role("user")
assistant, assistant_begin, assistant_end = _role("assistant")
tool, tool_begin, tool_end = _role("tool")


class SglFunction:
    """A `@function` program. `run()` executes it on the default backend (or `backend=`)."""

    def __init__(self, func: Callable[..., Any], **bound: Any) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@k3rt.function {func.__name__}: the first argument must be the state `s`")
        self.func, self.bound = func, bound
        functools.update_wrapper(self, func)

    def bind(self, **kw: Any) -> "SglFunction":
        return SglFunction(self.func, **{**self.bound, **kw})

    def run(self, *args: Any, backend: Any = None, stream: bool = False, ship: bool = True,
            **kwargs: Any) -> Any:
        """Run the program; returns its state (variables by `s[name]`, `s.text()`, `s.messages()`).

        Sampling keywords (max_tokens, temperature, ...) become defaults for every gen in the program;
        other keywords are the program's own arguments. ship=False runs it client-side, one request per
        gen/select call (the results are the same)."""
        from k3rt.frontend.runner import run_program

        return run_program(self, args, kwargs, backend=backend, stream=stream, ship=ship)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None, progress_bar: bool = False,
                  ship: bool = True, **defaults: Any) -> list[Any]:
        """Run one program per kwargs dict concurrently; results in order."""
        from k3rt.frontend.runner import run_batch

        return run_batch(self, batch_kwargs, defaults, backend=backend, progress_bar=progress_bar, ship=ship)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, **bound: Any) -> Any:
    """Decorator: `@k3rt.function def prog(s, question): s += ...`."""
    if func is None:
        return lambda f: SglFunction(f, **bound)
    return SglFunction(func, **bound)
