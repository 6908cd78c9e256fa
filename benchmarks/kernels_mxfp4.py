#!/usr/bin/env python3
"""MXFP4 routed experts at decode sizes: the Triton grouped GEMMs that dequantize in registers
(kernels/moe/triton_mxfp4.py: dot_scaled, dequant; kernels/moe/triton_mxfp4_planar.py on the planar layout:
planar-mma, planar-mma_ws, planar-fma) against the copy bandwidth, and against the bf16 kernel on the same shape.

GPU mode (default), one H200-class GPU, Kimi-K3's expert shape (latent width D=3584, expert intermediate
I=3072, top-16; E=256 experts here: the bandwidth only sees the selected ones):
  1. device-to-device copy bandwidth (bytes read + written): the physical limit;
  2. correctness: every variant x tile config vs the reference on the dequantized weights at T=16 (and each
     variant's default at T=64); a config that fails is not timed;
  3. decode with M = 1, 2, 4, 8, 16 rows per selected expert (M tokens all routed to the same 16 experts,
     the issue's "M tokens per expert group"), and a random routing at T = 1, 16, 64: time replayed from a
     CUDA graph, routings rotated so each call reads cold weights; bytes actually read = the selected
     experts' packed weights + scales (the planar layout reads the same bytes); the goal is >= 70% of copy
     bandwidth on those bytes. First pass: each variant's default tiles at every routing; second pass: the
     other tile candidates (what the budget leaves). "fma" only where a selected expert has <= 4 rows;
  4. the bf16 kernel (fused_experts) at the grouped routings: time and the ratio (MXFP4 reads ~0.27x the bytes).
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
from k3rt.kernels.moe.triton_mxfp4 import MXFP4_DECODE_CANDIDATES, fused_experts_mxfp4  # noqa: E402
from k3rt.kernels.moe.triton_mxfp4_planar import (  # noqa: E402
    PLANAR_CANDIDATES, PLANAR_INTERPRET_TILES, PlanarMxfp4, fused_experts_mxfp4_planar,
)
from k3rt.model_config import ActivationConfig  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
SHAPE = dict(E=8, k=2, D=256, I=256) if ARGS.smoke else dict(E=256, k=16, D=3584, I=3072)
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


def configs() -> list[tuple[str, object, bool]]:
    """(variant, tiles, default) for every config timed: dot_scaled's default and its best configs of the
    2026-12-01 run (the other seven were within 10%), the explicit dequant's default, every planar candidate."""
    if ARGS.smoke:
        out = [("dequant", MXFP4_DECODE_CANDIDATES[0], True)]
        return out + [(f"planar-{v}", c[0], True) for v, c in PLANAR_INTERPRET_TILES.items()]
    out = [("dot_scaled", MXFP4_DECODE_CANDIDATES[i], i == 0) for i in (0, 1, 3)]
    out.append(("dequant", MXFP4_DECODE_CANDIDATES[0], True))
    for v, cands in PLANAR_CANDIDATES.items():
        out += [(f"planar-{v}", t, i == 0) for i, t in enumerate(cands)]
    return out


def run_config(variant: str, tiles, w: dict, wp: PlanarMxfp4, x, tw, ids, out=None):
    if variant.startswith("planar-"):
        return fused_experts_mxfp4_planar(x, wp, tw, ids, act=ACT, out=out, tiles=tiles,
                                          variant=variant.removeprefix("planar-"))
    return fused_experts_mxfp4(x, **w, topk_weights=tw, topk_ids=ids, act=ACT, out=out, tiles=tiles,
                               native=variant == "dot_scaled")


def label_of(variant: str, tiles) -> str:
    return f"{variant} {'/'.join(str(v) for v in tiles.__dict__.values())}"


def correctness(w: dict, wp: PlanarMxfp4, defaults: bool) -> set[str]:
    """The default configs (defaults=True; at T=16 and T=64) or the other candidates (at T=16) vs the
    reference; returns the labels that pass."""
    tol = 1e-4 if ARGS.smoke else 1e-2
    ok: set[str] = set()
    failed: set[str] = set()
    for T in ([3] if ARGS.smoke else [16, 64]):
        tw, ids = random_routing(T, seed=T)
        # the reference dequantizes every expert: keep it to the experts the routing uses
        used = torch.unique(ids)
        remap = torch.full((SHAPE["E"],), -1, dtype=torch.int32, device=DEV)
        remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=DEV)
        sub = {k: v[used].contiguous() for k, v in w.items()}
        x = torch.randn(T, SHAPE["D"], device=DEV).to(ADTYPE)
        ref = fused_experts_mxfp4_ref(x, **sub, topk_weights=tw, topk_ids=remap[ids.long()].contiguous(), act=ACT)
        for variant, tiles, default in configs():
            if default != defaults or (T == 64 and not default):
                continue
            name = label_of(variant, tiles)

            def check(variant=variant, tiles=tiles) -> dict:
                err = rel_err(run_config(variant, tiles, w, wp, x, tw, ids), ref)
                return {"T": T, "rel_err": err, "ok": err <= tol}
            rec = item("correctness", f"{name} T={T}", check)
            (ok if rec.get("ok") else failed).add(name)
    bad = sorted(failed)
    log(f"correctness ({'defaults' if defaults else 'other candidates'}): {len(ok - failed)} configs pass"
        + (f", FAILED: {bad}" if bad else ""))
    return ok - failed


def decode_base(label: str, sets: list, bw_GBps: float, per_expert: int) -> dict:
    T = sets[0][1].shape[0]
    unique = sum(int(torch.unique(ids).numel()) for _, ids in sets) / len(sets)
    read = unique * per_expert
    return {"routing": label, "T": T, "unique_experts": unique, "bytes_read": read,
            "floor_us": read / (bw_GBps * 1e9) * 1e6, "rotation": len(sets)}


def time_config(label: str, sets: list, base: dict, variant: str, tiles, default: bool, w: dict,
                wp: PlanarMxfp4) -> None:
    T = base["T"]
    x = torch.randn(T, SHAPE["D"], device=DEV).to(ADTYPE)
    out = torch.empty_like(x)

    def run() -> dict:
        calls = [lambda tw=tw, ids=ids: run_config(variant, tiles, w, wp, x, tw, ids, out) for tw, ids in sets]
        us = graph_time(calls, reps=REPS)["us_per_call"]
        return {**base, "variant": variant, "tiles": tiles.__dict__, "default": default, "us": us,
                "pct_of_copy_bw": 100 * base["floor_us"] / us}
    item("decode", f"{label} {label_of(variant, tiles)}", run)


def time_bf16(label: str, sets: list, base: dict, w_bf16: dict) -> None:
    x = torch.randn(base["T"], SHAPE["D"], device=DEV).to(ADTYPE)
    out = torch.empty_like(x)

    def bf16() -> dict:
        calls = [lambda tw=tw, ids=ids: fused_experts(x, w_bf16["w13"], w_bf16["w2"], tw, ids, act=ACT, out=out,
                                                      tiles=DECODE_TILES) for tw, ids in sets]
        return {**base, "us": graph_time(calls, reps=REPS)["us_per_call"]}
    item("decode", f"{label} bf16", bf16)


def table() -> None:
    """One row per routing: the best config overall, the best of each variant, bf16."""
    recs = RESULT.get("decode", [])
    variants = list(dict.fromkeys(r["variant"] for r in recs if "variant" in r and "us" in r))
    print("\n| routing | rows/expert | MB read | floor us | best us | % of copy bw | best config | "
          + " | ".join(f"{v} best us (%)" for v in variants) + " | bf16 us | best vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|---|" + "---:|" * len(variants) + "---:|---:|")
    for label in dict.fromkeys(r.get("routing") for r in recs if "routing" in r):
        mx = [r for r in recs if r.get("routing") == label and "variant" in r and "us" in r]
        bf = [r for r in recs if r.get("routing") == label and "variant" not in r and "us" in r]
        if not mx:
            continue
        b = min(mx, key=lambda r: r["us"])
        rows = b["T"] * SHAPE["k"] / b["unique_experts"]
        per = []
        for v in variants:
            vs = [r for r in mx if r["variant"] == v]
            bv = min(vs, key=lambda r: r["us"]) if vs else None
            per.append(f"{bv['us']:.1f} ({bv['pct_of_copy_bw']:.0f})" if bv else "")
        bf_us = bf[0]["us"] if bf else float("nan")
        print(f"| {label} | {rows:.1f} | {b['bytes_read'] / 1e6:.0f} | {b['floor_us']:.1f} | {b['us']:.1f} | "
              f"{b['pct_of_copy_bw']:.0f} | {b['name'].removeprefix(label + ' ')} | " + " | ".join(per)
              + f" | {bf_us:.1f} | {bf_us / b['us']:.2f}x |")


def main() -> None:
    if not ARGS.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke for the CPU interpreter run")
    RESULT["device"] = "cpu (interpreter)" if ARGS.smoke else torch.cuda.get_device_name()
    RESULT["copy"] = copy_bandwidth()
    bw = RESULT["copy"]["GBps"]
    log(f"copy {bw:.0f} GB/s")
    w = mx_weights()
    wp = PlanarMxfp4.from_packed(**w)  # the load-time repack
    per_expert = expert_bytes(w)
    RESULT["bytes_per_expert"] = per_expert
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
    routings = [(f"grouped M={M}", [grouped_routing(M, seed=100 * M + r, experts=nb) for r in range(rot)], True)
                for M in ([1] if ARGS.smoke else ARGS.rows)]
    routings += [(f"random T={T}", [random_routing(T, seed=1000 * T + r) for r in range(rot)], False)
                 for T in ([3] if ARGS.smoke else ARGS.random_t)]
    bases = {label: decode_base(label, sets, bw, per_expert) for label, sets, _ in routings}
    for first_pass in (True, False):  # every variant's default tiles first, then the other candidates
        passing = correctness(w, wp, defaults=first_pass)  # compiles them too
        for label, sets, grouped in routings:
            base = bases[label]
            for variant, tiles, default in configs():
                rows = base["T"] * SHAPE["k"] / base["unique_experts"]
                if default != first_pass or label_of(variant, tiles) not in passing:
                    continue
                if variant == "planar-fma" and rows > 4.5 and not ARGS.smoke:
                    continue
                time_config(label, sets, base, variant, tiles, default, w, wp)
            if first_pass and grouped:
                time_bf16(label, sets, base, w_bf16)
        if first_pass:
            table()
    RESULT["wall_s"] = REPORT.elapsed()
    save()
    table()
    log(f"wrote {REPORT.path}")


if __name__ == "__main__":
    main()
