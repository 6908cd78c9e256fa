"""The page pool (DESIGN.md §4): G byte tensors [num_pages, page_size_bytes], refcounted page ids.

Ownership: a page is free (refcount 0, on the free list) or referenced by requests (block tables,
live state sets) and/or radix-tree nodes. `allocate` zeroes a page before anyone can read it,
unless the caller is about to fill it by a copy (snapshots, copy-on-write destinations): stale
NaN/Inf must never reach a norm, and a page being copied into is never zeroed under the copy.
All work runs on one stream (the pool's device's current stream), so zeroing is ordered before
the writes that follow it, and after the work of every step launched before it (overlap scheduling:
a page freed while a launched step still writes it is zeroed only after that step); no pool operation
waits for the device.

Under tensor parallelism every rank holds a pool of the same pages (its shard of each KDA state, the
whole replicated MLA latent), but only rank 0 allocates: with `record_fills()` the pool logs every
page fill (zeroing, poisoning) in order, and the runner ships the log to the other ranks with the
step, which apply it through `fill`.
"""

from __future__ import annotations

import torch

from k3rt.backend.device import to_device
from k3rt.cache_layout import CacheLayout

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, layout: CacheLayout, num_pages: int, *, device: torch.device | str = "cpu",
                 poison_freed: bool = False, materialize: bool = True) -> None:
        """materialize=False keeps only the accounting (no memory): the null runner and trace replays."""
        if num_pages < 1:
            raise ValueError(f"num_pages: need at least 1 page, got {num_pages}")
        self.layout, self.num_pages, self.poison_freed = layout, num_pages, poison_freed
        self.materialize = materialize
        rows = num_pages if materialize else 0
        self.tensors = [torch.zeros(rows, layout.page_size_bytes, dtype=torch.uint8, device=device)
                        for _ in range(layout.group_size)]
        self.refcount = [0] * num_pages
        # pop() from the end: low ids are handed out first, which keeps tests' expected ids readable
        self.free_list = list(range(num_pages - 1, -1, -1))
        self.reserved: list[int] = []  # pages held outside the scheduler (the GPU runner's padding page)
        self.allocated_total = 0  # pages handed out since start (the cache policy's clock: pool turnovers)
        self._fill_log: list[tuple[int, list[int]]] | None = None  # (byte value, pages) since take_fills
        self._views()

    def _views(self) -> None:
        L = self.layout
        kv = _TORCH_DTYPES[L.kv_dtype]
        cache_dim = L.mla_bytes_per_token // torch.empty(0, dtype=kv).element_size()
        # MLA view: [num_pages, block_size, L+R]
        self.mla = [t.view(kv).view(t.shape[0], L.block_size, cache_dim) for t in self.tensors]
        self.conv: list[torch.Tensor | None] = []
        self.rec: list[torch.Tensor | None] = []
        self._kda_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def set_kda_shapes(self, conv_shape: tuple[int, ...], rec_shape: tuple[int, ...]) -> None:
        """Define the KDA view: conv [W-1, C] in conv dtype, then recurrent [H, K, V] in state dtype."""
        L = self.layout
        cdt, sdt = _TORCH_DTYPES[L.conv_dtype], _TORCH_DTYPES[L.state_dtype]
        conv_bytes = torch.Size(conv_shape).numel() * torch.empty(0, dtype=cdt).element_size()
        rec_bytes = torch.Size(rec_shape).numel() * torch.empty(0, dtype=sdt).element_size()
        assert conv_bytes == L.kda_conv_bytes and conv_bytes + rec_bytes == L.kda_state_bytes, "KDA view mismatch"
        assert conv_bytes % 4 == 0
        self.conv = [t[:, :conv_bytes].view(cdt).view(self.num_pages, *conv_shape) for t in self.tensors]
        self.rec = [t[:, conv_bytes:conv_bytes + rec_bytes].view(sdt).view(self.num_pages, *rec_shape)
                    for t in self.tensors]
        self._kda_shapes = (conv_shape, rec_shape)

    # ---- allocation ----

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def reserve(self) -> int:
        """Take one page out of circulation for good (a scratch page that no request ever owns)."""
        page = self.allocate(1)[0]
        self.reserved.append(page)
        return page

    def allocate(self, n: int, *, zero: bool = True) -> list[int]:
        if n > len(self.free_list):
            raise OutOfPages(f"need {n} pages, {len(self.free_list)} free")
        pages = [self.free_list.pop() for _ in range(n)]
        self.allocated_total += n
        for p in pages:
            self.refcount[p] = 1
        if zero and pages:
            self.fill(pages, 0)
        return pages

    def fill(self, pages: list[int], value: int) -> None:
        """Set every byte of the pages to `value` in every tensor (logged when recording fills)."""
        if self._fill_log is not None:
            self._fill_log.append((value, list(pages)))
        if self.materialize:
            idx = self._index(pages)
            for t in self.tensors:
                t.index_fill_(0, idx, value)

    def _index(self, pages: list[int]) -> torch.Tensor:
        """Page ids as a device index without waiting for the device: a pageable host-to-device copy would
        wait for every queued step (and so undo overlap scheduling); a pinned one is queued behind them."""
        return to_device(torch.tensor(pages, dtype=torch.int64), self.tensors[0].device)

    def record_fills(self) -> None:
        """Start logging page fills (tensor parallelism: other ranks replay them)."""
        self._fill_log = []

    def take_fills(self) -> list[tuple[int, list[int]]]:
        """The fills since the last call, in order; the log starts over."""
        if self._fill_log is None:
            return []
        out, self._fill_log = self._fill_log, []
        return out

    def ref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"ref of free page {p}"
            self.refcount[p] += 1

    def unref(self, pages: list[int]) -> None:
        freed = []
        for p in pages:
            assert self.refcount[p] > 0, f"unref of free page {p}"
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                freed.append(p)
        if freed and self.poison_freed:
            self.fill(freed, 0xFF)  # all-ones bytes: NaN in every float view
        self.free_list.extend(reversed(freed))

    # ---- copies (copy-on-write, snapshots) ----

    def copy_pages(self, src: list[int], dst: list[int], tensors: int | None = None) -> None:
        """Copy whole pages src[i] -> dst[i] in the first `tensors` tensors (default all)."""
        if not src:
            return
        s, d = self._index(src), self._index(dst)
        for t in self.tensors[: tensors or len(self.tensors)]:
            t.index_copy_(0, d, t.index_select(0, s))

    def copy_state_set(self, src: list[int], dst: list[int]) -> None:
        """Copy a KDA state set (one page per KDA group) into another."""
        L = self.layout
        for g, (s, d) in enumerate(zip(src, dst)):
            n = len(L.kda_groups[g])
            for t in self.tensors[:n]:
                t[d, : L.kda_state_bytes].copy_(t[s, : L.kda_state_bytes])
