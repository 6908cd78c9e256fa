#!/usr/bin/env python3
"""Host cost of the suffix drafter (CPU only; no model, no device): the compressed tries k3rt runs against the
uncompressed ones it ran before (tests/backend/suffix_ref.py), side by side on the same token streams.

    python3 benchmarks/suffix_host.py                 # table to stdout
    python3 benchmarks/suffix_host.py --json out.json

Token streams: held-out stdlib code through the k3-tiny tokenizer (`k3rt bench spec`'s code workload), and an
agent session (each turn resends the history plus a tool result that echoes the last output). Figures, each
the median of --reps runs with the cyclic GC off while timing:
  first sight   a new request's first proposal: its own trie indexes the prompt (us per prompt token)
  step          one decode step of B requests: each gets one new token and is asked for a draft (ms per call)
  drain         B requests finish with their outputs into the global trie, which is full, so as many old
                outputs are subtracted out (ms per drain); and the dearest call of such a drain as proposals take
                it, SpecConfig.suffix_drain_tokens at a time (ms per call)
Both implementations' drafts are compared on every call (they must be identical: the compressed trie changes
the cost, not the drafts).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.backend.suffix_ref: the uncompressed oracle

from k3rt.backend.bench.codec_bench import median_ms  # noqa: E402
from k3rt.backend.bench.spec_bench import _code_sources, code_windows  # noqa: E402
from k3rt.backend.spec.base import DraftQuery  # noqa: E402
from k3rt.backend.spec.suffix import SuffixDrafter  # noqa: E402
from k3rt.config import SpecConfig  # noqa: E402
from tests.backend.suffix_ref import RefSuffixTrie  # noqa: E402


class _Uncompressed(SuffixDrafter):
    Trie = RefSuffixTrie


IMPLS = {"compressed": SuffixDrafter, "uncompressed": _Uncompressed}


def _agent_stream(code: list[list[int]], length: int, seed: int) -> list[int]:
    """An agent session's context: turns of (history, an output, a tool result echoing it), to `length`."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < length:
        turn = rng.choice(code)[:128]
        out += turn + [7, 8, 9] + turn
    return out[:length]


def bench(lengths: list[int], batch: int, out_len: int, reps: int, seed: int) -> list[dict]:
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.models import resolve_model_dir

    tok = load_tokenizer(resolve_model_dir("k3-tiny"))
    longest = max(lengths + [out_len * 2])
    cfg = SpecConfig(method="suffix", num_tokens=7)
    # distinct streams for the requests, the outputs already cached and the drained ones
    pool = batch + cfg.suffix_cached_requests + batch * (reps + 2)
    code = code_windows(_code_sources(), tok, pool, longest, seed)
    streams = {"code": code, "agent": [_agent_stream(code, longest, seed + i) for i in range(pool)]}
    rows = []
    for name, seqs in streams.items():
        for n in lengths:
            row: dict = {"stream": name, "measure": f"first sight, {n}-token prompt", "unit": "us/token"}
            for impl, cls in IMPLS.items():
                def first(cls=cls, n=n) -> list:
                    return cls(cfg).propose_scored([DraftQuery(0, seqs[0][:n], n, 7)])
                row[impl] = median_ms(first, reps) * 1e3 / n
            rows.append(row)
        # decode steps of `batch` requests at a context of 256 + i tokens, then their drain into a full global trie
        ctx = 256
        drafters = {impl: cls(cfg) for impl, cls in IMPLS.items()}
        for d in drafters.values():  # the global trie full: suffix_cached_requests outputs in it
            for i in range(cfg.suffix_cached_requests):
                d.finish(10_000 + i, seqs[batch + i][:out_len], 0)
            d.index_finished()
        for impl, d in drafters.items():
            d.propose_scored([DraftQuery(r, seqs[r][:ctx], ctx, 7) for r in range(batch)])  # first sight, untimed
        step = {"stream": name, "measure": f"step at batch {batch} (context {ctx}+)", "unit": "ms/call"}
        for impl, d in drafters.items():
            at = [ctx]

            def call(d=d, at=at) -> list:
                at[0] += 1
                return d.propose_scored([DraftQuery(r, seqs[r][:at[0]], ctx, 7) for r in range(batch)])
            step[impl] = median_ms(call, min(reps * 4, longest - ctx - 2))
        same = [d.propose_scored([DraftQuery(r, seqs[r][:ctx + 9], ctx, 7) for r in range(batch)])
                for d in drafters.values()]
        if same[0] != same[1]:
            raise AssertionError(f"{name}: the compressed and uncompressed drafters drafted differently")
        rows.append(step)
        drain = {"stream": name, "measure": f"drain of {batch} outputs of {out_len} tokens", "unit": "ms/drain"}
        for impl, d in drafters.items():
            nxt = [batch + cfg.suffix_cached_requests]

            def finish_all(d=d, nxt=nxt) -> None:
                for _ in range(batch):
                    d.finish(20_000 + nxt[0], seqs[nxt[0]][:out_len], 0)
                    nxt[0] += 1
                d.index_finished()  # finish only queues them: the next proposal indexes them
            drain[impl] = median_ms(finish_all, reps)
        rows.append(drain)
        # the same drain as proposals take it (SpecConfig.suffix_drain_tokens per call): its dearest call
        spread = {"stream": name, "measure": f"dearest call of such a drain, {cfg.suffix_drain_tokens} tokens a call",
                  "unit": "ms/call"}
        for impl, d in drafters.items():
            for i in range(batch):
                d.finish(30_000 + i, seqs[pool - batch + i][:out_len], 0)
            worst = 0.0
            gc.disable()
            try:
                while d._finished:
                    t = time.perf_counter()
                    d.index_finished(cfg.suffix_drain_tokens)
                    worst = max(worst, time.perf_counter() - t)
            finally:
                gc.enable()
            spread[impl] = worst * 1e3
        rows.append(spread)
    for r in rows:
        r["speedup"] = r["uncompressed"] / r["compressed"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="96,2048,8192", help="prompt lengths for the first-sight figure")
    ap.add_argument("--batch", type=int, default=64, help="requests per step and per drain")
    ap.add_argument("--out-len", type=int, default=128, help="tokens of each finished output")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rows = bench([int(x) for x in a.lengths.split(",")], a.batch, a.out_len, a.reps, a.seed)
    print("| stream | measure | unit | compressed | uncompressed | speedup |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stream']} | {r['measure']} | {r['unit']} | {r['compressed']:.2f} | {r['uncompressed']:.2f} | "
              f"{r['speedup']:.1f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
