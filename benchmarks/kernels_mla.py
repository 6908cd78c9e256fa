"""Benchmark the Triton MLA kernels: paged decode against copy bandwidth, prefill against SDPA.

Decode (Kimi-Linear-48B shape: H=32, L=512, R=64, bf16, page 1888, pages shuffled) runs at
context 4K/32K/128K x batch 1/16/64, each call replayed from a CUDA graph, rotating over enough
page sets that every call reads cold KV. Bytes = KV read (N*ctx*576*2) + q + out; the ratio is
taken against the device-to-device copy bandwidth measured in the same run. A sweep of split
counts and tile configs at 32K shows how far the num_splits heuristic is from the best.

Prefill (one sequence of 8K and 32K tokens, expanded form: qk dim 192, v dim 128) reports
tokens/s and TFLOP/s (causal: 2*H*T(T+1)/2*(192+128) flops) next to torch SDPA on the same
expanded inputs (flash backend; flash needs equal qk and v dims, so v is zero-padded to 192 and
only the useful flops are counted).

    python benchmarks/kernels_mla.py --smoke --out /tmp/kernels_mla.json   # CPU interpreter, tiny
    python3 benchmarks/kernels_mla.py --budget-s 150 --out $OUT/kernels_mla.json   # GPU
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels_mla.json"))
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip items that would start past this")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from _timing import (  # noqa: E402
    Report, copy_bandwidth, graph_time, import_k3rt_kernels, l2_rotation, rel_err, time_ms,
)

import_k3rt_kernels()
from k3rt.kernels.mla import (  # noqa: E402
    mla_decode, mla_decode_num_splits, mla_decode_ref, mla_prefill, mla_prefill_ref,
)

GPU = torch.cuda.is_available() and not ARGS.smoke
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
if GPU:
    SHAPE = dict(H=32, L=512, R=64, P=128, V=128, page=1888)
    CONTEXTS, BATCHES, PREFILL_LENS = [4096, 32768, 131072], [1, 16, 64], [8192, 32768]
else:
    SHAPE = dict(H=4, L=32, R=16, P=16, V=16, page=48)
    CONTEXTS, BATCHES, PREFILL_LENS = [100], [1, 3], [40]
H, L, R, P, V, PAGE = (SHAPE[k] for k in ("H", "L", "R", "P", "V", "page"))
SCALE = (P + R) ** -0.5
# this script's sections are plain lists filled by hand (no per-item records): only the budget clock
# and the JSON writing come from the Report
REPORT = Report(Path(ARGS.out), ARGS.budget_s, {
    "mode": "gpu" if GPU else "smoke", "shape": SHAPE, "dtype": str(DTYPE), "decode": [], "decode_sweep": [],
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


def time_decode(N: int, ctx: int, num_splits: int, **tune) -> dict:
    row = _time_decode(N, ctx, num_splits, **tune)
    if GPU:
        torch.cuda.empty_cache()  # the pools of the largest cases are ~10 GB
    return row


def _time_decode(N: int, ctx: int, num_splits: int, **tune) -> dict:
    bytes_per_call = N * ctx * (L + R) * 2 + N * H * (2 * L + R) * 2
    rot = l2_rotation(bytes_per_call)
    gen = torch.Generator(device=DEV).manual_seed(N * 7 + ctx)
    kv, tables, qs, seq_lens = decode_inputs(N, ctx, rot, gen)
    outs = [torch.empty(N, H, L, dtype=DTYPE, device=DEV) for _ in range(rot)]
    calls = [lambda r=r: mla_decode(qs[r], kv, tables[r], seq_lens, SCALE, kv_lora_rank=L,
                                    num_splits=num_splits, out=outs[r], **tune) for r in range(rot)]
    us = graph_time(calls, reps=30 if GPU else 1)["us_per_call"]
    gbps = bytes_per_call / (us * 1e-6) / 1e9
    return {"N": N, "ctx": ctx, "num_splits": num_splits, **tune, "us": us, "GBps": gbps,
            "pct_copy_bw": 100 * gbps / RESULT["copy_bandwidth"]["GBps"], "rotations": rot}


def bench_decode() -> None:
    for ctx in CONTEXTS:
        for N in BATCHES:
            if not in_budget(f"decode N={N} ctx={ctx}"):
                continue
            row = time_decode(N, ctx, mla_decode_num_splits(N, H, ctx))
            RESULT["decode"].append(row)
            print(f"decode N={N:3d} ctx={ctx:6d} splits={row['num_splits']:3d}  {row['us']:9.2f} us  "
                  f"{row['GBps']:7.0f} GB/s  {row['pct_copy_bw']:5.1f}% of copy")


def sweep_decode() -> None:
    """Split counts around the heuristic's choice, and tile configs, at the 32K context."""
    ctx = CONTEXTS[1] if len(CONTEXTS) > 1 else CONTEXTS[0]
    for N in BATCHES:
        chosen = mla_decode_num_splits(N, H, ctx)
        for s in sorted({max(1, chosen // 2), max(1, chosen * 3 // 4), chosen * 3 // 2, chosen * 2} - {chosen}):
            if in_budget(f"decode sweep N={N} splits={s}"):
                RESULT["decode_sweep"].append(time_decode(N, ctx, s))
    if not GPU:
        return
    N = BATCHES[-1]
    chosen = mla_decode_num_splits(N, H, ctx)
    # (block_n, block_h, num_warps, num_stages); the default is (32, 32, 8, 2) at H=32. All of these
    # build for sm_90 without spills; block_h=16 reads each KV tile twice (once per head block).
    for block_n, block_h, warps, stages in [(32, 32, 8, 3), (64, 32, 8, 2), (64, 32, 8, 3), (32, 16, 4, 2),
                                            (32, 16, 8, 2), (64, 16, 8, 2)]:
        if in_budget(f"decode tile N={N} block_n={block_n} block_h={block_h} warps={warps} stages={stages}"):
            RESULT["decode_sweep"].append(time_decode(N, ctx, chosen, block_n=block_n, block_h=block_h,
                                                      num_warps=warps, num_stages=stages))
    for row in RESULT["decode_sweep"]:
        print(f"  sweep N={row['N']:3d} splits={row['num_splits']:3d} "
              f"{ {k: row[k] for k in ('block_n', 'block_h', 'num_warps', 'num_stages') if k in row} }  "
              f"{row['us']:9.2f} us  {row['pct_copy_bw']:5.1f}% of copy")


def prefill_inputs(lens: list[tuple[int, int]], gen: torch.Generator) -> dict:
    Tq, Tk = sum(q for q, _ in lens), sum(k for _, k in lens)
    cu_q = torch.tensor([0] + [sum(q for q, _ in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(k for _, k in lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=DEV).to(DTYPE)  # noqa: E731
    return dict(q=rnd(Tq, H, P + R), k_nope=rnd(Tk, H, P), k_pe=rnd(Tk, R), v=rnd(Tk, H, V),
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
        if GPU and T == PREFILL_LENS[0]:
            for bm, bn, warps, stages in [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 4)]:
                if not in_budget(f"prefill tile {bm}x{bn}"):
                    continue
                tune = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                ts = time_ms(lambda: mla_prefill(**case, scale=SCALE, **tune), reps=reps, warmup=2)["median_ms"]
                RESULT["prefill_sweep"].append({"T": T, **tune, "ms": ts, "TFLOPs": flops / (ts * 1e-3) / 1e12})
                print(f"  sweep {tune}  {ts:8.2f} ms  {flops / (ts * 1e-3) / 1e12:6.1f} TFLOP/s")


def check_correctness() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    tol = 1e-2 if GPU else 1e-4
    ctx = 4096 if GPU else 120
    N = 16 if GPU else 3
    kv, (table,), (q,), seq_lens = decode_inputs(N, ctx, 1, gen)
    seq_lens = torch.randint(1, ctx + 1, (N,), generator=gen, device=DEV, dtype=torch.int32)
    seq_lens[0] = ctx
    got = mla_decode(q, kv, table, seq_lens, SCALE, kv_lora_rank=L)
    err = rel_err(got, mla_decode_ref(q, kv, table, seq_lens, SCALE, L))
    RESULT["correctness"].append({"name": f"decode N={N} ctx<={ctx}", "rel_err": err, "tol": tol, "ok": err <= tol})
    lens = [(1000, 3000), (512, 512), (1, 700)] if GPU else [(20, 50), (17, 17), (1, 9)]
    case = prefill_inputs(lens, gen)
    err = rel_err(mla_prefill(**case, scale=SCALE), mla_prefill_ref(**case, scale=SCALE))
    RESULT["correctness"].append({"name": f"prefill {lens}", "rel_err": err, "tol": tol, "ok": err <= tol})
    for c in RESULT["correctness"]:
        print(f"correctness {c['name']}: rel_err {c['rel_err']:.2e} (tol {c['tol']:.0e}) {'ok' if c['ok'] else 'FAIL'}")


def main() -> int:
    if GPU:
        RESULT["device"] = torch.cuda.get_device_name()
    RESULT["copy_bandwidth"] = copy_bandwidth()
    print(f"copy bandwidth: {RESULT['copy_bandwidth']['GBps']:.0f} GB/s")
    check_correctness()
    bench_decode()
    bench_prefill()
    sweep_decode()
    RESULT["elapsed_s"] = REPORT.elapsed()
    REPORT.save()
    print(f"wrote {REPORT.path} ({RESULT['elapsed_s']:.1f} s)")
    return 0 if all(c["ok"] for c in RESULT["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
