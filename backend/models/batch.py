"""The per-step batch description passed explicitly down the model, and the cache interface
that layers read and write through.

A step is a flat (varlen) token tensor: sequence i contributes `seq_lens[i]` consecutive tokens
whose absolute positions start at `start_positions[i]`. Prefill chunks and decode tokens mix
freely. Layers never see a global forward context; they get this object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


class SequenceCache(ABC):
    """One sequence's cache across all layers.

    Ownership: the layer that owns `layer_idx` is the only writer of that layer's entries during a
    step; tensors returned by `kda_state` are mutable views updated in place.
    """

    @abstractmethod
    def kda_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_state [W-1, 3*P_local] in the conv dtype, recurrent [H_local, K, V] fp32), both updated in place."""

    @abstractmethod
    def mla_extend(self, layer_idx: int, start: int, latent: torch.Tensor) -> torch.Tensor:
        """Store latent [T, L+R] at positions start..start+T-1; return entries [start+T, L+R] for 0..start+T-1."""


class ContiguousCache(SequenceCache):
    """A sequence cache in plain growable tensors: the reference generation path and tests.

    The paged pool (engine core) implements the same interface over pages.
    """

    def __init__(self, kda_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], mla_layers: list[int],
                 mla_dim: int, *, conv_dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.conv = {i: torch.zeros(c, dtype=conv_dtype, device=device) for i, (c, _) in kda_shapes.items()}
        self.rec = {i: torch.zeros(r, dtype=torch.float32, device=device) for i, (_, r) in kda_shapes.items()}
        self.kv = {i: torch.zeros(0, mla_dim, dtype=kv_dtype, device=device) for i in mla_layers}

    def kda_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[layer_idx], self.rec[layer_idx]

    def mla_extend(self, layer_idx: int, start: int, latent: torch.Tensor) -> torch.Tensor:
        kv = self.kv[layer_idx]
        if start != kv.shape[0]:
            raise ValueError(f"mla_extend: start {start} but layer {layer_idx} holds {kv.shape[0]} tokens")
        kv = torch.cat([kv, latent.to(kv.dtype)], dim=0)
        self.kv[layer_idx] = kv
        return kv

    @property
    def num_tokens(self) -> int:
        return next(iter(self.kv.values())).shape[0] if self.kv else -1


@dataclass
class ForwardBatch:
    """What one forward step computes.

    seq_lens: new tokens per sequence, in the order they appear in the flat token tensor.
    start_positions: tokens already processed for each sequence (its cache length before this step).
    caches: one SequenceCache per sequence, or None for a cache-less full forward (start must be 0).
    logits_indices: rows of the flat hidden state to compute logits for (None: every row).
    state_positions: per sequence, token counts (absolute) at which KDA layers must also report the
      state (prefix-cache snapshots); collected into `emitted_states` keyed (seq, layer, position).
    verify: per sequence, True for a speculative verify run: KDA layers read its state but leave it as it
      was, and keep the run's per-token inputs in `verify_inputs[(seq, layer)]` (pre-conv qkv [T, 3P],
      gate g [T, H, K], beta [T, H]) so that `KimiForCausalLM.commit_verified` can replay the accepted
      prefix into the state. MLA layers write every position (rejected ones are overwritten later).
    """

    seq_lens: list[int]
    start_positions: list[int] = field(default_factory=list)
    caches: list[SequenceCache] | None = None
    logits_indices: torch.Tensor | None = None
    state_positions: list[tuple[int, ...]] | None = None
    emitted_states: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    verify: list[bool] | None = None
    verify_inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.start_positions:
            self.start_positions = [0] * len(self.seq_lens)
        if len(self.start_positions) != len(self.seq_lens):
            raise ValueError("start_positions: one entry per sequence required")
        if self.caches is None and any(self.start_positions):
            raise ValueError("start_positions: non-zero start needs caches")
        if self.caches is not None and len(self.caches) != len(self.seq_lens):
            raise ValueError("caches: one SequenceCache per sequence required")
        if self.verify is not None and (len(self.verify) != len(self.seq_lens) or self.caches is None):
            raise ValueError("verify: one flag per sequence, and caches to verify against")

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def dense_shape(self) -> tuple[int, int] | None:
        """(B, T) when the step is B fresh sequences of one length T, with no caches and no state
        snapshots (training and evaluation windows): layers may then run on [B, T] at once."""
        if (self.caches is not None or (self.state_positions and any(self.state_positions)) or not self.seq_lens
                or (self.verify and any(self.verify))):
            return None
        t = self.seq_lens[0]
        return (len(self.seq_lens), t) if t > 0 and all(n == t for n in self.seq_lens) else None

    def spans(self) -> list[tuple[int, int]]:
        """(begin, end) row ranges of each sequence in the flat token tensor."""
        out, b = [], 0
        for n in self.seq_lens:
            out.append((b, b + n))
            b += n
        return out

    @staticmethod
    def single(num_tokens: int, start: int = 0, cache: SequenceCache | None = None) -> "ForwardBatch":
        return ForwardBatch([num_tokens], [start], None if cache is None else [cache])
