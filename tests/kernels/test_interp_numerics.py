"""kernels/interp_numerics.py: the interpreter's bf16 and tf32 made to round as the GPU does.

The helpers are checked here against torch's own conversions. The patch is process-wide (it changes every later
interpreted launch), so everything that installs it runs in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import torch

from k3rt.kernels.interp_numerics import bf16_to_f32, f32_to_bf16, tf32


def _edge_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-40, 38, 4096)
    ties = (torch.arange(1, 200, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)  # exactly halfway
    odd_ties = (torch.arange(1, 200, dtype=torch.int32) << 16 | 0x18000).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-45, 1.17e-38, 65504.0])
    return torch.cat([x, ties, -odd_ties, special])


def test_rounding_matches_torch() -> None:
    x = _edge_values()
    bits = f32_to_bf16(x.numpy())
    assert np.array_equal(bits, x.bfloat16().view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(bf16_to_f32(bits), x.bfloat16().float().numpy())
    assert np.array_equal(f32_to_bf16(x.numpy(), rtz=True), (x.view(torch.int32) >> 16).numpy().astype(np.uint16))
    nan = f32_to_bf16(np.array([np.nan], dtype=np.float32))
    assert np.isnan(bf16_to_f32(nan)).all()


def test_tf32_keeps_ten_mantissa_bits() -> None:
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -10 + 2.0 ** -12), 3.0])
    assert tf32(x.numpy()).tolist() == [1.0 + 2.0 ** -10, 1.0, -(1.0 + 2.0 ** -10), 3.0]


_SCRIPT = textwrap.dedent('''
    import numpy as np, torch, triton, triton.language as tl
    import k3rt.kernels.common as common
    from k3rt.kernels.interp_numerics import tf32
    assert common.GPU_NUMERICS and not common.EXACT_DOTS

    @triton.jit
    def k(a_ptr, b_ptr, x_ptr, y_ptr, o_dot, o_ops, o_cast, o_tf32, o_sum, o_max):
        r = tl.arange(0, 16)
        t = r[:, None] * 16 + r[None, :]
        a, b = tl.load(a_ptr + t), tl.load(b_ptr + t)
        tl.store(o_dot + t, tl.dot(a, b))
        tl.store(o_ops + t, a * b - a)
        x, y = tl.load(x_ptr + t), tl.load(y_ptr + t)
        tl.store(o_cast + t, x.to(tl.bfloat16))
        tl.store(o_tf32 + t, tl.dot(x, y, input_precision="tf32"))
        tl.store(o_sum + r, tl.sum(a, axis=1))
        tl.store(o_max + r, tl.max(a, axis=0))

    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(16, 16, generator=g).bfloat16() for _ in range(2))
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    bf = dict(dtype=torch.bfloat16)
    o = dict(dot=torch.empty(16, 16), ops=torch.empty(16, 16, **bf), cast=torch.empty(16, 16, **bf),
             tf32=torch.empty(16, 16), sum=torch.empty(16, **bf), max=torch.empty(16, **bf))
    k[(1,)](a, b, x, y, *o.values())
    torch.testing.assert_close(o["dot"], a.float() @ b.float(), rtol=1e-6, atol=1e-5)
    assert torch.equal(o["ops"], a * b - a)  # each op rounded to bf16, as torch rounds its bf16 ops
    assert torch.equal(o["cast"], x.bfloat16())
    want = torch.from_numpy(tf32(x.numpy())) @ torch.from_numpy(tf32(y.numpy()))
    torch.testing.assert_close(o["tf32"], want, rtol=1e-6, atol=1e-5)
    assert (o["tf32"] - x @ y).abs().max() > 1e-4  # tf32 is not fp32
    assert torch.equal(o["sum"], a.float().sum(1).bfloat16())
    assert torch.equal(o["max"], a.max(0).values)

    # the KDA chunk prefill's GPU path (bf16 dot operands, bf16 scratch) at the Kimi head width, against the
    # fp32 oracle: the interpreter ran it with fp32 operands before
    from k3rt.kernels.kda.ref import kda_chunked
    from k3rt.kernels.kda.triton_chunk import kda_chunk_fwd
    T, H, D = 64 + 37, 1, 128
    q, kk, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    gg = -torch.nn.functional.softplus(torch.randn(T, H, D, generator=g)) * 0.1
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    o_ref, s_ref, _ = kda_chunked(q[None], kk[None], v[None], gg[None], beta[None])
    blocks_all = dict(intra="blocks", fuse_gc_blocks=True, inverse_regs_blocks=True, out_chunk_blocks=True,
                      l_chunk_blocks=True)
    for form in (dict(intra="fused"), dict(intra="blocks"), blocks_all):
        state = torch.zeros(1, H, D, D)
        cu = torch.tensor([0, T], dtype=torch.int32)
        out = kda_chunk_fwd(q.bfloat16(), kk.bfloat16(), v.bfloat16(), gg, beta, cu, state,
                            torch.tensor([0], dtype=torch.int32), has_initial_state=torch.tensor([False]), **form)
        err = ((out.float() - o_ref[0]).norm() / o_ref.norm()).item()
        serr = ((state[0] - s_ref[0]).norm() / s_ref.norm()).item()
        print(form, err, serr)
        assert 1e-3 < err < 1e-2 and serr < 1e-2, (form, err, serr)  # bf16-sized error: neither garbage nor fp32
''')


def test_gpu_numerics_under_the_interpreter() -> None:
    """Under K3RT_GPU_NUMERICS=1 a kernel's bf16 ops, casts, reductions and dots equal torch's bf16 results; tf32
    dots equal products of tf32-cut operands; the KDA chunk prefill takes its GPU bf16-dot path and lands at bf16
    error against the fp32 oracle (the plain interpreter returns ~1e38 for bf16 dots)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "K3RT_GPU_NUMERICS": "1"}
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
