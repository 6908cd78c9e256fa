#!/usr/bin/env python3
"""Overlap scheduling on and off: the engine (scheduler + GPU runner + sampling + update, no HTTP) at the
Kimi-Linear-48B shape with random bf16 weights, N requests decoding together.

    python3 benchmarks/overlap.py                      # 48B shape, N = 64 and 256, one H200
    python3 benchmarks/overlap.py --smoke              # tiny config on CPU (torch ops): bit-rot check

For each N and each mode (overlap on, then off) the same engine weights serve N greedy requests with
--prompt-len-token prompts; after every request is decoding, --steps engine steps are timed:

  tokens_per_s      output tokens the engine returned / wall time of those steps
  step_ms           wall time per engine step (host: schedule, pack, launch, collect, update)
  gpu_idle          share of the GPU's step time it waited for the host (CUDA events, backend/runner/gpu/idle.py;
                    absent on the CPU)

The engine is built once per mode (its pool and CUDA graphs), the model once; the prefix cache is off
(the prompts are random: it would only publish snapshots nobody reuses). JSON to --out (default
$OUT/overlap.json) and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi-linear-48b", help="preset name or checkpoint folder (config only)")
    p.add_argument("--batch", type=int, nargs="*", default=[64, 256], help="concurrent decoding requests (N)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="timed engine steps per (N, mode)")
    p.add_argument("--cache-gb", type=float, default=8.0, help="cache pool size (GPU; N=256 at the 48B shape needs ~2.2)")
    p.add_argument("--smoke", "--tiny", dest="smoke", action="store_true",
                   help="tiny config on CPU with torch ops (no kernels, no graphs): N = 2 and 4, 4 steps")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip remaining items after this many seconds")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


ARGS = _args()
if ARGS.smoke:
    ARGS.batch, ARGS.steps, ARGS.prompt_len = [2, 4], 4, 16

import torch  # noqa: E402
from _timing import Report, default_out  # noqa: E402

from k3rt.backend.engine import Engine  # noqa: E402
from k3rt.backend.models.random_init import random_model  # noqa: E402
from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from k3rt.model_config import load_model_config  # noqa: E402
from k3rt.sampling_params import SamplingParams  # noqa: E402

REPORT = Report(default_out(ARGS.out, "overlap.json"), ARGS.budget_s,
                {"args": {k: str(v) for k, v in vars(ARGS).items()}})
log = REPORT.log


def engine_config(model: str, overlap: bool, max_running: int) -> EngineConfig:
    sched = SchedulerConfig(max_num_batched_tokens=8192, max_running=max_running)
    if ARGS.smoke:
        return EngineConfig(model=model, dtype="float32", device="cpu", runner="gpu", kernels=False,
                            cuda_graphs=False, overlap=overlap, random_weights=True, scheduler=sched,
                            cache=CacheConfig(num_pages=max(64, 8 * max_running), enable_prefix_cache=False))
    return EngineConfig(model=model, dtype="bfloat16", device="cuda", runner="gpu", overlap=overlap,
                        random_weights=True, scheduler=sched,
                        cache=CacheConfig(memory_gb=ARGS.cache_gb, num_pages=None, enable_prefix_cache=False))


def run_one(model_dir: str, model, n: int, overlap: bool) -> dict:
    eng = Engine(engine_config(model_dir, overlap, max(n, 1)), model=model)
    try:
        vocab = eng.model_cfg.vocab_size
        g = torch.Generator().manual_seed(n)
        warm = 8  # steps after the last prefill before timing
        params = SamplingParams(temperature=0.0, max_tokens=ARGS.steps + warm + 8, ignore_eos=True)
        for _ in range(n):
            eng.add_request(torch.randint(0, vocab, (ARGS.prompt_len,), generator=g).tolist(), params)
        # every prompt in, then a few decode steps so the step shape is the steady one
        while any(r.num_output == 0 for r in eng.requests.values()):
            eng.step()
        for _ in range(warm):
            eng.step()
        gpu0 = eng.runner.gpu_time()
        tokens = 0
        t0 = time.perf_counter()
        for _ in range(ARGS.steps):
            tokens += sum(len(o.new_token_ids) for o in eng.step())
        wall = time.perf_counter() - t0
        gpu1 = eng.runner.gpu_time()
        rec = {"batch": n, "overlap": overlap, "tokens": tokens, "tokens_per_s": tokens / wall,
               "step_ms": 1e3 * wall / ARGS.steps}
        if gpu1 is not None:
            idle, span = gpu1[0] - gpu0[0], gpu1[1] - gpu0[1]
            rec.update(gpu_idle=idle / span if span > 0 else None, gpu_step_ms=1e3 * span / ARGS.steps)
        while eng.has_unfinished:  # the engine drains its requests before it goes
            eng.step()
        return rec
    finally:
        eng.close()
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    model_dir = ARGS.model
    if ARGS.smoke:
        from k3rt.backend.models.tiny import make_tiny

        model_dir = str(make_tiny(Path(tempfile.mkdtemp()) / "k3", arch="k3", dtype="float32", seed=0))
    cfg = load_model_config(model_dir)
    t0 = time.perf_counter()
    model = random_model(cfg, dtype="float32" if ARGS.smoke else "bfloat16", device="cpu" if ARGS.smoke else "cuda",
                         seed=0)
    log(f"random model built in {time.perf_counter() - t0:.1f} s")
    for n in ARGS.batch:
        for overlap in (True, False):
            rec = REPORT.item("runs", f"N={n} overlap={'on' if overlap else 'off'}", lambda: run_one(model_dir, model, n, overlap))
            log(str(rec))
    rows = [r for r in REPORT.result.get("runs", []) if "tokens_per_s" in r]
    print("\n| N | overlap | tokens/s | step ms | GPU step ms | GPU idle |\n|---|---|---|---|---|---|")
    for r in rows:
        idle = "absent" if r.get("gpu_idle") is None else f"{100 * r['gpu_idle']:.1f}%"
        gpu = f"{r['gpu_step_ms']:.2f}" if "gpu_step_ms" in r else "-"
        print(f"| {r['batch']} | {'on' if r['overlap'] else 'off'} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
              f"{gpu} | {idle} |")
    for n in ARGS.batch:
        on = next((r for r in rows if r["batch"] == n and r["overlap"]), None)
        off = next((r for r in rows if r["batch"] == n and not r["overlap"]), None)
        if on and off:
            REPORT.result.setdefault("speedup", {})[str(n)] = on["tokens_per_s"] / off["tokens_per_s"]
            print(f"N={n}: overlap on / off = {on['tokens_per_s'] / off['tokens_per_s']:.2f}x tokens/s")
    REPORT.save()


if __name__ == "__main__":
    main()
