"""Plain-torch oracles for the MoE kernels: the router's top-k and the fused routed experts.

These carry the kernels' exact contracts, roundings included (model-facts §6; SiTU §7.3):
  - route_ref: sigmoid scores, selection on score + correction bias (grouped top-k, group score =
    sum of the group's top-2 biased scores), weights from the un-biased scores, optional
    renormalization, x routed_scaling_factor. Ids are int32, in descending order of biased score.
  - fused_experts_ref: per (token, slot) pair, h = act(gate) * up' from an fp32 GEMM, rounded to the
    activation dtype (the kernel's intermediate buffer); y = w * (h @ w2[e]^T) in fp32, rounded to
    the activation dtype (the kernel's per-pair buffer); out = sum over the k slots in fp32, in slot
    order, rounded to the activation dtype.
The router GEMM and the LatentMoE down/up projections are ordinary GEMMs outside these ops.
"""
from __future__ import annotations

import torch
from torch import Tensor

from k3rt.model_config import ActivationConfig


def route_ref(
    logits: Tensor, bias: Tensor, *, top_k: int, num_expert_group: int, topk_group: int,
    renormalize: bool, scaling: float,
) -> tuple[Tensor, Tensor]:
    """logits [T, E] fp32 (x @ W_gate^T), bias [E] -> (weights [T, top_k] fp32, ids [T, top_k] int32)."""
    scores = torch.sigmoid(logits.float())  # [T, E]
    choice = scores + bias.float()
    if num_expert_group > 1:
        T, E = logits.shape
        per = E // num_expert_group
        group_scores = choice.view(T, num_expert_group, per).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices  # [T, k], descending
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, ids.to(torch.int32)


def act_and_mul_ref(gate: Tensor, up: Tensor, act: ActivationConfig) -> Tensor:
    """SiLU: silu(gate) * up. SiTU: b*tanh(gate/b)*sigmoid(gate) * up', up' = bl*tanh(up/bl) if bl set."""
    if act.name == "silu":
        return gate * torch.sigmoid(gate) * up
    if act.name != "situ" or act.situ_beta is None:
        raise ValueError(f"act must be silu, or situ with situ_beta set, got {act}")
    b, bl = act.situ_beta, act.situ_linear_beta
    if bl is not None:
        up = bl * torch.tanh(up / bl)
    return b * torch.tanh(gate / b) * torch.sigmoid(gate) * up


def fused_experts_ref(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, *, act: ActivationConfig,
    shared_experts: int = 0,
) -> Tensor:
    """x [T, D], w13 [E, 2I, D] = [gate | up] rows, w2 [E, D, I], topk_weights [T, k] fp32,
    topk_ids [T, k] int -> [T, D] in x.dtype = sum_k w[t, k] * w2[e] act_and_mul(w13[e] x[t]).

    shared_experts S: the last S experts of w13/w2 are shared: every token also gets slots
    E-S .. E-1 of weight 1 after its k routed ones (summed in that order)."""
    if shared_experts:
        T, E = topk_ids.shape[0], w13.shape[0]
        extra = torch.arange(E - shared_experts, E, device=topk_ids.device).expand(T, shared_experts)
        topk_ids = torch.cat([topk_ids.long(), extra], dim=1)
        topk_weights = torch.cat([topk_weights, torch.ones(T, shared_experts, dtype=topk_weights.dtype,
                                                           device=topk_weights.device)], dim=1)
    T, k = topk_ids.shape
    D, inter = w2.shape[1], w2.shape[2]
    per_pair = torch.empty(T, k, D, dtype=x.dtype, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        gu = x[tok].float() @ w13[e].float().t()  # [n, 2I]
        h = act_and_mul_ref(gu[:, :inter], gu[:, inter:], act).to(x.dtype)
        y = (h.float() @ w2[e].float().t()) * topk_weights[tok, slot, None].float()
        per_pair[tok, slot] = y.to(x.dtype)
    out = per_pair[:, 0].float()
    for j in range(1, k):
        out = out + per_pair[:, j].float()
    return out.to(x.dtype)


def align_ref(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The grouped GEMMs' row layout, as Python lists over the used blocks only.

    Returns (sorted_pair_ids, block_expert): for each expert in order, its pairs p = t*k + j in
    ascending order, padded with the sentinel T*k to a multiple of block_m; and each block's expert.
    """
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    sorted_ids: list[int] = []
    block_expert: list[int] = []
    by_expert: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(flat):
        by_expert[e].append(p)
    for e, pairs in enumerate(by_expert):
        if not pairs:
            continue
        n_blocks = -(-len(pairs) // block_m)
        sorted_ids += pairs + [sentinel] * (n_blocks * block_m - len(pairs))
        block_expert += [e] * n_blocks
    return sorted_ids, block_expert


def moe_layer_ref(x: Tensor, gate_weight: Tensor, bias: Tensor, w13: Tensor, w2: Tensor, *, top_k: int,
                  renormalize: bool, scaling: float, shared_experts: int, act: ActivationConfig,
                  norm: tuple | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One token's MoE layer (triton_layer.py's `moe_layer_one_token`) from the references above: fp32 logits,
    `route_ref` (ungrouped), `fused_experts_ref`; with norm = (weight, eps[, residual]) the residual add rounded to
    x.dtype and kernels/norm's RMSNorm. -> (out, weights, ids, the new residual stream or None)."""
    from k3rt.kernels.norm.ref import rms_norm

    logits = x.float() @ gate_weight.float().t()
    tw, ids = route_ref(logits, bias, top_k=top_k, num_expert_group=1, topk_group=1, renormalize=renormalize,
                        scaling=scaling)
    y = fused_experts_ref(x, w13, w2, tw, ids, act=act, shared_experts=shared_experts)
    if norm is None:
        return y, tw, ids, None
    weight, eps, residual = (tuple(norm) + (None,))[:3]
    if residual is not None:
        y = (y.float() + residual.float()).to(x.dtype)
    return rms_norm(y, weight, eps), tw, ids, y if residual is not None else None
