"""Feed-forward blocks: dense gated MLP, Kimi MoE (sigmoid router + correction bias + grouped top-k)
and LatentMoE (routed experts in a smaller latent width; K3). Reference path: experts run as a loop
over the experts that received tokens.

Router (model-facts §6): s = sigmoid(x W_gate^T) in fp32; selection uses s + e_score_correction_bias,
weights use the un-biased s; optional renormalization; * routed_scaling_factor. The shared expert
is never scaled. LatentMoE order (§7.2): router on x, z = down(x), y = Σ w_i E_i(z) (w includes the
scaling), optional RMSNorm(y), up(y), + shared(x). Under TP each rank holds a slice of every
expert's intermediate dimension; the latent partial sums are reduced BEFORE the (nonlinear) norm.
With expert parallelism of degree ep (`model_config.ep_degree`) the ranks form ep groups of tp/ep: group g
holds experts [g E/ep, (g+1) E/ep), and within it each expert's width is split over the group's ranks (ep =
tp: every rank whole experts; ep = 1: the width split above). Every rank has every token (attention is
tensor-parallel, so hidden states are replicated), so dispatch is picking the tokens routed to this rank's
experts and combine is the same all-reduce of partial sums over all tp ranks. The shared expert stays split
by width over all tp ranks.
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
from k3rt.kernels.moe.mxfp4_planar_layout import from_planar
from k3rt.kernels.moe.mxfp4_ref import GROUP as MXFP4_GROUP, dequantize_mxfp4
from k3rt.model_config import ActivationConfig, ModelConfig, MoEConfig, ep_degree


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


def latent_tail(tp: TPContext, y_lat: torch.Tensor, shared: torch.Tensor | None, w_up: torch.Tensor,
                linear) -> torch.Tensor:
    """LatentMoE's output: up(y_lat) + the reduced shared-expert partial, by `tp.latent_tail`.
    All-reduce tail: w_up is the full [hidden, latent] on every rank, the shared partial all-reduced.
    Reduce-scatter tail (TP > 1; model-facts §7.2, DESIGN §9): w_up is this rank's rows, so it computes its
    slice of the output columns and adds its slice of the reduce-scattered shared partial; one all-gather
    joins the slices. The same sums either way. `linear(x, w)`: F.linear or the GPU runner's."""
    if tp.size == 1 or tp.latent_tail == "all_reduce":
        y = linear(y_lat, w_up)
        return y if shared is None else y + tp.all_reduce(shared)
    y = linear(y_lat, w_up)  # [M, hidden / tp]
    if shared is not None:
        y = y + tp.reduce_scatter_last_dim(shared)
    return tp.all_gather_last_dim(y)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp: TPContext = SINGLE, ep: int | bool = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        assert cfg.moe is not None
        m, h = cfg.moe, cfg.hidden_size
        self.m, self.act, self.tp, self.eps = m, cfg.act, tp, cfg.rms_norm_eps
        width = m.latent_size or h  # the experts' input/output width
        ep = ep_degree(ep, tp.size)
        # this rank's experts: [expert_offset, expert_offset + num_local_experts), each a 1/(tp/ep) slice of its
        # width: the slice expert_tp.rank of expert_tp.size (the loader shards the stacks' split dims over it)
        per_group = tp.size // ep
        if m.num_experts % ep:
            raise ValueError(f"num_experts={m.num_experts} is not divisible by expert-parallel size {ep}")
        self.num_local_experts = m.num_experts // ep
        self.expert_offset = (tp.rank // per_group) * self.num_local_experts
        self.expert_tp = TPContext(rank=tp.rank % per_group, size=per_group)
        inter = self.expert_tp.shard(m.intermediate_size, "moe_intermediate_size")
        E = self.num_local_experts
        # router kept in fp32 (selection must not flip on bf16 rounding)
        self.gate_weight = set_shard_spec(nn.Parameter(torch.empty(m.num_experts, h), requires_grad=False), ShardSpec())
        self.e_score_correction_bias = set_shard_spec(nn.Parameter(torch.zeros(m.num_experts), requires_grad=False), ShardSpec())
        # experts stacked: w13 [E, 2*I_local, width] = [gate | up], w2 [E, width, I_local]
        self.mxfp4 = m.expert_format == "mxfp4"
        if self.mxfp4:
            # packed E2M1 bytes [.., K/2] and E8M0 scales [.., K/32] per weight (kernels/moe/mxfp4_ref.py);
            # TP splits I: rows of w13, the packed K of w2, so I_local must stay a multiple of the group
            if inter % MXFP4_GROUP:
                raise ValueError(f"moe_intermediate_size={m.intermediate_size} over {per_group} ranks per expert "
                                 f"(tensor-parallel size {tp.size}, expert-parallel size {ep}) gives {inter} per rank, "
                                 f"not a multiple of {MXFP4_GROUP} (the MXFP4 group)")
            I = m.intermediate_size
            u8 = torch.uint8
            self.w13_packed = set_shard_spec(nn.Parameter(torch.empty(E, 2 * inter, width // 2, dtype=u8), requires_grad=False),
                                             ShardSpec(1, (I, I)))
            self.w13_scale = set_shard_spec(nn.Parameter(torch.empty(E, 2 * inter, width // MXFP4_GROUP, dtype=u8),
                                                         requires_grad=False), ShardSpec(1, (I, I)))
            self.w2_packed = set_shard_spec(nn.Parameter(torch.empty(E, width, inter // 2, dtype=u8), requires_grad=False),
                                            ShardSpec(2))
            self.w2_scale = set_shard_spec(nn.Parameter(torch.empty(E, width, inter // MXFP4_GROUP, dtype=u8),
                                                        requires_grad=False), ShardSpec(2))
            stacks = (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
            # "packed" (the checkpoint's codes) or "planar": `use_planar` swapped w13_packed / w2_packed for
            # w13_words / w2_words, the same bytes in the planar layout (kernels/moe/mxfp4_planar_layout.py)
            self.expert_layout = "packed"
        else:
            self.w13 = set_shard_spec(nn.Parameter(torch.empty(E, 2 * inter, width, dtype=dtype), requires_grad=False),
                                      ShardSpec(1, (m.intermediate_size, m.intermediate_size)))
            self.w2 = set_shard_spec(nn.Parameter(torch.empty(E, width, inter, dtype=dtype), requires_grad=False),
                                     ShardSpec(2))
            stacks = (self.w13, self.w2)
        for p in stacks:
            p.expert_stack = True  # type: ignore[attr-defined]  (loader: dim 0 = expert)
            # loader: which checkpoint experts this rank's stack holds (global ids offset .. offset + E - 1), and
            # over which ranks its split dims are split (the expert's group: all tp ranks without expert parallelism)
            p.expert_range = (self.expert_offset, E, m.num_experts)  # type: ignore[attr-defined]
            p.expert_tp = self.expert_tp  # type: ignore[attr-defined]  (loader: the split dims' ranks)
        self.shared_experts = (
            GatedMLP(h, m.shared_intermediate_size, cfg.act, tp=tp, dtype=dtype, reduce=False)
            if m.num_shared_experts else None
        )
        # the reduce-scatter tail: the up-projection column-striped (ColumnParallel: rows of [hidden, latent])
        self.rs_tail = m.latent_size is not None and tp.size > 1 and tp.latent_tail == "reduce_scatter"
        if m.latent_size is not None:
            self.routed_expert_down_proj = ReplicatedLinear(h, m.latent_size, dtype=dtype)
            self.routed_expert_up_proj = (ColumnParallelLinear(m.latent_size, h, tp=tp, dtype=dtype, name="hidden_size")
                                          if self.rs_tail else ReplicatedLinear(m.latent_size, h, dtype=dtype))
            if m.latent_norm:
                self.routed_expert_norm = set_shard_spec(
                    nn.Parameter(torch.ones(m.latent_size, dtype=dtype), requires_grad=False), ShardSpec())
        # deterministic mode (set by KimiForCausalLM.set_batch_invariant): router and expert products in
        # fixed row tiles — an expert's row count is how many tokens of the whole step picked it
        self.batch_invariant = False

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's local expert e's (w13 [2I, width], w2 [width, I]); MXFP4 experts dequantized (exactly)
        into dtype."""
        if self.mxfp4 and self.expert_layout == "planar":
            return (dequantize_mxfp4(from_planar(self.w13_words[e]), self.w13_scale[e], dtype),
                    dequantize_mxfp4(from_planar(self.w2_words[e]), self.w2_scale[e], dtype))
        if self.mxfp4:
            return (dequantize_mxfp4(self.w13_packed[e], self.w13_scale[e], dtype),
                    dequantize_mxfp4(self.w2_packed[e], self.w2_scale[e], dtype))
        return self.w13[e], self.w2[e]

    def use_planar(self, w13_words: torch.Tensor, w2_words: torch.Tensor) -> None:
        """Hold the MXFP4 experts as planar words (the GPU runner repacked w13_packed / w2_packed into them
        in place: the same storage, so nothing else may read the packed names afterwards; they are removed,
        and a later checkpoint load into this module fails on the missing names instead of writing codes
        where words are). The reference path decodes the words back (`expert_weights`)."""
        if not self.mxfp4 or self.expert_layout != "packed":
            raise ValueError(f"use_planar: needs MXFP4 experts in the packed layout, this module has "
                             f"{'mxfp4' if self.mxfp4 else 'dense'} experts, layout "
                             f"{getattr(self, 'expert_layout', None)}")
        for name, words in (("w13", w13_words), ("w2", w2_words)):
            packed = getattr(self, f"{name}_packed")
            if words.shape != (*packed.shape[:-1], packed.shape[-1] // 4) or words.dtype != torch.int32:
                want = [*packed.shape[:-1], packed.shape[-1] // 4]
                raise ValueError(f"use_planar: {name}_words must be int32 {want}, "
                                 f"got {words.dtype} {list(words.shape)}")
            del self._parameters[f"{name}_packed"]
            self.register_parameter(f"{name}_words", nn.Parameter(words, requires_grad=False))
        self.expert_layout = "planar"

    def experts(self, z: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_k w[:, k] * Expert_{ids[:, k]}(z) — this rank's partial sum when TP > 1 (its width slice of
        every expert, or under expert parallelism its own experts only)."""
        out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
        lo, hi = self.expert_offset, self.expert_offset + self.num_local_experts
        for e in torch.unique(ids).tolist():
            if not lo <= e < hi:
                continue  # another rank's expert: its tokens' contribution arrives in the all-reduce
            tok, slot = torch.where(ids == e)
            w13, w2 = self.expert_weights(e - lo, z.dtype)
            bi = self.batch_invariant
            y = linear(act_and_mul(linear(z[tok], w13, bi), self.act), w2, bi)
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
        up = self.routed_expert_up_proj  # its linear() honours the deterministic mode's fixed row tiles
        return self.latent_tail(y, shared, up.weight, lambda a, w: linear(a, w, up.batch_invariant))

    def latent_tail(self, y_lat: torch.Tensor, shared: torch.Tensor | None, w_up: torch.Tensor, mm) -> torch.Tensor:
        return latent_tail(self.tp, y_lat, shared, w_up, mm)
