"""`k3rt serve`: the gateway process (uvloop + uvicorn + the app) and the engine process it spawns.

Lifecycle
  start    bind the port first (a busy port fails before anything is spawned), serve HTTP at once
           (/health answers 503), spawn the engine in the background; /health turns 200 on its Ready and once
           the DSL port is bound (a taken DSL port exits 1 without ever having said 200).
  signal   SIGINT/SIGTERM, to the gateway or to the whole process group (the engine process ignores
           both: the gateway owns shutdown): stop accepting, answer 503 to new requests on open
           connections, let running requests finish for up to `drain_timeout_s`; those still running
           then are cut (`ServerContext.cut_requests`: a 503 `server_shutdown` error object, or a final
           error event then [DONE] on a stream; their engine requests are aborted). Then the engine
           drain handshake (Shutdown -> ShutdownAck) and join. Exit 0 if every request finished, 1 if
           any was cut. A second SIGINT/SIGTERM cuts the running requests at once (exit 1).
  crash    the engine process dies or reports EngineError: every waiting request is answered 503 (or an
           error event then [DONE] on a stream), the server shuts down the same way, and the exit status
           is 1 (also when it dies during a drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator

from k3rt.server.config import ServerConfig

log = logging.getLogger(__name__)

_CUT_GRACE_S = 2.0  # after a cut, how long uvicorn waits for the error answers to be sent before it drops them


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"port: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def serve(cfg: ServerConfig) -> int:
    """Run the server until a signal or an engine failure; returns the process exit status."""
    import uvloop

    return uvloop.run(_serve(cfg))


async def _serve(cfg: ServerConfig) -> int:
    import uvicorn

    from k3rt.backend.engine_client import EngineDead
    from k3rt.backend.gateway import Gateway, GatewayConfig
    from k3rt.server.app import create_app
    from k3rt.server.generation import ServerContext
    from k3rt.server.health import EngineWatch
    from k3rt.server.limits import freeze_startup_heap
    from k3rt.server.metrics import ServerMetrics

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # our loop handlers own the signals; uvicorn's would re-raise them at exit (exit status -15)
            yield

    gateway = Gateway(GatewayConfig(cfg.engine, cfg.context_length, cfg.log_level))
    sock = _bind(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    ctx = ServerContext(gateway, cfg, ServerMetrics(lambda: gateway.stats), EngineWatch(gateway, cfg.stall_timeout_s),
                        endpoints_bound=False)
    server = Server(uvicorn.Config(create_app(ctx), log_config=None, log_level=cfg.log_level.lower(),
                                   access_log=False, lifespan="off",
                                   # a backstop: our own cut at the drain timeout answers every request
                                   timeout_graceful_shutdown=cfg.drain_timeout_s + _CUT_GRACE_S))
    exit_code = 0
    loop = asyncio.get_running_loop()
    drain_timer: asyncio.TimerHandle | None = None
    programs = None  # the DSL endpoint, once up: drained like HTTP

    def cut(why: str) -> None:
        nonlocal exit_code
        if ctx.shutdown_error is not None:
            return
        num_cut = ctx.cut_requests(why)
        if num_cut:
            log.error("%d engine request(s) cut: %s", num_cut, why)
            exit_code = 1

    def stop(reason: str) -> None:
        nonlocal drain_timer
        if server.should_exit:
            if reason in ("SIGINT", "SIGTERM"):  # a second signal: don't wait for running requests
                if ctx.shutdown_error is None:
                    cut(f"a second {reason} ended the drain")
                    # a client that does not read its error answer is dropped a moment later
                    loop.call_later(_CUT_GRACE_S, setattr, server, "force_exit", True)
                else:
                    server.force_exit = True
            return
        log.warning("shutting down (%s); running requests have %gs to finish", reason, cfg.drain_timeout_s)
        gateway.draining = True
        if programs is not None:
            programs.draining = True  # new programs are refused; running ones finish (below)
        server.should_exit = True
        drain_timer = loop.call_later(cfg.drain_timeout_s, cut,
                                      f"the request did not finish within the drain timeout ({cfg.drain_timeout_s:g}s)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig.name)

    async def run_engine() -> None:
        nonlocal exit_code, programs
        try:
            await gateway.start()
        except EngineDead as e:
            log.error("the engine failed to start: %s", e)
            exit_code = 1
            stop("engine failed to start")
            return
        dsl = cfg.resolved_dsl_addr(port)
        if dsl is not None:
            from k3rt.backend.program.server import ProgramServer

            programs = ProgramServer(gateway.client, gateway.tokenizer, dsl, api_keys=cfg.api_keys,
                                     tenant=cfg.tenant,
                                     max_message_bytes=cfg.dsl_max_message_bytes)
            dsl_task = asyncio.create_task(programs.serve())
            await programs.bound.wait()
            if dsl_task.done():
                dsl_task.result()  # the endpoint could not bind: fail loudly
            dsl = programs.endpoint
        freeze_startup_heap()
        ctx.endpoints_bound = True  # only now may /health say 200
        watch_task = asyncio.create_task(ctx.health.run())
        print(f"k3rt serve: ready on http://{cfg.host}:{port} (model {cfg.model_name}, engine pid "
              f"{gateway.client.info.get('pid')}" + (f", DSL programs at {dsl}" if dsl else "") + ")",
              file=sys.stderr, flush=True)
        try:
            while gateway.dead is None:
                await asyncio.sleep(0.1)
        finally:
            watch_task.cancel()
            if dsl is not None:
                dsl_task.cancel()
        if not gateway.draining:
            exit_code = 1
            stop("engine process failed")

    def run_engine_done(task: asyncio.Task) -> None:
        nonlocal exit_code
        if not task.cancelled() and task.exception() is not None:  # e.g. the DSL port could not bind
            e = task.exception()
            log.error("the server failed: %s: %s", type(e).__name__, e)
            exit_code = 1
            stop("the server failed")

    engine_task = asyncio.create_task(run_engine())
    engine_task.add_done_callback(run_engine_done)
    try:
        await server.serve(sockets=[sock])
        if programs is not None and not gateway.dead:
            # DSL programs in flight get the drain too; the cut at the drain timeout ends their requests
            if not await programs.drain(cfg.drain_timeout_s + _CUT_GRACE_S):
                log.error("DSL programs still running at shutdown were cancelled")
                exit_code = 1
        if server.server_state.tasks:  # uvicorn's backstop dropped them (clients that did not read the answer)
            log.error("%d HTTP request(s) dropped at shutdown", len(server.server_state.tasks))
            exit_code = 1
    finally:
        if drain_timer is not None:
            drain_timer.cancel()
        engine_task.cancel()
        await asyncio.gather(engine_task, return_exceptions=True)  # its failure is logged by run_engine_done
        await gateway.shutdown()  # always: the engine ignores SIGTERM, nothing else would stop it
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if gateway.dead is not None:  # also a death during the drain: its requests were lost
        exit_code = 1
    return exit_code
