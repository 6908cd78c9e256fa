"""The step-plan channel from rank 0 to the workers: one broadcast of the packed plan per step.

`PlanSender` (rank 0) broadcasts each StepPlan over the control group as two tensors (its length, then
the packed ints). When no step has gone out for a quarter of the collective timeout, a heartbeat
thread sends a HEARTBEAT plan, so idle workers waiting in the broadcast never time out, and a lost
worker is noticed while idle too. `check()` raises TPFailure once any of that failed or a local worker
exited; the engine calls it between steps and the engine process on every loop turn, and exits.
`PlanReceiver` (each worker) returns the next plan.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from k3rt.backend.distributed.group import TPFailure, destroy_groups
from k3rt.backend.distributed.launch import WorkerSet
from k3rt.backend.distributed.plan import PlanKind, StepPlan

log = logging.getLogger(__name__)


class PlanSender:
    def __init__(self, control: Any, workers: WorkerSet | None, timeout_s: float) -> None:
        """workers: the worker processes this rank started and watches (None: started elsewhere, e.g.
        other hosts; then lost ranks show as failed broadcasts)."""
        self.control, self.workers = control, workers
        self.heartbeat_s = timeout_s / 4
        self.failure: str | None = None
        self._lock = threading.Lock()  # one broadcast at a time: the step's or the heartbeat's
        self._last_send = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="k3rt-tp-heartbeat", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(self.heartbeat_s / 4, 0.25)):
            if self.failure is not None:
                return
            lost = self.workers.poll() if self.workers is not None else None
            if lost is not None:
                self.failure = lost
                log.error("%s", lost)
                return
            if time.monotonic() - self._last_send >= self.heartbeat_s and self._lock.acquire(blocking=False):
                try:
                    self._broadcast(StepPlan(PlanKind.HEARTBEAT))
                except TPFailure:
                    return
                finally:
                    self._lock.release()

    def _broadcast(self, plan: StepPlan) -> None:
        data = plan.pack()
        try:
            dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0, group=self.control)
            dist.broadcast(data, 0, group=self.control)
        except Exception as e:  # gloo: a peer's socket closed, or the timeout passed
            lost = self._lost_worker()
            self.failure = self.failure or lost or f"tensor parallel: sending a step to the workers failed ({e})"
            log.error("%s", self.failure)
            raise TPFailure(self.failure) from e
        self._last_send = time.monotonic()

    def _lost_worker(self, wait_s: float = 1.0) -> str | None:
        """After a failed collective: the local worker that died, if one did. Its sockets close before
        its exit is reaped, so wait a little for the exit: the error then names the rank and the signal
        instead of a socket error."""
        if self.workers is None:
            return None
        deadline = time.monotonic() + wait_s
        while (lost := self.workers.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return lost

    def check(self) -> None:
        if self.failure is None and self.workers is not None:
            self.failure = self.workers.poll()
        if self.failure is not None:
            raise TPFailure(self.failure)

    @contextlib.contextmanager
    def step(self, plan: StepPlan) -> Iterator[None]:
        """Send the plan, then hold the channel while rank 0 runs it (no heartbeat mid-step). Any error
        inside is fatal: the other ranks are mid-step too and can no longer be kept in lockstep."""
        self.check()
        with self._lock:
            self._broadcast(plan)
            try:
                yield
            except Exception as e:
                lost = self._lost_worker()
                self.failure = self.failure or lost or f"tensor parallel: a step failed on rank 0 ({type(e).__name__}: {e})"
                raise TPFailure(self.failure) from e
            self._last_send = time.monotonic()

    def close(self) -> None:
        """Stop the workers (STOP plan, join) and leave the process groups; kills workers that hang."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        healthy = self.failure is None and (self.workers is None or self.workers.poll() is None)
        if healthy:
            try:
                with self._lock:
                    self._broadcast(StepPlan(PlanKind.STOP))
            except TPFailure:
                healthy = False
        if self.workers is not None:
            self.workers.join(10.0 if healthy else 0.0)
        destroy_groups()


class PlanReceiver:
    def __init__(self, control: Any) -> None:
        self.control = control

    def recv(self) -> StepPlan:
        n = torch.empty(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.control)
        data = torch.empty(int(n.item()), dtype=torch.int64)
        dist.broadcast(data, 0, group=self.control)
        return StepPlan.unpack(data)
