"""`kda_chunk_prep` (the chunked KDA form's conv + SiLU, decay gate and beta, one launch) at the 48B layer's shape
against copy bandwidth: the indexed windows (conv_idx, any step: a row block whose windows are all natural reads
x directly), the one-sequence path (the taps' rows computed; backend/runner/gpu/kda.py takes it for a step of one
sequence) over tile configs, and the step cut into --seqs sequences (conv_idx as pack_step builds it, the cached
windows first). Every one-sequence variant's outputs are first compared with the indexed default's (they must be
equal bit for bit), the several sequences' with the torch reference.

    python3 benchmarks/kda_prep.py --tokens 8192 32768                 # GPU
    python3 benchmarks/kda_prep.py --smoke                              # CPU interpreter, bit-rot check only

Bytes counted per row: the conv's C channels read and written (qkv dtype), f read (H*D, its dtype), g written
(fp32), b read and beta written; the taps' re-reads of neighbouring rows and the cached windows are not counted.
"""
from __future__ import annotations

import sys

from _timing import Report, copy_bandwidth, default_out, import_k3rt_kernels, kernel_bench_args, time_ms


def _add(p) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="rows of the step (one sequence)")
    p.add_argument("--configs", nargs="*", default=["16x128w4", "32x128w4", "32x256w8", "64x128w8", "64x256w8",
                                                      "128x128w8", "16x256w4"],
                   help="one-sequence tile configs ROWSxCOLSwWARPS (the indexed path runs at the default tile)")
    p.add_argument("--seqs", type=int, nargs="*", default=[8, 64],
                   help="also time the step as this many equal sequences (the indexed path)")


ARGS = kernel_bench_args(__doc__, "kda_prep.json", 200.0, _add)

import torch  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.kda import kda_chunk_prep  # noqa: E402
from k3rt.kernels.short_conv import causal_conv1d_rows  # noqa: E402

GPU = torch.cuda.is_available() and not ARGS.smoke
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float16
H, D, W = (32, 128, 4) if GPU else (2, 32, 4)
C = 3 * H * D
TOKENS = ARGS.tokens if GPU else [40]
REPORT = Report(default_out(ARGS.out, "kda_prep.json"), ARGS.budget_s, {"mode": "gpu" if GPU else "smoke",
                "shape": {"H": H, "D": D, "W": W, "C": C}, "dtype": str(DTYPE), "rows": []})


def inputs(T: int) -> tuple:
    g = torch.Generator(device=DEV).manual_seed(T)
    rnd = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    proj = rnd(T, C + H * D + H).to(DTYPE)  # qkv, f, b as column views of one projection, as the runner has them
    x, f, b = proj[:, :C], proj[:, C:C + H * D], proj[:, C + H * D:]
    pool = rnd(4, W - 1, C).to(DTYPE)
    slots = torch.tensor([2], device=DEV)
    idx = (torch.arange(T, device=DEV)[:, None] + torch.arange(W, device=DEV)[None, :]).contiguous()  # one sequence
    return x, pool, slots, idx, rnd(C, W).contiguous(), f, -rnd(H).abs(), rnd(H * D) * 0.1, b


def several(T: int, n: int, args: tuple) -> tuple:
    """args with the step cut into n equal sequences (the last takes the remainder): a pool slot each, conv_idx over
    ext = [their cached windows ; x] as the runner's pack_step builds it."""
    x, _, _, _, w, f, a_log, dt_bias, b = args
    g = torch.Generator(device=DEV).manual_seed(n)
    pool = torch.randn(n + 1, W - 1, C, generator=g, device=DEV).to(DTYPE)
    slots = torch.arange(1, n + 1, device=DEV)
    lens = [T // n] * (n - 1) + [T - (T // n) * (n - 1)]
    rows, w1, start = [], W - 1, 0
    for i, m in enumerate(lens):
        rel = torch.arange(m)[:, None] - w1 + torch.arange(W)[None, :]
        rows.append(torch.where(rel < 0, i * w1 + rel + w1, n * w1 + start + rel))
        start += m
    return x, pool, slots, torch.cat(rows).to(DEV).contiguous(), w, f, a_log, dt_bias, b


def config(name: str) -> dict:
    rows, rest = name.split("x")
    cols, warps = rest.split("w")
    return dict(block_t=int(rows), block_c=int(cols), num_warps=int(warps))


def main() -> int:
    bw = copy_bandwidth()["GBps"] if GPU else float("nan")
    REPORT.result["copy_GBps"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s")
    ok = True
    for T in TOKENS:
        args = inputs(T)
        nbytes = T * (2 * C * args[0].element_size() + H * D * (args[5].element_size() + 4) + H * (2 + 4))
        want = kda_chunk_prep(*args)
        # (name, the call's arguments, its keywords, the conv output it must give, its row's extra fields)
        cases = [("indexed", args, {}, want[0], {})] + [
            (f"one_seq {c}", args, {"one_seq": True, **config(c)}, want[0], {})
            for c in (ARGS.configs if GPU else ["16x128w4"])]
        for n in (ARGS.seqs if GPU else [3]):
            many = several(T, n, args)
            cases.append((f"indexed, {n} sequences", many, {}, causal_conv1d_rows(*many[:5]), {"seqs": n}))
        for name, call, kw, expect, extra in cases:
            if REPORT.over_budget():
                print(f"skipped (budget): T={T} {name}")
                continue
            got = kda_chunk_prep(*call, **kw)
            if call is args:  # the one-sequence variants: the indexed default's bits
                same = all(torch.equal(a, e) for a, e in zip(got, want))
            else:  # several sequences: the torch reference's conv, to 1% of its largest value
                same = bool((got[0].float() - expect.float()).abs().max() <= 1e-2 * expect.float().abs().max())
            ok &= same
            t = time_ms(lambda: kda_chunk_prep(*call, **kw), reps=20 if GPU else 1, warmup=3 if GPU else 0)
            row = {"T": T, "variant": name, **kw, **extra, "ms": t["median_ms"], "equal": same, "bytes": nbytes,
                   "pct_copy": 100 * nbytes / (t["median_ms"] * 1e-3) / 1e9 / bw if GPU else None}
            REPORT.result["rows"].append(row)
            REPORT.save()
            pct = f"{row['pct_copy']:5.1f} % of copy" if GPU else ""
            print(f"T={T:6d} {name:22s} {t['median_ms']:8.4f} ms {pct}  checked: {same}")
    REPORT.save()
    print(f"wrote {REPORT.path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
