"""benchmarks/dsl.py still runs (a small configuration) and its numbers say what the DSL claims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dsl.py"


def test_dsl_benchmark_smoke(tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "dsl.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model), "--repeats", "1", "--batch", "6",
                           "--system-tokens", "200", "--skip-cache-off", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["eight_calls"]["shipped"]["round_trips"] == 1
    assert r["eight_calls"]["client-side"]["round_trips"] == 9
    shared, distinct = r["batch_shared"], r["batch_distinct"]
    assert shared["programs"] == distinct["programs"] == 6
    assert distinct["computed_prompt_tokens"] == distinct["prompt_tokens"]  # nothing to share
    assert shared["computed_prompt_tokens"] < distinct["computed_prompt_tokens"] / 2
    assert "round trips" in proc.stdout and "shared prompt" in proc.stdout
