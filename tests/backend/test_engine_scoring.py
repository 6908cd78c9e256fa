"""Prompt scoring (`prompt_logprobs_from`): the engine returns log p(token_i | tokens_<i) for the scored
positions, equal to a cache-less full forward, even when the prefix comes from the cache."""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.loader import load_model
from k3rt.backend.models.tiny import make_tiny
from k3rt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("score"), arch="k3", dtype="float32", seed=5)


def _reference(model, ids: list[int], start: int) -> dict[int, float]:
    lp = torch.log_softmax(model(torch.tensor(ids), ForwardBatch([len(ids)])), -1)
    return {p: lp[p - 1, ids[p]].item() for p in range(start, len(ids))}


@pytest.mark.parametrize("prefix_len", [1, 63, 64, 100, 150], ids=lambda n: f"prefix{n}")
def test_prompt_logprobs_match_full_forward_with_cached_prefix(tiny, prefix_len: int) -> None:
    eng = Engine(engine_config_for_tests(str(tiny), num_pages=96))
    g = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.generate([prefix + [7, 8, 9, 10]], sp)  # publishes snapshots along the prefix
    choices = [[11, 12], [13], [14, 15, 16]]
    rids = [eng.add_request(prefix + c, SamplingParams(temperature=0, max_tokens=1), prompt_logprobs_from=prefix_len)
            for c in choices]
    done = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                done[o.rid] = o
    model = load_model(tiny, progress=False)
    for rid, c in zip(rids, choices):
        got, want = done[rid].prompt_logprobs, _reference(model, prefix + c, prefix_len)
        assert got.keys() == want.keys()
        assert max(abs(got[k] - want[k]) for k in want) < 1e-4
        if prefix_len >= 128:
            assert done[rid].cached_tokens > 0  # scoring still used the cache
    eng.check()


def test_prompt_logprobs_from_is_validated(tiny) -> None:
    eng = Engine(engine_config_for_tests(str(tiny), num_pages=32))
    with pytest.raises(ValueError, match="prompt_logprobs_from"):
        eng.add_request([5, 6, 7], prompt_logprobs_from=3)
