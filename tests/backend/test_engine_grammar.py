"""Grammars compile off the scheduler loop: a constrained request waits unadmitted until its grammar is
ready, a grammar that fails to compile ends only its own request (finish_reason "error", the message
names the problem), and constrained output obeys the grammar."""

from __future__ import annotations

import re
from concurrent.futures import Future

import pytest

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.tiny import make_tiny
from k3rt.backend.tokenizer import load_tokenizer
from k3rt.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("gram"), arch="k3", dtype="float32", seed=2)


def _drain(eng: Engine) -> dict[int, object]:
    done = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                done[o.rid] = o
    return done


def test_regex_output_obeys_the_grammar(tiny) -> None:
    eng = Engine(engine_config_for_tests(str(tiny), num_pages=64))
    rid = eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20),
                          grammar={"kind": "regex", "payload": "[0-9]{3}-[a-z]{2}", "strict": True})
    out = _drain(eng)[rid]
    assert out.error is None and out.finish_reason == "stop"
    text = load_tokenizer(tiny).decode(out.output_ids, skip_special_tokens=True)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text


def test_bad_grammar_fails_only_its_request(tiny) -> None:
    eng = Engine(engine_config_for_tests(str(tiny), num_pages=64))
    good = eng.add_request([5, 6, 7], GREEDY)
    bad = eng.add_request([8, 9], GREEDY, grammar={"kind": "regex", "payload": "(unclosed", "strict": True})
    done = _drain(eng)
    assert done[bad].finish_reason == "error" and "grammar" in done[bad].error
    assert done[good].finish_reason == "length" and len(done[good].output_ids) == 12
    eng.check()


def test_request_waits_while_its_grammar_compiles(tiny) -> None:
    eng = Engine(engine_config_for_tests(str(tiny), num_pages=64))
    slow: Future = Future()
    rid = eng.add_request([5, 6, 7], GREEDY, grammar={"kind": "regex", "payload": "[a-z]+", "strict": True})
    real = eng.requests[rid].grammar_future
    eng.requests[rid].grammar_future = slow  # stand-in for a compile still running
    other = eng.add_request([1, 2, 3], GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.requests[rid] in eng.scheduler.waiting  # not admitted; the other request ran meanwhile
    assert eng.requests[other].num_computed > 0 or other not in eng.requests
    slow.set_result(real.result())
    done = _drain(eng)
    assert done[rid].finish_reason in ("stop", "length") and done[rid].error is None
