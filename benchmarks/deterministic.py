#!/usr/bin/env python3
"""The cost of the deterministic (batch-invariant) mode: engine tokens/s with and without it, on CPU.

    python3 benchmarks/deterministic.py                        # shipped k3-tiny, 32 requests, 1 thread
    python3 benchmarks/deterministic.py --model /tmp/tiny-k3 --requests 64 --threads 2

Each mode runs the same seeded workload (random prompts of --prompt-len tokens, --max-tokens greedy
tokens each) through a fresh Engine twice: concurrently (continuous batching, the serving case) and
one request at a time (batch 1, every decode row alone in its matmuls). Reported per case: wall time,
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
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args()


def main() -> int:
    a = _args()
    import torch

    from k3rt.backend.engine import Engine
    from k3rt.config import EngineConfig, SchedulerConfig
    from k3rt.models import resolve_model_dir
    from k3rt.sampling_params import SamplingParams

    torch.set_num_threads(a.threads)
    model = str(resolve_model_dir(a.model))
    g = torch.Generator().manual_seed(0)
    vocab = Engine(EngineConfig(model=model, runner="null")).model_cfg.vocab_size
    prompts = [torch.randint(3, vocab - 64, (a.prompt_len,), generator=g).tolist() for _ in range(a.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    cases, outputs = [], {}
    for det in (False, True):
        mode = "deterministic" if det else "default"
        for batching in ("concurrent", "one-at-a-time"):
            eng = Engine(EngineConfig(model=model, deterministic=det,
                                      scheduler=SchedulerConfig(max_num_batched_tokens=a.budget)))
            eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
            t0 = time.perf_counter()
            if batching == "concurrent":
                outs = [o.output_ids for o in eng.generate(prompts, params)]
            else:
                outs = [eng.generate([p], params)[0].output_ids for p in prompts]
            cases.append(Case(mode, batching, time.perf_counter() - t0, sum(map(len, outs)),
                              a.prompt_len * a.requests))
            outputs[(mode, batching)] = outs
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
