#!/usr/bin/env python3
"""The DSL's two claims, measured: shipping a program saves round trips, and shared prefixes are computed once.

1. A program with 8 gen/select calls (a multi-turn chat: 5 gens, 2 selects, 1 regex gen), run shipped (the
   whole program in one message) and client-side (`ship=False`: one request per call, SGLang's interpreter
   model). Per mode: client round trips per program, wall latency (median over --repeats runs), and the
   prompt / computed tokens per program from the engine's counters. Every run starts with a fresh nonce so
   no run finds another's prefix in the cache.
2. `run_batch` of --batch programs: one shared ~--system-tokens system prompt + a short question each, against
   the same programs with a different system prompt each (of the same length), and against the shared
   prompt on a Runtime with the prefix cache off. Tokens computed and wall time per variant.

CPU-sized by default: a tiny random K3 checkpoint (made in a temp folder unless --model is given) and the
engine on a thread of this process (--engine spawn for the engine process). Prints a table; writes JSON to
--out (default $OUT/dsl.json, else ./dsl.json).

    python benchmarks/dsl.py                      # tiny model, in-process engine
    python benchmarks/dsl.py --model DIR --engine spawn --batch 64 --out /tmp/dsl.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import k3rt

QUESTION_WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "river", "stone", "cloud", "paper", "lamp",
                  "seven", "orange", "quiet", "north", "table"]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: a tiny random K3 in a temp folder)")
    p.add_argument("--engine", choices=["inproc", "spawn"], default="inproc",
                   help="engine on a thread of this process (default) or in its own process")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--repeats", type=int, default=5, help="runs per mode for the 8-call program")
    p.add_argument("--batch", type=int, default=64, help="programs in the run_batch comparison")
    p.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    p.add_argument("--cache-pages", type=int, default=1024)
    p.add_argument("--skip-cache-off", action="store_true", help="skip the cache-off baseline (a second Runtime)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/dsl.json or ./dsl.json)")
    return p.parse_args()


@k3rt.function
def eight_calls(s, nonce, topic):
    s += k3rt.system(f"Session {nonce}. You answer in a few words.")
    s += k3rt.user(f"Tell me about {topic}.")
    s += k3rt.assistant(k3rt.gen("intro", max_tokens=16))
    for i in range(3):
        s += k3rt.user(f"Detail {i + 1}?")
        s += k3rt.assistant(k3rt.gen(f"detail_{i}", max_tokens=12))
    s += k3rt.user("Is it good?")
    s += k3rt.assistant(k3rt.select("verdict", ["yes", "no", "it depends"]))
    s += k3rt.user("Rate it from 1 to 5.")
    s += k3rt.assistant(k3rt.select("rating", ["1", "2", "3", "4", "5"]))
    s += k3rt.user("Which year?")
    s += k3rt.assistant(k3rt.gen("year", regex=r"(19|20)[0-9]{2}"))
    s += k3rt.user("Summarize.")
    s += k3rt.assistant(k3rt.gen("summary", max_tokens=16))


EIGHT_VARS = ["intro", "detail_0", "detail_1", "detail_2", "verdict", "rating", "year", "summary"]


@k3rt.function
def ask(s, system, question):
    s += k3rt.system(system)
    s += k3rt.user(question)
    s += k3rt.assistant(k3rt.gen("answer", max_tokens=8))


def words_for_tokens(tok: Any, n_tokens: int, seed: int) -> str:
    """Pseudo-random words, about n_tokens long under `tok` (cut at the first word reaching it)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(tok.encode(" ".join(out))) < n_tokens:
        out += [rng.choice(QUESTION_WORDS) for _ in range(8)]
    while len(out) > 1 and len(tok.encode(" ".join(out[:-1]))) >= n_tokens:
        out.pop()
    return " ".join(out)


def counters(rt: Any) -> dict[str, int]:
    s = rt.engine_stats
    return {k: int(s.get(k, 0)) for k in ("prompt_tokens", "cached_tokens", "computed_tokens", "computed_prompt_tokens")}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def bench_eight_calls(rt: Any, repeats: int) -> dict[str, Any]:
    eight_calls.run(nonce="warmup", topic="warm-up", backend=rt, temperature=0)  # compile the regex grammar
    out: dict[str, Any] = {}
    outputs: dict[str, list[dict[str, str]]] = {}
    for mode, ship in (("shipped", True), ("client-side", False)):
        lat, trips, toks = [], [], []
        outputs[mode] = []
        for i in range(repeats):
            # the same nonce per repeat in both modes: identical prompts, so identical greedy outputs
            c0, r0, t0 = counters(rt), rt.backend.round_trips, time.perf_counter()
            st = eight_calls.run(nonce=f"{i:04d}-{mode[0]}", topic=f"lighthouse {i}", backend=rt, ship=ship,
                                 temperature=0)
            st.text()
            lat.append(time.perf_counter() - t0)
            trips.append(rt.backend.round_trips - r0)
            toks.append(delta(counters(rt), c0))
            outputs[mode].append({v: st[v] for v in EIGHT_VARS})
        out[mode] = {
            "round_trips": statistics.median(trips), "latency_ms_median": 1e3 * statistics.median(lat),
            "latency_ms_min": 1e3 * min(lat),
            **{f"{k}_per_program": statistics.mean(t[k] for t in toks) for k in toks[0]},
        }
    return out


def bench_batch(rt: Any, tok: Any, batch: int, system_tokens: int, *, shared: bool, seed: int) -> dict[str, Any]:
    systems = ([words_for_tokens(tok, system_tokens, seed)] * batch if shared
               else [words_for_tokens(tok, system_tokens, seed + 1 + i) for i in range(batch)])
    kwargs = [{"system": systems[i], "question": f"Question {i}: what is {i} plus {i}?"} for i in range(batch)]
    c0, t0 = counters(rt), time.perf_counter()
    states = ask.run_batch(kwargs, backend=rt, temperature=0)
    wall = time.perf_counter() - t0
    d = delta(counters(rt), c0)
    return {"programs": len(states), "system_prompt_tokens": len(tok.encode(systems[0])), "wall_s": wall, **d}


def main() -> int:
    args = _args()
    from k3rt.backend.tokenizer import load_tokenizer

    model = args.model
    if model is None:
        from k3rt.backend.models.tiny import make_tiny

        model = str(make_tiny(tempfile.mkdtemp(prefix="k3rt-bench-dsl-"), arch="k3", dtype="float32"))
    tok = load_tokenizer(model)
    in_process = args.engine == "inproc"
    result: dict[str, Any] = {"model": model, "engine": args.engine, "batch": args.batch,
                              "system_tokens": args.system_tokens, "repeats": args.repeats}
    with k3rt.Runtime(model=model, in_process=in_process, dtype=args.dtype, cache_pages=args.cache_pages) as rt:
        result["eight_calls"] = bench_eight_calls(rt, args.repeats)
        result["batch_shared"] = bench_batch(rt, tok, args.batch, args.system_tokens, shared=True, seed=1)
        result["batch_distinct"] = bench_batch(rt, tok, args.batch, args.system_tokens, shared=False, seed=1000)
    if not args.skip_cache_off:
        from dataclasses import replace

        from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig

        cfg = EngineConfig(model=model, dtype=args.dtype, scheduler=SchedulerConfig(max_running=64),
                           cache=replace(CacheConfig(num_pages=args.cache_pages), enable_prefix_cache=False))
        with k3rt.Runtime(engine_config=cfg, in_process=in_process) as rt:
            result["batch_shared_cache_off"] = bench_batch(rt, tok, args.batch, args.system_tokens, shared=True,
                                                           seed=1)
    _print(result)
    out = args.out or (Path(os.environ["OUT"]) / "dsl.json" if os.environ.get("OUT") else Path("dsl.json"))
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return 0


def _print(r: dict[str, Any]) -> None:
    e = r["eight_calls"]
    print(f"8-call program ({r['repeats']} runs per mode, engine {r['engine']})")
    print(f"{'mode':<12} {'round trips':>11} {'latency ms (median)':>20} {'prompt tok':>11} {'computed tok':>13} "
          f"{'computed prompt tok':>20}")
    for mode in ("shipped", "client-side"):
        m = e[mode]
        print(f"{mode:<12} {m['round_trips']:>11g} {m['latency_ms_median']:>20.1f} {m['prompt_tokens_per_program']:>11.0f} "
              f"{m['computed_tokens_per_program']:>13.0f} {m['computed_prompt_tokens_per_program']:>20.0f}")
    print(f"\nrun_batch of {r['batch']} programs, ~{r['system_tokens']}-token system prompt")
    print(f"{'variant':<28} {'prompt tok':>11} {'cached tok':>11} {'computed prompt tok':>20} {'wall s':>8}")
    for key, label in (("batch_shared", "shared prompt"), ("batch_distinct", "distinct prompts"),
                       ("batch_shared_cache_off", "shared prompt, cache off")):
        if key in r:
            b = r[key]
            print(f"{label:<28} {b['prompt_tokens']:>11} {b['cached_tokens']:>11} {b['computed_prompt_tokens']:>20} "
                  f"{b['wall_s']:>8.2f}")


if __name__ == "__main__":
    sys.exit(main())
