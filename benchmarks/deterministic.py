#!/usr/bin/env python3
"""The cost of the deterministic (batch-invariant) mode: engine tokens/s with and without it.

    python3 benchmarks/deterministic.py                        # shipped k3-tiny, 32 requests, 1 thread, CPU
    python3 benchmarks/deterministic.py --model /tmp/tiny-k3 --requests 64 --threads 2
    python3 benchmarks/deterministic.py --device cuda --requests 64          # the GPU runner (kernels, graphs)
    python3 benchmarks/deterministic.py --device cuda --preset kimi-linear-48b --vocab 8192 --requests 64
                                                               # random bf16 weights at the 48B shape

Each mode runs the same seeded workload (random prompts of --prompt-len tokens, --max-tokens greedy
tokens each) through a fresh Engine twice: concurrently (continuous batching, the serving case) and
one request at a time (batch 1, every decode row alone in its matmuls), each timed on its second pass (the
first compiles every kernel shape; the prefix cache is off). Reported per case: wall time,
output tokens/s, prompt+output tokens/s, and the deterministic mode's slowdown. It also checks the
mode's promise on the way: the deterministic outputs of both cases must be equal (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass


@dataclass
class Case:
    mode: str
    batching: str
    seconds: float
    output_tokens: int
    prompt_tokens: int

    @property
    def out_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="k3-tiny", help="checkpoint folder or shipped model name (default k3-tiny)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU runner with its kernels and decode graphs")
    p.add_argument("--preset", default=None, choices=["kimi-linear-48b"],
                   help="random weights at a published shape instead of --model (k3rt/presets.py)")
    p.add_argument("--vocab", type=int, default=None, help="with --preset: override vocab_size (a smaller head)")
    p.add_argument("--num-pages", type=int, default=None, help="cache pages (default: the engine's sizing)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args()


def main() -> int:
    a = _args()
    import torch

    from k3rt.backend.engine import Engine
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig
    from k3rt.models import resolve_model_dir
    from k3rt.sampling_params import SamplingParams

    torch.set_num_threads(a.threads)
    model, extra = str(resolve_model_dir(a.model)), {}
    if a.preset:
        import tempfile

        from k3rt.presets import PRESETS

        cfg = dict(PRESETS[a.preset], **({"vocab_size": a.vocab} if a.vocab else {}))
        model = tempfile.mkdtemp(prefix="k3rt-det-")
        with open(f"{model}/config.json", "w") as f:
            json.dump(cfg, f)
        extra["random_weights"] = True
    if a.device != "cpu":
        extra.update(device=a.device, runner="gpu")
    extra["cache"] = CacheConfig(enable_prefix_cache=False, **({"num_pages": a.num_pages} if a.num_pages else {}))
    g = torch.Generator().manual_seed(0)
    model_cfg = Engine(EngineConfig(model=model, runner="null", random_weights=bool(a.preset))).model_cfg
    vocab, shared = model_cfg.vocab_size, None
    if a.preset:  # one random model for all four engines (each would draw its own ~100 GB at the 48B shape)
        from k3rt.backend.models.random_init import random_model

        shared = random_model(model_cfg, dtype="bfloat16", device=a.device, seed=0)
    prompts = [torch.randint(3, vocab - 64, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    cases, outputs = [], {}
    for det in (False, True):
        mode = "deterministic" if det else "default"
        for batching in ("concurrent", "one-at-a-time"):
            eng = Engine(EngineConfig(model=model, deterministic=det, **extra,
                                      scheduler=SchedulerConfig(max_num_batched_tokens=a.budget)), model=shared)

            def run() -> list[list[int]]:
                if batching == "concurrent":
                    return [o.output_ids for o in eng.generate(prompts, params)]
                return [eng.generate([p], params)[0].output_ids for p in prompts]

            # warm-up: the whole workload once, so every kernel shape it needs is compiled (Triton JIT) and
            # the timed pass measures steps alone; prefix caching is off, so it cannot shorten the timed pass
            run()
            t0 = time.perf_counter()
            outs = run()
            cases.append(Case(mode, batching, time.perf_counter() - t0, sum(map(len, outs)),
                              a.prompt_len * a.requests))
            outputs[(mode, batching)] = outs
            eng.close()
            del eng
            if a.device != "cpu":
                torch.cuda.empty_cache()
    base = {c.batching: c for c in cases if c.mode == "default"}
    print(f"{'mode':<14} {'batching':<14} {'seconds':>8} {'out tok/s':>10} {'all tok/s':>10} {'slowdown':>9}")
    for c in cases:
        print(f"{c.mode:<14} {c.batching:<14} {c.seconds:8.2f} {c.out_tok_s:10.1f} {c.total_tok_s:10.1f} "
              f"{base[c.batching].seconds and c.seconds / base[c.batching].seconds:8.2f}x")
    same = outputs[("deterministic", "concurrent")] == outputs[("deterministic", "one-at-a-time")]
    differ = sum(x != y for x, y in zip(outputs[("default", "concurrent")], outputs[("default", "one-at-a-time")]))
    print(f"deterministic: concurrent == one-at-a-time: {same}; default mode: {differ}/{a.requests} requests differ")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cases": [c.__dict__ | {"out_tok_s": c.out_tok_s, "total_tok_s": c.total_tok_s}
                                                  for c in cases], "deterministic_equal": same,
                       "default_differ": differ}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
