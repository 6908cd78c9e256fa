"""Host time of the wire codec (`k3rt.protocol.encode` / `decode`) on the two messages that carry the most:
an UpdateBatch of 1,000 one-token updates (the engine's step loop sends one per step, the gateway's asyncio loop
reads it; timed in its columns, as the engine sends it, and as 1,000 whole RequestUpdates) and a GenerateRequest
with a 128K-token prompt. Target (issue 15): <= 1 ms each.
Decoding is timed as the engine and gateway decode each other (trusted: framing checked, fields not) and
as the DSL port decodes a client's message (every field's type checked). The floor under decoding 128K
token ids is making 131,072 Python ints: `list(range(131072))` is timed beside it."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

from k3rt.protocol import GenerateRequest, RequestUpdate, UpdateBatch, decode, encode, params_to_dict
from k3rt.sampling_params import SamplingParams


_STATS = {"running": 1000, "waiting": 3, "pages_used": 6000, "pages_total": 8192, "snapshots": 40, "pins": 2,
          "prompt_tokens": 512_000, "cached_tokens": 256_000, "computed_tokens": 1_250_000,
          "computed_prompt_tokens": 256_000}


def update_batch(num_updates: int = 1000) -> UpdateBatch:
    """One decode step of `num_updates` running requests as the engine sends it: one new token each, in the
    batch's columns, plus the engine's stats."""
    n = num_updates
    return UpdateBatch([], _STATS, [f"req-{i:08x}" for i in range(n)], [[1000 + i % 50000] for i in range(n)],
                       [512] * n, [256] * n, [0] * n)


def update_batch_whole(num_updates: int = 1000) -> UpdateBatch:
    """The same step as `num_updates` whole RequestUpdates (how every update travelled before the columns; still
    the form of finished ones and those with logprobs)."""
    updates = [RequestUpdate(f"req-{i:08x}", [1000 + i % 50000], prompt_tokens=512, cached_tokens=256)
               for i in range(num_updates)]
    return UpdateBatch(updates, _STATS)


def long_prompt(num_tokens: int = 131_072) -> GenerateRequest:
    """A GenerateRequest whose prompt is `num_tokens` token ids spread over a 150K vocabulary."""
    params = params_to_dict(SamplingParams(temperature=0.7, max_tokens=256))
    return GenerateRequest("req-long", [(i * 7919) % 150_000 for i in range(num_tokens)], params)


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median of `reps` calls, the cyclic GC off while timing (as timeit does)."""
    fn()  # warm up
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    finally:
        gc.enable()
    return 1e3 * statistics.median(times)


def bench_codec(reps: int = 200) -> list[dict]:
    """Median encode and decode time (ms) and encoded size of each message; checks the round trip too."""
    rows = []
    for name, msg in (("UpdateBatch x1000", update_batch()),
                      ("UpdateBatch x1000 (whole updates)", update_batch_whole()),
                      ("GenerateRequest 128K", long_prompt())):
        data = encode(msg)
        assert decode(data) == msg, f"{name}: the round trip changed the message"
        assert decode(data, trusted=True) == msg, f"{name}: the trusted round trip changed the message"
        rows.append({"message": name, "encode_ms": median_ms(lambda: encode(msg), reps),
                     "decode_trusted_ms": median_ms(lambda: decode(data, trusted=True), reps),
                     "decode_ms": median_ms(lambda: decode(data), reps), "bytes": len(data)})
    rows.append({"message": "list(range(131072)) (floor)", "encode_ms": float("nan"),
                 "decode_trusted_ms": median_ms(lambda: list(range(131_072)), reps), "decode_ms": float("nan"),
                 "bytes": 0})
    return rows


def format_codec_table(rows: list[dict]) -> str:
    head = ("message", "encode ms", "decode ms (engine<->gateway)", "decode ms (checked)", "bytes")
    cells = [(r["message"], f"{r['encode_ms']:.3f}", f"{r['decode_trusted_ms']:.3f}", f"{r['decode_ms']:.3f}",
              r["bytes"]) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *cells)]
    line = lambda xs: "  ".join(str(x).rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(c) for c in cells])


if __name__ == "__main__":
    print(format_codec_table(bench_codec()))
