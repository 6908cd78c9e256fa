"""Issue 15's acceptance test: shipped DSL programs against a real `k3rt serve` never leak pins.

Each program's one gen pins its end-of-generation snapshot, and the program's end unpins it. Gens that
end by a stop string are the case that used to leak: the gateway aborts the still-running request, and
the program's end sends its Unpin in the same engine drain. After every round the engine holds no pin;
after the last one a cache flush gives back every page the rounds used, and the server still serves.
"""

from __future__ import annotations

import collections
import time

import httpx
import pytest

import k3rt
from tests.server.conftest import MODEL_NAME, ServeProcess

ROUNDS, PROGRAMS = 20, 32
STOP = ["e", " "]  # frequent in the tiny model's text at temperature 0.8: some gens end by a stop string


@k3rt.function
def short(s, topic):
    s += k3rt.user(f"Say something about {topic}.")
    s += k3rt.assistant(k3rt.gen("answer", max_tokens=4, temperature=0.8, stop=STOP))


def _complete(server: ServeProcess, prompt: str) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def _pins(server: ServeProcess, timeout: float = 5.0) -> int:
    """The engine's pins once they reach 0, or after `timeout`. Unpins are sent as sessions close, before
    their results; a 1-token request makes the engine step and report its stats at once, rather than at
    its next once-a-second report."""
    deadline = time.monotonic() + timeout
    while True:
        _complete(server, "a nudge")
        pins = server.stats()["stats"]["pins"]
        if pins == 0 or time.monotonic() > deadline:
            return pins
        time.sleep(0.1)


def _settled(server: ServeProcess, key: str, want: int, timeout: float = 5.0) -> int:
    """Poll the engine's stat until it equals `want`; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = server.stats()["stats"].get(key)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _flush(server: ServeProcess) -> None:
    r = httpx.post(server.url + "/v1/k3rt/flush_cache", timeout=10)
    assert r.status_code == 200, r.text


def _baseline(server: ServeProcess) -> int:
    """pages_used once the cache is flushed and the value holds still for a second."""
    _flush(server)
    last, since = None, time.monotonic()
    deadline = since + 10
    while time.monotonic() < deadline:
        value = server.stats()["stats"]["pages_used"]
        if value != last:
            last, since = value, time.monotonic()
        elif time.monotonic() - since > 1.2:
            break
        time.sleep(0.05)
    return last


@pytest.mark.timeout(120)
def test_rounds_of_programs_with_stop_strings_leak_no_pins(server: ServeProcess) -> None:
    assert _pins(server) == 0
    before = _baseline(server)
    backend = k3rt.connect(f"tcp://127.0.0.1:{server.port + 1}", timeout=60)
    reasons: collections.Counter[str] = collections.Counter()
    try:
        for r in range(ROUNDS):
            states = short.run_batch([{"topic": f"topic {r}.{i}"} for i in range(PROGRAMS)], backend=backend)
            assert all(s.error() is None for s in states), [s.error() for s in states if s.error()]
            reasons.update(s.meta("answer")["finish_reason"] for s in states)
            pins = _pins(server)
            assert pins == 0, f"round {r}: {pins} pins left after every program ended ({dict(reasons)})"
    finally:
        backend.shutdown()
    assert reasons["stop_string"] > 0, f"no gen ended by a stop string: {dict(reasons)}"
    _flush(server)
    assert _settled(server, "pages_used", before) == before, server.stats()["stats"]
    _complete(server, "after the rounds")
