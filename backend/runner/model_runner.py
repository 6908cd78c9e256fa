"""The reference model runner: turns each scheduled step into a StepPlan, runs it over the page pool
with the torch model (on every tensor-parallel rank when there are several), then samples on this
rank (rank 0) from the gathered full-vocabulary logits. A verify chunk (speculative decoding, a single
rank only) gets logits at every fed position; after verification its KDA states advance by the accepted
run only. With a model drafter (DSpark) the runner also records, per speculating request, the target layer
states the drafter reads at the kept positions (backend/spec/target_states.py), captured by forward hooks."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.distributed.channel import PlanSender
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.runner.base import LaunchedStep, Runner, pending_tokens
from k3rt.backend.runner.sampling import prompt_score_rows, record_prompt_logprobs, sample_requests
from k3rt.backend.runner.step_plan import PlanExecutor, build_plan, step_chunks
from k3rt.backend.sampling.sampler import Sampler
from k3rt.backend.scheduler.scheduler import SchedulerOutput
from k3rt.backend.spec.dspark.target import capture_states
from k3rt.backend.spec.rejection import verify_requests
from k3rt.backend.spec.target_states import TargetStates, record_step_states


class ModelRunner(Runner):
    def __init__(self, model: KimiForCausalLM, pool: PagePool, *, sender: PlanSender | None = None,
                 deterministic: bool = False, target_states: TargetStates | None = None) -> None:
        """sender: the tensor-parallel workers' plan channel (None: a single rank). deterministic: put the
        model in its batch-invariant mode (EngineConfig.deterministic; single rank). target_states: where
        to record the target states a model drafter reads (single rank), or None."""
        if target_states is not None and sender is not None:
            raise ValueError("spec: a model drafter's target states are captured on a single rank only")
        self.model, self.pool, self.sender = model, pool, sender
        self.target_states = target_states
        model.set_batch_invariant(deterministic)
        self.executor = PlanExecutor(model, pool)
        self.device = self.executor.device
        self.sampler = Sampler(model.cfg.vocab_size, self.device)
        if sender is not None:
            pool.record_fills()

    def execute(self, out: SchedulerOutput) -> dict[int, int | list[int]]:
        return self._execute(out, None)

    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """No asynchronous device here: the step runs now; the engine still learns its tokens one step late."""
        return LaunchedStep(sampled=self._execute(out, prev))

    def _execute(self, out: SchedulerOutput, prev: LaunchedStep | None) -> dict[int, int | list[int]]:
        if not out.chunks and not out.decodes:
            return {}
        return self._run(*self._prepare(out, prev), prev)

    def _prepare(self, out: SchedulerOutput, prev: LaunchedStep | None) -> tuple:
        """The host half of a step, read from the requests now: (chunks, score rows, plan, pending rows)."""
        chunks = step_chunks(out)
        score_rows = prompt_score_rows(chunks)
        # single rank: the pool already applied its fills; the plan carries none (fill log off)
        plan = build_plan(out, chunks, self.pool.take_fills(), score_rows, self.pool.layout.block_size)
        return chunks, score_rows, plan, pending_tokens(chunks, prev)

    def _run(self, chunks: list, score_rows: list, plan, pending: dict[int, int],
             prev: LaunchedStep | None) -> dict[int, int | list[int]]:
        if pending:  # the previous step's tokens, fed where its requests continue
            ids = list(plan.token_ids)
            for row, rid in pending.items():
                ids[row] = prev.sampled[rid]
            plan = replace(plan, token_ids=tuple(ids))
        # this pool applied the fills when it allocated; the other ranks replay them from the plan
        if self.sender is None:
            store = self.target_states
            with capture_states(self.model, store.layers) if store is not None else nullcontext() as got:
                logits, batch = self.executor.run_batch(plan, apply_fills=False)
        else:
            if plan.verify:
                raise RuntimeError("speculative decoding does not run under tensor parallelism yet")
            with self.sender.step(plan):
                logits, batch = self.executor.run_batch(plan, apply_fills=False)
        plain = [c for c in chunks if c.needs_logits and not c.draft_ids]
        n_plain, n_verify = len(plain), sum(c.num_fed for c in chunks if c.draft_ids)
        if score_rows:
            record_prompt_logprobs(logits[n_plain + n_verify:], score_rows)
        sampled: dict[int, int | list[int]] = sample_requests(self.sampler, logits[:n_plain], [c.req for c in plain])
        kept: dict[int, int] = {}  # verify chunk -> its accepted run's fed tokens
        if n_verify:
            seqs = [i for i, c in enumerate(chunks) if c.draft_ids]
            reqs = [chunks[i].req for i in seqs]
            results = verify_requests(self.sampler, logits[n_plain:n_plain + n_verify], reqs,
                                      [chunks[i].draft_ids for i in seqs])
            for i, r, res in zip(seqs, reqs, results):
                # the fed tokens of the run: the last token and the accepted drafts, one per emitted token
                self.model.commit_verified(batch, i, len(res.token_ids))
                kept[i] = len(res.token_ids)
                r.sampled.run_logprobs, r.sampled.run_top_logprobs = res.logprobs, res.top_logprobs
                sampled[r.rid] = res.token_ids
        if self.target_states is not None:
            record_step_states(self.target_states, chunks, got, kept)
        return sampled

    def release(self, rid: int) -> None:
        if self.target_states is not None:
            self.target_states.release(rid)
