"""A sequence's view of the page pool, behind the model's SequenceCache interface.

MLA layers write latent rows into the pages of the request's block table and read back every
row 0..end-1; KDA layers get in-place views of the request's live state set. The model code is the
same one that runs on ContiguousCache.
"""

from __future__ import annotations

import torch

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.models.batch import SequenceCache


class PagedSequenceCache(SequenceCache):
    def __init__(self, pool: PagePool, block_table: list[int], state_set: list[int] | None,
                 kda_slots: dict[int, tuple[int, int]], mla_slots: dict[int, int], end: int) -> None:
        self.pool, self.state_set = pool, state_set
        self.kda_slots, self.mla_slots = kda_slots, mla_slots
        B = pool.layout.block_size
        dev = pool.tensors[0].device
        pos = torch.arange(end, device=dev)
        table = torch.tensor(block_table, dtype=torch.long, device=dev)
        # cache position -> (page, offset in page), for positions 0..end-1 of this step
        self.page_of = table[pos // B] if end else pos
        self.off_of = pos % B

    def kda_state(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, t = self.kda_slots[layer_idx]
        assert self.state_set is not None
        page = self.state_set[g]
        return self.pool.conv[t][page], self.pool.rec[t][page]

    def mla_extend(self, layer_idx: int, start: int, latent: torch.Tensor) -> torch.Tensor:
        view = self.pool.mla[self.mla_slots[layer_idx]]
        end = start + latent.shape[0]
        view[self.page_of[start:end], self.off_of[start:end]] = latent.to(view.dtype)
        return view[self.page_of[:end], self.off_of[:end]]
