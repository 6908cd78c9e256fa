"""One request never takes a real `k3rt serve` down (issue 19, part 1): the grammars that used to kill the
engine process at their first token (`a{1000000}`, `(ab){300000}`, a choice of one 1M-character string)
through completions, chat, streaming and the DSL port get a 400 (or a program error) naming the field,
while another client's request finishes with its usual output and /health keeps answering."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import k3rt
from tests.server.conftest import MODEL_NAME, log_dir, serving, tiny_model  # noqa: F401

pytestmark = pytest.mark.serial  # a /health latency bound: run alone (Makefile)

BAD = [
    ("regex", "a{1000000}"),
    ("regex", "(ab){300000}"),
    ("choice", ["x" * 1_000_000]),
]


@pytest.fixture(scope="module")
def srv(tiny_model, log_dir):  # noqa: F811
    with serving(tiny_model, log_dir) as s:
        yield s


def _completion(url: str, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "The river", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body | extra, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", ["completions", "chat", "chat-stream"])
def test_grammars_that_killed_the_engine_get_a_400_and_others_carry_on(srv, route):
    want = _completion(srv.url).json()["choices"][0]["text"]
    for field, value in BAD:
        other: dict = {}
        t = threading.Thread(target=lambda: other.update(r=_completion(srv.url)))
        t.start()
        if route == "completions":
            r = _completion(srv.url, **{field: value})
        else:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    field: value, "stream": route == "chat-stream"}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        t.join(60)
        assert r.status_code == 400, (field, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == field and ("expand" in err["message"] or "characters" in err["message"]), err
        assert other["r"].status_code == 200 and other["r"].json()["choices"][0]["text"] == want
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 1.0
    assert srv.proc.poll() is None


@pytest.mark.timeout(120)
def test_a_dsl_program_with_such_a_grammar_gets_an_error_and_the_server_stays(srv):
    backend = k3rt.connect(f"tcp://127.0.0.1:{srv.port + 1}")

    @k3rt.function
    def bad(s):
        s += "Answer: " + k3rt.gen("x", max_tokens=4, regex="a{1000000}")

    @k3rt.function
    def good(s):
        s += "Answer: " + k3rt.gen("x", max_tokens=4, temperature=0.0, ignore_eos=True)

    try:
        with pytest.raises(Exception, match="regex"):
            bad.run(backend=backend)["x"]
        assert len(good.run(backend=backend)["x"]) > 0
    finally:
        backend.shutdown()
    assert srv.proc.poll() is None and httpx.get(srv.url + "/health", timeout=5).status_code == 200
