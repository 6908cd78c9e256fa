"""`import k3rt` must not import torch and must stay fast (a DSL client needs neither)."""

from __future__ import annotations

import json
import subprocess
import sys


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
