"""`k3rt bench serve` against the real server: every workload runs and reports sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("workload", ["sharegpt", "system-prompt", "multi-turn"])
def test_bench_serve_reports(server, workload: str) -> None:
    r = subprocess.run([sys.executable, "-m", "k3rt.cli", "bench", "serve", "--url", server.url, "--workload", workload,
                        "--requests", "4", "--concurrency", "2", "--max-tokens", "4", "--turns", "2", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 4 and report["errors"] == 0
    assert report["output_throughput"] > 0 and report["ttft_ms"]["p50"] > 0
    assert report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    assert 0.0 <= report["cache_hit_rate"] <= 1.0
    assert report["overlap"] is False and report["gpu_idle_fraction"] is None  # a CPU server: absent, not 0
    if workload == "system-prompt":
        assert report["cache_hit_rate"] > 0.3  # the shared system prompt is computed once
