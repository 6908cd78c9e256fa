#!/usr/bin/env python3
"""Host cost of the GPU runner's eager mixed and prefill steps (issue 18): what the host issues per step.

    OMP_NUM_THREADS=1 python3 benchmarks/step_host_cost.py                   # CPU, Triton launches counted, not run
    OMP_NUM_THREADS=1 python3 benchmarks/step_host_cost.py --baseline HEAD~3 # the same, this tree vs an older commit
    python3 benchmarks/step_host_cost.py --device cuda --width full          # the H200: real kernels, real issue time

The model has the Kimi-Linear-48B layer structure (27 layers: 20 KDA, 7 MLA, 26 MoE, one dense FFN) at tiny
widths (--width tiny: hidden 64, 4 heads of 16) or the real ones (--width full, GPU only). Steps:
  mixed    --batch plain decodes (context --context) beside one new request's --prefill-token chunk, eager (the
           step a server runs whenever a request arrives while others decode);
  prefill  that chunk alone.
Per step: torch ops dispatched (a TorchDispatchMode counts every aten call; "of which launch work": neither a view
nor an allocation, i.e. a device kernel each on the GPU), Triton launches (JITFunction.run
counted; on the CPU the launch is replaced by a no-op under TRITON_INTERPRET=1, so only the host side runs), and
host ms: the median (and min) time until `fwd` returns (on CUDA, the launches issued: the device is synchronized before
each call, so the time is the host's; "wall_ms" adds the wait for the device). The same three for one KDA layer
alone (`kda_attend` of the first KDA layer on the step: the part the KDA path owns) and cProfile's top functions
by own time. First (--check; on by default on CUDA) every attention layer of each step (KDA, MLA) is checked
against the torch-op path (KernelConfig(triton=False)) on the same inputs and cache contents; a failed check
exits 1. --baseline REV runs this script again on the tree of commit REV (git archive into a temporary
folder, imported in place of this checkout) and prints both in one table. JSON to --out and a markdown table to
stdout; items past --budget-s are skipped.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--width", choices=["tiny", "full"], default="tiny", help="layer widths (full: GPU only)")
    p.add_argument("--batch", type=int, default=64, help="plain decodes beside the chunk")
    p.add_argument("--prefill", type=int, default=32, help="tokens of the new request's chunk")
    p.add_argument("--context", type=int, default=100, help="tokens already in each decode's cache")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--check", choices=["auto", "on", "off"], default="auto",
                   help="first check each step's attention layers against the torch-op path (auto: on CUDA only; on "
                        "the CPU the kernels then really run in the interpreter, slowly)")
    p.add_argument("--profile-top", type=int, default=12, help="cProfile functions listed per step (0: none)")
    p.add_argument("--baseline", default=None, metavar="REV", help="also measure commit REV's tree (git)")
    p.add_argument("--src", type=Path, default=None, help=argparse.SUPPRESS)  # the tree to import (--baseline)
    p.add_argument("--budget-s", type=float, default=300.0, help="skip remaining items after this many seconds")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: none)")
    return p.parse_args()


ARGS = _args()
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton sees any @jit: the launches are then counted no-ops
if ARGS.width == "full" and ARGS.device != "cuda":
    raise SystemExit("--width full: GPU only (--device cuda)")


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Import the k3rt packages from another checkout (setup.py's directory mapping), ahead of the install."""

    def __init__(self, root: Path) -> None:
        self.dirs = {"k3rt": root / "k3rt", "k3rt.backend": root / "backend", "k3rt.kernels": root / "kernels",
                     "k3rt.frontend": root / "frontend"}

    def find_spec(self, name, path, target=None):
        d = self.dirs.get(name)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])


if ARGS.src is not None:
    sys.meta_path.insert(0, _TreeFinder(ARGS.src))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


_NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "promote_types"}


class _OpCount(TorchDispatchMode):
    """Every aten op (n), and those that launch device work (kernels: neither a view nor an allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


class _Launches:
    """Counts Triton launches; on the CPU (interpreter) they do nothing, on CUDA they run."""

    def __init__(self, run: bool) -> None:
        if os.environ.get("TRITON_INTERPRET") == "1":
            from triton.runtime.interpreter import InterpretedFunction as cls
        else:
            from triton.runtime.jit import JITFunction as cls
        self.n, self.cls, self.orig, self.run = 0, cls, cls.run, run
        counter = self

        def run_fn(fn, *args, **kwargs):
            counter.n += 1
            return counter.orig(fn, *args, **kwargs) if counter.run else None

        cls.run = run_fn


def _config(width: str):
    from k3rt.model_config import parse_model_config
    from k3rt.presets import KIMI_LINEAR_48B

    raw = dict(KIMI_LINEAR_48B)
    if width == "tiny":  # the 48B's layer structure, tiny widths
        raw.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                   head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=8,
                   num_experts_per_token=2, moe_intermediate_size=32)
        raw["linear_attn_config"] = {**raw["linear_attn_config"], "num_heads": 4, "head_dim": 16}
    return parse_model_config(raw)


def _measure(fn, kda_fn, launches: _Launches, cuda: bool) -> dict:
    """ops / launches / host ms of fn (a step) and of kda_fn (one KDA layer), cProfile top of fn."""
    import cProfile
    import pstats
    import statistics

    out: dict = {}
    for name, f in (("step", fn), ("kda_layer", kda_fn)):
        f()  # warm: first-call imports and Triton's compile cache
        if cuda:
            torch.cuda.synchronize()
        launches.n = 0
        with _OpCount() as c:
            f()
        row = {"torch_ops": c.n, "torch_kernel_ops": c.kernels, "triton_launches": launches.n}
        host, wall = [], []
        for _ in range(ARGS.reps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            host.append((time.perf_counter() - t) * 1e3)
            if cuda:
                torch.cuda.synchronize()
                wall.append((time.perf_counter() - t) * 1e3)
        row["host_ms"], row["host_ms_min"] = statistics.median(host), min(host)
        if wall:
            row["wall_ms"] = statistics.median(wall)
        out[name] = row
    if ARGS.profile_top:
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        if cuda:
            torch.cuda.synchronize()
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:ARGS.profile_top]
        out["profile"] = [{"function": f"{Path(f).name}:{line} {fn_name}", "calls": nc, "own_ms": tt * 1e3,
                           "cum_ms": ct * 1e3} for (f, line, fn_name), (_, nc, tt, ct, _) in rows]
    return out


def measure_tree() -> dict:
    """This process's k3rt (this checkout, or --src): every step's numbers."""
    from k3rt.backend.cache.pool import PagePool
    from k3rt.backend.models.random_init import random_model
    from k3rt.backend.runner.gpu.kda import KdaWeights, kda_attend, kda_project
    from k3rt.backend.runner.gpu.ops import KernelConfig
    from k3rt.backend.runner.gpu.runner import GpuModelRunner
    from k3rt.backend.runner.gpu.step import StepSeq
    from k3rt.cache_layout import compute_layout

    cuda = ARGS.device == "cuda"
    dev = torch.device(ARGS.device)
    cfg = _config(ARGS.width)
    dtype = "bfloat16" if cuda else "float32"
    model = random_model(cfg, dtype=dtype, device=dev, progress=False)
    layout = compute_layout(cfg, kv_dtype=dtype, conv_dtype=dtype)
    per_seq = -(-(ARGS.context + 1) // layout.block_size) + layout.pages_per_state_set
    longest = -(-ARGS.prefill // layout.block_size) + layout.pages_per_state_set
    pool = PagePool(layout, ARGS.batch * per_seq + longest + 2, device=dev)
    launches = _Launches(run=cuda)
    runner = GpuModelRunner(model, pool, kernels=KernelConfig(triton=True), cuda_graphs=False)
    g = torch.Generator().manual_seed(0)
    per_set = layout.pages_per_state_set
    decs = [StepSeq([int(torch.randint(3, 500, (1,), generator=g))], ARGS.context,
                    pool.allocate(-(-(ARGS.context + 1) // layout.block_size)), pool.allocate(per_set), True)
            for _ in range(ARGS.batch)]
    chunk = StepSeq(torch.randint(3, 500, (ARGS.prefill,), generator=g).tolist(), 0,
                    pool.allocate(-(-ARGS.prefill // layout.block_size)), pool.allocate(per_set), True)
    fwd = runner.fwd
    i, w = next((i, w) for i, w in fwd.prepared.items() if isinstance(w, KdaWeights))
    attn = fwd.layers[i].self_attn
    conv, rec = pool.conv[w.tensor], pool.rec[w.tensor]
    result = {}
    for name, seqs in (("mixed", decs + [chunk]), ("prefill", [chunk])):
        if time.perf_counter() - T0 > ARGS.budget_s:
            result[name] = {"skipped": "budget"}
            continue
        check = None
        if ARGS.check == "on" or (ARGS.check == "auto" and cuda):
            launches.run = True
            check = _check(runner, pool, seqs, KernelConfig)
            launches.run = cuda
        step = runner._build(seqs, [])
        x = torch.randn(step.num_tokens, cfg.hidden_size, generator=g).to(dev, w.w_in.dtype)
        parts = kda_project(attn, w, x, fwd.k)
        result[name] = _measure(lambda step=step: fwd(step),
                                lambda step=step, parts=parts: kda_attend(attn, w, *parts, step, conv, rec, fwd.k,
                                                                          decode=False, workspace=fwd.kda_workspace),
                                launches, cuda)
        result[name]["kda_split"] = step.kda_split is not None
        if check is not None:
            result[name]["check"] = check
    return result


def _check(runner, pool, seqs, kernel_config) -> dict:
    """Every attention layer of the step (`GpuForward.attention`: KDA or MLA with its o_proj, the code this script
    is about) with the kernels against the torch-op path (KernelConfig(triton=False), the step built as the
    runner builds it for each path), on the same random input rows and the same random cache contents (every page
    of the step filled through the view its role uses, restored before each run): the largest relative error of
    a layer's output and of the cache views it leaves (conv and recurrent states, MLA latents), and ok. Per layer,
    not the logits: random routers flip near-tied experts between two paths, which says nothing about these."""
    dev = pool.tensors[0].device
    g = torch.Generator(device=dev).manual_seed(1)
    for s in seqs:
        for page in s.block_table:
            for t in range(len(pool.tensors)):
                pool.mla[t][page].normal_(0.0, 1.0, generator=g)
        for page in s.state_pages:
            for t in range(len(pool.conv)):
                pool.conv[t][page].normal_(0.0, 1.0, generator=g)
                pool.rec[t][page].normal_(0.0, 0.05, generator=g)
    table = torch.tensor(sorted({p for s in seqs for p in s.block_table}), device=dev)
    states = torch.tensor(sorted({p for s in seqs for p in s.state_pages}), device=dev)
    pages = torch.cat([table, states])
    saved = [t[pages].clone() for t in pool.tensors]
    fwd, base = runner.fwd, runner.fwd.k
    paths = (base, kernel_config(triton=False))
    steps = []
    for k in paths:
        fwd.k = k
        steps.append(runner._build(seqs, []))
    hidden = fwd.layers[0].input_layernorm.weight
    x = torch.randn(steps[0].num_tokens, hidden.shape[0], generator=g, device=dev).to(hidden.dtype)
    worst = {"output": 0.0, "cache": 0.0}
    try:
        for i, w in fwd.prepared.items():  # the attention layers, KDA and MLA
            views = ([pool.conv[w.tensor][states], pool.rec[w.tensor][states]] if hasattr(w, "conv_weight")
                     else [pool.mla[w.slot][table]])
            got = []
            for k, step in zip(paths, steps):
                for t, v in zip(pool.tensors, saved):
                    t[pages] = v
                fwd.k = k
                y = fwd.attention(i, x, step, decode=False).float()
                cache = ([pool.conv[w.tensor][states], pool.rec[w.tensor][states]] if len(views) == 2
                         else [pool.mla[w.slot][table]])
                got.append((y, [c.float() for c in cache]))
            (y0, c0), (y1, c1) = got
            worst["output"] = max(worst["output"], float((y0 - y1).norm() / y1.norm().clamp_min(1e-30)))
            for a, b in zip(c0, c1):
                worst["cache"] = max(worst["cache"], float((a - b).norm() / b.norm().clamp_min(1e-30)))
    finally:
        fwd.k = base
        for t, v in zip(pool.tensors, saved):
            t[pages] = v
    # fp32 on the CPU; bf16 on CUDA, where the chunk kernel takes bf16 dots (its own test at the 48B head allows
    # 2e-2 per sequence) against the torch path's fp32 math: a wrong row or tile shows as an error near 1
    tol = 5e-2 if hidden.dtype != torch.float32 else 1e-4
    return {"layer_rel_output": worst["output"], "layer_rel_cache": worst["cache"], "tol": tol,
            "ok": bool(worst["output"] < tol and worst["cache"] < tol)}


def _baseline(rev: str) -> dict:
    """Run this script on commit `rev`'s tree; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        out = Path(tmp) / "baseline.json"
        argv = [sys.executable, __file__, "--src", tmp, "--out", str(out)]
        for k in ("device", "width", "batch", "prefill", "context", "reps", "profile_top", "check"):
            argv += [f"--{k.replace('_', '-')}", str(getattr(ARGS, k))]
        argv += ["--budget-s", str(max(1.0, ARGS.budget_s - (time.perf_counter() - T0)))]
        subprocess.run(argv, stdout=subprocess.DEVNULL)  # a failed check still writes its JSON
        return json.loads(out.read_text())["trees"]["this"]


def table(trees: dict) -> str:
    lines = ["| tree | step | part | torch ops | of which launch work | Triton launches | host ms (median / min) "
             "| wall ms |", "|---|---|---|---|---|---|---|---|"]
    for tree, res in trees.items():
        for step, r in res.items():
            if "skipped" in r:
                lines.append(f"| {tree} | {step} | skipped ({r['skipped']}) | | | | | |")
                continue
            for part in ("step", "kda_layer"):
                p = r[part]
                wall = f"{p['wall_ms']:.2f}" if "wall_ms" in p else "-"
                lines.append(f"| {tree} | {step} | {part} | {p['torch_ops']} | {p.get('torch_kernel_ops', '-')} | "
                             f"{p['triton_launches']} | "
                             f"{p['host_ms']:.2f} / {p['host_ms_min']:.2f} | {wall} |")
    return "\n".join(lines)


def main() -> int:
    result = {"args": {k: str(v) for k, v in vars(ARGS).items()}, "trees": {"this": measure_tree()}}
    if ARGS.baseline:
        result["trees"] = {ARGS.baseline: _baseline(ARGS.baseline), "this": result["trees"]["this"]}
    if ARGS.out:
        ARGS.out.write_text(json.dumps(result, indent=1))
    failed = [f"{tree} {step}: {r['check']}" for tree, res in result["trees"].items() for step, r in res.items()
              if not r.get("check", {"ok": True})["ok"]]
    if ARGS.src is None:
        print(json.dumps(result))
        print()
        print(table(result["trees"]))
        for tree, res in result["trees"].items():
            for step, r in res.items():
                for p in r.get("profile", [])[:ARGS.profile_top]:
                    print(f"  {tree} {step}: {p['own_ms']:8.2f} own {p['cum_ms']:8.2f} cum x{p['calls']:<5} "
                          f"{p['function']}")
        for tree, res in result["trees"].items():
            for step, r in res.items():
                if "check" in r:
                    c = r["check"]
                    print(f"  check {tree} {step}: attention layers vs the torch-op path, largest relative error "
                          f"of an output {c['layer_rel_output']:.2e}, of a cache view {c['layer_rel_cache']:.2e} "
                          f"(tol {c['tol']:.0e}): {'ok' if c['ok'] else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
