"""Starting and watching the worker processes (ranks 1..n-1 on this host) of a tensor-parallel engine.

Each worker is `python -m k3rt.backend.distributed.worker`, handed its WorkerArgs (pickled, over its
stdin: our own child, so trusted) and otherwise independent: it joins the process groups, loads its
shard and replays rank 0's step plans until told to stop. Workers die with the process that started
them (Linux parent-death signal) and ignore SIGINT/SIGTERM like the engine process, whose owner
drains and stops them. `WorkerSet.poll` names the first worker that exited.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from k3rt.backend.distributed.group import Rendezvous, failed_key
from k3rt.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    cfg: EngineConfig
    rank: int
    rendezvous: Rendezvous
    log_level: str = "WARNING"


class WorkerSet:
    def __init__(self, cfg: EngineConfig, ranks: range, rdv: Rendezvous, *, log_level: str = "WARNING",
                 store: Any = None) -> None:
        """store: the rendezvous store, where a failing worker leaves its error for `poll` to quote."""
        self.procs: dict[int, subprocess.Popen] = {}
        self.store = store
        try:
            for rank in ranks:
                p = subprocess.Popen([sys.executable, "-m", "k3rt.backend.distributed.worker"], stdin=subprocess.PIPE)
                self.procs[rank] = p
                p.stdin.write(pickle.dumps(WorkerArgs(cfg, rank, rdv, log_level)))
                p.stdin.close()
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def poll(self) -> str | None:
        """Why a worker is gone (the first one that exited), or None while all run. Before STOP nothing ends
        a worker but a failure, so any exit counts, a clean one included."""
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) {how}" + self._reason(rank)
        return None

    def _reason(self, rank: int) -> str:
        if self.store is None:
            return ""
        try:
            if self.store.check([failed_key(rank)]):
                return ": " + self.store.get(failed_key(rank)).decode(errors="replace")
        except Exception:  # the store is best effort here: the exit itself is the news
            pass
        return ""

    def wait(self) -> int:
        """Block until every worker exited; the first non-zero exit status (0 when all stopped cleanly).
        A worker that fails ends the others: a rank short, none of them can step."""
        while True:
            codes = [p.poll() for p in self.procs.values()]
            if all(c is not None for c in codes):
                return next((c for c in codes if c), 0)
            if any(c for c in codes if c is not None):
                log.error("%s; stopping this node's other workers", self.poll())
                self.kill()
                return next(c for c in (p.poll() for p in self.procs.values()) if c)
            time.sleep(0.2)

    def join(self, timeout_s: float) -> None:
        """Wait for every worker to exit (after STOP); kill those still running after timeout_s."""
        for rank, p in self.procs.items():
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker rank %d did not stop within %.0f s; killing it", rank, timeout_s)
        self.kill()

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel worker pid %d survived SIGKILL for 5 s", p.pid)
