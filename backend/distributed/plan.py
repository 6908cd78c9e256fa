"""The step plan: everything a rank needs to replay one engine step on its shard, as plain ints.

Rank 0 (the scheduler) builds one `StepPlan` per step from its SchedulerOutput and the pool's fill
log; under tensor parallelism it travels to every worker as ONE int64 tensor (`pack`/`unpack`), and
every rank, rank 0 included, runs the same plan (`runner/step.py`). It knows no requests, sampling
parameters or grammars: sampling happens on rank 0 alone, after the vocab-parallel logits are
gathered, so nothing random has to agree across ranks.

Order of application on every rank: fills (zeroing / poisoning of pages, in the order the pool did
them), page copies (copy-on-write), state copies (snapshot -> live state set), the forward, then the
emitted snapshot states written to their destinations.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class PlanKind(IntEnum):
    RUN = 0  # a step: apply the cache operations, run the forward
    HEARTBEAT = 1  # nothing to do; keeps an idle engine's collectives inside their timeout
    STOP = 2  # the engine is shutting down: leave the loop and exit 0


@dataclass(frozen=True)
class PlanSeq:
    """One sequence's slice of the step (a prefill chunk or a one-token decode)."""

    start: int  # absolute position of the first fed token (tokens already in the cache)
    num_tokens: int
    block_table: tuple[int, ...]  # MLA page ids covering positions 0..start+num_tokens-1
    state_set: tuple[int, ...] | None  # live KDA state set (one page per KDA group); None: no KDA layers
    snapshots: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (absolute position, destination state set)


@dataclass(frozen=True)
class StepPlan:
    kind: PlanKind = PlanKind.RUN
    fills: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (byte value, page ids), in pool order
    page_copies: tuple[tuple[int, int], ...] = ()  # (src page, dst page), MLA group tensors
    state_copies: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()  # (src state set, dst state set)
    seqs: tuple[PlanSeq, ...] = ()
    token_ids: tuple[int, ...] = ()  # flat: seqs[0]'s tokens, then seqs[1]'s, ...
    logits_rows: tuple[int, ...] = ()  # rows of the flat hidden state whose logits the step returns
    # per seq: a verify chunk of speculative decoding (logits at every fed row; KDA states left for the
    # commit after verification). Rank 0 only: not packed, since speculation is refused under TP (the
    # commit of the accepted runs would need a second message to the workers)
    verify: tuple[bool, ...] = ()
    # the GPU runner's decode graph the step replays (its batch size; 0: the step runs eagerly). Every rank must
    # make the same choice: a replay pads the batch to the graph's size, so its collectives have other shapes
    graph: int = 0
    # the GPU runner's piecewise bucket for a step with prefill rows (its token count; 0: not run piecewise). Each
    # rank decides it from the step itself; a worker checks its own choice against rank 0's, since a different
    # bucket pads the pieces' collectives to other shapes (gloo aborts a process; NCCL may hang or sum unrelated rows)
    mixed: int = 0

    def pack(self) -> torch.Tensor:
        """This plan as one CPU int64 tensor (unpack(pack(p)) == p)."""
        out: list[int] = [int(self.kind), len(self.fills)]
        for value, pages in self.fills:
            out += [value, len(pages), *pages]
        out.append(len(self.page_copies))
        for s, d in self.page_copies:
            out += [s, d]
        out.append(len(self.state_copies))
        for s, d in self.state_copies:
            out += [len(s), *s, *d]
        out.append(len(self.seqs))
        for q in self.seqs:
            out += [q.start, q.num_tokens, len(q.block_table), *q.block_table]
            out += [-1] if q.state_set is None else [len(q.state_set), *q.state_set]
            out.append(len(q.snapshots))
            for pos, dest in q.snapshots:
                out += [pos, len(dest), *dest]
        out += [len(self.token_ids), *self.token_ids, len(self.logits_rows), *self.logits_rows, self.graph,
                self.mixed]
        return torch.tensor(out, dtype=torch.int64)

    @staticmethod
    def unpack(t: torch.Tensor) -> "StepPlan":
        r = _Reader(t.tolist())
        kind = PlanKind(r.one())
        fills = tuple((r.one(), r.many(r.one())) for _ in range(r.one()))
        page_copies = tuple((r.one(), r.one()) for _ in range(r.one()))
        state_copies = []
        for _ in range(r.one()):
            n = r.one()
            state_copies.append((r.many(n), r.many(n)))
        seqs = []
        for _ in range(r.one()):
            start, num, table = r.one(), r.one(), r.many(r.one())
            n = r.one()
            state = None if n < 0 else r.many(n)
            snaps = tuple((r.one(), r.many(r.one())) for _ in range(r.one()))
            seqs.append(PlanSeq(start, num, table, state, snaps))
        token_ids = r.many(r.one())
        rows = r.many(r.one())
        graph, mixed = r.one(), r.one()
        if r.i != len(r.data):
            raise ValueError(f"step plan: {len(r.data) - r.i} trailing values after unpacking")
        return StepPlan(kind, fills, page_copies, tuple(state_copies), tuple(seqs), token_ids, rows, graph=graph,
                         mixed=mixed)


class _Reader:
    def __init__(self, data: list[int]) -> None:
        self.data, self.i = data, 0

    def one(self) -> int:
        self.i += 1
        return self.data[self.i - 1]

    def many(self, n: int) -> tuple[int, ...]:
        self.i += n
        return tuple(self.data[self.i - n:self.i])
