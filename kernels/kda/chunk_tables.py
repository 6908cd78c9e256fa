"""The chunked KDA kernel's host tables (which chunk belongs to which sequence, where snapshots go), built
without Triton so the step packer can build them once per step (backend/runner/gpu/step.py) and every KDA
layer's `kda_chunk_fwd` reuses them (`ChunkTables`) instead of building, validating and copying its own.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from torch import Tensor

CHUNK = 64  # C: tokens per chunk
# kda_chunk_fwd's intra step: one fused program per (chunk, head), or two launches of smaller programs
INTRA_FORMS = ("fused", "split", "blocks")


class ChunkTables(NamedTuple):
    """`chunk_tables` on the device, for `kda_chunk_fwd(tables=...)`: int32 tensors. Built and validated once
    (by `chunk_tables`); the launcher checks only their sizes."""

    chunk_seq: Tensor  # [NC] sequence of each chunk
    chunk_idx: Tensor  # [NC] chunk index inside its sequence
    chunk_off: Tensor  # [N] global index of each sequence's first chunk
    snap: Tensor  # [NC] state slot that receives the state after this chunk, or -1
    init: Tensor  # [N] 1: the sequence starts from its slot's state
    num_chunks: int  # NC (a Python int: the grid size, read without a device sync)


def chunk_tables(
    seqlens: Sequence[int] | np.ndarray,
    snapshot_positions: Sequence[Sequence[int]] | None,
    snapshot_slots: Sequence[Sequence[int]] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Host tables (chunk_seq [NC], chunk_idx [NC], chunk_off [N], snap [NC]) as int64 numpy arrays, with the
    snapshot arguments checked (ValueError naming the sequence, the position and the limit)."""
    lens = np.asarray(seqlens, dtype=np.int64).reshape(-1)
    N = lens.size
    per = -(-lens // CHUNK)  # chunks per sequence
    chunk_off = np.zeros(N, dtype=np.int64)
    np.cumsum(per[:-1], out=chunk_off[1:])
    NC = int(per.sum())
    chunk_seq = np.repeat(np.arange(N, dtype=np.int64), per)
    chunk_idx = np.arange(NC, dtype=np.int64) - chunk_off[chunk_seq]
    snap = np.full(NC, -1, dtype=np.int64)
    if snapshot_positions is not None:
        if snapshot_slots is None or len(snapshot_slots) != N or len(snapshot_positions) != N:
            raise ValueError(
                f"snapshot_positions and snapshot_slots must both hold one list per sequence (N={N}), "
                f"got {len(snapshot_positions)} and {None if snapshot_slots is None else len(snapshot_slots)}"
            )
        for i, (pos, dst) in enumerate(zip(snapshot_positions, snapshot_slots)):
            if len(pos) != len(dst):
                raise ValueError(f"sequence {i}: {len(pos)} snapshot positions but {len(dst)} snapshot slots")
            n = int(lens[i])
            for p, d in zip(pos, dst):
                p, d = int(p), int(d)
                if not (0 < p <= n) or (p % CHUNK != 0 and p != n):
                    raise ValueError(
                        f"sequence {i}: snapshot position must satisfy 0 < p <= T={n} and be a "
                        f"multiple of {CHUNK} or equal T; got {p}"
                    )
                if d < 0:
                    raise ValueError(f"sequence {i}: snapshot slot must be >= 0, got {d}")
                c = int(chunk_off[i]) + -(-p // CHUNK) - 1
                if snap[c] != -1:
                    raise ValueError(f"sequence {i}: two snapshots at position {p}")
                snap[c] = d
    elif snapshot_slots is not None:
        raise ValueError("snapshot_slots given without snapshot_positions")
    return chunk_seq, chunk_idx, chunk_off, snap
