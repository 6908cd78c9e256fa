#!/usr/bin/env python3
"""Issue 17's K3-width slice: Kimi-K3's widths (the `kimi-k3-slice` preset: hidden 7168, 96 KDA and MLA heads,
LatentMoE at 3584 with random MXFP4 experts, four layers) under tensor parallelism, greedy against the fp32
reference path on the CPU (backend/bench/k3_slice.py says how).

    python3 benchmarks/k3_slice.py --tp 2                      # 2 GPUs (the device's nvidia-h200-x2), bf16
    python3 benchmarks/k3_slice.py --tp 2 --dtype float32      # the same in fp32 on the GPUs
    python3 benchmarks/k3_slice.py --smoke                     # CPU, gloo, the tiny k3 shape (seconds)

The checkpoint (~6 GB at 64 experts) goes to --dir and is reused by later runs with the same config. Prints a
table; JSON to --out (default $OUT/k3_slice.json). Exit status 1 when the greedy tokens differ other than by a
tie flip (a position where the reference's top-2 margin is below --tie-margin).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (one GPU each on CUDA)")
    p.add_argument("--ep", type=int, nargs="?", const=True, default=1, metavar="M",
                   help="expert-parallel degree (as serve --ep: M groups of whole experts; alone: M = --tp)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the engine under test's compute dtype (the reference is always fp32 on the CPU)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's 64)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-device", default=None, help="where the random weights are drawn (default: cuda if any)")
    p.add_argument("--tie-margin", type=float, default=0.05)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="the engine under test runs every step eagerly (skips the graph capture: a shorter run)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint folder (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, the tiny k3 shape with MXFP4 experts")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def main() -> int:
    a = _args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    from _timing import default_out

    from k3rt.backend.bench.k3_slice import SliceConfig, run_slice, table

    init = a.init_device or ("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    folder = a.dir or Path(tempfile.mkdtemp(prefix="k3_slice_"))
    cfg = SliceConfig(out_dir=str(folder), tp=a.tp, ep=a.ep, device="cpu" if a.smoke else a.device,
                      dtype="float32" if a.smoke else a.dtype, experts=a.experts, vocab=a.vocab,
                      prompt_len=a.prompt_len, tokens=a.tokens, seed=a.seed, init_device=init,
                      tie_margin=a.tie_margin, cuda_graphs=a.cuda_graphs, smoke=a.smoke)
    res = run_slice(cfg)
    out = default_out(a.out, "k3_slice.json")
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    print(f"reference {res['reference_s']:.1f} s, engine {res['engine_s']:.1f} s; JSON: {out}")
    return 0 if res["identical"] or res["tie_flip"] else 1


if __name__ == "__main__":
    sys.exit(main())
