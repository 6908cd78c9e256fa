"""Batch-invariant matmul for the deterministic mode (`EngineConfig.deterministic`).

What varies on CPU without it: torch's `F.linear` hands [M, K] x [K, N] to MKL/oneDNN, which picks
its kernel and blocking by M — M=1 takes a GEMV path, small M another micro-kernel, and bf16 at
M=48 yet another — so one row's dot products are summed in a different order depending on how many
other rows (requests, prompt tokens) share the step. Measured on this torch (2.13, MKL, AVX-512):
an fp32 row differs between M=1, M=2..9 and M>=16; a bf16 row differs at M=48.

The fix: every product is taken in tiles of exactly ROW_TILE rows (the last tile zero-padded), one
`F.linear` call per tile. Every call then has the same shape, so MKL takes the same kernel and
blocking for every row, and a row's result depends only on that row (a row's position inside a tile
does not change it: each output element is its own K-reduction). The cost is the padding (up to
ROW_TILE-1 wasted rows per call, mostly felt in decode) and one call per tile in prefill.

What this module does not know: attention, KDA, or which layers use it (the layers hold the flag).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# rows per matmul call; 16 is the smallest M at which MKL's fp32 path stops changing kernels here,
# so a single-token decode pays for 15 padding rows and a 2048-token prefill makes 128 calls
ROW_TILE = 16


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """x @ weight^T with each row's reduction order independent of the other rows.

    Args:
        x: [..., K].
        weight: [N, K].
        tile: rows per underlying matmul call.

    Returns:
        [..., N] in x's result dtype (as F.linear).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    padded = -(-m // tile) * tile
    if padded != m:
        flat = torch.cat([flat, flat.new_zeros(padded - m, k)])
    out = torch.cat([F.linear(flat[i:i + tile], weight) for i in range(0, padded, tile)]) if padded else \
        F.linear(flat, weight)
    return out[:m].reshape(*lead, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """F.linear, or its batch-invariant form when the layer is in the deterministic mode."""
    return invariant_linear(x, weight) if batch_invariant else F.linear(x, weight)
