"""The MLA kernels build for sm_90 (H100/H200) at the 48B shape without a GPU: Triton's frontend,
ptxas and cuobjdump ship in the triton wheel. The build must not spill registers and must pipeline
its loads (cp.async), and the prefill's dots must lower to wgmma: the cheap checks of what makes
these kernels fast, runnable on CPU-only CI.

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
from k3rt.kernels.mla import triton_decode as d, triton_prefill as p

def build(fn, sig, consts, num_warps, num_stages):
    # the runtime marks pointers and strides divisible by 16 as such; the 48B shapes all are
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
             if v.startswith("*") or k.startswith("stride")}
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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)  # register spills go to the stack
        assert r["async_copies"] > 0, (name, r)  # the tile loads are software-pipelined
        assert r["shared"] <= 227 * 1024, (name, r)
    assert res["prefill"]["wgmma"] > 0, res["prefill"]
