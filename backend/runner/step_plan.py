"""A step as a StepPlan: built on rank 0 from the scheduler's output, run on every rank.

`build_plan` turns a SchedulerOutput (plus the pool's fill log) into the plain-int StepPlan;
`PlanExecutor.run` applies a plan's cache operations to this rank's pool, runs the forward on this
rank's model shard and writes the emitted snapshot states, returning the logits of the plan's
logits rows (the full vocabulary on rank 0, gathered there; a worker's own vocabulary slice). Rank 0 and the workers run the same `run`, so their caches stay identical
(per shard) by construction. Sampling is not here: it needs the requests, which only rank 0 has.
"""

from __future__ import annotations

import torch

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.distributed.plan import PlanSeq, StepPlan
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.runner.paged_cache import PagedSequenceCache
from k3rt.backend.scheduler.scheduler import ScheduledChunk, SchedulerOutput


def step_chunks(out: SchedulerOutput) -> list[ScheduledChunk]:
    """The step's work as chunks, decodes first (a decode is a one-token chunk at num_computed that is
    always sampled)."""
    return [ScheduledChunk(r, r.num_computed, 1, True) for r in out.decodes] + out.chunks


def build_plan(out: SchedulerOutput, chunks: list[ScheduledChunk], fills: list[tuple[int, list[int]]],
               score_rows: list[tuple[object, int, int]], block_size: int) -> StepPlan:
    """chunks: step_chunks(out); score_rows: prompt_score_rows(chunks). Logit rows: the sampled rows of plain
    chunks, then every fed row of the verify chunks (speculative decoding: the last token and its drafts),
    then the scored prompt rows."""
    ids: list[int] = []
    seqs, logit_rows, verify_rows, verify = [], [], [], []
    for c in chunks:
        r = c.req
        end = c.start + c.num_fed
        ids.extend(r.token_ids[c.start:c.start + c.num_tokens])
        ids.extend(c.draft_ids)
        seqs.append(PlanSeq(c.start, c.num_fed, tuple(r.block_table[:-(-end // block_size)]),
                            None if r.state_set is None else tuple(r.state_set),
                            tuple((p, tuple(d)) for p, d in c.snapshots)))
        verify.append(bool(c.draft_ids))
        if c.draft_ids:
            verify_rows.extend(range(len(ids) - c.num_fed, len(ids)))
        elif c.needs_logits:
            logit_rows.append(len(ids) - 1)
    return StepPlan(fills=tuple((v, tuple(p)) for v, p in fills), page_copies=tuple(out.page_copies),
                    state_copies=tuple((tuple(s), tuple(d)) for s, d in out.state_copies), seqs=tuple(seqs),
                    token_ids=tuple(ids),
                    logits_rows=tuple(logit_rows) + tuple(verify_rows) + tuple(x[1] for x in score_rows),
                    verify=tuple(verify) if any(verify) else ())


def apply_cache_ops(pool: PagePool, plan: StepPlan, *, apply_fills: bool = True) -> None:
    """The plan's fills, page copies and state copies, in that order (every runner's workers)."""
    for value, pages in plan.fills if apply_fills else ():
        pool.fill(list(pages), value)
    if plan.page_copies:
        src, dst = zip(*plan.page_copies)
        pool.copy_pages(list(src), list(dst), tensors=len(pool.layout.mla_group))
    for src, dst in plan.state_copies:
        pool.copy_state_set(list(src), list(dst))


class PlanExecutor:
    """Runs plans on one rank: its model shard over its pool."""

    def __init__(self, model: KimiForCausalLM, pool: PagePool) -> None:
        self.model, self.pool = model, pool
        L = pool.layout
        self.kda_slots = {layer: L.kda_slot(layer) for group in L.kda_groups for layer in group}
        self.mla_slots = {layer: i for i, layer in enumerate(L.mla_group)}
        if L.kda_groups:
            conv_shape, rec_shape = model.model.layers[L.kda_groups[0][0]].self_attn.state_shapes()
            pool.set_kda_shapes(conv_shape, rec_shape)
        self.device = pool.tensors[0].device

    def apply_cache_ops(self, plan: StepPlan, *, apply_fills: bool = True) -> None:
        apply_cache_ops(self.pool, plan, apply_fills=apply_fills)

    def run(self, plan: StepPlan, *, apply_fills: bool = True) -> torch.Tensor | None:
        """Cache operations, forward, snapshot writes; -> fp32 logits [len(plan.logits_rows), vocab] (rank 0;
        None for a plan without sequences). apply_fills=False on the rank whose pool made the fills."""
        return self.run_batch(plan, apply_fills=apply_fills)[0]

    def run_batch(self, plan: StepPlan, *, apply_fills: bool = True) -> tuple[torch.Tensor | None, ForwardBatch | None]:
        """`run`, also returning the step's ForwardBatch (a verify step's commit reads its stashed inputs)."""
        self.apply_cache_ops(plan, apply_fills=apply_fills)
        if not plan.seqs:
            return None, None
        caches = [PagedSequenceCache(self.pool, list(q.block_table), None if q.state_set is None else list(q.state_set),
                                     self.kda_slots, self.mla_slots, q.start + q.num_tokens) for q in plan.seqs]
        batch = ForwardBatch([q.num_tokens for q in plan.seqs], [q.start for q in plan.seqs], caches,
                             logits_indices=torch.tensor(plan.logits_rows, dtype=torch.long, device=self.device),
                             state_positions=[tuple(p for p, _ in q.snapshots) for q in plan.seqs],
                             verify=list(plan.verify) if plan.verify else None)
        logits = self.model(torch.tensor(plan.token_ids, dtype=torch.long, device=self.device), batch)
        for i, q in enumerate(plan.seqs):
            for pos, dest in q.snapshots:
                for layer, (g, t) in self.kda_slots.items():
                    conv, rec = batch.emitted_states[(i, layer, pos)]
                    self.pool.conv[t][dest[g]].copy_(conv)
                    self.pool.rec[t][dest[g]].copy_(rec)
        return logits, batch
