"""The fused drafter-steps kernel (kernels/spec/triton_draft.py) builds for sm_90 (H100/H200) without a GPU, at
k3-tiny's drafter shape in the launcher's default tiles (bf16 tables, vocabulary 8192, rank 32: BLOCK_V 1024,
16 warps) and the two others benchmarks/dspark_pass.py times, with and without the copy head, and keeps its
[BLOCK_V, R] Markov tile in registers (no spill; before the per-lane running values, BLOCK_V 512 at 8 warps
spilled 32 bytes with the copy head). The interpreter runs the math on
the CPU but never compiles it; the build runs in a subprocess (tests/kernels/helpers.py: run_sm90_build).
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import run_sm90_build  # noqa: E402

_BUILD = r'''
from k3rt.kernels.spec import triton_draft as D

I32, C, T = "i32", "constexpr", "*bf16"
sig = dict(base_ptr="*fp32", anchor_ptr="*i64", pre_ptr=T, copy_ptr="*fp32", gate_ptr="*fp32", scr_ptr="*fp32",
           min_ptr=T, mout_ptr=T, cprev_ptr=T, stride_cprev=I32, ctop_ptr=T, stride_ctop=I32, cout_ptr=T, cout_b_ptr=T,
           tok_ptr="*i64", conf_ptr="*fp32", K=I32, V=I32, R=I32, C=I32, BLOCK_V=C, BLOCK_R=C, BLOCK_C=C,
           HAS_MARKOV=C, HAS_COPY=C)
res = {"tiles": list(D.tiles(8192, 32))}
for block_v, warps in (D.tiles(8192, 32), (256, 8), (512, 16)):
    for copy in (True, False):
        consts = dict(BLOCK_V=block_v, BLOCK_R=32, BLOCK_C=64, HAS_MARKOV=True, HAS_COPY=copy)
        res[f"{block_v}x{warps} copy={copy}"] = sm90_build(D._greedy_draft_fwd_kernel, sig, consts, warps, 1,
                                                          lambda k: k in ("V", "R"))
print(json.dumps(res))
'''


def test_greedy_draft_kernel_builds_for_sm90_without_spills() -> None:
    res = run_sm90_build(_BUILD, timeout=300)
    assert res.pop("tiles") == [1024, 16]
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)  # register spills go to the stack
