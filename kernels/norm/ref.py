"""Plain-torch RMSNorm oracles with the exact contract (and rounding order) of the Triton kernels.

What this module knows: the model's two RMSNorm forms (backend/layers/norm.py) and the fused
residual add in front of the plain one. It does not know layers, sharding or weights loading.

Rounding order, shared with the model:
  rms_norm:       h = x + residual (rounded to x.dtype); y = weight * (h_f32 * rstd).to(x.dtype),
                  the product computed in promote(weight.dtype, x.dtype).
  rms_norm_gated: y = (weight_f32 * x_f32 * rstd * sigmoid(gate_f32)).to(x.dtype), all fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim, optionally after a residual add.

    Args:
        x: [N, D] activations.
        weight: [D], x.dtype or fp32.
        eps: added to mean(x^2) inside the rsqrt.
        residual: optional [N, D] in x.dtype, added to x first.

    Returns:
        y [N, D] in promote(weight.dtype, x.dtype) without residual; else (y, h) with h = x + residual
        in x.dtype (the new residual stream).
    """
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * hf.to(h.dtype)
    return y if residual is None else (y, h)


def rms_norm_gated(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA output norm: RMSNorm over D, times weight and sigmoid(gate), in fp32.

    Args:
        x: [N, H, D] attention output.
        gate: [N, H, D] raw gate projection (sigmoid applied here).
        weight: [D].
        eps: added to mean(x^2) inside the rsqrt.

    Returns:
        [N, H, D] in x.dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)
