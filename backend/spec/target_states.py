"""The target's hidden states a model drafter is conditioned on, per running request (DSpark, issue 16).

The runner writes, the scheduler reads (into `DraftQuery.hidden`), the engine frees. Per request the store
holds the chosen target layer states (backend/spec/dspark/target.py numbering, concatenated per row) at
the newest `window` positions the target has run *and kept*: a prefill chunk's rows, a decode's row, a
verify run's accepted rows only (the last token and the accepted drafts; rejected rows never reach it).

Invariant (what `check` asserts and tests compare with a dense forward): an entry (rows, end) holds the
states of positions [end - len(rows), end), contiguous, oldest first, len(rows) <= window. A record that
starts past `end` (positions skipped by a prefix-cache hit) drops the old rows; one that starts before
`end` (a preempted request recomputing) replaces the rows from its start on. Memory: window x features
per request (DSpark on k3-tiny: 4 x 1152 values), on the target's device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TargetStates:
    def __init__(self, layers: Sequence[int], window: int) -> None:
        """layers: target layer states to capture (target.py numbering), in concatenation order; window: how
        many of the newest positions to keep per request."""
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.layers, self.window = tuple(layers), window
        # set while the speculation governor has speculation off (the scheduler sets it with each plan): steps
        # then record nothing (per request a gather and a copy each step: at batch 64 on k3-tiny ~1 ms of a 1.9 ms
        # step); a request whose rows stop short of its next position drafts nothing until a step records again
        self.paused = False
        self._rows: dict[int, tuple[torch.Tensor, int]] = {}  # rid -> (rows [n, F], end position)

    def record(self, rid: int, start: int, rows: torch.Tensor) -> None:
        """rows [m, F]: the states of positions start .. start + m - 1 of request rid (copied)."""
        m = rows.shape[0]
        if m == 0:
            return
        rows = rows[-self.window:]
        first = start + m - rows.shape[0]
        old = self._rows.get(rid)
        if old is not None and old[1] >= first:  # no gap since the old rows (a gap drops them)
            buf, end = old
            upto = buf.shape[0] - (end - first)  # buf[:upto] are the old rows before `first`
            keep = min(max(upto, 0), self.window - rows.shape[0])
            if keep > 0:
                self._rows[rid] = (torch.cat([buf[upto - keep:upto], rows]), start + m)
                return
        self._rows[rid] = (rows.clone(), start + m)

    def get(self, rid: int) -> torch.Tensor | None:
        """The request's rows [n <= window, F], oldest first, or None before its first run."""
        entry = self._rows.get(rid)
        return None if entry is None else entry[0]

    def end(self, rid: int) -> int | None:
        """One past the newest position held for rid (None when nothing is held)."""
        entry = self._rows.get(rid)
        return None if entry is None else entry[1]

    def release(self, rid: int) -> None:
        self._rows.pop(rid, None)

    def __len__(self) -> int:
        return len(self._rows)

    def check(self, live: set[int] | None = None) -> None:
        """Raise if an entry breaks the invariant, or (live given) belongs to a request no longer running."""
        for rid, (buf, end) in self._rows.items():
            if not 1 <= buf.shape[0] <= self.window or end < buf.shape[0]:
                raise AssertionError(f"target states of request {rid}: {buf.shape[0]} rows ending at {end}")
        stale = sorted(set(self._rows) - live) if live is not None else []
        if stale:
            raise AssertionError(f"target states kept for ended requests {stale}")


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
    idx = torch.tensor([r for _, first, n, _ in spans for r in range(first, first + n)], device=device)
    rows = torch.cat([tapped[i][idx] for i in store.layers], dim=-1)  # [kept rows, len(layers) * hidden]
    at = 0
    for rid, _, n, pos in spans:
        store.record(rid, pos, rows[at:at + n])
        at += n
