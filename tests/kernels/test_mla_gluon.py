"""The Gluon MLA decode (kernels/mla/gluon_decode.py, `mla_decode(gluon=True)`): it builds for sm_90 on the CPU
without spills inside the H100/H200's shared memory, with TMA copies and wgmma dots; its refusals name the
field; on the GPU it matches `mla_decode_ref` at the 48B shape, rows past a sequence's end poisoned with NaN
(a TMA box has no row mask), and replays from a CUDA graph over new lengths.

Gluon has no interpreter, so the CPU cases build and refuse; the `gpu` cases run it.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.mla import mla_decode  # noqa: E402
from k3rt.kernels.mla.gluon_decode import gluon_runs  # noqa: E402
from k3rt.kernels.mla.ref import mla_decode_ref  # noqa: E402
from k3rt.kernels.mla.triton_decode import MlaDecodeConfig  # noqa: E402
from tests.kernels.helpers import HAS_CUDA, rel_err, run_sm90_build  # noqa: E402
from tests.kernels.test_mla_triton import (  # noqa: E402
    H48, L48, PAGE48, R48, SCALE48, _gpu_lens, check_decode_graph_replay, decode_case,
)

pytestmark = pytest.mark.usefixtures("poison_outputs")

# the tiles, stage counts and pipelines the benchmark times (the 48B page of 1888 = 59 x 32 tokens)
LAUNCHES = [(32, 2, "serial"), (32, 3, "serial"), (32, 4, "serial"), (64, 2, "serial"), (32, 3, "pv"), (32, 4, "pv"),
            (64, 2, "pv"), (32, 3, "two_tile"), (32, 4, "two_tile"), (64, 2, "tokens"), (64, 2, "tokens16")]


def _tune(block_n: int, stages: int, pipeline: str) -> dict:
    """mla_decode's overrides for a LAUNCHES entry ("tokens": gluon_layout="tokens", whose pipeline is serial;
    "tokens16": with 16 heads a program)."""
    if pipeline.startswith("tokens"):
        return dict(gluon=True, block_n=block_n, num_stages=stages, gluon_layout="tokens",
                    block_h=16 if pipeline == "tokens16" else None)
    return dict(gluon=True, block_n=block_n, num_stages=stages, gluon_pipeline=pipeline)



_BUILDS = f"BUILDS = {LAUNCHES!r}\n" + r'''
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from k3rt.kernels.mla import gluon_decode as g

def build(block_n, stages, pipeline, L=512, R=64):
    sub = 32  # the 48B page (1888 tokens) is 59 boxes of 32 rows: 64-token tiles are two boxes
    cl = gl.NVMMASharedLayout.get_default_for([sub, L], gl.bfloat16)
    pl = gl.NVMMASharedLayout.get_default_for([sub, R], gl.bfloat16)
    I32, C = "i32", "constexpr"
    sig = dict(q_ptr="*bf16", stride_q_n=I32, stride_q_h=I32, kv_ptr="*bf16",
               c_desc=f"tensordesc<bf16[{sub}, {L}],{cl!r}>", pe_desc=f"tensordesc<bf16[{sub}, {R}],{pl!r}>",
               block_table_ptr="*i32", stride_bt_n=I32, seq_lens_ptr="*i32", part_ptr="*fp32", lse_ptr="*fp32",
               qk_scale="fp32", H=I32, block_size=I32, num_splits=I32, L=C, R=C, BLOCK_H=C, BLOCK_N=C, SUB=C,
               STAGES=C, PIPELINE=C, num_warps=C)
    if pipeline.startswith("tokens"):  # the tokens layout: one warpgroup, the 48B's 32 heads (or 16) on N
        del sig["PIPELINE"]
        fn, warps = g._mla_decode_gluon_tokens_kernel, 4
        consts = dict(L=L, R=R, BLOCK_H=16 if pipeline == "tokens16" else 32,
                      BLOCK_N=block_n, SUB=sub, STAGES=stages, num_warps=warps)
    else:
        fn, warps = g._mla_decode_gluon_kernel, 8
        consts = dict(L=L, R=R, BLOCK_H=g.GLUON_BLOCK_H, BLOCK_N=block_n, SUB=sub, STAGES=stages,
                      PIPELINE=g.PIPELINES.index(pipeline), num_warps=warps)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
             if v.startswith("*") or k.startswith("stride")}
    k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    usage = cuobjdump(k, "-res-usage")
    return {"regs": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "local": int(re.search(r"LOCAL:(\d+)", usage).group(1)), "shared": k.metadata.shared,
            "tma": k.asm["ptx"].count("cp.async.bulk.tensor"), "wgmma": k.asm["ptx"].count("wgmma.mma_async")}

print(json.dumps({f"n{n}x{s} {p}": build(n, s, p) for n, s, p in BUILDS}))
'''


def test_sm90_build_has_no_spills_and_fits_shared_memory() -> None:
    res = run_sm90_build(_BUILDS, timeout=400)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)  # one program per SM
        assert r["tma"] > 0 and r["wgmma"] > 0, (name, r)


def test_config_refusals() -> None:
    with pytest.raises(ValueError, match="gluon=True needs schedule='split' and tma=False"):
        MlaDecodeConfig(num_splits=2, paged=True, prefetch="none", schedule="balanced", gluon=True)
    with pytest.raises(ValueError, match="gluon=True needs schedule='split' and tma=False"):
        MlaDecodeConfig(num_splits=2, paged=True, prefetch="none", tma=True, gluon=True)
    with pytest.raises(ValueError, match="gluon_pipeline='pv' is a choice of the Gluon kernel"):
        MlaDecodeConfig(num_splits=2, gluon_pipeline="pv")
    with pytest.raises(ValueError, match="gluon_pipeline must be one of"):
        MlaDecodeConfig(num_splits=2, gluon=True, paged=True, prefetch="none", gluon_pipeline="fast")
    with pytest.raises(ValueError, match="gluon_layout='tokens' is a choice of the Gluon kernel"):
        MlaDecodeConfig(num_splits=2, gluon_layout="tokens")
    with pytest.raises(ValueError, match="gluon_layout must be one of"):
        MlaDecodeConfig(num_splits=2, gluon=True, paged=True, prefetch="none", gluon_layout="rows")
    with pytest.raises(ValueError, match="gluon_layout='tokens' takes block_n=64"):
        MlaDecodeConfig(num_splits=2, gluon=True, paged=True, prefetch="none", gluon_layout="tokens", block_n=32)
    with pytest.raises(ValueError, match="gluon_layout='tokens' takes block_h 16 or 32"):
        MlaDecodeConfig(num_splits=2, gluon=True, paged=True, prefetch="none", gluon_layout="tokens", block_n=64,
                        block_h=64)
    with pytest.raises(ValueError, match="gluon_layout='tokens' takes block_n=64"):
        MlaDecodeConfig(num_splits=2, gluon=True, paged=True, prefetch="none", gluon_layout="tokens", block_n=64,
                        gluon_pipeline="pv")
    with pytest.raises(ValueError, match="gluon_pipeline='two_tile' needs num_stages >= 3"):
        MlaDecodeConfig(num_splits=2, gluon=True, paged=True, prefetch="none", gluon_pipeline="two_tile",
                        num_stages=2)


def test_the_tokens_layout_refuses_a_latent_below_64_columns() -> None:
    """The tokens layout's c^T . p^T has the latent columns on wgmma's M (64 rows an instruction): the tiny
    checkpoints' kv_lora_rank of 32 is refused by name (the runner then keeps the Triton kernel, gluon_runs)."""
    case = decode_case([40, 7], H=4, L=32, R=16, block_size=64, dtype=torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="gluon_layout='tokens' needs kv_lora_rank a multiple of 64.*got 32"):
        mla_decode(**case, scale=0.2, kv_lora_rank=32, gluon=True, block_n=64, num_stages=2, gluon_layout="tokens")
    assert not gluon_runs(case["q"], 64, 64, "tokens", 32)


@pytest.mark.skipif(HAS_CUDA, reason="the refusal of a device without sm_90")
def test_the_gluon_split_count_fills_one_wave_not_two() -> None:
    """gluon_num_splits (mla_decode's count for the Gluon kernel when given none, and kernels_mla.py's since session
    44, which had timed the Gluon rows at the Triton kernels' two-wave count): at 132 SMs and 32 heads, batch 16
    takes 8 splits (128 programs) where the two-wave rule takes 16, batch 64 takes 2; batch 1 fills the SMs either
    way; 16 heads a program (tokens layout) halves the splits."""
    from k3rt.kernels.mla.triton_decode import gluon_num_splits, mla_decode_num_splits

    assert [gluon_num_splits(n, 32, 32768, 132, "tokens", 32) for n in (1, 16, 64)] == [132, 8, 2]
    assert [mla_decode_num_splits(n, 32, 32768, 132) for n in (1, 16, 64)] == [132, 16, 4]
    assert gluon_num_splits(16, 32, 32768, 132, "tokens", 16) == 4
    assert gluon_num_splits(16, 32, 32768, 132, "heads", 32) == 8  # heads layout: 64 heads a program, one block


def test_refuses_to_run_without_a_gpu() -> None:
    case = decode_case([40, 7], H=4, L=32, R=16, block_size=16, dtype=torch.float16, seed=3)
    with pytest.raises(ValueError, match="needs an sm_90\\+ GPU"):
        mla_decode(**case, scale=0.2, kv_lora_rank=32, gluon=True, block_n=16)


def _poison_past_ends(case: dict) -> None:
    """NaN in every pool row past a sequence's end on its last page: the kernel must never multiply them."""
    block_size = case["kv_cache"].shape[1]
    for n, s in enumerate(case["seq_lens"].tolist()):
        if s % block_size:
            case["kv_cache"][case["block_table"][n, s // block_size], s % block_size:] = float("nan")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,max_ctx", [(1, 32768), (16, 32768), (64, 8192)])
@pytest.mark.parametrize("splits", ["auto", "one"])
@pytest.mark.parametrize("block_n,stages,pipeline", LAUNCHES, ids=[f"n{n}x{s}_{p}" for n, s, p in LAUNCHES])
def test_gpu_matches_ref_at_the_48b_shape(N: int, max_ctx: int, splits: str, block_n: int, stages: int,
                                          pipeline: str) -> None:
    """64-token tiles are two 32-row boxes there (a tile may straddle a page)."""
    case = decode_case(_gpu_lens(N, max_ctx, seed=N + max_ctx), H=H48, L=L48, R=R48, block_size=PAGE48,
                       dtype=torch.bfloat16, seed=N, spare_blocks=1)
    _poison_past_ends(case)
    want = mla_decode_ref(**case, scale=SCALE48, kv_lora_rank=L48)
    got = mla_decode(**case, scale=SCALE48, kv_lora_rank=L48, num_splits=None if splits == "auto" else 1,
                     **_tune(block_n, stages, pipeline))
    assert rel_err(got, want) <= 1e-2, rel_err(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pipeline", ["serial", "pv", "two_tile", "tokens"])
def test_gpu_odd_heads_and_pages(pipeline: str) -> None:
    """Fewer heads than a block (masked rows), a page of 64 tokens, 16-token tiles (the tokens layout: 64), lengths
    of 0, 1 and one past a page, more splits than tiles."""
    case = decode_case([0, 1, 65, 300, 4097], H=20, L=L48, R=R48, block_size=64, dtype=torch.float16, seed=5)
    _poison_past_ends(case)
    want = mla_decode_ref(**case, scale=0.1, kv_lora_rank=L48)
    tune = _tune(64, 2, pipeline) if pipeline == "tokens" else _tune(16, 4, pipeline)
    got = mla_decode(**case, scale=0.1, kv_lora_rank=L48, num_splits=40, **tune)
    assert rel_err(got, want) <= 1e-2, rel_err(got, want)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pipeline", ["serial", "pv", "two_tile", "tokens"])
def test_gpu_cuda_graph_replay(pipeline: str) -> None:
    check_decode_graph_replay(**(_tune(64, 2, pipeline) if pipeline == "tokens" else _tune(32, 3, pipeline)))
