"""`bench_codec` times both issue-15 messages and its table prints them."""

from __future__ import annotations

from k3rt.backend.bench.codec_bench import bench_codec, format_codec_table


def test_bench_codec_rows_and_table() -> None:
    rows = bench_codec(reps=3)
    assert [r["message"] for r in rows] == ["UpdateBatch x1000", "GenerateRequest 128K", "list(range(131072)) (floor)"]
    assert all(r["encode_ms"] > 0 and r["decode_ms"] > 0 and 0 < r["decode_trusted_ms"] and r["bytes"] > 100_000
               for r in rows[:2])
    table = format_codec_table(rows).splitlines()
    assert table[0].split()[:3] == ["message", "encode", "ms"] and "(engine<->gateway)" in table[0]
    assert len(table) == 5
