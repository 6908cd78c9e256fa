"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3rt.backend.distributed import SINGLE, TPContext
from k3rt.backend.layers.batch_invariant import linear
from k3rt.backend.layers.linear import ShardSpec, set_shard_spec


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, *, tp: TPContext = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.local = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.local
        self.weight = set_shard_spec(nn.Parameter(torch.empty(self.local, dim, dtype=dtype), requires_grad=False), ShardSpec(0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.local)
        out = F.embedding(local.masked_fill(mask, 0), self.weight).masked_fill(mask[..., None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the full vocabulary on rank 0 (the other ranks get their vocabulary slice: they do not
    sample); the weight may be tied to the embedding's."""

    def __init__(self, vocab_size: int, dim: int, *, tp: TPContext = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.weight = set_shard_spec(
            nn.Parameter(torch.empty(tp.shard(vocab_size, "vocab_size"), dim, dtype=dtype), requires_grad=False),
            ShardSpec(0),
        )
        self.batch_invariant = False  # set by KimiForCausalLM.set_batch_invariant (deterministic mode)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_last_dim(linear(h, self.weight, self.batch_invariant).float())
