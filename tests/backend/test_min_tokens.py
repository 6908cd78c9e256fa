"""min_tokens: a request's stop tokens (EOS, stop_token_ids) cannot be sampled before it has that many
output tokens, on both sampling paths (the reference runner's and the GPU runner's host fallback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3rt.backend.runner.gpu.sample import sample_step
from k3rt.backend.runner.sampling import sample_requests
from k3rt.backend.sampling.sampler import Sampler
from k3rt.backend.scheduler.request import SampleState
from k3rt.sampling_params import SamplingParams

V = 40
STOP = 33  # bits above 31 sit in the mask's second word


def _req(rid: int, num_output: int, min_tokens: int, temperature: float = 0.0):
    prompt = [1, 2, 3]
    return SimpleNamespace(rid=rid, params=SamplingParams(temperature=temperature, max_tokens=8, min_tokens=min_tokens),
                           grammar=None, stop_ids=frozenset({STOP, 5}), token_ids=prompt + [7] * num_output,
                           prompt_len=len(prompt), num_output=num_output, generator=None, sampled=SampleState())


def _logits(n: int) -> torch.Tensor:
    x = torch.zeros(n, V)
    x[:, STOP] = 10.0  # the stop token is the argmax, then token 5 (also a stop), then 9
    x[:, 5] = 9.0
    x[:, 9] = 8.0
    return x


@pytest.mark.parametrize("path", ["reference", "gpu_host"])
def test_stop_tokens_wait_for_min_tokens(path: str) -> None:
    sampler = Sampler(V, "cpu")
    reqs = [_req(0, 0, 3), _req(1, 2, 3), _req(2, 3, 3), _req(3, 0, 0)]
    if path == "reference":
        got = sample_requests(sampler, _logits(4), reqs)
    else:
        got = sample_step(sampler, _logits(4), reqs, use_kernels=False)
    # under min_tokens: the best token that is not a stop token; at or past it, and without it: the stop token
    assert got == {0: 9, 1: 9, 2: STOP, 3: STOP}


def test_sampled_rows_never_draw_a_stop_token_under_min_tokens() -> None:
    sampler = Sampler(V, "cpu")
    torch.manual_seed(0)
    reqs = [_req(i, 0, 2, temperature=1.0) for i in range(64)]
    got = sample_requests(sampler, _logits(64), reqs)
    assert not {STOP, 5} & set(got.values())


def test_min_tokens_is_checked() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
