"""The reference model runner: builds the varlen ForwardBatch from scheduled chunks, runs the torch
model over the page pool, writes emitted snapshot states, samples. A verify chunk (speculative decoding)
gets logits at every fed position; after verification its KDA states advance by the accepted run only."""

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
from k3rt.backend.spec.rejection import verify_requests


class ModelRunner(Runner):
    def __init__(self, model: KimiForCausalLM, pool: PagePool) -> None:
        self.model, self.pool = model, pool
        L = pool.layout
        self.kda_slots = {layer: L.kda_slot(layer) for group in L.kda_groups for layer in group}
        self.mla_slots = {layer: i for i, layer in enumerate(L.mla_group)}
        if L.kda_groups:
            conv_shape, rec_shape = model.model.layers[L.kda_groups[0][0]].self_attn.state_shapes()
            pool.set_kda_shapes(conv_shape, rec_shape)
        self.device = pool.tensors[0].device
        self.sampler = Sampler(model.cfg.vocab_size, self.device)

    def execute(self, out: SchedulerOutput) -> dict[int, int | list[int]]:
        if not out.chunks and not out.decodes:
            return {}
        chunks = begin_step(self.pool, out)
        ids, caches, seq_lens, starts, positions, logit_rows, verify_rows = [], [], [], [], [], [], []
        score_rows = prompt_score_rows(chunks)
        for c in chunks:
            r = c.req
            ids.extend(r.token_ids[c.start:c.start + c.num_tokens])
            ids.extend(c.draft_ids)
            seq_lens.append(c.num_fed)
            starts.append(c.start)
            caches.append(PagedSequenceCache(self.pool, r.block_table, r.state_set, self.kda_slots,
                                             self.mla_slots, c.start + c.num_fed))
            positions.append(tuple(p for p, _ in c.snapshots))
            if c.draft_ids:
                verify_rows.extend(range(len(ids) - c.num_fed, len(ids)))
            elif c.needs_logits:
                logit_rows.append(len(ids) - 1)
        rows = logit_rows + verify_rows + [x[1] for x in score_rows]
        verify = [bool(c.draft_ids) for c in chunks]
        batch = ForwardBatch(seq_lens, starts, caches,
                             logits_indices=torch.tensor(rows, dtype=torch.long, device=self.device),
                             state_positions=positions, verify=verify if any(verify) else None)
        logits = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch)
        n_plain, n_verify = len(logit_rows), len(verify_rows)
        if score_rows:
            record_prompt_logprobs(logits[n_plain + n_verify:], score_rows)
        for i, c in enumerate(chunks):
            for pos, dest in c.snapshots:
                for layer, (g, t) in self.kda_slots.items():
                    conv, rec = batch.emitted_states[(i, layer, pos)]
                    self.pool.conv[t][dest[g]].copy_(conv)
                    self.pool.rec[t][dest[g]].copy_(rec)
        sampled: dict[int, int | list[int]] = sample_requests(
            self.sampler, logits[:n_plain], [c.req for c in chunks if c.needs_logits and not c.draft_ids])
        if n_verify:
            seqs = [i for i, c in enumerate(chunks) if c.draft_ids]
            reqs = [chunks[i].req for i in seqs]
            results = verify_requests(self.sampler, logits[n_plain:n_plain + n_verify], reqs,
                                      [chunks[i].draft_ids for i in seqs])
            for i, r, res in zip(seqs, reqs, results):
                # the fed tokens of the run: the last token and the accepted drafts, one per emitted token
                self.model.commit_verified(batch, i, len(res.token_ids))
                r.sampled.run_logprobs, r.sampled.run_top_logprobs = res.logprobs, res.top_logprobs
                sampled[r.rid] = res.token_ids
        return sampled
