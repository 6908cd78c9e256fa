"""What the engine reports about itself: counters and gauges from the scheduler, the prefix cache and
the pool, fixed-bucket histograms of step time and queue wait, and on a GPU the seconds the device waited
for the host between steps (the GPU-idle metric), as one JSON-shaped dict (sent to the gateway in every
UpdateBatch and exported by its /metrics)."""

from __future__ import annotations

import bisect

STEP_TIME_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Histogram:
    """Counts per bucket (counts[i]: observations in (bounds[i-1], bounds[i]]; the last bucket is
    everything above the last bound). Not cumulative: the exporter sums them for Prometheus."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


def engine_stats(engine) -> dict:
    sched, tree, pool = engine.scheduler, engine.scheduler.tree, engine.pool
    s = sched.stats
    gpu = engine.runner.gpu_time()
    # the GPU-idle metric (backend/runner/gpu/idle.py): absent where there is no asynchronous device, never 0
    timing = {} if gpu is None else {"gpu_idle_seconds": gpu[0], "gpu_step_seconds": gpu[1]}
    return timing | {
        "overlap": int(engine.overlap is not None),
        "running": len(sched.running), "waiting": len(sched.waiting),
        "pages_used": pool.num_pages - pool.num_free, "pages_total": pool.num_pages,
        "pages_usable": sched.usable_pages,
        "snapshots": tree.snapshot_count, "snapshot_pages": tree.snapshot_count * tree.state_pages,
        "pins": len(sched.pins), "pinned_pages": tree.pinned_pages,
        "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens, "computed_tokens": s.computed_tokens,
        "computed_prompt_tokens": s.computed_prompt_tokens, "preemptions": s.preemptions,
        "snapshots_published": s.snapshots_published, "pins_dropped": s.pins_dropped,
        "admissions_held": s.admissions_held,
        "spec_verifies": s.spec_verifies, "spec_drafted_tokens": s.spec_drafted_tokens,
        "spec_accepted_tokens": s.spec_accepted_tokens,
        "spec_steps": s.spec_steps, "spec_steps_speculated": s.spec_steps_speculated,
        "spec_steps_skipped": s.spec_steps_skipped, "spec_probes": s.spec_probes,
        "spec_drafter_errors": s.spec_drafter_errors,
        "spec_plan_whys": dict(s.spec_plan_whys),
        "evicted_snapshots": tree.stats.evicted_snapshots, "evicted_pages": tree.stats.evicted_pages,
        "steps": engine.num_steps,
        "step_time": engine.step_time.as_dict(), "queue_wait": engine.queue_wait.as_dict(),
    }
