"""`import k3rt` must not import torch and must stay fast (a DSL client needs neither); serving code must not
import the default model's training (`k3rt.training`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial  # an import-time bound: run alone (Makefile)


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_import_k3rt_does_not_import_torch() -> None:
    out = _run("import sys, json, k3rt, k3rt.cli, k3rt.model_config, k3rt.inspect_model; "
               "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy'))))")
    assert json.loads(out) == []


def test_import_k3rt_is_fast() -> None:
    # best of 3 to keep a loaded CI machine from flaking; the budget is 0.3 s
    code = "import time; t = time.perf_counter(); import k3rt; print(time.perf_counter() - t)"
    best = min(float(_run(code)) for _ in range(3))
    assert best < 0.3, f"import k3rt took {best:.3f}s"


def test_dsl_client_does_not_import_torch() -> None:
    # a DSL client: the whole frontend, Runtime's module, a program defined and its ops recorded
    code = (
        "import sys, json, k3rt, k3rt.runtime\n"
        "from k3rt.frontend import api, client, ir, runner, state\n"
        "@k3rt.function\n"
        "def qa(s, q):\n"
        "    s += k3rt.system('x') + k3rt.user(q)\n"
        "    s += k3rt.assistant(k3rt.gen('a', max_tokens=4, regex='[0-9]+') + k3rt.select('b', ['y', 'n']))\n"
        "ops = k3rt.assistant(k3rt.gen('a', json_schema={'type': 'string'})).ops()\n"
        "assert ir.Program(ops).to_dict()['ops'][1]['kind'] == 'gen'\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy'))))"
    )
    assert json.loads(_run(code)) == []


def test_import_k3rt_does_not_load_the_transport() -> None:
    # zmq and the Runtime load on first use (k3rt.connect / k3rt.Runtime), keeping `import k3rt` fast
    out = _run("import sys, json, k3rt; print(json.dumps([m for m in ('zmq', 'k3rt.runtime') if m in sys.modules]))")
    assert json.loads(out) == []


# ---- serving code never imports the default model's training (k3rt.training, training/) ----------

SERVING_MODULES = ("k3rt.cli", "k3rt.runtime", "k3rt.server.app", "k3rt.server.chat", "k3rt.server.completions",
                   "k3rt.server.launch", "k3rt.backend.engine", "k3rt.backend.engine_process",
                   "k3rt.backend.gateway", "k3rt.backend.program.server", "k3rt.backend.models.loader",
                   "k3rt.backend.tokenizer")


def test_serving_modules_do_not_import_training() -> None:
    out = _run(f"import sys, json, importlib\nfor m in {SERVING_MODULES!r}: importlib.import_module(m)\n"
               "print(json.dumps(sorted(m for m in sys.modules if m.startswith('k3rt.training'))))")
    assert json.loads(out) == []


def test_serving_sources_never_name_training() -> None:
    # the lazy imports inside functions too, which importing the modules would not run
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for top in ("k3rt", "frontend", "backend", "kernels"):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "k3rt.training" or n.startswith("k3rt.training.") for n in names):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []
