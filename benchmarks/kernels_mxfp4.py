#!/usr/bin/env python3
"""MXFP4 routed experts at decode sizes: the Triton grouped GEMM that dequantizes in registers
(kernels/moe/triton_mxfp4.py) against the copy bandwidth, and against the bf16 kernel on the same shape.

GPU mode (default), one H200-class GPU, Kimi-K3's expert shape (latent width D=3584, expert intermediate
I=3072, top-16; E=256 experts here: the bandwidth only sees the selected ones):
  1. device-to-device copy bandwidth (bytes read + written): the physical limit;
  2. correctness: fused_experts_mxfp4 vs the reference on the dequantized weights at T=16 and T=64;
  3. decode with M = 1, 2, 4, 8, 16 rows per selected expert (M tokens all routed to the same 16 experts,
     the issue's "M tokens per expert group"), and a random routing at T = 1, 16, 64: time replayed from a
     CUDA graph, routings rotated so each call reads cold weights; bytes actually read = the selected
     experts' packed weights + scales; the goal is >= 70% of copy bandwidth on those bytes. Every decode
     tile candidate is timed; the best and the default are reported;
  4. the bf16 kernel (fused_experts) at the same routings: time and the ratio (MXFP4 reads ~0.27x the bytes).
Times are medians of CUDA-event-timed graph replays. A table goes to stdout, all numbers to JSON
($OUT/kernels_mxfp4.json, or --out).

--smoke: a tiny CPU run under the Triton interpreter (no meaningful times) so CI notices rot.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_bench_args  # noqa: E402

def _add_args(p) -> None:
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16], help="rows per expert (grouped routings)")
    p.add_argument("--random-t", type=int, nargs="*", default=[1, 16, 64], help="tokens (random routings)")


ARGS = kernel_bench_args(__doc__, "kernels_mxfp4.json", 240.0, _add_args)

from _timing import Report, copy_bandwidth, default_out, graph_time, import_k3rt_kernels, l2_rotation, rel_err  # noqa: E402

import torch  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.moe import fused_experts  # noqa: E402
from k3rt.kernels.moe.mxfp4_ref import GROUP, dequantize_mxfp4, fused_experts_mxfp4_ref  # noqa: E402
from k3rt.kernels.moe.triton_experts import DECODE_TILES  # noqa: E402
from k3rt.kernels.moe.triton_mxfp4 import MXFP4_DECODE_CANDIDATES, fused_experts_mxfp4, mxfp4_tiles  # noqa: E402
from k3rt.model_config import ActivationConfig  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
SHAPE = dict(E=8, k=2, D=64, I=32) if ARGS.smoke else dict(E=256, k=16, D=3584, I=3072)
ACT = ActivationConfig("situ", 4.0, 25.0)
REPS = 2 if ARGS.smoke else 30
REPORT = Report(default_out(ARGS.out, "kernels_mxfp4.json"), ARGS.budget_s,
                {"mode": "smoke" if ARGS.smoke else "gpu", "shape": SHAPE})
RESULT, item, log, save = REPORT.result, REPORT.item, REPORT.log, REPORT.save
ADTYPE = torch.float32 if ARGS.smoke else torch.bfloat16


def mx_weights() -> dict:
    """Random packed codes and scales near 2^-6 (the size of a ~1/sqrt(D) weight), drawn on the device:
    the speed does not depend on the values, and quantizing 22 GB of fp32 would not fit the call."""
    E, D, inter = SHAPE["E"], SHAPE["D"], SHAPE["I"]
    g = torch.Generator(device=DEV).manual_seed(0)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV, generator=g)

    def scales(*shape):
        return torch.randint(118, 123, shape, dtype=torch.uint8, device=DEV, generator=g)
    return dict(w13_packed=codes(E, 2 * inter, D // 2), w13_scale=scales(E, 2 * inter, D // GROUP),
                w2_packed=codes(E, D, inter // 2), w2_scale=scales(E, D, inter // GROUP))


def expert_bytes(w: dict) -> int:
    return sum(t[0].numel() * t.element_size() for t in w.values())


def grouped_routing(M: int, seed: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """M tokens, all routed to the same k experts (a random set of the first `experts`): every selected
    expert gets M rows."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randperm(experts, device=DEV, generator=g)[:SHAPE["k"]].int().expand(M, -1).contiguous()
    return torch.rand(M, SHAPE["k"], device=DEV, generator=g), ids


def random_routing(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.stack([torch.randperm(SHAPE["E"], device=DEV, generator=g)[:SHAPE["k"]] for _ in range(T)]).int()
    return torch.rand(T, SHAPE["k"], device=DEV, generator=g), ids


def correctness(w: dict) -> None:
    tol = 1e-4 if ARGS.smoke else 1e-2
    for T in ([3] if ARGS.smoke else [16, 64]):
        tw, ids = random_routing(T, seed=T)
        # the reference dequantizes every expert: keep it to the experts the routing uses
        used = torch.unique(ids)
        remap = torch.full((SHAPE["E"],), -1, dtype=torch.int32, device=DEV)
        remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=DEV)
        sub = {k: v[used].contiguous() for k, v in w.items()}
        x = torch.randn(T, SHAPE["D"], device=DEV).to(ADTYPE)
        out = fused_experts_mxfp4(x, **w, topk_weights=tw, topk_ids=ids, act=ACT)
        ref = fused_experts_mxfp4_ref(x, **sub, topk_weights=tw, topk_ids=remap[ids.long()].contiguous(), act=ACT)
        err = rel_err(out, ref)
        RESULT.setdefault("correctness", []).append({"name": f"fused_experts_mxfp4 T={T}", "rel_err": err, "ok": err <= tol})
    log(f"correctness: {RESULT['correctness']}")
    save()


def decode(label: str, sets: list, w: dict, w_bf16: dict | None, bw_GBps: float, per_expert: int) -> None:
    T = sets[0][1].shape[0]
    x = torch.randn(T, SHAPE["D"], device=DEV).to(ADTYPE)
    out = torch.empty_like(x)
    unique = sum(int(torch.unique(ids).numel()) for _, ids in sets) / len(sets)
    read = unique * per_expert
    floor_us = read / (bw_GBps * 1e9) * 1e6
    base = {"routing": label, "T": T, "unique_experts": unique, "bytes_read": read, "floor_us": floor_us,
            "rotation": len(sets)}
    default = mxfp4_tiles(T * SHAPE["k"], SHAPE["E"])
    best = None
    # tl.dot_scaled (the default) and the explicit in-register dequant, over the decode tile candidates
    # the explicit dequant measured slower everywhere (RESULTS.md): only its default tiles are timed
    for native in ([False] if ARGS.smoke else [True, False]):
        for i, tiles in enumerate(MXFP4_DECODE_CANDIDATES if native else MXFP4_DECODE_CANDIDATES[:1]):
            def run(tiles=tiles, native=native) -> dict:
                calls = [lambda tw=tw, ids=ids: fused_experts_mxfp4(x, **w, topk_weights=tw, topk_ids=ids, act=ACT,
                                                                    out=out, tiles=tiles, native=native)
                         for tw, ids in sets]
                us = graph_time(calls, reps=REPS)["us_per_call"]
                return {**base, "tiles": tiles.__dict__, "native": native, "default": tiles == default and native,
                        "us": us, "pct_of_copy_bw": 100 * floor_us / us}
            rec = item("decode", f"{label} mxfp4 {'dot_scaled' if native else 'dequant'} tiles{i}", run)
            if "us" in rec and (best is None or rec["us"] < best["us"]):
                best = rec
    if best is not None:
        log(f"decode {label}: best {best['us']:.1f} us = {best['pct_of_copy_bw']:.0f}% of copy bandwidth "
            f"on {read / 1e6:.0f} MB (floor {floor_us:.1f} us), {best['name']}")
    if w_bf16 is not None:
        def bf16() -> dict:
            calls = [lambda tw=tw, ids=ids: fused_experts(x, w_bf16["w13"], w_bf16["w2"], tw, ids, act=ACT, out=out,
                                                          tiles=DECODE_TILES) for tw, ids in sets]
            us = graph_time(calls, reps=REPS)["us_per_call"]
            return {**base, "us": us, "mxfp4_speedup": (us / best["us"]) if best else None}
        rec = item("decode", f"{label} bf16", bf16)
        if "us" in rec:
            log(f"decode {label}: bf16 {rec['us']:.1f} us, mxfp4 speed-up {rec['mxfp4_speedup']:.2f}x")


def table() -> None:
    print("\n| routing | rows/expert | MB read | floor us | MXFP4 best us | % of copy bw | best variant | default us "
          "| explicit-dequant best us | bf16 us | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    recs = RESULT.get("decode", [])
    for label in dict.fromkeys(r.get("routing") for r in recs if "routing" in r):
        mx = [r for r in recs if r.get("routing") == label and "tiles" in r and "us" in r]
        bf = [r for r in recs if r.get("routing") == label and "tiles" not in r and "us" in r]
        if not mx:
            continue
        b = min(mx, key=lambda r: r["us"])
        d = next((r for r in mx if r["default"]), None)
        ex = [r["us"] for r in mx if not r["native"]]
        rows = b["T"] * SHAPE["k"] / b["unique_experts"]
        print(f"| {label} | {rows:.1f} | {b['bytes_read'] / 1e6:.0f} | {b['floor_us']:.1f} | {b['us']:.1f} | "
              f"{b['pct_of_copy_bw']:.0f} | {b['name'].split(' mxfp4 ')[-1]} | {d['us'] if d else float('nan'):.1f} | "
              f"{min(ex) if ex else float('nan'):.1f} | "
              f"{bf[0]['us'] if bf else float('nan'):.1f} | {bf[0]['mxfp4_speedup'] if bf else float('nan'):.2f} |")


def main() -> None:
    if not ARGS.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke for the CPU interpreter run")
    RESULT["device"] = "cpu (interpreter)" if ARGS.smoke else torch.cuda.get_device_name()
    RESULT["copy"] = copy_bandwidth()
    bw = RESULT["copy"]["GBps"]
    log(f"copy {bw:.0f} GB/s")
    w = mx_weights()
    per_expert = expert_bytes(w)
    RESULT["bytes_per_expert"] = per_expert
    correctness(w)
    E, D, inter = SHAPE["E"], SHAPE["D"], SHAPE["I"]
    # bf16 weights for the side-by-side: the same values (dequantized, one expert at a time), for the first
    # 64 experts, which the grouped routings draw from
    nb = min(E, 64)
    w_bf16 = {"w13": torch.empty(nb, 2 * inter, D, dtype=ADTYPE, device=DEV),
              "w2": torch.empty(nb, D, inter, dtype=ADTYPE, device=DEV)}
    for e in range(nb):
        w_bf16["w13"][e] = dequantize_mxfp4(w["w13_packed"][e], w["w13_scale"][e], ADTYPE)
        w_bf16["w2"][e] = dequantize_mxfp4(w["w2_packed"][e], w["w2_scale"][e], ADTYPE)
    rot = l2_rotation(SHAPE["k"] * per_expert)
    for M in ([1, 2] if ARGS.smoke else ARGS.rows):
        sets = [grouped_routing(M, seed=100 * M + r, experts=nb) for r in range(rot)]
        decode(f"grouped M={M}", sets, w, w_bf16, bw, per_expert)
    for T in ([3] if ARGS.smoke else ARGS.random_t):
        sets = [random_routing(T, seed=1000 * T + r) for r in range(rot)]
        decode(f"random T={T}", sets, w, None, bw, per_expert)
    RESULT["wall_s"] = REPORT.elapsed()
    save()
    table()
    log(f"wrote {REPORT.path}")


if __name__ == "__main__":
    main()
