"""The function-completion test of the default model: which functions, when a completion ends, how it is
scored. Shared by scripts/eval_default_model.py (the reported number, through the Engine) and the
training run (scripts/train_default_model.py, on a copy of its current weights), so both judge
completions by the same rules and drive the Engine the same way (`engine_completions`).

Cases: functions of 3..30 lines from the given documents, spread evenly in (file, line) order. The prompt
is the function's header, its signature lines and docstring if it has one, dedented to column 0. A
completion ends at its function's end, the first non-blank line that starts at column 0 (the dedent
heuristic), or at EOS, or at the token cap. It is `complete` when it ended before the cap, holds a
non-blank line (a docstring alone parses, so an empty completion does not count) and
`ast.parse(header + completion)` accepts it; `parses` also counts completions cut at the cap whose text
happens to parse (repetition loops cut at a statement boundary, mostly).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from k3rt.training.corpus import Document, dedent_rows

_TOP_LEVEL_LINE = re.compile(r"\n(?=[^\s])")


@dataclass(frozen=True)
class FunctionCase:
    module: str  # the document's path
    qualname: str
    lineno: int
    header: str  # dedented signature (+ docstring) ending in "\n"
    reference: str  # the dedented original function


def _functions(doc: Document) -> list[FunctionCase]:
    lines = doc.text.split("\n")
    cases: list[FunctionCase] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                case = _case(doc.name, lines, child, prefix)
                if case is not None:
                    cases.append(case)
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(doc.text), "")
    return cases


def _case(module: str, lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef, prefix: str) -> FunctionCase | None:
    if fn.end_lineno is None or not 3 <= fn.end_lineno - fn.lineno <= 30:
        return None
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str)
    if has_doc and len(body) == 1:
        return None  # nothing to complete after the docstring
    header_end = body[0].end_lineno if has_doc else body[0].lineno - 1
    if header_end is None or header_end < fn.lineno or (body[1] if has_doc else body[0]).lineno <= header_end:
        return None  # a body on the def line, or a statement sharing the docstring's line
    indent = len(lines[fn.lineno - 1]) - len(lines[fn.lineno - 1].lstrip())

    header = dedent_rows(lines[fn.lineno - 1:header_end], indent) + "\n"
    reference = dedent_rows(lines[fn.lineno - 1:fn.end_lineno], indent) + "\n"
    try:
        ast.parse(reference)
    except SyntaxError:
        return None
    return FunctionCase(module, prefix + fn.name, fn.lineno, header, reference)


def select_functions(docs: Sequence[Document], n: int) -> list[FunctionCase]:
    """n cases spread evenly over all eligible functions of the documents, in (file, line) order."""
    pool = [c for d in sorted(docs, key=lambda d: d.name) for c in _functions(d)]
    if len(pool) <= n:
        return pool
    return [pool[round(i * (len(pool) - 1) / (n - 1))] for i in range(n)] if n > 1 else pool[:1]


def function_end(completion: str) -> int | None:
    """Index where the function ends in `completion` (the first non-blank line at column 0), or None."""
    m = _TOP_LEVEL_LINE.search(completion)
    return None if m is None else m.start() + 1


def completion_result(text: str, finish_reason: str | None, num_tokens: int) -> dict | None:
    """The completion so far (`text`: generated tokens decoded without EOS/special tokens), if it has ended:
    at the function's end ("dedent"), or because generation finished (finish_reason "stop" for EOS,
    "length" for the cap); None while it goes on."""
    end = function_end(text)
    if end is not None:
        return {"completion": text[:end], "stop": "dedent", "tokens": num_tokens}
    if finish_reason is not None:
        return {"completion": text, "stop": finish_reason, "tokens": num_tokens}
    return None


def engine_completions(engine, tok, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[dict, list[int]]]:
    """Greedy completions through a k3rt `Engine`: per prompt (token ids), its `completion_result` and the
    token ids generated up to the step that ended it (EOS included). A completion that reaches its
    function's end is aborted there, so the engine's batch holds only completions still going."""
    from k3rt.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rids = [engine.add_request(list(p), params) for p in prompts]
    out_ids: dict[int, list[int]] = {rid: [] for rid in rids}
    result: dict[int, dict] = {}
    eos = set(tok.eos_token_ids)
    while engine.has_unfinished:
        for o in engine.step():
            if o.rid in result:
                continue
            out_ids[o.rid].extend(o.new_token_ids)
            text = tok.decode([t for t in out_ids[o.rid] if t not in eos], skip_special_tokens=True)
            r = completion_result(text, (o.finish_reason or "length") if o.finished else None, len(out_ids[o.rid]))
            if r is not None:
                result[o.rid] = r
                if not o.finished:
                    engine.abort(o.rid)
    return [(result[rid], out_ids[rid]) for rid in rids]


def score_completion(header: str, completion: str, stop: str, **_: object) -> dict:
    """`parses`: the completion holds a non-blank line and header + completion parses; `ended`: it stopped at
    the function's end or EOS rather than at the token cap; `complete`: both (the reported score)."""
    try:
        ast.parse(header + completion)
        parses = bool(completion.strip())
    except SyntaxError:
        parses = False
    ended = stop != "length"
    return {"parses": parses, "ended": ended, "complete": parses and ended}


def score_rows(cases: Sequence[FunctionCase], results: Sequence[dict]) -> list[dict]:
    """One row per case: the case's fields, its `completion_result` and its `score_completion`."""
    return [{**asdict(c), **r, **score_completion(c.header, **r)} for c, r in zip(cases, results, strict=True)]


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.split("\n") if line.strip()]


def _docstring_only(completion: str) -> bool:
    """The completion's statements (a function body) are all bare string literals."""
    try:
        stmts = ast.parse("def _():\n" + completion).body[0].body
    except SyntaxError:
        return False
    return all(isinstance(x, ast.Expr) and isinstance(x.value, ast.Constant) and isinstance(x.value.value, str)
               for x in stmts)


def shape_of_complete(rows: Sequence[dict]) -> dict:
    """What the completions that count look like, so that a rate is never read without them: their mean
    number of non-blank lines beside the true bodies' (rows with `reference` and `header`), how many are
    only a docstring, and how many repeat a line 3+ times (a loop that did end)."""
    done = [r for r in rows if r["complete"]]
    n = max(1, len(done))
    body = [_lines(r["completion"]) for r in done]
    only_doc = sum(_docstring_only(r["completion"]) for r in done)
    return {"complete_mean_lines": round(sum(map(len, body)) / n, 2),
            "reference_mean_lines": round(sum(len(_lines(r["reference"])) - len(_lines(r["header"]))
                                              for r in done) / n, 2),
            "complete_docstring_only": only_doc,
            "complete_with_repeated_line": sum(any(b.count(x) >= 3 for x in set(b)) for b in body)}


def summarize(rows: list[dict], split: str, max_tokens: int) -> dict:
    """Rates over scored rows (each with `stop` and `score_completion`'s keys), the shape of the complete
    ones (`shape_of_complete`), and the rows themselves."""
    n = max(1, len(rows))
    n_complete, n_parse = sum(r["complete"] for r in rows), sum(r["parses"] for r in rows)
    return {"split": split, "num_functions": len(rows), "complete_rate": round(n_complete / n, 3),
            "parse_rate": round(n_parse / n, 3), "stops": {s: sum(r["stop"] == s for r in rows)
                                                           for s in sorted({r["stop"] for r in rows})},
            **shape_of_complete(rows), "max_tokens": max_tokens, "cases": rows}
