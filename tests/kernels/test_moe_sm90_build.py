"""The MoE kernels build for sm_90 (H100/H200) at the 48B shape without a GPU (Triton's frontend,
ptxas and cuobjdump ship in the triton wheel): router, alignment (one chunk and many), the default
decode and prefill tiles of both grouped GEMMs with PDL on, and the k-sum. No build may spill
registers; the GEMMs must pipeline their loads (cp.async) and the prefill tiles must use wgmma.

The build runs in a subprocess because TRITON_INTERPRET (set by the interpreter tests) changes
what @triton.jit returns.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_BUILD = r'''
import json, os, re, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3rt.kernels.moe import triton_align as A, triton_experts as X, triton_router as R

def build(fn, sig, consts, num_warps, num_stages=3):
    # the runtime marks pointers and sizes divisible by 16 as such; the 48B shapes all are
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
             if v.startswith("*") or k in ("D", "I", "stride_xt")}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ttgir = k.asm["ttgir"]
    return {"stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "local": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "async_copies": ttgir.count("async_copy_global_to_local"), "wgmma": ttgir.count("warp_group_dot"),
            "shared": k.metadata.shared}

I32, C = "i32", "constexpr"
route = dict(logits_ptr="*fp32", stride_lt=I32, bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32", scaling="fp32",
             E=C, BLOCK_E=C, K=C, BLOCK_K=C, GROUPS=C, BLOCK_G=C, BLOCK_PER=C, TOPK_GROUP=C, RENORMALIZE=C, USE_PDL=C)
count = dict(ids_ptr="*i32", counts_ptr="*i32", P=I32, E_P=C, BP=C, USE_PDL=C)
offsets = dict(ids_ptr="*i32", counts_ptr="*i32", start_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32",
               P=I32, NC=I32, NB=I32, E_P=C, BLOCK_M=C, BP=C, SUB=C, TILE_C=C, BLOCK_B=C, SINGLE_CHUNK=C, USE_PDL=C)
scatter = dict(ids_ptr="*i32", counts_ptr="*i32", sorted_ptr="*i32", P=I32, E_P=C, BP=C, SUB=C, USE_PDL=C)
gate_up = dict(x_ptr="*bf16", stride_xt=I32, w13_ptr="*bf16", h_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
               P=I32, D=I32, I=I32, beta="fp32", lin_beta="fp32", TOPK=C, BLOCK_M=C, BLOCK_N=C, BLOCK_K=C, EVEN_K=C,
               SITU=C, LIN_SAT=C, DOT_PRECISION=C, USE_PDL=C)
down = dict(h_ptr="*bf16", w2_ptr="*bf16", y_ptr="*bf16", topk_w_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32",
            P=I32, D=I32, I=I32, BLOCK_M=C, BLOCK_N=C, BLOCK_K=C, EVEN_K=C, DOT_PRECISION=C, USE_PDL=C)
ksum = dict(y_ptr="*bf16", out_ptr="*bf16", stride_ot=I32, D=I32, TOPK=C, BLOCK_D=C, USE_PDL=C)
res = {
    "route": build(R._moe_route_kernel, route, dict(E=256, BLOCK_E=256, K=8, BLOCK_K=8, GROUPS=8, BLOCK_G=8,
                                                    BLOCK_PER=32, TOPK_GROUP=4, RENORMALIZE=True, USE_PDL=True), 4),
    "align_single": build(A._moe_align_offsets_kernel, offsets, dict(E_P=256, BLOCK_M=16, BP=A.CHUNK, SUB=A._SUB, TILE_C=16,
                          BLOCK_B=32, SINGLE_CHUNK=True, USE_PDL=True), 8),
    "align_count": build(A._moe_align_count_kernel, count, dict(E_P=256, BP=A.CHUNK, USE_PDL=True), 4),
    "align_offsets": build(A._moe_align_offsets_kernel, offsets, dict(E_P=256, BLOCK_M=64, BP=A.CHUNK, SUB=A._SUB,
                           TILE_C=16, BLOCK_B=32, SINGLE_CHUNK=False, USE_PDL=True), 8),
    "align_scatter": build(A._moe_align_scatter_kernel, scatter, dict(E_P=256, BP=A.CHUNK, SUB=A._SUB, USE_PDL=True), 8),
    "sum": build(X._moe_sum_kernel, ksum, dict(TOPK=8, BLOCK_D=1024, USE_PDL=True), 4),
}
for name, t in (("decode", X.DECODE_TILES), ("prefill64", X.PREFILL_TILES_64), ("prefill128", X.PREFILL_TILES_128)):
    res[name + "_gate_up"] = build(X._moe_gate_up_kernel, gate_up, dict(
        TOPK=8, BLOCK_M=t.block_m, BLOCK_N=t.block_n1, BLOCK_K=t.block_k1, EVEN_K=True, SITU=True, LIN_SAT=True,
        DOT_PRECISION="tf32", USE_PDL=True), t.num_warps1, t.num_stages)
    res[name + "_down"] = build(X._moe_down_kernel, down, dict(
        BLOCK_M=t.block_m, BLOCK_N=t.block_n2, BLOCK_K=t.block_k2, EVEN_K=True, DOT_PRECISION="tf32", USE_PDL=True),
        t.num_warps2, t.num_stages)
print(json.dumps(res))
'''


def test_sm90_build_has_no_spills_and_pipelines_gemm_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)  # register spills go to the stack
        assert r["shared"] <= 227 * 1024, (name, r)
        if name.endswith(("_gate_up", "_down")):
            assert r["async_copies"] > 0, (name, r)  # the tile loads are software-pipelined
        if name.startswith("prefill"):
            assert r["wgmma"] > 0, (name, r)
