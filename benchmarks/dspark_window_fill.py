#!/usr/bin/env python3
"""How the DSpark drafter's acceptance depends on how many of its context window's target states are held: the
engine holds only the positions recorded since recording last resumed (the governor pauses it while speculation
is off), so after a pause a request's window starts nearly empty (Scheduler.MIN_STATE_ROWS is chosen from this).

    python3 benchmarks/dspark_window_fill.py                  # CPU, fp32: k3-tiny + its shipped drafter, ~2 min
    python3 benchmarks/dspark_window_fill.py --prompts 4 --gen-len 24 --rows 1,128     # a smoke run

Greedy speculative decoding replayed on the target's greedy continuations of held-out code (training/dspark.py
`replay_tau`, K = the drafter's block size), with each round's window masked to its last n rows for every n in
--rows. JSON to --out (default $OUT/dspark_window_fill.json) and to stdout: tau per n.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16, help="held-out code prompts (default 16)")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--gen-len", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="window rows held, comma-separated")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    from _timing import default_out

    from k3rt.models import MODELS_DIR
    from k3rt.training import dspark as D

    rows = [int(x) for x in a.rows.split(",") if x.strip()]
    t0 = time.time()
    model = D.load_drafter(str(MODELS_DIR / "k3-tiny-dspark"), device=a.device)
    target = D.load_model(str(MODELS_DIR / "k3-tiny"), dtype="float32", device=a.device, progress=False)
    prompts = D.code_prompts("heldout", a.prompts, a.prompt_len, 0, str(MODELS_DIR / "k3-tiny"))
    tokens, states, _ = D.greedy_with_states(target, prompts, a.gen_len, model.cfg.target_layers)
    embed, head = target.model.embed_tokens.weight.float(), target.lm_head.weight.float()
    tau = {}
    for n in rows:
        tau[n] = round(D.replay_tau(model, tokens, states, a.prompt_len, embed, head, held=n)["tau"], 3)
        print(f"rows {n}: tau {tau[n]}", file=sys.stderr)
    res = {"args": {k: str(v) for k, v in vars(a).items()}, "context_len": model.cfg.context_len,
           "k": model.cfg.block_size, "tau_by_rows": tau, "seconds": round(time.time() - t0, 1)}
    out = default_out(a.out, "dspark_window_fill.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
