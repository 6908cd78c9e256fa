"""`kda_decode_multi` (the verify graphs' KDA: up to R tokens per sequence in one launch, kernels/kda/triton_multi.py)
in its two forms, the token loop (each token's loads and conv inside the loop, the output norm a row at a time) and
`hoist` (every token's conv, norms and gates as [R, D] tiles first; the loop only the recurrence; the norm over all
rows at once), at k3-tiny's KDA shape (H=4, D=64: 13.5 us a launch on the H200 in session 32, 12 launches per
speculative round) and the 48B's (H=32, D=128), against the single-token decode kernel.

Per shape and batch N: the verify pass (commit=False, the gated output norm) and the commit (commit=True, no norm)
for n = 1 .. R tokens run, each form at each warp count and V split, CUDA-graph timed (50 launches per graph). The
two forms are first checked against each other (outputs within 1e-6 of the largest value, states likewise after a
commit) at every shape.

    python3 benchmarks/kda_multi.py                       # GPU
    python3 benchmarks/kda_multi.py --smoke               # CPU interpreter: the check only, one tiny shape
"""
from __future__ import annotations

import sys

from _timing import Report, default_out, graph_time, import_k3rt_kernels, kernel_bench_args


def _add(p) -> None:
    p.add_argument("--shapes", nargs="+", default=["4x64", "32x128"], help="HxD of the KDA layer")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="sequences N")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8], help="tokens n each sequence runs (of R = 8)")
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])


ARGS = kernel_bench_args(__doc__, "kda_multi.json", 240.0, _add)

import torch  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.kda.triton_decode import default_v_split, kda_decode, kda_decode_workspace  # noqa: E402
from k3rt.kernels.kda.triton_multi import kda_decode_multi  # noqa: E402

GPU = torch.cuda.is_available() and not ARGS.smoke
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
R, W, LOWER_BOUND = 8, 4, -5.0
REPORT = Report(default_out(ARGS.out, "kda_multi.json"), ARGS.budget_s,
                {"mode": "gpu" if GPU else "smoke", "R": R, "checks": [], "rows": []})


def inputs(N: int, H: int, D: int, seed: int = 0) -> dict:
    """One verify block's inputs: qkv/f/b as column views of one projection (the runner's layout), N + 2 slots."""
    g = torch.Generator().manual_seed(seed)
    P = H * D
    proj = torch.randn(N * R, 4 * P + H, generator=g).to(DTYPE).to(DEV)
    return dict(qkv_pre=proj[:, :3 * P].view(N, R, 3 * P),
                conv_weight=(torch.randn(3 * P, W, generator=g) * 0.5).to(DEV),
                conv_state=torch.randn(N + 2, W - 1, 3 * P, generator=g).to(DTYPE).to(DEV),
                f=proj[:, 3 * P:4 * P].view(N, R, P), A_log=(torch.randn(H, generator=g) * 0.5).to(DEV),
                dt_bias=(torch.randn(P, generator=g) * 0.1).to(DEV), b=proj[:, 4 * P:].view(N, R, H),
                state=(torch.randn(N + 2, H, D, D, generator=g) * 0.5).to(DEV))


def check(case: dict, N: int, H: int, D: int, norm: dict, slots, ws) -> bool:
    """The hoisted form against the token loop: the pass's outputs, then a commit's outputs and states."""
    same = True
    for commit in (False, True):
        got = {}
        for hoist in (False, True):
            c = {k: v.clone() for k, v in case.items()}
            n = torch.tensor([R - i % R for i in range(N)], dtype=torch.int32, device=DEV)  # uneven runs
            o = kda_decode_multi(**c, slot_indices=slots, num_tokens=n, commit=commit, lower_bound=LOWER_BOUND,
                                 workspace=ws, hoist=hoist, **({} if commit else norm))
            got[hoist] = (o.float(), c["state"])
        for a, b in zip(got[True], got[False]):
            tol = 1e-6 * float(b.abs().max().clamp(min=1))
            ok = bool((a - b).abs().max() <= tol) if GPU else torch.equal(a, b)
            REPORT.result["checks"].append({"H": H, "D": D, "N": N, "commit": commit, "ok": ok})
            same &= ok
    return same


def main() -> int:
    ok = True
    shapes = [tuple(map(int, s.split("x"))) for s in (ARGS.shapes if GPU else ["2x32"])]
    for H, D in shapes:
        for N in (ARGS.batch if GPU else [2]):
            case = inputs(N, H, D, seed=N)
            slots = torch.arange(N, device=DEV, dtype=torch.int32)
            ws = kda_decode_workspace(N, H, DEV)
            norm = dict(o_gate=torch.randn(N, R, H, D, device=DEV).to(DTYPE), o_norm_weight=torch.ones(D, device=DEV))
            same = check(case, N, H, D, norm, slots, ws)
            ok &= same
            print(f"H={H} D={D} N={N}: hoist equals the token loop: {same}")
            if not GPU:
                continue
            least = max(D // 32, 1)  # the state tile in registers: at most 32 value columns a program
            splits = sorted({least, 2 * least, max(default_v_split(N, H, D), least)})
            q1, f1, b1 = (case[k][:, 0].contiguous() for k in ("qkv_pre", "f", "b"))
            dec = graph_time([lambda: kda_decode(q1, case["conv_weight"], case["conv_state"], f1, case["A_log"],
                                                 case["dt_bias"], b1, case["state"], slots, lower_bound=LOWER_BOUND,
                                                 workspace=ws, o_gate=norm["o_gate"][:, 0].contiguous(),
                                                 o_norm_weight=norm["o_norm_weight"])] * 50)
            REPORT.result["rows"].append({"H": H, "D": D, "N": N, "kernel": "kda_decode", "us": dec["us_per_call"]})
            print(f"H={H} D={D} N={N} kda_decode (one token, norm) {dec['us_per_call']:.2f} us")
            for n in ARGS.tokens:
                runs = torch.full((N,), n, dtype=torch.int32, device=DEV)
                for kind, commit, kw in (("pass", False, norm), ("commit", True, {})):
                    for v_split in splits:
                        for warps in ARGS.warps:
                            for hoist in (False, True):
                                if REPORT.over_budget():
                                    continue
                                t = graph_time([lambda: kda_decode_multi(
                                    **case, slot_indices=slots, num_tokens=runs, commit=commit,
                                    lower_bound=LOWER_BOUND, workspace=ws, v_split=v_split, num_warps=warps,
                                    hoist=hoist, **kw)] * 50)
                                REPORT.result["rows"].append({"H": H, "D": D, "N": N, "n": n, "kind": kind,
                                                              "v_split": v_split, "warps": warps, "hoist": hoist,
                                                              "us": t["us_per_call"]})
                    best = {h: min((r for r in REPORT.result["rows"] if r.get("kind") == kind and r["H"] == H
                                    and r["N"] == N and r["n"] == n and r["hoist"] == h), key=lambda r: r["us"],
                                   default=None) for h in (False, True)}
                    print(f"H={H} D={D} N={N} n={n} {kind:6s} " + "  ".join(
                        f"{'hoist' if h else 'loop'} {b['us']:.2f} us (split {b['v_split']}, {b['warps']} warps)"
                        for h, b in best.items() if b is not None))
            REPORT.save()
    REPORT.save()
    print(f"wrote {REPORT.path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
