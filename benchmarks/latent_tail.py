#!/usr/bin/env python3
"""LatentMoE's tail per layer under tensor parallelism, K3 widths (hidden 7168, latent 3584), bf16, NCCL:
the all-reduce variant (latent partial all-reduced, RMSNorm, the replicated up-projection, the shared-expert
partial all-reduced and added) against the reduce-scatter variant (latent all-reduced, RMSNorm, the
up-projection column-striped so each rank reads 1/TP of its weight, the shared partial reduce-scattered and
added to this rank's columns, one all-gather). Both run `MoE.latent_tail`, the code the model runs.

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
    from k3rt.backend.distributed import TPContext
    from k3rt.backend.layers.norm import rms_norm
    from k3rt.backend.models.moe import latent_tail

    dist.init_process_group("gloo" if a.smoke else "nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    if a.smoke:
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda")
    dt = torch.float32 if a.smoke else torch.bfloat16
    H, L = a.hidden, a.latent
    g = torch.Generator(device=dev).manual_seed(0)  # same weights on every rank
    w_up = [torch.randn(H, L, device=dev, generator=g, dtype=dt) * L ** -0.5 for _ in range(a.layers)]
    norm_w = torch.ones(L, device=dev, dtype=dt)
    rows = slice(rank * H // size, (rank + 1) * H // size)
    w_slice = [w[rows].contiguous() for w in w_up]
    result: dict = {"tp": size, "hidden": H, "latent": L, "layers": a.layers, "device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(),
                    "rows": []}

    tps = {v: TPContext(rank, size, dist.group.WORLD, latent_tail=v) for v in ("all_reduce", "reduce_scatter")}
    linear = torch.nn.functional.linear

    for M in a.m:
        gm = torch.Generator(device=dev).manual_seed(1000 + M + rank)  # each rank its own partial sums
        lat = [torch.randn(M, L, device=dev, generator=gm, dtype=dt) for _ in range(a.layers)]
        shr = [torch.randn(M, H, device=dev, generator=gm, dtype=dt) for _ in range(a.layers)]

        def run(variant: str) -> list[torch.Tensor]:
            tp = tps[variant]
            outs = []
            for i in range(a.layers):
                y = tp.all_reduce(lat[i].clone())
                y = rms_norm(y, norm_w, 1e-5)
                w = w_slice[i] if variant == "reduce_scatter" else w_up[i]
                outs.append(latent_tail(tp, y, shr[i].clone(), w, linear))
            return outs

        # oracle: the same sums gathered to every rank, computed on one GPU
        full_lat = [torch.empty(size * M, L, device=dev, dtype=dt) for _ in range(a.layers)]
        full_shr = [torch.empty(size * M, H, device=dev, dtype=dt) for _ in range(a.layers)]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13 renamed it
        for i in range(a.layers):
            gather(full_lat[i], lat[i])
            gather(full_shr[i], shr[i])
        full_lat = [t.view(size, M, L) for t in full_lat]
        full_shr = [t.view(size, M, H) for t in full_shr]
        want = [linear(rms_norm(full_lat[i].float().sum(0).to(dt), norm_w, 1e-5), w_up[i])
                + full_shr[i].float().sum(0).to(dt) for i in range(a.layers)]
        row = {"M": M}
        for variant in ("all_reduce", "reduce_scatter"):
            got = run(variant)
            err = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(got, want))
            row[f"{variant}_rel_err"] = err
            if a.smoke:  # no CUDA graphs or events: correctness only, and a wall time
                import time
                t0 = time.perf_counter()
                run(variant)
                row[f"{variant}_us"] = (time.perf_counter() - t0) * 1e6 / a.layers
                continue
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    run(variant)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(variant)
            ts = []
            for _ in range(a.reps + 5):
                dist.barrier()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3 / a.layers)
            t = torch.tensor(ts[5:], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a layer is as slow as its slowest rank
            row[f"{variant}_us"] = statistics.median(t.tolist())
        row["ratio"] = row["reduce_scatter_us"] / row["all_reduce_us"]
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
