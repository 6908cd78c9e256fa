"""Shared by the benchmark scripts: import k3rt from this checkout, time with CUDA events or graphs,
measure the device's copy bandwidth (the physical limit most ratios are taken against).

Times are medians of event-timed repetitions after warm-up (perf_counter on CPU, where numbers are
only a bit-rot check).
"""
from __future__ import annotations

import importlib.util
import math
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_k3rt_kernels() -> None:
    """Make `k3rt.kernels` importable from this checkout, installed or not (the device has no install)."""
    try:
        import k3rt.kernels  # noqa: F401
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


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp64; any non-finite value in a gives inf."""
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def time_ms(fn, reps: int = 20, warmup: int = 3) -> dict:
    """Median (and spread) of CUDA-event-timed calls after warm-up; perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    ts = []
    if torch.cuda.is_available():
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


def graph_time(calls: list, reps: int = 30) -> dict:
    """Per-call time of `calls` (one pass) replayed from one CUDA graph (plain loop on CPU)."""
    import torch

    if not torch.cuda.is_available():
        t = time_ms(lambda: [c() for c in calls], reps=1, warmup=0)
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
    t = time_ms(graph.replay, reps=reps, warmup=3)
    return {"us_per_call": 1e3 * t["median_ms"] / len(calls), "us_per_call_min": 1e3 * t["min_ms"] / len(calls),
            "calls_per_graph": len(calls), "graph": True}


def l2_rotation(bytes_per_call: int) -> int:
    """How many distinct input sets make one pass 3x the L2, so each call reads cold memory."""
    import torch

    if not torch.cuda.is_available():
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
