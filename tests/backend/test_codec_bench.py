"""`bench_codec` times both issue-15 messages and its table prints them."""

from __future__ import annotations

from k3rt.backend.bench.codec_bench import bench_codec, format_codec_table


def test_bench_codec_rows_and_table() -> None:
    rows = bench_codec(reps=3)
    assert [r["message"] for r in rows] == ["UpdateBatch x1000", "UpdateBatch x1000 (whole updates)",
                                            "GenerateRequest 128K", "list(range(131072)) (floor)"]
    assert all(r["encode_ms"] > 0 and r["decode_ms"] > 0 and 0 < r["decode_trusted_ms"] and r["bytes"] > 10_000
               for r in rows[:3])
    assert rows[0]["bytes"] < rows[1]["bytes"] / 5  # the columns carry the same step in far fewer bytes
    table = format_codec_table(rows).splitlines()
    assert table[0].split()[:3] == ["message", "encode", "ms"] and "(engine<->gateway)" in table[0]
    assert len(table) == 6
