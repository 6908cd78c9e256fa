"""The offline engine: schedule -> run -> update, over one page pool and the radix prefix cache.

`Engine(EngineConfig(...))` loads the model (or uses the null runner), sizes the pool from the
cache config and the model's layout, and exposes `add_request` / `step` / `abort` for streaming
callers and `generate` for batch use. It knows nothing of tokenization or HTTP.
"""

from __future__ import annotations

import itertools
import logging
from array import array
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.cache.policy import CachePolicy
from k3rt.backend.cache.radix import RadixCache
from k3rt.backend.engine_stats import QUEUE_WAIT_BUCKETS_S, STEP_TIME_BUCKETS_S, Histogram, engine_stats
from k3rt.backend.runner.base import Runner
from k3rt.backend.scheduler.request import FinishReason, Request
from k3rt.backend.scheduler.scheduler import Scheduler, SchedulerOutput
from k3rt.backend.spec.base import create_drafter
from k3rt.backend.spec.cost import StepKind, classify, ran_prefill, step_sample
from k3rt.backend.spec.gate import SpecGate
from k3rt.cache_layout import CacheLayout, compute_layout
from k3rt.config import EngineConfig
from k3rt.model_config import ModelConfig, load_model_config
from k3rt.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    rid: int
    new_token_ids: list[int]  # tokens generated in this step
    output_ids: list[int] | None  # all generated tokens; set once finished (stream callers use new_token_ids)
    finished: bool
    finish_reason: str | None
    prompt_len: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[float] | None = None  # of new_token_ids, when params.logprobs is set
    prompt_logprobs: dict[int, float] | None = None  # position -> log p(prompt token); set once finished
    # position -> the params.logprobs most likely [token_id, logprob] there; with prompt_logprobs
    prompt_top_logprobs: dict[int, list[list[float]]] | None = None
    error: str | None = None  # why the request failed (finish_reason "error"), naming the field
    top_logprobs: list[list[list[float]]] | None = None  # per new token: [[token_id, logprob], ...]
    spec_accepted_tokens: int = 0  # draft tokens accepted so far for this request (speculative decoding)


def cache_geometry(cfg: EngineConfig, model_cfg: ModelConfig) -> tuple[CacheLayout, int]:
    """(layout, num_pages) of the pool: from the configs alone, so every tensor-parallel rank gets the same."""
    model_dtype = cfg.dtype or model_cfg.dtype
    cc = cfg.cache
    layout = compute_layout(model_cfg, tp=cfg.tp, kv_dtype=cc.kv_dtype or model_dtype,
                            conv_dtype=cc.conv_dtype or model_dtype, state_dtype=cc.state_dtype,
                            block_size=cc.block_size)
    num_pages = cc.num_pages if cc.memory_gb is None else layout.num_pages(int(cc.memory_gb * 2**30))
    if num_pages < layout.pages_per_state_set + 2:
        raise ValueError(f"{'num_pages' if cc.memory_gb is None else 'memory_gb'}: the pool holds {num_pages} "
                         f"pages; one request needs at least {layout.pages_per_state_set + 2}")
    return layout, num_pages


class Engine:
    def __init__(self, cfg: EngineConfig, *, model=None) -> None:
        import torch

        self.cfg = cfg
        self.model_cfg: ModelConfig = load_model_config(cfg.model)
        if cfg.runner != "null":
            self.model_cfg.check_tp_model(cfg.tp, cfg.ep)  # before any worker starts: the error names the dimension
        cc = cfg.cache
        self.layout, num_pages = cache_geometry(cfg, self.model_cfg)
        self.pool = PagePool(self.layout, num_pages, device=cfg.device, poison_freed=cc.poison_freed,
                             materialize=cfg.runner != "null")
        info = self.layout.as_dict() | {"num_pages": num_pages}
        log.info("cache layout: %s", info)
        if self.layout.padding_fraction > 0.02:
            log.warning("KDA state padding %.1f%% of each page", 100 * self.layout.padding_fraction)
        self.target_states = self._target_states()  # DSpark: the runner records what the drafter reads
        self.runner = self._make_runner(model, torch)
        policy = CachePolicy(eviction="lru" if cc.full_block_mode else cc.eviction)
        spec = self.cfg.spec  # the drafter folder resolved
        if spec.enabled:
            log.info("speculative decoding: %s%s, up to %d draft tokens per request", spec.method,
                     f" ({spec.model})" if spec.model else "", spec.num_tokens)
        drafter = create_drafter(spec, getattr(self.runner, "model", None), graph_sizes=self._spec_graph_sizes())
        # the speculation controller learns step costs from this engine's step times (see `step`)
        fixed = max(getattr(self.runner, "verify_graphs", {}), default=0)  # verify graphs: a draft costs nothing more
        # a model drafter (it reads target states) costs alike per pass: its cold first pass is not its price
        self.gate = (SpecGate(spec.gate, fixed, stable_pass=self.target_states is not None)
                     if drafter is not None and spec.adaptive else None)
        # several verify rounds per step on the device (SpecConfig.rounds): the GPU runner with a DSpark drafter
        device_rounds = (spec.rounds > 1 and self.target_states is not None and hasattr(drafter, "window")
                         and hasattr(self.runner, "round_drafter"))
        if device_rounds:
            self.runner.capture_rounds(drafter)
        self.scheduler = Scheduler(cfg.scheduler, cc, self.pool, RadixCache(self.pool, self.layout.block_size, policy),
                                   drafter=drafter, spec_cfg=spec, target_states=self.target_states, gate=self.gate,
                                   device_rounds=device_rounds)
        self.overlap = None  # the OverlapLoop (backend/overlap.py) when steps overlap, else None
        if cfg.overlap:
            from k3rt.backend.overlap import OverlapLoop

            if type(self.runner).launch is Runner.launch:
                raise ValueError(f"overlap: the {type(self.runner).__name__} has no launch/collect; set overlap=False")
            self.overlap = OverlapLoop(self.scheduler, speculative=spec.enabled)
        self.requests: dict[int, Request] = {}
        # what the last _step launched and read back (the step kind its wall time measures, for the controller)
        self._launched: SchedulerOutput | None = None
        self._collected: list[SchedulerOutput] = []
        self._rids = itertools.count()
        self._eos = frozenset(self.model_cfg.eos_token_ids)
        self._pending_aborts: list[int] = []
        self._grammar_backend = None
        self._compiling: list[Request] = []  # waiting requests whose grammar future has not resolved
        self.num_steps = 0
        self.step_time = Histogram(STEP_TIME_BUCKETS_S)
        self.queue_wait = Histogram(QUEUE_WAIT_BUCKETS_S)

    def _spec_graph_sizes(self) -> tuple[int, ...]:
        """Batch buckets of the drafter's CUDA graphs (the runner's verify graphs use the same rule)."""
        if self.cfg.runner != "gpu" or not self.cfg.spec.enabled:
            return ()
        from k3rt.backend.runner.gpu.runner import spec_graph_sizes

        return spec_graph_sizes(self.cfg)

    def _target_states(self):
        """The per-request target-state store of a DSpark drafter (None for the other drafters). Resolves the
        drafter folder first (--spec-model, else the one shipped beside the target) into cfg.spec.model."""
        spec = self.cfg.spec
        if spec.method != "dspark":
            return None
        if self.cfg.runner == "null":
            raise ValueError("spec: the dspark drafter reads the target's hidden states; the null runner has none")
        from k3rt.backend.spec.dspark.checkpoint import load_config
        from k3rt.backend.spec.target_states import TargetStates
        from k3rt.models import resolve_drafter_dir

        folder = str(resolve_drafter_dir(spec.model, self.cfg.model))
        self.cfg = replace(self.cfg, spec=replace(spec, model=folder))
        dcfg = load_config(folder)
        return TargetStates(dcfg.target_layers, dcfg.context_len)

    def _make_runner(self, model, torch) -> Runner:
        if self.cfg.runner == "null":
            from k3rt.backend.runner.null_runner import NullRunner

            return NullRunner(self.model_cfg.vocab_size)
        from k3rt.backend.models.loader import load_model
        from k3rt.backend.runner.model_runner import ModelRunner

        torch.manual_seed(self.cfg.seed)
        if self.cfg.tp > 1:
            return self._start_tensor_parallel(model)
        if model is None and self.cfg.random_weights:
            from k3rt.backend.models.random_init import random_model

            model = random_model(self.model_cfg, dtype=self.cfg.dtype, device=self.cfg.device, seed=self.cfg.seed)
        elif model is None:
            model = load_model(self.cfg.model, dtype=self.cfg.dtype, device=self.cfg.device)
        if self.cfg.runner == "gpu":
            from k3rt.backend.runner.gpu.runner import engine_gpu_runner

            return engine_gpu_runner(self.cfg, model, self.pool, target_states=self.target_states)
        return ModelRunner(model, self.pool, deterministic=self.cfg.deterministic, target_states=self.target_states)

    def _start_tensor_parallel(self, model) -> Runner:
        """Start ranks 1..tp-1 on this host, load rank 0's shard, and wait until every rank has its own."""
        from k3rt.backend.distributed.rank0 import start_tensor_parallel, wait_for_workers
        from k3rt.backend.models.loader import load_model
        from k3rt.backend.runner.model_runner import ModelRunner

        if model is not None:
            raise ValueError("model: a tensor-parallel engine loads each rank's shard itself; pass no model")
        groups, sender = start_tensor_parallel(self.cfg)
        try:
            model = load_model(self.cfg.model, dtype=self.cfg.dtype, tp=groups.tp, ep=self.cfg.ep,
                               device=str(groups.device))
            if self.cfg.runner == "gpu":
                from k3rt.backend.runner.gpu.runner import engine_gpu_runner

                runner = engine_gpu_runner(self.cfg, model, self.pool, sender=sender)
            else:
                runner = ModelRunner(model, self.pool, sender=sender)
            wait_for_workers(self.cfg, sender)
        except BaseException:
            sender.close()
            raise
        return runner

    # ---- requests ----

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, eos_token_ids: Sequence[int] | None = None,
                    grammar: dict | None = None, prompt_logprobs_from: int | None = None, pin: bool = False) -> int:
        """Queue a request; returns its id. Raises ValueError naming the field for bad input."""
        params = params or SamplingParams()
        try:
            prompt = array("q", prompt_ids).tolist()  # plain ints, at C speed (a 128K prompt in ~2 ms)
        except (TypeError, OverflowError):
            raise ValueError("prompt: token ids must be integers") from None
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        v = self.model_cfg.vocab_size
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= v:
            raise ValueError(f"prompt: token id {lo if lo < 0 else hi} outside the vocabulary [0, {v})")
        bad = next((t for t, _ in params.logit_bias if t >= v), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} outside the vocabulary [0, {v})")
        limit = self.model_cfg.max_position_embeddings
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(f"prompt: {len(prompt)} tokens + max_tokens {params.max_tokens} exceed the context "
                             f"length {limit}")
        # a request that cannot fit in the whole pool would preempt itself every step, forever
        fed = len(prompt) + params.max_tokens - 1  # the last sampled token is never fed
        pages = -(-fed // self.layout.block_size) + self.layout.pages_per_state_set
        usable = self.scheduler.usable_pages
        if pages > usable:
            reserved = self.pool.num_pages - usable
            raise ValueError(f"prompt: {len(prompt)} tokens + max_tokens {params.max_tokens} need {pages} cache pages "
                             f"(KV and KDA state); the pool has {usable}"
                             + (f" ({self.pool.num_pages} less {reserved} reserved by the runner)" if reserved else ""))
        sc = self.cfg.scheduler
        if len(self.scheduler.waiting) + len(self.scheduler.running) >= sc.max_waiting + sc.max_running:
            # the gateway admits up to max_running + max_waiting: a burst that arrives together queues
            raise OverflowError(f"max_waiting: {sc.max_running} requests running and {sc.max_waiting} waiting already")
        eos = self._eos if eos_token_ids is None else frozenset(eos_token_ids)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos)
        rid = next(self._rids)
        gen = None
        if params.seed is not None and self.cfg.runner != "null":
            from k3rt.backend.sampling.sampler import make_generator

            gen = make_generator(params.seed, self.cfg.device)
        req = Request(rid, prompt, len(prompt), params, cache_salt, stop, gen)
        req.pin = pin
        req.arrival = time.monotonic()
        if prompt_logprobs_from is not None:
            if not 1 <= prompt_logprobs_from < len(prompt):
                raise ValueError(f"prompt_logprobs_from: {prompt_logprobs_from} outside [1, {len(prompt) - 1}]")
            req.prompt_logprobs_from = prompt_logprobs_from
        if grammar is not None:
            # compiled off the scheduler loop: the request waits (not admitted) until its grammar is ready
            req.grammar_future = self._grammar_submit(grammar)
            req.grammar_deadline = time.monotonic() + self._grammar_backend.compile_timeout_s
            self._compiling.append(req)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _grammar_submit(self, spec: dict):
        """Start compiling the request's grammar on the backend's worker threads (cached by spec key)."""
        if self.cfg.runner == "null":
            raise ValueError("grammar: constrained decoding needs the model runner")
        from k3rt.backend.grammar import GrammarSpec

        parsed = GrammarSpec.from_dict(spec)  # a malformed spec raises here, naming the field
        if self._grammar_backend is None:
            from k3rt.backend.grammar import create_grammar_backend
            from k3rt.backend.tokenizer import load_tokenizer

            self._grammar_backend = create_grammar_backend(self.cfg.grammar_backend, load_tokenizer(self.cfg.model),
                                                           vocab_size=self.model_cfg.vocab_size)
        return self._grammar_backend.submit(parsed)

    def _resolve_grammars(self, outputs: list[RequestOutput]) -> None:
        """Waiting requests whose grammar finished compiling get their matcher; failures end the request."""
        if not self._compiling:
            return  # the common case costs nothing per step
        now = time.monotonic()
        pending, self._compiling = self._compiling, []
        for req in pending:
            if req.finished:
                continue  # aborted while its grammar compiled
            fut = req.grammar_future
            error = None
            if fut.done():
                try:
                    req.grammar = fut.result().matcher()
                except Exception as e:  # GrammarError: an invalid regex/schema named by the backend
                    error = f"grammar: {e}"
            elif now > req.grammar_deadline:
                error = (f"grammar: compiling took longer than {self._grammar_backend.compile_timeout_s:g} s "
                         f"({self.cfg.grammar_backend} backend)")
            else:
                self._compiling.append(req)
                continue
            req.grammar_future = None
            if error is not None:
                req.error = error
                self.scheduler.abort(req, FinishReason.ERROR)
                outputs.append(self._output(req, []))

    def unpin(self, rid: int) -> None:
        """Let the cache evict the end-of-request snapshot a `pin=True` request kept (no-op otherwise).
        Unpinning a request that has not finished yet means it will not pin at all."""
        self.scheduler.unpin(self.requests.get(rid), rid)

    def is_pinned(self, rid: int) -> bool:
        return rid in self.scheduler.pins

    @property
    def num_pins(self) -> int:
        return len(self.scheduler.pins)

    def flush_cache(self) -> None:
        """Drop every cached prefix that no running request holds, pinned snapshots included."""
        self.scheduler.drop_pins()
        self.scheduler.tree.reset()

    def abort(self, rid: int) -> None:
        """Abort a request; applied between steps. Its pages and state are freed."""
        if rid in self.requests:
            self._pending_aborts.append(rid)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or (self.overlap is not None and self.overlap.busy)

    def stats_dict(self) -> dict:
        """Counters, gauges and histograms for the gateway's /metrics (backend/engine_stats.py)."""
        return engine_stats(self)

    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> update cycle. Returns outputs of requests that advanced or ended."""
        self.scheduler.step_rounds, self.scheduler.step_drafted = 1, 0
        t0 = time.monotonic()
        outputs = self._step()
        t1 = time.monotonic()
        self.num_steps += 1
        self.step_time.observe(t1 - t0)
        if self.gate is not None:
            self._observe_step(t1 - t0, outputs)
        for req in self.scheduler.admitted_now:
            self.queue_wait.observe(t0 - req.arrival)
        self.scheduler.admitted_now.clear()
        if not self.has_unfinished:
            self.runner.timing_break()  # the wait for the next request is not the host's step cost
        return outputs

    @property
    def last_step(self) -> tuple[SchedulerOutput | None, list[SchedulerOutput]]:
        """What the last `step` call ran: the step it launched (None: none) and the steps it read back (with
        overlap scheduling usually the one before; the same step on the synchronous path)."""
        return self._launched, self._collected

    def _observe_step(self, seconds: float, outputs: list[RequestOutput]) -> None:
        """Hand the controller this call's wall time, less the drafter's pass, when it measured one step kind;
        and to its governor the tokens the call delivered in its whole wall time, when no prefill ran in it."""
        launched, collected = self._launched, self._collected
        if launched is not None and not ran_prefill(launched, collected):
            kind, batch = classify(launched)
            self.gate.observe_rate(batch, sum(len(o.new_token_ids) for o in outputs), seconds,
                                   kind is StepKind.VERIFY)
        sample = step_sample(launched, collected)
        if sample is None:
            return
        kind, batch = sample
        # a step of several device rounds (SpecConfig.rounds) is that many verify steps to the cost model, each with
        # its share of the step's drafts (the first round carries the scheduled drafts, the further ones K per
        # request: counting the first alone priced a round's tokens at a fraction of what it yields)
        rounds = self.scheduler.step_rounds if kind is StepKind.VERIFY else 1
        drafted = self.scheduler.step_drafted / rounds if kind is StepKind.VERIFY else 0
        self.gate.observe_step(kind, batch, max(seconds - self.scheduler.step_draft_s, 0.0) / rounds, drafted, rounds)

    def _step(self) -> list[RequestOutput]:
        outputs = []
        self._launched, self._collected = None, []
        for rid in self._pending_aborts:
            req = self.requests.pop(rid, None)
            if req is not None and not req.finished:
                self.scheduler.abort(req)
                self.runner.release(rid)
                outputs.append(self._output(req, []))
        self._pending_aborts.clear()
        self._resolve_grammars(outputs)
        out = self.scheduler.schedule()
        if self.scheduler.failed:
            for req in self.scheduler.failed:
                outputs.append(self._output(req, []))
            self.scheduler.failed.clear()
        if self.overlap is not None:
            # launch this step, then collect the one before it (backend/overlap.py)
            self.overlap.step(self.runner, out, lambda o, sampled, _: self._report(o, sampled, outputs),
                              lambda o, e: self._fail_step(o, e, outputs))
            self._launched, self._collected = self.overlap.launched, self.overlap.collected
            return outputs
        try:
            sampled = self.runner.execute(out)
        except Exception as e:
            self._fail_step(out, e, outputs)
            return outputs
        self.scheduler.update(out, sampled)
        self._report(out, sampled, outputs)
        if out.decodes or out.chunks:
            self._launched, self._collected = out, [out]
        return outputs

    def _fail_step(self, out, e: Exception, outputs: list[RequestOutput]) -> None:
        if _is_fatal(e):
            raise e
        # not attributable to one request (the forward itself): this step's requests fail, the engine
        # and every other request go on
        log.exception("a step failed; its %d requests fail with it", len(out.decodes) + len(out.chunks))
        for req in self.scheduler.fail_step(out, f"the engine could not run this request's step: "
                                                  f"{type(e).__name__}: {e}"):
            outputs.append(self._output(req, []))

    def _report(self, out, sampled: dict, outputs: list[RequestOutput]) -> None:
        """Outputs of the requests an updated (resolved) step sampled for."""
        for req in out.decodes + [c.req for c in out.chunks if c.needs_logits]:
            if self.requests.get(req.rid) is not req:
                continue  # ended before this step's token was read (overlap: aborted, or stopped a step earlier)
            if req.sampled.error is not None:  # its grammar failed: this request alone ends, with the reason
                self.scheduler.fail(req, req.sampled.error)
                outputs.append(self._output(req, []))
            else:
                s = sampled[req.rid]
                outputs.append(self._output(req, s if isinstance(s, list) else [s]))

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        if req.params.logprobs is None and not req.finished:
            # the common case (a request that runs on, no logprobs), built positionally: the keyword path
            # below took half of a 1,000-decode step's host time (benchmarks/host_cost.py)
            return RequestOutput(req.rid, new, None, False, None, req.prompt_len, req.cached_tokens, None, None, None,
                                 None, None, req.spec_accepted)
        lp = top = None
        st = req.sampled
        if req.params.logprobs is not None and new and st.run_logprobs is not None:
            lp, top = st.run_logprobs, [[[t, v] for t, v in row] for row in st.run_top_logprobs]
            st.run_logprobs = st.run_top_logprobs = None
        elif req.params.logprobs is not None and new and st.logprob is not None:
            lp = [st.logprob]
            top = [[[t, v] for t, v in st.top_logprobs or []]]
        if not req.finished:
            return RequestOutput(req.rid, new, None, False, None, req.prompt_len, req.cached_tokens,
                                 logprobs=lp, top_logprobs=top, spec_accepted_tokens=req.spec_accepted)
        self.requests.pop(req.rid, None)
        self.runner.release(req.rid)
        scored = req.prompt_logprobs_from is not None
        tops = None
        if scored and req.params.logprobs:
            tops = {p: [[t, v] for t, v in top] for p, top in req.sampled.prompt_top_logprobs.items()}
        return RequestOutput(req.rid, new, req.output_ids, True, req.finish_reason.value if req.finish_reason else None,
                             req.prompt_len, req.cached_tokens, logprobs=lp, top_logprobs=top,
                             prompt_logprobs=dict(req.sampled.prompt_logprobs) if scored else None,
                             prompt_top_logprobs=tops, error=req.error, spec_accepted_tokens=req.spec_accepted)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, cache_salt: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        rids = [self.add_request(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, plist)]
        final: dict[int, RequestOutput] = {}
        while len(final) < len(rids):
            if not self.has_unfinished:
                raise RuntimeError("engine stalled with unfinished requests")
            for o in self.step():
                if o.finished:
                    final[o.rid] = o
        return [final[r] for r in rids]

    def check(self) -> None:
        self.scheduler.check()
        if self.target_states is not None:
            self.target_states.check(set(self.requests))

    def check_runner(self) -> None:
        """Raise TPFailure if a tensor-parallel rank is lost (cheap; the engine process calls it every turn)."""
        self.runner.check()

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel workers); idempotent."""
        self.runner.close()

    @property
    def stats(self):
        return self.scheduler.stats


def _is_fatal(e: BaseException) -> bool:
    """Errors after which the engine cannot go on: a CUDA error poisons the device context (every later
    step would fail too), and running out of host memory is nobody's request in particular."""
    from k3rt.backend.distributed.group import TPFailure

    text = str(e)
    return isinstance(e, (MemoryError, TPFailure)) or "CUDA error" in text or "device-side assert" in text or (
        "illegal memory access" in text)


def engine_config_for_tests(model: str, **cache_overrides) -> EngineConfig:
    """fp32 caches so cache-on output can be compared with cache-off output exactly."""
    from k3rt.config import CacheConfig

    return EngineConfig(model=model, dtype="float32",
                        cache=replace(CacheConfig(kv_dtype="float32", conv_dtype="float32"), **cache_overrides))
