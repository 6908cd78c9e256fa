"""The MoE oracles (kernels/moe/ref.py) agree with the model's torch path (backend/models/moe.py:
`route`, `MoE.experts`, `act_and_mul`) and with naive per-token loops. CPU only, no Triton."""
from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from k3rt.backend.layers.activation import act_and_mul
from k3rt.backend.models.moe import MoE, route
from k3rt.backend.models.tiny import TINY_CONFIGS
from k3rt.kernels.moe.ref import act_and_mul_ref, align_ref, fused_experts_ref, route_ref
from k3rt.model_config import ActivationConfig, ModelConfig, parse_model_config

ACTS = {
    "silu": ActivationConfig("silu"),
    "situ_lin": ActivationConfig("situ", 4.0, 25.0),
    "situ": ActivationConfig("situ", 1.5, None),
}


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def config(arch: str, **overrides) -> ModelConfig:
    return parse_model_config({**TINY_CONFIGS[arch], **overrides})


def moe_module(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg, dtype=dtype)
    for p in (moe.gate_weight, moe.e_score_correction_bias, moe.w13, moe.w2):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def naive_route(logits: Tensor, bias: Tensor, k: int, groups: int, topk_group: int, renorm: bool,
                scaling: float) -> tuple[list[list[int]], list[list[float]]]:
    """Per token, in Python: sorted lists instead of topk."""
    all_ids, all_w = [], []
    E = logits.shape[1]
    per = E // groups
    for row in logits.double().tolist():
        s = [1 / (1 + math.exp(-v)) for v in row]
        sel = [s[e] + float(bias[e]) for e in range(E)]
        gscore = [sum(sorted(sel[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -gscore[g])[:topk_group] if groups > 1 else [0]
        cand = [e for e in range(E) if e // per in kept]
        ids = sorted(cand, key=lambda e: -sel[e])[:k]
        w = [s[e] for e in ids]
        if renorm:
            tot = sum(w)
            w = [v / (tot + 1e-20) for v in w]
        all_ids.append(ids)
        all_w.append([v * scaling for v in w])
    return all_ids, all_w


ROUTES = {
    "plain_renorm": dict(E=8, top_k=2, num_expert_group=1, topk_group=1, renormalize=True, scaling=2.446),
    "grouped_2of4": dict(E=16, top_k=3, num_expert_group=4, topk_group=2, renormalize=True, scaling=1.0),
    "grouped_1of2_norenorm": dict(E=8, top_k=2, num_expert_group=2, topk_group=1, renormalize=False, scaling=2.5),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_route_ref_matches_model_route_and_naive_loop(case: str) -> None:
    c = ROUTES[case]
    cfg = config("kimi_linear", num_experts=c["E"], num_experts_per_token=c["top_k"],
                 num_expert_group=c["num_expert_group"], topk_group=c["topk_group"],
                 moe_renormalize=c["renormalize"], routed_scaling_factor=c["scaling"])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, cfg.hidden_size, generator=g)
    W = torch.randn(c["E"], cfg.hidden_size, generator=g) * 0.3
    bias = torch.randn(c["E"], generator=g) * 0.5
    w_model, ids_model = route(x, W, bias, cfg.moe)
    kw = {k: v for k, v in c.items() if k != "E"}
    w, ids = route_ref(x @ W.t(), bias, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ids_model)
    assert rel_err(w, w_model) <= 1e-6
    n_ids, n_w = naive_route(x @ W.t(), bias, c["top_k"], c["num_expert_group"], c["topk_group"],
                             c["renormalize"], c["scaling"])
    assert ids.tolist() == n_ids
    assert rel_err(w, torch.tensor(n_w)) <= 1e-6


def test_route_ref_bias_selects_but_does_not_weight() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = route_ref(logits, bias, top_k=2, num_expert_group=1, topk_group=1, renormalize=False, scaling=1.0)
    assert ids.tolist() == [[3, 0]]
    assert torch.allclose(w, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


@pytest.mark.parametrize("act", list(ACTS))
def test_act_and_mul_ref_matches_model(act: str) -> None:
    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(32, 24, generator=g) * 8, torch.randn(32, 24, generator=g) * 40
    ref = act_and_mul(torch.cat([gate, up], -1), ACTS[act])
    assert rel_err(act_and_mul_ref(gate, up, ACTS[act]), ref) <= 1e-6


def test_act_and_mul_ref_rejects_situ_without_beta() -> None:
    with pytest.raises(ValueError, match="situ"):
        act_and_mul_ref(torch.ones(2), torch.ones(2), ActivationConfig("situ"))


@pytest.mark.parametrize("arch,act", [("kimi_linear", "silu"), ("k3", "situ_lin"), ("k3", "situ")])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_fused_experts_ref_matches_model_experts(arch: str, act: str, dtype: torch.dtype, tol: float) -> None:
    a = ACTS[act]
    cfg = config(arch, hidden_act=a.name, activation_situ_beta=a.situ_beta,
                 activation_situ_linear_beta=a.situ_linear_beta)
    assert cfg.act == a
    moe = moe_module(cfg, seed=5, dtype=dtype)
    g = torch.Generator().manual_seed(6)
    width = cfg.moe.latent_size or cfg.hidden_size
    x = torch.randn(19, cfg.hidden_size, generator=g)
    w, ids = route(x, moe.gate_weight, moe.e_score_correction_bias, cfg.moe)
    z = torch.randn(19, width, generator=g).to(dtype)  # the experts' input (latent for K3)
    with torch.no_grad():
        ref_model = moe.experts(z, w, ids)
    out = fused_experts_ref(z, moe.w13.data, moe.w2.data, w, ids.int(), act=moe.act)
    assert out.dtype == dtype and out.shape == ref_model.shape
    assert rel_err(out, ref_model) <= tol


@pytest.mark.parametrize("act", list(ACTS))
def test_fused_experts_ref_matches_per_token_loop(act: str) -> None:
    g = torch.Generator().manual_seed(7)
    T, E, k, D, inter = 9, 6, 3, 20, 12
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * inter, D, generator=g) * 0.4
    w2 = torch.randn(E, D, inter, generator=g) * 0.4
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=g)
    out = fused_experts_ref(x, w13, w2, w, ids, act=ACTS[act])
    loop = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double()
            h = act_and_mul(gu[None], ACTS[act])[0]
            loop[t] += float(w[t, j]) * (w2[e].double() @ h)
    assert rel_err(out, loop) <= 1e-5


def test_align_ref_layout() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)  # pairs 0..5; expert 1 gets none
    sorted_ids, block_expert = align_ref(ids, num_experts=4, block_m=2)
    S = 6  # sentinel = T * k
    assert sorted_ids == [1, 4, 0, 2, 5, S, 3, S]
    assert block_expert == [0, 2, 2, 3]
