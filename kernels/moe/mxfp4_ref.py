"""MXFP4 weights (OCP microscaling FP4), as compressed-tensors' `mxfp4-pack-quantized` format stores them,
and the plain-torch oracles for the MXFP4 routed experts.

Format (one linear weight W [N, K], K a multiple of 32):
  - `weight_packed` uint8 [N, K/2]: two E2M1 codes per byte along K; element 2j in the low nibble,
    2j+1 in the high nibble.
  - `weight_scale` uint8 [N, K/32]: one E8M0 scale per group of 32 consecutive K elements,
    value 2^(s - 127) (255 is NaN in the spec; never written here).
  - E2M1 code: bit 3 the sign, bits 0-2 index the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6).
W[n, k] = e2m1(code[n, k]) * 2^(scale[n, k // 32] - 127). Every such value is exact in bf16, fp16 (within
its range) and fp32, so the dequantized weight does not depend on the dtype it is written in.

Quantizing (`quantize_mxfp4`, used by `k3rt quantize --mxfp4-experts` and the tests) follows the OCP MX
recipe: the group's scale is 2^(floor(log2(amax)) - 2) (2 = E2M1's largest exponent), each element is
divided by it and rounded to the nearest E2M1 magnitude (ties to the even code), clamped to 6.
"""
from __future__ import annotations

import torch
from torch import Tensor

from k3rt.kernels.moe.ref import fused_experts_ref
from k3rt.model_config import ActivationConfig

GROUP = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_EMAX = 2  # 6 = 1.5 * 2^2
_SCALE_BIAS = 127


def e2m1_values(device: torch.device | str = "cpu") -> Tensor:
    """The 16 code values, fp32: codes 0-7 positive, 8-15 their negatives (8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N, K] (any float dtype, K % 32 == 0) -> (packed uint8 [..., N, K/2], scale uint8 [..., N, K/32])."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"the last dim of an MXFP4 weight must be a multiple of {GROUP}, got {list(w.shape)}")
    *lead, K = w.shape
    g = w.float().reshape(*lead, K // GROUP, GROUP)
    amax = g.abs().amax(-1)
    # exponent of amax; an all-zero group gets the smallest scale (its codes are all 0 anyway)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny))),
                      torch.full_like(amax, -float(_SCALE_BIAS)))
    s = (exp - _E2M1_EMAX + _SCALE_BIAS).clamp(0, 254)
    scaled = g / torch.exp2(s - _SCALE_BIAS)[..., None]
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=w.device)
    a = scaled.abs().clamp(max=6.0)
    # nearest magnitude; on a tie the even code (the smaller mantissa), as round-half-to-even does
    dist = (a[..., None] - mags).abs()
    best = dist.min(-1, keepdim=True).values
    cand = (dist == best)
    idx = torch.where(cand[..., 0::2].any(-1), (cand[..., 0::2].float().argmax(-1) * 2),
                      cand.float().argmax(-1))
    code = (idx + 8 * (scaled < 0)).to(torch.uint8).reshape(*lead, K)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), s.to(torch.uint8).contiguous()


def dequantize_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed uint8 [..., N, K/2], scale uint8 [..., N, K/32]) -> W [..., N, K] in dtype."""
    *lead, half = packed.shape
    K = 2 * half
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if tuple(scale.shape) != (*lead, K // GROUP):
        raise ValueError(f"scale must be {[*lead, K // GROUP]} for packed {list(packed.shape)}, got {list(scale.shape)}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, K).long()
    vals = e2m1_values(packed.device)[codes]
    factor = torch.exp2(scale.float() - _SCALE_BIAS).repeat_interleave(GROUP, dim=-1)
    return (vals * factor).to(dtype)


def fused_experts_mxfp4_ref(
    x: Tensor, w13_packed: Tensor, w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
    topk_weights: Tensor, topk_ids: Tensor, *, act: ActivationConfig, shared_experts: int = 0,
) -> Tensor:
    """`fused_experts_ref` on the dequantized weights: w13 [E, 2I, D] and w2 [E, D, I] in x.dtype (exact)."""
    return fused_experts_ref(x, dequantize_mxfp4(w13_packed, w13_scale, x.dtype), dequantize_mxfp4(w2_packed, w2_scale, x.dtype),
                             topk_weights, topk_ids, act=act, shared_experts=shared_experts)
