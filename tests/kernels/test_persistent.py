"""kernels/persistent.py: the grid of a persistent launch fits what the SMs hold at once (the launch's waits need every
program resident); the counters' code is exercised by the persistent layer kernels' tests."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from k3rt.kernels import persistent as P  # noqa: E402


def test_resident_programs_fit_the_sms(monkeypatch) -> None:
    """The grid holds per_sm programs an SM where registers (256 a warp at a time), threads and shared memory allow,
    never fewer than one an SM."""
    monkeypatch.setattr(P, "_sm_limits", lambda index: (132, 2048, 65536, 233472))
    assert P.resident_programs(0, 2, 94, 1024, 8) == 132 * 8  # 96 x 32 x 2 registers: 10 fit
    assert P.resident_programs(0, 2, 200, 1024, 8) == 132 * 5  # 200 -> 224 a thread: 65536 // 14336
    assert P.resident_programs(0, 4, 64, 100_000, 8) == 132 * 2  # shared memory: 2
    assert P.resident_programs(0, 32, 255, 0, 8) == 132  # one fits only partly: still one
    assert P.resident_programs(0, 1, 32, 0, 64) == 132 * 32  # the hardware's 32 programs an SM
