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


_ROUNDS = r'''
from k3rt.kernels.spec import triton_rounds as Rk
from k3rt.kernels.moe import triton_act as A

I32, C, L = "i32", "constexpr", "*i64"
accept = dict(am_ptr=L, fed_ptr=L, nd_ptr=L, stops_ptr=L, budget_ptr=L, live_ptr="*i1", anchor_ptr=L, kept_ptr=L,
              P=I32, R=C, BLOCK_R=C, BLOCK_P=C)
shift = dict(ctx_ptr="*bf16", taps_ptr="*bf16", tok_ptr=L, valid_ptr="*i1", fed_ptr=L, kept_ptr=L, anchor_ptr=L,
             F=I32, W=C, R=C, HAS_TOKENS=C, BLOCK_W=C, BLOCK_F=C)
advance = dict(ids_ptr=L, pos_ptr=L, slot_ptr=L, lens_ptr="*i32", table_ptr="*i32", stride_table=I32, kept_ptr=L,
               anchor_ptr=L, drafts_ptr=L, stride_drafts=I32, real_ptr="*i1", limit_ptr=L, nd_ptr=L, block_size=I32,
               R=C, BLOCK_R=C)
act = dict(x_ptr="*bf16", stride_x=I32, o_ptr="*bf16", stride_o=I32, I=I32, beta="fp32", lin_beta="fp32", SITU=C,
           LIN_SAT=C, BLOCK=C)
res = {
    "accept": sm90_build(Rk._round_accept_kernel, accept, dict(R=8, BLOCK_R=8, BLOCK_P=16), 1, 1, lambda k: False),
    # k3-tiny's drafter window: 128 rows of 3 x 384 features, the launcher's BLOCK_F for it
    "shift": sm90_build(Rk._round_shift_kernel, shift, dict(W=128, R=8, HAS_TOKENS=True, BLOCK_W=128, BLOCK_F=64), 4,
                        1, lambda k: k == "F"),
    "advance": sm90_build(Rk._round_advance_kernel, advance, dict(R=8, BLOCK_R=8), 1, 1, lambda k: False),
    "act": sm90_build(A._act_and_mul_kernel, act, dict(SITU=True, LIN_SAT=True, BLOCK=1024), 4, 1,
                      lambda k: k in ("I", "stride_x", "stride_o")),
}
print(json.dumps(res))
'''


def test_round_and_activation_kernels_build_for_sm90_without_spills() -> None:
    """A device round's three bookkeeping kernels (triton_rounds.py) at k3-tiny's drafter window and the dense MLP's
    gated activation (kernels/moe/triton_act.py) at its launcher's tile: they build for sm_90 and keep their tiles in
    registers (the window shift holds a [128, 64] tile of the old rows and one of the taps between its barrier's
    two sides)."""
    res = run_sm90_build(_ROUNDS, timeout=300)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)
