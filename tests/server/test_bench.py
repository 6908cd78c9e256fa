"""`k3rt bench serve` against the real server: every workload runs and reports sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import random

import pytest

from k3rt.server.bench import Result, arrival_times, steady_throughput, tpot_s


def test_arrivals_and_tpot() -> None:
    assert arrival_times(3, None, random.Random(0)) == [0.0, 0.0, 0.0]
    t = arrival_times(4000, 50.0, random.Random(0))
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and min(gaps) >= 0.0
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.002  # Poisson: exponential gaps of mean 1/rate
    assert tpot_s(Result(ok=True, ttft_s=0.5, latency_s=2.5, completion_tokens=5)) == 0.5  # 2 s over 4 tokens
    assert tpot_s(Result(ok=True, ttft_s=0.5, latency_s=0.5, completion_tokens=1)) is None


def test_steady_throughput_counts_the_window_between_first_finish_and_last_send() -> None:
    # two requests sent at 0 (10 tokens, one chunk a second from 1 s; the first ends at 10 s), a third sent at
    # 10 s when the first finished (its chunks at 11..14 s), a fourth sent at 12 s: window [10, 12] s
    a = Result(ok=True, sent_s=0.0, latency_s=10.0, completion_tokens=10, token_times_s=[float(t) for t in range(1, 11)])
    b = Result(ok=True, sent_s=0.0, latency_s=20.0, completion_tokens=20, token_times_s=[float(t) for t in range(1, 21)])
    c = Result(ok=True, sent_s=10.0, latency_s=4.0, completion_tokens=8, token_times_s=[11.0, 12.0, 13.0, 14.0])
    d = Result(ok=True, sent_s=12.0, latency_s=3.0, completion_tokens=2, token_times_s=[13.0, 15.0])
    rate, window = steady_throughput([a, b, c, d])
    assert window == 2.0
    # in [10, 12]: a's chunk at 10 (1 of its 10 -> 1 token), b's 10, 11, 12 (3 of 20 -> 3 tokens), c's 11, 12 (2 of 4
    # chunks of 8 tokens -> 4 tokens), none of d's
    assert rate == (1 + 3 + 4) / 2.0
    # every request sent before the first finish (all at once, requests <= concurrency): no steady window
    assert steady_throughput([a, b]) is None
    assert steady_throughput([Result(ok=False, sent_s=0.0)]) is None


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
    assert "steady_output_throughput" in report and report["steady_window_s"] >= 0.0  # its value: the unit test
    if workload == "system-prompt":
        assert report["cache_hit_rate"] > 0.3  # the shared system prompt is computed once
