"""Torch oracle of the skinny linear: fp32 products and sums of the inputs as given."""
from __future__ import annotations

import torch
from torch import Tensor


def skinny_linear_ref(x: Tensor, w: Tensor, out_dtype: torch.dtype | None = None,
                      row_rms: tuple[Tensor, float] | None = None) -> Tensor:
    """x [M, K] @ w [N, K]^T in fp32 (either operand may be 16-bit or fp32), rounded to out_dtype
    (default x.dtype). row_rms = (partials [M, G, P] fp32, eps): x's K columns in G groups of K/G, each scaled
    first by rsqrt(partials.sum(-1) / (K/G) + eps) (a norm whose sums of squares were taken in P parts elsewhere:
    kernels/kda `kda_decode_split_norm`)."""
    xf = x.float()
    if row_rms is not None:
        partials, eps = row_rms
        M, G = partials.shape[:2]
        rstd = torch.rsqrt(partials.float().sum(-1) / (x.shape[1] // G) + eps)  # [M, G]
        xf = (xf.view(M, G, -1) * rstd[:, :, None]).view(M, -1)
    return (xf @ w.float().t()).to(out_dtype or x.dtype)
