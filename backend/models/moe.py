"""Feed-forward blocks: dense gated MLP, Kimi MoE (sigmoid router + correction bias + grouped top-k)
and LatentMoE (routed experts in a smaller latent width; K3). Reference path: experts run as a loop
over the experts that received tokens.

Router (model-facts §6): s = sigmoid(x W_gate^T) in fp32; selection uses s + e_score_correction_bias,
weights use the un-biased s; optional renormalization; * routed_scaling_factor. The shared expert
is never scaled. LatentMoE order (§7.2): router on x, z = down(x), y = Σ w_i E_i(z) (w includes the
scaling), optional RMSNorm(y), up(y), + shared(x). Under TP each rank holds a slice of every
expert's intermediate dimension; the latent partial sums are reduced BEFORE the (nonlinear) norm.
"""

from __future__ import annotations

import torch
from torch import nn

from k3rt.backend.distributed import SINGLE, TPContext
from k3rt.backend.layers.activation import act_and_mul
from k3rt.backend.layers.batch_invariant import linear
from k3rt.backend.layers.linear import (
    ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, ShardSpec, set_shard_spec,
)
from k3rt.backend.layers.norm import rms_norm
from k3rt.model_config import ActivationConfig, ModelConfig, MoEConfig


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate|up merged into one column-parallel weight."""

    def __init__(self, hidden: int, intermediate: int, act: ActivationConfig, *, tp: TPContext = SINGLE,
                 dtype: torch.dtype | None = None, reduce: bool = True) -> None:
        super().__init__()
        self.act = act
        self.gate_up_proj = ColumnParallelLinear(hidden, (intermediate, intermediate), tp=tp, dtype=dtype, name="intermediate_size")
        self.down_proj = RowParallelLinear(intermediate, hidden, tp=tp, dtype=dtype, reduce=reduce, name="intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, m: MoEConfig,
          batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, hidden] -> (topk_weights [N, k] fp32 incl. scaling, topk_ids [N, k] int64).

    batch_invariant: take the router product in fixed row tiles (deterministic mode), so a token's
    scores, and with them its expert choice, do not depend on the other tokens of the step."""
    scores = torch.sigmoid(linear(x.float(), weight.float(), batch_invariant))  # [N, E]
    choice = scores + bias.float()
    if m.num_expert_group > 1:
        n, per = x.shape[0], m.num_experts // m.num_expert_group
        group_scores = choice.view(n, m.num_expert_group, per).topk(2, dim=-1).values.sum(-1)  # [N, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(m.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(m.num_experts_per_token, dim=-1).indices
    w = scores.gather(1, ids)
    if m.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * m.routed_scaling_factor, ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp: TPContext = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        assert cfg.moe is not None
        m, h = cfg.moe, cfg.hidden_size
        self.m, self.act, self.tp, self.eps = m, cfg.act, tp, cfg.rms_norm_eps
        width = m.latent_size or h  # the experts' input/output width
        inter = tp.shard(m.intermediate_size, "moe_intermediate_size")
        # router kept in fp32 (selection must not flip on bf16 rounding)
        self.gate_weight = set_shard_spec(nn.Parameter(torch.empty(m.num_experts, h), requires_grad=False), ShardSpec())
        self.e_score_correction_bias = set_shard_spec(nn.Parameter(torch.zeros(m.num_experts), requires_grad=False), ShardSpec())
        # experts stacked: w13 [E, 2*I_local, width] = [gate | up], w2 [E, width, I_local]
        self.w13 = set_shard_spec(nn.Parameter(torch.empty(m.num_experts, 2 * inter, width, dtype=dtype), requires_grad=False),
                                  ShardSpec(1, (m.intermediate_size, m.intermediate_size)))
        self.w2 = set_shard_spec(nn.Parameter(torch.empty(m.num_experts, width, inter, dtype=dtype), requires_grad=False),
                                 ShardSpec(2))
        self.w13.expert_stack = self.w2.expert_stack = True  # type: ignore[attr-defined]  (loader: dim 0 = expert)
        self.shared_experts = (
            GatedMLP(h, m.shared_intermediate_size, cfg.act, tp=tp, dtype=dtype, reduce=False)
            if m.num_shared_experts else None
        )
        if m.latent_size is not None:
            self.routed_expert_down_proj = ReplicatedLinear(h, m.latent_size, dtype=dtype)
            self.routed_expert_up_proj = ReplicatedLinear(m.latent_size, h, dtype=dtype)
            if m.latent_norm:
                self.routed_expert_norm = set_shard_spec(
                    nn.Parameter(torch.ones(m.latent_size, dtype=dtype), requires_grad=False), ShardSpec())
        # deterministic mode (set by KimiForCausalLM.set_batch_invariant): router and expert products in
        # fixed row tiles — an expert's row count is how many tokens of the whole step picked it
        self.batch_invariant = False

    def experts(self, z: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_k w[:, k] * Expert_{ids[:, k]}(z) — this rank's partial sum when TP > 1."""
        out = torch.zeros(z.shape[0], self.w2.shape[1], dtype=torch.float32, device=z.device)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            bi = self.batch_invariant
            y = linear(act_and_mul(linear(z[tok], self.w13[e], bi), self.act), self.w2[e], bi)
            out.index_add_(0, tok, y.float() * w[tok, slot, None])
        return out.to(z.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = route(x, self.gate_weight, self.e_score_correction_bias, self.m, self.batch_invariant)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.m.latent_size is None:
            y = self.experts(x, w, ids)
            if shared is not None:
                y = y + shared
            return self.tp.all_reduce(y)  # one reduction for routed + shared partial sums
        y = self.tp.all_reduce(self.experts(self.routed_expert_down_proj(x), w, ids))
        if self.m.latent_norm:
            y = rms_norm(y, self.routed_expert_norm, self.eps)
        y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + self.tp.all_reduce(shared)
        return y
