"""Feed-forward blocks on the GPU path: the dense MLP as is, MoE/LatentMoE through the fused
router + grouped expert kernels (the reference expert loop when kernels are off: eager only, it
reads the routing on the host)."""

from __future__ import annotations

import torch

from k3rt.backend.layers.norm import rms_norm
from k3rt.backend.models.moe import MoE, route
from k3rt.backend.runner.gpu.ops import KernelConfig, kernel


def moe_forward(moe: MoE, x: torch.Tensor, k: KernelConfig) -> torch.Tensor:
    m = moe.m
    experts = kernel("moe", "fused_experts") if k.triton else None
    router = kernel("moe", "moe_route") if k.triton else None
    if router is not None:
        logits = torch.nn.functional.linear(x.float(), moe.gate_weight.float())
        w, ids = router(logits, moe.e_score_correction_bias.float(), top_k=m.num_experts_per_token,
                        num_expert_group=m.num_expert_group, topk_group=m.topk_group,
                        renormalize=m.renormalize, scaling=m.routed_scaling_factor)
    else:
        w, ids = route(x, moe.gate_weight, moe.e_score_correction_bias, m)

    def routed(z: torch.Tensor) -> torch.Tensor:
        if experts is None:
            return moe.experts(z, w, ids)
        return experts(z, moe.w13, moe.w2, w, ids.to(torch.int32), act=moe.act, use_pdl=k.use_pdl)

    shared = moe.shared_experts(x) if moe.shared_experts is not None else None
    if m.latent_size is None:
        y = routed(x)
        return moe.tp.all_reduce(y if shared is None else y + shared)
    y = moe.tp.all_reduce(routed(moe.routed_expert_down_proj(x)))
    if m.latent_norm:
        y = rms_norm(y, moe.routed_expert_norm, moe.eps)
    y = moe.routed_expert_up_proj(y)
    return y if shared is None else y + moe.tp.all_reduce(shared)
