"""The engine (scheduler) process: owns the Engine, talks to the gateway over ZMQ PUSH/PULL.

Loop: drain incoming messages (never blocking while there is work), run one engine step, push one
UpdateBatch per step (plain token updates in its columns). Bad requests are answered with a RequestUpdate
carrying `error` and never stop the loop; only a failure of the step itself is fatal (reported as
EngineError, then exit non-zero).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import replace

import zmq

from k3rt.backend.request_map import RequestMap
from k3rt.config import EngineConfig
from k3rt.protocol import (
    AbortRequest, EngineError, FlushCache, GenerateRequest, ProtocolError, Ready, RequestUpdate, Shutdown, ShutdownAck,
    Unpin, UpdateBatch, decode, encode,
)

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, cfg: EngineConfig, in_addr: str, out_addr: str) -> None:
        from k3rt.backend.engine import Engine

        self.cfg = cfg
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(in_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(out_addr)
        self.engine = Engine(cfg)
        self.requests = RequestMap(self.engine)
        self.running = True
        self.parent_pid = os.getppid()  # the gateway; if it dies without Shutdown, nobody reads our messages

    def info(self) -> dict:
        e = self.engine
        return {"model": self.cfg.model, "architecture": e.model_cfg.arch, "vocab_size": e.model_cfg.vocab_size,
                "max_model_len": e.model_cfg.max_position_embeddings, "num_pages": e.pool.num_pages,
                "pid": os.getpid(), "tp": self.cfg.tp, "ep": self.cfg.ep, **e.layout.as_dict()}

    def stats(self) -> dict:
        return self.engine.stats_dict()

    def handle(self, msg, errors: list[RequestUpdate]) -> None:
        if isinstance(msg, GenerateRequest):
            error = self.requests.add(msg)
            if error is not None:
                errors.append(error)
        elif isinstance(msg, AbortRequest):
            self.requests.abort(msg.rid)
        elif isinstance(msg, Unpin):
            self.requests.unpin(msg.rid)
        elif isinstance(msg, FlushCache):
            self.requests.flush()
        elif isinstance(msg, Shutdown):
            self.running = False

    def run(self) -> None:
        self.push.send(encode(Ready(self.info())))
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        last_stats = 0.0
        while self.running:
            if os.getppid() != self.parent_pid:
                # the gateway was killed (SIGKILL, OOM): exit instead of running on as an orphan
                log.error("the gateway (pid %d) is gone; the engine process exits", self.parent_pid)
                self.engine.close()
                self.push.close(linger=0)
                self.pull.close(linger=0)
                self.ctx.term()
                return
            # a lost tensor-parallel rank raises TPFailure here, idle or not: engine_main reports and exits 1
            self.engine.check_runner()
            busy = self.engine.has_unfinished
            errors: list[RequestUpdate] = []
            # block only when idle; otherwise take whatever arrived and step
            if poller.poll(0 if busy else 50):
                while True:
                    try:
                        data = self.pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = decode(data, trusted=True)  # our gateway, private ipc
                    except ProtocolError as e:  # one bad message never ends the loop
                        log.error("ignoring a malformed message from the gateway: %s", e)
                        continue
                    self.handle(msg, errors)
            batch = self.requests.step_batch() if self.engine.has_unfinished else UpdateBatch([])
            now = time.monotonic()
            if errors or batch.updates or batch.rids or now - last_stats > 1.0:
                self.push.send(encode(replace(batch, updates=errors + batch.updates, stats=self.stats())))
                last_stats = now
        # drain: abort everything still known, tell the gateway, then ack the shutdown
        self.requests.abort_all()
        if self.engine.has_unfinished:
            self.push.send(encode(self.requests.step_batch()))
        self.engine.close()  # tensor-parallel workers stop before the gateway hears the ack
        self.push.send(encode(ShutdownAck()))
        self.push.close(linger=2000)
        self.pull.close(linger=0)
        self.ctx.term()


def engine_main(cfg: EngineConfig, in_addr: str, out_addr: str, log_level: str = "WARNING") -> None:
    """Entry point of the engine process (multiprocessing 'spawn' target)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    # the gateway owns shutdown: a Ctrl-C or a SIGTERM to the whole process group (systemd, Kubernetes)
    # reaches it too, and it drains before it sends Shutdown. A gateway that dies is noticed in the loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cfg.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        # leave a core to the gateway process: oversubscribed intra-op threads made CPU steps 10-50x slower;
        # tensor-parallel ranks on this host share the rest
        torch.set_num_threads(max(1, ((os.cpu_count() or 2) - 1) // cfg.ranks_per_node))
    loop = None
    try:
        loop = EngineLoop(cfg, in_addr, out_addr)
        loop.run()
    except Exception as e:  # fatal: report, then exit non-zero so the gateway fails fast
        if loop is not None:
            try:
                loop.engine.close()  # no tensor-parallel worker outlives the engine
            except Exception as close_error:
                log.error("stopping the tensor-parallel workers failed: %s", close_error)
        msg = f"{type(e).__name__}: {e}"
        if loop is None and isinstance(e, ValueError):  # a configuration the engine refuses, naming the field
            log.error("engine process failed: %s", msg)
            log.debug("%s", traceback.format_exc())
        else:
            log.error("engine process failed: %s\n%s", msg, traceback.format_exc())
        try:
            ctx = zmq.Context.instance()
            s = ctx.socket(zmq.PUSH)
            s.connect(out_addr)
            s.send(encode(EngineError(msg)))
            s.close(linger=2000)
        except Exception:
            pass
        sys.exit(1)
