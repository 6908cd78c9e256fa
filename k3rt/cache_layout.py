"""How cache memory is cut into pages (DESIGN.md §4), from the model config alone (no torch).

One pool of pages of `page_size_bytes`. Layers are split into groups of equal size: all MLA
layers in one group, KDA layers in as many groups as needed. The pool is one tensor per in-group
layer index; layer i of every group views tensor i, so a page id means something for every layer
of the group it is allocated to.

  MLA view of a page: [block_size, kv_lora_rank + qk_rope_head_dim] in the KV dtype.
  KDA view of a page: one sequence's conv state then recurrent state for one layer, then padding.
  A sequence's full KDA state is a *state set*: one page in each KDA group.

`block_size` is the smallest multiple of the MLA kernels' alignment whose page holds one KDA state.
k3rt's own MLA kernels tile the token axis in 16s, so the alignment is 16 (not the 64/128 of
kernels k3rt does not use): that is what keeps padding under 2% at every TP degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3rt.model_config import _DTYPE_BYTES, ModelConfig

MLA_ALIGNMENT = 16  # tokens; the MLA kernels' token-tile size


@dataclass(frozen=True)
class CacheLayout:
    block_size: int  # tokens per MLA page
    page_size_bytes: int
    kda_conv_bytes: int  # one layer, one sequence, this rank
    kda_state_bytes: int  # conv + recurrent, one layer, one sequence, this rank
    mla_bytes_per_token: int  # one layer
    group_size: int  # tensors in the pool = layers per group
    mla_group: tuple[int, ...]  # layer ids of the MLA group, in tensor order
    kda_groups: tuple[tuple[int, ...], ...]  # layer ids of each KDA group, in tensor order
    kv_dtype: str
    conv_dtype: str
    state_dtype: str

    @property
    def padding_fraction(self) -> float:
        """Share of a page a KDA state leaves unused (MLA pages are full by construction)."""
        return 0.0 if not self.kda_groups else (self.page_size_bytes - self.kda_state_bytes) / self.page_size_bytes

    @property
    def pages_per_state_set(self) -> int:
        return len(self.kda_groups)

    @property
    def bytes_per_page_all_tensors(self) -> int:
        return self.page_size_bytes * self.group_size

    def num_pages(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_page_all_tensors

    def kda_slot(self, layer: int) -> tuple[int, int]:
        """(group index, tensor index) of a KDA layer."""
        for g, layers in enumerate(self.kda_groups):
            if layer in layers:
                return g, layers.index(layer)
        raise KeyError(f"layer {layer} is not a KDA layer")

    def as_dict(self) -> dict:
        return {
            "block_size": self.block_size, "page_size_bytes": self.page_size_bytes,
            "kda_state_bytes": self.kda_state_bytes, "mla_bytes_per_token": self.mla_bytes_per_token,
            "padding_fraction": round(self.padding_fraction, 6), "group_size": self.group_size,
            "num_kda_groups": len(self.kda_groups), "pages_per_state_set": self.pages_per_state_set,
        }


def compute_layout(cfg: ModelConfig, *, tp: int = 1, kv_dtype: str = "bfloat16", conv_dtype: str = "bfloat16",
                   state_dtype: str = "float32", block_size: int | None = None) -> CacheLayout:
    for name, dt in (("kv_dtype", kv_dtype), ("conv_dtype", conv_dtype), ("state_dtype", state_dtype)):
        if dt not in _DTYPE_BYTES:
            raise ValueError(f"{name}: {dt!r} not one of {sorted(_DTYPE_BYTES)}")
    st = cfg.kda_state_bytes(tp, conv_dtype, state_dtype)
    kda_bytes = st["total"] if cfg.kda_layers else 0
    per_tok = cfg.mla_bytes_per_token(kv_dtype)
    need = max(1, math.ceil(kda_bytes / per_tok))
    auto = MLA_ALIGNMENT * math.ceil(need / MLA_ALIGNMENT)
    if block_size is None:
        block_size = auto
    elif block_size % MLA_ALIGNMENT or block_size * per_tok < kda_bytes:
        raise ValueError(f"block_size: {block_size} must be a multiple of {MLA_ALIGNMENT} and hold one KDA state "
                         f"({kda_bytes} B = {need} tokens of MLA KV); smallest valid is {auto}")
    mla = tuple(cfg.mla_layers)
    kda = tuple(cfg.kda_layers)
    g = max(len(mla), 1)
    groups = tuple(kda[i:i + g] for i in range(0, len(kda), g))
    return CacheLayout(
        block_size=block_size, page_size_bytes=block_size * per_tok, kda_conv_bytes=st["conv"],
        kda_state_bytes=kda_bytes, mla_bytes_per_token=per_tok, group_size=g, mla_group=mla, kda_groups=groups,
        kv_dtype=kv_dtype, conv_dtype=conv_dtype, state_dtype=state_dtype,
    )
