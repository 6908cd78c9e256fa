"""Attention residuals (Kimi-K3): sub-layers read a learned, per-token softmax mix over depth.

The residual stream is a list of completed block sums plus the running `prefix` (the sum of
sub-layer outputs since the last block boundary). Block 0 is the token embedding. At every layer
with idx % block_size == 0 the completed prefix is appended as a block BEFORE that layer's
attention, and the attention output starts the new prefix. Every sub-layer input (and the final
output) is MIX(blocks, prefix):

    l_j = Σ_d src_j[d] · rstd(src_j) · w_norm[d] · w_proj[d]     (rstd with eps = rms_norm_eps, fp32)
    mix = Σ_j softmax_j(l) · src_j                                (raw, un-normalized sources)

Sources: vLLM `vllm/models/kimi_k3/nvidia/ops/attn_res.py`, SGLang `layers/attn_residual.py`
(summarized in docs/architecture.md). State lives only inside one forward pass.
"""

from __future__ import annotations

import torch


def attn_res_mix(blocks: list[torch.Tensor], prefix: torch.Tensor, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """blocks: list of [N, h]; prefix: [N, h]; norm_weight [h]; proj_weight [1, h] -> [N, h] in prefix.dtype."""
    if not blocks:
        return prefix
    src = torch.stack([*blocks, prefix]).float()  # [J, N, h]
    rstd = torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.float() * proj_weight.float().reshape(-1)  # [h]
    logits = ((src * rstd) * w).sum(-1)  # [J, N]
    probs = torch.softmax(logits, dim=0)
    return (probs[..., None] * src).sum(0).to(prefix.dtype)


class AttnResStream:
    """The per-forward residual state: completed block sums and the running prefix."""

    def __init__(self, embeddings: torch.Tensor, block_size: int) -> None:
        self.blocks: list[torch.Tensor] = []
        self.prefix: torch.Tensor | None = embeddings
        self.block_size = block_size

    def mix(self, norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
        assert self.prefix is not None
        return attn_res_mix(self.blocks, self.prefix, norm_weight, proj_weight, eps)

    def begin_layer(self, idx: int) -> None:
        """Call after the attention-side mix of layer idx: closes a block at boundary layers."""
        if idx % self.block_size == 0:
            assert self.prefix is not None
            self.blocks.append(self.prefix)
            self.prefix = None

    def add(self, y: torch.Tensor) -> None:
        self.prefix = y if self.prefix is None else self.prefix + y
