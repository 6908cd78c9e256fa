"""Pins: a finished `pin=True` request keeps its end-of-request snapshot through any eviction until it is
unpinned (a DSL program between two calls); accounting returns to idle afterwards."""

from __future__ import annotations

import pytest

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.tiny import make_tiny
from k3rt.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pin"), arch="kimi_linear", dtype="float32", seed=4)


def _finish(eng: Engine, rid: int):
    while eng.has_unfinished:
        for o in eng.step():
            if o.rid == rid and o.finished:
                return o
    raise AssertionError("request did not finish")


def test_pinned_snapshot_survives_eviction_until_unpinned(tiny) -> None:
    eng = Engine(engine_config_for_tests(str(tiny), num_pages=96))
    prompt = list(range(3, 103))
    pinned = eng.add_request(prompt, GREEDY, pin=True)
    out = _finish(eng, pinned)
    fed = prompt + out.output_ids[:-1]
    plain = eng.add_request(list(range(200, 290)), GREEDY)
    _finish(eng, plain)
    eng.scheduler.tree.evict(eng.pool.num_pages)  # evict everything evictable
    eng.check()
    m = eng.scheduler.tree.match(fed, touch=False)
    assert m.state_hit == len(fed)  # the pinned end snapshot is still there
    assert eng.scheduler.tree.match(list(range(200, 289)), touch=False).state_hit == 0  # the unpinned one went
    # the next call of the "program" resumes from the pinned snapshot: only its new tokens are computed
    before = eng.stats.computed_prompt_tokens
    nxt = eng.add_request(fed + out.output_ids[-1:] + [7, 8], GREEDY)
    _finish(eng, nxt)
    assert eng.stats.computed_prompt_tokens - before == 3
    eng.unpin(pinned)
    eng.unpin(pinned)  # a second unpin is a no-op
    eng.check()
    eng.scheduler.tree.reset()
    assert eng.pool.num_free == eng.pool.num_pages
