"""Bit-packed allowed-token masks, the format grammar backends emit (llguidance, xgrammar).

A mask row is ceil(V / 32) int32 words; token t is allowed when bit (t % 32) of word (t // 32) is set
(least significant bit first). Bits past V are ignored. A row with every bit set is unconstrained.
This module knows nothing about grammars; it only unpacks and applies masks.
"""

from __future__ import annotations

import torch


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_token_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """mask: [B, ceil(V/32)] int32 -> allowed: [B, V] bool."""
    words = num_mask_words(vocab_size)
    if mask.dtype != torch.int32 or mask.dim() != 2 or mask.shape[1] != words:
        raise ValueError(f"allowed_mask: expected int32 [B, {words}] for vocab_size {vocab_size}, "
                         f"got {mask.dtype} {list(mask.shape)}")
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    # >> is arithmetic on int32, so the sign bit smears left; & 1 still reads each bit exactly.
    bits = (mask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(mask.shape[0], words * 32)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits: [B, V], mask: [B, ceil(V/32)] int32 -> logits with disallowed tokens at -inf (a new tensor)."""
    if mask.shape[0] != logits.shape[0]:
        raise ValueError(f"allowed_mask: expected {logits.shape[0]} rows (one per logits row), got {mask.shape[0]}")
    allowed = unpack_token_bitmask(mask.to(logits.device), logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))
