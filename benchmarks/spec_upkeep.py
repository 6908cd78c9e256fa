"""What a speculative engine costs per step when it does not speculate: host time of decode steps, plain engine
vs engines configured with each drafter, with the speculation controller as it is or with its governor held
off (issue 16's "never below 0.95x": speculation turned down must cost next to nothing).

Per engine: a warm-up run, then B requests prefilled, then their decode steps (no prefill in them), each
`Engine.step` call timed (median, p90), then the same again under cProfile: host microseconds per step of each
k3rt function (tottime), so the engines' difference shows by function. Greedy, `--max-tokens` per request.

    python3 benchmarks/spec_upkeep.py --device cuda --dtype bfloat16 --batch 1,64
    python3 benchmarks/spec_upkeep.py --smoke      # CPU, null runner: host code only
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import threading
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import ROOT, Report, default_out, engine_bench_parser  # noqa: E402


def _args() -> argparse.Namespace:
    p = engine_bench_parser(__doc__)
    p.add_argument("--runner", default="auto", help="engine runner (the smoke run: null)")
    p.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--engines", default="plain,suffix,suffix-off,dspark,dspark-off",
                   help="plain, or a drafter (ngram, suffix, dspark) with '-off' for its governor held off")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--gc", default="on", choices=["on", "off", "collect", "freeze"],
                   help="Python's garbage collector during the timed steps: on (as served), off, on after a full "
                        "collection (collect), or on with everything alive before them frozen (freeze)")
    p.add_argument("--top", type=int, default=25, help="functions per profile kept in the JSON")
    p.add_argument("--smoke", action="store_true", help="CPU, null runner, batch 1 and 8, 32 tokens")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def _decode_steps(eng, prompts, params, profile: cProfile.Profile | None, gc_mode: str = "on"
                  ) -> tuple[list[float], dict]:
    """Add the requests, step until every one has its first token, then time each decode step call. Returns
    the calls' seconds and what the host did meanwhile (collections per generation, involuntary context
    switches, process CPU time over wall time, OS threads)."""
    for p in prompts:
        eng.add_request(p, params)
    while eng.scheduler.waiting or any(r.num_output == 0 for r in eng.scheduler.running):
        eng.step()
    times = []
    if gc_mode in ("collect", "freeze"):
        gc.collect()
    if gc_mode == "freeze":
        gc.freeze()
    elif gc_mode == "off":
        gc.disable()
    before = [g["collections"] for g in gc.get_stats()]
    switches, cpu0, wall0 = _switches(), time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    try:
        while eng.has_unfinished:
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
    finally:
        if profile is not None:
            profile.disable()
        gc.enable()
        gc.unfreeze()
    collections = [g["collections"] - b for g, b in zip(gc.get_stats(), before)]
    host = {"gc_collections": collections, "involuntary_switches": _switches() - switches,
            "cpu_over_wall": (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9),
            "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0}
    return times, host


def _switches() -> int:
    """This process's involuntary context switches so far (another thread or process took its CPU), 0 where
    /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
    except (OSError, StopIteration):
        return 0


def _top(profile: cProfile.Profile, steps: int, n: int) -> list[list]:
    """[us per step (tottime), us per step (cumtime), calls, function] of k3rt's own functions, tottime order."""
    rows = []
    for (f, line, fn), (_, nc, tt, ct, _) in pstats.Stats(profile).stats.items():
        if f.startswith(str(ROOT)) and "/site-packages/" not in f:
            rows.append([round(tt / steps * 1e6, 1), round(ct / steps * 1e6, 1), nc,
                         f"{Path(f).relative_to(ROOT)}:{line} {fn}"])
    return sorted(rows, reverse=True)[:n]


def main() -> int:
    a = _args()
    if a.smoke:
        a.device, a.runner, a.batch, a.max_tokens, a.engines = "cpu", "null", "1,8", 32, "plain,suffix,suffix-off"
    import torch

    from k3rt.backend.bench.spec_bench import _code_prompts
    from k3rt.backend.engine import Engine
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.spec import governor
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from k3rt.models import resolve_model_dir
    from k3rt.sampling_params import SamplingParams

    report = Report(default_out(a.out, "spec_upkeep.json"), a.budget_s,
                    {"args": {k: str(v) for k, v in vars(a).items()}})
    res, log = report.result, report.log
    md = resolve_model_dir(a.model)
    tok = load_tokenizer(md)
    model = None if a.runner == "null" else load_model(md, dtype=a.dtype, device=a.device)
    sizes = [int(x) for x in a.batch.split(",") if x.strip()]
    bmax = max(sizes)
    base = EngineConfig(model=str(md), dtype=a.dtype, device=a.device, runner=a.runner,
                        scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, bmax * 16), max_running=bmax),
                        cache=CacheConfig(num_pages=bmax * 64 + 64))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    allowed = governor.Governor.allowed
    res["rows"] = []
    for name in a.engines.split(","):
        method, off = (None, False) if name == "plain" else (name.removesuffix("-off"), name.endswith("-off"))
        if report.over_budget():
            log(f"{name}: skipped (budget)")
            continue
        governor.Governor.allowed = (lambda self, b: False) if off else allowed
        try:
            eng = Engine(replace(base, spec=SpecConfig(method=method, num_tokens=7)), model=model)
            for b in sizes:
                prompts = _code_prompts(tok, b, 96, seed=b)
                eng.generate(prompts, replace(params, max_tokens=8))  # warm-up (compiles, graphs)
                eng.flush_cache()
                times, host = _decode_steps(eng, prompts, params, None, a.gc)
                eng.flush_cache()
                prof = cProfile.Profile()
                ptimes, _ = _decode_steps(eng, prompts, params, prof, a.gc)
                eng.flush_cache()
                ms = sorted(t * 1e3 for t in times)
                row = {"engine": name, "batch": b, "steps": len(ms), "step_ms_median": statistics.median(ms),
                       "step_ms_p90": ms[int(0.9 * (len(ms) - 1))], "step_ms_mean": statistics.fmean(ms),
                       "profiled_step_ms_median": statistics.median(ptimes) * 1e3,
                       "speculated_steps": eng.stats.spec_steps_speculated if method else 0,
                       **host, "gc_tracked": len(gc.get_objects()),
                       "threads": sorted(t.name for t in threading.enumerate()),
                       "top": _top(prof, len(ptimes), a.top)}
                res["rows"].append(row)
                log(f"{name} b={b}: step {row['step_ms_median']:.3f} ms median ({len(ms)} steps)")
                report.save()
            eng.close()
            del eng
        finally:
            governor.Governor.allowed = allowed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    plain = {r["batch"]: r["step_ms_median"] for r in res["rows"] if r["engine"] == "plain"}
    print("| engine | batch | step ms median | p90 | x plain | speculated steps |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        ratio = r["step_ms_median"] / plain[r["batch"]] if r["batch"] in plain else float("nan")
        print(f"| {r['engine']} | {r['batch']} | {r['step_ms_median']:.3f} | {r['step_ms_p90']:.3f} | {ratio:.2f} | "
              f"{r['speculated_steps']} |")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
