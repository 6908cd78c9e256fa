"""benchmarks/host_cost.py runs (50 decodes, 3 repetitions) and reports every figure of its table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_host_cost_benchmark_smoke() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "host_cost.py"), "--running", "50", "--reps", "3",
                          "--json"], check=True, capture_output=True, text=True, timeout=120)
    (row,) = json.loads(out.stdout)
    assert row["running"] == 50 and row["wire_bytes"] > 0
    for key in ("schedule_ms", "seqs_ms", "pack_eager_ms", "pack_graph_ms", "updates_ms", "encode_ms", "decode_ms",
                "route_ms"):
        assert 0 < row[key] < 1000, key
    assert abs(row["codec_total_ms"] - sum(row[k] for k in ("updates_ms", "encode_ms", "decode_ms", "route_ms"))) < 1e-9
