"""The gateway on the in-process engine client (no sockets, no HTTP): choices, stop strings, early close."""

from __future__ import annotations

import asyncio
import time

from k3rt.backend.engine_inproc import InProcEngineClient
from k3rt.backend.gateway import Gateway, GatewayConfig, Job, Overloaded, TooLarge
from k3rt.config import EngineConfig, SchedulerConfig
from k3rt.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run(tiny_model, body) -> None:
    # max_waiting >= the choices of any job here: the engine answers max_waiting to the requests of one drain
    # beyond it, even when it could run them (the xfail in test_small_pool.py)
    cfg = GatewayConfig(EngineConfig(model=str(tiny_model), scheduler=SchedulerConfig(max_running=4, max_waiting=4)))

    async def main() -> None:
        gw = Gateway(cfg, client=InProcEngineClient(cfg.engine))
        await gw.start()
        try:
            await body(gw)
        finally:
            await gw.shutdown()

    asyncio.run(main())


async def _settle(gw: Gateway, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (gw.in_flight or gw.client.engine.has_unfinished) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _collect(gw: Gateway, job: Job) -> dict[int, tuple[str, list[int], str | None]]:
    out: dict[int, tuple[str, list[int], str | None]] = {}
    async for d in gw.generate(job):
        text, ids, _ = out.get(d.index, ("", [], None))
        out[d.index] = (text + d.text, ids + d.token_ids, d.finish_reason)
    return out


def test_choices_stop_strings_and_admission(tiny_model) -> None:
    async def body(gw: Gateway) -> None:
        prompt = await gw.encode_prompt("The scheduler hands out a token budget")
        full = await _collect(gw, Job([prompt, prompt[:5]], GREEDY, n=2))
        assert sorted(full) == [0, 1, 2, 3]
        assert full[0] == full[1] and full[2] == full[3]  # greedy: a prompt's choices agree
        text, ids, finish = full[0]
        assert finish == "length" and len(ids) == 12 and text == gw.tokenizer.decode(ids, skip_special_tokens=True)
        stop = text[3:6]
        stopped = await _collect(gw, Job([prompt], GREEDY, stop=(stop,)))
        assert stopped[0][0] == text[: text.find(stop)] and stopped[0][2] == "stop"
        assert len(stopped[0][1]) < 12
        # max_running + max_waiting = 8 engine requests may be in flight: 9 choices never fit (a 400), and
        # 5 more while 4 run must wait (a 429)
        try:
            gw.generate(Job([prompt], GREEDY, n=9))
        except TooLarge as e:
            assert e.param == "n" and "at most 8 generations" in str(e)
        else:
            raise AssertionError("9 choices were admitted past a limit of 8")
        running = gw.generate(Job([prompt], GREEDY, n=4))
        try:
            gw.generate(Job([prompt], GREEDY, n=5))
        except Overloaded as e:
            assert "limit is 8" in str(e)
        else:
            raise AssertionError("9 choices in flight past a limit of 8")
        finally:
            running.close()
        await _settle(gw)  # the stopped choice's task ends just after its last delta (it sends the abort)
        assert gw.in_flight == 0

    _run(tiny_model, body)


def test_closing_a_job_aborts_its_requests(tiny_model) -> None:
    async def body(gw: Gateway) -> None:
        engine = gw.client.engine
        idle = engine.pool.num_free
        prompt = await gw.encode_prompt("A long answer, please.")
        stream = gw.generate(Job([prompt], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True), n=3))
        async for d in stream:
            if d.token_ids:
                break
        stream.close()
        await _settle(gw)
        assert gw.in_flight == 0 and not engine.has_unfinished
        await gw.flush_cache()  # applied by the engine thread on its next turn
        deadline = time.monotonic() + 30
        while engine.pool.num_free != idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert engine.pool.num_free == idle

    _run(tiny_model, body)


def test_overlap_gives_the_same_text_for_choices_and_stop_strings(tiny_model) -> None:
    """Overlap scheduling (the engine learns tokens one step late; a stop string ends a choice by an abort
    from the gateway): the same texts, token ids and finish reasons as without overlap."""
    results = {}
    for overlap in (False, True):
        cfg = GatewayConfig(EngineConfig(model=str(tiny_model), overlap=overlap,
                                         scheduler=SchedulerConfig(max_running=4, max_waiting=4)))

        async def main() -> None:
            gw = Gateway(cfg, client=InProcEngineClient(cfg.engine))
            await gw.start()
            try:
                prompt = await gw.encode_prompt("The scheduler hands out a token budget")
                full = await _collect(gw, Job([prompt, prompt[:5]], GREEDY, n=2))
                stop = full[0][0][3:6]
                stopped = await _collect(gw, Job([prompt, prompt[:5]], GREEDY, stop=(stop,)))
                results[overlap] = (full, stopped)
                await _settle(gw)
                assert not gw.client.engine.has_unfinished
            finally:
                await gw.shutdown()

        asyncio.run(main())
    assert results[True] == results[False]
    assert results[True][1][0][2] == "stop"
