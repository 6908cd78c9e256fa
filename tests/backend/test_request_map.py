"""`RequestMap.step_batch` (the engine process's per-step wire message): every engine output of a live request
appears once, new-tokens-only updates in the columns and every other one (finished, aborted, with logprobs)
whole, and expanding the batch gives exactly the RequestUpdates built field by field from the
engine's outputs, which is what the gateway routed before the columns existed."""

from __future__ import annotations

from k3rt.backend.engine import Engine, RequestOutput
from k3rt.backend.request_map import RequestMap
from k3rt.config import CacheConfig, EngineConfig
from k3rt.protocol import GenerateRequest, RequestUpdate, decode, encode, params_to_dict
from k3rt.sampling_params import SamplingParams


def _expected(rm: RequestMap, outputs, names: dict[int, str]) -> list[RequestUpdate]:
    """The per-output RequestUpdates (the construction RequestMap.step used before the columns)."""
    out = []
    for o in outputs:
        if o.rid not in names:
            continue
        plp = None if o.prompt_logprobs is None else {str(k): v for k, v in o.prompt_logprobs.items()}
        out.append(RequestUpdate(names[o.rid], o.new_token_ids, o.finished, o.finish_reason, o.prompt_len,
                                 o.cached_tokens, o.logprobs, o.top_logprobs, error=o.error, prompt_logprobs=plp,
                                 spec_accepted_tokens=o.spec_accepted_tokens))
    return out


def test_step_batch_expands_to_the_per_output_updates() -> None:
    eng = Engine(EngineConfig(model="k3-tiny", runner="null", cache=CacheConfig(num_pages=256)))
    rm = RequestMap(eng)
    for i in range(12):
        params = SamplingParams(temperature=0.0, max_tokens=3 + i % 5, ignore_eos=True)
        assert rm.add(GenerateRequest(f"r{i}", [3 + i, 4, 5 + i] * (1 + i), params_to_dict(params))) is None
    seen_columns = seen_whole = 0
    step = eng.step
    for n in range(40):
        if not eng.has_unfinished:
            break
        if n == 2:
            rm.abort("r5")  # an aborted request's last update is a whole one
        outputs = []
        eng.step = lambda: outputs.extend(step()) or outputs
        names = dict(rm.names)
        batch = rm.step_batch()
        eng.step = step
        assert all(not u.finished for u in batch.expand()[len(batch.updates):])
        assert all(u.finished for u in batch.updates)
        key = lambda u: u.rid  # noqa: E731  (one update per request per step)
        want = sorted(_expected(rm, outputs, names), key=key)
        assert sorted(batch.expand(), key=key) == want
        assert sorted(decode(encode(batch), trusted=True).expand(), key=key) == want
        seen_columns += len(batch.rids)
        seen_whole += len(batch.updates)
    assert not eng.has_unfinished and not rm.names
    assert seen_whole == 12 and seen_columns > 12


def test_an_update_with_logprobs_travels_whole() -> None:
    eng = Engine(EngineConfig(model="k3-tiny", runner="null", cache=CacheConfig(num_pages=64)))
    rm = RequestMap(eng)
    assert rm.add(GenerateRequest("a", [3, 4], params_to_dict(SamplingParams(max_tokens=4)))) is None
    assert rm.add(GenerateRequest("b", [3, 5], params_to_dict(SamplingParams(max_tokens=4)))) is None
    ra, rb = rm.rids["a"], rm.rids["b"]
    eng.step = lambda: [RequestOutput(ra, [5], None, False, None, 2, 0, logprobs=[-0.1], top_logprobs=[[[5, -0.1]]]),
                        RequestOutput(rb, [6], None, False, None, 2, 1)]
    batch = rm.step_batch()
    assert batch.updates == [RequestUpdate("a", [5], prompt_tokens=2, logprobs=[-0.1], top_logprobs=[[[5, -0.1]]])]
    assert (batch.rids, batch.token_ids, batch.prompt_tokens, batch.cached_tokens) == (["b"], [[6]], [2], [1])


def test_the_running_requests_output_fast_path_fills_the_named_fields() -> None:
    """Engine._output builds a running request's RequestOutput positionally: each value in its own field."""
    eng = Engine(EngineConfig(model="k3-tiny", runner="null", cache=CacheConfig(num_pages=64)))
    rid = eng.add_request([3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()
    req = eng.requests[rid]
    req.spec_accepted, req.cached_tokens = 2, 1
    got = eng._output(req, [9])
    assert got == RequestOutput(rid=rid, new_token_ids=[9], output_ids=None, finished=False, finish_reason=None,
                                prompt_len=3, cached_tokens=1, spec_accepted_tokens=2)
