#!/usr/bin/env python3
"""Speculative decoding with the model-free drafters: tau, acceptance and time against plain decoding.

    python3 benchmarks/spec.py                           # the shipped k3-tiny model, reference runner, CPU
    python3 benchmarks/spec.py --model DIR --device cuda --runner gpu --max-tokens 256

Two workloads of greedy requests, run through the Engine without speculation and with each drafter:
  single: each prompt once (tau comes from the request's own history: prompt lookup, its own suffix trie);
  repeat: the same prompts asked a second time after the first round finished (an agent loop re-asking;
    the suffix drafter's global trie holds the first round's outputs).
Every speculative output is checked token for token against the plain one. tau = (accepted drafts +
verifies) / verifies: tokens a verify step emits. On CPU the times only show the host overhead of drafting
and verifying on a tiny model (where a step costs about the same for 1 or 5 tokens); tokens/step is the
number that carries over. Table to stdout, everything to JSON (--out, default $OUT/spec.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\ndef list_files(path):",
    "def quicksort(xs):",
    "# Sum the squares of a list\ndef sum_squares(xs):",
    "def is_prime(n):",
]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="k3-tiny", help="checkpoint folder or shipped model name")
    p.add_argument("--device", default="cpu")
    p.add_argument("--runner", default="model", choices=["model", "gpu"])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec-tokens", type=int, nargs="*", default=[4])
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def _run(model_dir: Path, args, prompts: list[list[int]], rounds: int, method: str | None, k: int) -> dict:
    from k3rt.backend.engine import Engine
    from k3rt.config import EngineConfig, SpecConfig
    from k3rt.sampling_params import SamplingParams

    eng = Engine(EngineConfig(model=str(model_dir), device=args.device, runner=args.runner,
                              spec=SpecConfig(method=method, num_tokens=max(k, 1))))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outs, t0 = [], time.perf_counter()
    for _ in range(rounds):
        outs = [o.output_ids for o in eng.generate(prompts, params)]
    wall = time.perf_counter() - t0
    s = eng.stats
    tokens = sum(map(len, outs)) * rounds
    return {"method": method or "plain", "spec_tokens": k if method else 0, "outputs": outs, "wall_s": wall,
            "steps": eng.num_steps, "tokens": tokens, "tokens_per_step": tokens / max(eng.num_steps, 1),
            "verifies": s.spec_verifies, "drafted": s.spec_drafted_tokens, "accepted": s.spec_accepted_tokens,
            "tau": s.spec_tau, "accept_rate": s.spec_accepted_tokens / s.spec_drafted_tokens if s.spec_drafted_tokens else 0.0}


def main() -> int:
    args = _args()
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.models import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode_prompt(p) for p in PROMPTS]
    rows = []
    for workload, rounds in (("single", 1), ("repeat", 2)):
        plain = _run(model_dir, args, prompts, rounds, None, 0)
        rows.append({"workload": workload, **plain})
        for method in ("ngram", "suffix"):
            for k in args.spec_tokens:
                r = _run(model_dir, args, prompts, rounds, method, k)
                r["identical"] = r["outputs"] == plain["outputs"]
                rows.append({"workload": workload, **r})
    print(f"{'workload':8} {'method':7} {'K':>2} {'tau':>5} {'accept':>6} {'tok/step':>8} {'steps':>5} "
          f"{'wall s':>7} identical")
    for r in rows:
        print(f"{r['workload']:8} {r['method']:7} {r['spec_tokens']:>2} {r['tau']:5.2f} {r['accept_rate']:6.2f} "
              f"{r['tokens_per_step']:8.2f} {r['steps']:5d} {r['wall_s']:7.2f} {r.get('identical', '')}")
    out = args.out or Path(os.environ.get("OUT", ".")) / "spec.json"
    out.write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in rows], indent=1))
    return 0 if all(r.get("identical", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
