"""The MoE kernels build for sm_90 (H100/H200) at the 48B shape without a GPU (Triton's frontend,
ptxas and cuobjdump ship in the triton wheel): router (and k3-tiny's with its logits in the launch), alignment
(one chunk and many), the default decode and prefill tiles of both grouped GEMMs with PDL on, and the k-sum (and
its norm epilogue). No build may spill
registers; the GEMMs must pipeline their loads (cp.async) and the prefill tiles must use wgmma.

The build runs in a subprocess (tests/kernels/helpers.py: run_sm90_build) because TRITON_INTERPRET
(set by conftest.py without a GPU) changes what @triton.jit returns.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import run_sm90_build  # noqa: E402

_BUILD = r'''
from k3rt.kernels.moe import triton_align as A, triton_experts as X, triton_one_token as O, triton_router as R

def build(fn, sig, consts, num_warps, num_stages=3):
    # the runtime marks pointers and sizes divisible by 16 as such; the 48B shapes all are
    return sm90_build(fn, sig, consts, num_warps, num_stages, lambda k: k in ("D", "I", "stride_xt"))

I32, C = "i32", "constexpr"
route = dict(logits_ptr="*fp32", stride_lt=I32, bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32", scaling="fp32",
             E=C, BLOCK_E=C, K=C, BLOCK_K=C, GROUPS=C, BLOCK_G=C, BLOCK_PER=C, TOPK_GROUP=C, RENORMALIZE=C, USE_PDL=C)
route_x = dict(x_ptr="*bf16", stride_x=I32, gate_ptr="*fp32", D=I32, bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32",
               scaling="fp32", E=C, BLOCK_E=C, K=C, BLOCK_K=C, RENORMALIZE=C, USE_PDL=C, BLOCK_D=C)
count = dict(ids_ptr="*i32", counts_ptr="*i32", P=I32, E_P=C, BP=C, USE_PDL=C)
offsets = dict(ids_ptr="*i32", counts_ptr="*i32", start_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32",
               big_ptr="*i32", small_ptr="*i32", P=I32, NC=I32, NB=I32, NBIG=I32, NSMALL=I32, E_P=C, BLOCK_M=C, BP=C,
               SUB=C, TILE_C=C, BLOCK_B=C, SINGLE_CHUNK=C, USE_PDL=C, GROUP=C)
scatter = dict(ids_ptr="*i32", counts_ptr="*i32", sorted_ptr="*i32", P=I32, E_P=C, BP=C, SUB=C, USE_PDL=C)
place = dict(ids_ptr="*i32", counts_ptr="*i32", base_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32",
             big_ptr="*i32", small_ptr="*i32", P=I32, NC=I32, NB=I32, NBIG=I32, NSMALL=I32, E_P=C, BLOCK_M=C, BP=C,
             SUB=C, TILE_C=C, BLOCK_B=C, USE_PDL=C, GROUP=C)
split = dict(ids_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32", big_ptr="*i32", small_ptr="*i32", P=I32,
             NB=I32, NBIG=I32, NSMALL=I32, E_P=C, BLOCK_M=C, BP=C, SP=C, G=C, BLOCK_B=C, USE_PDL=C, GROUP=C)
gate_up = dict(x_ptr="*bf16", stride_xt=I32, w13_ptr="*bf16", h_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
               table_ptr="*i32", P=I32, D=I32, I=I32, beta="fp32", lin_beta="fp32", T=I32, NB_ROUTED=I32,
               NB_SHARED=I32, E_ROUTED=I32, H_SHARED=I32, TOPK=C, BLOCK_M=C, SUB_M=C, GROUPED=C, BLOCK_N=C,
               BLOCK_K=C, EVEN_K=C, SITU=C, LIN_SAT=C, DOT_PRECISION=C, USE_PDL=C)
down = dict(h_ptr="*bf16", w2_ptr="*bf16", y_ptr="*bf16", topk_w_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32",
            table_ptr="*i32", P=I32, D=I32, I=I32, T=I32, NB_ROUTED=I32, NB_SHARED=I32, E_ROUTED=I32, H_SHARED=I32,
            TOPK=C, BLOCK_M=C, SUB_M=C, GROUPED=C, BLOCK_N=C, BLOCK_K=C, EVEN_K=C, DOT_PRECISION=C, USE_PDL=C)
ksum = dict(y_ptr="*bf16", out_ptr="*bf16", stride_ot=I32, D=I32, T=I32, P=I32, norm_w_ptr="*bf16", eps="fp32",
            r_ptr="*bf16", stride_r=I32, h_ptr="*bf16", TOPK=C, SHARED=C, BLOCK_D=C, USE_PDL=C, NORM=C, RESIDUAL=C)
res = {
    "route": build(R._moe_route_kernel, route, dict(E=256, BLOCK_E=256, K=8, BLOCK_K=8, GROUPS=8, BLOCK_G=8,
                                                    BLOCK_PER=32, TOPK_GROUP=4, RENORMALIZE=True, USE_PDL=True), 4),
    # k3-tiny's router with its logits in the launch (moe_route_from_x): bf16 x, the fp32 8 x 384 weight, one warp
    "route_from_x": build(R._moe_route_from_x_kernel, route_x, dict(E=8, BLOCK_E=8, K=2, BLOCK_K=2, RENORMALIZE=True,
                                                                    USE_PDL=True, BLOCK_D=128), 1),
    "align_single": build(A._moe_align_offsets_kernel, offsets, dict(E_P=256, BLOCK_M=16, BP=A.CHUNK, SUB=A._SUB, TILE_C=16,
                          BLOCK_B=32, SINGLE_CHUNK=True, USE_PDL=True, GROUP=1), 8),
    "align_count": build(A._moe_align_count_kernel, count, dict(E_P=256, BP=A.CHUNK, USE_PDL=True), 4),
    "align_offsets": build(A._moe_align_offsets_kernel, offsets, dict(E_P=256, BLOCK_M=64, BP=A.CHUNK, SUB=A._SUB,
                           TILE_C=16, BLOCK_B=32, SINGLE_CHUNK=False, USE_PDL=True, GROUP=1), 8),
    "align_place": build(A._moe_align_place_kernel, place, dict(E_P=256, BLOCK_M=64, BP=A.CHUNK, SUB=A._SUB,
                         TILE_C=32, BLOCK_B=32, USE_PDL=True, GROUP=1), 8),
    # the grouped tiles' tables (PREFILL_TILES_128_GROUPED: runs padded to 64 rows, tiles of two blocks)
    "align_place_grouped": build(A._moe_align_place_kernel, place, dict(E_P=256, BLOCK_M=64, BP=A.CHUNK, SUB=A._SUB,
                                 TILE_C=32, BLOCK_B=32, USE_PDL=True, GROUP=2), 8),
    "align_scatter": build(A._moe_align_scatter_kernel, scatter, dict(E_P=256, BP=A.CHUNK, SUB=A._SUB, USE_PDL=True), 8),
    # the launcher's split form at the 48B decode of batch 64 (512 pairs over 256 experts: 16 programs)
    "align_split": build(A._moe_align_split_kernel, split, dict(E_P=256, BLOCK_M=16, BP=A.CHUNK, SP=A.SPLIT_PAIRS,
                         G=A.CHUNK // A.SPLIT_PAIRS, BLOCK_B=32, USE_PDL=True, GROUP=1), 4),
    "sum": build(X._moe_sum_kernel, ksum, dict(TOPK=8, SHARED=1, BLOCK_D=1024, USE_PDL=True, NORM=False,
                                               RESIDUAL=False), 4),
    # LatentMoE's sum with routed_expert_norm (a 1024-wide latent)
    "sum_norm": build(X._moe_sum_kernel, ksum, dict(TOPK=8, SHARED=0, BLOCK_D=1024, USE_PDL=True, NORM=True,
                                                    RESIDUAL=False), 4),
    # the 48B's sum with the residual add and the next norm (D 2,304 in one program: the widest it takes)
    "sum_add_norm": build(X._moe_sum_kernel, ksum, dict(TOPK=8, SHARED=1, BLOCK_D=X.NORM_MAX_D, USE_PDL=True,
                                                        NORM=True, RESIDUAL=True), 4),
}
G128 = X.PREFILL_TILES_128_GROUPED
for name, t, sub in (("decode", X.DECODE_TILES, None), ("prefill64", X.PREFILL_TILES_64, None),
                     ("prefill128", X.PREFILL_TILES_128, None), ("prefill128_grouped", G128, G128.tail.block_m)):
    rows = dict(SUB_M=sub or t.block_m, GROUPED=sub is not None)
    res[name + "_gate_up"] = build(X._moe_gate_up_kernel, gate_up, dict(
        TOPK=8, BLOCK_M=t.block_m, BLOCK_N=t.block_n1, BLOCK_K=t.block_k1, EVEN_K=True, SITU=True, LIN_SAT=True,
        DOT_PRECISION="tf32", USE_PDL=True, **rows), t.num_warps1, t.num_stages)
    res[name + "_down"] = build(X._moe_down_kernel, down, dict(
        TOPK=8, BLOCK_M=t.block_m, BLOCK_N=t.block_n2, BLOCK_K=t.block_k2, EVEN_K=True, DOT_PRECISION="tf32",
        USE_PDL=True, **rows),
        t.num_warps2, t.num_stages)
one = dict(x_ptr="*bf16", w13_ptr="*bf16", w2_ptr="*bf16", ids_ptr="*i32", part_ptr="*fp32", D=I32, I=I32,
           beta="fp32", lin_beta="fp32", E_ROUTED=I32, TOPK=C, BLOCK_N=C, BLOCK_K=C, BLOCK_D=C, EVEN_K=C, SITU=C,
           LIN_SAT=C, DOT_PRECISION=C, USE_PDL=C)
res["one_token_gate_up"] = build(O._moe_one_token_kernel, one, dict(
    TOPK=8, BLOCK_N=O.BLOCK_N, BLOCK_K=O.BLOCK_K, BLOCK_D=O.BLOCK_D, EVEN_K=True, SITU=True, LIN_SAT=True,
    DOT_PRECISION="tf32", USE_PDL=True), 4, 4)
red = dict(part_ptr="*fp32", topk_w_ptr="*fp32", out_ptr="*bf16", D=I32, NT=I32, SLOTS=C, TOPK=C, BLOCK_T=C,
           BLOCK_D=C, USE_PDL=C)
res["one_token_reduce"] = build(O._moe_one_token_reduce_kernel, red, dict(SLOTS=9, TOPK=8, BLOCK_T=32,
                                BLOCK_D=O.REDUCE_D, USE_PDL=True), 4, 1)
print(json.dumps(res))
'''


def test_sm90_build_has_no_spills_and_pipelines_gemm_loads() -> None:
    res = run_sm90_build(_BUILD, timeout=300)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)  # register spills go to the stack
        assert r["shared"] <= 227 * 1024, (name, r)
        if name.endswith(("_gate_up", "_down")):
            assert r["async_copies"] > 0, (name, r)  # the tile loads are software-pipelined
        if name.startswith("prefill"):
            assert r["wgmma"] > 0, (name, r)
