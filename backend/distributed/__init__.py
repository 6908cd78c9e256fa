"""Tensor-parallel context: which rank this process is and how to reduce across ranks.

Layers receive a `TPContext` explicitly (no global process group). With `size == 1` every
collective is the identity, so the single-process CPU reference path pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist


LatentTail = Literal["reduce_scatter", "all_reduce"]


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    # LatentMoE's tail under TP (backend/models/moe.py): "reduce_scatter" reduce-scatters the shared
    # expert's partial sum and runs the latent up-projection column-striped (each rank reads 1/size of its
    # weight), then gathers once; "all_reduce" all-reduces the shared partial and runs the replicated
    # up-projection on every rank (the plain path, kept for comparison)
    latent_tail: LatentTail = "reduce_scatter"
    # an all-reduce that takes small messages itself (x -> True, summed in place) or declines them (False:
    # NCCL then); every rank holds the same one. backend/distributed/symm_all_reduce.py; None: always `group`'s
    fast_all_reduce: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside 0..{self.size - 1}")
        if self.latent_tail not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"latent_tail must be 'reduce_scatter' or 'all_reduce', got {self.latent_tail!r}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and not (self.fast_all_reduce is not None and self.fast_all_reduce(x)):
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

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank gets the concatenation of every rank's shard of the last dimension (the reduce-scatter
        latent tail, whose output every rank needs)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def reduce_scatter_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of x [..., n], this rank keeping columns [rank * n/size, (rank + 1) * n/size)."""
        if self.size == 1:
            return x
        parts = [c.contiguous() for c in x.chunk(self.size, dim=-1)]
        out = torch.empty_like(parts[self.rank])
        dist.reduce_scatter(out, parts, group=self.group)
        return out

    def shard(self, n: int, name: str) -> int:
        """Size of this rank's shard of a dimension of size n; names the field when it doesn't divide."""
        if n % self.size:
            raise ValueError(f"{name}={n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size


SINGLE = TPContext()
