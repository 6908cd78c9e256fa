"""The KDA chunked-prefill intra kernel builds for sm_90 (H100/H200) at the Kimi head (H=32, K=V=128)
without a GPU (Triton's frontend and ptxas ship in the triton wheel), in both forms the GPU path
launches: bf16 inputs with 16-bit dots and bf16 scratch, and fp32 inputs with ieee dots. The
interpreter runs the kernel's math on the CPU but never compiles it, so a kernel can pass every CPU
test and still fail to build on the GPU (a run of this session did): this catches that here.

The build runs in a subprocess (tests/kernels/helpers.py: run_sm90_build) because TRITON_INTERPRET
(set by conftest.py without a GPU) changes what @triton.jit returns.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import run_sm90_build  # noqa: E402

_BUILD = r'''
from k3rt.kernels.kda import triton_chunk as K

I32, C = "i32", "constexpr"

def sig(act, scratch):
    return dict(q_ptr=act, k_ptr=act, v_ptr=act, g_ptr="*fp32", beta_ptr="*fp32",
                stride_qt=I32, stride_qh=I32, stride_kt=I32, stride_kh=I32, stride_vt=I32, stride_vh=I32,
                stride_gt=I32, stride_gh=I32, stride_bt=I32, stride_bh=I32,
                cu_ptr="*i32", chunk_seq_ptr="*i32", chunk_idx_ptr="*i32",
                qg_ptr=scratch, kd_ptr=scratch, w_ptr=scratch, u_ptr=scratch, aqk_ptr=scratch, gl_ptr="*fp32",
                gc_ptr="*fp32", akk_ptr="*fp32", scale="fp32",
                H=C, K=C, V=C, BK=C, BKS=C, BV=C, C=C, BC=C, DOT16=C, PREC=C, PREC_INV=C, SAFE_SPAN=C)

def consts(dot16, prec):
    return dict(H=32, K=128, V=128, BK=128, BKS=16, BV=128, C=K.CHUNK, BC=K.SUB, DOT16=dot16, PREC=prec,
                PREC_INV=prec, SAFE_SPAN=K.SAFE_SPAN)

strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_gt", "stride_gh")
res = {
    "bf16": sm90_build(K._kda_chunk_intra_kernel, sig("*bf16", "*bf16"), consts(True, "tf32"), 4, 1,
                       lambda k: k in strides),
    "fp32": sm90_build(K._kda_chunk_intra_kernel, sig("*fp32", "*fp32"), consts(False, "ieee"), 4, 1,
                       lambda k: k in strides),
}
print(json.dumps(res))
'''


def test_chunk_intra_kernel_builds_for_sm90() -> None:
    res = run_sm90_build(_BUILD, timeout=600)
    for name, r in res.items():
        assert r["shared"] <= 227 * 1024, (name, r)
    assert res["bf16"]["wgmma"] > 0, res["bf16"]  # the 16-bit dots reach the tensor cores
