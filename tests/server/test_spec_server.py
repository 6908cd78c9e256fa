"""`k3rt serve --spec suffix`: greedy completions equal the in-process engine without speculation, a
repeated request is drafted from the server's earlier output (accepted tokens and tau > 1 on /metrics),
`"speculative": false` opts one request out, and a DSL program runs unchanged."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import k3rt
from tests.server.conftest import MODEL_NAME, ServeProcess, serving


@pytest.fixture(scope="module")
def spec_server(tiny_model: Path, log_dir: Path):
    # --no-spec-adaptive: the controller's choices follow wall time; this test pins what drafting does
    with serving(tiny_model, log_dir, "--spec", "suffix", "--spec-tokens", "4", "--no-spec-adaptive") as s:
        yield s


def _complete(server: ServeProcess, prompt: str, **extra) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _metric(server: ServeProcess, name: str, sample: str | None = None) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for f in text_string_to_metric_families(text):
        if f.name == name:
            return next(s.value for s in f.samples if s.name == (sample or name))
    raise KeyError(name)


def _engine_reference(model: Path, prompt_ids: list[int]) -> list[int]:
    from k3rt.backend.engine import Engine, engine_config_for_tests
    from k3rt.sampling_params import SamplingParams

    eng = Engine(engine_config_for_tests(str(model)))
    [out] = eng.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return out.output_ids


@pytest.mark.timeout(240)
def test_speculative_server(spec_server: ServeProcess, tiny_model: Path) -> None:
    first = _complete(spec_server, "The speculative server says")
    ids = first["choices"][0]["token_ids"]
    assert ids == _engine_reference(tiny_model, first["prompt_token_ids"])
    accepted0 = spec_server.stats()["stats"]["spec_accepted_tokens"]
    # the same request again: the suffix drafter's global trie holds the first output
    again = _complete(spec_server, "The speculative server says")
    assert again["choices"][0]["token_ids"] == ids
    assert 0 < again["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] < len(ids)
    assert "completion_tokens_details" not in _complete(spec_server, "Something new entirely")["usage"]
    accepted1 = spec_server.stats()["stats"]["spec_accepted_tokens"]
    assert accepted1 > accepted0
    assert _metric(spec_server, "k3rt_spec_accepted_tokens", "k3rt_spec_accepted_tokens_total") == accepted1
    assert _metric(spec_server, "k3rt_spec_drafted_tokens", "k3rt_spec_drafted_tokens_total") >= accepted1
    assert _metric(spec_server, "k3rt_spec_tau") > 1.0
    # without the controller nothing is skipped, and the steps that verified are a share of those that could draft
    assert _metric(spec_server, "k3rt_spec_steps_skipped", "k3rt_spec_steps_skipped_total") == 0
    speculated = _metric(spec_server, "k3rt_spec_steps_speculated", "k3rt_spec_steps_speculated_total")
    assert 0 < speculated <= _metric(spec_server, "k3rt_spec_steps", "k3rt_spec_steps_total")
    assert 0 < _metric(spec_server, "k3rt_spec_speculated_fraction") <= 1.0
    # a stop string inside an accepted run: the text ends where the stop string starts
    text = first["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = _complete(spec_server, "The speculative server says", stop=[stop])
    assert cut["choices"][0]["text"] == text[:text.find(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    # n = 2: both choices speculate (and the global trie drafts them), both equal the plain output
    two = _complete(spec_server, "The speculative server says", n=2)
    assert [c["token_ids"] for c in two["choices"]] == [ids, ids]
    # opted out: no drafts for it, same output
    drafted = spec_server.stats()["stats"]["spec_drafted_tokens"]
    out = _complete(spec_server, "The speculative server says", speculative=False)
    assert out["choices"][0]["token_ids"] == ids
    assert spec_server.stats()["stats"]["spec_drafted_tokens"] == drafted


@k3rt.function
def _two_turns(s, topic):
    s += k3rt.user(f"Tell me about {topic}.")
    s += k3rt.assistant(k3rt.gen("a", max_tokens=6, temperature=0))
    s += k3rt.user("Again.")
    s += k3rt.assistant(k3rt.gen("b", max_tokens=6, temperature=0))


@pytest.mark.timeout(240)
def test_dsl_programs_run_unchanged_on_a_speculative_server(spec_server: ServeProcess) -> None:
    backend = k3rt.connect(f"tcp://127.0.0.1:{spec_server.port + 1}", timeout=60)
    try:
        runs = [_two_turns.run(topic="suffixes", backend=backend) for _ in range(2)]
    finally:
        backend.shutdown()
    assert all(r.error() is None for r in runs), [r.error() for r in runs]
    assert runs[0]["a"] == runs[1]["a"] and runs[0]["b"] == runs[1]["b"]
    assert runs[0]["a"] and runs[0]["b"]
