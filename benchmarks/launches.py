#!/usr/bin/env python3
"""How many launches a k3-tiny forward issues (issue 16: a batch-1 speculative round is launch-bound, ~4.5 us per
kernel on the H200, session 23): the decode form (B one-token rows), the verify graphs' form (B runs of K + 1 rows)
and the DSpark drafter's serving pass, each counted by backend/bench/op_count.py: top-level torch ops that launch
work (`launching`), Triton launches (`triton`) and on CUDA the device kernels the profiler saw. The forwards are
counted with the launch cuts on (the default KernelConfig) and off (`moe_latent_fusion`, `moe_fused_router`:
LatentMoE's fused projections and norm, the small router's logits in its top-k launch; the MLA gate kernel,
the verify form's shared per-row tables and the pair blocks have no switch).

    python3 benchmarks/launches.py                                  # CPU: kernels under the Triton interpreter
    python3 benchmarks/launches.py --device cuda --dtype bfloat16   # also the device kernels per forward
    python3 benchmarks/launches.py --smoke                          # a tiny random k3 checkpoint (bit-rot check)

JSON to --out (default $OUT/launches.json, with each form's launches by op or kernel name), then a markdown table
and the by-name lists of the forms with the cuts on. Counts only: the times are decode.py's
(--model k3-tiny --variants unfused ...) and spec_round.py's.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="k3-tiny", help="a shipped model's name or a checkpoint folder (k3 arch)")
    p.add_argument("--no-drafter", action="store_true",
                   help="skip the drafter's pass (it is k3-tiny's shipped DSpark drafter: k3-tiny only)")
    p.add_argument("--device", default="cpu", help="cpu (the Triton interpreter) or cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences per forward")
    p.add_argument("--spec-tokens", type=int, default=7, help="K: a verify run is K + 1 rows")
    p.add_argument("--budget-s", type=float, default=1200.0,
                   help="skip remaining items after this many seconds (the CPU interpreter takes 20-60 s a forward)")
    p.add_argument("--smoke", action="store_true",
                   help="bit-rot check: a tiny random k3 checkpoint, fp32 on the CPU, batch 1, no drafter")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if a.smoke:
        a.device, a.dtype, a.batch, a.no_drafter = "cpu", "float32", [1], True
    if not a.device.startswith("cuda"):
        os.environ["TRITON_INTERPRET"] = "1"  # before triton sees any @jit
    return a


ARGS = _args()

import torch  # noqa: E402
from _timing import Report, default_out  # noqa: E402

from k3rt.backend.bench.op_count import count_ops  # noqa: E402
from k3rt.backend.device import to_device  # noqa: E402
from k3rt.backend.engine import Engine  # noqa: E402
from k3rt.backend.runner.gpu.step import StepSeq, step_views  # noqa: E402
from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from k3rt.models import MODELS_DIR, resolve_model_dir  # noqa: E402

CUTS_OFF = dict(moe_latent_fusion=False, moe_fused_router=False)


def _seqs(eng: Engine, batch: int, rows: int) -> list[StepSeq]:
    """batch sequences at context 20 feeding `rows` tokens each (rows > 1: verify runs)."""
    pool = eng.pool
    return [StepSeq([7] * rows, 20, pool.allocate(2), pool.allocate(eng.layout.pages_per_state_set), True,
                    verify=rows > 1) for _ in range(batch)]


def _forward_counts(eng: Engine, batch: int, rows: int, cuts: bool) -> dict:
    runner = eng.runner
    default = runner.fwd.k
    # (a tree without the switches, e.g. an older commit's: its own default only)
    runner.fwd.k = default if cuts else replace(default, **{k: v for k, v in CUTS_OFF.items() if hasattr(default, k)})
    seqs = _seqs(eng, batch, rows)
    try:
        if rows == 1:
            step = runner._build(seqs, [])
        else:  # the verify graphs' form, eagerly (what each verify graph and device round replays)
            meta, (h64, h32) = runner._pack(seqs, row_queries=True)
            step = step_views(meta, to_device(h64, runner.device), to_device(h32, runner.device))
        c = count_ops(lambda: runner.fwd(step, decode=rows == 1), names=True)
    finally:
        runner.fwd.k = default
        for s in seqs:  # the pages back, so that every item of a run finds its own (no OutOfPages at batch 4)
            eng.pool.unref(s.block_table + s.state_pages)
    return {"batch": batch, "rows": batch * rows, "cuts": cuts, **c, "launches": c["launching"] + c["triton"]}


def _drafter_counts(eng: Engine, batch: int) -> dict:
    """The drafter's serving pass alone (greedy, fused) on random target states and token ids."""
    from k3rt.backend.spec.base import DraftQuery
    from k3rt.backend.spec.dspark.drafter import DSparkDrafter

    d = DSparkDrafter.from_folder(MODELS_DIR / "k3-tiny-dspark", eng.runner.fwd.model, fused=True)
    cfg = d.model.cfg
    g = torch.Generator().manual_seed(batch)
    width = len(cfg.target_layers) * cfg.target_hidden_size
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.context_len + 1), generator=g)
    states = torch.randn(batch, cfg.context_len, width, generator=g).to(d.embed.device, d.embed.dtype)
    ctx, anchors, extra = d._inputs([DraftQuery(i, ids[i].tolist(), cfg.context_len, cfg.block_size, states[i])
                                     for i in range(batch)])
    c = count_ops(lambda: d.model.greedy_pass(ctx, anchors, d.embed, d.lm_head, fused=True, **extra), names=True)
    return {"batch": batch, **c, "launches": c["launching"] + c["triton"]}


def main() -> None:
    rep = Report(default_out(ARGS.out, "launches.json"), ARGS.budget_s, {"args": {k: str(v) for k, v in vars(ARGS).items()}})
    if ARGS.smoke:
        import tempfile

        from k3rt.backend.models.tiny import make_tiny

        md = make_tiny(Path(tempfile.mkdtemp()) / "k3", arch="k3", dtype="float32", seed=4)
    else:
        md = resolve_model_dir(ARGS.model)
    bmax = max(ARGS.batch)
    eng = Engine(EngineConfig(model=str(md), dtype=ARGS.dtype, device=ARGS.device, runner="gpu", cuda_graphs=False,
                              scheduler=SchedulerConfig(max_running=bmax),
                              cache=CacheConfig(num_pages=8 * bmax + 16)))
    with torch.no_grad():
        for b in ARGS.batch:
            for form, rows in (("decode", 1), ("verify", ARGS.spec_tokens + 1)):
                for cuts in (True, False):
                    rep.item(form, f"b{b} cuts={'on' if cuts else 'off'}",
                             lambda b=b, rows=rows, cuts=cuts: _forward_counts(eng, b, rows, cuts))
            if not ARGS.no_drafter:
                rep.item("drafter_pass", f"b{b}", lambda b=b: _drafter_counts(eng, b))
    print(f"\n| section | batch | launch cuts | torch launching | triton | launches | device kernels |\n"
          f"|---|---:|---|---:|---:|---:|---:|")
    for sec in ("decode", "verify", "drafter_pass"):
        for r in rep.result.get(sec, []):
            if "launches" in r:
                cuts = "" if "cuts" not in r else ("on" if r["cuts"] else "off")
                print(f"| {sec} | {r['batch']} | {cuts} | {r['launching']} | {r['triton']} | {r['launches']} | "
                      f"{r.get('device_kernels', '')} |")
    # where each form's launches come from (the cuts on; JSON has every row's)
    for sec in ("decode", "verify", "drafter_pass"):
        for r in rep.result.get(sec, []):
            if "names" in r and r.get("cuts", True):
                top = ", ".join(f"{n.split('::')[-1]} {c}" for n, c in r["names"].items())
                print(f"\n{sec} b{r['batch']}: {top}")


if __name__ == "__main__":
    main()
