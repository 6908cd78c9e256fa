"""Every example in examples/ runs against the tiny checkpoint: through its `run(backend)` on this module's
Runtime (structure asserted; the model is random, so the content is noise), and standalone as
`python examples/X.py --model DIR --in-process --json`, whose output must equal the in-module run (greedy)."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import jsonschema
import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
NAMES = ["few_shot_qa", "regex_extraction", "json_extraction", "parallel_drafts", "agent_calculator"]


@pytest.fixture(scope="module")
def examples() -> dict:
    sys.path.insert(0, str(EXAMPLES_DIR))
    try:
        return {n: importlib.import_module(n) for n in NAMES}
    finally:
        sys.path.remove(str(EXAMPLES_DIR))


@pytest.fixture(scope="module")
def results(examples, rt) -> dict:
    return {n: examples[n].run(rt) for n in NAMES}


def test_few_shot_qa(examples, results) -> None:
    rows = results["few_shot_qa"]
    assert [r["question"] for r in rows] == examples["few_shot_qa"].QUESTIONS
    for r in rows:
        assert "\n" not in r["answer"] and r["completion_tokens"] <= 24
    # the shots are shared text: all but (at most) the first program find them in the cache
    assert sum(r["cached_tokens"] > 0 for r in rows) >= len(rows) - 1


def test_regex_extraction(examples, results) -> None:
    fields = examples["regex_extraction"].FIELDS
    for r in results["regex_extraction"]:
        assert r["fields"].keys() == fields.keys()
        for name, value in r["fields"].items():
            assert re.fullmatch(fields[name], value), (name, value)


def test_json_extraction(examples, results) -> None:
    mod = examples["json_extraction"]
    rows = results["json_extraction"]
    assert len(rows) == len(mod.BIOS)
    for r in rows:
        assert r["finish_reason"] == "stop"
        jsonschema.validate(r["record"], mod.PERSON_SCHEMA)


def test_parallel_drafts(examples, results) -> None:
    r = results["parallel_drafts"]
    n = len(examples["parallel_drafts"].STYLES)
    assert len(r["drafts"]) == n and all(isinstance(d, str) and "\n" not in d for d in r["drafts"])
    assert 1 <= r["best"] <= n and len(r["scores"]) == n
    assert r["scores"][r["best"] - 1] == max(r["scores"])
    # the parent saw every draft, numbered in child order, before choosing
    shown = r["messages"][-2]["content"]
    assert shown == "Which is best?\n" + "".join(f"{i + 1}. {d}\n" for i, d in enumerate(r["drafts"]))


def test_agent_calculator_structure(examples, results) -> None:
    mod = examples["agent_calculator"]
    r = results["agent_calculator"]
    calls = r["calls"]
    assert 2 <= len(calls) <= 4  # min_tool_calls=2, max_turns=4: the loop terminated
    assert all(c["call"]["tool"] == "calculator" for c in calls[:2])
    assert all(c["call"]["tool"] == "calculator" for c in calls[:-1])  # only the last may be the answer
    assert r["answered"] == (calls[-1]["call"]["tool"] == "final_answer")
    for c in calls:
        jsonschema.validate(c["call"], mod.TOOL_CALL_SCHEMA)
    # the conversation: system, question, then per turn the call and (for the calculator) its result
    msgs = r["messages"]
    assert [m["role"] for m in msgs[:2]] == ["system", "user"]
    turn_msgs = msgs[2:]
    for c in calls:
        assert turn_msgs.pop(0) == {"role": "assistant", "content": c["raw"]}
        if c["call"]["tool"] == "calculator":
            assert turn_msgs.pop(0) == {"role": "user",
                                        "content": f"calculator({c['call']['expression']}) = {c['result']}"}
    assert turn_msgs == []


@pytest.mark.parametrize("expr, value", [
    ("1 + 2 * 3", Fraction(7)), ("(1 + 2) * 3", Fraction(9)), ("-4 - -2", Fraction(-2)), ("7 / 2", Fraction(7, 2)),
    ("2 * (3 + (4 - 1)) / 3", Fraction(4)), ("0.5 + 0.25", Fraction(3, 4)), ("10 - 2 - 3", Fraction(5)),
    ("24 / 4 / 3", Fraction(2)),
])
def test_calculator(examples, expr: str, value: Fraction) -> None:
    assert examples["agent_calculator"].calculate(expr) == value


@pytest.mark.parametrize("expr, error", [
    ("1 / 0", "division by zero"), ("1 +", "end of expression"), ("(1 + 2", "missing"), ("2 3", "unexpected"),
    ("__import__('os')", "unexpected"),
])
def test_calculator_errors(examples, expr: str, error: str) -> None:
    mod = examples["agent_calculator"]
    with pytest.raises(mod.CalculatorError, match=error):
        mod.calculate(expr)
    assert mod.run_tool({"tool": "calculator", "expression": expr}).startswith("error: ")


@pytest.mark.parametrize("name", NAMES)
def test_example_runs_standalone(name: str, tiny_model, results) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES_DIR / f"{name}.py"), "--model", str(tiny_model),
                           "--in-process", "--json"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same output as the in-module run, up to what the prefix cache held beforehand
    assert _uncached(json.loads(proc.stdout.strip().splitlines()[-1])) == _uncached(json.loads(json.dumps(results[name])))


def _uncached(x):
    if isinstance(x, dict):
        return {k: _uncached(v) for k, v in x.items() if k != "cached_tokens"}
    if isinstance(x, list):
        return [_uncached(v) for v in x]
    return x


def test_demo_on_the_shipped_model_is_complete_and_matches_make_demo() -> None:
    # `make demo` runs examples/demo.py on k3-tiny: every part is there, the JSON is complete and valid
    # under its schema (the token cap covers the largest object the schema admits), and the standalone
    # script prints exactly what an in-module run returns
    sys.path.insert(0, str(EXAMPLES_DIR))
    try:
        demo = importlib.import_module("demo")
    finally:
        sys.path.remove(str(EXAMPLES_DIR))
    import k3rt

    with k3rt.Runtime(in_process=True) as rt:
        r = demo.run(rt)
    assert r["function"].startswith(demo.FUNCTION_HEAD) and len(r["function"]) > len(demo.FUNCTION_HEAD)
    jsonschema.validate(r["summary"], demo.SUMMARY_SCHEMA)
    assert [t["user"] for t in r["turns"]] == ["What does the function return?", "Explain `str.split` in one sentence."]
    assert all(t["assistant"].strip() for t in r["turns"])
    out = subprocess.run([sys.executable, str(EXAMPLES_DIR / "demo.py"), "--in-process", "--json"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    standalone = json.loads(out[out.index("{"):])
    assert {k: v for k, v in standalone.items() if k != "seconds"} == {k: v for k, v in r.items() if k != "seconds"}
