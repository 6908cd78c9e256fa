"""`k3rt bench serve` against the real server: every workload runs and reports sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import random

import pytest

from k3rt.server.bench import Result, arrival_times, tpot_s


def test_arrivals_and_tpot() -> None:
    assert arrival_times(3, None, random.Random(0)) == [0.0, 0.0, 0.0]
    t = arrival_times(4000, 50.0, random.Random(0))
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and min(gaps) >= 0.0
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.002  # Poisson: exponential gaps of mean 1/rate
    assert tpot_s(Result(ok=True, ttft_s=0.5, latency_s=2.5, completion_tokens=5)) == 0.5  # 2 s over 4 tokens
    assert tpot_s(Result(ok=True, ttft_s=0.5, latency_s=0.5, completion_tokens=1)) is None


@pytest.mark.parametrize("workload", ["sharegpt", "system-prompt", "multi-turn"])
def test_bench_serve_reports(server, workload: str) -> None:
    rate = ["--request-rate", "20"] if workload == "sharegpt" else []
    r = subprocess.run([sys.executable, "-m", "k3rt.cli", "bench", "serve", "--url", server.url, "--workload", workload,
                        "--requests", "4", "--concurrency", "2", "--max-tokens", "4", "--turns", "2", "--json", *rate],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 4 and report["errors"] == 0
    assert report["output_throughput"] > 0 and report["ttft_ms"]["p50"] > 0
    assert report["ttft_ms"]["p50"] <= report["ttft_ms"]["p99"]
    assert report["request_rate"] == (20.0 if rate else None)
    assert 0 < report["tpot_ms"]["p50"] <= report["tpot_ms"]["p99"]  # sharegpt's shortest output is 4 tokens
    assert 0.0 <= report["cache_hit_rate"] <= 1.0
    assert report["overlap"] is False and report["gpu_idle_fraction"] is None  # a CPU server: absent, not 0
    if workload == "system-prompt":
        assert report["cache_hit_rate"] > 0.3  # the shared system prompt is computed once
