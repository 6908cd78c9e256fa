#!/usr/bin/env python3
"""Triton compiles per kernel under varied prompt lengths and batch compositions (issues 16/18: measured runs
and served TTFTs that paid for JIT compiles).

    python3 benchmarks/jit_churn.py --device cuda                 # k3-tiny bf16, GPU runner, CUDA graphs on
    python3 benchmarks/jit_churn.py --smoke                       # CPU, interpreter kernels, a tiny random model

A warm-up (one prompt per power-of-two length 1..256, arriving one per step while the others decode), then 40
prompts of random lengths 1..300 in waves of 8 at random arrival spacings (backend/bench/jit_churn.py). Per
phase: binaries compiled per kernel (CUDA), launch keys first seen per kernel (any device: what the GPU would
compile), steps and wall time; then which arguments made the measured phase's new keys. --specialize-all is
the before: the kernels' do_not_specialize lists ignored (every argument specialized, as Triton does by default). JSON to --out (default $OUT/jit_churn.json); exit status 1 when the
measured phase compiled anything or a per-step argument is specialized (runtime churn).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="k3-tiny", help="checkpoint folder or shipped model name")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's; k3-tiny bf16)")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-len", type=int, default=300)
    p.add_argument("--no-cuda-graphs", action="store_true", help="every step eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--specialize-all", action="store_true",
                   help="the comparison: ignore the kernels' do_not_specialize lists (every argument specialized, as "
                        "before them; kernels/jit_probe.py specialize_all)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: the Triton interpreter, a tiny random model, 6 short prompts (launch keys only)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def main() -> int:
    a = _args()
    if a.smoke:  # before anything imports triton: the interpreter runs the kernels on the CPU
        os.environ["TRITON_INTERPRET"] = "1"
    from _timing import Report, default_out

    from contextlib import nullcontext

    from k3rt.backend.bench.jit_churn import ChurnConfig, run_churn
    from k3rt.backend.engine import Engine
    from k3rt.config import CacheConfig, EngineConfig
    from k3rt.models import resolve_model_dir

    cfg = ChurnConfig(num_prompts=a.prompts, max_len=a.max_len, seed=a.seed)
    if a.smoke:
        from k3rt.backend.models.tiny import make_tiny

        model = str(make_tiny(Path(tempfile.mkdtemp()) / "tiny", arch="kimi_linear", dtype="float32", seed=9))
        a.device, a.dtype = "cpu", "float32"
        cfg = replace(cfg, warmup_lens=(5, 17, 3, 12), num_prompts=6, max_len=40, wave=3, max_tokens=(2, 3))
    else:
        model = str(resolve_model_dir(a.model))
    report = Report(default_out(a.out, "jit_churn.json"), 0.0, {"args": {k: str(v) for k, v in vars(a).items()}})
    from k3rt.kernels.jit_probe import specialize_all

    # around the engine too: its start (CUDA graph capture) is the kernels' first launch
    with specialize_all() if a.specialize_all else nullcontext():
        eng = Engine(EngineConfig(model=model, device=a.device, dtype=a.dtype, runner="gpu", seed=a.seed,
                                  cuda_graphs=not a.no_cuda_graphs and a.device.startswith("cuda"),
                                  cache=CacheConfig(num_pages=4096 if a.device.startswith("cuda") else 256)))
        res = run_churn(eng, cfg)
        eng.close()
    out = report.result
    out["warmup"], out["measured"] = asdict(res["warmup"]), asdict(res["measured"])
    out["runtime_churn"], out["measured_churn"] = res["runtime_churn"], res["measured_churn"]
    report.save()
    w, m = res["warmup"], res["measured"]
    names = sorted(set(w.keys) | set(w.binaries) | set(m.keys) | set(m.binaries))
    print("| kernel | warm-up binaries | warm-up keys | measured binaries | measured keys |")
    print("|---|---|---|---|---|")
    for n in names:
        print(f"| {n} | {w.binaries.get(n, 0)} | {w.keys.get(n, 0)} | {m.binaries.get(n, 0)} | {m.keys.get(n, 0)} |")
    print(f"\nwarm-up: {w.steps} steps in {w.wall_s:.1f}s; measured: {m.steps} steps in {m.wall_s:.1f}s, "
          f"{sum(m.binaries.values())} binaries compiled, {sum(m.keys.values())} new launch keys")
    for n, c in res["measured_churn"].items():
        print(f"  new keys of {n}: " + "; ".join(f"{p}: {', '.join(v)}" for p, v in c.items()))
    if res["runtime_churn"]:
        # a kernel launched from several call sites (the skinny GEMV: one per weight) varies in the sizes its
        # weights fix, which is no churn: only the measured phase's new keys are (the exit status)
        print(f"arguments whose specialization varied across launches (call sites' model-shaped sizes, or per-step "
              f"values the do_not_specialize lists miss): {res['runtime_churn']}")
    print(f"JSON: {report.path}")
    return 1 if m.binaries or m.keys else 0


if __name__ == "__main__":
    sys.exit(main())
