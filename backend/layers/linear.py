"""TP-aware linear layers (Megatron-style) whose parameters know how to load a full checkpoint tensor.

Each parameter carries a `ShardSpec` telling the loader which dimension is split across ranks and,
for merged parameters (gate|up, q|k|v conv), the full-size extents of each part. The loader
(`backend/models/loader.py`) copies one checkpoint tensor into one part of one parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3rt.backend.distributed import SINGLE, TPContext
from k3rt.backend.layers.batch_invariant import linear


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter relates to its full (unsharded) checkpoint form.

    split_dim: dimension split evenly across TP ranks (None: replicated).
    parts: full sizes of the parts concatenated along split_dim (merged params), or None for one part.
      Each part is split across ranks separately, so rank r holds [part0_r | part1_r | ...].
    """

    split_dim: int | None = None
    parts: tuple[int, ...] | None = None


def set_shard_spec(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    param.shard_spec = spec  # type: ignore[attr-defined]
    return param


def _empty(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ReplicatedLinear(nn.Module):
    """y = x W^T, the same full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = set_shard_spec(_empty(out_features, in_features, dtype=dtype), ShardSpec())
        self.batch_invariant = False  # set by KimiForCausalLM.set_batch_invariant (deterministic mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.batch_invariant)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; no communication. `parts` names merged outputs (full sizes)."""

    def __init__(
        self,
        in_features: int,
        out_features: int | tuple[int, ...],
        *,
        tp: TPContext = SINGLE,
        dtype: torch.dtype | None = None,
        name: str = "out_features",
    ) -> None:
        super().__init__()
        parts = out_features if isinstance(out_features, tuple) else None
        full = sum(parts) if parts else int(out_features)  # type: ignore[arg-type]
        local = sum(tp.shard(p, name) for p in parts) if parts else tp.shard(full, name)
        self.weight = set_shard_spec(_empty(local, in_features, dtype=dtype), ShardSpec(0, parts))
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.batch_invariant)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial products are all-reduced (unless reduce=False)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: TPContext = SINGLE,
        dtype: torch.dtype | None = None,
        reduce: bool = True,
        name: str = "in_features",
    ) -> None:
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.weight = set_shard_spec(_empty(out_features, tp.shard(in_features, name), dtype=dtype), ShardSpec(1))
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.batch_invariant)
        return self.tp.all_reduce(y) if self.reduce else y
