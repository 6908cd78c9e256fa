"""`k3rt bench scheduler`: host time of one engine step (schedule + null run + update) with R requests
all decoding, the figure that bounds how small a GPU step can be before the host is the bottleneck."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from k3rt.backend.engine import Engine
from k3rt.config import EngineConfig, SchedulerConfig
from k3rt.sampling_params import SamplingParams


def bench_steps(cfg: EngineConfig, running: int, *, prompt_len: int = 64, steps: int = 200,
                warmup: int = 20, prefill_tree: int = 0) -> dict[str, float]:
    """prefill_tree: grow the prefix cache to about this many nodes first (unrelated cached prefixes)."""
    sched = replace(cfg.scheduler, max_running=max(running, cfg.scheduler.max_running),
                    max_num_batched_tokens=max(cfg.scheduler.max_num_batched_tokens, running * prompt_len))
    eng = Engine(replace(cfg, runner="null", scheduler=sched))
    if prefill_tree:
        from k3rt.backend.bench.scale import fill_tree

        fill_tree(eng.scheduler.tree, prefill_tree)
    sp = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 8, ignore_eos=True)
    for i in range(running):
        eng.add_request([3 + (i * 7 + j) % 1000 for j in range(prompt_len)], sp)
    for _ in range(warmup):
        eng.step()
    assert len(eng.scheduler.running) == running, "not every request is running: raise cache size"
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return {"running": running, "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))], "mean_ms": 1e3 * statistics.fmean(times)}


def default_config(model: str) -> EngineConfig:
    from k3rt.config import CacheConfig

    return EngineConfig(model=model, runner="null", cache=CacheConfig(num_pages=8192),
                        scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_running=1024))
