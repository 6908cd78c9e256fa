"""Prometheus metrics of `k3rt serve`, exposed at GET /metrics.

The server counts what it sees (requests by endpoint and status, prompt / generated / cached tokens,
time to first token, inter-token latency, request latency); the engine's own numbers (running, waiting,
pages, snapshots, cumulative prompt and cached tokens, hence the cache hit rate) are read at scrape time
from the latest UpdateBatch stats the engine sent. One registry per server, no global state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "k3rt_num_requests_running": ("requests the engine is running", s.get("running")),
            "k3rt_num_requests_waiting": ("requests queued in the engine", s.get("waiting")),
            "k3rt_gateway_requests_in_flight": ("engine requests the gateway has started and not seen end",
                                                s.get("in_flight")),
            "k3rt_cache_pages_used": ("cache pages in use (running requests and the prefix cache)",
                                      s.get("pages_used")),
            "k3rt_cache_pages_total": ("cache pages in the pool", s.get("pages_total")),
            "k3rt_cache_snapshots": ("KDA state snapshots held by the prefix cache", s.get("snapshots")),
        }
        for name, (doc, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        prompt, cached = s.get("prompt_tokens"), s.get("cached_tokens")
        if prompt is not None and cached is not None:
            yield CounterMetricFamily("k3rt_engine_prompt_tokens", "prompt tokens admitted by the engine",
                                      value=prompt)
            yield CounterMetricFamily("k3rt_engine_cached_tokens", "prompt tokens served from the prefix cache",
                                      value=cached)
            yield GaugeMetricFamily("k3rt_cache_hit_rate", "cached / admitted prompt tokens since start",
                                    value=cached / prompt if prompt else 0.0)


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
