"""Benchmark the Triton MLA kernels: paged decode against copy bandwidth, prefill against SDPA.

Decode (Kimi-Linear-48B shape: H=32, L=512, R=64, bf16, page 1888, pages shuffled) runs at
context 8K/32K/128K x batch 1/16/64 (issue 18's points), each call replayed from a CUDA graph, rotating over enough
page sets that every call reads cold KV. Bytes = KV read (N*ctx*576*2) + q + out; the ratio is
taken against the device-to-device copy bandwidth measured in the same run. Every launch variant
in DECODE_VARIANTS (the default, the paged kernel's tile / stage / occupancy alternatives) is checked against
the oracle at 32K and timed at every case side by side, then at ragged lengths (uniform in
[1, 64K], batch 16 and 64: where the balanced schedule matters); then split counts at half and twice the
heuristic's are timed for the two variants with the best mean at contexts >= 32K. A markdown table of
% of copy bandwidth (variant x case) goes to stdout and into the JSON ("decode_table_md"), and before the
split sweep each kernel's device time (torch.profiler) for the default and the best variant at the goal's
cases ("decode_profile": the attention kernel and the combine apart).

Prefill (one sequence of 8K and 32K tokens, expanded form: qk dim 192, v dim 128) reports
tokens/s and TFLOP/s (causal: 2*H*T(T+1)/2*(192+128) flops) next to torch SDPA on the same
expanded inputs (flash backend; flash needs equal qk and v dims, so v is zero-padded to 192 and
only the useful flops are counted).

    python benchmarks/kernels_mla.py --smoke --out /tmp/kernels_mla.json   # CPU interpreter, tiny
    python3 benchmarks/kernels_mla.py --budget-s 150 --out $OUT/kernels_mla.json   # GPU
    python3 benchmarks/kernels_mla.py --decode-only --budget-s 120 --out $OUT/kernels_mla.json
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels_mla.json"))
    ap.add_argument("--variant-index", type=int, default=None,
                    help="time only DECODE_VARIANTS[i] (run variants in separate processes: a crash stays local)")
    ap.add_argument("--decode-variants", nargs="+", default=None, metavar="NAME",
                    help="time only these DECODE_VARIANTS (the first named is the split sweep's reference)")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill benchmark and its check")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode benchmark and its checks")
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=None,
                    help="fresh single-sequence prefill lengths (GPU default 8192 32768)")
    ap.add_argument("--prefill-variants", nargs="*", default=None,
                    help="prefill launch variants timed at every length, each checked against the oracle first "
                         "(names from PREFILL_VARIANTS, or mMnNwWsS tiles; default: a tile sweep at the first length)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip items that would start past this")
    ap.add_argument("--decode-baseline", default=None, metavar="FILE",
                    help="an earlier kernels/mla/triton_decode.py (git show REV:kernels/mla/triton_decode.py > FILE): "
                         "its mla_decode timed beside the default variant at every decode case, twice each, "
                         "interleaved, in the same process (decode_baseline in the JSON)")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from _timing import (  # noqa: E402
    Report, copy_bandwidth, graph_time, import_k3rt_kernels, l2_rotation, load_file_module, rel_err, time_ms,
)

import_k3rt_kernels()
from k3rt.kernels.mla import (  # noqa: E402
    mla_decode, mla_decode_num_splits, mla_decode_ref, mla_prefill, mla_prefill_ref,
)
from k3rt.kernels.mla.triton_decode import (  # noqa: E402
    gluon_num_splits, mla_decode_balanced_programs, mla_decode_config)

GPU = torch.cuda.is_available() and not ARGS.smoke
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
if GPU:
    SHAPE = dict(H=32, L=512, R=64, P=128, V=128, page=1888)
    CONTEXTS, BATCHES, PREFILL_LENS = [8192, 32768, 131072], [1, 16, 64], [8192, 32768]
else:
    SHAPE = dict(H=4, L=32, R=16, P=16, V=16, page=48)
    CONTEXTS, BATCHES, PREFILL_LENS = [100], [1, 3], [40]
PREFILL_LENS = ARGS.prefill_lens or PREFILL_LENS
# mla_prefill's launch options by name (block sizes, warps, stages; TMA descriptors; Triton's warp specialization)
PREFILL_VARIANTS = {
    "default": {},
    "m128n64w8s2": dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    "m128n128w8s2": dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    "m64n64w4s3": dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    "m128n64w4s3": dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
    "tma": dict(tma=True),
    "tma_s2": dict(tma=True, num_stages=2),
    "tma_s4": dict(tma=True, num_stages=4),
    "tma_s5": dict(tma=True, num_stages=5),
    "tma_m256w8s2": dict(tma=True, block_m=256, num_warps=8, num_stages=2),
    "tma_m256w16s2": dict(tma=True, block_m=256, num_warps=16, num_stages=2),
    "tma_m256w16s3": dict(tma=True, block_m=256, num_warps=16, num_stages=3),
    "tma_n128s2": dict(tma=True, block_n=128, num_stages=2),
    "tma_m64w4": dict(tma=True, block_m=64, num_warps=4),
    "ws": dict(warp_specialize=True),
    "tma_ws": dict(tma=True, warp_specialize=True),
    "tma_ws_w4": dict(tma=True, warp_specialize=True, num_warps=4),
}
H, L, R, P, V, PAGE = (SHAPE[k] for k in ("H", "L", "R", "P", "V", "page"))
SCALE = (P + R) ** -0.5
# this script's sections are plain lists filled by hand (no per-item records): only the budget clock
# and the JSON writing come from the Report
REPORT = Report(Path(ARGS.out), ARGS.budget_s, {
    "mode": "gpu" if GPU else "smoke", "shape": SHAPE, "dtype": str(DTYPE), "decode": [], "decode_errors": [], "decode_sweep": [],
    "decode_baseline": [],
    "prefill": [], "prefill_sweep": [], "correctness": [], "skipped": []})
RESULT = REPORT.result


def in_budget(name: str) -> bool:
    if REPORT.over_budget():
        RESULT["skipped"].append(name)
        print(f"skipped (budget): {name}")
        return False
    return True


def decode_inputs(N: int, ctx: int, rotations: int, gen: torch.Generator):
    """One shuffled page pool holding `rotations` disjoint page sets of N sequences of ctx tokens."""
    blocks = -(-ctx // PAGE)
    num_pages = rotations * N * blocks
    kv = torch.empty(num_pages, PAGE, L + R, dtype=DTYPE, device=DEV).normal_(generator=gen)
    perm = torch.randperm(num_pages, generator=gen, device=DEV).int()
    tables = [perm[r * N * blocks:(r + 1) * N * blocks].view(N, blocks) for r in range(rotations)]
    qs = [torch.randn(N, H, L + R, generator=gen, device=DEV).to(DTYPE) for _ in range(rotations)]
    seq_lens = torch.full((N,), ctx, dtype=torch.int32, device=DEV)
    return kv, tables, qs, seq_lens


# name -> mla_decode tuning overrides ({} is the default config: the paged kernel, triton_decode_paged.py, with
# heads on the dots' M, 32-token page-aligned tiles, 4 warps, 3 stages: two programs per SM). Names: h = heads per
# program (the dots' M), n = tokens per KV tile, w = warps, x = pipeline stages. The paged kernel carries each tile's
# page id one tile ahead, so Triton's pipeliner keeps the next KV copies in flight during the math.
#   "wgmma h64": FlashMLA's layout at Kimi's 32 heads: the head block padded to 64 rows so both dots lower to
#     Hopper wgmma (m64) reading the KV tile straight from shared memory (mma.sync at h32 loads it into registers
#     through ldmatrix, every warp re-reading q); twice the MMA work, half of it on zero rows, 8 warps (two
#     warpgroups split each dot's N), one program per SM (q in shared memory: 72 KB at 64 rows).
#     Its sm_90 TTGIR shows a further cost: Triton gives the score dot, whose result feeds the second dot, all 8
#     warps along M (warpsPerCTA [8, 1]), so both warpgroups compute the same 64 x n scores.
#   "tma": KV tiles copied by TMA boxes (triton_decode_tma.py): no per-thread addresses; 1888-token pages take
#     16- and 32-token tiles only. (With 32 heads on mma.sync the TMA tile's layout does not suit ldmatrix and
#     the build spills, so only the wgmma launches take it.)
#   "h32 n64 w4": with 32 heads on mma.sync the 4 warps split the score dot's N, so each warp reads all of q from
#     shared memory per tile (4 x 36 KB per 32-token tile in the default); 64-token tiles halve that per token.
#     One program per SM (184 KB).
#   "bf16 partials": the splits' partial outputs in q's dtype (half the bytes the combine reads back).
#   "pdl": programmatic dependent launch (the combine's launch overlaps the attention's tail), as the runner runs.
#   "balanced": FlashMLA's persistent schedule: one work program per SM slot, each over an equal share of all
#     sequences' tiles laid end to end.
# The 2026-12-02 sweep (benchmarks/RESULTS.md) also timed 8-warp 32- and 16-token tiles with heads on M, 2-stage and
# 128-register launches, the tokens-on-M paged launch and the gathered-row kernel: all slower, left out here.
_PAGED = dict(paged=True, prefetch="none")
_WGMMA = dict(_PAGED, layout="heads", block_h=64, num_warps=8)
DECODE_VARIANTS = {
    "default (h32 n32 w4 x3 2/SM)": {},
    "default pdl": dict(use_pdl=True),
    "default bf16 partials": dict(partial_dtype="input"),  # with the one-pass combine: no gain (session 43)
    "default two-step combine": dict(wide_combine=False),  # 32 splits a combine step (the default before session 43)
    "paged h32 n64 w8 x3": dict(_PAGED, layout="heads", block_n=64, num_warps=8, num_stages=3),
    "paged h32 n64 w4 x3": dict(_PAGED, layout="heads", block_n=64, num_warps=4, num_stages=3),
    "wgmma h64 n32 x3": dict(_WGMMA, block_n=32, num_stages=3),
    "wgmma h64 n32 x4": dict(_WGMMA, block_n=32, num_stages=4),
    "wgmma h64 n16 x4": dict(_WGMMA, block_n=16, num_stages=4),
    "tma wgmma h64 n32 x3": dict(_WGMMA, block_n=32, num_stages=3, tma=True),
    "tma wgmma h64 n16 x4": dict(_WGMMA, block_n=16, num_stages=4, tma=True),
    "wgmma h64 n32 x3 bf16 partials pdl": dict(_WGMMA, block_n=32, num_stages=3, partial_dtype="input",
                                               use_pdl=True),
    "balanced h32 n32 w4 x3 2/SM": dict(_PAGED, schedule="balanced", layout="heads", block_n=32, num_warps=4,
                                        num_stages=3),
    "balanced wgmma h64 n32 x3": dict(_WGMMA, schedule="balanced", block_n=32, num_stages=3),
    # the Gluon kernel (kernels/mla/gluon_decode.py): heads padded to 64 on wgmma's M, both warpgroups splitting
    # the scores' tokens and the output's columns, TMA ring of num_stages 32-token tiles
    "gluon n32 x2": dict(gluon=True, block_n=32, num_stages=2),
    "gluon n32 x3": dict(gluon=True, block_n=32, num_stages=3),
    "gluon n32 x4": dict(gluon=True, block_n=32, num_stages=4),
    "gluon n64 x2": dict(gluon=True, block_n=64, num_stages=2),  # two 32-row boxes a tile at the 1888-token page
    # session 43: tokens on wgmma's M (the scores c . q^T, then c^T . p^T), heads on N unpadded, one warpgroup
    "gluon tokens n64 x2": dict(gluon=True, block_n=64, num_stages=2, gluon_layout="tokens"),
    "gluon tokens n64 x2 bf16 partials": dict(gluon=True, block_n=64, num_stages=2, gluon_layout="tokens",
                                              partial_dtype="input"),
    # 16 heads a program: two programs a split share its KV tiles (through L2), half the splits at batch 1, so half
    # the partials written and merged. H100 (session 43): ahead at 1x8K only (23.0 against 19.6 %), 9-29 points
    # behind from batch 16 (every tile read twice through L2)
    "gluon tokens h16 n64 x2": dict(gluon=True, block_n=64, num_stages=2, gluon_layout="tokens", block_h=16),
    "gluon n32 x3 pv": dict(gluon=True, block_n=32, num_stages=3, gluon_pipeline="pv"),
    "gluon n32 x4 pv": dict(gluon=True, block_n=32, num_stages=4, gluon_pipeline="pv"),
    "gluon n64 x2 pv": dict(gluon=True, block_n=64, num_stages=2, gluon_pipeline="pv"),
    "gluon n32 x3 two_tile": dict(gluon=True, block_n=32, num_stages=3, gluon_pipeline="two_tile"),
    "gluon n32 x4 two_tile": dict(gluon=True, block_n=32, num_stages=4, gluon_pipeline="two_tile"),
}
if not GPU:  # the interpreter: its 16-token tiles
    DECODE_VARIANTS = {"default (h32 n32 w4 x3 2/SM)": {},
                       "tma heads 16 x3": dict(_PAGED, layout="heads", block_n=16, num_stages=3, tma=True),
                       "paged heads 16 x3": dict(_PAGED, layout="heads", block_n=16, num_stages=3),
                       "balanced heads 16 x3": dict(_PAGED, schedule="balanced", layout="heads", block_n=16,
                                                    num_stages=3)}
if ARGS.variant_index is not None:
    DECODE_VARIANTS = dict([list(DECODE_VARIANTS.items())[ARGS.variant_index]])
if ARGS.decode_variants:
    unknown = sorted(set(ARGS.decode_variants) - set(DECODE_VARIANTS))
    if unknown:
        raise SystemExit(f"unknown --decode-variants {unknown}: one of {sorted(DECODE_VARIANTS)}")
    DECODE_VARIANTS = {v: DECODE_VARIANTS[v] for v in ARGS.decode_variants}


def variant_config(variant: str, N: int, ctx: int):
    """The MlaDecodeConfig a variant launches at (N, ctx): the default's with the variant's overrides."""
    tune = DECODE_VARIANTS[variant]
    return replace(mla_decode_config(N, H, ctx), **{k: v for k, v in tune.items() if k != "use_pdl"})


def launcher_splits(variant: str, N: int, ctx: int) -> int:
    """The split count mla_decode picks for this variant when given none (the runner's): the Gluon kernel's one
    wave, the Triton kernels' two-wave rule. (Before session 44 every variant was timed at the Triton rule's count,
    so the Gluon rows ran at twice their own splits from batch 16 on.)"""
    if DECODE_VARIANTS[variant].get("gluon"):
        cfg = variant_config(variant, N, ctx)
        return gluon_num_splits(N, H, ctx, None, cfg.gluon_layout, cfg.block_h)
    return mla_decode_num_splits(N, H, ctx)


class DecodeCase:
    """One (batch, context) decode case: its page pool is built once and timed under many launches.
    ragged: lengths uniform in [1, 2 * ctx] (mean ~ctx; pages for 2 * ctx), bytes from the actual lengths."""

    def __init__(self, N: int, ctx: int, ragged: bool = False) -> None:
        self.N, self.ctx, self.ragged = N, ctx, ragged
        gen = torch.Generator(device=DEV).manual_seed(N * 7 + ctx + ragged)
        span = 2 * ctx if ragged else ctx
        self.rot = l2_rotation(N * ctx * (L + R) * 2)
        self.kv, self.tables, self.qs, self.seq_lens = decode_inputs(N, span, self.rot, gen)
        if ragged:
            self.seq_lens = torch.randint(1, span + 1, (N,), generator=gen, device=DEV, dtype=torch.int32)
        self.span = span
        self.bytes_per_call = int(self.seq_lens.sum()) * (L + R) * 2 + N * H * (2 * L + R) * 2
        self.outs = [torch.empty(N, H, L, dtype=DTYPE, device=DEV) for _ in range(self.rot)]

    def time(self, variant: str, num_splits: int | None = None, decode=None) -> dict:
        """decode: another mla_decode (--decode-baseline's) in the variant's launch."""
        decode = decode or mla_decode
        tune = DECODE_VARIANTS[variant]
        # the balanced schedule's count is work programs (None: the launcher's choice), not splits
        balanced = tune.get("schedule") == "balanced"
        if balanced:
            splits = num_splits or mla_decode_balanced_programs(H, variant_config(variant, self.N, self.span),
                                                                 None if GPU else 4)  # interpreter: few
        else:
            splits = num_splits or launcher_splits(variant, self.N, self.span)
        calls = [lambda r=r: decode(self.qs[r], self.kv, self.tables[r], self.seq_lens, SCALE, kv_lora_rank=L,
                                    num_splits=splits, out=self.outs[r], **tune) for r in range(self.rot)]
        us = graph_time(calls, reps=30 if GPU else 1)["us_per_call"]
        gbps = self.bytes_per_call / (us * 1e-6) / 1e9
        return {"variant": variant, "N": self.N, "ctx": self.ctx, "ragged": self.ragged, "num_splits": splits,
                **tune, "us": us,
                "GBps": gbps, "pct_copy_bw": 100 * gbps / RESULT["copy_bandwidth"]["GBps"], "rotations": self.rot}


def case_key(row: dict) -> str:
    """A decode row's column name: batch x context (in K from 1024 tokens), r for ragged lengths."""
    ctx = f"{row['ctx'] // 1024}K" if row["ctx"] >= 1024 else str(row["ctx"])
    return f"{row['N']}x{ctx}{'r' if row['ragged'] else ''}"


def markdown_table(table: dict) -> str:
    """% of copy bandwidth, one row per variant, one column per case (batch x context, r = ragged lengths),
    the best of each column in bold."""
    cols = list(dict.fromkeys(k for row in table.values() for k in row))
    best = {c: max((row[c] for row in table.values() if c in row), default=None) for c in cols}
    lines = ["| variant | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for v, row in table.items():
        cells = ["" if c not in row else f"**{row[c]}**" if row[c] == best[c] else f"{row[c]}" for c in cols]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def profile_decode(variants: list[str]) -> None:
    """Where a call's time goes: each kernel's mean device time (torch.profiler, eager calls rotated over cold
    page sets as in the timing) for `variants` at the goal's cases, so the attention kernel and the combine
    are seen apart (at batch 1 the combine and the partials weigh most). Failures are recorded, not raised."""
    from torch.profiler import ProfilerActivity, profile

    RESULT["decode_profile"] = []
    for N, ctx in [(1, 32768), (1, 131072), (16, 32768), (64, 32768)]:
        if not in_budget(f"decode profile N={N} ctx={ctx}"):
            continue
        case = DecodeCase(N, ctx)
        for variant in variants:
            tune = DECODE_VARIANTS[variant]
            try:
                splits = launcher_splits(variant, N, ctx) if tune.get("schedule") != "balanced" else None
                calls = [lambda r=r: mla_decode(case.qs[r], case.kv, case.tables[r], case.seq_lens, SCALE,
                                                kv_lora_rank=L, num_splits=splits, out=case.outs[r], **tune)
                         for r in range(case.rot)]
                for c in calls:
                    c()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        for c in calls:
                            c()
                    torch.cuda.synchronize()
                kernels = {e.key: round(e.device_time_total / max(1, e.count), 2) for e in prof.key_averages()
                           if e.device_time_total > 0}
            except Exception as e:
                RESULT["decode_errors"].append({"variant": variant, "N": N, "ctx": ctx, "profile": True,
                                                "error": repr(e)[:400]})
                continue
            RESULT["decode_profile"].append({"variant": variant, "N": N, "ctx": ctx, "us_per_kernel": kernels})
            REPORT.save()
            print(f"profile N={N:3d} ctx={ctx:6d} {variant:36s} "
                  + "  ".join(f"{k}: {v} us" for k, v in kernels.items()))
        del case
        torch.cuda.empty_cache()


BASELINE = load_file_module(ARGS.decode_baseline, "k3rt_mla_decode_baseline") if ARGS.decode_baseline else None


def time_baseline(case: "DecodeCase") -> None:
    """--decode-baseline: the default variant through the current and the earlier mla_decode, twice each,
    interleaved (the second pair's readings say how much the order moved the first)."""
    first = next(iter(DECODE_VARIANTS))
    for again in ("", " again"):
        for impl, fn in (("k3rt", None), ("baseline", BASELINE.mla_decode)):
            row = {**case.time(first, decode=fn), "impl": impl + again}
            RESULT["decode_baseline"].append(row)
            REPORT.save()
            print(f"decode N={case.N:3d} ctx={case.ctx:6d} {first} {impl + again:15s} {row['us']:9.2f} us "
                  f"{row['pct_copy_bw']:5.1f}% of copy")


def bench_decode() -> None:
    """Every variant at every (context, batch) with the split heuristic's count, then split counts
    around the heuristic's for the variant with the best mean at contexts >= 32K."""
    failed = {c["name"].split(" splits=")[0][len("decode "):] for c in RESULT["correctness"] if not c["ok"]}
    ok = set(DECODE_VARIANTS) - failed
    best_key = lambda v: -sum(r["pct_copy_bw"] for r in RESULT["decode"]  # noqa: E731
                              if r["variant"] == v and r["ctx"] >= 32768 and not r["ragged"]) if GPU and v in ok else 0
    for ctx in sorted(CONTEXTS, key=lambda c: c < 32768):  # the goal's contexts (>= 32K) first, should the budget cut
        for N in BATCHES:
            if not in_budget(f"decode N={N} ctx={ctx}"):
                continue
            case = DecodeCase(N, ctx)
            for variant in DECODE_VARIANTS:
                try:
                    row = case.time(variant)
                except Exception as e:  # a variant that does not build (shared memory) or launch stays local
                    RESULT["decode_errors"].append({"variant": variant, "N": N, "ctx": ctx, "error": repr(e)[:400]})
                    print(f"decode N={N:3d} ctx={ctx:6d} {variant:36s} ERROR {repr(e)[:200]}")
                    continue
                RESULT["decode"].append(row)
                REPORT.save()  # a later crash (illegal address) keeps what was measured
                print(f"decode N={N:3d} ctx={ctx:6d} splits={row['num_splits']:3d} {variant:36s} {row['us']:9.2f} us "
                      f"{row['GBps']:7.0f} GB/s  {row['pct_copy_bw']:5.1f}% of copy")
            if BASELINE is not None:
                time_baseline(case)
            del case
            if GPU:
                torch.cuda.empty_cache()  # the pools of the largest cases are ~10 GB
    for N in BATCHES[1:] if GPU else BATCHES:  # ragged lengths, mean ~32K: where the balanced schedule matters
        ctx = 32768 if GPU else CONTEXTS[0]
        if not in_budget(f"decode ragged N={N} ctx={ctx}"):
            continue
        case = DecodeCase(N, ctx, ragged=True)
        for variant in DECODE_VARIANTS:
            try:
                row = case.time(variant)
            except Exception as e:
                RESULT["decode_errors"].append({"variant": variant, "N": N, "ctx": ctx, "ragged": True,
                                                "error": repr(e)[:400]})
                continue
            RESULT["decode"].append(row)
            REPORT.save()
            print(f"decode N={N:3d} ragged ~{ctx:6d} {variant:36s} {row['us']:9.2f} us {row['pct_copy_bw']:5.1f}% of copy")
        del case
        if GPU:
            torch.cuda.empty_cache()
    table = {v: {case_key(r): round(r["pct_copy_bw"], 1)
                 for r in RESULT["decode"]
                 if r["variant"] == v} for v in DECODE_VARIANTS}
    RESULT["decode_table_pct_copy_bw"] = table
    RESULT["decode_table_md"] = markdown_table(table)
    print(RESULT["decode_table_md"])
    ranked = sorted(DECODE_VARIANTS, key=best_key)
    best = ranked[0]
    if ARGS.variant_index not in (None, 0):
        return  # split counts only with the default variant
    RESULT["decode_best_variant"] = best
    RESULT["decode_ranked_variants"] = ranked
    if GPU:
        profile_decode(list(dict.fromkeys([next(iter(DECODE_VARIANTS)), best])))
    sweep = ranked[:2] if GPU else ranked[:1]  # the two best: their tiles load-balance differently
    for ctx in CONTEXTS[1:] or CONTEXTS:
        for N in BATCHES:
            if not in_budget(f"decode splits N={N} ctx={ctx}"):
                continue
            case = DecodeCase(N, ctx)
            for variant in sweep:
                chosen = launcher_splits(variant, N, ctx)
                for s in sorted({max(1, chosen // 2), chosen * 2} - {chosen}):
                    row = case.time(variant, s)
                    RESULT["decode_sweep"].append(row)
                    print(f"  splits N={N:3d} ctx={ctx:6d} {variant:36s} splits={s:3d} {row['us']:9.2f} us "
                          f"{row['pct_copy_bw']:5.1f}% of copy")
            del case
            if GPU:
                torch.cuda.empty_cache()


def prefill_inputs(lens: list[tuple[int, int]], gen: torch.Generator) -> dict:
    """Packed varlen inputs laid out as the runner's expanded form: k_nope and v views of one kv_b_proj output
    [Tk, H, P+V], k_pe the rope columns of the latent rows [Tk, L+R]."""
    Tq, Tk = sum(q for q, _ in lens), sum(k for _, k in lens)
    cu_q = torch.tensor([0] + [sum(q for q, _ in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(k for _, k in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=DEV).to(DTYPE)  # noqa: E731
    kv, ctx = rnd(Tk, H, P + V), rnd(Tk, L + R)
    return dict(q=rnd(Tq, H, P + R), k_nope=kv[..., :P], k_pe=ctx[:, L:], v=kv[..., P:],
                cu_seqlens_q=cu_q.to(DEV), cu_seqlens_k=cu_k.to(DEV),
                max_seqlen_q=max(q for q, _ in lens), max_seqlen_k=max(k for _, k in lens))


def sdpa_peer(case: dict):
    """Torch SDPA on the same expanded inputs (one fresh sequence): the call and the backend used."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    T = case["q"].shape[0]
    q = case["q"].transpose(0, 1).unsqueeze(0)  # [1, H, T, P+R]
    k = torch.cat([case["k_nope"], case["k_pe"][:, None].expand(T, H, R)], dim=-1).transpose(0, 1).unsqueeze(0)
    v = case["v"].transpose(0, 1).unsqueeze(0)
    v_pad = torch.nn.functional.pad(v, (0, P + R - V))
    attempts = [("flash (v padded)", SDPBackend.FLASH_ATTENTION, v_pad), ("efficient", SDPBackend.EFFICIENT_ATTENTION, v)]
    for name, backend, vv in attempts:
        def call(backend=backend, vv=vv):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=SCALE)
        try:
            call()
            return call, name
        except RuntimeError:
            continue
    return None, "none"


def bench_prefill() -> None:
    for T in PREFILL_LENS:
        if not in_budget(f"prefill T={T}"):
            continue
        case = prefill_inputs([(T, T)], torch.Generator(device=DEV).manual_seed(T))
        flops = 2 * H * (T * (T + 1) / 2) * (P + R + V)
        reps = 5 if GPU else 1
        t = time_ms(lambda: mla_prefill(**case, scale=SCALE), reps=reps, warmup=2 if GPU else 0)["median_ms"]
        row = {"T": T, "ms": t, "tokens_per_s": T / (t * 1e-3), "TFLOPs": flops / (t * 1e-3) / 1e12}
        if GPU:
            peer, backend = sdpa_peer(case)
            if peer is not None:
                tp = time_ms(peer, reps=reps, warmup=2)["median_ms"]
                row.update(sdpa_backend=backend, sdpa_ms=tp, sdpa_TFLOPs=flops / (tp * 1e-3) / 1e12)
        RESULT["prefill"].append(row)
        print(f"prefill T={T:6d}  {t:8.2f} ms  {row['tokens_per_s']:10.0f} tok/s  {row['TFLOPs']:6.1f} TFLOP/s"
              + (f"   SDPA[{row['sdpa_backend']}] {row['sdpa_ms']:8.2f} ms {row['sdpa_TFLOPs']:6.1f} TFLOP/s"
                 if "sdpa_ms" in row else ""))
        variants = ARGS.prefill_variants
        if variants is None:
            variants = ["m128n64w8s2", "m128n128w8s2", "m64n64w4s3", "m64n32w4s4"] if GPU and T == PREFILL_LENS[0] else []
        want = mla_prefill(**case, scale=SCALE) if variants else None
        for name in variants:
            tune = _prefill_tune(name)
            if not in_budget(f"prefill T={T} {name}"):
                continue
            try:
                err = rel_err(mla_prefill(**case, scale=SCALE, **tune), want)
                ts = time_ms(lambda: mla_prefill(**case, scale=SCALE, **tune), reps=reps, warmup=2)["median_ms"]
            except Exception as e:  # a variant that does not compile is a row, not the end of the run
                print(f"  variant {name}: ERROR {repr(e)[:300]}")
                RESULT["prefill_sweep"].append({"T": T, "variant": name, **tune, "error": repr(e)[:500]})
                continue
            RESULT["prefill_sweep"].append({"T": T, "variant": name, **tune, "ms": ts, "rel_err_vs_default": err,
                                            "TFLOPs": flops / (ts * 1e-3) / 1e12, "vs_default": t / ts})
            print(f"  variant {name:14s} {ts:8.3f} ms {flops / (ts * 1e-3) / 1e12:6.1f} TFLOP/s  {t / ts:5.3f}x the "
                  f"default  (rel err vs the default {err:.1e})")
            REPORT.save()


def _prefill_tune(name: str) -> dict:
    """A PREFILL_VARIANTS name, or 'm64n32w4s4' -> block_m 64, block_n 32, 4 warps, 4 stages."""
    import re
    if name in PREFILL_VARIANTS:
        return PREFILL_VARIANTS[name]
    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)", name)
    if m is None:
        raise SystemExit(f"unknown prefill variant {name!r}: one of {sorted(PREFILL_VARIANTS)} or mMnNwWsS")
    bm, bn, w, st = map(int, m.groups())
    return dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)


def check_decode(gen: torch.Generator, tol: float, ctx: int) -> None:
    kv, (table,), (q,), _ = decode_inputs(4, ctx, 1, gen)
    seq_lens = torch.tensor([ctx, 1, PAGE + 1, ctx // 3 + 5], dtype=torch.int32, device=DEV)
    want = mla_decode_ref(q, kv, table, seq_lens, SCALE, L)
    for variant, tune in DECODE_VARIANTS.items():
        for splits in (None, 1):
            try:
                got = mla_decode(q, kv, table, seq_lens, SCALE, kv_lora_rank=L, num_splits=splits, **tune)
                err = rel_err(got, want)
            except Exception as e:  # recorded as a failed check; the timing loop records it again
                print(f"correctness {variant} splits={splits}: ERROR {repr(e)[:200]}")
                err = float("inf")
            RESULT["correctness"].append({"name": f"decode {variant} splits={splits or 'auto'} lens={seq_lens.tolist()}",
                                          "rel_err": err, "tol": tol, "ok": err <= tol})
            REPORT.save()


def check_correctness() -> None:
    """Every decode variant (auto splits and one split) on ragged lengths, and prefill, vs the oracles."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    tol = 1e-2 if GPU else 1e-4
    ctx = 32768 if GPU else 120
    if not ARGS.prefill_only:
        check_decode(gen, tol, ctx)
    if not ARGS.decode_only:
        lens = [(1000, 3000), (512, 512), (1, 700)] if GPU else [(20, 50), (17, 17), (1, 9)]
        case = prefill_inputs(lens, gen)
        want = mla_prefill_ref(**case, scale=SCALE)
        for name in ["default", *[v for v in ARGS.prefill_variants or [] if v != "default"]]:
            tune = _prefill_tune(name)
            try:
                err = rel_err(mla_prefill(**case, scale=SCALE, **tune), want)
            except Exception as e:  # recorded as a failed check; the timing loop records it again
                print(f"correctness prefill {name}: ERROR {repr(e)[:300]}")
                err = float("inf")
            RESULT["correctness"].append({"name": f"prefill {name} {lens}", "rel_err": err, "tol": tol, "ok": err <= tol})
    for c in RESULT["correctness"]:
        print(f"correctness {c['name']}: rel_err {c['rel_err']:.2e} (tol {c['tol']:.0e}) {'ok' if c['ok'] else 'FAIL'}")


def main() -> int:
    if GPU:
        RESULT["device"] = torch.cuda.get_device_name()
    RESULT["copy_bandwidth"] = copy_bandwidth()
    print(f"copy bandwidth: {RESULT['copy_bandwidth']['GBps']:.0f} GB/s")
    check_correctness()
    if not ARGS.prefill_only:
        bench_decode()
    if not ARGS.decode_only:
        bench_prefill()
    RESULT["elapsed_s"] = REPORT.elapsed()
    REPORT.save()
    print(f"wrote {REPORT.path} ({RESULT['elapsed_s']:.1f} s)")
    return 0 if all(c["ok"] for c in RESULT["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
