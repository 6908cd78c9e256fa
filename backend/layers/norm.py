"""RMSNorm variants, computed in fp32 (matching the published implementations' casting)."""

from __future__ import annotations

import torch
from torch import nn

from k3rt.backend.layers.linear import ShardSpec, set_shard_spec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), normalized in fp32, cast back before the weight
    (transformers' KimiLinearRMSNorm order, so fp32 outputs agree bit-for-bit in spirit)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: RMSNorm over the last dim, * weight, * sigmoid(gate), all in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_shard_spec(nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False), ShardSpec())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
