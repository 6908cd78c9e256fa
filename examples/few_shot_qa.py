"""Few-shot question answering: a fixed block of worked examples, then the question; the answer stops at the
end of its line. `run_batch` sends every question at once, and since the examples are the same text for all
of them, the server computes them once (the `cached` column counts prompt tokens served from the cache).

    python examples/few_shot_qa.py --model DIR [--in-process] [--json]
"""

from __future__ import annotations

from typing import Any

from _common import backend, emit, parser

import k3rt

SHOTS = [
    ("What is the capital of France?", "Paris."),
    ("How many legs does a spider have?", "Eight."),
    ("Which planet is known as the red planet?", "Mars."),
    ("What do bees make?", "Honey."),
    ("What is the boiling point of water at sea level in Celsius?", "100 degrees."),
]

QUESTIONS = [
    "What is the largest ocean on Earth?",
    "Who wrote Hamlet?",
    "What gas do plants absorb from the air?",
    "How many days are in a leap year?",
]


@k3rt.function
def few_shot_qa(s, question):
    s += "Answer each question in a few words.\n\n"
    for q, a in SHOTS:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + k3rt.gen("answer", max_tokens=24, stop="\n")


def run(backend: Any, questions: list[str] = QUESTIONS) -> list[dict[str, Any]]:
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0)
    return [{"question": q, "answer": st["answer"].strip(), **st.meta("answer")} for q, st in zip(questions, states)]


def show(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"Q: {r['question']}\nA: {r['answer']}\n   (prompt {r['prompt_tokens']} tokens, "
              f"cached {r['cached_tokens']}, generated {r['completion_tokens']})\n")


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    with backend(args) as be:
        emit(args, run(be), show)


if __name__ == "__main__":
    main()
