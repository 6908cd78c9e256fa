"""Rank 0's side of starting a tensor-parallel engine: the rendezvous store, this host's workers, the
process groups, and the plan channel. The engine calls `start_tensor_parallel`, loads its own shard,
then `wait_for_workers` (every rank loaded) before its first step.
"""

from __future__ import annotations

import logging
import time

from k3rt.backend.distributed.channel import PlanSender
from k3rt.backend.distributed.group import (
    TPFailure, TPGroups, create_store, destroy_groups, init_groups, joined_key, startup_barrier,
)
from k3rt.backend.distributed.launch import WorkerSet
from k3rt.config import EngineConfig

log = logging.getLogger(__name__)


def start_tensor_parallel(cfg: EngineConfig) -> tuple[TPGroups, PlanSender]:
    store, rdv = create_store(cfg)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    # this host's other ranks; under an outside launcher (torchrun) they run already
    local = range(0) if cfg.dist.external_ranks else range(1, cfg.ranks_per_node)
    workers = WorkerSet(cfg, local, rdv, log_level=level, store=store)
    try:
        # ranks write this key once they run (before they join the groups): waiting for it while watching
        # the processes fails the engine at once when a worker dies on start-up
        keys = [joined_key(r) for r in range(1, cfg.tp)]
        deadline = time.monotonic() + cfg.dist.startup_timeout_s
        while keys and not store.check(keys):
            lost = workers.poll()
            if lost is not None:
                raise TPFailure(lost)
            if time.monotonic() > deadline:
                raise TPFailure(f"tensor parallel: not every rank joined within {cfg.dist.startup_timeout_s:.0f} s")
            time.sleep(0.02)
        groups = init_groups(cfg, 0, rdv, store)
    except BaseException:
        workers.kill()
        destroy_groups()
        raise
    log.info("tensor parallel: %d ranks (%d on this host: pids %s)", cfg.tp, cfg.ranks_per_node, workers.pids)
    return groups, PlanSender(groups.control, workers, cfg.dist.timeout_s)


def wait_for_workers(cfg: EngineConfig, sender: PlanSender) -> None:
    """Every rank has loaded its shard: start the heartbeat. Raises TPFailure on a lost rank."""
    startup_barrier(cfg.dist.startup_timeout_s, sender.check)
    sender.start_heartbeat()
