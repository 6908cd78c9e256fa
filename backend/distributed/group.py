"""Process groups of one tensor-parallel engine: who meets where, with which timeouts.

Three groups over the same ranks, so that each wait has the timeout it needs:
  startup (default group, gloo, startup_timeout_s): the one barrier after every rank loaded its shard;
  compute (NCCL on CUDA, gloo on CPU, timeout_s): the model's all-reduces and logits gathers;
  control (gloo, CPU, timeout_s): rank 0's step plans and heartbeats (no device sync for a few ints).
A collective that waits past its timeout raises instead of hanging, and so does one whose peer died
(its sockets close). Rank 0 hosts the rendezvous store (unless torchrun's agent does); with
master_port 0 it takes a free port and passes the chosen port to the workers it starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from k3rt.backend.distributed import TPContext
from k3rt.config import EngineConfig


class TPFailure(RuntimeError):
    """A tensor-parallel rank is lost or a collective timed out: the engine cannot go on."""


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's store listens (the port resolved when the config said 0)."""

    addr: str
    port: int


@dataclass(frozen=True)
class TPGroups:
    tp: TPContext  # compute group, handed to the layers
    control: Any  # gloo ProcessGroup of the plan channel
    device: torch.device  # this rank's device


def joined_key(rank: int) -> str:
    """Rendezvous-store key a worker sets once it runs."""
    return f"k3rt/joined/{rank}"


def failed_key(rank: int) -> str:
    """Rendezvous-store key a worker sets to its error before it exits non-zero (rank 0 quotes it)."""
    return f"k3rt/failed/{rank}"


def rank_device(cfg: EngineConfig, rank: int) -> torch.device:
    """cuda:<local rank> for CUDA engines (one GPU per rank on each host), else the configured device."""
    if cfg.device == "cuda":
        return torch.device("cuda", rank % cfg.ranks_per_node)
    return torch.device(cfg.device)


def create_store(cfg: EngineConfig) -> tuple[Any, Rendezvous]:
    """Rank 0's rendezvous store (started before any worker, so workers can connect to it)."""
    d = cfg.dist
    store = dist.TCPStore(d.master_addr, d.master_port, cfg.tp, is_master=not d.agent_store,
                          timeout=timedelta(seconds=d.startup_timeout_s), wait_for_workers=False)
    return store, Rendezvous(d.master_addr, store.port)


def init_groups(cfg: EngineConfig, rank: int, rdv: Rendezvous, store: Any = None) -> TPGroups:
    """Join the engine's process groups as `rank` (rank 0 passes its store from create_store)."""
    d = cfg.dist
    device = rank_device(cfg, rank)
    if store is None:
        store = dist.TCPStore(rdv.addr, rdv.port, cfg.tp, is_master=False, timeout=timedelta(seconds=d.startup_timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.tp,
                            timeout=timedelta(seconds=d.startup_timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=d.timeout_s)
    ranks = list(range(cfg.tp))
    compute = dist.new_group(ranks, timeout=timeout, backend="nccl" if device.type == "cuda" else "gloo")
    control = dist.new_group(ranks, timeout=timeout, backend="gloo")
    fast = None
    if d.symm_all_reduce:  # every rank maps the others' buffers here, at the same point of start-up
        from k3rt.backend.distributed.symm_all_reduce import SymmAllReduce

        fast = SymmAllReduce(compute, device)
    tp = TPContext(rank, cfg.tp, compute, latent_tail=d.latent_tail, fast_all_reduce=fast)
    return TPGroups(tp, control, device)


def startup_barrier(timeout_s: float, check: Any = None) -> None:
    """Wait until every rank has loaded its shard, calling check() (raises on a lost rank) meanwhile."""
    work = dist.barrier(async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TPFailure(f"tensor parallel: not every rank loaded its shard within {timeout_s:.0f} s")
        time.sleep(0.05)
    work.wait()


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
