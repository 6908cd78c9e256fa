"""Prometheus metrics of `k3rt serve`, exposed at GET /metrics.

The server counts what it sees (requests by endpoint and status, prompt / generated / cached tokens,
time to first token, inter-token latency, request latency); the engine's own numbers are read at scrape
time from the latest UpdateBatch stats the engine sent (backend/engine_stats.py): gauges (running, waiting,
pages used / total / usable, snapshots and their pages, pins and pinned pages), counters (prompt and cached
tokens, hence the cache hit rate; preemptions, snapshots published, pins dropped, evicted snapshots and
pages; on a GPU the seconds it waited for the host between steps and the gauge k3rt_gpu_idle_fraction,
absent on the CPU) and two histograms (k3rt_engine_step_time_seconds, k3rt_engine_queue_wait_seconds: the engine counts
per bucket, exported cumulative). One registry per server, no global state.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


# engine stats key -> (Prometheus name, help); counters get "_total" appended by prometheus_client
_ENGINE_GAUGES = {
    "running": ("k3rt_num_requests_running", "requests the engine is running"),
    "waiting": ("k3rt_num_requests_waiting", "requests queued in the engine"),
    "in_flight": ("k3rt_gateway_requests_in_flight", "engine requests the gateway has started and not seen end"),
    "pages_used": ("k3rt_cache_pages_used", "cache pages in use (running requests and the prefix cache)"),
    "pages_total": ("k3rt_cache_pages_total", "cache pages in the pool"),
    "pages_usable": ("k3rt_cache_pages_usable", "cache pages the scheduler can hand out (total less the runner's "
                     "reserved pages)"),
    "snapshots": ("k3rt_cache_snapshots", "KDA state snapshots held by the prefix cache"),
    "snapshot_pages": ("k3rt_cache_snapshot_pages", "cache pages held by KDA state snapshots"),
    "pins": ("k3rt_cache_pinned_snapshots", "snapshots pinned for DSL programs between their calls"),
    "pinned_pages": ("k3rt_cache_pinned_pages", "cache pages held by pinned snapshots"),
    "overlap": ("k3rt_engine_overlap", "1 when the engine overlaps scheduling with the device's work, else 0"),
}
_ENGINE_COUNTERS = {
    "preemptions": ("k3rt_engine_preemptions", "running requests preempted to free cache pages"),
    "snapshots_published": ("k3rt_cache_snapshots_published", "KDA state snapshots added to the prefix cache"),
    "pins_dropped": ("k3rt_cache_pins_dropped", "pins released by the cache (pin cap, flush) before their unpin"),
    "admissions_held": ("k3rt_engine_admissions_held", "steps that held waiting requests back to admit several in one "
                        "mixed step (--prefill-delay-steps)"),
    "evicted_snapshots": ("k3rt_cache_evicted_snapshots", "snapshots evicted from the prefix cache"),
    "evicted_pages": ("k3rt_cache_evicted_pages", "cache pages freed by prefix-cache eviction"),
    "spec_verifies": ("k3rt_spec_verifies", "speculative verify runs (one request's drafts checked in one forward)"),
    "spec_drafted_tokens": ("k3rt_spec_drafted_tokens", "draft tokens fed to speculative verification"),
    "spec_accepted_tokens": ("k3rt_spec_accepted_tokens", "draft tokens accepted by speculative verification"),
    "spec_steps": ("k3rt_spec_steps", "steps in which some request could speculate (the controller decided)"),
    "spec_steps_speculated": ("k3rt_spec_steps_speculated", "of k3rt_spec_steps, steps that verified drafts"),
    "spec_steps_skipped": ("k3rt_spec_steps_skipped", "of k3rt_spec_steps, steps the speculation controller decoded "
                           "plainly because a verify was not expected to pay (--spec-adaptive)"),
    "spec_probes": ("k3rt_spec_probes", "steps the speculation controller drafted while speculation did not pay, to "
                    "refresh its acceptance and cost estimates"),
    "spec_drafter_errors": ("k3rt_spec_drafter_errors", "drafter calls that raised (those steps decoded without "
                            "drafts; the server log has each traceback)"),
    "gpu_idle_seconds": ("k3rt_gpu_idle_seconds", "time the GPU waited for the host between engine steps (absent "
                         "without a GPU)"),
    "gpu_step_seconds": ("k3rt_gpu_step_seconds", "GPU time from one engine step's end to the next's, over the "
                         "steps timed for k3rt_gpu_idle_seconds"),
}
_ENGINE_HISTOGRAMS = {
    "step_time": ("k3rt_engine_step_time_seconds", "duration of one engine step (schedule, run, update)"),
    "queue_wait": ("k3rt_engine_queue_wait_seconds", "request arrival in the engine to its first scheduling"),
}


def _histogram(name: str, doc: str, h: dict[str, Any]) -> HistogramMetricFamily | None:
    """The engine's per-bucket counts (one per bound, plus +Inf) as Prometheus' cumulative buckets."""
    bounds, counts = h.get("bounds"), h.get("counts")
    if not bounds or not counts or len(counts) != len(bounds) + 1:
        return None
    cumulative = list(itertools.accumulate(counts))
    buckets = [(floatToGoString(b), c) for b, c in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(h.get("sum", 0.0)))


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for key, (name, doc) in _ENGINE_GAUGES.items():
            if s.get(key) is not None:
                yield GaugeMetricFamily(name, doc, value=s[key])
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if s.get(key) is not None:
                yield CounterMetricFamily(name, doc, value=s[key])
        for key, (name, doc) in _ENGINE_HISTOGRAMS.items():
            h = s.get(key)
            family = _histogram(name, doc, h) if isinstance(h, dict) else None
            if family is not None:
                yield family
        prompt, cached = s.get("prompt_tokens"), s.get("cached_tokens")
        if prompt is not None and cached is not None:
            yield CounterMetricFamily("k3rt_engine_prompt_tokens", "prompt tokens admitted by the engine",
                                      value=prompt)
            yield CounterMetricFamily("k3rt_engine_cached_tokens", "prompt tokens served from the prefix cache",
                                      value=cached)
            yield GaugeMetricFamily("k3rt_cache_hit_rate", "cached / admitted prompt tokens since start",
                                    value=cached / prompt if prompt else 0.0)
        idle, span = s.get("gpu_idle_seconds"), s.get("gpu_step_seconds")
        if idle is not None and span:
            yield GaugeMetricFamily("k3rt_gpu_idle_fraction", "of the GPU's step time since start, the share it "
                                    "waited for the host (schedule, pack, launch)", value=idle / span)
        verifies, accepted = s.get("spec_verifies"), s.get("spec_accepted_tokens")
        if verifies is not None and accepted is not None:
            yield GaugeMetricFamily("k3rt_spec_tau", "tokens per speculative verify since start (accepted drafts + 1; "
                                    "0 before the first)", value=(accepted + verifies) / verifies if verifies else 0.0)
        whys = s.get("spec_plan_whys")
        if whys:
            plans = CounterMetricFamily("k3rt_spec_plans", "the speculation controller's plans by reason: pays, "
                                        "not_worth, explore, probe, refresh, cheap, off (the governor measured plain "
                                        "decoding faster at that batch size)", labels=["why"])
            for why, n in sorted(whys.items()):
                plans.add_metric([why], n)
            yield plans
        steps, speculated = s.get("spec_steps"), s.get("spec_steps_speculated")
        if steps is not None and speculated is not None:
            yield GaugeMetricFamily("k3rt_spec_speculated_fraction", "of the steps in which some request could "
                                    "speculate, the share that verified drafts since start (0 before the first)",
                                    value=speculated / steps if steps else 0.0)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("k3rt_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"],
                                registry=r)
        self.disconnects = Counter("k3rt_client_disconnects", "requests whose client went away before the end",
                                   ["endpoint"], registry=r)
        self.prompt_tokens = Counter("k3rt_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("k3rt_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("k3rt_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.ttft = Histogram("k3rt_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY_BUCKETS + (30.0, 60.0), registry=r)
        self.itl = Histogram("k3rt_inter_token_latency_seconds", "time between a choice's tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("k3rt_request_latency_seconds", "request arrival to its last token",
                                 buckets=_REQUEST_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Token timing of one HTTP request (all its choices): TTFT once, inter-token latency per token."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.start = time.monotonic()
        self._last: dict[int, float] = {}  # choice index -> time of its latest token
        self._first = True

    def tokens(self, index: int, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._first:
            self.m.ttft.observe(now - self.start)
            self._first = False
        last = self._last.get(index)
        if last is not None:
            gap = (now - last) / num_tokens
            for _ in range(num_tokens):
                self.m.itl.observe(gap)
        self._last[index] = now
        self.m.generation_tokens.inc(num_tokens)

    def done(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.m.latency.observe(time.monotonic() - self.start)
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.cached_tokens.inc(cached_tokens)
