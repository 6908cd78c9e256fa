"""The target's hidden states a model drafter is conditioned on, per running request (DSpark, issue 16).

The runner writes, the scheduler reads (into `DraftQuery.hidden`), the engine frees. Per request the store
holds the chosen target layer states (backend/spec/dspark/target.py numbering, concatenated per row) at
the newest `window` positions the target has run *and kept*: a prefill chunk's rows, a decode's row, a
verify run's accepted rows only (the last token and the accepted drafts; rejected rows never reach it).

Invariant (what `check` asserts and tests compare with a dense forward): an entry (rows, end) holds the
states of positions [end - len(rows), end), contiguous, oldest first, len(rows) <= window. A record that
starts past `end` (positions skipped by a prefix-cache hit) drops the old rows; one that starts before
`end` (a preempted request recomputing) replaces the rows from its start on. Memory: 2 x window x features
per request (DSpark on k3-tiny: 2 x 128 x 1152 values), in one pool on the target's device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from k3rt.backend.device import to_device


class TargetStates:
    def __init__(self, layers: Sequence[int], window: int) -> None:
        """layers: target layer states to capture (target.py numbering), in concatenation order; window: how
        many of the newest positions to keep per request."""
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.layers, self.window = tuple(layers), window
        # set while the speculation governor has speculation off (the scheduler sets it with each plan): steps
        # then record nothing; a request whose rows stop short of its next position drafts nothing until a step
        # records again
        self.paused = False
        # every request's rows live in one pool [slots, 2 * window, F] (allocated at the first record, doubled when
        # full): slot rows 0.. hold positions base.. of the request, so a step appends without moving what is held
        # and a record of every request's new rows is one indexed write. When a request's rows reach the slot's end
        # the held ones move to its front (one copy per `window` positions). Before, each record rebuilt the
        # request's [window, F] tensor (a cat per request and step: 64 copies of up to 128 x 1152 values per step at
        # batch 64 on k3-tiny, ~1 ms of host time against a ~2 ms step on the H200)
        self._pool: torch.Tensor | None = None
        self._free: list[int] = []
        self._held: dict[int, list[int]] = {}  # rid -> [slot, base, lo, end]: positions [lo, end) at rows lo - base..

    def _alloc(self, like: torch.Tensor) -> int:
        if self._pool is None:
            self._pool = like.new_empty(8, 2 * self.window, like.shape[-1])
            self._free = list(range(8))[::-1]
        elif like.shape[-1] != self._pool.shape[-1]:
            raise ValueError(f"target states: rows of {like.shape[-1]} features, the store holds "
                             f"{self._pool.shape[-1]}")
        if not self._free:
            n = self._pool.shape[0]
            pool = self._pool.new_empty(2 * n, *self._pool.shape[1:])
            pool[:n] = self._pool
            self._pool, self._free = pool, list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def record(self, rid: int, start: int, rows: torch.Tensor) -> None:
        """rows [m, F]: the states of positions start .. start + m - 1 of request rid (copied)."""
        self.record_many([(rid, start, rows.shape[0])], rows)

    def record_many(self, spans: Sequence[tuple[int, int, int]], rows: torch.Tensor) -> None:
        """Several records in one indexed write: spans (rid, start, m), their rows concatenated in `rows`
        [sum m, F]. Per request as `record`: the newest `window` of the positions held; a record that starts past
        the held rows' end (positions skipped by a prefix-cache hit) drops them, one that starts before it (a
        preempted request recomputing) replaces the rows from its start on."""
        W = self.window
        dst: list[tuple[int, int]] = []  # runs (first row, rows): pool rows (flat over slots) written...
        src: list[tuple[int, int]] = []  # ...from these rows of `rows`
        at = 0
        for rid, start, m in spans:
            if m <= 0:
                continue
            n = min(m, W)
            first, new_end = start + m - n, start + m
            held = self._held.get(rid)
            if held is None:
                held = self._held[rid] = [self._alloc(rows), first, first, first]
            slot, base, lo, end = held
            if end >= first:  # no gap since the rows held: keep the newest of those before `first`
                keep = min(max(first - lo, 0), W - n)
            else:
                keep = 0
            new_lo = first - keep
            if keep == 0:
                base = new_lo
            elif new_end - base > 2 * W:  # the slot's end: the kept rows to its front
                self._write(dst, src, rows)  # (the rows written so far first: a request recorded twice)
                dst, src = [], []
                self._pool[slot, :keep] = self._pool[slot, new_lo - base:new_lo - base + keep].clone()
                base = new_lo
            held[1:] = [base, new_lo, new_end]
            dst.append((slot * 2 * W + first - base, n))
            src.append((at + m - n, n))
            at += m
        self._write(dst, src, rows)

    def _write(self, dst: list[tuple[int, int]], src: list[tuple[int, int]], rows: torch.Tensor) -> None:
        """pool rows dst (flat over slots) = rows[src], one indexed copy; dst and src as runs (first, count)."""
        if not dst:
            return
        d, s = _runs(dst), _runs(src)
        # src ascends over distinct rows: as many as `rows` has, it takes them all in order (no gather)
        whole = s.size == rows.shape[0]
        idx = to_device(torch.from_numpy(d if whole else np.stack([d, s])), rows.device)
        flat = self._pool.view(-1, self._pool.shape[-1])
        if whole:
            flat[idx] = rows.to(flat.dtype)
        else:
            flat[idx[0]] = rows[idx[1]].to(flat.dtype)

    def get(self, rid: int) -> torch.Tensor | None:
        """The request's rows [n <= window, F], oldest first, or None before its first run: a view of the store,
        valid until the request's next record (use it within the step)."""
        held = self._held.get(rid)
        if held is None:
            return None
        slot, base, lo, end = held
        return self._pool[slot, lo - base:end - base]

    def held(self, rid: int) -> int:
        """How many positions are held for rid (0: none), without touching the device."""
        held = self._held.get(rid)
        return 0 if held is None else held[3] - held[2]

    def end(self, rid: int) -> int | None:
        """One past the newest position held for rid (None when nothing is held)."""
        held = self._held.get(rid)
        return None if held is None else held[3]

    def release(self, rid: int) -> None:
        held = self._held.pop(rid, None)
        if held is not None:
            self._free.append(held[0])

    def __len__(self) -> int:
        return len(self._held)

    def check(self, live: set[int] | None = None) -> None:
        """Raise if an entry breaks the invariant, or (live given) belongs to a request no longer running."""
        slots = [h[0] for h in self._held.values()]
        if len(set(slots)) != len(slots) or set(slots) & set(self._free):
            raise AssertionError(f"target states: slots shared or both held and free ({sorted(slots)})")
        for rid, (_, base, lo, end) in self._held.items():
            if not (1 <= end - lo <= self.window and base <= lo and end - base <= 2 * self.window):
                raise AssertionError(f"target states of request {rid}: positions [{lo}, {end}) from base {base}")
        stale = sorted(set(self._held) - live) if live is not None else []
        if stale:
            raise AssertionError(f"target states kept for ended requests {stale}")


def _runs(runs: Sequence[tuple[int, int]]) -> np.ndarray:
    """The int64 rows first, first + 1, ... of each run (first, count), concatenated: built in numpy (a Python list
    of every row, then torch.tensor of it, cost ~0.3 ms of host time per prefill step of 9 x 96 rows on the CI
    machine; these steps are host-bound)."""
    firsts = np.fromiter((f for f, _ in runs), dtype=np.int64, count=len(runs))
    counts = np.fromiter((n for _, n in runs), dtype=np.int64, count=len(runs))
    offsets = np.cumsum(counts) - counts
    return np.repeat(firsts - offsets, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def record_step_states(store: TargetStates, chunks: Sequence, tapped: dict[int, torch.Tensor],
                       kept: dict[int, int]) -> None:
    """After a step: tapped maps each of store.layers to its states [rows, hidden], packed in chunk order (each
    chunk num_fed rows, padding after); kept: chunk index -> rows of a verify chunk that were accepted (its
    run's fed tokens). Every other chunk keeps all its num_tokens rows. Requests that never speculate
    (speculative=False) are skipped. Only the rows kept (at most `window` per request) are gathered, in one
    index per layer, so a long prefill chunk costs no copy of its whole hidden state."""
    if store.paused:
        return
    missing = [i for i in store.layers if i not in tapped]
    if missing:
        raise RuntimeError(f"target states of layers {missing} were not captured (no forward ran?)")
    row, w = 0, store.window
    spans: list[tuple[int, int, int, int]] = []  # (request id, first row, rows, position of the first row)
    for i, c in enumerate(chunks):
        n = kept.get(i, c.num_tokens)
        if c.req.params.speculative and n > 0:
            lo = max(0, n - w)
            spans.append((c.req.rid, row + lo, n - lo, c.start + lo))
        row += c.num_fed
    if not spans:
        return
    device = tapped[store.layers[0]].device
    idx = to_device(torch.from_numpy(_runs([(first, n) for _, first, n, _ in spans])), device)
    rows = torch.cat([tapped[i][idx] for i in store.layers], dim=-1)  # [kept rows, len(layers) * hidden]
    store.record_many([(rid, pos, n) for rid, _, n, pos in spans], rows)
