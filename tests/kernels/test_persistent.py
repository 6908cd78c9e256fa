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


def test_the_persistent_kernels_compile_one_binary_whatever_the_grid_size() -> None:
    """grid_for sizes the grid from a binary compiled with G = 1; Triton folds an int argument equal to 1 in as a
    constant (and one divisible by 16 as such), so unless G is never specialized the launched binary (G = the real
    grid) differs from the sized one, with more registers: on the H100 (session 42) the MoE layer's per_sm=16
    candidate then launched more programs than the SMs held (10,594 stalled waits). Checked without the interpreter
    (which does not keep the kernels' specialization), in a subprocess."""
    import json
    import os
    import subprocess
    import sys

    code = r'''
import json
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from k3rt.kernels.moe import triton_layer as moe
from k3rt.kernels.kda import triton_layer as kda
from k3rt.kernels.mla import triton_layer as mla
out = {}
for k in (moe._moe_layer_kernel, kda._kda_layer_kernel, mla._mla_pre_kernel, mla._mla_post_kernel):
    g = next(p for p in k.params if p.name == "G")
    keys = {str(native_specialize_impl(BaseBackend, v, False, not g.do_not_specialize, not g.do_not_specialize_on_alignment))
            for v in (1, 3, 1056, 1320)}
    out[k.fn.__name__ if hasattr(k, "fn") else k.__name__] = len(keys)
# grid_for refuses a kernel that would specialize its grid size (before compiling anything)
from types import SimpleNamespace
from k3rt.kernels import persistent as P

param = lambda name, dns: SimpleNamespace(name=name, do_not_specialize=dns)
_specializes = SimpleNamespace(fn=SimpleNamespace(__qualname__="k"), params=[param("x_ptr", False), param("G", False)])
try:
    P.grid_for(_specializes, (None, 1), {}, 0, 1, 1)
    out["refused"] = False
except ValueError as e:
    out["refused"] = "do_not_specialize" in str(e)
print(json.dumps(out))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got.pop("refused") is True, got
    assert len(got) == 4 and all(n == 1 for n in got.values()), got
