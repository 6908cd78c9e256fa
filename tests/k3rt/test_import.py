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
