"""`k3rt bench cache` and `k3rt bench scheduler` (null runner, config only): the acceptance figures of
the engine core, measured the way the CLI measures them."""

from __future__ import annotations

import json
import subprocess
import sys

from k3rt.backend.bench import workloads
from k3rt.backend.bench.cache_replay import IdealCache, replay
from k3rt.backend.bench.scheduler_bench import bench_steps, default_config
from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig

VOCAB = 163840  # kimi-linear-48b preset


def _cfg(full_block: bool) -> EngineConfig:
    return EngineConfig(model="kimi-linear-48b", runner="null",
                        cache=CacheConfig(memory_gb=40, num_pages=None, block_size=1920, full_block_mode=full_block),
                        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_running=64))


def test_system_prompt_workload_within_5_percent_of_ideal_at_block_1920() -> None:
    sessions = list(workloads.system_prompt(VOCAB, sessions=12, turns=3, seed=1))
    k3 = replay(_cfg(False), sessions, concurrency=8)
    base = replay(_cfg(True), sessions, concurrency=8)
    assert k3.ideal_tokens == base.ideal_tokens > 0
    assert k3.computed_prompt_tokens <= 1.05 * k3.ideal_tokens, (k3.computed_prompt_tokens, k3.ideal_tokens)
    assert base.computed_prompt_tokens > 1.5 * k3.computed_prompt_tokens  # the full-block baseline misses


def test_ideal_cache_counts_the_longest_seen_prefix() -> None:
    ideal = IdealCache()
    ideal.add([1, 2, 3, 4])
    ideal.add([1, 2, 9])
    assert ideal.lcp([1, 2, 3, 7]) == 3 and ideal.lcp([1, 2, 9, 9]) == 3 and ideal.lcp([5]) == 0


def test_mooncake_trace_expands_hash_ids_deterministically(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 512, "output_length": 2, "hash_ids": [1]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    sessions = list(workloads.mooncake(trace, VOCAB))
    first, second = (s[0].build([]) for s in sessions)  # sorted by timestamp
    assert len(first) == 512 and len(second) == 700 and second[:512] == first
    assert first == workloads.expand_hash_id(1, VOCAB)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}')
    try:
        list(workloads.mooncake(bad, VOCAB))
    except ValueError as e:
        assert "input_length" in str(e)
    else:
        raise AssertionError("an input_length beyond its hash ids must be rejected")


def test_scheduler_step_host_time_at_256_running() -> None:
    # the budget is 1 ms per step at 256 running on a 2-core machine; CI machines are shared,
    # so assert a looser bound here and print the figure (`k3rt bench scheduler` reports it)
    r = bench_steps(default_config("kimi-linear-48b"), 256, steps=60, warmup=10)
    print(f"host time per step at 256 running: median {r['median_ms']:.3f} ms")
    assert r["median_ms"] < 5.0


def test_bench_cache_cli_json() -> None:
    out = subprocess.run([sys.executable, "-m", "k3rt.cli", "bench", "cache", "--workload", "multi-turn",
                          "--users", "3", "--turns", "2", "--block-size", "1920", "--json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    assert [r["mode"] for r in rows] == ["k3rt", "full-block"]
    assert all(r["computed_prompt_tokens"] >= r["ideal_tokens"] > 0 for r in rows)


def test_bench_cache_cli_sweep_and_plot(tmp_path) -> None:
    png = tmp_path / "sweep.png"
    out = subprocess.run([sys.executable, "-m", "k3rt.cli", "bench", "cache", "--workload", "agents",
                          "--sessions", "6", "--turns", "3", "--cache-gb", "2,8", "--plot", str(png)],
                         capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("workload agents (") and "computed/ideal" in lines[1] and "snapshot share" in lines[1]
    rows = [ln.split() for ln in lines[3:7]]
    assert [(r[0], r[1]) for r in rows] == [("2", "k3rt"), ("2", "full-block"), ("8", "k3rt"), ("8", "full-block")]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    bad = subprocess.run([sys.executable, "-m", "k3rt.cli", "bench", "cache", "--cache-gb", "10,x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--cache-gb" in bad.stderr
