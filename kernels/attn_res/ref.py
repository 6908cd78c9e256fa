"""Plain-torch oracle for the attention-residual mix, on the stacked-buffer contract of the kernel.

The model (backend/models/attn_res.py) keeps completed blocks in a list plus a running prefix. The
kernel instead reads a stacked buffer `sources [Jmax, N, D]` whose first J slots are live: blocks in
order, then the prefix in slot J-1. A runner that appends into such a buffer (and accumulates the
prefix in place in its slot) feeds the kernel without a copy. The math is the model's:

    l_j = sum_d src_j[d] * rstd(src_j) * w_norm[d] * w_proj[d]        (fp32)
    mix = sum_j softmax_j(l) * src_j                                   (raw sources)
"""
from __future__ import annotations

import torch
from torch import Tensor


def attn_res_mix(sources: Tensor, num_sources: int, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """Softmax-over-depth mix of the first `num_sources` slots of `sources`.

    Args:
        sources: [Jmax, N, D]; slots 0..J-2 are completed blocks, slot J-1 the running prefix.
        num_sources: J, 1 <= J <= Jmax.
        norm_weight: [D] the res-norm weight.
        proj_weight: [D] or [1, D] the res-proj weight.
        eps: RMSNorm eps (rms_norm_eps).

    Returns:
        [N, D] in sources.dtype.
    """
    src = sources[:num_sources].float()  # [J, N, D]
    rstd = torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.float() * proj_weight.float().reshape(-1)  # [D]
    logits = ((src * rstd) * w).sum(-1)  # [J, N]
    probs = torch.softmax(logits, dim=0)
    return (probs[..., None] * src).sum(0).to(sources.dtype)
