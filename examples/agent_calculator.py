"""A multi-turn agent that calls a local calculator tool through JSON-constrained tool calls.

Each turn the assistant emits one tool call, constrained to TOOL_CALL_SCHEMA: either
`{"tool": "calculator", "expression": "12 * (3 + 4)"}` or `{"tool": "final_answer", "answer": "..."}`.
The program parses the call (it always parses: the schema constrains decoding), runs the calculator, a
small exact arithmetic parser (no eval), and feeds the result back as the next user turn, until the model
answers or the turn limit is reached. `min_tool_calls` works like OpenAI's tool_choice="required" for the
first turns: only the calculator branch of the schema is allowed there.

The control flow depends on generated values (which tool, which expression), so this program cannot ship
whole: it pays one client round trip per turn, and each turn continues the same server-side state, so the
conversation's prefix stays in the cache.

    python examples/agent_calculator.py --model DIR [--in-process] [--json]
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any

from _common import backend, emit, parser

import k3rt

# flat arithmetic the calculator always parses: up to four integers joined by + - * /
EXPRESSION_PATTERN = r"^-?[0-9]{1,4}( ?[-+*/] ?[0-9]{1,4}){0,3}$"

CALCULATOR_CALL = {
    "type": "object",
    "properties": {
        "tool": {"const": "calculator"},
        "expression": {"type": "string", "pattern": EXPRESSION_PATTERN},
    },
    "required": ["tool", "expression"],
    "additionalProperties": False,
}
FINAL_ANSWER = {
    "type": "object",
    "properties": {
        "tool": {"const": "final_answer"},
        "answer": {"type": "string", "maxLength": 48},
    },
    "required": ["tool", "answer"],
    "additionalProperties": False,
}
TOOL_CALL_SCHEMA = {"anyOf": [CALCULATOR_CALL, FINAL_ANSWER]}

SYSTEM = (
    "You solve arithmetic word problems. Every reply is one JSON tool call: "
    '{"tool": "calculator", "expression": "<arithmetic>"} to compute, or '
    '{"tool": "final_answer", "answer": "<text>"} when done. Calculator results come back as user turns.'
)


class CalculatorError(ValueError):
    pass


def calculate(expression: str) -> Fraction:
    """Exact value of + - * / and parentheses over integers and decimals (recursive descent, no eval)."""
    tokens = re.findall(r"\d+(?:\.\d+)?|[-+*/()]|\S", expression)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise CalculatorError("unexpected end of expression")
        pos += 1
        return tokens[pos - 1]

    def expr() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    def term() -> Fraction:
        value = factor()
        while peek() in ("*", "/"):
            if take() == "*":
                value *= factor()
            else:
                d = factor()
                if d == 0:
                    raise CalculatorError("division by zero")
                value /= d
        return value

    def factor() -> Fraction:
        t = take()
        if t in ("+", "-"):
            v = factor()
            return v if t == "+" else -v
        if t == "(":
            v = expr()
            if peek() != ")":
                raise CalculatorError("missing )")
            take()
            return v
        if re.fullmatch(r"\d+(?:\.\d+)?", t):
            return Fraction(t)
        raise CalculatorError(f"unexpected {t!r}")

    value = expr()
    if pos != len(tokens):
        raise CalculatorError(f"unexpected {tokens[pos]!r}")
    return value


def format_number(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.6g}"


def run_tool(call: dict[str, Any]) -> str:
    try:
        return format_number(calculate(call["expression"]))
    except CalculatorError as e:
        return f"error: {e}"


@k3rt.function
def agent(s, question, max_turns=4, min_tool_calls=0):
    s += k3rt.system(SYSTEM)
    s += k3rt.user(question)
    for turn in range(max_turns):
        schema = CALCULATOR_CALL if turn < min_tool_calls else TOOL_CALL_SCHEMA
        s += k3rt.assistant(k3rt.gen(f"call_{turn}", json_schema=schema, max_tokens=96))
        call = json.loads(s.get_var(f"call_{turn}"))  # reads the value now: one round trip
        if call["tool"] == "final_answer":
            break
        s += k3rt.user(f"calculator({call['expression']}) = {run_tool(call)}")


def run(backend: Any, question: str = "A shop sells 17 boxes of 24 pens and 9 boxes of 12 pens. How many pens?",
        max_turns: int = 4, min_tool_calls: int = 2) -> dict[str, Any]:
    state = agent.run(question=question, max_turns=max_turns, min_tool_calls=min_tool_calls, backend=backend,
                      temperature=0)
    calls = []
    for turn in range(max_turns):
        try:
            raw = state.get_var(f"call_{turn}")
        except KeyError:  # the agent answered before this turn
            break
        call = json.loads(raw)
        calls.append({"turn": turn, "raw": raw, "call": call,
                      "result": run_tool(call) if call["tool"] == "calculator" else None})
    answered = bool(calls) and calls[-1]["call"]["tool"] == "final_answer"
    return {"question": question, "calls": calls, "answered": answered, "messages": state.messages()}


def show(r: dict[str, Any]) -> None:
    print(f"Q: {r['question']}")
    for c in r["calls"]:
        if c["call"]["tool"] == "calculator":
            print(f"  turn {c['turn']}: calculator({c['call']['expression']}) -> {c['result']}")
        else:
            print(f"  turn {c['turn']}: final answer: {c['call']['answer']}")
    if not r["answered"]:
        print("  (turn limit reached without a final answer)")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--question", default=None)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--min-tool-calls", type=int, default=2)
    args = p.parse_args(argv)
    kw = {"max_turns": args.max_turns, "min_tool_calls": args.min_tool_calls}
    if args.question:
        kw["question"] = args.question
    with backend(args) as be:
        emit(args, run(be, **kw), show)


if __name__ == "__main__":
    main()
