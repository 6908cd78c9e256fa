"""Each Kimi / K3 model part against an independent formula written here (fp64 loops over tokens,
heads and experts), using only the module's weights, never the k3rt function under test.

Covers: the KDA layer with the low-rank and the full-rank (K3) output gate and with the softplus
and the lower-bound (K3) forget gate; MLA with q-LoRA off/on and the K3 elementwise output gate;
MLA expanded vs absorbed forms; the MoE router (correction bias selects only, grouped top-k,
renormalize, scaling); MoE and LatentMoE with and without the latent norm; SiTU; and attention
residuals over a whole 4-layer model with its own residual bookkeeping.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3rt.backend.layers.activation import act_and_mul
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kda import KimiDeltaAttention
from k3rt.backend.models.loader import build_model
from k3rt.backend.models.mla import MultiHeadLatentAttention, mla_absorbed, mla_expanded
from k3rt.backend.models.moe import MoE, route
from k3rt.backend.models.tiny import TINY_CONFIGS, random_init
from k3rt.model_config import ActivationConfig, ModelConfig, MoEConfig, parse_model_config
from tests.backend.threads import single_thread  # noqa: F401  (autouse fixture)

TOL = 1e-5


def config(arch: str, lac: dict | None = None, **overrides) -> ModelConfig:
    raw = {**TINY_CONFIGS[arch], **overrides}
    if lac:
        raw["linear_attn_config"] = {**raw["linear_attn_config"], **lac}
    return parse_model_config(raw)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * d(w)


def silu_ref(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def act_mul_ref(gate: torch.Tensor, up: torch.Tensor, act: ActivationConfig) -> torch.Tensor:
    if act.name == "silu":
        return silu_ref(gate) * up
    b, lb = act.situ_beta, act.situ_linear_beta
    g = b * torch.tanh(gate / b) * torch.sigmoid(gate)
    return g * (up if lb is None else lb * torch.tanh(up / lb))


# ------------------------------------------------------------------------------------------------
# KDA layer
# ------------------------------------------------------------------------------------------------


def kda_reference(layer: KimiDeltaAttention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The whole KDA layer as literal per-token, per-head fp64 loops (model-facts §1–§2)."""
    kc = cfg.kda
    T, H, D, P = x.shape[0], kc.num_heads, kc.head_dim, kc.proj_dim
    x = d(x)
    qkv = torch.cat([x @ d(layer.q_proj.weight).T, x @ d(layer.k_proj.weight).T, x @ d(layer.v_proj.weight).T], -1)
    w = d(layer.conv_weight)  # [3P, W]: column W-1 multiplies the current token
    W = w.shape[1]
    conv = torch.zeros_like(qkv)
    for t in range(T):
        for i in range(W):
            src = t - (W - 1) + i
            if src >= 0:
                conv[t] += w[:, i] * qkv[src]
    conv = silu_ref(conv)
    q, k, v = conv[:, :P].view(T, H, D), conv[:, P:2 * P].view(T, H, D), conv[:, 2 * P:].view(T, H, D)

    f = ((x @ d(layer.f_a_proj.weight).T) @ d(layer.f_b_proj.weight).T).view(T, H, D)
    A = d(layer.A_log).exp()  # one decay rate per head
    dt = d(layer.dt_bias).view(H, D)
    beta = torch.sigmoid(x @ d(layer.b_proj.weight).T)  # [T, H]
    if kc.use_full_rank_gate:
        gate = x @ d(layer.g_proj.weight).T
    else:
        gate = (x @ d(layer.g_a_proj.weight).T) @ d(layer.g_b_proj.weight).T
    gate = gate.view(T, H, D)

    o = torch.zeros(T, H, D, dtype=torch.float64)
    for h in range(H):
        S = torch.zeros(D, D, dtype=torch.float64)  # keys x values
        for t in range(T):
            z = f[t, h] + dt[h]
            if kc.gate_lower_bound is None:
                g = -A[h] * torch.log1p(torch.exp(z))
            else:
                g = kc.gate_lower_bound * torch.sigmoid(A[h] * z)
            qt = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + 1e-6) * D**-0.5
            kt = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + 1e-6)
            S = torch.exp(g)[:, None] * S
            S = S + beta[t, h] * torch.outer(kt, v[t, h] - S.T @ kt)
            o[t, h] = S.T @ qt
    y = rms(o, layer.o_norm_weight, cfg.rms_norm_eps) * torch.sigmoid(gate)
    return y.reshape(T, H * D) @ d(layer.o_proj.weight).T


KDA_VARIANTS = {
    "softplus_lowrank": {},
    "softplus_fullrank": {"use_full_rank_gate": True},
    "lb5_lowrank": {"gate_lower_bound": -5.0},
    "lb5_fullrank": {"gate_lower_bound": -5.0, "use_full_rank_gate": True},
    "lb1_fullrank": {"gate_lower_bound": -1.0, "use_full_rank_gate": True},
}


@pytest.mark.parametrize("T", [1, 70], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("variant", list(KDA_VARIANTS))
def test_kda_layer_matches_reference(variant: str, T: int) -> None:
    cfg = config("kimi_linear", lac=KDA_VARIANTS[variant])
    layer = KimiDeltaAttention(cfg, 0, dtype=torch.float32)
    random_init(layer, seed=4)
    names = {n for n, _ in layer.named_parameters()}
    if cfg.kda.use_full_rank_gate:
        assert "g_proj.weight" in names and not names & {"g_a_proj.weight", "g_b_proj.weight"}
        assert layer.g_proj.weight.shape == (cfg.kda.proj_dim, cfg.hidden_size)
    else:
        assert {"g_a_proj.weight", "g_b_proj.weight"} <= names and "g_proj.weight" not in names
    # the forget gate stays low rank in both variants
    assert layer.f_a_proj.weight.shape == (cfg.kda.head_dim, cfg.hidden_size)
    x = torch.randn(T, cfg.hidden_size, generator=gen(T))
    with torch.no_grad():
        out = layer(x, ForwardBatch([T]))
    ref = kda_reference(layer, x, cfg)
    assert out.abs().max().item() > 1e-2
    assert (out.double() - ref).abs().max().item() <= TOL


def test_kda_gate_kinds_differ() -> None:
    """The softplus and the lower-bound gates really are different functions on the same weights."""
    outs = []
    for lac in ({}, {"gate_lower_bound": -5.0}):
        cfg = config("kimi_linear", lac=lac)
        layer = KimiDeltaAttention(cfg, 0, dtype=torch.float32)
        random_init(layer, seed=4)
        outs.append(layer(torch.randn(20, cfg.hidden_size, generator=gen(1)), ForwardBatch([20])))
    assert (outs[0] - outs[1]).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------------
# MLA
# ------------------------------------------------------------------------------------------------


def mla_reference(layer: MultiHeadLatentAttention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    m = cfg.mla
    T, H, P, R, V, L = x.shape[0], m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    x = d(x)
    if m.q_lora_rank is None:
        q = x @ d(layer.q_proj.weight).T
    else:
        q = rms(x @ d(layer.q_a_proj.weight).T, layer.q_a_layernorm.weight, 1e-6) @ d(layer.q_b_proj.weight).T
    q = q.view(T, H, P + R)
    ckv = x @ d(layer.kv_a_proj_with_mqa.weight).T
    c, k_pe = rms(ckv[:, :L], layer.kv_a_layernorm.weight, 1e-6), ckv[:, L:]
    kv = (c @ d(layer.kv_b_proj.weight).T).view(T, H, P + V)
    o = torch.zeros(T, H, V, dtype=torch.float64)
    for h in range(H):
        for t in range(T):
            s = torch.stack([q[t, h, :P] @ kv[j, h, :P] + q[t, h, P:] @ k_pe[j] for j in range(t + 1)])
            s = s * (P + R) ** -0.5
            p = torch.exp(s - s.max())
            p = p / p.sum()
            o[t, h] = sum(p[j] * kv[j, h, P:] for j in range(t + 1))
    o = o.reshape(T, H * V)
    if m.use_output_gate:
        o = o * torch.sigmoid(x @ d(layer.g_proj.weight).T)  # elementwise over all H*V channels
    return o @ d(layer.o_proj.weight).T


MLA_VARIANTS = {
    "qlora_off": ("kimi_linear", {}),
    "qlora_on": ("kimi_linear", {"q_lora_rank": 48}),
    "qlora_on_output_gate": ("k3", {}),
    "qlora_off_output_gate": ("kimi_linear", {"mla_use_output_gate": True}),
}


@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
def test_mla_layer_matches_reference(variant: str) -> None:
    arch, overrides = MLA_VARIANTS[variant]
    cfg = config(arch, **overrides)
    layer = MultiHeadLatentAttention(cfg, 3, dtype=torch.float32)
    random_init(layer, seed=5)
    if cfg.mla.use_output_gate:
        layer.g_proj.weight.data.normal_(0, 0.3, generator=gen(6))  # gate values spread over (0, 1)
    x = torch.randn(12, cfg.hidden_size, generator=gen(7))
    with torch.no_grad():
        out = layer(x, ForwardBatch([12]))
    ref = mla_reference(layer, x, cfg)
    assert out.abs().max().item() > 1e-2
    assert (out.double() - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("T, start", [(1, 0), (1, 9), (6, 0), (6, 9)], ids=["T1-s0", "T1-s9", "T6-s0", "T6-s9"])
def test_mla_expanded_and_absorbed_agree(T: int, start: int) -> None:
    H, P, R, V, L = 4, 16, 8, 16, 32
    g = gen(T * 31 + start)
    q = torch.randn(T, H, P + R, generator=g)
    latent = torch.randn(start + T, L + R, generator=g)
    kv_b = torch.randn(H * (P + V), L, generator=g) * L**-0.5
    scale = (P + R) ** -0.5
    a = mla_expanded(q, latent, kv_b, start, P, R, V, scale)
    b = mla_absorbed(q, latent, kv_b, start, P, R, V, scale)
    assert a.shape == b.shape == (T, H, V)
    assert (a - b).abs().max().item() <= TOL
    # and both are causal attention at absolute positions start..start+T-1
    kv = (latent[:, :L].double() @ kv_b.double().T).view(start + T, H, P + V)
    for t in range(T):
        n = start + t + 1
        s = (torch.einsum("hp,shp->hs", q[t, :, :P].double(), kv[:n, :, :P])
             + torch.einsum("hr,sr->hs", q[t, :, P:].double(), latent[:n, L:].double())) * scale
        ref = torch.einsum("hs,shv->hv", torch.softmax(s, -1), kv[:n, :, P:])
        assert (a[t].double() - ref).abs().max().item() <= TOL


# ------------------------------------------------------------------------------------------------
# MoE router
# ------------------------------------------------------------------------------------------------


def moe_cfg(E: int = 8, k: int = 2, groups: int = 1, topk_group: int = 1, renorm: bool = False,
            scale: float = 1.0) -> MoEConfig:
    return MoEConfig(num_experts=E, num_experts_per_token=k, intermediate_size=4, num_shared_experts=0,
                     routed_scaling_factor=scale, renormalize=renorm, num_expert_group=groups, topk_group=topk_group)


def route_logits(logits: list[float], bias: list[float], m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Route one token whose router logits are exactly `logits` (x = e_0, W[:, 0] = logits)."""
    E = len(logits)
    x = torch.zeros(1, 3)
    x[0, 0] = 1.0
    w = torch.zeros(E, 3)
    w[:, 0] = torch.tensor(logits)
    return route(x, w, torch.tensor(bias), m)


def test_router_correction_bias_selects_but_does_not_weight() -> None:
    logits = [2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]
    w, ids = route_logits(logits, [0.0] * 7 + [10.0], moe_cfg())
    assert ids[0].tolist() == [7, 0]
    s = torch.sigmoid(torch.tensor(logits))
    assert torch.allclose(w[0], torch.stack([s[7], s[0]]), atol=1e-7, rtol=0)
    # without the bias, plain top-2 of the scores
    w0, ids0 = route_logits(logits, [0.0] * 8, moe_cfg())
    assert ids0[0].tolist() == [0, 1]
    assert torch.allclose(w0[0], torch.stack([s[0], s[1]]), atol=1e-7, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 2.446], ids=["scale1", "scale2.446"])
def test_router_renormalize_then_scale(scale: float) -> None:
    logits = [0.5, -1.0, 1.5, 0.0, -2.0, 0.3, 0.2, -0.1]
    w, ids = route_logits(logits, [0.0] * 8, moe_cfg(k=3, renorm=True, scale=scale))
    s = torch.sigmoid(torch.tensor(logits))
    assert ids[0].tolist() == [2, 0, 5]
    want = s[[2, 0, 5]] / s[[2, 0, 5]].sum() * scale
    assert torch.allclose(w[0], want, atol=1e-6, rtol=0)
    assert abs(w[0].sum().item() - scale) <= 1e-6
    # without renormalization only the scaling applies
    w2, _ = route_logits(logits, [0.0] * 8, moe_cfg(k=3, renorm=False, scale=scale))
    assert torch.allclose(w2[0], s[[2, 0, 5]] * scale, atol=1e-6, rtol=0)


def test_router_grouped_topk_restricts_to_best_groups() -> None:
    # 4 groups of 2 experts; sigmoid scores ~ [.982 .018 | .269 .250 | .881 .870 | .891 .002].
    # Group scores (sum of the top-2 in each group): g0 1.000, g1 0.519, g2 1.751, g3 0.893.
    logits = [4.0, -4.0, -1.0, -1.1, 2.0, 1.9, 2.1, -6.0]
    _, ids = route_logits(logits, [0.0] * 8, moe_cfg(groups=1))
    assert ids[0].tolist() == [0, 6]  # plain top-2
    _, ids = route_logits(logits, [0.0] * 8, moe_cfg(groups=4, topk_group=1))
    assert ids[0].tolist() == [4, 5]  # only group 2 survives, although expert 0 scores best
    _, ids = route_logits(logits, [0.0] * 8, moe_cfg(groups=4, topk_group=2))
    assert ids[0].tolist() == [0, 4]  # groups 2 and 0 survive; expert 6 (group 3) is excluded
    # group scores use the biased scores: +1 on group 1 makes it the best group
    w, ids = route_logits(logits, [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], moe_cfg(groups=4, topk_group=1))
    assert ids[0].tolist() == [2, 3]
    assert torch.allclose(w[0], torch.sigmoid(torch.tensor([-1.0, -1.1])), atol=1e-7, rtol=0)


# ------------------------------------------------------------------------------------------------
# MoE / LatentMoE blocks
# ------------------------------------------------------------------------------------------------


def moe_reference(moe: MoE, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Literal per-token loop over the selected experts (model-facts §6, k3 facts §5)."""
    m, act = cfg.moe, cfg.act
    E, k, G, I = m.num_experts, m.num_experts_per_token, m.num_expert_group, m.intermediate_size
    per = E // G
    Wg, bias = d(moe.gate_weight), d(moe.e_score_correction_bias)
    out = torch.zeros(x.shape[0], cfg.hidden_size, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = d(x[t])
        s = [torch.sigmoid(Wg[e] @ xt).item() for e in range(E)]
        sel = [s[e] + bias[e].item() for e in range(E)]
        groups = sorted(range(G), key=lambda g: -sum(sorted(sel[g * per:(g + 1) * per], reverse=True)[:2]))
        keep = set(groups[:m.topk_group])
        cand = [e for e in range(E) if e // per in keep]
        picked = sorted(cand, key=lambda e: -sel[e])[:k]
        weights = [s[e] for e in picked]
        if m.renormalize:
            total = sum(weights)
            weights = [w / (total + 1e-20) for w in weights]
        weights = [w * m.routed_scaling_factor for w in weights]

        z = xt @ d(moe.routed_expert_down_proj.weight).T if m.latent_size else xt
        y = torch.zeros_like(z)
        for e, w in zip(picked, weights):
            w13, w2 = d(moe.w13[e]), d(moe.w2[e])
            y = y + w * (w2 @ act_mul_ref(w13[:I] @ z, w13[I:] @ z, act))
        if m.latent_size:
            if m.latent_norm:
                y = rms(y, moe.routed_expert_norm, cfg.rms_norm_eps)
            y = y @ d(moe.routed_expert_up_proj.weight).T
        if m.num_shared_experts:
            gu = d(moe.shared_experts.gate_up_proj.weight)
            si = m.shared_intermediate_size
            y = y + d(moe.shared_experts.down_proj.weight) @ act_mul_ref(gu[:si] @ xt, gu[si:] @ xt, act)
        out[t] = y
    return out


MOE_VARIANTS = {
    "moe_silu": ("kimi_linear", {}),
    "moe_grouped_topk": ("kimi_linear", {"num_expert_group": 4, "topk_group": 2, "num_experts_per_token": 3}),
    "moe_no_shared_no_renorm": ("kimi_linear", {"num_shared_experts": 0, "moe_renormalize": False}),
    "latent_situ_norm": ("k3", {"routed_scaling_factor": 2.5}),
    "latent_situ_no_norm": ("k3", {"routed_scaling_factor": 2.5, "latent_moe_use_norm": False}),
    "latent_situ_norm_2shared": ("k3", {"num_shared_experts": 2, "activation_situ_linear_beta": None}),
}


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_block_matches_per_token_loop(variant: str) -> None:
    arch, overrides = MOE_VARIANTS[variant]
    cfg = config(arch, **overrides)
    moe = MoE(cfg, dtype=torch.float32)
    random_init(moe, seed=8)
    g = gen(9)
    moe.gate_weight.data.normal_(0, 0.3, generator=g)  # spread the router scores
    moe.e_score_correction_bias.data.normal_(0, 0.3, generator=g)  # and let the bias change selection
    moe.w13.data.normal_(0, 0.3, generator=g)  # expert outputs of order 1 (the latent norm's eps is small)
    moe.w2.data.normal_(0, 0.3, generator=g)
    x = torch.randn(16, cfg.hidden_size, generator=g)
    with torch.no_grad():
        out = moe(x)
    ref = moe_reference(moe, x, cfg)
    assert out.abs().max().item() > 1e-2
    assert (out.double() - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


def test_latent_norm_cancels_routed_scaling() -> None:
    """Scaling is applied before the latent RMSNorm, so with the norm it cancels (up to eps)."""
    outs = {}
    for scale in (1.0, 3.0):
        for norm in (True, False):
            cfg = config("k3", routed_scaling_factor=scale, latent_moe_use_norm=norm, num_shared_experts=0)
            moe = MoE(cfg, dtype=torch.float32)
            random_init(moe, seed=10)
            moe.w13.data.normal_(0, 0.5, generator=gen(11))  # latent output far above the norm's eps
            moe.w2.data.normal_(0, 1.0, generator=gen(11))
            outs[scale, norm] = moe(torch.randn(8, cfg.hidden_size, generator=gen(12)) * 3)
    assert (outs[3.0, True] - outs[1.0, True]).abs().max().item() <= 1e-4
    assert (outs[3.0, False] - 3.0 * outs[1.0, False]).abs().max().item() <= TOL
    assert (outs[3.0, False] - outs[1.0, False]).abs().max().item() > 1e-3


# ------------------------------------------------------------------------------------------------
# SiTU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "beta, lin_beta", [(4.0, 25.0), (4.0, None), (1.0, 2.0)], ids=["b4-lin25", "b4-lin_none", "b1-lin2"])
def test_situ_and_mul_matches_formula(beta: float, lin_beta: float | None) -> None:
    g = gen(13)
    gate, up = torch.randn(64, 24, generator=g) * 30, torch.randn(64, 24, generator=g) * 30
    out = act_and_mul(torch.cat([gate, up], -1), ActivationConfig("situ", beta, lin_beta))
    gd, ud = gate.double(), up.double()
    a = beta * torch.tanh(gd / beta) / (1 + torch.exp(-gd))
    u = ud if lin_beta is None else lin_beta * torch.tanh(ud / lin_beta)
    ref = a * u
    assert ((out.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item() <= 1e-5
    # the gate branch saturates at beta, unlike SiLU
    assert out.double().div(u).max().item() <= beta + 1e-4
    silu = act_and_mul(torch.cat([gate, up], -1), ActivationConfig("silu"))
    assert (silu - out).abs().max().item() > 1.0


# ------------------------------------------------------------------------------------------------
# attention residuals
# ------------------------------------------------------------------------------------------------


def attn_res_logits(model, ids: torch.Tensor, block: int) -> torch.Tensor:
    """The K3 forward with residual bookkeeping written from the K3 pseudo-code (k3 facts §3); the
    attention and MLP sub-modules are used as black boxes, everything else is recomputed here."""
    cfg, eps, layers = model.cfg, model.cfg.rms_norm_eps, model.model.layers
    batch = ForwardBatch([ids.shape[0]])

    def mix(blocks: list[torch.Tensor], prefix: torch.Tensor, norm, proj) -> torch.Tensor:
        srcs = [d(b) for b in blocks] + [d(prefix)]
        wv = d(norm.weight) * d(proj.weight)[0]
        logits = torch.stack([(s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * wv).sum(-1) for s in srcs])
        p = torch.softmax(logits, dim=0)  # over the depth axis, per token
        return sum(p[j][:, None] * srcs[j] for j in range(len(srcs))).float()

    def norm(x: torch.Tensor, w) -> torch.Tensor:
        return rms(d(x), w.weight, eps).float()

    prefix = model.model.embed_tokens.weight[ids]
    blocks: list[torch.Tensor] = []
    for i, layer in enumerate(layers):
        if blocks:
            a_in = mix(blocks, prefix, layer.self_attention_res_norm, layer.self_attention_res_proj)
        else:
            a_in = prefix  # one source: the mix is the prefix itself
        if i % block == 0:
            blocks.append(prefix)
            prefix = None
        h = layer.self_attn(norm(a_in, layer.input_layernorm), batch)
        prefix = h if prefix is None else prefix + h
        m_in = mix(blocks, prefix, layer.mlp_res_norm, layer.mlp_res_proj)
        prefix = prefix + layer.mlp(norm(m_in, layer.post_attention_layernorm))
    assert len(blocks) == math.ceil(cfg.num_hidden_layers / block)
    out = mix(blocks, prefix, model.model.output_attn_res_norm, model.model.output_attn_res_proj)
    return norm(out, model.model.norm).double() @ d(model.lm_head.weight).T


@pytest.mark.parametrize("block", [1, 2, 3, 4], ids=lambda b: f"block{b}")
def test_attention_residuals_match_k3_pseudocode(block: int) -> None:
    cfg = config("k3", attn_res_block_size=block)
    assert cfg.num_hidden_layers == 4
    model = build_model(cfg, dtype=torch.float32)
    random_init(model, seed=14)
    g = gen(15)
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight"):
            p.data.normal_(0, 0.5, generator=g)  # depth-mix logits of order 1: clearly non-uniform mixes
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    with torch.no_grad():
        out = model(ids, ForwardBatch([40]))
        ref = attn_res_logits(model, ids, block)
    assert (out.double() - ref).abs().max().item() <= TOL


def test_attention_residuals_change_the_output() -> None:
    """Non-vacuity of the test above: the same weights with the plain residual give other logits."""
    res = build_model(config("k3", attn_res_block_size=2), dtype=torch.float32)
    random_init(res, seed=14)
    plain = build_model(config("k3", attn_res_block_size=None), dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(res.state_dict(), strict=False)
    assert not missing and all("_res_" in k for k in unexpected) and unexpected
    ids = torch.randint(0, 512, (20,), generator=gen(16))
    assert (res(ids, ForwardBatch([20])) - plain(ids, ForwardBatch([20]))).abs().max().item() > 1e-3
