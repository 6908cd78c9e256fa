"""logit_bias in the batched sampler: added to the named tokens' logits of its own row only, before
penalties and temperature; a grammar-banned token stays banned; ids outside the vocabulary fail naming it."""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.sampling.bitmask import apply_token_bitmask
from k3rt.backend.sampling.sampler import Sampler, apply_logit_bias
from k3rt.sampling_params import SamplingParams

V = 40


def _logits(rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(0))


def test_bias_moves_greedy_choice_of_its_row_only():
    x = _logits()
    plain = SamplingParams(temperature=0.0, logprobs=2)
    biased = SamplingParams(temperature=0.0, logprobs=2, logit_bias=((7, 100.0), (int(x[1].argmax()), -100.0)))
    s = Sampler(V, "cpu")
    base = s.sample_batch(x, [plain] * 3, [None] * 3, [()] * 3, [()] * 3)
    out = s.sample_batch(x, [plain, biased, plain], [None] * 3, [()] * 3, [()] * 3)
    assert out.token_ids[1] == 7
    assert out.token_ids[0] == base.token_ids[0] and out.token_ids[2] == base.token_ids[2]
    assert out.logprobs[0] == base.logprobs[0] and out.logprobs[2] == base.logprobs[2]  # rows untouched exactly
    # logprobs describe the biased distribution: token 7 holds nearly all of the mass
    assert out.logprobs[1] > -1e-3 and out.top_logprobs[1][0][0] == 7


def test_negative_bias_bans_under_sampling():
    x = torch.zeros(1, V)
    params = SamplingParams(temperature=1.0, seed=1, logit_bias=tuple((t, -100.0) for t in range(V - 1)))
    s = Sampler(V, "cpu")
    draws = {s.sample_batch(x, [params], [torch.Generator().manual_seed(i)], [()], [()]).token_ids[0] for i in range(20)}
    assert draws == {V - 1}


def test_banned_token_stays_banned_and_values_add():
    x = torch.zeros(2, V)
    mask = torch.full((2, (V + 31) // 32), -1, dtype=torch.int32)
    mask[0, 0] = ~1  # row 0: token 0 disallowed
    masked = apply_token_bitmask(x, mask)
    out = apply_logit_bias(masked, [SamplingParams(logit_bias=((0, 100.0), (3, 2.5))),
                                    SamplingParams(logit_bias=((3, -1.0),))])
    assert out[0, 0] == float("-inf") and out[0, 3] == 2.5 and out[1, 3] == -1.0
    assert masked[0, 3] == 0.0  # a new tensor; the input is not modified


def test_out_of_vocab_id_is_named():
    with pytest.raises(ValueError, match=r"logit_bias: token id 40 outside the vocabulary \[0, 40\)"):
        apply_logit_bias(torch.zeros(1, V), [SamplingParams(logit_bias=((40, 1.0),))])
