"""The program IR: what a traced `@k3rt.function` becomes, and what the gateway executes.

A program is a list of ops, each applied to one *state* (0 is the root; `fork` creates more). Ops of
one state run in order; different states run concurrently once forked. Everything here is plain
data (JSON via to_dict/from_dict), so programs ship over the wire. No torch, no tokenizer.

Ops:
  text(value)                      append constant text
  gen(name, params, grammar, stop) generate; stores text in variables[name] (name may be None)
  select(name, choices, method)    score the choices from the current state, append the best
  role_begin(role) / role_end(role)  chat roles (system/user/assistant/tool): template text around content
  fork(children)                   the listed new states start as copies of this one
  join(children, value=mode)       wait for the children; "gather_variable" (the default): their new
                                   variables are appended to this state's variables as lists;
                                   "concate_and_append": their text since the fork is appended to this
                                   state's text, child by child
  var_begin(name) / var_end(name)  `with s.var_scope(name)`: the text appended in between becomes variable name
  set_var(name, params={"value"})  set a variable to a JSON value (`s[name] = value`)
Each op records the source `line` of the program that produced it, so errors point at user code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OP_KINDS = ("text", "gen", "select", "role_begin", "role_end", "fork", "join", "var_begin", "var_end", "set_var")
ROLES = ("system", "user", "assistant", "tool")
CHOICE_METHODS = ("token_length_normalized", "greedy", "unconditional_likelihood_normalized")
JOIN_MODES = ("gather_variable", "concate_and_append")
# gen keywords that shape what a gen returns rather than how it samples (Op.options; run() defaults too)
GEN_OPTIONS = ("n", "stop_regex", "return_logprob", "logprob_start_len", "top_logprobs_num",
               "return_text_in_logprobs")

# sglang.lang.ir's regexes for gen(dtype=...), same strings. [0-9], not \d: grammars use Rust regex
# semantics, where \d is every Unicode digit. int and float gens also stop at " " and "\n".
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


@dataclass(frozen=True)
class Op:
    kind: str
    state: int = 0
    value: str | None = None  # text / role name / join mode
    name: str | None = None  # variable name
    params: dict[str, Any] = field(default_factory=dict)  # sampling params overrides (gen)
    stop: list[str] = field(default_factory=list)  # stop strings (gen)
    options: dict[str, Any] = field(default_factory=dict)  # GEN_OPTIONS of a gen; "own_stop": stop replaces run()'s
    grammar: dict[str, Any] | None = None  # GrammarSpec dict (gen with regex / json_schema / choices)
    choices: list[str] = field(default_factory=list)  # select
    method: str = "token_length_normalized"  # select
    children: list[int] = field(default_factory=list)  # fork / join
    line: int = 0  # source line in the user's program

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"op kind: {self.kind!r} not one of {OP_KINDS}")
        if self.kind in ("role_begin", "role_end") and self.value not in ROLES:
            raise ValueError(f"role: {self.value!r} not one of {ROLES}")
        if self.kind == "select":
            if not self.choices:
                raise ValueError("choices: select needs at least one choice")
            if self.method not in CHOICE_METHODS:
                raise ValueError(f"choices_method: {self.method!r} not one of {CHOICE_METHODS}")
        if self.kind == "join" and self.value is not None and self.value not in JOIN_MODES:
            raise ValueError(f"join mode: {self.value!r} not one of {JOIN_MODES}")
        if self.kind in ("var_begin", "var_end", "set_var") and not self.name:
            raise ValueError(f"{self.kind}: needs a variable name")
        if self.kind == "set_var" and "value" not in self.params:
            raise ValueError("set_var: params.value missing")
        unknown = set(self.options) - {*GEN_OPTIONS, "own_stop"}
        if unknown:
            raise ValueError(f"options: unknown {sorted(unknown)}")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, [], {}, 0, "") or k == "kind"}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Op":
        return Op(**d)


@dataclass(frozen=True)
class Program:
    ops: list[Op]
    num_states: int = 1
    default_params: dict[str, Any] = field(default_factory=dict)  # run(...) sampling defaults
    name: str = "program"

    def to_dict(self) -> dict[str, Any]:
        return {"ops": [o.to_dict() for o in self.ops], "num_states": self.num_states,
                "default_params": self.default_params, "name": self.name}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Program":
        return Program([Op.from_dict(o) for o in d["ops"]], d.get("num_states", 1), d.get("default_params", {}),
                       d.get("name", "program"))
