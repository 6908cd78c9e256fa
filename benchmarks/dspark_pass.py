#!/usr/bin/env python3
"""The DSpark drafter's serving pass (issue 16: <= 0.15x a plain decode step): its left-to-right steps as torch
ops (~25 per draft) against the fused kernel (kernels/spec/triton_draft.py, one launch for all k drafts).

    python3 benchmarks/dspark_pass.py                 # H200: k3-tiny + its shipped drafter, bf16, batch 1 4 16 64
    python3 benchmarks/dspark_pass.py --smoke         # CPU, Triton interpreter, fp32: op counts and the check only

In order, on the target's device (k3-tiny and models/k3-tiny-dspark; random target states and token ids):
  1. ops: one `propose` at batch 1 and at the largest batch, and one `greedy_pass` (the pass alone) at batch 1,
     under the torch profiler (backend/bench/op_count.py), per variant: top-level aten ops (`aten_ops`), those
     that launch work (`launching`: not a view, an alias or an allocation), Triton launches (`triton`), and on
     CUDA the device kernels the profiler saw (`device_kernels`);
  2. check: the fused pass against the torch pass in fp32 (the drafter built over an fp32 copy of the target:
     tokens equal, confidences within 1e-4), then in the serving dtype (bf16 on CUDA: >= 95% of requests with
     all k drafts equal; the Markov dot product's sum order may move a near-tie by one bf16 rounding, and the
     torch path's confidence MLP rounds to bf16 where the kernel stays in fp32);
  3. times (CUDA only), per batch: `propose` wall time (host input build + pass + the one sync: what the engine
     pays) and the pass alone (CUDA events), eager and graphed (graph.py buckets), torch and fused steps;
     `vs_plain` = propose time / --plain-step-ms (a plain k3-tiny decode step; 1.46 ms measured on the H200
     with `k3rt bench spec`, pass the one measured beside this run); then the fused kernel alone on one pass's
     inputs, replayed from a CUDA graph, per form and tile (BLOCK_V x warps): one program per request (the
     default `tiles(V, R)`, then 256x8, 512x16, 1024x8) and the vocabulary split over programs
     (triton_draft_split.py: `split_tile(V, R)`, then 256x4, 1024x8, 2048x16), with whether its tokens equal
     the one-program default's.
JSON to --out (default $OUT/dspark_pass.json) and to stdout's first line, then a markdown table; --budget-s
bounds the run (items past it are skipped and say so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64], help="requests per pass")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--plain-step-ms", type=float, default=1.46, help="a plain k3-tiny decode step (for vs_plain)")
    p.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter, fp32: ops and check only")
    p.add_argument("--budget-s", type=float, default=300.0, help="skip remaining items after this many seconds")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if not a.batch or min(a.batch) < 1 or max(a.batch) > 64:
        p.error(f"--batch: sizes in [1, 64] (the drafter's graph buckets), got {a.batch}")
    if a.smoke:
        a.batch, a.reps = [1, 3], 2
        os.environ["TRITON_INTERPRET"] = "1"  # before triton sees any @jit
    return a


ARGS = _args()

import torch  # noqa: E402
from _timing import Report, default_out, graph_time, time_ms  # noqa: E402

from k3rt.backend.bench.op_count import count_ops  # noqa: E402
from k3rt.backend.models.loader import load_model  # noqa: E402
from k3rt.backend.spec.base import DraftQuery  # noqa: E402
from k3rt.backend.spec.dspark.drafter import DSparkDrafter  # noqa: E402
from k3rt.models import MODELS_DIR  # noqa: E402

DRAFTER = MODELS_DIR / "k3-tiny-dspark"
def _queries(drafter: DSparkDrafter, n: int, seed: int) -> list[DraftQuery]:
    cfg = drafter.model.cfg
    g = torch.Generator().manual_seed(seed)
    width = len(cfg.target_layers) * cfg.target_hidden_size
    ids = torch.randint(0, cfg.vocab_size, (n, cfg.context_len + 1), generator=g)
    states = torch.randn(n, cfg.context_len, width, generator=g).to(drafter.embed.device, drafter.embed.dtype)
    return [DraftQuery(i, ids[i].tolist(), cfg.context_len, cfg.block_size, states[i]) for i in range(n)]


def _pass_fn(drafter: DSparkDrafter, queries: list[DraftQuery]):
    """The pass alone (no input build, no sync): a graph replay when the drafter has graphs, else greedy_pass."""
    ctx, anchors, extra = drafter._inputs(queries)
    if drafter.graphs is not None:
        return lambda: drafter.graphs.draft(ctx, anchors, **extra)
    return lambda: drafter.model.greedy_pass(ctx, anchors, drafter.embed, drafter.lm_head, fused=drafter.fused, **extra)


def _check(target, dtype_name: str) -> dict:
    """Fused against torch steps on one batch of the largest size, in the given dtype."""
    torch_steps = DSparkDrafter.from_folder(DRAFTER, target, fused=False, confidence_threshold=0.0)
    fused = DSparkDrafter.from_folder(DRAFTER, target, fused=True, confidence_threshold=0.0)
    queries = _queries(fused, max(ARGS.batch), seed=1)
    ctx, anchors, extra = fused._inputs(queries)
    got = fused.model.greedy_pass(ctx, anchors, fused.embed, fused.lm_head, fused=True, **extra)
    want = torch_steps.model.greedy_pass(ctx, anchors, torch_steps.embed, torch_steps.lm_head, fused=False, **extra)
    same = (got[0] == want[0]).float().mean().item()
    rows = (got[0] == want[0]).all(1).float().mean().item()
    conf_err = (got[1] - want[1]).abs().max().item()
    # bf16: a request whose drafts part at a near-tie keeps parting (each step reads the token before it)
    ok = same == 1.0 and conf_err < 1e-4 if dtype_name == "float32" else rows >= 0.95
    return {"dtype": dtype_name, "tokens_equal": same, "rows_equal": rows, "conf_max_abs_err": conf_err, "ok": ok}


def main() -> None:
    cuda = torch.cuda.is_available() and not ARGS.smoke
    device = "cuda" if cuda else "cpu"
    rep = Report(default_out(ARGS.out, "dspark_pass.json"), ARGS.budget_s,
                 {"device": torch.cuda.get_device_name() if cuda else "cpu", "plain_step_ms": ARGS.plain_step_ms})
    dtype = "bfloat16" if cuda else "float32"
    target = load_model("k3-tiny", dtype=dtype, device=device, progress=False)
    fp32 = target if dtype == "float32" else load_model("k3-tiny", dtype="float32", device=device, progress=False)
    rep.item("check", "fp32", lambda: _check(fp32, "float32"))
    if fp32 is not target:
        rep.item("check", dtype, lambda: _check(target, dtype))
    del fp32
    variants = {"torch": dict(fused=False), "fused": dict(fused=True)}
    drafters = {name: DSparkDrafter.from_folder(DRAFTER, target, **kw) for name, kw in variants.items()}
    for n in sorted({1, max(ARGS.batch)}):
        for name, d in drafters.items():
            q = _queries(d, n, seed=2)
            rep.item("ops", f"propose-{name}-b{n}",
                     lambda: {"batch": n, "variant": name, **count_ops(lambda: d.propose(q))})
    for name, d in drafters.items():
        q = _queries(d, 1, seed=2)
        rep.item("ops", f"pass-{name}-b1", lambda: {"batch": 1, "variant": f"{name} (pass only)",
                                                     **count_ops(_pass_fn(d, q))})
    if cuda:
        sizes = tuple(sorted(set(ARGS.batch)))
        for name, kw in variants.items():
            drafters[f"{name}+graphs"] = DSparkDrafter.from_folder(DRAFTER, target, graph_sizes=sizes, **kw)
        for n in ARGS.batch:
            for name, d in drafters.items():
                q = _queries(d, n, seed=3)

                def timed() -> dict:
                    t_pass = time_ms(_pass_fn(d, q), reps=ARGS.reps)["median_ms"]
                    d.propose(q)
                    walls = []
                    for _ in range(ARGS.reps):
                        t0 = time.perf_counter()
                        d.propose(q)
                        walls.append((time.perf_counter() - t0) * 1e3)
                    wall = sorted(walls)[len(walls) // 2]
                    return {"batch": n, "variant": name, "pass_ms": t_pass, "propose_ms": wall,
                            "vs_plain": wall / ARGS.plain_step_ms}
                rep.item("times", f"{name}-b{n}", timed)
        # the fused kernel alone on one pass's inputs, per form and tile (BLOCK_V, warps), replayed from a CUDA
        # graph (the split form's 2k launches are what the drafter's graph replays); tokens checked against the
        # one-program default's
        from k3rt.kernels.spec.triton_draft import greedy_draft, split_tile, tiles
        d = drafters["fused"]
        cfg = d.model.cfg
        forms = [(False, t) for t in dict.fromkeys([tiles(cfg.vocab_size, cfg.markov_rank), (256, 8), (512, 16),
                                                    (1024, 8)])]
        forms += [(True, t) for t in dict.fromkeys([split_tile(cfg.vocab_size, cfg.markov_rank), (256, 4), (1024, 8),
                                                    (2048, 16)])]
        for n in ARGS.batch:
            ctx, anchors, extra = d._inputs(_queries(d, n, seed=4))
            inputs = d.model.greedy_step_inputs(ctx, anchors, d.embed, d.lm_head, **extra)
            want = greedy_draft(*inputs, split=False)[0]
            for split, tile in forms:
                form = "split" if split else "one-program"

                def timed_tile() -> dict:
                    same = bool(torch.equal(greedy_draft(*inputs, tile=tile, split=split)[0], want))
                    us = graph_time([lambda: greedy_draft(*inputs, tile=tile, split=split)],
                                    reps=ARGS.reps)["us_per_call"]
                    return {"batch": n, "variant": f"kernel {form} {tile[0]}x{tile[1]}", "kernel_graph_us": us,
                            "tokens_as_default": same}
                rep.item("times", f"kernel-{form}-{tile[0]}x{tile[1]}-b{n}", timed_tile)
    print(json.dumps(rep.result))
    print("\n| section | variant | batch | values |\n|---|---|---|---|")
    for section in ("check", "ops", "times"):
        for r in rep.result.get(section, []):
            vals = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                             if k not in ("name", "variant", "batch"))
            print(f"| {section} | {r.get('variant', r['name'])} | {r.get('batch', '')} | {vals} |")
    failed = [r for r in rep.result.get("check", []) if not r.get("ok")]
    if failed:
        print(f"CHECK FAILED: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
