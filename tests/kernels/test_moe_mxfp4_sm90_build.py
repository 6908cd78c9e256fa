"""The planar MXFP4 expert GEMMs (kernels/moe/triton_mxfp4_planar.py) build for sm_90 (H100/H200) at Kimi-K3's
expert shape without a GPU, and their K loops stay cheap: what makes them faster than `triton_mxfp4` is the
instruction count per weight element (the 2026-12-01 kernel was ALU-bound), which the SASS shows on CPU.

For each variant's default tiles, gate/up and down: no register spills; the MMA variants lower to wgmma
with pipelined (cp.async) loads; the innermost loop that does the math (the smallest loop holding the
kernel's HGMMA/HMMA, or FFMA for "fma") issues at most a bound of SASS instructions per weight element
(measured with triton 3.6: 3.9-4.3 for the MMA variants, 5.9-6.8 for "fma"; the bounds leave ~10%).

The build runs in a subprocess (tests/kernels/helpers.py: run_sm90_build) because TRITON_INTERPRET
(set by conftest.py without a GPU) changes what @triton.jit returns.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import run_sm90_build  # noqa: E402

_BUILD = r'''
from k3rt.kernels.moe import triton_mxfp4_planar as m

SASS_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def math_loop(fn, sig, consts, num_warps, num_stages, divisible, op):
    """The SASS opcodes of the smallest loop (a backward branch's span) that holds an `op` instruction."""
    sass = cuobjdump(sm90_kernel(fn, sig, consts, num_warps, num_stages, divisible), "-sass")
    ins = [(int(a, 16), o, line) for line in sass.splitlines() for a, _, o in SASS_INSTR.findall(line)[:1]]
    spans = []
    for addr, o, line in ins:
        tgt = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if o.startswith("BRA") and tgt and int(tgt.group(1), 16) <= addr:  # a backward branch: a loop
            body = [b for a, b, _ in ins if int(tgt.group(1), 16) <= a <= addr]
            if any(b.startswith(op) for b in body):
                spans.append(body)
    return min(spans, key=len)


I32, C = "i32", "constexpr"
gu = dict(x_ptr="*bf16", stride_xt=I32, w_ptr="*i32", stride_w=I32, s_ptr="*u8", stride_s=I32, h_ptr="*bf16",
          sorted_ptr="*i32", block_expert_ptr="*i32", P=I32, D=I32, I=I32, beta="fp32", lin_beta="fp32", T=I32,
          NB_ROUTED=I32, NB_SHARED=I32, E_ROUTED=I32, TOPK=C, BLOCK_M=C, SUB_M=C, BLOCK_N=C, CHUNKS=C, FMA=C,
          WSCALE=C, FUSED=C, SITU=C, LIN_SAT=C, DOT_PRECISION=C)
down = dict(h_ptr="*bf16", w_ptr="*i32", stride_w=I32, s_ptr="*u8", stride_s=I32, y_ptr="*bf16",
            topk_w_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32", P=I32, D=I32, I=I32, T=I32,
            NB_ROUTED=I32, NB_SHARED=I32, E_ROUTED=I32, TOPK=C, BLOCK_M=C, SUB_M=C, BLOCK_N=C, CHUNKS=C, FMA=C,
            WSCALE=C, FUSED=C, DOT_PRECISION=C)
# K3's expert shape: D = 3584, I = 3072, top-16; strides, D and I are multiples of 16 there
divisible = lambda k: k.startswith("stride") or k in ("D", "I")
res = {}
for variant in m.PLANAR_VARIANTS:
    t = m.PLANAR_CANDIDATES[variant][0]
    common = dict(TOPK=16, BLOCK_M=t.block_m, SUB_M=t.sub_m, CHUNKS=t.chunks, FMA=variant == "fma",
                  WSCALE=variant == "mma_ws", FUSED=variant == "fma", DOT_PRECISION="tf32")  # real weights' scales
    op = "FFMA" if variant == "fma" else "HGMMA" if t.block_n1 >= 64 else "HMMA"
    for name, fn, sig, consts, bn, warps, mats in (
            ("gate_up", m._moe_gate_up_planar_kernel, gu, dict(common, BLOCK_N=t.block_n1, SITU=True, LIN_SAT=True),
             t.block_n1, t.num_warps1, 2),
            ("down", m._moe_down_planar_kernel, down, dict(common, BLOCK_N=t.block_n2), t.block_n2, t.num_warps2, 1)):
        r = sm90_build(fn, sig, consts, warps, t.num_stages, divisible)
        body = math_loop(fn, sig, consts, warps, t.num_stages, divisible, op)
        # SASS instructions per weight element a thread handles in one loop step
        r["per_element"] = len(body) / (mats * bn * 256 * t.chunks / (32 * warps))
        r["loop_spills"] = sum(b.startswith(("STL", "LDL")) for b in body)
        r["block_n"] = bn
        res[f"{variant} {name}"] = r
print(json.dumps(res))
'''

# SASS instructions per weight element in the math loop, the bound each variant's default tiles must keep
_BOUND = {"mma": 4.7, "mma_ws": 4.7, "fma": 7.5}


def test_sm90_build_planar_mxfp4_math_loops() -> None:
    res = run_sm90_build(_BUILD, timeout=300)
    assert len(res) == 2 * len(_BOUND), res
    for name, r in res.items():
        variant = name.split()[0]
        # no register spills in the math loop; "mma down" at its 2-warp default keeps two registers (8 bytes
        # of stack) across its per-block loop, stored and reloaded once per block, not per weight chunk
        assert r["loop_spills"] == 0 and r["local"] == 0 and r["stack"] <= 8, (name, r)
        if variant == "mma_ws":  # the served one (PLANAR_SERVE_VARIANT): none at all
            assert r["stack"] == 0, (name, r)
        assert r["per_element"] <= _BOUND[variant], (name, r)
        if variant != "fma":
            assert r["async_copies"] > 0, (name, r)
            # wgmma needs a warpgroup's 64 rows: the measured-best 32-row tiles (2 warps) run mma.sync instead
            assert (r["wgmma"] > 0) == (r["block_n"] >= 64), (name, r)
