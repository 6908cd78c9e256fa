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
                H=C, K=C, V=C, BK=C, BKS=C, BV=C, C=C, BC=C, DOT16=C, PREC=C, PREC_INV=C, SAFE_SPAN=C,
                PROBE=C)

def consts(dot16, prec):
    return dict(H=32, K=128, V=128, BK=128, BKS=16, BV=128, C=K.CHUNK, BC=K.SUB, DOT16=dot16, PREC=prec,
                PREC_INV=prec, SAFE_SPAN=K.SAFE_SPAN, PROBE=0)

strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_gt", "stride_gh")
res = {
    "bf16": sm90_build(K._kda_chunk_intra_kernel, sig("*bf16", "*bf16"), consts(True, "tf32"), 8, 1,
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


_BUILD_HOST_PATH = r'''
import torch
from k3rt.kernels.kda import triton_chunk as K, triton_prep as P
from k3rt.kernels.short_conv import triton_rows as R

I32, I64, C = "i32", "i64", "constexpr"
B16 = "*bf16"
prep = dict(x_ptr=B16, stride_x=I32, cs_ptr=B16, stride_cs_s=I32, stride_cs_w=I32, slot_ptr="*i64", idx_ptr="*i64",
            cw_ptr="*fp32", y_ptr=B16, f_ptr=B16, stride_f=I32, b_ptr=B16, stride_b=I32, a_log_ptr="*fp32",
            dt_ptr="*fp32", g_ptr="*fp32", beta_ptr="*fp32", lower_bound="fp32", T=I32, C=I32, num_old=I32,
            conv_blocks=I32, W=C, WP=C, H=C, D=C, BT=C, BC=C, BH=C, USE_LOWER_BOUND=C, ONE_SEQ=C)
store = dict(x_ptr=B16, stride_x=I32, cs_ptr=B16, stride_cs_s=I32, stride_cs_w=I32, slot_ptr="*i64", idx_ptr="*i64",
             dest_ptr="*i64", C=I32, num_old=I32, W1=C, BW=C, BC=C)
state = dict(o_ptr=B16, stride_ot=I32, stride_oh=I32, cu_ptr="*i32", chunk_off_ptr="*i32", slot_ptr="*i64",
             init_ptr="*i32", snap_ptr="*i32", state_ptr="*fp32", stride_s=I32, qg_ptr=B16, kd_ptr=B16, w_ptr=B16,
             u_ptr=B16, aqk_ptr=B16, gl_ptr="*fp32", h_ptr=B16, vn_ptr=B16, H=C, K=C, V=C, BK=C, BV=C, BVF=C, C=C,
             DOT16=C, PREC=C, SPLIT_O=C)
strided = lambda k: k.startswith("stride")
res = {
    "prep": sm90_build(P._kda_chunk_prep_kernel, prep, dict(W=4, WP=4, H=32, D=128, BT=P._BT, BC=P._BC, BH=32,
                                                            USE_LOWER_BOUND=False, ONE_SEQ=False), 4, 1, strided),
    "prep_one_seq": sm90_build(P._kda_chunk_prep_kernel, prep, dict(W=4, WP=4, H=32, D=128, BT=P._BT,
                                                                    BC=P._BC_ONE_SEQ, BH=32, USE_LOWER_BOUND=False,
                                                                    ONE_SEQ=True), 4, 1, strided),
    "store": sm90_build(R._conv_windows_store_kernel, store, dict(W1=3, BW=4, BC=R._BC), 4, 1, strided),
    "state": sm90_build(K._kda_chunk_state_kernel, state, dict(H=32, K=128, V=128, BK=128, BV=32, BVF=128, C=K.CHUNK,
                                                               DOT16=True, PREC="tf32", SPLIT_O=False), 4,
                        K.default_state_stages(torch.bfloat16), strided),
}
# the decode kernel at N = 1's defaults (8 programs a head, 16 columns, the fused norm) and N = 16's
from k3rt.kernels.kda import triton_decode as KD
dec = dict(qkv_ptr=B16, stride_qkv_n=I32, conv_w_ptr="*fp32", conv_state_ptr=B16, stride_cs_slot=I32, f_ptr=B16,
           stride_f_n=I32, a_log_ptr="*fp32", dt_bias_ptr="*fp32", b_ptr=B16, stride_b_n=I32, state_ptr="*fp32",
           stride_state_slot=I32, slot_ptr="*i64", o_ptr=B16, gate_ptr=B16, stride_gate_n=I32, stride_gate_h=I32,
           norm_w_ptr=B16, raw_ptr="*fp32", count_ptr="*i32", scale="fp32", lower_bound="fp32", eps="fp32",
           H=C, D=C, BK=C, BV=C, BVS=C, NV=C, W=C, WP=C, USE_LOWER_BOUND=C, NORM=C, USE_PDL=C, PREFETCH=C,
           PROBE=C, HOIST=C, EARLY=C, PIN=C, SPLIT_NORM=C, LATE_WAIT=C)
for name, n, norm, split in (("decode_n1", 1, True, False), ("decode_n1_no_norm", 1, False, False),
                             ("decode_n1_split_norm", 1, False, True), ("decode_n4", 4, True, False),
                             ("decode_n4_no_norm", 4, False, False), ("decode_n16", 16, True, False)):
    nv = KD.default_v_split(n, 32, 128)
    bvs = 128 // nv
    warps = KD.default_num_warps(128, nv)
    hoist, early, pin = KD.load_order(nv > 1, warps, nv, norm, n * 32 * nv, 4)
    res[name] = sm90_build(KD._kda_decode_kernel, dec, dict(
        H=32, D=128, BK=128, BV=min(KD.default_block_v(n, 32, nv), bvs), BVS=bvs, NV=nv, W=4, WP=4,
        USE_LOWER_BOUND=False, NORM=norm, USE_PDL=False, PREFETCH=nv > 1, PROBE=0, HOIST=hoist,
        EARLY=early, PIN=pin, SPLIT_NORM=split, LATE_WAIT=False), warps, 1, strided)
# N = 1 with PDL's late wait: the state tile's 16 vector loads go out before the wait (griddepcontrol.wait: ACQBULK)
for name, norm in (("decode_n1_pdl_late", False), ("decode_n1_norm_pdl_late", True)):
    hoist, early, pin = KD.load_order(True, 1, 8, norm, 256, 4)
    consts = dict(H=32, D=128, BK=128, BV=16, BVS=16, NV=8, W=4, WP=4, USE_LOWER_BOUND=False, NORM=norm, USE_PDL=True,
                  PREFETCH=True, PROBE=0, HOIST=hoist, EARLY=early, PIN=pin, SPLIT_NORM=False, LATE_WAIT=True)
    res[name] = sm90_build(KD._kda_decode_kernel, dec, consts, 1, 1, strided)
    sass = cuobjdump(sm90_kernel(KD._kda_decode_kernel, dec, consts, 1, 1, strided), "-sass").splitlines()
    last_wait = max(i for i, line in enumerate(sass) if "ACQBULK" in line)
    res[name]["tile_loads_before_wait"] = sum("LDG.E.128" in line for line in sass[:last_wait])
# fp32 scratch (bf16 dots, and tf32x3 dots): the launcher's default stages must fit the shared memory (3 did not)
f32 = dict(state, qg_ptr="*fp32", kd_ptr="*fp32", w_ptr="*fp32", u_ptr="*fp32", aqk_ptr="*fp32", h_ptr="*fp32",
           vn_ptr="*fp32")
for name, dot16, prec in (("state_fp32_scratch", True, "tf32"), ("state_fp32_tf32x3", False, "tf32x3")):
    res[name] = sm90_build(K._kda_chunk_state_kernel, f32, dict(H=32, K=128, V=128, BK=128, BV=32, BVF=128,
                           C=K.CHUNK, DOT16=dot16, PREC=prec, SPLIT_O=False), 4, K.default_state_stages(torch.float32),
                           strided)
print(json.dumps(res))
'''


def test_host_path_kernels_build_for_sm90() -> None:
    """Issue 18's kernels of the chunked form's host path (conv + gate, window store) and the state pass on a
    page pool's strided states build for sm_90 at the 48B shape, without spilling, within the shared memory at the
    launcher's stages for 16-bit and fp32 scratch (three stages with fp32 scratch did not fit: session 29's GPU
    tests failed on it); so does the decode kernel at N = 1's and N = 4's defaults (each with and without the norm:
    the tile's loads pinned at N = 1, not at N = 4; N = 1 with the norm split too) and N = 16's; and N = 1's with
    PDL issues its state tile's loads before the PDL wait."""
    res = run_sm90_build(_BUILD_HOST_PATH, timeout=600)
    for name, r in res.items():
        assert r["local"] == 0 and r["shared"] <= 227 * 1024, (name, r)
    for name in ("decode_n1_pdl_late", "decode_n1_norm_pdl_late"):  # with PDL, the pinned N = 1 step's state tile
        assert res[name]["tile_loads_before_wait"] >= 16, res[name]  # loads while the kernel before it runs


_BUILD_SPLIT = r'''
from k3rt.kernels.kda import triton_chunk as K, triton_intra_split as S

I32, C = "i32", "constexpr"
strided = lambda k: k.startswith("stride")

def rows(act, scratch):
    return dict(q_ptr=act, k_ptr=act, g_ptr="*fp32", beta_ptr="*fp32", stride_qt=I32, stride_qh=I32, stride_kt=I32,
                stride_kh=I32, stride_gt=I32, stride_gh=I32, stride_bt=I32, stride_bh=I32, cu_ptr="*i32",
                chunk_seq_ptr="*i32", chunk_idx_ptr="*i32", qg_ptr=scratch, kd_ptr=scratch, kg_ptr=scratch,
                aqk_ptr=scratch, gl_ptr="*fp32", akk_ptr="*fp32", scale="fp32", H=C, K=C, BK=C, BKI=C, BKS=C, C=C,
                BC=C, DOT16=C, PREC=C, SAFE_SPAN=C)

def solve(act, scratch):
    return dict(v_ptr=act, beta_ptr="*fp32", stride_vt=I32, stride_vh=I32, stride_bt=I32, stride_bh=I32,
                cu_ptr="*i32", chunk_seq_ptr="*i32", chunk_idx_ptr="*i32", akk_ptr="*fp32", kg_ptr=scratch,
                w_ptr=scratch, u_ptr=scratch, H=C, V=C, BK=C, BV=C, BKI=C, BVI=C, C=C, BC=C, DOT16=C, PREC=C,
                PREC_INV=C)

def build(dtype, dot16, prec):
    # kda_chunk_fwd's defaults: block_k_split 16, num_warps_split 4
    act = "*" + dtype
    return {
        "rows": sm90_build(S._kda_intra_rows_kernel, rows(act, act), dict(
            H=32, K=128, BK=128, BKI=16, BKS=16, C=K.CHUNK, BC=K.SUB, DOT16=dot16, PREC=prec,
            SAFE_SPAN=K.SAFE_SPAN), 4, 1, strided),
        "solve": sm90_build(S._kda_intra_solve_kernel, solve(act, act), dict(
            H=32, V=128, BK=128, BV=128, BKI=S.SOLVE_BLOCK, BVI=S.SOLVE_BLOCK, C=K.CHUNK, BC=K.SUB,
            DOT16=dot16, PREC=prec, PREC_INV=prec), 4, 1, strided),
    }

print(json.dumps({"bf16": build("bf16", True, "tf32"), "fp32": build("fp32", False, "ieee")}))
'''


def test_split_intra_kernels_build_for_sm90_without_spills() -> None:
    """intra="split" (triton_intra_split.py) at the Kimi head, bf16 with 16-bit dots: both kernels build for
    sm_90 and neither spills, at <= 128 registers (four 4-warp programs per SM; the fused kernel: 255 plus
    spills, one program per SM). The fp32 form builds too."""
    res = run_sm90_build(_BUILD_SPLIT, timeout=600)
    for name, r in res["bf16"].items():
        assert r["stack"] == 0 and r["local"] == 0 and r["regs"] <= 128, (name, r)
    for name, r in res["fp32"].items():
        assert r["shared"] <= 227 * 1024, (name, r)


_BUILD_BLOCKS = r"""
from k3rt.kernels.kda import triton_chunk as K, triton_intra_blocks as B

I32, C, F = "i32", "constexpr", "*fp32"
strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_gt", "stride_gh")
ptrs = dict(q_ptr=None, k_ptr=None, v_ptr=None, g_ptr=F, beta_ptr=F, stride_qt=I32, stride_qh=I32, stride_kt=I32,
            stride_kh=I32, stride_vt=I32, stride_vh=I32, stride_gt=I32, stride_gh=I32, stride_bt=I32, stride_bh=I32,
            cu_ptr="*i32", chunk_seq_ptr="*i32", chunk_idx_ptr="*i32", gl_ptr=F, gc_ptr=F, sq_ptr=F, span_ptr=F,
            akk_ptr=F, aqk_ptr=None, qg_ptr=None, kd_ptr=None, w_ptr=None, u_ptr=None, scale="fp32")
const = dict(H=32, K=128, V=128, BK=128, BKS=32, BV=128, BVS=32, C=K.CHUNK, BC=K.SUB, SAFE_SPAN=K.SAFE_SPAN)
ptrs["beta_ptr"] = F

def build(fn, act, dot16, prec, warps, sliced, fuse, regs, chunk=False):
    args = fn.arg_names
    sig = {a: (act if ptrs.get(a, C) is None else ptrs.get(a, C)) for a in args}
    consts = {a: v for a, v in dict(const, DOT16=dot16, PREC=prec, PREC_INV=prec, SLICED=sliced,
                                    FUSE_GC=fuse, REGS=regs, ROWS=K.CHUNK if chunk else K.SUB,
                                    CHUNK=chunk, NORMS=False, NORMS_L=not (chunk or fuse), NSPAN=1).items()
              if a in args}
    # kda_chunk_fwd's defaults: the per-chunk L and W/U launches at 4 warps, W/U at 3 stages with 16-bit dots; the
    # inverse at 1 warp; the Gc launch at 2 warps per K slice, 4 per chunk; the others the form's
    nw = (4 if chunk else 1 if fn is B._blocks_inverse_kernel else 2 if fn is B._blocks_gc_slice_kernel
          else 4 if fn is B._blocks_gc_kernel else warps)
    stages = 3 if chunk and dot16 and fn is B._blocks_out_kernel else 2
    return sm90_build(fn, sig, consts, nw, stages, lambda k: k in strides)

kernels = dict(gc=(B._blocks_gc_kernel, False, False, False), gc_slice=(B._blocks_gc_slice_kernel, False, False, False),
               pair=(B._blocks_pair_kernel, False, False, False),
               lrow=(B._blocks_lrow_kernel, False, False, False),
               lrow_fused_gc=(B._blocks_lrow_kernel, False, True, False),
               inverse=(B._blocks_inverse_kernel, False, False, False),
               inverse_regs=(B._blocks_inverse_kernel, False, False, True),
               out=(B._blocks_out_kernel, False, False, False), out_sliced=(B._blocks_out_kernel, True, False, False),
               out_fused_gc=(B._blocks_out_kernel, False, True, False),
               out_chunk=(B._blocks_out_kernel, False, False, False, True),
               out_chunk_fused_gc=(B._blocks_out_kernel, False, True, False, True),
               l_chunk=(B._blocks_lrow_kernel, False, False, False, True))
print(json.dumps({  # kda_chunk_fwd's defaults for intra="blocks": 32-column slices, 2 stages, 2 warps (bf16), 4 (fp32)
    form: {name: build(fn, act, dot16, prec, warps, *flags) for name, (fn, *flags) in kernels.items()}
    for form, act, dot16, prec, warps in (("bf16", "*bf16", True, "tf32", 2), ("fp32", "*fp32", False, "ieee", 4))}))
"""


def test_blocks_intra_kernels_build_for_sm90() -> None:
    """intra="blocks" (triton_intra_blocks.py) at the Kimi head builds for sm_90 in both forms, within the shared
    memory, and its four launches stay small at their default warps: no spills in the bf16 form (2 warps) and registers
    for at least four programs per SM (the point of the split: session 29's one-launch form took 255 with spills;
    2 warps measured faster than 4 on the H200, 2.29 against 2.53 ms at 16K tokens, session 32); the fused-Gc forms of
    phases 1 and 3 (fuse_gc_blocks, session 33), the inverse's register form and the per-chunk L and W/U launches
    (inverse_regs_blocks, l_chunk_blocks, out_chunk_blocks, session 34) too."""
    res = run_sm90_build(_BUILD_BLOCKS, timeout=600)
    for form, kernels in res.items():
        for name, r in kernels.items():
            assert r["shared"] <= 227 * 1024, (form, name, r)
            if form == "bf16":
                assert r["stack"] == 0 and r["local"] == 0 and 4 * 2 * 32 * r["regs"] <= 65536, (name, r)
    print(res)
