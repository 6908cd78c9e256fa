#!/usr/bin/env python3
"""Decode-row projections: k3rt's skinny GEMV (`kernels/linear`) against torch's matmul (cuBLAS) and
the bandwidth floor, at Kimi-Linear-48B's projection shapes.

GPU mode (default), one H200-class GPU: for each weight shape (N, K) and rows M in --rows,
  torch F.linear (bf16; the router: F.linear(x.float(), W_fp32), its cast included) and every tile
  candidate of `skinny_linear`, each checked against the fp32 oracle and timed as one call replayed
  from a CUDA graph over rotated weights (each call reads cold memory); bytes = the weight once +
  x + y; GB/s as a fraction of the measured copy bandwidth (bytes read + written of a 1 GiB copy).
A table goes to stdout, all numbers to JSON ($OUT/kernels_linear.json, or --out).

--smoke: a tiny CPU run under the Triton interpreter (no meaningful times) so CI notices rot.
"""
from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_bench_args  # noqa: E402


def _add_args(p) -> None:
    p.add_argument("--rows", type=int, nargs="*", default=[1, 4], help="decode rows M (<= MAX_ROWS, 16)")
    p.add_argument("--shapes", nargs="*", default=None, help="only these shapes (names as in the table)")
    p.add_argument("--model", choices=["kimi-linear-48b", "k3-tiny"], default="kimi-linear-48b",
                   help="whose projection shapes: the 48B's, or k3-tiny's (a verify step's 8 or 16 rows there: "
                        "launch-bound GEMMs)")


ARGS = kernel_bench_args(__doc__, "kernels_linear.json", 120.0, _add_args)

from _timing import Report, copy_bandwidth, default_out, graph_time, import_k3rt_kernels, l2_rotation, rel_err  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.linear import skinny_linear, skinny_linear_ref  # noqa: E402
from k3rt.kernels.linear.triton_gemv import CANDIDATES, pick_tiles  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
DT = torch.float32 if ARGS.smoke else torch.bfloat16
# (name, N, K, weight dtype): Kimi-Linear-48B, TP 1
SHAPES = [("tiny", 24, 40, DT), ("tiny_router", 8, 40, torch.float32)] if ARGS.smoke else [
    ("kda_in", 12576, 2304, DT), ("attn_o", 2304, 4096, DT), ("mla_in", 6720, 2304, DT),
    ("kda_gate_b", 4096, 128, DT), ("kda_gate_f_b_blockdiag", 8192, 256, DT), ("router_fp32", 256, 2304, torch.float32), ("dense_gate_up", 18432, 2304, DT),
    ("dense_down", 2304, 9216, DT), ("lm_head", 163840, 2304, DT),
] if ARGS.model == "kimi-linear-48b" else [  # k3-tiny, its fused projections as the GPU runner holds them
    ("kda_in", 1104, 384, DT), ("kda_f_b", 256, 64, DT), ("attn_o", 384, 256, DT), ("mla_in", 544, 384, DT),
    ("mla_q_b", 384, 128, DT), ("router_fp32", 8, 384, torch.float32), ("latent_down", 128, 384, DT),
    ("shared_gate_up", 384, 384, DT), ("shared_down", 384, 192, DT), ("latent_up", 384, 128, DT),
    ("dense_gate_up", 1024, 384, DT), ("dense_down", 384, 512, DT), ("lm_head", 8192, 384, DT),
]
REPS = 2 if ARGS.smoke else 30
REPORT = Report(default_out(ARGS.out, "kernels_linear.json"), ARGS.budget_s, {"mode": "smoke" if ARGS.smoke else "gpu"},
                log_records=True)
RESULT, item, log, save = REPORT.result, REPORT.item, REPORT.log, REPORT.save


def measure(name: str, N: int, K: int, wdt: torch.dtype, M: int) -> dict:
    out_dt = torch.float32 if wdt == torch.float32 else DT
    nbytes = N * K * wdt.itemsize + M * K * DT.itemsize + M * N * out_dt.itemsize
    sets = [((torch.randn(M, K, device=DEV)).to(DT), (torch.randn(N, K, device=DEV) * 0.02).to(wdt))
            for _ in range(l2_rotation(nbytes))]
    x0, w0 = sets[0]
    ref = skinny_linear_ref(x0, w0, torch.float32)
    tol = 1e-5 if out_dt == torch.float32 else 8e-3

    def torch_call(x, w):
        return F.linear(x.float(), w) if wdt == torch.float32 else F.linear(x, w)

    copy = RESULT["copy"]["GBps"]
    rec: dict = {"bytes": nbytes, "floor_us": nbytes / (copy * 1e9) * 1e6}
    t = graph_time([lambda s=s: torch_call(*s) for s in sets], reps=REPS)
    rec["torch_us"] = t["us_per_call"]
    best = None
    for i, tiles in enumerate(CANDIDATES if not ARGS.smoke else CANDIDATES[:1]):
        err = rel_err(skinny_linear(x0, w0, out_dtype=out_dt, tiles=tiles), ref)
        if not err <= tol:
            rec[f"cand{i}_err"] = err
            continue
        k = graph_time([lambda s=s, tl=tiles: skinny_linear(*s, out_dtype=out_dt, tiles=tl) for s in sets], reps=REPS)
        rec[f"cand{i}_us"] = k["us_per_call"]
        if best is None or k["us_per_call"] < rec[f"cand{best}_us"]:
            best = i
    d = CANDIDATES.index(pick_tiles(N, K)) if pick_tiles(N, K) in CANDIDATES else None
    rec["default"] = d
    if d is not None and f"cand{d}_us" in rec:
        rec["default_us"] = rec[f"cand{d}_us"]
        rec["default_frac_of_copy"] = rec["floor_us"] / rec["default_us"]
    if best is not None:
        rec["best"], rec["best_us"] = best, rec[f"cand{best}_us"]
        rec["best_frac_of_copy"] = rec["floor_us"] / rec["best_us"]
        rec["torch_frac_of_copy"] = rec["floor_us"] / rec["torch_us"]
        rec["speedup_vs_torch"] = rec["torch_us"] / rec["best_us"]
    return rec


def main() -> None:
    RESULT["copy"] = copy_bandwidth()
    RESULT["candidates"] = [t.__dict__ for t in CANDIDATES]
    log(f"copy {RESULT['copy']['GBps']:.0f} GB/s")
    for name, N, K, wdt in SHAPES:
        if ARGS.shapes and name not in ARGS.shapes:
            continue
        for M in ARGS.rows:
            item("gemv", f"{name} N={N} K={K} M={M}", lambda: measure(name, N, K, wdt, M))
    save()
    print("\n| shape | M | floor us | torch us | default us | best (cand) us | best % copy | torch % copy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in RESULT.get("gemv", []):
        if "best_us" in r:
            print(f"| {r['name'].rsplit(' M=', 1)[0]} | {r['name'].rsplit('M=', 1)[1]} | {r['floor_us']:.2f} | "
                  f"{r['torch_us']:.2f} | {r.get('default_us', float('nan')):.2f} | {r['best_us']:.2f} ({r['best']}) | "
                  f"{100 * r['best_frac_of_copy']:.0f} | {100 * r['torch_frac_of_copy']:.0f} |")
        else:
            print(f"| {r['name']} | | {r.get('error') or r.get('skipped') or r} |")


if __name__ == "__main__":
    main()
