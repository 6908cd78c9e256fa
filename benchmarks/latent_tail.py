#!/usr/bin/env python3
"""LatentMoE's tail per layer under tensor parallelism, K3 widths (hidden 7168, latent 3584), bf16, NCCL:
the all-reduce variant (latent partial all-reduced, RMSNorm, the replicated up-projection, the shared-expert
partial all-reduced and added) against the reduce-scatter variant (latent all-reduced, RMSNorm, the
up-projection column-striped so each rank reads 1/TP of its weight, the shared partial reduce-scattered and
added to this rank's columns, one all-gather). Both run `MoE.latent_tail`, the code the model runs; the measurement is `k3rt.backend.bench.tp_bench.tail_row`,
which `k3rt bench tp` runs too.

  torchrun --nproc-per-node 2 benchmarks/latent_tail.py [--m 1 8 16 64] [--out tail.json]

For each M: correctness (the two variants' outputs equal the single-GPU computation of the same sums within
bf16 rounding), then the time per layer of each variant replayed from a CUDA graph holding `--layers`
consecutive layers (each with its own weights, so the up-projection reads cold memory as in the model),
median of `--reps` replays. Rank 0 prints a table and writes JSON (default $OUT/latent_tail_tp{N}.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="*", default=[1, 8, 16, 64], help="tokens per step")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--latent", type=int, default=3584)
    p.add_argument("--layers", type=int, default=8, help="layers per graph (distinct weights)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, fp32, tiny widths, no graphs (CI: the script runs)")
    a = p.parse_args()
    if a.smoke:
        a.hidden, a.latent, a.m, a.layers, a.reps = 64, 32, [1, 3], 2, 2
    return a


def main() -> None:
    a = parse()
    from k3rt.backend.bench.tp_bench import tail_row

    dist.init_process_group("gloo" if a.smoke else "nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    if a.smoke:
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda")
    H, L = a.hidden, a.latent
    result: dict = {"tp": size, "hidden": H, "latent": L, "layers": a.layers, "device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(),
                    "rows": []}

    for M in a.m:
        # the measurement `k3rt bench tp` runs too (correctness against the one-device sums, graph replay)
        row = tail_row(rank, size, dist.group.WORLD, M, H, L, a.layers, a.reps, dev, graphs=not a.smoke)
        result["rows"].append(row)
        if rank == 0:
            print(f"M={M}: all-reduce {row['all_reduce_us']:.1f} us, reduce-scatter {row['reduce_scatter_us']:.1f} us "
                  f"({row['ratio']:.2f}x); rel err {row['all_reduce_rel_err']:.2e} / {row['reduce_scatter_rel_err']:.2e}",
                  flush=True)
    if rank == 0:
        print(f"\n| TP | M | all-reduce tail us/layer | reduce-scatter tail us/layer | ratio | rel err AR / RS |")
        print("|---:|---:|---:|---:|---:|---|")
        for r in result["rows"]:
            print(f"| {size} | {r['M']} | {r['all_reduce_us']:.1f} | {r['reduce_scatter_us']:.1f} | {r['ratio']:.2f} | "
                  f"{r['all_reduce_rel_err']:.1e} / {r['reduce_scatter_rel_err']:.1e} |")
        out = a.out or Path(os.environ.get("OUT", ".")) / f"latent_tail_tp{size}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
