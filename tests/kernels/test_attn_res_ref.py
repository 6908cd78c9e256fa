"""The attention-residual oracle (kernels/attn_res/ref.py) equals the model's mix and a naive loop."""
from __future__ import annotations

import math

import pytest
import torch

from k3rt.backend.models.attn_res import attn_res_mix as model_mix
from k3rt.kernels.attn_res import attn_res_mix_ref


@pytest.mark.parametrize("J", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ref_equals_model(J: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(J)
    buf = torch.randn(7, 4, 24, generator=gen).to(dtype)  # Jmax = 7 > J: the tail slots must be ignored
    nw, pw = torch.randn(24, generator=gen).to(dtype), torch.randn(1, 24, generator=gen).to(dtype)
    got = attn_res_mix_ref(buf, J, nw, pw, 1e-5)
    expect = model_mix(list(buf[: J - 1]), buf[J - 1], nw, pw, 1e-5)
    assert got.dtype == dtype and torch.equal(got, expect)


def test_ref_matches_naive_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    J, N, D = 4, 3, 10
    buf = torch.randn(J, N, D, generator=gen) * torch.tensor([0.5, 2.0, 5.0, 1.0])[:, None, None]
    nw, pw = torch.randn(D, generator=gen), torch.randn(D, generator=gen)
    got = attn_res_mix_ref(buf, J, nw, pw, 1e-6)
    for n in range(N):
        logits = []
        for j in range(J):
            row = [float(v) for v in buf[j, n]]
            rstd = 1.0 / math.sqrt(sum(v * v for v in row) / D + 1e-6)
            logits.append(sum(row[d] * rstd * float(nw[d]) * float(pw[d]) for d in range(D)))
        top = max(logits)
        weights = [math.exp(v - top) for v in logits]
        total = sum(weights)
        for d in range(D):
            expect = sum(weights[j] / total * float(buf[j, n, d]) for j in range(J))
            assert abs(float(got[n, d]) - expect) < 1e-5 * (1 + abs(expect))
