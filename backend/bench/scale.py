"""Host cost of the prefix cache and the scheduler at scale (`k3rt bench scheduler --scale`): the
figures issue 15 sets goals for, each measured on the real RadixCache / Scheduler over an
accounting-only pool (no tensors), median of repeated runs.

  evict_ms        one eviction (pop the lowest-priority snapshot, free it and the KV only it kept)
                  from a tree of `nodes` nodes
  match_ms        match() of a 128K-token prompt against a cached 128K path (snapshots every 64 tokens)
  publish_ms      every snapshot publish of a 128K prompt's prefill (one per 64 tokens), from the
                  request's node
  schedule_waiting_ms  schedule() with 1,000 waiting requests that share a prefix a running request
                  is still computing
  step_ms         schedule() + null run + update() with 1,000 running decodes and 100k cached nodes
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import replace

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.cache.policy import CachePolicy
from k3rt.backend.cache.radix import RadixCache
from k3rt.cache_layout import CacheLayout

B = 64  # tokens per page of the synthetic layout


def _tree(num_pages: int, eviction: str = "value", state_pages: int = 3) -> RadixCache:
    layout = CacheLayout(block_size=B, page_size_bytes=B * 32, kda_conv_bytes=32, kda_state_bytes=160,
                         mla_bytes_per_token=32, group_size=1, mla_group=(99,),
                         kda_groups=tuple((i,) for i in range(state_pages)),
                         kv_dtype="float32", conv_dtype="float32", state_dtype="float32")
    return RadixCache(PagePool(layout, num_pages, materialize=False), B, CachePolicy(eviction=eviction))


def _publish(tree: RadixCache, tokens: list[int], start=None):
    pool = tree.pool
    pages = pool.allocate(-(-len(tokens) // B))
    node = tree.insert(tokens, pages, snapshot=pool.allocate(tree.state_pages), start=start)
    pool.unref(pages)
    return node


def fill_tree(tree: RadixCache, nodes: int, *, seed: int = 0) -> RadixCache:
    """Grow tree to about `nodes` nodes: conversations (shared system prompts, turns) each ending in a
    snapshot, token ids above 50,000 so they share nothing with a benchmark's requests."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000, 100_000) for _ in range(rng.randrange(64, 2048))] for _ in range(64)]
    count = tree.num_nodes()
    while count < nodes:
        path = list(rng.choice(systems))
        for _ in range(rng.randrange(1, 6)):
            path += [rng.randrange(50_000, 100_000) for _ in range(rng.randrange(20, 300))]
            _publish(tree, path)
        count = tree.num_nodes()
    return tree


def filled_tree(nodes: int, *, seed: int = 0, eviction: str = "value") -> RadixCache:
    return fill_tree(_tree(nodes * 8 + 1024, eviction), nodes, seed=seed)


def bench_evict(nodes: int = 100_000, evictions: int = 2000) -> float:
    tree = filled_tree(nodes)
    times = []
    for _ in range(evictions):
        t = time.perf_counter()
        tree.evict(1)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def bench_match(tokens: int = 131_072, reps: int = 20) -> float:
    rng = random.Random(1)
    seq = [rng.randrange(1, 50_000) for _ in range(tokens)]
    tree = _tree(tokens // B * 8 + 64)
    node = None
    for p in range(64, tokens + 1, 64):
        node = _publish(tree, seq[:p], start=node)
    query = seq + [7]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        m = tree.match(query)
        times.append(time.perf_counter() - t)
    assert m.state_hit == tokens
    return 1e3 * statistics.median(times)


def bench_publish(tokens: int = 131_072, reps: int = 5) -> float:
    rng = random.Random(2)
    times = []
    for _ in range(reps):
        seq = [rng.randrange(1, 50_000) for _ in range(tokens)]
        tree = _tree(tokens // B * 8 + 64)
        pages = tree.pool.allocate(tokens // B)
        snaps = [tree.pool.allocate(tree.state_pages) for _ in range(tokens // 64)]
        node = None
        t = time.perf_counter()
        for i, p in enumerate(range(64, tokens + 1, 64)):
            node = tree.insert(seq, pages, snapshot=snaps[i], start=node, length=p)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def bench_schedule_waiting(model: str, waiting: int = 1000, reps: int = 5) -> float:
    """The step in which 1,000 requests sharing a 4K-token system prompt wait for the first of them
    to compute it (each is checked against the running sharer; none is admitted)."""
    from k3rt.backend.engine import Engine
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig
    from k3rt.sampling_params import SamplingParams

    times = []
    for rep in range(reps):
        cfg = EngineConfig(model=model, runner="null", cache=CacheConfig(num_pages=20_000),
                           scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_running=1024,
                                                     max_waiting=4096))
        eng = Engine(cfg)
        rng = random.Random(rep)
        system = [rng.randrange(3, 1000) for _ in range(4096)]
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for _ in range(waiting + 1):
            eng.add_request(system + [rng.randrange(3, 1000) for _ in range(20)], sp)
        t = time.perf_counter()
        out = eng.scheduler.schedule()
        times.append(time.perf_counter() - t)
        assert len(eng.scheduler.running) == 1 and len(eng.scheduler.waiting) == waiting, "not the waiting case"
        eng.scheduler.update(out, eng.runner.execute(out))
    return 1e3 * statistics.median(times)


def bench_step_with_cache(model: str, running: int = 1000, nodes: int = 100_000, steps: int = 100) -> float:
    from k3rt.backend.bench.scheduler_bench import bench_steps, default_config

    cfg = default_config(model)
    cfg = replace(cfg, cache=replace(cfg.cache, num_pages=nodes * 8 + running * 8))
    return bench_steps(cfg, running, steps=steps, prefill_tree=nodes)["median_ms"]


GOALS_MS = {"evict_ms": 1.0, "match_ms": 2.0, "publish_ms": 20.0, "schedule_waiting_ms": 5.0, "step_ms": 2.0}


def bench_scale(model: str) -> dict[str, float]:
    """Each figure from a collected heap with the cyclic GC off while it is timed, as timeit does (a
    collection of the previous figure's garbage would otherwise land in the next one's timings)."""
    figures = {"evict_ms": bench_evict, "match_ms": bench_match, "publish_ms": bench_publish,
               "schedule_waiting_ms": lambda: bench_schedule_waiting(model),
               "step_ms": lambda: bench_step_with_cache(model)}
    out = {}
    for name, fn in figures.items():
        gc.collect()
        gc.disable()
        try:
            out[name] = fn()
        finally:
            gc.enable()
    return out


def format_scale(row: dict[str, float]) -> str:
    lines = [f"{'figure':<22} {'measured ms':>12} {'goal ms':>8}"]
    for k, v in row.items():
        lines.append(f"{k:<22} {v:>12.3f} {GOALS_MS.get(k, float('nan')):>8.1f}")
    return "\n".join(lines)
