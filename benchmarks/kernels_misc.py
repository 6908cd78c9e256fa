#!/usr/bin/env python3
"""Correctness check and timing of the small Triton ops: RMSNorm (+residual), gated RMSNorm, the
attention-residual mix, and the on-device sampler.

GPU mode (default), one H200-class GPU, bf16 activations at Kimi widths (D=2304; H=32 x 128 for the
gated norm; J=9 sources for the mix):
  1. device-to-device copy bandwidth (bytes read + written), the ceiling for every norm;
  2. per op and N in {1, 64, 8192}: rel err vs the torch oracle, then the time of one call replayed
     from a CUDA graph (inputs rotated so each call reads cold memory), its achieved GB/s (compulsory
     bytes: inputs once, outputs once) as a fraction of copy bandwidth, and the oracle's graph time;
  3. sampling, V=163840, B in {1, 64, 256}: k3rt `sample` (graph-replayed) for greedy-only
     (apply_filters=False), full filters + penalties + bitmask, and the same with 5 logprobs; the sort
     (filter_thresholds) alone; against backend/sampling's Sampler.sample_batch (eager, it syncs).
A table goes to stdout, all numbers to JSON ($OUT/kernels_misc.json, or --out). Items past
--budget-s are skipped and say so.

--smoke: a tiny CPU run under the Triton interpreter (no meaningful times) so CI notices rot.
"""
from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_bench_args  # noqa: E402

ARGS = kernel_bench_args(__doc__, "kernels_misc.json", 100.0)

from _timing import (  # noqa: E402
    Report, copy_bandwidth, default_out, graph_time, import_k3rt_kernels, l2_rotation, rel_err,
)

import torch  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.attn_res import attn_res_mix, attn_res_mix_ref  # noqa: E402
from k3rt.kernels.norm import rms_norm, rms_norm_gated, rms_norm_gated_ref, rms_norm_ref  # noqa: E402
from k3rt.kernels.sampling import filter_thresholds, sample  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
DT = torch.float32 if ARGS.smoke else torch.bfloat16
D, HEADS, HEAD_DIM, J = (64, 2, 32, 3) if ARGS.smoke else (2304, 32, 128, 9)
NS = [1, 4] if ARGS.smoke else [1, 64, 8192]
V = 300 if ARGS.smoke else 163840
BS = [1, 4] if ARGS.smoke else [1, 64, 256]
REPS = 2 if ARGS.smoke else 30
EPS = 1e-5
REPORT = Report(default_out(ARGS.out, "kernels_misc.json"), ARGS.budget_s,
                {"mode": "smoke" if ARGS.smoke else "gpu", "D": D, "J": J, "V": V}, log_records=True)
RESULT, item, log, save = REPORT.result, REPORT.item, REPORT.log, REPORT.save


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(DT)


def bandwidth_item(make_inputs, kernel, oracle, nbytes: int, tol: float) -> dict:
    """Check kernel vs oracle on one input set, then graph-time both over rotated input sets."""
    sets = [make_inputs() for _ in range(l2_rotation(nbytes))]
    got, want = kernel(*sets[0]), oracle(*sets[0])
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    err = rel_err(got, want)
    if not err <= tol:
        raise AssertionError(f"rel err {err:.3g} > {tol}")
    k = graph_time([lambda s=s: kernel(*s) for s in sets], reps=REPS)
    r = graph_time([lambda s=s: oracle(*s) for s in sets], reps=REPS)
    copy = RESULT["copy"]["GBps"]
    gbps = nbytes / (k["us_per_call"] * 1e-6) / 1e9
    return {"rel_err": err, "us": k["us_per_call"], "GBps": gbps, "frac_of_copy": gbps / copy,
            "floor_us": nbytes / (copy * 1e9) * 1e6, "ref_us": r["us_per_call"],
            "speedup_vs_ref": r["us_per_call"] / k["us_per_call"], "bytes": nbytes, "sets": len(sets)}


def norms() -> None:
    tol = 1e-4 if ARGS.smoke else 1e-2
    es = torch.tensor([], dtype=DT).element_size()
    for N in NS:
        w = (1 + randn(D, scale=0.1))
        item("rms_norm", f"N={N}", lambda: bandwidth_item(
            lambda: (randn(N, D),), lambda x: rms_norm(x, w, EPS), lambda x: rms_norm_ref(x, w, EPS),
            2 * N * D * es + D * es, tol))
        item("rms_norm_residual", f"N={N}", lambda: bandwidth_item(
            lambda: (randn(N, D), randn(N, D)), lambda x, r: rms_norm(x, w, EPS, residual=r),
            lambda x, r: rms_norm_ref(x, w, EPS, residual=r), 4 * N * D * es + D * es, tol))
        wg = randn(HEAD_DIM).float()
        item("rms_norm_gated", f"N={N}", lambda: bandwidth_item(
            lambda: (randn(N, HEADS, HEAD_DIM), randn(N, HEADS, HEAD_DIM)),
            lambda x, g: rms_norm_gated(x, g, wg, EPS), lambda x, g: rms_norm_gated_ref(x, g, wg, EPS),
            3 * N * HEADS * HEAD_DIM * es + HEAD_DIM * 4, tol))
        nw, pw = 1 + randn(D, scale=0.1), randn(D)
        item("attn_res_mix", f"N={N} J={J}", lambda: bandwidth_item(
            lambda: (randn(J, N, D),), lambda s: attn_res_mix(s, nw, pw, EPS, num_sources=J),
            lambda s: attn_res_mix_ref(s, J, nw, pw, EPS), (J + 1) * N * D * es + 2 * D * es, tol))
    # k3-tiny's stream (9 slots of 384, 7 live: a mid-forward mix), both forms of the kernel (triton_mix.py: the
    # stacked one is the default at this width), at a decode row, a verify run's 8 rows and a prefill chunk
    dk, jk = (64, 3) if ARGS.smoke else (384, 9)
    nwk, pwk = 1 + randn(dk, scale=0.1), randn(dk)
    for N in ([1, 4] if ARGS.smoke else [1, 8, 8192]):
        for stacked in (False, True):
            item("attn_res_mix", f"k3-tiny N={N} {'stacked' if stacked else 'online'}", lambda: bandwidth_item(
                lambda: (randn(jk, N, dk),), lambda s: attn_res_mix(s, nwk, pwk, EPS, num_sources=jk - 2,
                                                                    stacked=stacked),
                lambda s: attn_res_mix_ref(s, jk - 2, nwk, pwk, EPS), (jk - 1) * N * dk * es + 2 * dk * es, tol))


def sampling_inputs(B: int, filters: bool) -> dict:
    d = dict(logits=(torch.randn(B, V, device=DEV) * 3).to(DT).float(),
             temperature=torch.full((B,), 0.8 if filters else 0.0, device=DEV),
             top_k=torch.full((B,), 50 if filters else 0, dtype=torch.int32, device=DEV),
             top_p=torch.full((B,), 0.9 if filters else 1.0, device=DEV),
             min_p=torch.full((B,), 0.05 if filters else 0.0, device=DEV),
             seeds=torch.randint(0, 2**62, (B,), device=DEV), offsets=torch.zeros(B, dtype=torch.int64, device=DEV))
    if filters:
        d.update(allowed_mask=torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, device=DEV),
                 repetition_penalty=torch.full((B,), 1.1, device=DEV),
                 frequency_penalty=torch.full((B,), 0.2, device=DEV),
                 presence_penalty=torch.full((B,), 0.1, device=DEV),
                 prompt_mask=torch.rand(B, V, device=DEV) < 0.003,
                 output_counts=(torch.rand(B, V, device=DEV) < 0.0005).to(torch.int32))
    return d


def backend_sampler_us(B: int, filters: bool, num_logprobs: int | None) -> float | None:
    """backend/sampling's Sampler.sample_batch, eager (host syncs included); None if not importable."""
    try:
        from k3rt.backend.sampling import Sampler, make_generator
        from k3rt.sampling_params import SamplingParams
    except ImportError:
        return None
    from _timing import time_ms

    p = (SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                        frequency_penalty=0.2, presence_penalty=0.1, logprobs=num_logprobs, seed=1)
         if filters else SamplingParams(temperature=0.0, logprobs=num_logprobs))
    sampler = Sampler(V, DEV)
    logits = (torch.randn(B, V, device=DEV) * 3).to(DT).float()
    gens = [make_generator(i, DEV) for i in range(B)]
    prompt = [[(i + j) % V for j in range(500)] for i in range(B)]
    output = [[(i + 7 * j) % V for j in range(40)] for i in range(B)]
    mask = torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, device=DEV) if filters else None
    t = time_ms(lambda: sampler.sample_batch(logits, [p] * B, gens, prompt, output, mask), reps=max(3, REPS // 3))
    return 1e3 * t["median_ms"]


def sampling() -> None:
    for B in BS:
        for name, filters, nlp in (("greedy", False, None), ("filters+penalties", True, None),
                                   ("filters+penalties+logprobs5", True, 5)):
            def run(B=B, filters=filters, nlp=nlp) -> dict:
                d = sampling_inputs(B, filters)
                out = torch.empty(B, dtype=torch.int64, device=DEV)
                k = graph_time([lambda: sample(**d, apply_filters=filters, num_logprobs=nlp, out=out)], reps=REPS)
                rec = {"us": k["us_per_call"], "graph": k["graph"]}
                ref = backend_sampler_us(B, filters, nlp)
                if ref is not None:
                    rec.update(backend_us=ref, speedup_vs_backend=ref / k["us_per_call"])
                return rec
            item("sampling", f"B={B} {name}", run)
        def sort_only(B=B) -> dict:
            d = sampling_inputs(B, True)
            greedy = torch.zeros(B, dtype=torch.bool, device=DEV)
            t = graph_time([lambda: filter_thresholds(d["logits"], d["top_k"], d["top_p"], d["min_p"], greedy)],
                           reps=REPS)
            return {"us": t["us_per_call"]}
        item("sampling", f"B={B} filter_thresholds (sort) alone", sort_only)


def table() -> None:
    print(f"\ncopy bandwidth {RESULT['copy']['GBps']:.0f} GB/s; D={D}, gated {HEADS}x{HEAD_DIM}, J={J}, {DT}")
    print(f"{'op':<20}{'case':<14}{'us':>9}{'GB/s':>8}{'%copy':>7}{'floor us':>9}{'ref us':>9}{'x ref':>7}")
    for op in ("rms_norm", "rms_norm_residual", "rms_norm_gated", "attn_res_mix"):
        for r in RESULT.get(op, []):
            if "us" not in r:
                print(f"{op:<20}{r['name']:<14}  {r.get('skipped') or r.get('error')}")
                continue
            print(f"{op:<20}{r['name']:<14}{r['us']:9.2f}{r['GBps']:8.0f}{100 * r['frac_of_copy']:6.0f}%"
                  f"{r['floor_us']:9.2f}{r['ref_us']:9.2f}{r['speedup_vs_ref']:7.1f}")
    print(f"\n{'sampling V=' + str(V):<48}{'us':>10}{'backend us':>12}{'x backend':>10}")
    for r in RESULT.get("sampling", []):
        if "us" not in r:
            print(f"{r['name']:<48}  {r.get('skipped') or r.get('error')}")
            continue
        b = r.get("backend_us")
        print(f"{r['name']:<48}{r['us']:10.1f}" + (f"{b:12.1f}{r['speedup_vs_backend']:10.1f}" if b else ""))


def main() -> None:
    if not ARGS.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke for the CPU interpreter run")
    torch.manual_seed(0)
    RESULT["device"] = "cpu (interpreter)" if ARGS.smoke else torch.cuda.get_device_name()
    RESULT["copy"] = copy_bandwidth()
    log(f"copy {RESULT['copy']['GBps']:.0f} GB/s")
    norms()
    sampling()
    RESULT["wall_s"] = REPORT.elapsed()
    save()
    table()
    log(f"wrote {REPORT.path}")


if __name__ == "__main__":
    main()
