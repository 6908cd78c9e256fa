"""GET /health beyond ready / dead: 503 when the engine has work and makes no progress (or sends nothing)
for the stall timeout, and when pinned snapshots leave no room to admit a request."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from k3rt.server.health import EngineWatch
from tests.server.conftest import MODEL_NAME, ServeProcess

INFO = {"pages_per_state_set": 3}


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _stats(steps: int = 0, running: int = 0, waiting: int = 0, computed: int = 0, pinned: int = 0,
           usable: int = 100) -> dict:
    return {"steps": steps, "computed_tokens": computed, "running": running, "waiting": waiting,
            "pinned_pages": pinned, "pages_usable": usable}


def _watch(timeout: float = 30.0):
    clock = _Clock()
    gw = SimpleNamespace(client=SimpleNamespace(stats=_stats(), info=INFO, queues={}), in_flight=0,
                         last_update_at=0.0)
    return EngineWatch(gw, timeout, clock), gw, clock


def _advance(watch: EngineWatch, clock: _Clock, seconds: float, tick: float = 0.5, send=None) -> None:
    """Let `seconds` pass, sampling every `tick` like `EngineWatch.run`; `send()` makes each tick's stats."""
    end = clock.t + seconds
    while clock.t < end:
        clock.t = min(end, clock.t + tick)
        if send is not None:
            watch.gateway.client.stats = send()
        watch.observe()


def test_an_idle_engine_never_stalls() -> None:
    watch, gw, clock = _watch()
    _advance(watch, clock, 300)  # not even a silent one: no work pending
    assert watch.problem() is None


def test_work_without_progress_is_a_stall() -> None:
    watch, gw, clock = _watch()
    _advance(watch, clock, 100, send=_stats)
    gw.client.stats = _stats(running=1, waiting=2)
    _advance(watch, clock, 29, send=lambda: _stats(running=1, waiting=2))  # stats keep coming, steps do not
    assert watch.problem() is None
    _advance(watch, clock, 2, send=lambda: _stats(running=1, waiting=2))
    p = watch.problem()
    assert p["status"] == "stalled" and "made no progress" in p["reason"], p
    assert p["running"] == 1 and p["waiting"] == 2 and p["stall_timeout_s"] == 30
    steps = iter(range(1, 10**6))
    _advance(watch, clock, 1, send=lambda: _stats(steps=next(steps), running=1))  # it moves again
    assert watch.problem() is None
    _advance(watch, clock, 60, send=lambda: _stats(steps=next(steps), running=1))
    assert watch.problem() is None


def test_computed_tokens_and_request_updates_are_progress() -> None:
    watch, gw, clock = _watch()
    gw.in_flight = 1
    computed = iter(range(1, 10**6))
    _advance(watch, clock, 60, send=lambda: _stats(running=1, computed=next(computed)))
    assert watch.problem() is None
    for _ in range(120):  # the same stats, but the gateway keeps receiving updates
        _advance(watch, clock, 0.5, send=lambda: _stats(running=1, computed=10**6))
        gw.last_update_at = clock.t
    assert watch.problem() is None


def test_no_stats_at_all_while_work_is_pending_is_a_stall() -> None:
    watch, gw, clock = _watch()
    _advance(watch, clock, 100)  # the engine went silent while idle; only pending work starts the clock
    gw.in_flight = 1  # the gateway's request, which the wedged engine never reported
    _advance(watch, clock, 20)
    assert watch.problem() is None
    _advance(watch, clock, 11)
    p = watch.problem()
    assert p["status"] == "stalled" and "no stats" in p["reason"] and p["in_flight"] == 1, p
    gw.in_flight = 0
    gw.client.queues = {"dsl-program-request": None}  # the DSL programs' requests count as pending too
    assert watch.problem()["status"] == "stalled"
    gw.client.queues = {}
    _advance(watch, clock, 0.5)
    assert watch.problem() is None


def test_a_stall_timeout_of_zero_disables_the_check() -> None:
    watch, gw, clock = _watch(timeout=0)
    gw.in_flight = 1
    _advance(watch, clock, 1000, send=lambda: _stats(running=1))
    assert watch.problem() is None


def test_pinned_snapshots_that_leave_no_room_are_unhealthy() -> None:
    watch, gw, clock = _watch()
    gw.client.stats = _stats(pinned=6, usable=10)  # a request needs 3 + 1 pages: 10 - 6 leaves exactly 4
    assert watch.problem() is None
    gw.client.stats = _stats(pinned=7, usable=10)
    p = watch.problem()
    assert p["status"] == "pinned_full" and p["pinned_pages"] == 7 and p["pages_per_request"] == 4, p
    assert "7 of the 10 usable" in p["reason"]


def test_a_real_pin_that_fills_a_small_pool_is_seen(tiny_model) -> None:
    """In process: a 6-page pool (state set of 3) keeps one pinned snapshot (3 pages, the cap is half the
    pool), which leaves 3 pages; a request needs 4, so /health would answer pinned_full until the unpin."""
    from k3rt.backend.engine_inproc import InProcEngineClient
    from k3rt.backend.gateway import Gateway, GatewayConfig
    from k3rt.config import CacheConfig, EngineConfig

    cfg = GatewayConfig(EngineConfig(model=str(tiny_model), cache=CacheConfig(num_pages=6)))
    gw: Gateway | None = None

    async def drain(updates) -> None:
        async for u in updates:
            assert u.error is None, u.error

    async def stats_settle(key: str, want: int) -> None:
        deadline = time.monotonic() + 10
        while gw.client.stats.get(key) != want and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert gw.client.stats.get(key) == want, gw.client.stats

    async def main() -> None:
        nonlocal gw
        gw = Gateway(cfg, client=InProcEngineClient(cfg.engine))
        await gw.start()
        try:
            watch = EngineWatch(gw, 30.0)
            params = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
            await drain(gw.client.generate([5, 6, 7, 8], params, rid="pinned", pin=True))
            await stats_settle("pins", 1)  # the engine thread sets its stats just after the last update
            assert gw.client.stats["pinned_pages"] == 3
            assert watch.problem()["status"] == "pinned_full"
            await gw.client.unpin("pinned")
            await drain(gw.client.generate([9, 10, 11], params))  # admitted once the pin is gone
            await stats_settle("pins", 0)
            assert watch.problem() is None
        finally:
            await gw.shutdown()

    asyncio.run(main())


def _health(server: ServeProcess) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=10)


@pytest.mark.timeout(180)
def test_a_wedged_engine_turns_health_503_and_back(small_server: ServeProcess) -> None:
    """SIGSTOP the engine process (2 s stall timeout): a request in flight makes /health 503 'stalled';
    SIGCONT lets the request finish and /health turns 200 again."""
    assert _health(small_server).status_code == 200
    pid = small_server.stats()["stats"]["engine_pid"]
    result: dict = {}

    def request() -> None:
        result["r"] = httpx.post(small_server.url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "wedged", "max_tokens": 3, "ignore_eos": True})

    os.kill(pid, signal.SIGSTOP)
    t = threading.Thread(target=request)
    try:
        t.start()
        deadline = time.monotonic() + 30
        r = _health(small_server)
        while r.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            r = _health(small_server)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "stalled" and "no stats" in body["reason"] and body["in_flight"] == 1, body
        assert body["stall_timeout_s"] == 2
    finally:
        os.kill(pid, signal.SIGCONT)
        t.join(120)
    assert result["r"].status_code == 200, result["r"].text
    deadline = time.monotonic() + 10
    while _health(small_server).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _health(small_server).status_code == 200


def test_health_is_503_until_every_endpoint_is_bound(tiny_model) -> None:
    """The CI flake behind `test_a_start_that_loses_its_port_retries_on_another`: `k3rt serve` binds its DSL
    port after the engine is up, and /health said 200 in between, so a server whose DSL port was taken
    answered 200 and then exited 1. Until `endpoints_bound`, /health (and /health_generate, and the stats'
    `ready`) must say starting."""
    from k3rt.backend.engine_inproc import InProcEngineClient
    from k3rt.backend.gateway import Gateway, GatewayConfig
    from k3rt.config import EngineConfig
    from k3rt.server.app import create_app
    from k3rt.server.config import ServerConfig
    from k3rt.server.generation import ServerContext
    from k3rt.server.metrics import ServerMetrics

    async def main() -> None:
        scfg = ServerConfig(engine=EngineConfig(model=str(tiny_model)))
        gw = Gateway(GatewayConfig(scfg.engine), client=InProcEngineClient(scfg.engine))
        ctx = ServerContext(gw, scfg, ServerMetrics(lambda: gw.stats), EngineWatch(gw, 30.0))
        ctx.endpoints_bound = False  # as `k3rt serve` starts it (launch.py), until the DSL port is bound
        await gw.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(ctx)),
                                         base_url="http://k3rt") as c:
                r = await c.get("/health")
                assert (r.status_code, r.json()) == (503, {"status": "starting"})
                assert (await c.get("/health_generate")).status_code == 503
                assert (await c.get("/v1/k3rt/stats")).json()["ready"] is False
                ctx.endpoints_bound = True
                assert (await c.get("/health")).status_code == 200
                assert (await c.get("/v1/k3rt/stats")).json()["ready"] is True
        finally:
            await gw.shutdown()

    asyncio.run(main())
