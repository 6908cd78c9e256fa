"""The GPU model runner: the scheduler's step -> one packed device batch -> the fast forward ->
sampling, with decode steps replayed from CUDA graphs.

Per step the host packs every index (backend/runner/gpu/step.py) into two pinned buffers and
copies them to the device once; the only synchronization is reading the sampled tokens back, which
`collect` does (overlap scheduling: `launch` returns first, and the next step's launch feeds those
tokens from the device, backend/overlap.py).
Decode-only steps of up to `max(graph_sizes)` sequences replay a graph captured for the next larger
size (sizes up to 512; those captured follow --max-running, `graph_sizes_for`); the padding rows point
at one reserved pool page (state set and MLA page), so they compute garbage nobody reads and touch no
live state.

Steps with prefill rows (a new request's chunk beside the decodes) of up to the largest mixed bucket's tokens
replay piecewise graphs (backend/runner/gpu/pieces.py): everything between two attention cores is captured
per token-count bucket, the attention cores run eagerly on the real rows; --no-mixed-graphs runs them eagerly
(EngineConfig.mixed_pieces_eager, test/debug: the pieces themselves, eagerly, on any device).

Steps of plain decodes and verify runs only (speculative decoding: no prefill chunk, no prompt-logprob
rows) of up to SPEC_GRAPH_MAX_BATCH requests replay a verify graph captured for (batch bucket, K + 1) at
the configured --spec-tokens K: every request runs K + 1 rows, KDA states stay at the runs' start and the
commit after sampling advances each request by what it kept (a plain decode: one token); the padding plan
is backend/runner/gpu/verify_graph.py. --no-cuda-graphs turns these off with the decode graphs.

With a model drafter (DSpark) the forward also taps the target layer states the drafter reads, over all
rows (inside the graphs too), and the runner records the kept rows per speculating request.

Under tensor parallelism every rank runs this runner on its model shard: rank 0 schedules, broadcasts
the step as one StepPlan (naming the decode graph and the piecewise bucket it takes), and samples from the
gathered logits; the workers replay the plans (backend/runner/gpu/tp.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.device import read_back, to_device
from k3rt.backend.distributed.channel import PlanSender
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.runner.base import LaunchedStep, Runner, begin_step, pending_tokens
from k3rt.backend.runner.gpu.forward import GpuForward
from k3rt.backend.runner.gpu.idle import IdleTimer
from k3rt.backend.runner.gpu.ops import PERSISTENT_FORMS, KernelConfig, kernel
from k3rt.backend.runner.gpu.penalties import PenaltyState
from k3rt.backend.runner.gpu.pieces import PiecewiseForward, mixed_buckets_for
from k3rt.backend.runner.gpu.rounds import RoundGraph, carry_back, queue_first_pass, run_rounds
from k3rt.backend.runner.gpu.sample import sample_on_device, sample_step
from k3rt.backend.runner.gpu.step import GpuStep, StepSeq, build_step, pack_step, step_views
from k3rt.backend.runner.gpu.verify_graph import VerifyPlan, pad_rows, plan_verify
from k3rt.backend.runner.sampling import prompt_score_rows, record_prompt_logprobs
from k3rt.backend.runner.step_plan import build_plan
from k3rt.backend.sampling.sampler import Sampler
from k3rt.backend.scheduler.scheduler import ScheduledChunk, SchedulerOutput
from k3rt.backend.spec.rejection import verify_requests
from k3rt.backend.spec.target_states import TargetStates, record_step_states

log = logging.getLogger(__name__)

# up to 512 sequences (wider decodes run eagerly); above 256 in steps of 64, so a replay there pads at most 63
# rows (12-20% of the graph). Sizes above the scheduler's max_running are never replayed and not captured.
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def graph_sizes_for(max_running: int, sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES) -> tuple[int, ...]:
    """The sizes a decode of at most `max_running` sequences can replay: those below it and the first at or
    above it (a step of max_running sequences pads up to that one)."""
    if max_running < 1:
        raise ValueError(f"max_running: must be >= 1, got {max_running}")
    ordered = sorted(sizes)
    cover = next((s for s in ordered if s >= max_running), None)
    return tuple(s for s in ordered if s < max_running or s == cover)


# speculative steps (verify forwards, the drafter's pass) replay graphs for batches up to this many requests
SPEC_GRAPH_MAX_BATCH = 64


def spec_graph_sizes(cfg) -> tuple[int, ...]:
    """The batch buckets an EngineConfig's speculative graphs are captured for: the decode graph sizes up to
    SPEC_GRAPH_MAX_BATCH. None (()) without speculation, with --no-cuda-graphs or --no-spec-graphs, off CUDA,
    without the Triton kernels, under tensor parallelism (speculation runs at tp 1), or in the batch-invariant
    mode (its verify path steps token by token on host-built indices, docs/deterministic.md)."""
    if (not cfg.spec.enabled or not cfg.spec.cuda_graphs or not cfg.cuda_graphs or not cfg.device.startswith("cuda")
            or cfg.tp > 1 or cfg.deterministic or not cfg.kernels):
        return ()
    return tuple(s for s in graph_sizes_for(cfg.scheduler.max_running) if s <= SPEC_GRAPH_MAX_BATCH)


def engine_gpu_runner(cfg, model: KimiForCausalLM, pool: PagePool, *, sender: PlanSender | None = None,
                      target_states: TargetStates | None = None) -> "GpuModelRunner":
    """The GPU runner an EngineConfig asks for (rank 0 and every worker build theirs here, so they match)."""
    kernels = KernelConfig(cfg.kernels, cfg.use_pdl, batch_invariant=cfg.deterministic)
    spec_sizes = spec_graph_sizes(cfg)
    return GpuModelRunner(model, pool, kernels=kernels,
                          cuda_graphs=cfg.cuda_graphs, graph_sizes=graph_sizes_for(cfg.scheduler.max_running),
                          sender=sender, target_states=target_states,
                          verify_graphs=(cfg.spec.num_tokens, spec_sizes) if spec_sizes else None,
                          mixed_buckets=mixed_buckets_for(cfg.scheduler.max_num_batched_tokens)
                          if cfg.mixed_graphs else (), mixed_capture=not cfg.mixed_pieces_eager)


def _form(bucket: int) -> str:
    return f"piecewise in bucket {bucket}" if bucket else "without the pieces"


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    flat64: torch.Tensor
    flat32: torch.Tensor
    logits: torch.Tensor
    taps: dict[int, torch.Tensor]  # the graph's tapped target states (model drafter), [size, hidden] each
    step: GpuStep | None = None  # verify graphs: the captured step (its verify_inputs feed the commit)
    commit: torch.cuda.CUDAGraph | None = None  # verify graphs: the commit after sampling (kda_commit_graphed)
    accepted: torch.Tensor | None = None  # its input: tokens each sequence keeps, [size] int64 (0: none)


class GpuModelRunner(Runner):
    def __init__(self, model: KimiForCausalLM, pool: PagePool, *, kernels: KernelConfig = KernelConfig(),
                 cuda_graphs: bool = True, graph_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES,
                 max_model_len: int | None = None, target_states: TargetStates | None = None,
                 sender: PlanSender | None = None,
                 verify_graphs: tuple[int, tuple[int, ...]] | None = None,
                 mixed_buckets: tuple[int, ...] = (), mixed_capture: bool = True) -> None:
        """verify_graphs: (K, batch buckets) of the speculative verify graphs (None: verify steps run eagerly);
        when no graph is captured (graphs off, not on CUDA) verify steps run in the eager form. Setting
        verify_run_len and verify_sizes afterwards runs the padded form the graphs replay eagerly (CPU tests).
        target_states: where to record the target states a model drafter reads (None: no taps). sender:
        rank 0 of a tensor-parallel engine, the workers' plan channel (None: a single rank, or a worker, which
        runs the plans it receives through backend/runner/gpu/tp.py run_worker_plan). Every rank builds its
        runner with the same arguments: the same reserved pad page and the same graphs.
        mixed_buckets: token-count buckets of the piecewise graphs for steps with prefill rows (pieces.py; ():
        those steps run eagerly), captured with the decode graphs (a model drafter's taps included); not in the
        batch-invariant mode. mixed_capture False (EngineConfig.mixed_pieces_eager, test/debug): the pieces are
        built on any device and run eagerly, never captured. Setting `mixed` to a PiecewiseForward afterwards
        runs its pieces eagerly too (single-process CPU tests)."""
        if target_states is not None and sender is not None:
            raise ValueError("spec: a model drafter's target states are captured on a single rank only")
        self.model, self.pool, self.kernels, self.sender = model, pool, kernels, sender
        self.target_states = target_states
        # the reference modules the GPU path still calls (shared experts, fallbacks) follow the mode too
        model.set_batch_invariant(kernels.batch_invariant)
        L = pool.layout
        if L.kda_groups:
            conv_shape, rec_shape = model.model.layers[L.kda_groups[0][0]].self_attn.state_shapes()
            pool.set_kda_shapes(conv_shape, rec_shape)
        self.device = pool.tensors[0].device
        self.fwd = GpuForward(model, pool, kernels)
        if target_states is not None:
            self.fwd.taps = frozenset(target_states.layers)  # before capture: the graphs tap them too
        self.num_groups = max(1, len(L.kda_groups))
        self.block_size = L.block_size
        limit = max_model_len or model.cfg.max_position_embeddings
        self.max_blocks = min(-(-limit // L.block_size), pool.num_pages)
        self.sampler = Sampler(model.cfg.vocab_size, self.device)
        self.penalties = PenaltyState(model.cfg.vocab_size, self.device)
        self.pad_page = pool.reserve()  # padding rows of graph-replayed batches write here, never read
        self.idle = IdleTimer() if self.device.type == "cuda" else None  # the GPU-idle metric (idle.py)
        self._timing = None  # the launching step's idle-metric events (launch sets them; None between launches)
        if sender is not None:
            pool.record_fills()  # after the pad page: each worker's pool reserves the same page itself
        self.graphs: dict[int, _Graph] = {}
        self.graph_sizes = tuple(sorted(graph_sizes))
        # not in the batch-invariant mode: its verify path steps token by token on host-built indices
        spec = verify_graphs if verify_graphs and not kernels.batch_invariant else None
        self.verify_run_len = spec[0] + 1 if spec else 0
        self.verify_sizes = tuple(sorted(spec[1])) if spec else ()
        self.verify_graphs: dict[int, _Graph] = {}
        self.verify_graph_replays = 0  # verify steps replayed from a graph so far (benchmarks read it)
        # a drafter that drafts on the device from its own window (DSpark): verify-form steps the scheduler planned
        # several rounds for run them here (rounds.py); set by the engine
        self.round_drafter = None
        self.round_graphs: dict[int, RoundGraph] = {}  # verify bucket -> its captured round (capture_rounds)
        # steps with prefill rows: replayed piecewise (None: eager); not in the batch-invariant mode (its forms
        # step token by token on host-built indices)
        self.mixed: PiecewiseForward | None = None
        mixed_ok = bool(mixed_buckets) and not kernels.batch_invariant
        capturing = cuda_graphs and self.device.type == "cuda"
        missing = self._graph_blockers() if capturing else []
        if missing:
            log.warning("CUDA graphs off: no graph-safe kernel for %s", ", ".join(missing))
        capturing = capturing and not missing
        if mixed_ok and (capturing or not mixed_capture):
            self.mixed = PiecewiseForward(self.fwd, mixed_buckets)
        if self.device.type == "cuda":  # the interpreter's phased launches never spin: nothing to check there
            self.check_persistent()
        if capturing:
            self.capture(mixed=mixed_capture)
        if not self.verify_graphs:  # the padded form only pays off replayed
            self.verify_run_len, self.verify_sizes = 0, ()

    def check_persistent(self) -> list[str]:
        """Run one batch-1 decode of the pad sequence with the persistent one-token layers the kernel config turns on
        and read their counters back; where any launch did not finish cleanly (a wait gave up: more programs than the
        SMs hold at once, e.g. another process's kernels resident beside ours), warn, zero the counters and turn the
        three forms off, so the runner serves the separate launches instead of wrong rows. Returns the faults found
        (before capture: the graphs then hold the forms that ran clean). A worker or rank 0 of a tensor-parallel
        engine skips it (the forms are TP 1 only)."""
        on = [f for f in PERSISTENT_FORMS if getattr(self.fwd.k, f)]
        counters = self.fwd.persistent_counters()
        if not on or not counters or self.sender is not None or self.fwd.tp.size > 1:
            return []
        meta, (h64, h32) = self._pack([self._pad_seq()])
        with torch.no_grad():
            self.fwd(step_views(meta, h64.to(self.device), h32.to(self.device)), decode=True)
        faults = self.fwd.persistent_faults()
        if faults:
            log.warning("persistent one-token layers turned off (%s): their launches did not finish cleanly: %s",
                        ", ".join(on), "; ".join(faults))
            for t in counters.values():
                t.zero_()
            self.kernels = self.fwd.k = replace(self.fwd.k, **dict.fromkeys(on, False))
        return faults

    def _graph_blockers(self) -> list[str]:
        """Ops whose only implementation here would synchronize with the host inside a capture."""
        if not self.kernels.triton:
            return ["every op (kernels are off)"]
        need = [("kda", "kda_decode"), ("mla", "mla_decode"), ("moe", "fused_experts")]
        return [f"{m}.{n}" for m, n in need if kernel(m, n) is None]

    # ---- steps ----

    def _seq(self, c: ScheduledChunk) -> StepSeq:
        r = c.req
        if c.num_tokens == 1 and not c.draft_ids and not c.snapshots:  # a decode: no slicing, positional
            return StepSeq([r.token_ids[c.start]], c.start, r.block_table, r.state_set, c.needs_logits, [], False)
        return StepSeq(r.token_ids[c.start:c.start + c.num_tokens] + c.draft_ids, c.start, r.block_table,
                       r.state_set, c.needs_logits, list(c.snapshots), verify=bool(c.draft_ids))

    def _pad_seq(self) -> StepSeq:
        return StepSeq([0], 0, [self.pad_page], [self.pad_page] * self.num_groups, True)

    def execute(self, out: SchedulerOutput) -> dict[int, int | list[int]]:
        return self.collect(self.launch(out, None))

    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Copies, forward and sampling queued on the device; the sampled tokens stay there (overlap
        scheduling) unless the batch's sampling needs the host (grammar, logprobs, ...: then they are read
        now). Requests continuing from `prev` get prev's tokens by a device gather."""
        if not out.chunks and not out.decodes:
            return LaunchedStep(sampled={})
        timing = self._timing = self.idle.begin() if self.idle is not None else None
        chunks = begin_step(self.pool, out)
        seqs = [self._seq(c) for c in chunks]
        pending = pending_tokens(chunks, prev)
        score_rows = prompt_score_rows(chunks)
        size = next((s for s in self.graph_sizes if s >= len(seqs)), None)
        graph = size if self.graphs and not out.chunks and not score_rows and size in self.graphs else 0
        extra = [row for _, row, _ in score_rows]
        vsize = self._verify_size(chunks, score_rows)
        tapped: dict[int, torch.Tensor] | None = None
        if vsize:
            raw, step, plan = self._run_verify(seqs, vsize, pending, prev)
            if out.spec_rounds > 1 and self.round_drafter is not None:
                # the scheduler plans rounds only for steps of greedy verify chunks (Scheduler._plan_rounds)
                launched = LaunchedStep(sampled=run_rounds(self, chunks, step, raw, vsize, out.spec_rounds,
                                                           self.round_drafter), timing=timing)
                if timing is not None:
                    self.idle.end(timing)
                return launched
            logits, tapped = self._verify_rows(raw, plan)
        elif self.sender is None:
            logits, step = self.run_seqs(seqs, extra, graph, pending, prev)
        else:
            if any(c.draft_ids for c in chunks):
                raise RuntimeError("speculative decoding does not run under tensor parallelism yet")
            if pending:  # EngineConfig refuses overlap for the gpu runner at tp > 1
                raise RuntimeError("overlap: a tensor-parallel step cannot take its tokens from the device")
            # built before the plan goes out: the plan names the piecewise bucket the step takes, which the
            # workers check against their own choice
            step = None if graph else self._build(seqs, extra)
            plan = replace(build_plan(out, chunks, self.pool.take_fills(), score_rows, self.block_size), graph=graph,
                           mixed=self._mixed_bucket(step) if step is not None else 0)
            with self.sender.step(plan):
                logits, step = self.run_seqs(seqs, extra, graph, step=step)
        if tapped is None:
            tapped = self.graphs[graph].taps if graph else self.fwd.tapped
        reqs = [c.req for c in chunks if c.needs_logits and not c.draft_ids]
        verify = [(i, c) for i, c in enumerate(chunks) if c.draft_ids]
        n_plain, n_verify = len(reqs), sum(c.num_fed for _, c in verify)
        if score_rows:
            record_prompt_logprobs(logits[n_plain + n_verify:], score_rows)
        launched = LaunchedStep(timing=timing)
        tokens = None
        if not verify and reqs:
            tokens = sample_on_device(logits[:n_plain], reqs, use_kernels=self.kernels.triton, penalties=self.penalties)
        kept: dict[int, int] = {}  # verify chunk -> its accepted run's fed tokens
        if tokens is not None:
            launched.tokens, launched.rows = tokens, {r.rid: i for i, r in enumerate(reqs)}
            if tokens.is_cuda:
                (launched.host_tokens,), launched.ready = read_back(tokens)
        else:
            # the verify form left every plain decode's KDA states alone too: committed with one token each
            plain = ([(i, 1, c.req.state_set) for i, c in enumerate(chunks) if not c.draft_ids] if vsize else [])
            launched.sampled, kept = self._sample_now(logits, reqs, verify, n_plain, n_verify, step, plain, vsize)
        if self.target_states is not None:
            record_step_states(self.target_states, chunks, tapped, kept)
            if (out.first_pass and out.chunks and tokens is not None and self.round_drafter is not None
                    and not self.target_states.paused):
                # the first drafts of the requests whose prompt this step completed, from the device's token; a
                # speed-up only: should it fail, the next step drafts on the host as before (as a failed proposal
                # there decodes plainly), the step's tokens unaffected
                try:
                    launched.carry = queue_first_pass(self.round_drafter, self.target_states, out.chunks, tokens,
                                                      launched.rows)
                except Exception:
                    log.exception("queuing the drafter's first pass failed; those requests draft on the host")
        if timing is not None:
            self.idle.end(timing)
        return launched

    def collect(self, step: LaunchedStep) -> dict[int, int | list[int]]:
        if step.sampled is None:
            if step.ready is not None:
                # the step's one wait for the device: for this step's copy, not for the step launched after it
                # (`tokens.tolist()` would queue behind that one: on the H200 a k3-tiny decode step at batch 64
                # then took 1.8 ms of wall for 0.53 ms of kernels, the host and the device taking turns)
                step.ready.synchronize()
                step.sampled = dict(zip(step.rows, step.host_tokens.tolist()))
            else:
                step.sampled = dict(zip(step.rows, step.tokens.tolist()))
        if step.carry is not None:
            carry_back(self.round_drafter, step.carry)
            step.carry = None
        if step.timing is not None:
            self.idle.collected(step.timing)
        return step.sampled

    def _device_starts(self) -> None:
        """The launching step's device work is queued next (its buffers are packed): the GPU-idle metric's start
        mark goes here, so the host's scheduling and packing count as the device waiting (idle.py)."""
        if self.idle is not None:
            self.idle.started(self._timing)

    def gpu_time(self) -> tuple[float, float] | None:
        return None if self.idle is None else (self.idle.idle_s, self.idle.span_s)

    def timing_break(self) -> None:
        if self.idle is not None:
            self.idle.reset()

    def _sample_now(self, logits: torch.Tensor, reqs: list, verify: list, n_plain: int, n_verify: int,
                    step: GpuStep | None, plain_runs: list[tuple[int, int, list[int]]] = (), vsize: int = 0
                    ) -> tuple[dict[int, int | list[int]], dict[int, int]]:
        """Host-assisted sampling and speculative verification: reads the tokens back now. Returns the
        sampled tokens and, per verify chunk index, how many of its fed tokens the accepted run kept.
        plain_runs: (sequence, 1, state set) of the plain decodes a verify-form step must commit too;
        vsize: the step's verify graph bucket (0: an eager step)."""
        sampled: dict[int, int | list[int]] = sample_step(self.sampler, logits[:n_plain], reqs,
                                                          use_kernels=self.kernels.triton, penalties=self.penalties)
        kept: dict[int, int] = {}
        if verify:
            results = verify_requests(self.sampler, logits[n_plain:n_plain + n_verify], [c.req for _, c in verify],
                                      [c.draft_ids for _, c in verify])
            runs = [(i, len(res.token_ids), c.req.state_set) for (i, c), res in zip(verify, results)] + list(plain_runs)
            if vsize:
                self._commit_verify_form(step, vsize, runs)
            else:
                self.fwd.commit_verified(step, runs)
            for (_, c), res in zip(verify, results):
                r = c.req
                # the device penalty counts missed these tokens: rebuilt from token_ids at the next use
                self.penalties.release(r.rid)
                r.sampled.run_logprobs, r.sampled.run_top_logprobs = res.logprobs, res.top_logprobs
                sampled[r.rid] = res.token_ids
            kept = {i: len(res.token_ids) for (i, _), res in zip(verify, results)}
        return sampled, kept

    def _feed_pending(self, ids: torch.Tensor, pending: dict[int, int], prev: LaunchedStep | None) -> None:
        """ids[row] = prev's sampled token of request rid, for each (row, rid) in pending: on the device when
        prev's tokens are still there, else from the host."""
        if not pending:
            return
        rows = to_device(torch.tensor(list(pending), dtype=torch.int64), self.device)
        if prev.tokens is not None:
            src = to_device(torch.tensor([prev.rows[rid] for rid in pending.values()], dtype=torch.int64), self.device)
            ids.index_copy_(0, rows, prev.tokens.index_select(0, src))
        else:
            vals = torch.tensor([prev.sampled[rid] for rid in pending.values()], dtype=torch.int64)
            ids.index_copy_(0, rows, to_device(vals, self.device))

    def run_seqs(self, seqs: list[StepSeq], extra_rows: list[int], graph: int, pending: dict[int, int] | None = None,
                 prev: LaunchedStep | None = None, *, step: GpuStep | None = None,
                 mixed: int | None = None) -> tuple[torch.Tensor, GpuStep | None]:
        """The step's forward (or the replay of decode graph `graph`, 0: none) -> (fp32 logits of its logits
        rows, gathered to rank 0 under TP; the eager step, None for a replay). Workers run it too, with the
        StepSeqs of rank 0's plan. pending: rows whose token is prev's, fed on the device (overlap, one rank).
        step: the eager step already built from seqs (rank 0 under TP). mixed: rank 0's piecewise bucket
        (workers: the plan's), checked against this rank's own choice; None: no check."""
        if graph:
            return self.fwd.full_logits(self._replay(seqs, graph, pending, prev)[:len(seqs)]), None
        if step is None:
            step = self._build(seqs, extra_rows)
        self._feed_pending(step.ids, pending, prev)
        bucket = self._mixed_bucket(step)
        if mixed is not None and bucket != mixed:
            raise RuntimeError(f"step plan: rank 0 runs this {step.num_tokens}-token step {_form(mixed)}, this "
                               f"rank {_form(bucket)}: the ranks' runners were built differently (mixed buckets)")
        if bucket:
            logits = self.mixed.run(step)
            self.fwd.tapped = self.mixed.tapped  # the target states of this step's forward, the pieces
            return self.fwd.full_logits(logits), step
        return self.fwd.full_logits(self.fwd(step, decode=step.decode_only)), step

    def _mixed_bucket(self, step: GpuStep) -> int:
        """The piecewise bucket an eager step runs in (0: the plain eager forward): a step with prefill rows or
        verify runs (a decode-only step without a graph keeps the decode form), within the largest bucket.
        Decided from the step alone, so every tensor-parallel rank decides alike (workers check it against the
        plan's)."""
        if self.mixed is None or step.decode_only:
            return 0
        return self.mixed.bucket(step.num_tokens) or 0

    def _verify_size(self, chunks: list[ScheduledChunk], score_rows: list) -> int:
        """The verify graph bucket a step takes (0: the eager step): plain decodes and verify runs of at most K
        drafts only, at least one verify, no snapshots, no prompt-logprob rows, at most the largest bucket."""
        if not self.verify_sizes or score_rows or self.sender is not None or len(chunks) > self.verify_sizes[-1]:
            return 0
        if not any(c.draft_ids for c in chunks):
            return 0  # plain decodes replay the (cheaper) decode graphs
        if any(c.num_tokens != 1 or c.snapshots or not c.needs_logits or len(c.draft_ids) >= self.verify_run_len
               for c in chunks):
            return 0
        return next(s for s in self.verify_sizes if s >= len(chunks))

    def capture_rounds(self, drafter) -> None:
        """Attach the drafter of the device rounds and, where verify graphs were captured, capture one round graph
        per verify bucket (rounds.py RoundGraph), in a pool of their own; logs the time and memory they took."""
        self.round_drafter = drafter
        if not self.verify_graphs:
            return
        t0 = time.perf_counter()
        reserved0 = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for size in sorted(self.verify_graphs, reverse=True):
                self.round_graphs[size] = RoundGraph(self, drafter, size, pool)
        torch.cuda.synchronize(self.device)
        log.info("captured %d speculative round graphs (batch %d to %d) in %.1f s, %.2f GiB of device memory",
                 len(self.round_graphs), min(self.round_graphs), max(self.round_graphs), time.perf_counter() - t0,
                 (torch.cuda.memory_reserved(self.device) - reserved0) / 2**30)

    def _run_verify(self, seqs: list[StepSeq], size: int, pending: dict[int, int] | None,
                    prev: LaunchedStep | None) -> tuple[tuple, GpuStep, VerifyPlan]:
        """A verify-form step (verify_graph.py): replayed from its graph when captured, else the same padded
        step eagerly. -> ((logits, taps) of every padded row, the step the commit reads, the padding plan)."""
        padded, plan = plan_verify(seqs, size, self.verify_run_len, self._pad_seq())
        meta, (h64, h32) = self._pack(padded, row_queries=True)
        pad_rows(meta, h64, plan, self.pad_page * self.block_size)
        moved = {plan.fed_rows[row]: rid for row, rid in (pending or {}).items()}
        self._device_starts()
        g = self.verify_graphs.get(size)
        if g is not None:
            g.flat64.copy_(h64.pin_memory(), non_blocking=True)
            g.flat32.copy_(h32.pin_memory(), non_blocking=True)
            self._feed_pending(g.flat64[:plan.num_rows], moved, prev)
            g.graph.replay()
            self.verify_graph_replays += 1
            logits, step, taps = g.logits, g.step, g.taps
        else:
            step = step_views(meta, to_device(h64, self.device), to_device(h32, self.device))
            self._feed_pending(step.ids, moved, prev)
            logits, taps = self.fwd(step), dict(self.fwd.tapped)
        return (logits, taps), step, plan

    def _verify_rows(self, raw: tuple, plan: VerifyPlan) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(logits, taps) of a padded verify step -> (fp32 logits of the real logit rows in the eager order, the
        tapped target states of the real rows in the eager packing)."""
        logits, taps = raw
        rows = to_device(torch.tensor(plan.logit_rows, dtype=torch.int64), self.device)
        fed = to_device(torch.tensor(plan.fed_rows, dtype=torch.int64), self.device) if taps else None
        tapped = {i: t.index_select(0, fed) for i, t in taps.items()}
        return self.fwd.full_logits(logits.index_select(0, rows)), tapped

    def _commit_verify_form(self, step: GpuStep, size: int, runs: list[tuple[int, int, list[int]]]) -> None:
        """The commit of a verify-form step: the bucket's commit graph replayed with each sequence's kept
        tokens (pad sequences 0), or the same commit eagerly when the step was not replayed."""
        accepted = torch.zeros(size, dtype=torch.int64)
        for i, m, _ in runs:
            accepted[i] = m
        g = self.verify_graphs.get(size)
        if g is not None:
            g.accepted.copy_(accepted.pin_memory(), non_blocking=True)
            g.commit.replay()
        else:
            self.fwd.commit_graphed(step, to_device(accepted, self.device))

    def release(self, rid: int) -> None:
        self.penalties.release(rid)
        if self.target_states is not None:
            self.target_states.release(rid)

    def _build(self, seqs: list[StepSeq], extra_rows: list[int]) -> GpuStep:
        k = self.fwd.k  # the benchmarks swap it to time variants
        return build_step(seqs, block_size=self.block_size, conv_width=self.fwd.conv_width,
                          num_groups=self.num_groups, device=self.device, extra_logit_rows=extra_rows,
                          kda_split=k.triton and k.kda_split and not k.batch_invariant,
                          chunk_tables=k.triton and not k.batch_invariant,
                          merge_stores=k.triton and not k.batch_invariant, before_copy=self._device_starts)

    # ---- CUDA graphs ----

    def _pack(self, seqs: list[StepSeq], row_queries: bool = False):
        return pack_step(seqs, block_size=self.block_size, conv_width=self.fwd.conv_width,
                         num_groups=self.num_groups, max_blocks=self.max_blocks, row_queries=row_queries)

    def capture(self, mixed: bool = True) -> None:
        """Capture one decode graph per size, then (speculation) one verify graph per bucket, largest first,
        then (mixed: when the runner has them) the piecewise graphs of steps with prefill rows, every bucket's
        pieces (all share one memory pool), with a progress bar (on a terminal) that names the graph being captured;
        the time and the memory each kind took are logged."""
        from tqdm import tqdm

        pool = torch.cuda.graph_pool_handle()
        # every graph writes its logits into the first rows of one buffer (steps run in stream order, so a replay
        # never overwrites logits an earlier step still has to sample from)
        rows = max(max(self.graph_sizes, default=0), max(self.verify_sizes, default=0) * self.verify_run_len)
        shared = torch.empty(rows, self.model.lm_head.weight.shape[0], dtype=self.fwd.logits_dtype(),
                             device=self.device)
        kinds = [("decode", self.graph_sizes, self.graphs)]
        if self.verify_sizes:
            # what each verify graph keeps for its commit lives in one set of buffers, not one per graph
            self.fwd.reserve_verify_inputs(max(self.verify_sizes) * self.verify_run_len)
            kinds.append((f"verify (1 + {self.verify_run_len - 1} rows each)", self.verify_sizes, self.verify_graphs))
        for kind, sizes, graphs in kinds:
            t0 = time.perf_counter()
            reserved0 = torch.cuda.memory_reserved(self.device)
            # disable=None: a bar on a terminal only (in a log file each update would be a line; the log line
            # below reports what was captured)
            bar = tqdm(sorted(sizes, reverse=True), desc=f"capturing {kind.split()[0]} graphs", unit="graph",
                       leave=False, disable=None)
            for size in bar:
                bar.set_postfix_str(f"batch {size}")
                graphs[size] = self._capture_one(size, graphs is self.verify_graphs, shared, pool)
            torch.cuda.synchronize()
            if graphs:
                log.info("captured %d %s graphs (batch %d to %d) in %.1f s, %.2f GiB of device memory", len(graphs),
                         kind, min(graphs), max(graphs), time.perf_counter() - t0,
                         (torch.cuda.memory_reserved(self.device) - reserved0) / 2**30)
        if mixed and self.mixed is not None:
            self.mixed.capture(pool)

    def _capture_one(self, size: int, verify: bool, shared: torch.Tensor, pool) -> _Graph:
        """One graph of `size` pad sequences: a decode step, or (verify) the padded verify form."""
        if verify:
            padded, plan = plan_verify([self._pad_seq()], size, self.verify_run_len, self._pad_seq())
            meta, (h64, h32) = self._pack(padded, row_queries=True)
            pad_rows(meta, h64, plan, self.pad_page * self.block_size)
            rows = plan.num_rows
        else:
            meta, (h64, h32) = self._pack([self._pad_seq()] * size)
            rows = size
        flat64, flat32 = h64.to(self.device), h32.to(self.device)
        step = step_views(meta, flat64, flat32)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and autotune outside the capture
                self.fwd(step, decode=not verify, logits_out=shared[:rows])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.fwd(step, decode=not verify, logits_out=shared[:rows])
        g = _Graph(graph, flat64, flat32, logits, dict(self.fwd.tapped))
        if verify:  # and its commit, reading what the forward kept (accepted 0 here: the pad page stays as it was)
            g.step, g.commit = step, torch.cuda.CUDAGraph()
            g.accepted = torch.zeros(size, dtype=torch.int64, device=self.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fwd.commit_graphed(step, g.accepted)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g.commit, pool=pool):
                self.fwd.commit_graphed(step, g.accepted)
        return g

    def _replay(self, seqs: list[StepSeq], size: int, pending: dict[int, int] | None = None,
                prev: LaunchedStep | None = None) -> torch.Tensor:
        g = self.graphs[size]
        _, (h64, h32) = self._pack(seqs + [self._pad_seq()] * (size - len(seqs)))
        self._device_starts()
        g.flat64.copy_(h64.pin_memory(), non_blocking=True)
        g.flat32.copy_(h32.pin_memory(), non_blocking=True)
        if pending:
            self._feed_pending(g.flat64[:size], pending, prev)  # the token ids lead the int64 buffer (step.py)
        g.graph.replay()
        return g.logits
