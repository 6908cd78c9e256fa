"""/metrics exports the engine's counters, gauges and histograms (issue 15) with plausible values."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, ServeProcess

COUNTERS = ("k3rt_engine_preemptions", "k3rt_cache_evicted_snapshots", "k3rt_cache_evicted_pages",
            "k3rt_cache_snapshots_published", "k3rt_cache_pins_dropped")
GAUGES = ("k3rt_cache_pinned_snapshots", "k3rt_cache_pinned_pages", "k3rt_cache_snapshot_pages",
          "k3rt_cache_pages_usable")


def _scrape(server: ServeProcess) -> dict:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _value(families: dict, name: str, sample: str | None = None) -> float:
    return next(s.value for s in families[name].samples if s.name == (sample or name))


@pytest.mark.timeout(180)
def test_engine_counters_gauges_and_histograms(server: ServeProcess) -> None:
    for i in range(3):
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": f"metrics {i}: the quick brown fox", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
    stats = server.stats()["stats"]
    m = _scrape(server)
    for name in COUNTERS:
        assert m[name].type == "counter", name
        assert _value(m, name, name + "_total") >= 0
    for name in GAUGES:
        assert m[name].type == "gauge", name
    assert _value(m, "k3rt_cache_pages_usable") == stats["pages_usable"] > 0
    # a CPU engine: steps do not overlap, and the GPU-idle metric is absent rather than 0
    assert _value(m, "k3rt_engine_overlap") == 0
    assert not {"k3rt_gpu_idle_seconds", "k3rt_gpu_step_seconds", "k3rt_gpu_idle_fraction"} & set(m)
    assert 0 <= _value(m, "k3rt_cache_pinned_pages") <= _value(m, "k3rt_cache_pages_usable")
    assert _value(m, "k3rt_cache_snapshot_pages") >= 0
    assert _value(m, "k3rt_cache_snapshots_published", "k3rt_cache_snapshots_published_total") >= 1

    for name, at_least in (("k3rt_engine_step_time_seconds", 4), ("k3rt_engine_queue_wait_seconds", 3)):
        h = m[name]
        assert h.type == "histogram", name
        buckets = [(s.labels["le"], s.value) for s in h.samples if s.name == name + "_bucket"]
        counts = [v for _, v in buckets]
        assert buckets[-1][0] == "+Inf" and len(buckets) >= 2
        assert counts == sorted(counts), f"{name}: buckets are not cumulative: {buckets}"
        count, total = _value(m, name, name + "_count"), _value(m, name, name + "_sum")
        assert counts[-1] == count >= at_least, (name, count)
        assert 0 < total < 60 * count, (name, total, count)
    # one step-time observation per engine step (the scrape came after the stats: no fewer)
    assert _value(m, "k3rt_engine_step_time_seconds", "k3rt_engine_step_time_seconds_count") >= stats["steps"] > 0


def test_gpu_idle_metrics_are_exported_from_engine_stats() -> None:
    from k3rt.server.bench import gpu_idle_fraction, parse_engine_timing
    from k3rt.server.metrics import ServerMetrics

    stats = {"overlap": 1, "gpu_idle_seconds": 0.5, "gpu_step_seconds": 20.0}
    text = ServerMetrics(lambda: stats).render().decode()
    m = {f.name: f for f in text_string_to_metric_families(text)}
    assert _value(m, "k3rt_gpu_idle_seconds", "k3rt_gpu_idle_seconds_total") == 0.5
    assert _value(m, "k3rt_gpu_step_seconds", "k3rt_gpu_step_seconds_total") == 20.0
    assert _value(m, "k3rt_gpu_idle_fraction") == 0.025 and _value(m, "k3rt_engine_overlap") == 1
    # what `k3rt bench serve` reads: the fraction over its run, from two scrapes
    before = parse_engine_timing(text)
    stats.update(gpu_idle_seconds=1.5, gpu_step_seconds=30.0)
    after = parse_engine_timing(ServerMetrics(lambda: stats).render().decode())
    assert before == {"overlap": 1.0, "idle": 0.5, "span": 20.0} and gpu_idle_fraction(before, after) == 0.1
    assert gpu_idle_fraction({}, {"overlap": 0.0}) is None


def test_speculation_plans_are_exported_by_reason() -> None:
    from k3rt.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: {"spec_plan_whys": {"pays": 5, "off": 40}}).render().decode()
    fam = {f.name: f for f in text_string_to_metric_families(text)}["k3rt_spec_plans"]
    assert {(x.labels["why"], x.value) for x in fam.samples if x.name == "k3rt_spec_plans_total"} == {
        ("pays", 5.0), ("off", 40.0)}
    assert "k3rt_spec_plans" not in ServerMetrics(lambda: {"spec_plan_whys": {}}).render().decode()


def test_drafter_errors_are_a_counter() -> None:
    from k3rt.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: {"spec_drafter_errors": 3}).render().decode()
    fam = {f.name: f for f in text_string_to_metric_families(text)}["k3rt_spec_drafter_errors"]
    assert [x.value for x in fam.samples if x.name == "k3rt_spec_drafter_errors_total"] == [3.0]
