"""Where a speculative round's time goes at small batch (issue 16's batch-1 goal): the engine's decode-phase step
wall, the host phases inside it, and the device's work, plain engine against drafting engines.

Per engine (plain, then each drafter with the speculation controller off, so every step drafts and verifies):
B code requests prefilled, then
  1. `Engine.step` wall times of the decode phase (median), tokens emitted per step, tau;
  2. the same steps under torch.profiler with the engine's phases labelled (drafter pass, verify forward, the
     host's acceptance, commit, target-state recording, plain graph replay): host ms per step of each label,
     the device's kernel ms and kernel count per step, the share of the wall the device was busy, the top
     kernels by device time;
  3. at the end (the requests done), each CUDA graph the engine replays, alone, CUDA-event timed: the decode
     graph, the verify graph and its commit graph, the drafter's graph, at the batch's bucket;
  4. the prefill phase (`prefill_ms`: the steps from the B requests' arrival until each has its first token,
     synced; median of 3) and, with --profile-prefill, those steps under the profiler as in 2.

    python3 benchmarks/spec_round.py --device cuda --dtype bfloat16 --batch 1,16
    python3 benchmarks/spec_round.py --smoke      # CPU, reference runner, few steps: bit-rot check
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Report, default_out, engine_bench_parser, time_ms  # noqa: E402


def _args() -> argparse.Namespace:
    p = engine_bench_parser(__doc__)
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--engines", default="plain,dspark,suffix",
                   help="plain and/or drafters (ngram, suffix, dspark); dspark:N runs up to N verify rounds per step "
                        "on the device (SpecConfig.rounds)")
    p.add_argument("--adaptive", action="store_true", help="the speculation controller on (default off: every step "
                                                           "drafts)")
    p.add_argument("--spec-tokens", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--profile-steps", type=int, default=24, help="decode steps under the profiler per engine")
    p.add_argument("--top", type=int, default=20, help="kernels kept per row")
    p.add_argument("--profile-prefill", action="store_true",
                   help="also profile the prefill phase's steps (the row's prefill_profile)")
    p.add_argument("--smoke", action="store_true", help="CPU, batch 1, 32-token prompts, 8 tokens (the reference runner: no graphs)")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


# (object path from the engine, attribute, label): the engine phases labelled in the profile and timed on the
# host; "runner module" names a function the runner's module imported (patched there)
_PHASES = (
    ("scheduler", "schedule", "schedule"),
    ("scheduler.drafter", "propose_scored", "draft"),
    ("scheduler.drafter", "_inputs", "draft_inputs"),
    ("runner", "launch", "launch"),
    ("runner", "_pack", "pack"),
    ("runner", "_build", "build_step"),
    ("runner.fwd", "logits", "logits"),
    ("runner", "_run_verify", "verify_forward"),
    ("runner", "_sample_now", "sample_and_accept"),
    ("runner module", "verify_requests", "accept"),
    ("runner", "_commit_verify_form", "commit"),
    ("runner module", "record_step_states", "record_states"),
    ("runner", "_replay", "decode_replay"),
    ("runner", "collect", "collect"),
    ("scheduler", "resolve", "resolve"),
)


def _resolve(eng, path: str):
    if path == "runner module":
        return sys.modules[type(eng.runner).__module__]
    obj = eng
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _timed(fn, totals: dict, label: str):
    """fn, adding the seconds each call holds the host to totals[label]."""
    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[label] += time.perf_counter() - t0
    return timed


def _time_triton_launches():
    """Total the host time of every Triton launch (JITFunction.run) per kernel until the returned function is
    called, which restores the launcher and returns {kernel name: (launches, seconds)}. Nested runs (an autotuner's
    benchmark launches) count once each."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return dict
    run = JITFunction.run
    stats: dict[str, list] = defaultdict(lambda: [0, 0.0])

    def timed_run(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return run(self, *a, **kw)
        finally:
            s = stats[self.__name__]
            s[0] += 1
            s[1] += time.perf_counter() - t0

    JITFunction.run = timed_run

    def done() -> dict[str, tuple[int, float]]:
        JITFunction.run = run
        return {k: (n, t) for k, (n, t) in stats.items()}
    return done


def _label(eng, record_function=None, totals: dict | None = None) -> list:
    """Wrap each phase's method on its instance (or function in the runner's module) with a profiler label
    (record_function) or a perf_counter total (totals: label -> seconds); returns what to undo."""
    undo = []
    for path, attr, label in _PHASES:
        obj = _resolve(eng, path)
        fn = getattr(obj, attr, None) if obj is not None else None
        if fn is None:
            continue
        if record_function is not None:
            def wrapped(*a, _fn=fn, _label=label, **kw):
                with record_function(f"k3rt::{_label}"):
                    return _fn(*a, **kw)
        else:
            wrapped = _timed(fn, totals, label)
        setattr(obj, attr, functools.wraps(fn)(wrapped))
        undo.append((obj, attr, fn if isinstance(obj, type(sys)) else None))
    return undo


def _unlabel(undo: list) -> None:
    for obj, attr, fn in undo:
        if fn is not None:
            setattr(obj, attr, fn)  # a module's function
        else:
            delattr(obj, attr)  # back to the class's method


def _decode_ready(eng, prompts, params) -> int:
    """Add the prompts and step until each request has its first token; returns the steps taken."""
    for p in prompts:
        eng.add_request(p, params)
    steps = 0
    while eng.scheduler.waiting or any(r.num_output == 0 for r in eng.scheduler.running):
        eng.step()
        steps += 1
    return steps


def _finish(eng) -> None:
    while eng.has_unfinished:
        eng.step()
    eng.flush_cache()


def _timed_steps(eng, sync) -> tuple[list[float], list[int]]:
    """Step until a request finishes (the batch stays whole); (seconds per step, tokens emitted per step)."""
    times, tokens = [], []
    n0 = len(eng.scheduler.running)
    while eng.scheduler.running and len(eng.scheduler.running) == n0:
        t0 = time.perf_counter()
        outs = eng.step()
        sync()
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(o.new_token_ids) for o in outs))
    return times, tokens


def _profile_summary(prof, steps: int, wall_s: float, top: int) -> dict:
    from torch.autograd import DeviceType

    host = defaultdict(float)
    kernels = defaultdict(lambda: [0.0, 0])
    spans = []
    for ev in prof.events():
        if ev.name.startswith("k3rt::"):
            # a label also comes back as a device-side range: a span of a host phase, no kernel (counted as one, it
            # made the busy and kernel time per step those of the longest phase)
            if ev.device_type != DeviceType.CUDA:
                host[ev.name[6:]] += ev.time_range.elapsed_us()
        elif ev.device_type == DeviceType.CUDA:
            if ev.name.startswith("Memcpy") or ev.name.startswith("Memset"):
                key = ev.name.split(" ")[0]
            else:
                key = ev.name
            kernels[key][0] += ev.time_range.elapsed_us()
            kernels[key][1] += 1
            spans.append((ev.time_range.start, ev.time_range.end))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    total = sum(v[0] for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"host_ms_per_step": {k: round(v / 1e3 / steps, 4) for k, v in sorted(host.items())},
            "device_kernel_ms_per_step": round(total / 1e3 / steps, 4),
            "device_busy_ms_per_step": round(busy / 1e3 / steps, 4),
            "device_ops_per_step": round(sum(v[1] for v in kernels.values()) / steps, 1),
            "wall_ms_per_step": round(wall_s * 1e3 / steps, 4),
            "top_kernels": [[k[:90], round(v[0] / 1e3 / steps, 4), round(v[1] / steps, 2)] for k, v in ranked]}


def _profile_prefill(eng, prompts, params, sync, prefill_steps: int, top: int) -> dict:
    """The prefill phase's steps twice: host time per phase with nothing attached (the labelled phases plus the
    piecewise forward's cores and graph replays: `host_phase_ms_per_step`), then under the torch profiler
    (`_profile_summary`), in that order (CUPTI slows graph launches once a profiler has attached)."""
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    totals = defaultdict(float)
    undo = _label(eng, totals=totals)
    mixed = getattr(eng.runner, "mixed", None)
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = _timed(replay, totals, "graph_replay")
    if mixed is not None:
        mixed._core = _timed(mixed._core, totals, "piecewise_core")
    launches = _time_triton_launches()
    sync()
    t0 = time.perf_counter()
    steps = _decode_ready(eng, prompts, params)
    sync()
    totals["wall"] = time.perf_counter() - t0
    torch.cuda.CUDAGraph.replay = replay
    if mixed is not None:
        del mixed._core
    per_kernel = launches()
    _unlabel(undo)
    _finish(eng)
    prefill_host = {k: round(v * 1e3 / steps, 4) for k, v in sorted(totals.items())}
    undo = _label(eng, record_function=record_function)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        _decode_ready(eng, prompts, params)
        sync()
        wall = time.perf_counter() - t0
    _unlabel(undo)
    prefill_profile = _profile_summary(prof, prefill_steps, wall, top)
    prefill_profile["host_phase_ms_per_step"] = prefill_host
    # per Triton kernel: launches per step and the host ms per step its launches held (JITFunction.run: argument
    # binding, specialization, cache lookup and the driver call), largest first
    prefill_profile["triton_launch_host"] = {
        name: {"launches_per_step": round(n / steps, 2), "host_ms_per_step": round(t * 1e3 / steps, 4),
               "us_per_launch": round(t * 1e6 / max(n, 1), 2)}
        for name, (n, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])}
    _finish(eng)
    return prefill_profile


def _graph_times(eng, batch: int, reps: int = 30) -> dict:
    """Each graph the engine replays at this batch's bucket, alone (after the run: replays write scratch state)."""
    r = eng.runner
    out: dict[str, float] = {}

    def timed(name, fn):
        out[name] = round(time_ms(fn, reps=reps, cuda=True)["median_ms"], 4)

    size = next((s for s in sorted(getattr(r, "graphs", {}) or {}) if s >= batch), None)
    if size is not None:
        timed("decode_graph_ms", r.graphs[size].graph.replay)
    vg = getattr(r, "verify_graphs", {}) or {}
    vsize = next((s for s in sorted(vg) if s >= batch), None)
    if vsize is not None:
        timed("verify_graph_ms", vg[vsize].graph.replay)
        timed("commit_graph_ms", vg[vsize].commit.replay)
    dg = getattr(getattr(eng.scheduler, "drafter", None), "graphs", None)
    if dg is not None and dg.size_for(batch) is not None and dg.size_for(batch) in dg.graphs:
        timed("drafter_graph_ms", dg.graphs[dg.size_for(batch)].graph.replay)
    return out


def main() -> int:
    a = _args()
    if a.smoke:
        a.device, a.batch, a.max_tokens, a.profile_steps = "cpu", "1", 8, 2
    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from k3rt.backend.bench.spec_bench import _code_prompts
    from k3rt.backend.engine import Engine
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from k3rt.models import resolve_model_dir
    from k3rt.sampling_params import SamplingParams

    report = Report(default_out(a.out, "spec_round.json"), a.budget_s,
                    {"args": {k: str(v) for k, v in vars(a).items()}})
    res, log = report.result, report.log
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    md = resolve_model_dir(a.model)
    tok = load_tokenizer(md)
    model = load_model(md, dtype=a.dtype, device=a.device)
    sizes = [int(x) for x in a.batch.split(",") if x.strip()]
    bmax = max(sizes)
    base = EngineConfig(model=str(md), dtype=a.dtype, device=a.device,
                        scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, bmax * 16), max_running=bmax),
                        cache=CacheConfig(num_pages=bmax * 64 + 64))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    res["rows"] = []
    for name in a.engines.split(","):
        if report.over_budget():
            log(f"{name}: skipped (budget)")
            continue
        method, _, rounds = name.partition(":")  # dspark:4 = up to 4 verify rounds per step on the device
        spec = SpecConfig() if name == "plain" else SpecConfig(method=method, num_tokens=a.spec_tokens,
                                                               adaptive=a.adaptive, rounds=int(rounds or 1))
        eng = Engine(replace(base, spec=spec), model=model)
        for b in sizes:
            prompts = _code_prompts(tok, b, 32 if a.smoke else 96, seed=b)
            eng.generate(prompts, replace(params, max_tokens=min(16, a.max_tokens)))  # warm-up: compiles, graphs
            eng.flush_cache()
            prefill_ms, prefill_steps = [], 0
            for _ in range(3):  # the prefill phase alone (synced; the prefix cache flushed between)
                sync()
                t0 = time.perf_counter()
                prefill_steps = _decode_ready(eng, prompts, params)
                sync()
                prefill_ms.append((time.perf_counter() - t0) * 1e3)
                _finish(eng)
            prefill_profile = (_profile_prefill(eng, prompts, params, sync, prefill_steps, a.top)
                               if a.profile_prefill else None)
            v0, acc0 = eng.stats.spec_verifies, eng.stats.spec_accepted_tokens
            _decode_ready(eng, prompts, params)
            times, emitted = _timed_steps(eng, sync)
            v1, acc1 = eng.stats.spec_verifies, eng.stats.spec_accepted_tokens
            _finish(eng)
            # the same steps again with each phase's host time totalled (perf_counter around each call: what
            # a phase holds the host, device waits inside it included)
            totals: dict[str, float] = defaultdict(float)
            _decode_ready(eng, prompts, params)
            undo = _label(eng, totals=totals)
            htimes, _ = _timed_steps(eng, sync)
            _unlabel(undo)
            verifies, accepted = v1 - v0, acc1 - acc0
            _finish(eng)
            _decode_ready(eng, prompts, params)
            undo = _label(eng, record_function=record_function)
            n = min(a.profile_steps, max(1, a.max_tokens // 4))
            sync()
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                for _ in range(n):
                    eng.step()
                sync()
                wall = time.perf_counter() - t0
            _unlabel(undo)
            _finish(eng)
            ms = [t * 1e3 for t in times]
            row = {"engine": name, "batch": b, "steps": len(ms), "step_ms_median": round(statistics.median(ms), 4),
                   "tokens_per_step": round(sum(emitted) / max(1, len(emitted)), 3),
                   "tok_s": round(sum(emitted) / max(1e-9, sum(times)), 1),
                   "tau": round((accepted + verifies) / verifies, 3) if verifies else None,
                   "host_phase_ms_per_step": {k: round(v * 1e3 / len(htimes), 4) for k, v in sorted(totals.items())},
                   "host_timed_step_ms_median": round(statistics.median(htimes) * 1e3, 4),
                   "profile": _profile_summary(prof, n, wall, a.top),
                   "prefill_ms": round(statistics.median(prefill_ms), 4), "prefill_steps": prefill_steps}
            if prefill_profile is not None:
                row["prefill_profile"] = prefill_profile
            if cuda:
                row["graphs"] = _graph_times(eng, b)
            res["rows"].append(row)
            log(f"{name} b={b}: step {row['step_ms_median']:.3f} ms, {row['tokens_per_step']} tok/step, "
                f"{row['tok_s']} tok/s, tau {row['tau']}, prefill {row['prefill_ms']:.3f} ms in {prefill_steps} "
                f"steps, graphs {row.get('graphs')}")
            report.save()
        eng.close()
        del eng
        if cuda:
            torch.cuda.empty_cache()
    print("| engine | batch | step ms | tok/step | tok/s | tau | device busy ms/step | kernels/step | prefill ms | "
          "graphs ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in res["rows"]:
        p = r["profile"]
        g = ", ".join(f"{k[:-3]} {v}" for k, v in r.get("graphs", {}).items())
        print(f"| {r['engine']} | {r['batch']} | {r['step_ms_median']} | {r['tokens_per_step']} | {r['tok_s']} | "
              f"{r['tau']} | {p['device_busy_ms_per_step']} | {p['device_ops_per_step']} | {r['prefill_ms']} | {g} |")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
