"""The short-conv reference matches a literal loop and is invariant to how the input is split."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from k3rt.kernels.short_conv import causal_conv1d

B, C = 2, 6


def _inputs(T: int, W: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, T, C], weight [C, W], a random conv_state [B, W-1, C]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    state = torch.randn(B, W - 1, C, generator=gen)
    return x, weight, state


def _literal_loop(x: Tensor, weight: Tensor, state: Tensor, silu: bool) -> Tensor:
    """y[b, t, c] = sum_i weight[c, i] * xs[b, t + i, c] with xs = concat(state, x), in fp64."""
    xs = torch.cat([state, x], dim=1).double()
    Bn, T, Cn = x.shape
    W = weight.shape[1]
    y = torch.zeros(Bn, T, Cn, dtype=torch.float64)
    for b in range(Bn):
        for t in range(T):
            for c in range(Cn):
                for i in range(W):
                    y[b, t, c] += weight[c, i].double() * xs[b, t + i, c]
    return F.silu(y) if silu else y


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "linear"])
@pytest.mark.parametrize("W", [2, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T", [1, 2, 9], ids=lambda t: f"T{t}")
def test_prefill_without_state_matches_loop(T: int, W: int, activation: str | None) -> None:
    x, weight, _ = _inputs(T, W)
    y, new_state = causal_conv1d(x, weight, activation=activation)
    zeros = torch.zeros(B, W - 1, C)
    expected = _literal_loop(x, weight, zeros, silu=activation == "silu")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y.double() - expected).abs().max() <= 1e-5
    assert torch.equal(new_state, torch.cat([zeros, x], dim=1)[:, -(W - 1) :])


@pytest.mark.parametrize("W", [2, 4], ids=lambda w: f"W{w}")
def test_with_state_matches_loop(W: int) -> None:
    x, weight, state = _inputs(7, W, seed=1)
    y, _ = causal_conv1d(x, weight, state)
    assert (y.double() - _literal_loop(x, weight, state, silu=True)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "pieces", [[1, 2, 5, 3, 1], [2, 10], [12]], ids=["ragged", "short_then_long", "whole"]
)
def test_chunked_feeding_equals_one_call(pieces: list[int]) -> None:
    x, weight, state = _inputs(sum(pieces), 4, seed=2)
    y_whole, s_whole = causal_conv1d(x, weight, state)
    ys, s = [], state
    for part in x.split(pieces, dim=1):
        y, s = causal_conv1d(part, weight, s)
        ys.append(y)
    assert (torch.cat(ys, dim=1) - y_whole).abs().max() <= 1e-6
    assert torch.equal(s, s_whole)


def test_decode_steps_equal_prefill() -> None:
    x, weight, _ = _inputs(10, 4, seed=3)
    y_prefill, s_prefill = causal_conv1d(x, weight)
    s: Tensor | None = None
    for t in range(x.shape[1]):
        y_t, s = causal_conv1d(x[:, t : t + 1], weight, s)
        assert (y_t - y_prefill[:, t : t + 1]).abs().max() <= 1e-6
    assert torch.equal(s, s_prefill)


def test_short_input_shifts_state() -> None:
    # T=2 < W-1=3: the new state keeps the newest old row and appends both inputs.
    x, weight, state = _inputs(2, 4, seed=4)
    y, new_state = causal_conv1d(x, weight, state)
    assert torch.equal(new_state, torch.cat([state[:, 2:], x], dim=1))
    assert (y.double() - _literal_loop(x, weight, state, silu=True)).abs().max() <= 1e-5


def test_dtypes_and_state_not_modified() -> None:
    x, weight, state = _inputs(5, 4, seed=5)
    state_before = state.clone()
    y, new_state = causal_conv1d(x.to(torch.bfloat16), weight, state)
    assert y.dtype == torch.bfloat16 and new_state.dtype == torch.float32
    assert torch.equal(state, state_before)
    y_ref, _ = causal_conv1d(x.to(torch.bfloat16).float(), weight, state)
    assert torch.equal(y, y_ref.to(torch.bfloat16))
    _, s16 = causal_conv1d(x.to(torch.bfloat16), weight)
    assert s16.dtype == torch.bfloat16


def test_rejects_bad_arguments() -> None:
    x, weight, state = _inputs(3, 4)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, weight[:-1])
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, weight, state[:, 1:])
