"""One token's MoE layer in one persistent launch (kernels/moe/triton_layer.py) agrees with ref.py's moe_layer_ref.

Without a GPU the kernel runs in the Triton interpreter in its phased form (three launches: the interpreter runs
programs one after another, so the grid form's waits would never end); small fp32 / fp16 shapes with every item
kind's masked tail (E, I and D not multiples of the items' rows). The `gpu` cases run the grid form at the
Kimi-Linear-48B shape (E=256, k=8, one shared expert, D=2304, I=1024, bf16) against the oracle, the phased form and
the grouped path (router GEMV + top-k + fused_experts with its add + norm), from a CUDA graph replayed several times
(the counters must come back to zero). The sm_90 build checks registers, spills and the release / acquire pairs.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.moe import fused_experts, moe_route  # noqa: E402
from k3rt.kernels.moe.ref import moe_layer_ref  # noqa: E402
from k3rt.kernels.moe import triton_layer as L  # noqa: E402
from k3rt.kernels.moe.triton_experts import SumNorm  # noqa: E402
from k3rt.model_config import ActivationConfig  # noqa: E402
from tests.kernels.helpers import HAS_CUDA, rel_err, run_sm90_build  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py

ACTS = {"silu": ActivationConfig("silu"), "situ_lin": ActivationConfig("situ", 4.0, 25.0)}
SYNC = L.LAYER_SYNC_WORDS


def make_case(D: int, I: int, E: int, S: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> dict:
    """A layer's weights and input: a fp32 router (Kimi keeps it fp32), stacks of E routed + S shared experts."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=device) * scale  # noqa: E731
    return dict(x=r(1, D).to(dtype), gate_weight=r(E, D, scale=D ** -0.5), bias=r(E, scale=0.1),
                w13=r(E + S, 2 * I, D, scale=D ** -0.5).to(dtype), w2=r(E + S, D, I, scale=I ** -0.5).to(dtype))


def norm_args(kind: str, D: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> tuple:
    """(the launcher's norm, the oracle's norm, residual_out) for kind none / plain / residual."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    weight = (torch.rand(D, generator=g, device=device) + 0.5).to(dtype)
    if kind == "none":
        return None, None, None
    if kind == "plain":
        return (weight, 1e-5), (weight, 1e-5), None
    residual = torch.randn(1, D, generator=g, device=device).to(dtype)
    residual_out = torch.empty_like(residual)
    return SumNorm(weight, 1e-5, residual, residual_out), (weight, 1e-5, residual), residual_out


@pytest.mark.parametrize("dtype,act,S,norm,shape", [
    (torch.float32, "silu", 1, "residual", (72, 48, 16)),
    (torch.float32, "silu", 0, "none", (72, 48, 16)),
    (torch.float32, "situ_lin", 2, "plain", (72, 48, 16)),
    # every item kind's masked tail: 13 routers rows in items of 2, 47 columns, 71 down rows in items of 2
    (torch.float32, "silu", 1, "residual", (71, 47, 13)),
    (torch.float16, "situ_lin", 1, "residual", (64, 32, 12)),
])
def test_matches_the_reference(dtype: torch.dtype, act: str, S: int, norm: str, shape: tuple) -> None:
    D, I, E = shape
    case = make_case(D, I, E, S, dtype, seed=D + I + E)
    kw = dict(top_k=4, renormalize=True, scaling=2.446, shared_experts=S, act=ACTS[act])
    launch_norm, ref_norm, residual_out = norm_args(norm, D, dtype, seed=E)
    sync = torch.zeros(SYNC, dtype=torch.int32)
    out, tw, ids = L.moe_layer_one_token(**case, sync=sync, norm=launch_norm, **kw)
    ref, ref_tw, ref_ids, ref_res = moe_layer_ref(**case, norm=ref_norm, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(tw, ref_tw, rtol=1e-5, atol=1e-6)
    assert rel_err(out, ref) <= tol
    if residual_out is not None:
        assert rel_err(residual_out, ref_res) <= tol
    assert torch.equal(sync, torch.zeros(SYNC, dtype=torch.int32))  # left as found, for the next launch
    again, _, _ = L.moe_layer_one_token(**case, sync=sync, norm=launch_norm, **kw, programs=5)
    assert torch.equal(again, out)  # no atomics on data: the grid's size does not change a bit


def test_rejects_bad_inputs() -> None:
    case = make_case(32, 16, 8, 1, torch.float32, seed=1)
    kw = dict(top_k=2, shared_experts=1, act=ACTS["silu"])
    sync = torch.zeros(SYNC, dtype=torch.int32)
    with pytest.raises(ValueError, match="one row"):
        L.moe_layer_one_token(**dict(case, x=case["x"].expand(2, -1)), sync=sync, **kw)
    with pytest.raises(ValueError, match="routed \\+ shared_experts"):
        L.moe_layer_one_token(**case, sync=sync, **dict(kw, shared_experts=0))
    with pytest.raises(ValueError, match="sync"):
        L.moe_layer_one_token(**case, sync=torch.zeros(3, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="top_k"):
        L.moe_layer_one_token(**case, sync=sync, **dict(kw, top_k=9))
    with pytest.raises(ValueError, match="phased=True"):
        L.moe_layer_one_token(**case, sync=sync, **kw, phased=False)
    wide = make_case(L.NORM_MAX_D + 16, 16, 8, 1, torch.float32, seed=2)
    with pytest.raises(ValueError, match="D <="):
        L.moe_layer_one_token(**wide, sync=sync, **kw, norm=(torch.ones(L.NORM_MAX_D + 16), 1e-5))
    assert L.layer_fits(1, 256, 2304, 1, True) and not L.layer_fits(2, 256, 2304, 1, True)
    assert not L.layer_fits(1, 256, 2304, 8, True) and not L.layer_fits(1, 1024, 2304, 1, False)


def test_sm90_build_default_tiles() -> None:
    """The grid form at the 48B shape builds for sm_90: no spills, registers that let the default per_sm programs
    share an SM, the arrivals as releases and the waits as acquires at GPU scope, and the GEMVs' K steps without CTA
    barriers (a broadcast x would cost two a step: over a hundred in all)."""
    res = run_sm90_build(r'''
import re
from k3rt.kernels.moe import triton_layer as L
I32, C = "i32", "constexpr"
sig = dict(x_ptr="*bf16", gate_ptr="*fp32", bias_ptr="*fp32", w13_ptr="*bf16", w2_ptr="*bf16", logits_ptr="*fp32",
           h_ptr="*bf16", sync_ptr="*i32", tw_ptr="*fp32", ids_ptr="*i32", out_ptr="*bf16", row_ptr="*bf16",
           res_ptr="*bf16", norm_w_ptr="*bf16", eps="fp32", scaling="fp32", beta="fp32", lin_beta="fp32", E=I32, G=I32,
           D=C, I=C, BLOCK_E=C, K=C, BLOCK_KS=C, S=C, RENORMALIZE=C, SITU=C, LIN_SAT=C, NORM=C, RESIDUAL=C, BLOCK_D=C,
           ROUTER_ROWS=C, COLS=C, DOWN_ROWS=C, BLOCK_KR=C, BLOCK_KW=C, LINES_I=C, PREFETCH=C, PHASE=C, USE_PDL=C)
t = L.DEFAULT_TILES
consts = dict(D=2304, I=1024, BLOCK_E=256, K=8, BLOCK_KS=8, S=1, RENORMALIZE=True, SITU=False, LIN_SAT=False,
              NORM=True, RESIDUAL=True, BLOCK_D=4096, ROUTER_ROWS=t.router_rows, COLS=t.cols, DOWN_ROWS=t.down_rows,
              BLOCK_KR=128 * t.loads, BLOCK_KW=256 * t.loads, LINES_I=16, PREFETCH=t.prefetch,
              PHASE=L.ALL_PHASES.value, USE_PDL=True)
k = sm90_kernel(L._moe_layer_kernel, sig, consts, t.num_warps, 1, lambda n: False)
usage = cuobjdump(k, "-res-usage")
ptx = k.asm["ptx"]
num = lambda key: int(re.search(key + r":(\d+)", usage).group(1))
print(json.dumps({"regs": num("REG"), "spill": num("STACK") + num("LOCAL"),
                  "release": len(re.findall(r"atom\.global\.gpu\.release", ptx)),
                  "acquire": len(re.findall(r"ld\.global\.gpu\.acquire", ptx)),
                  "bars": ptx.count("bar.sync"), "warps": t.num_warps, "per_sm": t.per_sm}))
''', timeout=300)
    assert res["spill"] == 0
    assert (-(-res["regs"] * 32 // 256) * 256) * res["warps"] * res["per_sm"] <= 65536, res
    assert res["release"] == 3 and res["acquire"] == 3, res  # three arrivals, three waits (ALL_DONE: acq_rel)
    assert res["bars"] <= 100, res


# --------------------------------------------------------------------------------------------
# GPU: the grid form


E48, K48, D48, I48 = 256, 8, 2304, 1024


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tiles", L.CANDIDATES, ids=[f"tiles{i}" for i in range(len(L.CANDIDATES))])
def test_gpu_grid_form_48b_from_a_graph(tiles: L.LayerTiles) -> None:
    case = make_case(D48, I48, E48, 1, torch.bfloat16, seed=7, device="cuda")
    kw = dict(top_k=K48, renormalize=True, scaling=2.446, shared_experts=1, act=ACTS["silu"])
    launch_norm, ref_norm, residual_out = norm_args("residual", D48, torch.bfloat16, seed=3, device="cuda")
    sync = torch.zeros(SYNC, dtype=torch.int32, device="cuda")
    out = torch.empty(1, D48, dtype=torch.bfloat16, device="cuda")
    L.moe_layer_one_token(**case, sync=sync, norm=launch_norm, out=out, tiles=tiles, **kw)  # compiles
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, tw, ids = L.moe_layer_one_token(**case, sync=sync, norm=launch_norm, out=out, tiles=tiles, **kw)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    assert int(sync[L.STALLED.value]) == 0 and torch.equal(sync, torch.zeros_like(sync))
    ref, ref_tw, ref_ids, ref_res = moe_layer_ref(**case, norm=ref_norm, **kw)
    assert torch.equal(ids, ref_ids)
    assert rel_err(out, ref) <= 1e-2 and rel_err(residual_out, ref_res) <= 1e-2
    phased = torch.empty_like(out)
    L.moe_layer_one_token(**case, sync=sync, norm=launch_norm, out=phased, phased=True, tiles=tiles, **kw)
    assert torch.equal(phased, out)  # the same items, the same sums: the waits change no bit


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("use_pdl", [False, True])
def test_gpu_grid_form_equals_the_grouped_path(use_pdl: bool) -> None:
    """Against what the runner launches today at batch 1 (fp32 logits, moe_route, fused_experts with the add and
    the norm in its sum): the same experts, outputs within bf16 rounding."""
    case = make_case(D48, I48, E48, 1, torch.bfloat16, seed=9, device="cuda")
    kw = dict(top_k=K48, renormalize=True, scaling=2.446)
    launch_norm, _, residual_out = norm_args("residual", D48, torch.bfloat16, seed=5, device="cuda")
    sync = torch.zeros(SYNC, dtype=torch.int32, device="cuda")
    out, _, ids = L.moe_layer_one_token(**case, sync=sync, norm=launch_norm, shared_experts=1, act=ACTS["silu"],
                                        use_pdl=use_pdl, **kw)
    logits = case["x"].float() @ case["gate_weight"].t()
    tw, ref_ids = moe_route(logits, case["bias"], **kw)
    res_out = torch.empty_like(residual_out)
    grouped = fused_experts(case["x"], case["w13"], case["w2"], tw, ref_ids, act=ACTS["silu"], shared_experts=1,
                            norm=SumNorm(launch_norm.weight, 1e-5, launch_norm.residual, res_out))
    torch.cuda.synchronize()
    assert torch.equal(ids, ref_ids)
    assert rel_err(out, grouped) <= 1e-2 and rel_err(residual_out, res_out) <= 1e-2
