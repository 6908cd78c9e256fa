"""Requests that can never fit get a 400 naming why, never a 429 or a hang; the smallest pool that starts
serves one request of its size, and n copies of it one after another."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, READY_TIMEOUT_S, SMALL_POOL_PAGES, ServeProcess


def _complete(server: ServeProcess, prompt, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
            "ignore_eos": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def _capacity(server: ServeProcess) -> int:
    """prompt + max_tokens of the largest request the pool holds (the last sampled token is never fed)."""
    info = server.stats()["info"]
    assert info["num_pages"] == SMALL_POOL_PAGES
    kv_pages = info["num_pages"] - info["pages_per_state_set"]
    return kv_pages * info["block_size"] + 1


def _prompt(num_tokens: int) -> list[int]:
    return [10 + i % 200 for i in range(num_tokens)]


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


@pytest.mark.timeout(300)
def test_smallest_pool_serves_a_request_that_fills_it(small_server: ServeProcess) -> None:
    total = _capacity(small_server)
    r = _complete(small_server, _prompt(total - 7), 7)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 7
    # the engine runs n choices one after another when they do not fit together
    r = _complete(small_server, _prompt(total - 7), 7, n=4)
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 4
    assert r.json()["usage"]["completion_tokens"] == 28


@pytest.mark.timeout(120)
def test_one_token_more_than_the_pool_is_a_400_naming_the_limit(small_server: ServeProcess) -> None:
    total = _capacity(small_server)
    for n in (1, 4):
        e = _error(_complete(small_server, _prompt(total - 7), 8, n=n))
        assert e["param"] == "prompt"
        assert f"max_tokens 8 need {SMALL_POOL_PAGES + 1} cache pages" in e["message"]
        assert f"the pool has {SMALL_POOL_PAGES}" in e["message"]
    assert small_server.stats()["stats"]["in_flight"] == 0


@pytest.mark.timeout(120)
def test_more_choices_than_the_server_ever_admits_is_a_400(small_server: ServeProcess) -> None:
    # --max-running 2 --max-waiting 6: at most 8 generations at once, however idle the engine
    e = _error(_complete(small_server, _prompt(5), 2, n=9))
    assert e["param"] == "n" and "at most 8 generations" in e["message"], e
    e = _error(_complete(small_server, [_prompt(5), _prompt(6), _prompt(7)], 2, n=3))
    assert e["param"] == "prompt" and "9 generations" in e["message"] and "at most 8" in e["message"], e
    r = httpx.post(small_server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 9})
    assert _error(r)["param"] == "n"
    r = _complete(small_server, _prompt(5), 2, n=6)  # what fits the queue is served
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 6


@pytest.mark.timeout(READY_TIMEOUT_S + 60)
def test_a_pool_smaller_than_one_request_does_not_start(tiny_model, log_dir) -> None:
    s = ServeProcess(tiny_model, log_dir, "--cache-pages", str(SMALL_POOL_PAGES - 1))
    try:
        code = s.proc.wait(READY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        s.kill()
        raise AssertionError(f"k3rt serve started with {SMALL_POOL_PAGES - 1} pages:\n{s.log()}") from None
    assert code == 1, s.log()
    assert f"the pool holds {SMALL_POOL_PAGES - 1} pages; one request needs at least {SMALL_POOL_PAGES}" in s.log()


@pytest.mark.timeout(120)
def test_as_many_choices_as_the_gateway_admits_are_served(small_server: ServeProcess) -> None:
    r = _complete(small_server, _prompt(5), 2, n=8)
    assert r.status_code == 200, r.text
