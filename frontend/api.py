"""The DSL's user-facing primitives: `@function`, `gen`, `select`, roles. Shaped like `sglang.lang` so
programs port by changing the import. Expressions are inert values; appending one to a state
(`s += expr`) records ops. No torch.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3rt.frontend.choices import ChoicesSamplingMethod, method_name, token_length_normalized
from k3rt.frontend.ir import CHOICE_METHODS, REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, Op
from k3rt.sampling_params import MAX_LOGPROBS

# gen() keyword -> SamplingParams field
_PARAM_NAMES = {"max_tokens": "max_tokens", "max_new_tokens": "max_tokens", "temperature": "temperature",
                "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
                "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
                "ignore_eos": "ignore_eos", "seed": "seed", "stop_token_ids": "stop_token_ids",
                "min_tokens": "min_tokens"}


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
    options: dict[str, Any]

    def ops(self) -> list[Op]:
        return [Op("gen", name=self.name, params=self.params, stop=self.stop, grammar=self.grammar,
                   options=self.options)]


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


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: type | str | None = None,
        choices: list[str] | None = None, choices_method: ChoicesSamplingMethod | str | None = None,
        regex: str | None = None, json_schema: dict | str | None = None, *,
        repetition_penalty: float | None = None, seed: int | None = None,
        max_new_tokens: int | None = None) -> Expr:
    """Generate text into variable `name`; the positional order is `sglang.gen`'s.

    max_tokens (alias max_new_tokens), min_tokens (the stop tokens, EOS and stop strings count only after
    this many tokens), stop, stop_token_ids, stop_regex (stop where the text first matches one; the match
    is cut like a stop string), and the sampling keywords work as in SamplingParams. n > 1: n samples
    from the same state; the variable is their list and the state continues with the first.
    return_logprob: s.get_meta_info(name) gets output_token_logprobs [(logprob, token_id, text or None)]
    (text with return_text_in_logprobs), output_top_logprobs with top_logprobs_num alternatives per
    token, and input_token_logprobs of the prompt from logprob_start_len (default: none).
    dtype int / float / str / bool constrains the text by sglang's REGEX_INT / ... (ints and floats also
    stop at " " and "\\n"); regex / json_schema constrain it; choices makes it a select."""
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      token_length_normalized if choices_method is None else choices_method)
    if dtype is not None:
        if regex is not None or json_schema is not None:
            raise ValueError("gen: give at most one of dtype, regex and json_schema")
        regex, extra_stop = _dtype_regex(dtype)
    else:
        extra_stop = []
    if regex is not None and json_schema is not None:
        raise ValueError("gen: give at most one of regex and json_schema")
    local = dict(max_tokens=max_tokens, max_new_tokens=max_new_tokens, min_tokens=min_tokens, temperature=temperature,
                 top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                 presence_penalty=presence_penalty, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
                 seed=seed, stop_token_ids=stop_token_ids)
    params = {_PARAM_NAMES[k]: v for k, v in local.items() if v is not None}
    if params.get("top_k") == -1:
        params["top_k"] = 0  # sglang's "off"
    grammar = None
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"regex: invalid pattern {regex!r}: {e}") from None
        grammar = {"kind": "regex", "payload": regex, "strict": True}
    elif json_schema is not None:
        schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        grammar = {"kind": "json_schema", "payload": schema, "strict": True}
    options: dict[str, Any] = {}
    for key, v in (("n", n), ("stop_regex", stop_regex), ("return_logprob", return_logprob),
                   ("logprob_start_len", logprob_start_len), ("top_logprobs_num", top_logprobs_num),
                   ("return_text_in_logprobs", return_text_in_logprobs)):
        if v is not None:
            options[key] = v
    check_gen_options(options)
    if stop is not None:
        options["own_stop"] = True  # this gen's stop replaces run()'s (sglang: a gen's value wins)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return GenExpr(name, params, stops + extra_stop, grammar, options)


def check_gen_options(options: dict[str, Any]) -> None:
    """Normalize and check GEN_OPTIONS in place (gen() and run() defaults); ValueError names the field."""
    n = options.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n: must be an int >= 1, got {n!r}")
    if "stop_regex" in options:
        sr = options["stop_regex"]
        options["stop_regex"] = [sr] if isinstance(sr, str) else list(sr)
        for pattern in options["stop_regex"]:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"stop_regex: invalid pattern {pattern!r}: {e}") from None
    for key in ("logprob_start_len", "top_logprobs_num"):
        v = options.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{key}: must be an int, got {v!r}")
    k = options.get("top_logprobs_num")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs_num: must be in [0, {MAX_LOGPROBS}], got {k}")


def _dtype_regex(dtype: type | str) -> tuple[str, list[str]]:
    """sglang's dtype -> (regex, extra stop strings)."""
    if dtype in (int, "int"):
        return REGEX_INT, [" ", "\n"]
    if dtype in (float, "float"):
        return REGEX_FLOAT, [" ", "\n"]
    if dtype in (str, "str"):
        return REGEX_STR, []
    if dtype in (bool, "bool"):
        return REGEX_BOOL, []
    raise ValueError(f"dtype: {dtype!r} not one of int, float, str, bool")


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None, **kw: Any) -> Expr:
    """An integer: gen(dtype=int), as sglang.gen_int."""
    return gen(name, max_tokens, n=n, dtype=int, **kw)


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None, **kw: Any) -> Expr:
    """A double-quoted string of word characters and spaces: gen(dtype=str), as sglang.gen_string."""
    return gen(name, max_tokens, n=n, dtype=str, **kw)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod | str = token_length_normalized) -> Expr:
    """Pick one of `choices` by likelihood from the current state (scored in one batched pass);
    choices_method: frontend/choices.py."""
    if not choices:
        raise ValueError("choices: select needs a non-empty list of strings")
    if temperature > 1e-5:  # sglang asserts the same
        raise ValueError("temperature: select scores choices deterministically; only 0.0 is supported")
    method = method_name(choices_method)
    if method not in CHOICE_METHODS:
        raise ValueError(f"choices_method: {method!r} not one of {CHOICE_METHODS}")
    return SelectExpr(name, [str(c) for c in choices], method)


def image(path: Any) -> Expr:
    """sglang.image: refused, because no model k3rt runs has a vision tower."""
    raise ValueError(f"image({path!r}): this model has no vision tower; k3rt runs text-only Kimi models, so a "
                     "program cannot attach images")


def video(path: Any, num_frames: int = 0) -> Expr:
    """sglang.video: refused, because no model k3rt runs has a vision tower."""
    raise ValueError(f"video({path!r}): this model has no vision tower; k3rt runs text-only Kimi models, so a "
                     "program cannot attach videos")


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
    """A `@function` program. `run()` executes it on the default backend (or `backend=`).

    num_api_spec_tokens: sglang's API speculative execution, which makes one API call serve several gens
    of an OpenAI-style backend. Accepted and kept, and it changes nothing: a k3rt program ships to the
    server whole and makes no call per gen to save."""

    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None, **bound: Any) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@k3rt.function {func.__name__}: the first argument must be the state `s`")
        self.func, self.bound, self.num_api_spec_tokens = func, bound, num_api_spec_tokens
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def bind(self, **kw: Any) -> "SglFunction":
        return SglFunction(self.func, self.num_api_spec_tokens, **{**self.bound, **kw})

    def run(self, *args: Any, backend: Any = None, stream: bool = False, ship: bool = True,
            use_thread: bool = True, **kwargs: Any) -> Any:
        """Run the program; returns its state (variables by `s[name]`, `s.text()`, `s.messages()`).

        The keywords of sglang's run() (max_new_tokens, temperature, stop, n, return_logprob, ...: runner.py
        RUN_KEYS) become defaults for every gen of the program and never reach the program; other
        keywords are the program's own arguments. ship=False runs it client-side, one request per
        gen/select call (the results are the same). use_thread: accepted for sglang (its interpreter's
        worker thread); k3rt records on the caller's thread either way."""
        from k3rt.frontend.runner import run_program

        return run_program(self, args, kwargs, backend=backend, stream=stream, ship=ship)

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple | list], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
                  ship: bool = True, **defaults: Any) -> Any:
        """Run one program per entry concurrently; results in order. An entry is a dict of arguments, or
        a list/tuple of them in the function's order. num_threads: programs recording at once ("auto":
        min(batch, 64)). generator_style=True returns a generator that yields the states in order as
        they finish. Other keywords as in run()."""
        from k3rt.frontend.runner import run_batch

        return run_batch(self, list(batch_kwargs), defaults, backend=backend, num_threads=num_threads,
                         progress_bar=progress_bar, generator_style=generator_style, ship=ship)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None,
             **bound: Any) -> Any:
    """Decorator: `@k3rt.function def prog(s, question): s += ...`, or `@k3rt.function(num_api_spec_tokens=64)`."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens, **bound)
    return SglFunction(func, num_api_spec_tokens, **bound)
