"""Torch oracle of the skinny linear: fp32 products and sums of the inputs as given."""
from __future__ import annotations

import torch
from torch import Tensor


def skinny_linear_ref(x: Tensor, w: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [M, K] @ w [N, K]^T in fp32 (either operand may be 16-bit or fp32), rounded to out_dtype
    (default x.dtype)."""
    return (x.float() @ w.float().t()).to(out_dtype or x.dtype)
