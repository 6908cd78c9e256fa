"""One token's KDA layer in one persistent launch (kernels/kda/triton_layer.py) against the runner's decode path as
separate ops: the input projection and the up-projections (fp32 GEMVs rounded to x.dtype), `kda_decode` with the
gated output norm, o_proj, the residual add and kernels/norm's RMSNorm; the conv window and the state updated alike.

Without a GPU the kernel runs in the interpreter in its phased form (four launches); the `gpu` cases run the grid
form at the 48B's KDA shape (H 32, D 128, hidden 2304, bf16) from a CUDA graph replayed several times (the counters
come back to zero) and against the phased form, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.kda import kda_decode  # noqa: E402
from k3rt.kernels.kda import triton_layer as L  # noqa: E402
from k3rt.kernels.norm.ref import rms_norm as rms_norm_ref  # noqa: E402
from tests.kernels.helpers import HAS_CUDA, rel_err, run_benchmark_smoke, run_sm90_build  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")


def make_layer(H: int, D: int, HID: int, dtype: torch.dtype, seed: int, device: str = "cpu", W: int = 4,
               slots: int = 3) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=device) * scale  # noqa: E731
    P = H * D
    w_up = torch.zeros(2 * P, 2 * D, device=device)
    w_up[:P, :D], w_up[P:, D:] = r(P, D, scale=D ** -0.5), r(P, D, scale=D ** -0.5)
    return dict(
        x=r(1, HID).to(dtype), w_in=r(3 * P + 2 * D + H + 5, HID, scale=HID ** -0.5).to(dtype),  # 5 padding rows
        w_up=w_up.to(dtype), conv_weight=r(3 * P, W, scale=0.5), conv_pool=r(slots, W - 1, 3 * P).to(dtype),
        A_log=r(H, scale=0.5), dt_bias=r(P, scale=0.5), state_pool=r(slots, H, D, D, scale=0.1),
        slot=torch.tensor([1], device=device), o_norm_weight=(r(D).abs() + 0.5).to(dtype),
        o_proj=r(HID, P, scale=P ** -0.5).to(dtype), residual=r(1, HID).to(dtype),
        norm_weight=(r(HID).abs() + 0.5).to(dtype))


def reference(c: dict, lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's decode path as separate ops, on c's pools in place."""
    dt = c["x"].dtype
    _, H, D, _ = c["state_pool"].shape
    P = H * D
    proj = (c["x"].float() @ c["w_in"].float().t()).to(dt)
    qkv, ga, fa, b = proj[:, :3 * P], proj[:, 3 * P:3 * P + D], proj[:, 3 * P + D:3 * P + 2 * D], \
        proj[:, 3 * P + 2 * D:3 * P + 2 * D + H]
    gate = (ga.float() @ c["w_up"][:P, :D].float().t()).to(dt)
    f = (fa.float() @ c["w_up"][P:, D:].float().t()).to(dt)
    o = kda_decode(qkv, c["conv_weight"], c["conv_pool"], f, c["A_log"], c["dt_bias"], b, c["state_pool"], c["slot"],
                   lower_bound=lower_bound, o_gate=gate.reshape(1, H, D), o_norm_weight=c["o_norm_weight"],
                   o_norm_eps=1e-5)
    y = (o.reshape(1, P).float() @ c["o_proj"].float().t()).to(dt)
    h = (y.float() + c["residual"].float()).to(dt)
    return rms_norm_ref(h, c["norm_weight"], 1e-6), h


@pytest.mark.parametrize("dtype,lower_bound,H,D,HID", [
    (torch.float32, None, 2, 16, 48),
    (torch.float32, -5.0, 3, 16, 40),
    (torch.float16, None, 2, 32, 64),
])
def test_matches_the_decode_path(dtype: torch.dtype, lower_bound: float | None, H: int, D: int, HID: int) -> None:
    c = make_layer(H, D, HID, dtype, seed=H * D + HID)
    ref_c = {k: v.clone() for k, v in c.items()}
    want, want_h = reference(ref_c, lower_bound)
    sync = torch.zeros(L.kda_layer_sync_words(H), dtype=torch.int32)
    got, got_h = L.kda_layer_one_token(**c, sync=sync, o_norm_eps=1e-5, eps=1e-6, lower_bound=lower_bound)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel_err(got, want) <= tol and rel_err(got_h, want_h) <= tol
    assert rel_err(c["state_pool"], ref_c["state_pool"]) <= tol  # the slot's state moved on alike, the others kept
    assert torch.equal(c["state_pool"][0], ref_c["state_pool"][0])
    assert rel_err(c["conv_pool"].float(), ref_c["conv_pool"].float()) <= tol  # the window shifted alike
    assert not sync.any()  # left as found, for the next launch


def test_rejects_what_it_does_not_take() -> None:
    c = make_layer(2, 16, 48, torch.float32, seed=1)
    sync = torch.zeros(L.kda_layer_sync_words(2), dtype=torch.int32)
    kw = dict(o_norm_eps=1e-5, eps=1e-6)
    with pytest.raises(ValueError, match="one contiguous row"):
        L.kda_layer_one_token(**dict(c, x=c["x"].expand(2, -1)), sync=sync, **kw)
    with pytest.raises(ValueError, match="w_up"):
        L.kda_layer_one_token(**dict(c, w_up=c["w_up"][:, :16]), sync=sync, **kw)
    with pytest.raises(ValueError, match="sync"):
        L.kda_layer_one_token(**c, sync=torch.zeros(3, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="phased=True"):
        L.kda_layer_one_token(**c, sync=sync, **kw, phased=False)
    with pytest.raises(ValueError, match="head_dim"):
        L.kda_layer_one_token(**make_layer(2, 12, 48, torch.float32, seed=2), sync=sync, **kw)
    assert L.kda_layer_fits(1, True, 32, 128, 2304, L.DEFAULT_TILES)
    assert not L.kda_layer_fits(2, True, 32, 128, 2304, L.DEFAULT_TILES)
    assert not L.kda_layer_fits(1, False, 32, 128, 2304, L.DEFAULT_TILES)


def test_benchmark_smoke(tmp_path) -> None:
    """benchmarks/kda_layer.py --smoke: the phased form checked against the separate path and both timed."""
    result = run_benchmark_smoke("kda_layer.py", tmp_path / "kda_layer.json")
    layer = {r["name"]: r for r in result["layer"]}
    assert layer["phased (4 launches)"]["ok"] and "us" in layer["separate (5 launches)"], layer


def test_sm90_build_default_tiles() -> None:
    """The grid form at the 48B's KDA shape builds for sm_90 without spills, in registers that let the default
    per_sm programs share an SM, its four waits as acquires and its four arrivals as releases."""
    res = run_sm90_build(r'''
import re
from k3rt.kernels.kda import triton_layer as L
C = "constexpr"
sig = dict(x_ptr="*bf16", w_in_ptr="*bf16", w_up_ptr="*bf16", conv_w_ptr="*fp32", conv_ptr="*bf16",
           stride_cs_slot="i32", a_log_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32", stride_state_slot="i32",
           slot_ptr="*i32", norm_o_w_ptr="*bf16", wo_ptr="*bf16", res_ptr="*bf16", norm_w_ptr="*bf16",
           proj_ptr="*bf16", up_ptr="*bf16", raw_ptr="*fp32", o_ptr="*bf16", sync_ptr="*i32", out_ptr="*bf16",
           res_out_ptr="*bf16", scale="fp32", lower_bound="fp32", eps_o="fp32", eps="fp32", G="i32", HID=C, H=C, D=C,
           W=C, WP=C, NV=C, USE_LOWER_BOUND=C, ROWS=C, UP_ROWS=C, BLOCK_KX=C, BLOCK_KD=C, BLOCK_KP=C, BLOCK_HID=C,
           LINES_P=C, PREFETCH=C, PHASE=C, USE_PDL=C)
t = L.DEFAULT_TILES
consts = dict(HID=2304, H=32, D=128, W=4, WP=4, NV=t.v_split, USE_LOWER_BOUND=False, ROWS=t.rows,
              UP_ROWS=t.up_rows, BLOCK_KX=256, BLOCK_KD=128, BLOCK_KP=256, BLOCK_HID=4096, LINES_P=64,
              PREFETCH=t.prefetch, PHASE=L.ALL_PHASES.value, USE_PDL=True)
k = sm90_kernel(L._kda_layer_kernel, sig, consts, t.num_warps, 1, lambda n: n.startswith("stride"))
usage = cuobjdump(k, "-res-usage")
ptx = k.asm["ptx"]
num = lambda key: int(re.search(key + r":(\d+)", usage).group(1))
print(json.dumps({"regs": num("REG"), "spill": num("STACK") + num("LOCAL"), "warps": t.num_warps, "per_sm": t.per_sm,
                  "release": len(re.findall(r"atom\.global\.gpu\.release", ptx)),
                  "acquire": len(re.findall(r"ld\.global\.gpu\.acquire", ptx))}))
''', timeout=300)
    assert res["spill"] == 0, res
    assert (-(-res["regs"] * 32 // 256) * 256) * res["warps"] * res["per_sm"] <= 65536, res
    assert res["acquire"] == 4 and res["release"] == 4, res  # arrivals and waits: LOW, PROJ, UP, HEADS


# --------------------------------------------------------------------------------------------
# GPU: the grid form at the 48B's KDA shape


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tiles", L.CANDIDATES, ids=[f"tiles{i}" for i in range(len(L.CANDIDATES))])
def test_gpu_grid_form_48b_from_a_graph(tiles: L.KdaLayerTiles) -> None:
    c = make_layer(32, 128, 2304, torch.bfloat16, seed=4, device="cuda")
    start = {k: v.clone() for k, v in c.items()}
    ref_c = {k: v.clone() for k, v in c.items()}
    want, want_h = reference(ref_c, None)
    sync = torch.zeros(L.kda_layer_sync_words(32), dtype=torch.int32, device="cuda")
    kw = dict(o_norm_eps=1e-5, eps=1e-6, tiles=tiles)
    out, res_out = torch.empty_like(c["residual"]), torch.empty_like(c["residual"])
    L.kda_layer_one_token(**c, sync=sync, out=out, residual_out=res_out, **kw)  # compiles
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        L.kda_layer_one_token(**c, sync=sync, out=out, residual_out=res_out, **kw)
    for _ in range(3):  # each replay from the same start: the pools restored first
        c["conv_pool"].copy_(start["conv_pool"])
        c["state_pool"].copy_(start["state_pool"])
        out.fill_(float("nan"))
        g.replay()
    torch.cuda.synchronize()
    assert not sync.any()
    assert rel_err(out, want) <= 1e-2 and rel_err(res_out, want_h) <= 1e-2
    assert rel_err(c["state_pool"], ref_c["state_pool"]) <= 1e-2  # the inputs differ by bf16 GEMV roundings
    grid_state, grid_out = c["state_pool"].clone(), out.clone()
    c["conv_pool"].copy_(start["conv_pool"])
    c["state_pool"].copy_(start["state_pool"])
    phased, _ = L.kda_layer_one_token(**c, sync=sync, phased=True, **kw)
    assert torch.equal(phased, grid_out) and torch.equal(c["state_pool"], grid_state)  # the waits change no bit
