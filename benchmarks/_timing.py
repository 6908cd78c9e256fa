"""Shared by the benchmark scripts: import k3rt from this checkout, time with CUDA events or graphs,
measure the device's copy bandwidth (the physical limit most ratios are taken against), and keep the
result dict that goes to JSON (`Report`).

Times are medians of event-timed repetitions after warm-up (perf_counter on CPU, where numbers are
only a bit-rot check).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kernel_bench_args(doc: str | None, json_name: str, budget_s: float, add=None):
    """The kernel benchmarks' command line: --smoke, --out, --budget-s, then the script's own options
    (`add(parser)`). --smoke sets TRITON_INTERPRET=1 here, before the script imports any kernel."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run under the Triton interpreter")
    p.add_argument("--out", type=Path, default=None, help=f"JSON path (default $OUT/{json_name}, else ./{json_name})")
    p.add_argument("--budget-s", type=float, default=budget_s, help="skip remaining items after this many seconds")
    if add is not None:
        add(p)
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton sees any @jit
    return args


def import_k3rt_kernels() -> None:
    """Make `k3rt.kernels` importable from this checkout, installed or not (the device has no install)."""
    try:
        importlib.import_module("k3rt.kernels")  # an installed k3rt, or this checkout on sys.path
        return
    except ModuleNotFoundError:
        pass
    pkg = types.ModuleType("k3rt")
    pkg.__path__ = [str(ROOT / "k3rt")]  # namespace only: k3rt/__init__ (the DSL) is not needed
    sys.modules["k3rt"] = pkg
    spec = importlib.util.spec_from_file_location(
        "k3rt.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["k3rt.kernels"] = mod
    spec.loader.exec_module(mod)
    pkg.kernels = mod


def load_file_module(path: str, name: str) -> types.ModuleType:
    """An earlier copy of a kernel file (`git show REV:kernels/... > FILE`) loaded as a module of its own, to time
    beside the current one in the same process (its imports resolve to this checkout's other modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp64; any non-finite value in a gives inf."""
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def engine_bench_parser(doc: str | None):
    """The engine benchmarks' common options (--model, --device, --dtype); the script adds its own."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="k3-tiny", help="a shipped model's name or a checkpoint folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's)")
    return p


def _use_cuda(cuda: bool | None) -> bool:
    """cuda=None: time on the device whenever there is one. A script that runs on the CPU on a machine
    with a GPU (kernels.py --smoke) passes False, so its CPU work is neither event-timed nor captured."""
    import torch

    return torch.cuda.is_available() if cuda is None else cuda


def time_ms(fn, reps: int = 20, warmup: int = 3, cuda: bool | None = None) -> dict:
    """Median (and spread) of CUDA-event-timed calls after warm-up; perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    ts = []
    if _use_cuda(cuda):
        torch.cuda.synchronize()
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "reps": reps}


def graph_time(calls: list, reps: int = 30, cuda: bool | None = None) -> dict:
    """Per-call time of `calls` (one pass) replayed from one CUDA graph (plain loop on CPU)."""
    import torch

    if not _use_cuda(cuda):
        t = time_ms(lambda: [c() for c in calls], reps=1, warmup=0, cuda=False)
        return {"us_per_call": 1e3 * t["median_ms"] / len(calls), "graph": False}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    t = time_ms(graph.replay, reps=reps, warmup=3, cuda=True)
    return {"us_per_call": 1e3 * t["median_ms"] / len(calls), "us_per_call_min": 1e3 * t["min_ms"] / len(calls),
            "calls_per_graph": len(calls), "graph": True}


def timeline_stats(events: list[tuple[float, float, str]], top: int = 15) -> dict:
    """What a stream of device kernels did with its span: events (start_us, end_us, name) of one replay, in any
    order. busy: the union of the kernels' intervals; gap: the span's idle time (span - busy); the gap before a
    kernel is its start less the latest end of every kernel before it (negative: it overlapped them, as a PDL
    launch's prologue does), summed per kernel name (top by idle time, then by overlap); every kernel name's total
    duration and count."""
    ev = sorted(events)
    if not ev:
        return {"kernels": 0}
    busy, cur_s, cur_e = 0.0, ev[0][0], ev[0][1]
    latest = ev[0][1]
    per: dict[str, list[float]] = {}
    idle_before: dict[str, float] = {}
    overlap_before: dict[str, float] = {}
    for s, e, name in ev[1:]:
        g = s - latest
        per.setdefault(name, []).append(g)
        if g >= 0:
            idle_before[name] = idle_before.get(name, 0.0) + g
        else:
            overlap_before[name] = overlap_before.get(name, 0.0) - g
        latest = max(latest, e)
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = latest - ev[0][0]
    durations: dict[str, float] = {}
    for s, e, name in ev:
        durations[name] = durations.get(name, 0.0) + (e - s)

    def rows(d: dict[str, float]) -> list[dict]:
        return [{"kernel": k[:90], "us": round(v, 2), "count": len(per.get(k, []))}
                for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"kernels": len(ev), "span_us": span, "busy_us": busy, "gap_us": span - busy,
            "kernel_us": sum(durations.values()), "overlap_us": sum(overlap_before.values()),
            "idle_before": rows(idle_before), "overlap_before": rows(overlap_before),
            "duration": [{"kernel": k[:90], "us": round(v, 2), "count": sum(1 for *_, n in ev if n == k)}
                         for k, v in sorted(durations.items(), key=lambda kv: -kv[1])]}


def device_timeline(fn, top: int = 15) -> dict:
    """timeline_stats of the device kernels (and copies) of one call of fn, from torch.profiler (a graph replay's
    kernels are traced one by one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
              if "CUDA" in str(getattr(e, "device_type", ""))]
    return timeline_stats(events, top)


def l2_rotation(bytes_per_call: int, cuda: bool | None = None) -> int:
    """How many distinct input sets make one pass 3x the L2, so each call reads cold memory."""
    import torch

    if not _use_cuda(cuda):
        return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20) or (60 << 20)
    return max(1, min(64, math.ceil(3 * l2 / max(1, bytes_per_call))))


def copy_bandwidth() -> dict:
    """Device-to-device copy of 1 GiB: GB/s counting bytes read + written."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = ((1 << 30) if dev == "cuda" else (1 << 24)) // 4
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), reps=20, warmup=3)
    return {"bytes_moved": 2 * n * 4, "GBps": 2 * n * 4 / (t["median_ms"] * 1e-3) / 1e9, **t}


def default_out(out: Path | None, name: str) -> Path:
    """--out if given, else $OUT/name (the device machine's result folder), else out/name (git-ignored, so a
    local run never leaves results in the tree)."""
    if out is not None:
        return out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    Path("out").mkdir(exist_ok=True)
    return Path("out") / name


class Report:
    """One script's results: the dict that goes to JSON at `path`, and the clock that its log lines
    and its --budget-s count from (started when the Report is made).

    item() writes the JSON after every item, so a device run that is cut short keeps what it measured.
    log_records: item() also logs each finished record's values (kernels_misc.py's progress lines).
    """

    def __init__(self, path: Path, budget_s: float, result: dict | None = None, log_records: bool = False) -> None:
        self.path = Path(path)
        self.budget_s = budget_s
        self.result: dict = {} if result is None else result
        self.log_records = log_records
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.result, indent=1, default=str))

    def item(self, section: str, name: str, fn) -> dict:
        """Run one measured item: record its dict, or the error / the skip, in result[section]."""
        rec: dict = {"name": name}
        if self.over_budget():
            rec["skipped"] = f"budget {self.budget_s:.0f}s spent"
            self.log(f"{section}/{name}: skipped (budget)")
        else:
            try:
                rec.update(fn())
                if self.log_records:
                    self.log(f"{section}/{name}: " + ", ".join(
                        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items() if k != "name"))
            except Exception as e:  # one broken item must not lose the rest of a device run
                rec["error"] = f"{type(e).__name__}: {e}"
                self.log(f"{section}/{name}: ERROR {rec['error']}")
                traceback.print_exc()
        self.result.setdefault(section, []).append(rec)
        self.save()
        return rec


def persistent_forms(report: Report, section: str, candidates, default_tiles, phased_name: str, check, time_form,
                     smoke: bool) -> None:
    """The persistent layer kernels' items (kernels_moe.py --layer, kda_layer.py): each tile candidate (GPU only)
    and the phased form, each checked (`check(tiles, phased)` -> {"rel_err", "ok", ...}) and then timed
    (`time_form(tiles, phased)` -> {"us", "pct_of_floor", ...}) into report[section]."""
    forms = [(phased_name, None, True)]
    if not smoke:
        forms = [(f"persistent tiles{i}", t, None) for i, t in enumerate(candidates)] + forms
    for name, tiles, phased in forms:
        t = tiles or default_tiles  # None: a kernel without tile options
        rec = report.item(section, name, lambda tiles=tiles, phased=phased, t=t: {
            **check(tiles, phased), "tiles": None if t is None else t.__dict__, **time_form(tiles, phased)})
        if "us" in rec:
            report.log(f"{section} {name}: {rec['us']:.1f} us ({rec['pct_of_floor']:.0f}% of the floor), "
                       f"rel err {rec['rel_err']:.2e}, ok {rec['ok']}")


def floor_timed(fn, items: list, reps: int, base: dict) -> dict:
    """fn(item) for each item, one pass replayed from a CUDA graph: base plus the us per call and its % of
    base["floor_us"] (the layer benchmarks' timing)."""
    t = graph_time([lambda c=c: fn(c) for c in items], reps=reps)
    return {**base, "us": t["us_per_call"], "pct_of_floor": 100 * base["floor_us"] / t["us_per_call"]}


def finish_layer_report(report: Report, stalled: int) -> None:
    """The layer benchmarks' end (kda_layer.py, mla_layer.py): the persistent kernels' stalled waits, the wall time,
    the JSON, and a table of report.result["layer"]."""
    report.result["stalled"] = stalled
    report.result["wall_s"] = report.elapsed()
    report.save()
    print("\n| form | us | floor us | % of floor | ok |\n|---|---:|---:|---:|---|")
    for rec in report.result.get("layer", []):
        if "us" in rec:
            print(f"| {rec['name']} | {rec['us']:.1f} | {rec['floor_us']:.1f} | {rec['pct_of_floor']:.0f} | "
                  f"{rec.get('ok', '')} |")
        else:
            print(f"| {rec['name']} | {rec.get('error') or rec.get('skipped')} | | | |")
    report.log(f"wrote {report.path}")


def start_device(report: Report, smoke: bool) -> float:
    """A kernel benchmark's start: exit without CUDA unless --smoke, record the device and the copy bandwidth;
    -> GB/s (bytes read + written)."""
    import torch

    if not smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke for the CPU interpreter run")
    report.result["device"] = "cpu (interpreter)" if smoke else torch.cuda.get_device_name()
    report.result["copy"] = copy_bandwidth()
    return report.result["copy"]["GBps"]
