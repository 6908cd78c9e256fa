"""A tensor-parallel worker (ranks 1..n-1): load this rank's shard, then replay rank 0's step plans
(through the reference PlanExecutor, or the fused GPU runner when the engine runs runner='gpu').

Run as `python -m k3rt.backend.distributed.worker` with pickled WorkerArgs on stdin (launch.py). The
worker keeps a pool of the same pages as rank 0 (its shard of every KDA state, the whole MLA latent)
but never allocates: every page fill, copy and snapshot write arrives in the plan. Sampling happens
on rank 0; the worker's part of the logits gather is all it contributes to the output. It exits 0 on
STOP and non-zero on any error (a lost rank 0 shows as a failed broadcast, or as the parent-death
signal when rank 0 started it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """SIGKILL this process when the process that started it dies (Linux), so no worker outlives it.
    Linux ties the signal to the starting *thread*: engines are built on long-lived threads (the engine
    process's main thread; InProcEngineClient's executor thread lives until its loop shuts down)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the signal was armed
        sys.exit(1)


def run_worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from k3rt.backend.cache.pool import PagePool
    from k3rt.backend.distributed.channel import PlanReceiver
    from k3rt.backend.distributed.group import destroy_groups, init_groups, joined_key, startup_barrier
    from k3rt.backend.distributed.plan import PlanKind
    from k3rt.backend.engine import cache_geometry
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.runner.step_plan import PlanExecutor
    from k3rt.model_config import load_model_config

    cfg, rank, rdv = args.cfg, args.rank, args.rendezvous
    if cfg.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # ranks of one host share its cores; oversubscribed intra-op threads make CPU steps far slower
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // cfg.ranks_per_node))
    store = dist.TCPStore(rdv.addr, rdv.port, cfg.tp, is_master=False,
                          timeout=timedelta(seconds=cfg.dist.startup_timeout_s))
    store.set(joined_key(rank), "1")
    try:
        groups = init_groups(cfg, rank, rdv, store)
        try:
            layout, num_pages = cache_geometry(cfg, load_model_config(cfg.model))
            torch.manual_seed(cfg.seed)
            model = load_model(cfg.model, dtype=cfg.dtype, tp=groups.tp, ep=cfg.ep, device=str(groups.device),
                               progress=False)
            pool = PagePool(layout, num_pages, device=groups.device)
            if cfg.runner == "gpu":  # the fused runner, built as rank 0 builds its own (pad page, graphs)
                from k3rt.backend.runner.gpu.runner import engine_gpu_runner
                from k3rt.backend.runner.gpu.tp import run_worker_plan

                gpu = engine_gpu_runner(cfg, model, pool)
                run = lambda plan: run_worker_plan(gpu, plan)  # noqa: E731
            else:
                run = PlanExecutor(model, pool).run
            startup_barrier(cfg.dist.startup_timeout_s)
            receiver = PlanReceiver(groups.control)
            while (plan := receiver.recv()).kind != PlanKind.STOP:
                if plan.kind == PlanKind.RUN:
                    run(plan)
        finally:
            destroy_groups()
    except Exception as e:
        _report(store, rank, e)
        raise


def _report(store, rank: int, e: Exception) -> None:
    """Leave the error where rank 0 quotes it (best effort: a lost rank 0 takes the store with it)."""
    from k3rt.backend.distributed.group import failed_key

    try:
        store.set(failed_key(rank), f"{type(e).__name__}: {e}")
    except Exception:
        pass


def serve_rank(args) -> int:
    """Run one worker in this process until STOP (0) or a failure (1, logged)."""
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s tp worker {args.rank}: %(message)s")
    try:
        run_worker(args)
    except Exception as e:
        log.error("tensor-parallel worker rank %d failed: %s: %s", args.rank, type(e).__name__, e)
        log.debug("details", exc_info=True)
        return 1
    return 0


def run_node(cfg) -> int:
    """A node other than node 0 (multi-host, `--node-rank K`): start this node's ranks, wait for them."""
    from k3rt.backend.distributed.group import Rendezvous
    from k3rt.backend.distributed.launch import WorkerSet

    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    workers = WorkerSet(cfg, cfg.node_ranks, Rendezvous(cfg.dist.master_addr, cfg.dist.master_port), log_level=level)
    try:
        return workers.wait()
    finally:
        workers.kill()


def main() -> int:
    args = pickle.load(sys.stdin.buffer)  # from the engine that started us (launch.py), trusted
    _die_with_parent()
    # the engine's owner drains and stops the workers through rank 0, as it does the engine process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return serve_rank(args)


if __name__ == "__main__":
    sys.exit(main())
