"""The RMSNorm oracles (kernels/norm/ref.py) equal the model's functions and a naive per-row loop."""
from __future__ import annotations

import math

import pytest
import torch

from k3rt.backend.layers import norm as model_norm
from k3rt.kernels.norm import rms_norm_gated_ref, rms_norm_ref


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row by row, element by element in float64, rounding to x.dtype where the model does."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    for n in range(x.shape[0]):
        row = [float(v) for v in x[n].float()]
        rstd = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        normed = torch.tensor([v * rstd for v in row], dtype=torch.float64).to(x.dtype)
        out[n] = (weight.double() * normed.double()).to(out.dtype)
    return out


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-w32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_ref_equals_model(dtype: torch.dtype, wdtype: torch.dtype, residual: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 37, generator=gen).to(dtype)
    r = torch.randn(5, 37, generator=gen).to(dtype)
    w = (1 + 0.3 * torch.randn(37, generator=gen)).to(wdtype)
    if residual:
        y, h = rms_norm_ref(x, w, 1e-5, residual=r)
        assert h.dtype == dtype and torch.equal(h, x + r)
        assert torch.equal(y, model_norm.rms_norm(x + r, w, 1e-5))
    else:
        y = rms_norm_ref(x, w, 1e-5)
        assert torch.equal(y, model_norm.rms_norm(x, w, 1e-5))
    assert y.dtype == torch.promote_types(dtype, wdtype)


def test_rms_norm_ref_matches_naive_loop() -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 19, generator=gen) * 4
    w = torch.randn(19, generator=gen)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), naive_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_gated_ref_equals_model_and_loop(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 3, 16, generator=gen).to(dtype)
    g = torch.randn(4, 3, 16, generator=gen).to(dtype)
    w = torch.randn(16, generator=gen)
    y = rms_norm_gated_ref(x, g, w, 1e-5)
    assert y.dtype == dtype
    assert torch.equal(y, model_norm.rms_norm_gated(x, g, w, 1e-5))
    expect = torch.empty(4, 3, 16, dtype=torch.float64)
    for n in range(4):
        for h in range(3):
            row = x[n, h].double()
            rstd = 1.0 / math.sqrt(float((row * row).mean()) + 1e-5)
            expect[n, h] = w.double() * row * rstd / (1 + torch.exp(-g[n, h].double()))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), expect, rtol=tol, atol=tol)
