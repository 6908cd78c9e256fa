"""`bench_codec` times both issue-15 messages and its table prints them."""

from __future__ import annotations

from k3rt.backend.bench.codec_bench import bench_codec, format_codec_table


def test_bench_codec_rows_and_table() -> None:
    rows = bench_codec(reps=3)
    assert [r["message"] for r in rows] == ["UpdateBatch x1000", "GenerateRequest 128K"]
    assert all(r["encode_ms"] > 0 and r["decode_ms"] > 0 and r["bytes"] > 100_000 for r in rows)
    table = format_codec_table(rows).splitlines()
    assert table[0].split() == ["message", "encode", "ms", "decode", "ms", "bytes"] and len(table) == 4
