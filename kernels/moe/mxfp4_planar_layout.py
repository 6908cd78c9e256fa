"""The planar in-memory layout of MXFP4 weights (torch only, no Triton): compressed-tensors packed codes
uint8 [..., N, K/2] <-> int32 words [..., N, K/8] of the same bytes, which `triton_mxfp4_planar`'s kernels
decode a whole word at a time. The layout is described there; it lives here so the reference path can read
experts the GPU runner repacked (`backend/models/moe.py`) without importing Triton.
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 256  # K elements per planar chunk: 8 groups of 32, 32 int32 words of 8 nibbles

# Where a 16-bit lane keeps the code bits (m, e0, e1, sign) of its 4 slots. Decoded, a slot's bits sit at
# the bf16 positions (6, 7, 8, 15) (`triton_mxfp4_planar._plane`): slots 0-2 get there with one shift (6, 3, 0)
# and one mask, slot 3 with three (16 bits hold no fourth copy of the pattern {0, 1, 2, 9}).
SLOT_BITS = ((0, 1, 2, 9), (3, 4, 5, 12), (6, 7, 8, 15), (10, 11, 13, 14))


def to_planar(packed: Tensor) -> Tensor:
    """compressed-tensors packed codes uint8 [..., N, K/2] -> planar int32 words [..., N, K/8]."""
    *lead, half = packed.shape
    K = 2 * half
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if K % CHUNK:
        raise ValueError(f"the planar MXFP4 layout needs K to be a multiple of {CHUNK}, got K={K}")
    # element 32 g + 2 i + l of a chunk (group g, pair i, lane l) -> word 16 (g // 4) + i, lane l, slot g % 4
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, K // CHUNK, 2, 4, 16, 2).long()
    word = torch.zeros(*lead, K // CHUNK, 2, 16, dtype=torch.int64, device=packed.device)
    for slot, positions in enumerate(SLOT_BITS):
        c = codes[..., slot, :, :]  # [.., chunk, 2, 16, lane]
        for bit, pos in enumerate(positions):
            word |= (((c >> bit) & 1) << (torch.tensor([0, 16], device=packed.device) + pos)).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32).reshape(*lead, K // 8)


def from_planar(words: Tensor) -> Tensor:
    """The inverse of `to_planar`: int32 words [..., N, K/8] -> packed uint8 [..., N, K/2]."""
    if words.dtype != torch.int32:
        raise ValueError(f"planar words must be int32, got {words.dtype}")
    *lead, K8 = words.shape
    K = 8 * K8
    w = words.long().reshape(*lead, K // CHUNK, 2, 1, 16, 1) & 0xFFFFFFFF
    lane = torch.tensor([0, 16], device=words.device)
    codes = torch.zeros(*lead, K // CHUNK, 2, 4, 16, 2, dtype=torch.int64, device=words.device)
    for slot, positions in enumerate(SLOT_BITS):
        for bit, pos in enumerate(positions):
            codes[..., slot, :, :] |= ((w[..., 0, :, :] >> (lane + pos)) & 1) << bit
    codes = codes.reshape(*lead, K)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).contiguous()


# packed bytes repacked per step by `repack_in_place`: to_planar's int64 temporaries take ~16x that (1 GiB),
# and K3's 93 layers of 896 experts one at a time would be ~170k calls of ~40 small ops each
REPACK_BYTES = 64 << 20


def repack_in_place(packed: Tensor) -> Tensor:
    """A stack of packed codes [E, N, K/2] rewritten as its planar words [E, N, K/8] in the same storage
    (returned: the int32 view of it), a few experts at a time (REPACK_BYTES): no second copy of the stack,
    only those experts' temporaries. `packed` must be contiguous; afterwards its bytes are the words."""
    if not packed.is_contiguous():
        raise ValueError("packed must be contiguous to be repacked in place")
    words = packed.view(torch.int32)  # also checks K/2 is a multiple of 4 (K of CHUNK: always)
    step = max(1, REPACK_BYTES // max(1, packed[0].numel())) if packed.shape[0] else 1
    for e in range(0, packed.shape[0], step):
        # to_planar reads these experts whole before the copy overwrites them
        words[e:e + step] = to_planar(packed[e:e + step])
    return words
