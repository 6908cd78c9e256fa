"""The do_not_specialize lists (kernels/common.py, "Compiles") cost no vector access: hot kernels built for sm_90
at the 48B shape with the attributes the runtime now gives them (the per-step ints and the packed step's index
pointers without the divisible-by-16 mark) have as many vectorized global loads and stores, and async copies,
as the same kernels with every pointer and every int argument marked divisible (at best what a step could get
before). Without a GPU: Triton's frontend and ptxas ship in the wheel (tests/kernels/helpers.py).
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.kernels.helpers import run_sm90_build  # noqa: E402

_BUILD = r'''
from dataclasses import replace
from k3rt.kernels.kda import triton_chunk as K, triton_decode as KD, triton_prep as P
from k3rt.kernels.mla import triton_decode as d, triton_decode_paged as MP
from k3rt.kernels.norm import triton_norm as N
from k3rt.kernels.short_conv import triton_rows as R

def vector_accesses(fn, sig, consts, num_warps, num_stages, as_launched):
    # as_launched: the kernel's lists leave their arguments unmarked; else every pointer and int is marked
    free = set(fn.do_not_specialize) | set(fn.do_not_specialize_on_alignment)
    marked = lambda n, v: (v.startswith("*") or v.startswith("i")) and not (as_launched and n in free)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items()) if marked(n, v)}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = k.asm["ptx"]
    return {"ld_v": len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]", ptx)),
            "st_v": len(re.findall(r"st\.global(?:\.\w+)*\.v[248]", ptx)),
            "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 16", ptx))}

I32, C, B16 = "i32", "constexpr", "*bf16"
cases = {}
prep = dict(x_ptr=B16, stride_x=I32, cs_ptr=B16, stride_cs_s=I32, stride_cs_w=I32, slot_ptr="*i64", idx_ptr="*i64",
            cw_ptr="*fp32", y_ptr=B16, f_ptr=B16, stride_f=I32, b_ptr=B16, stride_b=I32, a_log_ptr="*fp32",
            dt_ptr="*fp32", g_ptr="*fp32", beta_ptr="*fp32", lower_bound="fp32", T=I32, C=I32, num_old=I32,
            conv_blocks=I32, W=C, WP=C, H=C, D=C, BT=C, BC=C, BH=C, USE_LOWER_BOUND=C)
cases["kda_prep"] = (P._kda_chunk_prep_kernel, prep, dict(W=4, WP=4, H=32, D=128, BT=P._BT, BC=P._BC, BH=32,
                                                          USE_LOWER_BOUND=False), 4, 1)
store = dict(x_ptr=B16, stride_x=I32, cs_ptr=B16, stride_cs_s=I32, stride_cs_w=I32, slot_ptr="*i64", idx_ptr="*i64",
             dest_ptr="*i64", C=I32, num_old=I32, W1=C, BW=C, BC=C)
cases["conv_store"] = (R._conv_windows_store_kernel, store, dict(W1=3, BW=4, BC=R._BC), 4, 1)
state = dict(o_ptr=B16, stride_ot=I32, stride_oh=I32, cu_ptr="*i32", chunk_off_ptr="*i32", slot_ptr="*i64",
             init_ptr="*i32", snap_ptr="*i32", state_ptr="*fp32", stride_s=I32, qg_ptr=B16, kd_ptr=B16, w_ptr=B16,
             u_ptr=B16, aqk_ptr=B16, gl_ptr="*fp32", h_ptr=B16, vn_ptr=B16, H=C, K=C, V=C, BK=C, BV=C, BVF=C, C=C,
             DOT16=C, PREC=C, SPLIT_O=C)
cases["kda_state"] = (K._kda_chunk_state_kernel, state, dict(H=32, K=128, V=128, BK=128, BV=32, BVF=128, C=K.CHUNK,
                                                             DOT16=True, PREC="tf32", SPLIT_O=False), 4, 3)
dec = dict(qkv_ptr=B16, stride_qkv_n=I32, conv_w_ptr="*fp32", conv_state_ptr=B16, stride_cs_slot=I32, f_ptr=B16,
           stride_f_n=I32, a_log_ptr="*fp32", dt_bias_ptr="*fp32", b_ptr=B16, stride_b_n=I32, state_ptr="*fp32",
           stride_state_slot=I32, slot_ptr="*i64", o_ptr=B16, gate_ptr=B16, stride_gate_n=I32, stride_gate_h=I32,
           norm_w_ptr=B16, raw_ptr="*fp32", count_ptr="*i32", scale="fp32", lower_bound="fp32", eps="fp32",
           H=C, D=C, BK=C, BV=C, BVS=C, NV=C, W=C, WP=C, USE_LOWER_BOUND=C, NORM=C, USE_PDL=C, PREFETCH=C,
           PROBE=C, HOIST=C, EARLY=C, PIN=C, SPLIT_NORM=C)
cases["kda_decode"] = (KD._kda_decode_kernel, dec, dict(H=32, D=128, BK=128, BV=32, BVS=32, NV=4, W=4, WP=4,
                                                        USE_LOWER_BOUND=False, NORM=True, USE_PDL=False,
                                                        PREFETCH=True, PROBE=0, HOIST=True, EARLY=False, PIN=True,
                                                        SPLIT_NORM=False), 1, 1)
paged = dict(q_ptr=B16, stride_q_n=I32, stride_q_h=I32, kv_ptr=B16, block_table_ptr="*i32", stride_bt_n=I32,
             seq_lens_ptr="*i32", part_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32", H=I32, block_size=I32,
             num_splits=I32, L=C, R=C, BLOCK_H=C, BLOCK_N=C, DOT_PRECISION=C, USE_PDL=C, HEADS_ON_M=C)
cfg = d.mla_decode_config(64, 32, 32768, 132)
cases["mla_paged"] = (MP._mla_decode_paged_kernel, paged, dict(L=512, R=64, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                                                               DOT_PRECISION="tf32", USE_PDL=False, HEADS_ON_M=True),
                      cfg.num_warps, cfg.num_stages)
norm = dict(x_ptr=B16, stride_x=I32, r_ptr=B16, stride_r=I32, w_ptr=B16, y_ptr=B16, stride_y=I32, h_ptr=B16, N=I32, D=I32,
            eps="fp32", BLOCK_D=C, ROWS=C, HAS_RESIDUAL=C, USE_PDL=C)
cases["rms_norm"] = (N._rms_norm_fwd_kernel, norm, dict(BLOCK_D=4096, ROWS=1, HAS_RESIDUAL=True, USE_PDL=False), 8, 1)
res = {name: {"launched": vector_accesses(*c, True), "all_marked": vector_accesses(*c, False)}
       for name, c in cases.items()}
print(json.dumps(res))
'''


def test_unspecialized_arguments_cost_no_vector_access() -> None:
    res = run_sm90_build(_BUILD, timeout=900)
    assert {n: r for n, r in res.items() if r["launched"] != r["all_marked"]} == {}
    # the counts are live: the bulk loads of these kernels are vectorized at all
    assert res["rms_norm"]["launched"]["ld_v"] > 0 and res["kda_decode"]["launched"]["ld_v"] > 0, res
