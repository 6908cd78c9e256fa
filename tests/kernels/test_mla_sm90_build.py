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


_PAGED = r'''
from dataclasses import replace
from k3rt.kernels.mla import triton_decode as d, triton_decode_paged as p

I32, C = "i32", "constexpr"
sig = dict(q_ptr="*bf16", stride_q_n=I32, stride_q_h=I32, kv_ptr="*bf16", block_table_ptr="*i32", stride_bt_n=I32,
           seq_lens_ptr="*i32", part_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32", H=I32, block_size=I32,
           num_splits=I32, L=C, R=C, BLOCK_H=C, BLOCK_N=C, DOT_PRECISION=C, USE_PDL=C, HEADS_ON_M=C)
# the default launch at the 48B shape (32 heads, 512 + 64), with the test's overrides
cfg = replace(d.mla_decode_config(64, 32, 32768, 132), **OVERRIDES)
consts = dict(L=512, R=64, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DOT_PRECISION="tf32", USE_PDL=True,
              HEADS_ON_M=cfg.layout == "heads")
# block_size too is divisible by 16 at the 48B shape's 1888-token pages, and the runtime marks it so
divisible = lambda k: k.startswith("stride") or k == "block_size"
k = triton.compile(ASTSource(p._mla_decode_paged_kernel, sig, constexprs=consts,
                             attrs={(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
                                    if v.startswith("*") or divisible(n)}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
loop = k.asm["ttgir"].split("scf.for", 1)[1]
waits = [int(n) for n in re.findall(r"ttg.async_wait[^{]*\{num = (\d+)", loop.split("scf.yield", 1)[0])]
res = sm90_build(p._mla_decode_paged_kernel, sig, consts, cfg.num_warps, cfg.num_stages, divisible)
res["loop_waits"] = waits
print(json.dumps(res))
'''


def test_paged_decode_keeps_copies_in_flight_and_fits_two_programs_per_sm() -> None:
    """The default decode launch (the paged kernel) at the 48B shape: inside the tile loop the first wait
    on the KV copies leaves later copies pending (num > 0), i.e. the next tile streams in during this
    one's math. The gathered-row kernels wait for everything (num = 0) at the top of each iteration,
    which held them at 45 % of copy bandwidth. Shared memory and 4 warps leave room for two programs
    per SM (228 KB, less 1 KB per program), which the measured speed relies on."""
    r = run_sm90_build("OVERRIDES = {}" + _PAGED, timeout=240)
    assert r["async_copies"] > 0 and r["loop_waits"] and r["loop_waits"][0] > 0, r
    assert r["shared"] <= 113 * 1024, r
    # ptxas keeps 8 bytes on the stack at 254 registers (the launch measured on the H200 had them)
    assert r["stack"] <= 8 and r["local"] == 0, r
    assert r["wgmma"] == 0, r  # 32 heads on M: mma.sync


def test_paged_decode_wgmma_launch_pads_heads_to_64() -> None:
    """The benchmark's "wgmma h64" launch (FlashMLA's layout at 32 heads): a 64-row head block (half of it
    zero rows) lowers both dots to wgmma at 8 warps, keeps the next copies in flight, fits one program per
    SM with q in shared memory, and does not spill."""
    r = run_sm90_build("OVERRIDES = dict(block_h=64, num_warps=8, num_stages=3)" + _PAGED, timeout=240)
    assert r["wgmma"] > 0, r
    assert r["async_copies"] > 0 and r["loop_waits"] and r["loop_waits"][0] > 0, r
    assert r["shared"] <= 227 * 1024, r
    assert r["stack"] == 0 and r["local"] == 0, r


_TMA = r'''
from k3rt.kernels.mla import triton_decode_tma as t

I32, C = "i32", "constexpr"
sig = dict(q_ptr="*bf16", stride_q_n=I32, stride_q_h=I32, kv_ptr="*bf16", c_desc="tensordesc<bf16[32,512]>",
           pe_desc="tensordesc<bf16[32,64]>", block_table_ptr="*i32", stride_bt_n=I32, seq_lens_ptr="*i32",
           part_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32", H=I32, block_size=I32, num_splits=I32, L=C, R=C,
           BLOCK_H=C, BLOCK_N=C, DOT_PRECISION=C, USE_PDL=C, HEADS_ON_M=C)
consts = dict(L=512, R=64, BLOCK_H=64, BLOCK_N=32, DOT_PRECISION="tf32", USE_PDL=True, HEADS_ON_M=True)
divisible = lambda k: k.startswith("stride") or k == "block_size"
res = sm90_build(t._mla_decode_tma_kernel, sig, consts, 8, 3, divisible)
k = triton.compile(ASTSource(t._mla_decode_tma_kernel, sig, constexprs=consts,
                             attrs={(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
                                    if v.startswith("*") or divisible(n)}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
loop = k.asm["ttgir"].split("scf.for", 1)[1].split("scf.yield", 1)[0]
res["loop_tma"] = loop.count("async_tma_copy_global_to_local")
print(json.dumps(res))
'''


def test_tma_decode_copies_tiles_in_the_loop_with_wgmma() -> None:
    """The TMA launch the benchmark times (64-row head block, 32-token tiles, 8 warps, 3 stages) at the 48B
    shape: the tile loop issues TMA copies (c and k_pe boxes), both dots lower to wgmma, no spills, and the
    shared memory fits one program per SM."""
    r = run_sm90_build(_TMA, timeout=240)
    assert r["loop_tma"] == 2, r
    assert r["wgmma"] > 0, r
    assert r["stack"] == 0 and r["local"] == 0, r
    assert r["shared"] <= 227 * 1024, r
