"""One token's MLA layer around its attention core in two persistent launches (kernels/mla/triton_layer.py) against
the runner's separate ops: the input projection (an fp32 GEMV rounded to x.dtype), `mla_store_latent`, the absorbed
query (W_UK product rounded, then the rope part), and after the attention the W_UV product, o_proj, the residual add
and kernels/norm's RMSNorm. Interpreter: the phased form (two launches each); `gpu`: the grid form at the 48B's MLA
shape (32 heads, L 512, R 64, P = V = 128, hidden 2304, bf16), bit-equal to the phased form, counters back at zero.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.mla import mla_store_latent  # noqa: E402
from k3rt.kernels.mla import triton_layer as L  # noqa: E402
from k3rt.kernels.norm.ref import rms_norm as rms_norm_ref  # noqa: E402
from tests.kernels.helpers import HAS_CUDA, rel_err, run_benchmark_smoke, run_sm90_build  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")


def make_layer(H: int, P: int, R: int, Lr: int, V: int, HID: int, dtype: torch.dtype, seed: int,
               device: str = "cpu") -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=device) * scale  # noqa: E731
    kv_b = r(H * (P + V), Lr, scale=Lr ** -0.5).to(dtype)
    return dict(x=r(1, HID).to(dtype), w_in=r(H * (P + R) + Lr + R + 3, HID, scale=HID ** -0.5).to(dtype),
                kv_norm_weight=(r(Lr).abs() + 0.5).to(dtype), kv_flat=r(10, Lr + R).to(dtype),
                kv_slot=torch.tensor([6], device=device), kv_b=kv_b,
                w_uk_t=kv_b.view(H, P + V, Lr)[:, :P].transpose(1, 2).contiguous(),
                o_lat=r(1, H, Lr).to(dtype), o_proj=r(HID, H * V, scale=(H * V) ** -0.5).to(dtype),
                residual=r(1, HID).to(dtype), norm_weight=(r(HID).abs() + 0.5).to(dtype))


def pre_reference(c: dict, H: int, P: int, R: int, Lr: int) -> torch.Tensor:
    dt = c["x"].dtype
    NQ = H * (P + R)
    proj = (c["x"].float() @ c["w_in"].float().t()).to(dt)
    mla_store_latent(proj[:, NQ:NQ + Lr + R], c["kv_norm_weight"], 1e-6, c["kv_flat"], c["kv_slot"], kv_lora_rank=Lr)
    q = proj[:, :NQ].view(1, H, P + R)
    q_lat = torch.bmm(q[..., :P].float().transpose(0, 1), c["w_uk_t"].float().transpose(1, 2)).transpose(0, 1)
    return torch.cat([q_lat.to(dt), q[..., P:]], dim=-1)


def post_reference(c: dict, H: int, P: int, V: int, Lr: int) -> tuple[torch.Tensor, torch.Tensor]:
    dt = c["x"].dtype
    w_uv_t = c["kv_b"].view(H, P + V, Lr)[:, P:].transpose(1, 2).float()  # [H, L, V]
    o = torch.bmm(c["o_lat"].float().transpose(0, 1), w_uv_t).transpose(0, 1).to(dt)  # [1, H, V]
    y = (o.reshape(1, H * V).float() @ c["o_proj"].float().t()).to(dt)
    h = (y.float() + c["residual"].float()).to(dt)
    return rms_norm_ref(h, c["norm_weight"], 1e-6), h


@pytest.mark.parametrize("dtype,H,P,R,Lr,V,HID", [
    (torch.float32, 2, 16, 8, 32, 16, 48),
    (torch.float32, 3, 16, 8, 40, 24, 40),  # L and V not multiples of the items' rows: masked tails
    (torch.float16, 2, 32, 16, 64, 32, 64),
])
def test_matches_the_separate_ops(dtype: torch.dtype, H: int, P: int, R: int, Lr: int, V: int, HID: int) -> None:
    c = make_layer(H, P, R, Lr, V, HID, dtype, seed=H + P + Lr)
    ref_kv = c["kv_flat"].clone()
    want_q = pre_reference(dict(c, kv_flat=ref_kv), H, P, R, Lr)
    sync = torch.zeros(L.MLA_LAYER_SYNC_WORDS, dtype=torch.int32)
    qcat = L.mla_pre_one_token(c["x"], c["w_in"], c["kv_norm_weight"], 1e-6, c["kv_flat"], c["kv_slot"], c["w_uk_t"],
                               sync, qk_rope_head_dim=R)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel_err(qcat, want_q) <= tol
    # the latent row written as mla_store_latent writes it (from projections summed in another order), the rest kept
    assert rel_err(c["kv_flat"], ref_kv) <= tol
    keep = torch.arange(c["kv_flat"].shape[0]) != int(c["kv_slot"])
    assert torch.equal(c["kv_flat"][keep], ref_kv[keep])
    want, want_h = post_reference(c, H, P, V, Lr)
    out, res_out = L.mla_post_one_token(c["o_lat"], c["kv_b"], c["o_proj"], c["residual"], c["norm_weight"], 1e-6,
                                        sync, qk_nope_head_dim=P)
    assert rel_err(out, want) <= tol and rel_err(res_out, want_h) <= tol
    assert not sync.any()


def test_rejects_what_it_does_not_take() -> None:
    c = make_layer(2, 16, 8, 32, 16, 48, torch.float32, seed=1)
    sync = torch.zeros(L.MLA_LAYER_SYNC_WORDS, dtype=torch.int32)
    with pytest.raises(ValueError, match="one contiguous row"):
        L.mla_pre_one_token(c["x"].expand(2, -1), c["w_in"], c["kv_norm_weight"], 1e-6, c["kv_flat"], c["kv_slot"],
                            c["w_uk_t"], sync, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="w_in"):
        L.mla_pre_one_token(c["x"], c["w_in"][:10], c["kv_norm_weight"], 1e-6, c["kv_flat"], c["kv_slot"],
                            c["w_uk_t"], sync, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="kv_slot"):
        L.mla_pre_one_token(c["x"], c["w_in"], c["kv_norm_weight"], 1e-6, c["kv_flat"], c["kv_slot"].int(),
                            c["w_uk_t"], sync, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="o_proj"):
        L.mla_post_one_token(c["o_lat"], c["kv_b"], c["o_proj"][:, :8], c["residual"], c["norm_weight"], 1e-6, sync,
                             qk_nope_head_dim=16)
    with pytest.raises(ValueError, match="phased=True"):
        L.mla_post_one_token(c["o_lat"], c["kv_b"], c["o_proj"], c["residual"], c["norm_weight"], 1e-6, sync,
                             qk_nope_head_dim=16, phased=False)
    assert L.mla_layer_fits(1, False, False, 2304)
    assert not L.mla_layer_fits(1, True, False, 2304) and not L.mla_layer_fits(1, False, True, 2304)
    assert not L.mla_layer_fits(2, False, False, 2304)


def test_benchmark_smoke(tmp_path) -> None:
    """benchmarks/mla_layer.py --smoke: the phased form checked against the separate path and both timed."""
    result = run_benchmark_smoke("mla_layer.py", tmp_path / "mla_layer.json")
    layer = {r["name"]: r for r in result["layer"]}
    assert layer["phased (6 launches)"]["ok"] and "us" in layer["separate (9 launches)"], layer


def test_sm90_build_at_the_48b_shape() -> None:
    """Both grid forms build for sm_90 without spills, in registers that let PER_SM programs share an SM, each with
    its one wait an acquire."""
    res = run_sm90_build(r'''
import re
from k3rt.kernels.mla import triton_layer as L
C = "constexpr"
pre = dict(x_ptr="*bf16", w_in_ptr="*bf16", proj_ptr="*bf16", kvn_w_ptr="*bf16", kv_ptr="*bf16", kv_slot_ptr="*i64",
           w_uk_t_ptr="*bf16", qcat_ptr="*bf16", sync_ptr="*i32", kv_eps="fp32", G="i32", HID=C, H=C, P=C, R=C, L=C,
           BL=C, BR=C, PROD_FP32=C, ROWS=C, BLOCK_KX=C, BLOCK_KP=C, PHASE=C)
post = dict(o_lat_ptr="*bf16", kvb_ptr="*bf16", o_ptr="*bf16", wo_ptr="*bf16", res_ptr="*bf16", norm_w_ptr="*bf16",
            sync_ptr="*i32", out_ptr="*bf16", res_out_ptr="*bf16", eps="fp32", G="i32", HID=C, H=C, P=C, V=C, L=C,
            ROWS=C, BLOCK_KL=C, BLOCK_KO=C, BLOCK_HID=C, PHASE=C)
res = {}
for name, fn, sig, consts in (
        ("pre", L._mla_pre_kernel, pre, dict(HID=2304, H=32, P=128, R=64, L=512, BL=512, BR=64, PROD_FP32=False,
                                             ROWS=L.ROWS, BLOCK_KX=256, BLOCK_KP=128, PHASE=L.ALL_PHASES.value)),
        ("post", L._mla_post_kernel, post, dict(HID=2304, H=32, P=128, V=128, L=512, ROWS=L.ROWS, BLOCK_KL=256,
                                                BLOCK_KO=256, BLOCK_HID=4096, PHASE=L.ALL_PHASES.value))):
    k = sm90_kernel(fn, sig, consts, L.NUM_WARPS, 1, lambda n: False)
    usage = cuobjdump(k, "-res-usage")
    num = lambda key: int(re.search(key + r":(\d+)", usage).group(1))
    res[name] = {"regs": num("REG"), "spill": num("STACK") + num("LOCAL"),
                 "acquire": len(re.findall(r"ld\.global\.gpu\.acquire", k.asm["ptx"]))}
res.update(warps=L.NUM_WARPS, per_sm=L.PER_SM)
print(json.dumps(res))
''', timeout=300)
    for name in ("pre", "post"):
        r = res[name]
        assert r["spill"] == 0 and r["acquire"] == 1, res
        assert (-(-r["regs"] * 32 // 256) * 256) * res["warps"] * res["per_sm"] <= 65536, res


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_grid_form_48b_from_a_graph() -> None:
    H, P, R, Lr, V, HID = 32, 128, 64, 512, 128, 2304
    c = make_layer(H, P, R, Lr, V, HID, torch.bfloat16, seed=3, device="cuda")
    ref_kv = c["kv_flat"].clone()
    want_q = pre_reference(dict(c, kv_flat=ref_kv), H, P, R, Lr)
    want, want_h = post_reference(c, H, P, V, Lr)
    sync = torch.zeros(L.MLA_LAYER_SYNC_WORDS, dtype=torch.int32, device="cuda")
    pre = lambda **kw: L.mla_pre_one_token(c["x"], c["w_in"], c["kv_norm_weight"], 1e-6, c["kv_flat"],  # noqa: E731
                                           c["kv_slot"], c["w_uk_t"], sync, qk_rope_head_dim=R, **kw)
    post = lambda **kw: L.mla_post_one_token(c["o_lat"], c["kv_b"], c["o_proj"], c["residual"],  # noqa: E731
                                             c["norm_weight"], 1e-6, sync, qk_nope_head_dim=P, **kw)
    pre(), post()  # compiles
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qcat = pre()
        out, res_out = post()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert not sync.any()
    assert rel_err(qcat, want_q) <= 1e-2 and rel_err(c["kv_flat"], ref_kv) <= 1e-2
    assert rel_err(out, want) <= 1e-2 and rel_err(res_out, want_h) <= 1e-2
    assert torch.equal(pre(phased=True), qcat) and torch.equal(post(phased=True)[0], out)
