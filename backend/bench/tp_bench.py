"""`k3rt bench tp`: decode under tensor parallelism in the fused GPU runner, and LatentMoE's tail alone.

For each TP degree (those asked for that this host has GPUs for; `--smoke`: 1 and 2 ranks on CPU, gloo,
the tiny k3 shape, torch ops, no graphs) it starts that many rank processes (`python -m
k3rt.backend.bench.tp_bench`, one GPU each, NCCL) and measures:

  decode: a model of `--model`'s shape with random weights (each rank draws its own shard from the same
    seed, so the replicated router is the same on every rank and they route alike; routers re-drawn to route
    near-uniformly, as in benchmarks/decode.py), B sequences at context `--context` (cache pages
    zeroed: the time does not depend on their values). One step is what the engine does per decode step
    minus the scheduler: rank 0 builds and broadcasts the StepPlan, every rank turns it into the runner's
    batch and replays the decode graph (or runs eagerly), the logits are gathered to rank 0, which takes
    the argmax and reads the tokens back. Median of `--reps` steps; tokens/s = B / step time.
  tail (TP >= 2): LatentMoE's tail per layer at K3 widths, the all-reduce variant against the reduce-scatter
    variant (`moe.latent_tail`, the code the model runs), replayed from a CUDA graph of `--tail-layers`
    layers with distinct weights; each checked against the single-device sums (rel err). Also
    benchmarks/latent_tail.py (torchrun) runs this measurement.

Prints a table, writes JSON (--out, default ./bench_tp.json).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TpBenchConfig:
    model: str = "kimi-linear-48b"  # preset or checkpoint folder (config only)
    tps: tuple[int, ...] = (1, 2, 4, 8)
    batches: tuple[int, ...] = (1, 16, 64)
    context: int = 4096
    tail_m: tuple[int, ...] = (1, 8, 16, 64)
    tail_hidden: int = 7168
    tail_latent: int = 3584
    tail_layers: int = 8
    reps: int = 20
    ep: bool = False  # routed experts split by expert (expert parallelism) instead of by width
    symm_all_reduce: bool = False  # the model's small all-reduces through symmetric memory (CUDA) instead of NCCL
    smoke: bool = False  # CPU, gloo, tiny k3 shape, torch ops, no graphs (the bench runs; times mean nothing)
    timeout_s: float = 1800.0  # one TP degree's processes, start to finish

    def __post_init__(self) -> None:
        for name in ("tps", "batches", "tail_m"):
            vals = getattr(self, name)
            if not vals or min(vals) < 1:
                raise ValueError(f"{name}: need at least one value, each >= 1, got {list(vals)}")
        if self.smoke and self.symm_all_reduce:
            raise ValueError("symm_all_reduce: symmetric memory needs CUDA devices; the smoke run is on CPU")
        for name in ("context", "tail_hidden", "tail_latent", "tail_layers", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    def resolved(self) -> "TpBenchConfig":
        """The smoke run's sizes (tiny widths, two reps, short context)."""
        if not self.smoke:
            return self
        from dataclasses import replace

        return replace(self, model="tiny k3 (smoke)", tps=tuple(t for t in self.tps if t <= 2) or (1,),
                       batches=(1, 3), context=40,
                       tail_m=(1, 3), tail_hidden=64, tail_latent=32, tail_layers=2, reps=2)


def degrees(cfg: TpBenchConfig) -> list[int]:
    """The TP degrees this host can run: as many ranks as GPUs (smoke: CPU processes)."""
    if cfg.smoke:
        return sorted(set(cfg.tps))
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise ValueError("bench tp: needs CUDA devices (or --smoke for the CPU check)")
    return sorted(t for t in set(cfg.tps) if t <= n)


def run(cfg: TpBenchConfig, out: Path | None = None) -> dict:
    cfg = cfg.resolved()
    for tp in cfg.tps:  # before any process starts (GPUs or not): the error names the dimension that does not split
        model_config(cfg).check_tp_model(tp, cfg.ep)
    result: dict = {"config": asdict(cfg), "decode": [], "tail": [], "skipped_tp": []}
    tps = degrees(cfg)
    result["skipped_tp"] = sorted(set(cfg.tps) - set(tps))
    for tp in tps:
        part = _launch(cfg, tp)
        result["decode"] += part["decode"]
        result["tail"] += part["tail"]
        result.setdefault("device", part["device"])
    base = {r["batch"]: r["step_ms"] for r in result["decode"] if r["tp"] == 1}
    for r in result["decode"]:
        if r["batch"] in base:
            r["step_vs_tp1"] = r["step_ms"] / base[r["batch"]]
            r["throughput_vs_tp1"] = base[r["batch"]] / r["step_ms"]
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


def model_config(cfg: TpBenchConfig):
    from k3rt.model_config import load_model_config, parse_model_config

    if cfg.smoke:
        from k3rt.backend.models.tiny import TINY_CONFIGS

        return parse_model_config(TINY_CONFIGS["k3"])
    return load_model_config(cfg.model)


def format_tables(result: dict) -> str:
    c = result["config"]
    lines = [f"device: {result.get('device')}; model {c['model']}, context {c['context']}"
             + ("; routed experts split by expert (--ep)" if c["ep"] else "")
             + ("; model all-reduces through symmetric memory" if c["symm_all_reduce"] else ""),
             "", "| TP | batch | step ms | tokens/s | step / TP1 | throughput / TP1 | graph |",
             "|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in result["decode"]:
        lines.append(f"| {r['tp']} | {r['batch']} | {r['step_ms']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r.get('step_vs_tp1', float('nan')):.2f} | {r.get('throughput_vs_tp1', float('nan')):.2f} | "
                     f"{'yes' if r['graph'] else 'no'} |")
    if result["tail"]:
        lines += ["", "| TP | M | all-reduce tail us/layer | reduce-scatter tail us/layer | RS / AR | rel err AR / RS |",
                  "|---:|---:|---:|---:|---:|---|"]
        for r in result["tail"]:
            lines.append(f"| {r['tp']} | {r['M']} | {r['all_reduce_us']:.1f} | {r['reduce_scatter_us']:.1f} | "
                         f"{r['ratio']:.2f} | {r['all_reduce_rel_err']:.1e} / {r['reduce_scatter_rel_err']:.1e} |")
    if result["skipped_tp"]:
        lines.append(f"\nnot run (fewer GPUs than ranks): TP {result['skipped_tp']}")
    return "\n".join(lines)


# ---- the rank processes ----

def _launch(cfg: TpBenchConfig, tp: int) -> dict:
    """Run one TP degree's ranks to completion; rank 0's results. Any rank failing (or the timeout) kills the
    others and raises, naming the rank. This process hosts the ranks' rendezvous store on a port the OS picks and
    keeps it bound for the run (a port probed free and handed over could be taken before a rank binds it)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, timeout=timedelta(seconds=cfg.timeout_s),
                          wait_for_workers=False)
    port = store.port
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        procs = []
        try:
            for rank in range(tp):
                p = subprocess.Popen([sys.executable, "-m", "k3rt.backend.bench.tp_bench"], stdin=subprocess.PIPE)
                p.stdin.write(pickle.dumps((cfg, tp, rank, port, str(out))))
                p.stdin.close()
                procs.append(p)
            deadline = time.monotonic() + cfg.timeout_s
            while any(p.poll() is None for p in procs):
                failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"bench tp: TP {tp} rank {failed[0][0]} exited {failed[0][1]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bench tp: TP {tp} did not finish within {cfg.timeout_s:.0f} s")
                time.sleep(0.1)
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                raise RuntimeError(f"bench tp: TP {tp} rank {failed[0][0]} exited {failed[0][1]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return json.loads(out.read_text())


def _rank_main(cfg: TpBenchConfig, tp: int, rank: int, port: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from k3rt.backend.distributed import SINGLE, TPContext

    if cfg.smoke:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, tp, is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    dist.init_process_group("gloo" if cfg.smoke else "nccl", store=store, rank=rank, world_size=tp,
                            timeout=timedelta(seconds=cfg.timeout_s))
    try:
        control = dist.new_group(list(range(tp)), backend="gloo")
        res: dict = {"device": "cpu (smoke)" if cfg.smoke else torch.cuda.get_device_name(device),
                     "decode": [], "tail": []}
        if tp > 1:
            for M in cfg.tail_m:
                row = {"tp": tp, **tail_row(rank, tp, dist.group.WORLD, M, cfg.tail_hidden, cfg.tail_latent,
                                            cfg.tail_layers, cfg.reps, device, graphs=not cfg.smoke)}
                res["tail"].append(row)
        fast = None
        if cfg.symm_all_reduce and tp > 1:
            from k3rt.backend.distributed.symm_all_reduce import SymmAllReduce

            fast = SymmAllReduce(dist.group.WORLD, device)
        ctx = TPContext(rank, tp, dist.group.WORLD, fast_all_reduce=fast) if tp > 1 else SINGLE
        res["decode"] = _decode(cfg, ctx, control, device)
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        from k3rt.backend.distributed.group import destroy_groups

        destroy_groups()


def _decode(cfg: TpBenchConfig, tp, control, device) -> list[dict]:
    import torch

    from k3rt.backend.cache.pool import PagePool
    from k3rt.backend.distributed.channel import PlanReceiver, PlanSender
    from k3rt.backend.distributed.plan import PlanKind, PlanSeq, StepPlan
    from k3rt.backend.models.kimi import KimiForCausalLM
    from k3rt.backend.models.loader import DTYPES
    from k3rt.backend.models.tiny import init_parameter
    from k3rt.backend.runner.gpu.ops import KernelConfig
    from k3rt.backend.runner.gpu.runner import GpuModelRunner
    from k3rt.backend.runner.gpu.tp import plan_seqs, run_worker_plan
    from k3rt.cache_layout import compute_layout

    mcfg = model_config(cfg)
    dtype = "float32" if cfg.smoke else "bfloat16"
    with torch.device(device):
        model = KimiForCausalLM(mcfg, tp=tp, ep=cfg.ep, dtype=DTYPES[dtype])
    g = torch.Generator(device=device).manual_seed(0)  # same draws on every rank: the router agrees
    for name, p in model.named_parameters():
        init_parameter(name, p.data, g)
    # as benchmarks/decode.py: routers at the projections' small std send every token to the experts with the
    # largest correction bias; unit-variance logits and no bias route near-uniformly, as a trained router does
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate_weight"):
            layer.mlp.gate_weight.normal_(0.0, mcfg.hidden_size ** -0.5, generator=g)
            layer.mlp.e_score_correction_bias.zero_()
    model.eval()
    layout = compute_layout(mcfg, tp=tp.size, kv_dtype=dtype, conv_dtype=dtype)
    per_seq = -(-(cfg.context + 1) // layout.block_size) + max(1, layout.pages_per_state_set)
    pool = PagePool(layout, max(cfg.batches) * per_seq + 2 * max(1, layout.pages_per_state_set) + 2, device=device)
    runner = GpuModelRunner(model, pool, kernels=KernelConfig(triton=not cfg.smoke), cuda_graphs=not cfg.smoke,
                            graph_sizes=tuple(sorted(set(cfg.batches))), max_model_len=cfg.context + 1)
    if tp.rank != 0:  # a worker: replay rank 0's plans until STOP, as in the engine
        receiver = PlanReceiver(control)
        while (plan := receiver.recv()).kind != PlanKind.STOP:
            run_worker_plan(runner, plan)
        return []
    sender = PlanSender(control, None, cfg.timeout_s) if tp.size > 1 else None
    pool.record_fills()
    rows = []
    try:
        for B in cfg.batches:
            pages = []
            seqs = []
            for i in range(B):
                table = pool.allocate(-(-(cfg.context + 1) // layout.block_size))
                states = pool.allocate(max(1, layout.pages_per_state_set))
                pages += table + states
                seqs.append(PlanSeq(cfg.context, 1, tuple(table), tuple(states) if mcfg.kda_layers else None))
            graph = B if B in runner.graphs else 0
            plan = StepPlan(fills=tuple((v, tuple(p)) for v, p in pool.take_fills()), seqs=tuple(seqs),
                            token_ids=tuple((7 * i + 3) % mcfg.vocab_size for i in range(B)),
                            logits_rows=tuple(range(B)), graph=graph)
            first, later = plan, StepPlan(seqs=plan.seqs, token_ids=plan.token_ids, logits_rows=plan.logits_rows,
                                          graph=graph)

            def step(p: StepPlan) -> list[int]:
                # what the engine's GPU runner does per decode step, less the scheduler and the sampler's options
                if sender is None:
                    logits, _ = runner.run_seqs(*plan_seqs(p), p.graph)
                    return logits.argmax(-1).tolist()
                with sender.step(p):
                    logits, _ = runner.run_seqs(*plan_seqs(p), p.graph)
                    return logits.argmax(-1).tolist()

            step(first)  # applies the fills on the workers; compiles outside the timing
            for _ in range(2):
                step(later)
            ts = []
            for _ in range(cfg.reps):
                t0 = time.perf_counter()
                step(later)
                ts.append(time.perf_counter() - t0)
            ms = statistics.median(ts) * 1e3
            rows.append({"tp": tp.size, "ep": cfg.ep, "symm_all_reduce": cfg.symm_all_reduce and tp.size > 1,
                         "batch": B, "context": cfg.context, "step_ms": ms,
                         "tokens_per_s": B / (ms * 1e-3), "graph": bool(graph)})
            log.info("TP %d batch %d: %.3f ms per step", tp.size, B, ms)
            pool.unref(pages)
            pool.take_fills()  # freed pages are not poisoned here; nothing to replay
    finally:
        if sender is not None:
            sender.close()  # STOP to the workers, then leaves the process groups
    return rows


def tail_row(rank: int, size: int, group, M: int, hidden: int, latent: int, layers: int, reps: int, device,
             *, graphs: bool) -> dict:
    """LatentMoE's tail per layer, both variants, at M tokens (every rank of `group` calls it): correctness
    against the single-device sums, then microseconds per layer (median of `reps`, the slowest rank's)."""
    import torch
    import torch.distributed as dist

    from k3rt.backend.distributed import TPContext
    from k3rt.backend.layers.norm import rms_norm
    from k3rt.backend.models.moe import latent_tail

    dev = torch.device(device)
    dt = torch.bfloat16 if graphs else torch.float32
    H, L = hidden, latent
    g = torch.Generator(device=dev).manual_seed(0)  # same weights on every rank
    w_up = [torch.randn(H, L, device=dev, generator=g, dtype=dt) * L ** -0.5 for _ in range(layers)]
    norm_w = torch.ones(L, device=dev, dtype=dt)
    rows = slice(rank * H // size, (rank + 1) * H // size)
    w_slice = [w[rows].contiguous() for w in w_up]
    tps = {v: TPContext(rank, size, group, latent_tail=v) for v in ("all_reduce", "reduce_scatter")}
    linear = torch.nn.functional.linear
    gm = torch.Generator(device=dev).manual_seed(1000 + M + rank)  # each rank its own partial sums
    lat = [torch.randn(M, L, device=dev, generator=gm, dtype=dt) for _ in range(layers)]
    shr = [torch.randn(M, H, device=dev, generator=gm, dtype=dt) for _ in range(layers)]

    def run(variant: str) -> list[torch.Tensor]:
        tp = tps[variant]
        outs = []
        for i in range(layers):
            y = rms_norm(tp.all_reduce(lat[i].clone()), norm_w, 1e-5)
            w = w_slice[i] if variant == "reduce_scatter" else w_up[i]
            outs.append(latent_tail(tp, y, shr[i].clone(), w, linear))
        return outs

    # oracle: the same sums gathered to every rank, computed on one device
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # 2.13 renamed it
    want = []
    for i in range(layers):
        fl = torch.empty(size * M, L, device=dev, dtype=dt)
        fs = torch.empty(size * M, H, device=dev, dtype=dt)
        gather(fl, lat[i], group=group)
        gather(fs, shr[i], group=group)
        y = rms_norm(fl.view(size, M, L).float().sum(0).to(dt), norm_w, 1e-5)
        want.append(linear(y, w_up[i]) + fs.view(size, M, H).float().sum(0).to(dt))
    row: dict = {"M": M, "hidden": H, "latent": L, "layers": layers}
    for variant in ("all_reduce", "reduce_scatter"):
        got = run(variant)
        row[f"{variant}_rel_err"] = max(((x.float() - y.float()).norm() / y.float().norm()).item()
                                        for x, y in zip(got, want))
        if not graphs:  # CPU smoke: correctness, and a wall time
            t0 = time.perf_counter()
            run(variant)
            row[f"{variant}_us"] = (time.perf_counter() - t0) * 1e6 / layers
            continue
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                run(variant)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(variant)
        ts = []
        for _ in range(reps + 5):
            dist.barrier(group=group)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3 / layers)
        t = torch.tensor(ts[5:], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a layer is as slow as its slowest rank
        row[f"{variant}_us"] = statistics.median(t.tolist())
    row["ratio"] = row["reduce_scatter_us"] / row["all_reduce_us"]
    return row


def main() -> int:
    """A rank process of `_launch` (its arguments pickled on stdin by our own parent: trusted)."""
    logging.basicConfig(level=logging.WARNING)
    cfg, tp, rank, port, out = pickle.load(sys.stdin.buffer)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        _rank_main(cfg, tp, rank, port, out)
    except Exception:
        log.exception("bench tp: rank %d failed", rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
