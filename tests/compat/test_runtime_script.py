"""`k3rt.Runtime(...)` built at module level of a plain script (no `if __name__ == "__main__":`), run as a real
subprocess: the engine process is spawned without re-running the script, so the runtime starts once, the
program runs, and the script exits 0 on its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(200)

SCRIPT = """
import k3rt

print("MODULE-LEVEL CODE RAN", flush=True)
rt = k3rt.Runtime(model={model!r}, cache_pages=256)

@k3rt.function
def prog(s):
    s += "Hello"
    s += k3rt.gen("x", max_tokens=4, temperature=0)

state = prog.run(backend=rt)
print("OUT", repr(state["x"]), len(state["x"]) > 0, flush=True)
"""


def test_runtime_at_module_level_of_a_plain_script(tiny_model: Path, tmp_path: Path):
    script = tmp_path / "plain_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(model=str(tiny_model))))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    # the script's module-level code ran once: the engine process did not re-import it
    assert out.count("MODULE-LEVEL CODE RAN") == 1, out
    assert "OUT " in out and out.strip().endswith("True"), out
    assert "exited unexpectedly" not in proc.stderr
