#!/usr/bin/env python3
"""Correctness check and timing of the Triton MoE kernels (router top-k, fused routed experts).

GPU mode (default), one H200-class GPU, Kimi-Linear-48B shape (E=256, top-8, D=2304, I=1024, bf16):
  1. device-to-device copy bandwidth (bytes read + written) and a big bf16 torch.matmul (the peaks);
  2. correctness at T=64: moe_route vs route_ref, fused_experts vs fused_experts_ref;
  3. decode T in {1, 16, 64}: fused_experts replayed from a CUDA graph, the routing rotated over
     enough id sets that each call reads mostly cold experts; against the floor (distinct selected
     experts x 3*D*I*2 bytes / copy bandwidth) and against the torch loop over experts (the model's
     MoE.experts path, eager: it syncs on the host); the alignment step alone; a few decode tile
     configs (the default first);
  4. prefill T in {4096, 16384}: TFLOP/s (6*T*k*D*I flops) vs the matmul peak, for the default and
     two other tile configs, the CUTLASS grouped GEMMs (kernels/moe/grouped.py, sm90+), and the torch loop;
  5. moe_route alone at T in {1, 64, 4096}, 1/2/4/8 warps (--route-only: just this, first);
  6. one token's whole layer (--layer; --layer-only: just this): the runner's five launches (the fp32 router's skinny
     GEMV, moe_route, fused_experts with one shared expert and the residual add + norm in its sum) against
     kernels/moe/triton_layer.py's one persistent launch at each LayerTiles candidate, and its phased form (three
     launches), from CUDA graphs over layers rotated past the L2; floor = (E x D fp32 router + 9 experts) / copy.
Times are medians of CUDA-event-timed repetitions after warm-up. A table goes to stdout, all numbers
to JSON ($OUT/kernels_moe.json, or --out). Items past --budget-s are skipped and say so.

--smoke: a tiny CPU run under the Triton interpreter (no meaningful times) so CI notices rot.
"""
from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_bench_args  # noqa: E402


def _add_args(p) -> None:
    p.add_argument("--decode-t", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--prefill-t", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--route-only", action="store_true", help="time moe_route only (its warp counts), then stop")
    p.add_argument("--layer", action="store_true", help="also time one token's whole layer (item 6)")
    p.add_argument("--layer-only", action="store_true", help="time one token's whole layer only (item 6), then stop")


ARGS = kernel_bench_args(__doc__, "kernels_moe.json", 150.0, _add_args)

from _timing import (  # noqa: E402
    Report, copy_bandwidth, default_out, floor_timed, graph_time, import_k3rt_kernels, l2_rotation, persistent_forms,
    rel_err, time_ms,
)

import torch  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.linear import skinny_linear  # noqa: E402
from k3rt.kernels.moe import (  # noqa: E402
    SumNorm, fused_experts, fused_experts_grouped, grouped_mm_available, moe_align_fwd, moe_layer_one_token, moe_route,
)
from k3rt.kernels.moe import triton_layer  # noqa: E402
from k3rt.kernels.moe.ref import act_and_mul_ref, fused_experts_ref, moe_layer_ref, route_ref  # noqa: E402
from k3rt.kernels.moe.triton_experts import (  # noqa: E402
    DECODE_CANDIDATES, PREFILL_CANDIDATES, ExpertTiles, pick_tiles,
)
from k3rt.model_config import ActivationConfig  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
SHAPE = dict(E=8, k=2, D=32, I=16) if ARGS.smoke else dict(E=256, k=8, D=2304, I=1024)
SCALING = 2.446
ACT = ActivationConfig("silu")
REPS = 2 if ARGS.smoke else 20
REPORT = Report(default_out(ARGS.out, "kernels_moe.json"), ARGS.budget_s,
                {"mode": "smoke" if ARGS.smoke else "gpu", "shape": SHAPE})
RESULT, item, log, save = REPORT.result, REPORT.item, REPORT.log, REPORT.save


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, D], w2 [E, D, I] in the activation dtype, drawn in place (no fp32 copy of 3.6 GB)."""
    E, D, inter = SHAPE["E"], SHAPE["D"], SHAPE["I"]
    torch.manual_seed(seed)
    dtype = torch.float32 if ARGS.smoke else torch.bfloat16
    w13 = torch.empty(E, 2 * inter, D, dtype=dtype, device=DEV).normal_(0, D ** -0.5)
    w2 = torch.empty(E, D, inter, dtype=dtype, device=DEV).normal_(0, inter ** -0.5)
    return w13, w2


def routing(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random router logits through moe_route: (weights [T, k] fp32, ids [T, k] int32)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(T, SHAPE["E"], device=DEV, generator=g)
    bias = torch.randn(SHAPE["E"], device=DEV, generator=g) * 0.1
    return moe_route(logits, bias, top_k=SHAPE["k"], renormalize=True, scaling=SCALING)


def torch_loop_experts(x, w13, w2, w, ids) -> torch.Tensor:
    """The model's reference path (backend MoE.experts): a loop over the experts that got tokens."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    idl = ids.long()
    for e in torch.unique(idl).tolist():
        tok, slot = torch.where(idl == e)
        gu = x[tok] @ w13[e].t()
        y = act_and_mul_ref(gu[:, :inter], gu[:, inter:], ACT) @ w2[e].t()
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    return out.to(x.dtype)


def correctness(w13, w2) -> None:
    T = 5 if ARGS.smoke else 64
    x = torch.randn(T, SHAPE["D"], device=DEV).to(w13.dtype)
    g = torch.Generator(device=DEV).manual_seed(7)
    logits = torch.randn(T, SHAPE["E"], device=DEV, generator=g)
    bias = torch.randn(SHAPE["E"], device=DEV, generator=g) * 0.1
    groups = 2 if ARGS.smoke else 8
    kw = dict(top_k=SHAPE["k"], num_expert_group=groups, topk_group=groups // 2, renormalize=True, scaling=SCALING)
    w, ids = moe_route(logits, bias, **kw)
    w_ref, ids_ref = route_ref(logits, bias, **kw)
    err = rel_err(w, w_ref)
    RESULT.setdefault("correctness", []).append(
        {"name": f"moe_route T={T} grouped {groups}/{groups // 2}", "ids_equal": bool(torch.equal(ids, ids_ref)),
         "rel_err": err, "ok": bool(torch.equal(ids, ids_ref)) and err <= 1e-5})
    tol = 1e-4 if ARGS.smoke else 1e-2
    for act in (ACT, ActivationConfig("situ", 4.0, 25.0)):
        out = fused_experts(x, w13, w2, w, ids, act=act)
        err = rel_err(out, fused_experts_ref(x, w13, w2, w, ids, act=act))
        RESULT["correctness"].append({"name": f"fused_experts T={T} {act.name}", "rel_err": err, "ok": err <= tol})
    log(f"correctness: {RESULT['correctness']}")
    save()


# the GEMV form's (ROWS_1, ROWS_2, WARPS_1, WARPS_2) at T = 1, its default first
GEMV_ROWS = ((4, 8, 4, 4), (2, 4, 2, 2), (4, 4, 4, 4), (8, 8, 4, 4), (2, 8, 2, 4), (8, 16, 8, 8))


def decode(T: int, w13, w2, bw_GBps: float) -> None:
    D, inter = SHAPE["D"], SHAPE["I"]
    expert_bytes = 3 * D * inter * w13.element_size()
    rot = l2_rotation(SHAPE["k"] * expert_bytes)
    sets = [routing(T, seed=1000 * T + r) for r in range(rot)]
    x = torch.randn(T, D, device=DEV).to(w13.dtype)
    out = torch.empty_like(x)
    unique = sum(int(torch.unique(ids).numel()) for _, ids in sets) / rot
    floor_us = unique * expert_bytes / (bw_GBps * 1e9) * 1e6
    base = {"T": T, "unique_experts": unique, "weight_bytes": unique * expert_bytes, "floor_us": floor_us,
            "rotation": rot}

    def ours(tiles: ExpertTiles):
        def run() -> dict:
            calls = [lambda w=w, ids=ids: fused_experts(x, w13, w2, w, ids, act=ACT, out=out, tiles=tiles)
                     for w, ids in sets]
            t = graph_time(calls, reps=REPS)
            return {**base, "tiles": tiles.__dict__, "us": t["us_per_call"], "pct_of_floor": 100 * floor_us / t["us_per_call"]}
        return run

    for i, tiles in enumerate(DECODE_CANDIDATES if not ARGS.smoke else DECODE_CANDIDATES[:1]):
        rec = item("decode", f"T={T} tiles{i}" + (" (default)" if tiles == pick_tiles(T * SHAPE['k'], SHAPE['E']) else ""),
                   ours(tiles))
        if "us" in rec:
            log(f"decode T={T} tiles{i}: {rec['us']:.1f} us, floor {floor_us:.1f} us ({rec['pct_of_floor']:.0f}%)")
    if T == 1:  # session 45: the experts as GEMVs of a few rows a program (fused_experts(gemv=True)), checked first
        from k3rt.kernels.moe.triton_experts import sum_slots
        from k3rt.kernels.moe.triton_gemv_experts import gemv_expert_outputs

        def gemv(rows: tuple, w, ids) -> torch.Tensor:
            y = gemv_expert_outputs(x, w13, w2, w, ids, situ=ACT.name == "situ", beta=ACT.situ_beta or 1.0,
                                    lin_beta=ACT.situ_linear_beta, shared_experts=0, use_pdl=False, rows=rows)
            return sum_slots(y, out, SHAPE["k"], 0, False)

        def gemv_item(rows: tuple):
            def run() -> dict:
                w, ids = sets[0]
                err = rel_err(gemv(rows, w, ids).clone(), fused_experts(x, w13, w2, w, ids, act=ACT))
                t = graph_time([lambda w=w, ids=ids: gemv(rows, w, ids) for w, ids in sets], reps=REPS)
                return {**base, "gemv_rows": rows, "rel_err_vs_grouped": err, "ok": err < 2e-2,
                        "us": t["us_per_call"], "pct_of_floor": 100 * floor_us / t["us_per_call"]}
            return run
        for rows in GEMV_ROWS if not ARGS.smoke else GEMV_ROWS[:1]:
            rec = item("decode", f"T=1 gemv rows {rows}", gemv_item(rows))
            if "us" in rec:
                log(f"decode T=1 gemv {rows}: {rec['us']:.1f} us ({rec['pct_of_floor']:.0f}%), "
                    f"err {rec['rel_err_vs_grouped']:.1e}")
    bm = pick_tiles(T * SHAPE["k"], SHAPE["E"]).block_m
    for split in (True, False):  # the single chunk over several programs (the default) or in one
        item("decode", f"T={T} align only" + ("" if split else " (one program)"), lambda split=split: {
            **base, "us": graph_time([lambda ids=ids: moe_align_fwd(ids, SHAPE["E"], bm, split=split)
                                      for _, ids in sets], reps=REPS)["us_per_call"]})

    def peer() -> dict:
        ts = [time_ms(lambda w=w, ids=ids: torch_loop_experts(x, w13, w2, w, ids), reps=max(2, REPS // 4), warmup=1)
              for w, ids in sets[:2]]
        us = 1e3 * sum(t["median_ms"] for t in ts) / len(ts)
        return {**base, "us": us, "pct_of_floor": 100 * floor_us / us}
    rec = item("decode", f"T={T} torch loop (eager)", peer)
    if "us" in rec:
        log(f"decode T={T} torch loop: {rec['us']:.1f} us")


def prefill(T: int, w13, w2, peak_tflops: float) -> None:
    D, inter, k = SHAPE["D"], SHAPE["I"], SHAPE["k"]
    w, ids = routing(T, seed=T)
    x = torch.randn(T, D, device=DEV).to(w13.dtype)
    out = torch.empty_like(x)
    flops = 6 * T * k * D * inter
    reps = REPS if T <= 4096 else max(2, REPS // 2)

    base = fused_experts(x, w13, w2, w, ids, act=ACT)  # the default tiles: each candidate is checked against it

    def ours(tiles: ExpertTiles | None):
        def run() -> dict:
            err = rel_err(fused_experts(x, w13, w2, w, ids, act=ACT, tiles=tiles), base)
            t = time_ms(lambda: fused_experts(x, w13, w2, w, ids, act=ACT, out=out, tiles=tiles), reps=reps, warmup=2)
            tf = flops / (t["median_ms"] * 1e-3) / 1e12
            used = tiles or pick_tiles(T * k, SHAPE["E"])
            return {"T": T, "tiles": used.__dict__, "ms": t["median_ms"], "TFLOPs": tf,
                    "pct_of_matmul_peak": 100 * tf / peak_tflops, "rel_err_vs_default": err}
        return run

    sweep = [None] + [t for t in PREFILL_CANDIDATES if t != pick_tiles(T * k, SHAPE["E"])]
    for i, tiles in enumerate(sweep if not ARGS.smoke else sweep[:1]):
        rec = item("prefill", f"T={T} " + ("default" if tiles is None else f"tiles{i}"), ours(tiles))
        if "ms" in rec:
            log(f"prefill {rec['name']}: {rec['ms']:.3f} ms, {rec['TFLOPs']:.0f} TFLOP/s "
                f"({rec['pct_of_matmul_peak']:.0f}% of matmul)")

    def grouped() -> dict:
        err = rel_err(fused_experts_grouped(x, w13, w2, w, ids, act=ACT), base)
        t = time_ms(lambda: fused_experts_grouped(x, w13, w2, w, ids, act=ACT, out=out), reps=reps, warmup=2)
        tf = flops / (t["median_ms"] * 1e-3) / 1e12
        return {"T": T, "ms": t["median_ms"], "TFLOPs": tf, "pct_of_matmul_peak": 100 * tf / peak_tflops,
                "rel_err_vs_default": err}
    if ARGS.smoke or grouped_mm_available(x):
        rec = item("prefill", f"T={T} grouped (CUTLASS)", grouped)
        if "ms" in rec:
            log(f"prefill {rec['name']}: {rec['ms']:.3f} ms, {rec['TFLOPs']:.0f} TFLOP/s "
                f"({rec['pct_of_matmul_peak']:.0f}% of matmul), rel err vs default {rec['rel_err_vs_default']:.1e}")

    bm = pick_tiles(T * k, SHAPE["E"]).block_m
    for split in (True, False):  # the offsets over one program per chunk (the default) or in one program
        rec = item("prefill", f"T={T} align only" + ("" if split else " (one offsets program)"), lambda split=split: {
            "T": T, "us": graph_time([lambda: moe_align_fwd(ids, SHAPE["E"], bm, split=split)],
                                     reps=REPS)["us_per_call"]})
        if "us" in rec:
            log(f"prefill {rec['name']}: {rec['us']:.1f} us")

    def peer() -> dict:
        t = time_ms(lambda: torch_loop_experts(x, w13, w2, w, ids), reps=max(2, reps // 4), warmup=1)
        tf = flops / (t["median_ms"] * 1e-3) / 1e12
        return {"T": T, "ms": t["median_ms"], "TFLOPs": tf, "pct_of_matmul_peak": 100 * tf / peak_tflops}
    item("prefill", f"T={T} torch loop", peer)


def route_timing(T: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(T)
    logits = torch.randn(T, SHAPE["E"], device=DEV, generator=g)
    bias = torch.randn(SHAPE["E"], device=DEV, generator=g) * 0.1
    for nw in (1, 2, 4, 8):  # one program per token: fewer warps, cheaper cross-warp argmax reductions
        item("route", f"T={T} warps={nw}", lambda nw=nw: {"T": T, "num_warps": nw, "us": graph_time(
            [lambda: moe_route(logits, bias, top_k=SHAPE["k"], renormalize=True, scaling=SCALING, num_warps=nw)],
            reps=REPS)["us_per_call"]})


def layer(bw_GBps: float) -> None:
    """Item 6: one token's MoE layer, the runner's five launches against the persistent one (module docstring)."""
    E, k, D, inter = SHAPE["E"], SHAPE["k"], SHAPE["D"], SHAPE["I"]
    dtype = torch.float32 if ARGS.smoke else torch.bfloat16
    expert_bytes = 3 * D * inter * torch.finfo(dtype).bits // 8
    layer_bytes = E * D * 4 + (k + 1) * expert_bytes
    rot = l2_rotation(layer_bytes)
    torch.manual_seed(5)
    # layer r: experts r .. r + E of one stack (the last its shared expert), so every layer's shared one differs too
    w13 = torch.empty(E + rot, 2 * inter, D, dtype=dtype, device=DEV).normal_(0, D ** -0.5)
    w2 = torch.empty(E + rot, D, inter, dtype=dtype, device=DEV).normal_(0, inter ** -0.5)
    layers = [dict(x=torch.randn(1, D, device=DEV).to(dtype), gate_weight=torch.randn(E, D, device=DEV) * D ** -0.5,
                   bias=torch.randn(E, device=DEV) * 0.1, w13=w13[r:r + E + 1], w2=w2[r:r + E + 1],
                   residual=torch.randn(1, D, device=DEV).to(dtype)) for r in range(rot)]
    norm_w = (torch.rand(D, device=DEV) + 0.5).to(dtype)
    out, res_out = torch.empty(1, D, dtype=dtype, device=DEV), torch.empty(1, D, dtype=dtype, device=DEV)
    sync = torch.zeros(triton_layer.LAYER_SYNC_WORDS, dtype=torch.int32, device=DEV)
    route_kw = dict(top_k=k, renormalize=True, scaling=SCALING)
    floor_us = layer_bytes / (bw_GBps * 1e9) * 1e6
    base = {"layer_bytes": layer_bytes, "floor_us": floor_us, "rotation": rot}

    def grouped(c: dict) -> None:  # what the runner launches today (ffn.moe_add_norm at T = 1)
        logits = skinny_linear(c["x"], c["gate_weight"], out_dtype=torch.float32)
        tw, ids = moe_route(logits, c["bias"], **route_kw)
        fused_experts(c["x"], c["w13"], c["w2"], tw, ids, act=ACT, shared_experts=1, out=out,
                      norm=SumNorm(norm_w, 1e-5, c["residual"], res_out))

    def persistent(c: dict, tiles=None, phased: bool | None = None) -> None:
        moe_layer_one_token(c["x"], c["gate_weight"], c["bias"], c["w13"], c["w2"], sync, act=ACT, shared_experts=1,
                            norm=SumNorm(norm_w, 1e-5, c["residual"], res_out), out=out, tiles=tiles, phased=phased,
                            **route_kw)

    def check(tiles, phased) -> dict:
        c = layers[0]
        ref, _, ids_ref, res_ref = moe_layer_ref(c["x"], c["gate_weight"], c["bias"], c["w13"], c["w2"], act=ACT,
                                                 shared_experts=1, norm=(norm_w, 1e-5, c["residual"]), **route_kw)
        persistent(c, tiles, phased)
        got, got_res = out.clone(), res_out.clone()
        grouped(c)
        err = max(rel_err(got, ref), rel_err(got_res, res_ref))
        return {"rel_err": err, "rel_err_vs_grouped": rel_err(got, out),
                "ok": err <= (1e-4 if ARGS.smoke else 1e-2) and not bool(sync.any())}

    item("layer", "grouped (5 launches)", lambda: floor_timed(grouped, layers, REPS, base))
    persistent_forms(
        REPORT, "layer", triton_layer.CANDIDATES, triton_layer.DEFAULT_TILES, "phased (3 launches)", check,
        lambda tiles, phased: floor_timed(lambda c: persistent(c, tiles, phased), layers, REPS, base), ARGS.smoke)
    RESULT["layer_stalled"] = int(sync[triton_layer.STALLED.value])


def matmul_peak() -> dict:
    n = 256 if ARGS.smoke else 8192
    dtype = torch.float32 if ARGS.smoke else torch.bfloat16
    a = torch.randn(n, n, device=DEV, dtype=dtype)
    b = torch.randn(n, n, device=DEV, dtype=dtype)
    t = time_ms(lambda: a @ b, reps=REPS, warmup=3)
    return {"n": n, "ms": t["median_ms"], "TFLOPs": 2 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12}


def table() -> None:
    print("\n| item | time | floor / peak | % |\n|---|---:|---:|---:|")
    for rec in RESULT.get("decode", []):
        if "us" in rec:
            print(f"| decode {rec['name']} | {rec['us']:.1f} us | {rec['floor_us']:.1f} us "
                  f"({rec['unique_experts']:.0f} experts) | {100 * rec['floor_us'] / rec['us']:.0f} |")
    for rec in RESULT.get("prefill", []):
        if "ms" in rec:
            print(f"| prefill {rec['name']} | {rec['ms']:.3f} ms | {RESULT['matmul']['TFLOPs']:.0f} TFLOP/s | "
                  f"{rec['pct_of_matmul_peak']:.0f} ({rec['TFLOPs']:.0f} TFLOP/s) |")
    for rec in RESULT.get("prefill", []):
        if "us" in rec:
            print(f"| prefill {rec['name']} | {rec['us']:.1f} us | | |")
    for rec in RESULT.get("route", []):
        if "us" in rec:
            print(f"| route {rec['name']} | {rec['us']:.1f} us | | |")
    for rec in RESULT.get("layer", []):
        if "us" in rec:
            print(f"| layer {rec['name']} | {rec['us']:.1f} us | {rec['floor_us']:.1f} us | "
                  f"{rec['pct_of_floor']:.0f} |")
    for section in ("decode", "prefill", "route", "layer"):
        for rec in RESULT.get(section, []):
            if "skipped" in rec or "error" in rec:
                print(f"| {section} {rec['name']} | {rec.get('skipped') or rec.get('error')} | | |")


def main() -> None:
    if not ARGS.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke for the CPU interpreter run")
    RESULT["device"] = "cpu (interpreter)" if ARGS.smoke else torch.cuda.get_device_name()
    RESULT["copy"] = copy_bandwidth()
    RESULT["matmul"] = matmul_peak()
    log(f"copy {RESULT['copy']['GBps']:.0f} GB/s, matmul {RESULT['matmul']['TFLOPs']:.0f} TFLOP/s")
    if ARGS.layer or ARGS.layer_only or ARGS.smoke:
        layer(RESULT["copy"]["GBps"])
    if ARGS.layer_only:
        save()
        table()
        return
    w13, w2 = weights()
    for T in ([3] if ARGS.smoke else [1, 64, 4096]):
        route_timing(T)
    if ARGS.route_only:
        save()
        table()
        return
    correctness(w13, w2)
    for T in ([1, 5] if ARGS.smoke else ARGS.decode_t):
        decode(T, w13, w2, RESULT["copy"]["GBps"])
    for T in ([33] if ARGS.smoke else ARGS.prefill_t):
        prefill(T, w13, w2, RESULT["matmul"]["TFLOPs"])
    RESULT["wall_s"] = REPORT.elapsed()
    save()
    table()
    log(f"wrote {REPORT.path}")


if __name__ == "__main__":
    main()
