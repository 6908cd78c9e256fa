"""The reference model runner: builds the varlen ForwardBatch from scheduled chunks, runs the torch
model over the page pool, writes emitted snapshot states, samples."""

from __future__ import annotations

import torch

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.runner.base import Runner, begin_step
from k3rt.backend.runner.paged_cache import PagedSequenceCache
from k3rt.backend.runner.sampling import prompt_score_rows, record_prompt_logprobs, sample_requests
from k3rt.backend.sampling.sampler import Sampler
from k3rt.backend.scheduler.scheduler import SchedulerOutput


class ModelRunner(Runner):
    def __init__(self, model: KimiForCausalLM, pool: PagePool, *, deterministic: bool = False) -> None:
        """deterministic: put the model in its batch-invariant mode (EngineConfig.deterministic)."""
        self.model, self.pool = model, pool
        model.set_batch_invariant(deterministic)
        L = pool.layout
        self.kda_slots = {layer: L.kda_slot(layer) for group in L.kda_groups for layer in group}
        self.mla_slots = {layer: i for i, layer in enumerate(L.mla_group)}
        if L.kda_groups:
            conv_shape, rec_shape = model.model.layers[L.kda_groups[0][0]].self_attn.state_shapes()
            pool.set_kda_shapes(conv_shape, rec_shape)
        self.device = pool.tensors[0].device
        self.sampler = Sampler(model.cfg.vocab_size, self.device)

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        if not out.chunks and not out.decodes:
            return {}
        chunks = begin_step(self.pool, out)
        ids, caches, seq_lens, starts, positions, logit_rows = [], [], [], [], [], []
        score_rows = prompt_score_rows(chunks)
        for c in chunks:
            r = c.req
            ids.extend(r.token_ids[c.start:c.start + c.num_tokens])
            seq_lens.append(c.num_tokens)
            starts.append(c.start)
            caches.append(PagedSequenceCache(self.pool, r.block_table, r.state_set, self.kda_slots,
                                             self.mla_slots, c.start + c.num_tokens))
            positions.append(tuple(p for p, _ in c.snapshots))
            if c.needs_logits:
                logit_rows.append(len(ids) - 1)
        rows = logit_rows + [x[1] for x in score_rows]
        batch = ForwardBatch(seq_lens, starts, caches,
                             logits_indices=torch.tensor(rows, dtype=torch.long, device=self.device),
                             state_positions=positions)
        logits = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch)
        if score_rows:
            record_prompt_logprobs(logits[len(logit_rows):], score_rows)
            logits = logits[: len(logit_rows)]
        for i, c in enumerate(chunks):
            for pos, dest in c.snapshots:
                for layer, (g, t) in self.kda_slots.items():
                    conv, rec = batch.emitted_states[(i, layer, pos)]
                    self.pool.conv[t][dest[g]].copy_(conv)
                    self.pool.rec[t][dest[g]].copy_(rec)
        return sample_requests(self.sampler, logits, [c.req for c in chunks if c.needs_logits])
