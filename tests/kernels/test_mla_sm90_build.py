"""The MLA kernels build for sm_90 (H100/H200) at the 48B shape without a GPU: Triton's frontend,
ptxas and cuobjdump ship in the triton wheel. The build must not spill registers and must pipeline
its loads (cp.async), and the prefill's dots must lower to wgmma: the cheap checks of what makes
these kernels fast, runnable on CPU-only CI.

The build runs in a subprocess (tests/kernels/helpers.py: run_sm90_build) because TRITON_INTERPRET
(set by conftest.py without a GPU) changes what @triton.jit returns.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import run_sm90_build  # noqa: E402

_BUILD = r'''
from k3rt.kernels.mla import triton_decode as d, triton_prefill as p

def build(fn, sig, consts, num_warps, num_stages):
    # the runtime marks pointers and strides divisible by 16 as such; the 48B shapes all are
    return sm90_build(fn, sig, consts, num_warps, num_stages, lambda k: k.startswith("stride"))

I32, C = "i32", "constexpr"
dec = dict(q_ptr="*bf16", stride_q_n=I32, stride_q_h=I32, kv_ptr="*bf16", block_table_ptr="*i32", stride_bt_n=I32,
           seq_lens_ptr="*i32", o_ptr="*fp32", stride_o_n=I32, stride_o_h=I32, lse_ptr="*fp32", qk_scale="fp32",
           H=I32, block_size=I32, num_splits=I32, L=C, R=C, BLOCK_H=C, BLOCK_N=C, WRITE_OUT=C, DOT_PRECISION=C,
           USE_PDL=C)
pre = dict(q_ptr="*bf16", stride_q_t=I32, stride_q_h=I32, kn_ptr="*bf16", stride_kn_t=I32, stride_kn_h=I32,
           kpe_ptr="*bf16", stride_kpe_t=I32, v_ptr="*bf16", stride_v_t=I32, stride_v_h=I32, o_ptr="*bf16",
           stride_o_t=I32, stride_o_h=I32, cu_q_ptr="*i32", cu_k_ptr="*i32", qk_scale="fp32", P=C, R=C, V=C,
           BLOCK_M=C, BLOCK_N=C, DOT_PRECISION=C)
# the launchers' GPU defaults at H=32, L=512, R=64, P=V=128
print(json.dumps({
    "decode": build(d._mla_decode_split_kernel, dec, dict(L=512, R=64, BLOCK_H=32, BLOCK_N=32, WRITE_OUT=False,
                                                          DOT_PRECISION="tf32", USE_PDL=True), 8, 2),
    "prefill": build(p._mla_prefill_kernel, pre, dict(P=128, R=64, V=128, BLOCK_M=128, BLOCK_N=64,
                                                      DOT_PRECISION="tf32"), 8, 3),
}))
'''


def test_sm90_build_has_no_spills_and_pipelines_loads() -> None:
    res = run_sm90_build(_BUILD, timeout=240)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)  # register spills go to the stack
        assert r["async_copies"] > 0, (name, r)  # the tile loads are software-pipelined
        assert r["shared"] <= 227 * 1024, (name, r)
    assert res["prefill"]["wgmma"] > 0, res["prefill"]
