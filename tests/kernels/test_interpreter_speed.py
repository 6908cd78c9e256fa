"""kernels/interpreter_speed.py: under the Triton interpreter a launch patches the language once, however many
device-function calls it makes, computes what it computed before, and leaves the language as it found it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from k3rt.kernels.common import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter only (CPU)")


@triton.jit
def _twice(x):
    return x * 2.0 + tl.zeros_like(x)  # zeros_like: triton's standard library, which names `core`


@triton.jit
def _calls_kernel(x_ptr, o_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    acc = tl.zeros([N], dtype=tl.float32)
    for _ in tl.static_range(CALLS):
        acc += _twice(x)
    tl.store(o_ptr + offs, acc + tl.sum(x, axis=0))


def _run(calls: int) -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32)
    o = torch.empty_like(x)
    _calls_kernel[(1,)](x, o, N=8, CALLS=calls)
    return o


def test_one_patch_per_launch_whatever_the_helper_calls(monkeypatch) -> None:
    from triton.runtime import interpreter

    count = [0]
    real = interpreter._patch_builtin

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    _run(1)  # the first launch of a kernel meets its functions for the first time
    per_launch = []
    for calls in (1, 8, 16):
        count[0] = 0
        o = _run(calls)
        x = torch.arange(8, dtype=torch.float32)
        assert torch.equal(o, calls * 2 * x + x.sum())
        per_launch.append(count[0])
    assert len(set(per_launch)) == 1, per_launch  # unwrapped: 29 / 144 / 272, ~16 per helper call


def test_the_language_is_restored_after_a_launch_and_after_a_failed_one() -> None:
    before = {name: getattr(tl.core, name) for name in ("full", "arange", "load", "store")}
    before_tl = {name: getattr(tl, name) for name in ("zeros", "sum", "arange", "load")}
    _run(2)
    with pytest.raises(Exception):
        _calls_kernel[(1,)](torch.zeros(4), torch.zeros(4), N=3, CALLS=1)  # arange of 3: not a power of 2
    assert {name: getattr(tl.core, name) for name in before} == before
    assert {name: getattr(tl, name) for name in before_tl} == before_tl
    x = torch.arange(8, dtype=torch.float32)
    assert torch.equal(_run(3), 6 * x + x.sum())  # and the next launch patches again
