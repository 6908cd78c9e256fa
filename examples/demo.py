"""The `make demo` program, on the shipped default model (k3-tiny, trained by k3rt on the Python
standard library). One `@k3rt.function` program, shipped whole to the engine:

  1. completes a Python function from its signature and docstring,
  2. summarizes that function as JSON constrained by a JSON schema,
  3. holds a short multi-turn exchange about it.

    python examples/demo.py [--model DIR] [--in-process] [--json]
"""

from __future__ import annotations

import json
import time
from typing import Any

from _common import backend, emit, parser

import k3rt

FUNCTION_HEAD = '''def count_words(path):
    """Return a dict mapping each word in the file at path to its number of occurrences."""
'''

IDENTIFIER = "^[A-Za-z_][A-Za-z0-9_]*$"  # a Python name: the schema, not the model, keeps it one
SUMMARY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": IDENTIFIER, "maxLength": 40},
        "arguments": {"type": "array", "items": {"type": "string", "pattern": IDENTIFIER, "maxLength": 20},
                      "maxItems": 4},
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["name", "arguments", "summary"],
    "additionalProperties": False,
}
# enough for the largest object the schema admits (40 + 4 * 20 + 120 characters plus the punctuation, at
# worst one token per character), so the constrained JSON is always complete: a token cap that cuts it
# short would leave an unterminated string
SUMMARY_MAX_TOKENS = 320
# Greedy text from a 12M-parameter model falls into loops ("path, path, path, ..."); a mild repetition
# penalty on the free-text gens keeps it varied. The JSON summary stays plainly greedy: the schema shapes it.
REPETITION_PENALTY = 1.2


@k3rt.function
def demo(s, head):
    # 1. plain completion: the model continues the function body until the next top-level statement or the
    #    end of the code block (its chat data shows functions in ``` fences)
    s += k3rt.user(f"Write a Python function `count_words(path)`. Return a dict mapping each word in the file "
                   f"at path to its number of occurrences.")
    s += k3rt.assistant(head + k3rt.gen("body", max_tokens=96, stop=["\ndef ", "\nclass ", "\n\n\n", "\n```"],
                                        repetition_penalty=REPETITION_PENALTY))
    # 2. a JSON summary, constrained by the schema (always parses, always validates)
    s += k3rt.user("Summarize this function as JSON with the keys name, arguments and summary.")
    s += k3rt.assistant(k3rt.gen("summary", json_schema=SUMMARY_SCHEMA, max_tokens=SUMMARY_MAX_TOKENS))
    # 3. a short multi-turn exchange
    s += k3rt.user("What does the function return?")
    s += k3rt.assistant(k3rt.gen("answer1", max_tokens=48, repetition_penalty=REPETITION_PENALTY))
    s += k3rt.user("Explain `str.split` in one sentence.")
    s += k3rt.assistant(k3rt.gen("answer2", max_tokens=48, repetition_penalty=REPETITION_PENALTY))


def run(be: Any) -> dict[str, Any]:
    t = time.perf_counter()
    st = demo.run(head=FUNCTION_HEAD, backend=be, temperature=0)
    return {"function": FUNCTION_HEAD + st["body"], "summary": json.loads(st["summary"]),
            "turns": [{"user": m["content"], "assistant": a["content"]}
                      for m, a in zip(st.messages()[4::2], st.messages()[5::2])],
            "seconds": round(time.perf_counter() - t, 2)}


def show(r: dict[str, Any]) -> None:
    print("== 1. completed function ==\n" + r["function"].rstrip() + "\n")
    print("== 2. JSON summary (schema-constrained) ==\n" + json.dumps(r["summary"], indent=2) + "\n")
    print("== 3. multi-turn ==")
    for t in r["turns"]:
        print(f"user: {t['user']}\nassistant: {t['assistant'].strip()}\n")
    print(f"(program ran in {r['seconds']} s, shipped to the engine in one round trip)")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.set_defaults(model=None)
    args = p.parse_args(argv)
    print("starting k3rt on " + (args.model or "the default model k3-tiny") + " ...", flush=True)
    with backend(args) as be:
        print("running the demo program ...", flush=True)
        emit(args, run(be), show)


if __name__ == "__main__":
    main()
