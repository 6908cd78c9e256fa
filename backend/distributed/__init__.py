"""Tensor-parallel context: which rank this process is and how to reduce across ranks.

Layers receive a `TPContext` explicitly (no global process group). With `size == 1` every
collective is the identity, so the single-process CPU reference path pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside 0..{self.size - 1}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets the concatenation of every rank's shard of the last dimension; the other ranks get
        their own shard back. For the vocab-parallel logits: only rank 0 samples, and an all-gather would
        send every other rank the whole [tokens, vocab] block for nothing (as vLLM, gather to one rank)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        # the groups span ranks 0..size-1, so group rank 0 is global rank 0
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else x

    def shard(self, n: int, name: str) -> int:
        """Size of this rank's shard of a dimension of size n; names the field when it doesn't divide."""
        if n % self.size:
            raise ValueError(f"{name}={n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size


SINGLE = TPContext()
