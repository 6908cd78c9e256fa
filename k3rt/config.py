"""Typed, frozen engine configuration, composed per component and passed down. No torch.

Validated in __post_init__; errors name the field and the limit. Derived values are properties.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

KDA_CHUNK = 64  # the chunked KDA kernels' chunk: snapshot grids must be multiples of it


@dataclass(frozen=True)
class CacheConfig:
    memory_gb: float | None = None  # cache pool size; None: use num_pages
    num_pages: int | None = 256  # used when memory_gb is None
    block_size: int | None = None  # tokens per MLA page; None: smallest that holds a KDA state
    hash_block_size: int = 64  # snapshot grid (prefix-cache hit granularity), multiple of KDA_CHUNK
    full_block_mode: bool = False  # baseline: hits only at block boundaries, no tails/junctions
    enable_prefix_cache: bool = True
    # rungs of the tail ladder before each prompt's end: the replay boundary (the grid point at or below
    # n - 1), then grid points 64, 128, 256, ... below it (hash_block_size doubling)
    tail_snapshots: int = 5
    # interior checkpoints of a prefill, every this many tokens (a multiple of hash_block_size), written
    # only into free pages ("value" eviction); 0: none; -1: at every physical block boundary, as before
    checkpoint_interval: int = 2048
    # eviction priority of snapshots: "value" (recompute saved per page freed, aged: GreedyDual-Size-
    # Frequency) or "lru"; the full-block baseline always uses "lru"
    eviction: str = "value"
    max_pinned_fraction: float = 0.5  # pinned snapshots (DSL programs between calls) hold at most this share
    kv_dtype: str | None = None  # None: the model's compute dtype
    conv_dtype: str | None = None  # None: the model's compute dtype
    state_dtype: str = "float32"  # KDA recurrent state
    poison_freed: bool = False  # debug: fill freed pages with NaN so a stale read cannot hide

    def __post_init__(self) -> None:
        if self.hash_block_size < KDA_CHUNK or self.hash_block_size % KDA_CHUNK:
            raise ValueError(f"hash_block_size: must be a positive multiple of {KDA_CHUNK}, got {self.hash_block_size}")
        if self.memory_gb is None and (self.num_pages is None or self.num_pages < 1):
            raise ValueError("num_pages: set memory_gb or num_pages >= 1")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"memory_gb: must be > 0, got {self.memory_gb}")
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction: {self.eviction!r} not one of value, lru")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction: must be in [0, 1], got {self.max_pinned_fraction}")
        if self.checkpoint_interval < -1 or (self.checkpoint_interval > 0
                                             and self.checkpoint_interval % self.hash_block_size):
            raise ValueError(f"checkpoint_interval: must be -1, 0 or a positive multiple of hash_block_size "
                             f"({self.hash_block_size}), got {self.checkpoint_interval}")
        if self.tail_snapshots < 1:
            raise ValueError(f"tail_snapshots: must be >= 1 (the replay boundary), got {self.tail_snapshots}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step (decode tokens first, then prefill chunks)
    max_running: int = 256
    max_waiting: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < KDA_CHUNK:
            # a smaller budget could never end a non-final chunk on the snapshot grid
            raise ValueError(f"max_num_batched_tokens: must be >= {KDA_CHUNK}, got {self.max_num_batched_tokens}")
        if self.max_running < 1:
            raise ValueError(f"max_running: must be >= 1, got {self.max_running}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint folder
    dtype: str | None = None  # compute dtype; None: the checkpoint's
    device: str = "cpu"
    tp: int = 1
    # "model": the reference torch path (any device); "gpu": fused Triton kernels, device-side batch
    # description, decode in CUDA graphs; "null": no compute, fake tokens (scheduler benchmarks);
    # "auto": gpu on a CUDA device, model elsewhere
    runner: str = "auto"
    kernels: bool = True  # gpu runner: Triton kernels (off: the same path with torch ops; tests)
    cuda_graphs: bool = True  # gpu runner: replay decode steps from captured CUDA graphs
    use_pdl: bool = False  # gpu runner: programmatic dependent launch between chained decode kernels
    random_weights: bool = False  # build the model from its config with random weights (benchmarks)
    grammar_backend: str = "llguidance"  # or "outlines"
    seed: int = 0
    # batch-invariant numerics: each request's tokens are independent of batch composition, prefill
    # chunking and prefix-cache hits (fixed-tile matmuls, per-query MLA, recurrent KDA); slower, see
    # docs/deterministic.md
    deterministic: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.runner == "auto":
            object.__setattr__(self, "runner", "gpu" if self.device.startswith("cuda") else "model")
        if self.runner not in ("model", "gpu", "null"):
            raise ValueError(f"runner: {self.runner!r} not one of auto, model, gpu, null")
        if (self.runner == "gpu" and self.kernels and not self.device.startswith("cuda")
                and os.environ.get("TRITON_INTERPRET") != "1"):
            raise ValueError(f"device: the gpu runner's Triton kernels need a CUDA device, got {self.device!r} "
                             "(use runner='model', or kernels=False for its torch-op path)")
        if self.runner == "gpu" and self.deterministic and not self.kernels:
            raise ValueError("deterministic: the gpu runner's batch-invariant mode needs its Triton kernels "
                             "(kernels=True), or use runner='model'")
        if self.runner == "gpu" and self.tp != 1:
            raise ValueError(f"tp: the gpu runner runs on one GPU (tp=1), got tp={self.tp}; use runner='model'")
        if self.grammar_backend not in ("llguidance", "outlines"):
            raise ValueError(f"grammar_backend: {self.grammar_backend!r} not one of llguidance, outlines")
        if self.tp < 1:
            raise ValueError(f"tp: must be >= 1, got {self.tp}")
