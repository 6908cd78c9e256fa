"""benchmarks/_timing.timeline_stats: the span, busy time, idle gaps and PDL overlaps of one replay's kernels
(decode.py --graph-timeline reads why a variant's graph is slower from these)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _timing import timeline_stats  # noqa: E402


def test_timeline_gaps_overlaps_and_busy_time():
    # a [0, 10), idle 2, b [12, 20); c starts at 18 (PDL: 2 us over b), ends 25; a again after 5 idle
    ev = [(12.0, 20.0, "b"), (0.0, 10.0, "a"), (18.0, 25.0, "c"), (30.0, 31.0, "a")]
    t = timeline_stats(ev)
    assert t["kernels"] == 4
    assert t["span_us"] == pytest.approx(31.0)
    assert t["busy_us"] == pytest.approx(10 + 13 + 1)
    assert t["gap_us"] == pytest.approx(7.0)
    assert t["kernel_us"] == pytest.approx(10 + 8 + 7 + 1)
    assert t["overlap_us"] == pytest.approx(2.0)
    assert t["idle_before"] == [{"kernel": "a", "us": 5.0, "count": 1}, {"kernel": "b", "us": 2.0, "count": 1}]
    assert t["overlap_before"] == [{"kernel": "c", "us": 2.0, "count": 1}]
    assert t["duration"] == [{"kernel": "a", "us": 11.0, "count": 2}, {"kernel": "b", "us": 8.0, "count": 1},
                             {"kernel": "c", "us": 7.0, "count": 1}]


def test_timeline_nested_kernel_is_not_idle():
    # b runs inside a's interval: no gap, its start 8 us before a's end counts as overlap
    t = timeline_stats([(0.0, 10.0, "a"), (2.0, 4.0, "b"), (11.0, 12.0, "c")])
    assert t["busy_us"] == pytest.approx(11.0)
    assert t["gap_us"] == pytest.approx(1.0)
    assert t["overlap_before"] == [{"kernel": "b", "us": 8.0, "count": 1}]
    assert t["idle_before"] == [{"kernel": "c", "us": 1.0, "count": 1}]


def test_timeline_empty():
    assert timeline_stats([]) == {"kernels": 0}
