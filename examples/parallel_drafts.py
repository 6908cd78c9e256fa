"""Parallel drafting with fork/join: the brief is computed once, then n children each write a draft in their
own style at the same time (they share the brief's cache pages); `join()` gathers the drafts into a list,
the parent shows them to the model and lets it pick one with `select`.

    python examples/parallel_drafts.py --model DIR [--in-process] [--json]
"""

from __future__ import annotations

from typing import Any

from _common import backend, emit, parser

import k3rt

STYLES = ["playful", "formal", "minimal"]


@k3rt.function
def parallel_drafts(s, product, styles=STYLES):
    s += k3rt.system("You write one-line product taglines.")
    s += k3rt.user(f"Write a tagline for {product}.")
    drafts = s.fork(len(styles))
    for style, d in zip(styles, drafts):
        d += k3rt.assistant(f"({style}) " + k3rt.gen("draft", max_tokens=20, stop="\n"))
    drafts.join()  # s["draft"] is now the list of drafts, in child order
    s += k3rt.user("Which is best?\n" + "".join(f"{i + 1}. {d}\n" for i, d in enumerate(s["draft"])))
    s += k3rt.assistant("Draft " + k3rt.select("best", [str(i + 1) for i in range(len(styles))]))


def run(backend: Any, product: str = "a solar-powered bicycle lamp") -> dict[str, Any]:
    state = parallel_drafts.run(product=product, backend=backend, temperature=0)
    best = int(state["best"])
    return {"product": product, "styles": STYLES, "drafts": state["draft"], "best": best,
            "scores": state.meta("best")["scores"], "messages": state.messages()}


def show(r: dict[str, Any]) -> None:
    print(f"Taglines for {r['product']}:")
    for i, (style, d) in enumerate(zip(r["styles"], r["drafts"])):
        mark = "*" if i + 1 == r["best"] else " "
        print(f" {mark} {i + 1}. ({style}) {d.strip()}")


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    with backend(args) as be:
        emit(args, run(be), show)


if __name__ == "__main__":
    main()
