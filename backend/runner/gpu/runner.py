"""The GPU model runner: the scheduler's step -> one packed device batch -> the fast forward ->
sampling, with decode steps replayed from CUDA graphs.

Per step the host packs every index (backend/runner/gpu/step.py) into two pinned buffers and
copies them to the device once; the only synchronization is reading the sampled tokens back.
Decode-only steps of up to `max(graph_sizes)` sequences replay a graph captured for the next
larger size; the padding rows point at one reserved pool page (state set and MLA page), so they
compute garbage nobody reads and touch no live state.

With a model drafter (DSpark) the forward also taps the target layer states the drafter reads, over all
rows (inside the graphs too), and the runner records the kept rows per speculating request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.runner.base import Runner, begin_step
from k3rt.backend.runner.gpu.forward import GpuForward
from k3rt.backend.runner.gpu.ops import KernelConfig, kernel
from k3rt.backend.runner.gpu.penalties import PenaltyState
from k3rt.backend.runner.gpu.sample import sample_step
from k3rt.backend.runner.gpu.step import GpuStep, StepSeq, build_step, pack_step, step_views
from k3rt.backend.runner.sampling import prompt_score_rows, record_prompt_logprobs
from k3rt.backend.sampling.sampler import Sampler
from k3rt.backend.scheduler.scheduler import ScheduledChunk, SchedulerOutput
from k3rt.backend.spec.rejection import verify_requests
from k3rt.backend.spec.target_states import TargetStates, record_step_states

log = logging.getLogger(__name__)

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    flat64: torch.Tensor
    flat32: torch.Tensor
    logits: torch.Tensor
    taps: dict[int, torch.Tensor]  # the graph's tapped target states (model drafter), [size, hidden] each


class GpuModelRunner(Runner):
    def __init__(self, model: KimiForCausalLM, pool: PagePool, *, kernels: KernelConfig = KernelConfig(),
                 cuda_graphs: bool = True, graph_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES,
                 max_model_len: int | None = None, target_states: TargetStates | None = None) -> None:
        """target_states: where to record the target states a model drafter reads (None: no taps)."""
        self.model, self.pool, self.kernels = model, pool, kernels
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
        self.graphs: dict[int, _Graph] = {}
        self.graph_sizes = tuple(sorted(graph_sizes))
        if cuda_graphs and self.device.type == "cuda":
            missing = self._graph_blockers()
            if missing:
                log.warning("CUDA graphs off: no graph-safe kernel for %s", ", ".join(missing))
            else:
                self.capture()

    def _graph_blockers(self) -> list[str]:
        """Ops whose only implementation here would synchronize with the host inside a capture."""
        if not self.kernels.triton:
            return ["every op (kernels are off)"]
        need = [("kda", "kda_decode"), ("mla", "mla_decode"), ("moe", "fused_experts")]
        return [f"{m}.{n}" for m, n in need if kernel(m, n) is None]

    # ---- steps ----

    def _seq(self, c: ScheduledChunk) -> StepSeq:
        r = c.req
        return StepSeq(r.token_ids[c.start:c.start + c.num_tokens] + c.draft_ids, c.start, r.block_table,
                       r.state_set, c.needs_logits, list(c.snapshots), verify=bool(c.draft_ids))

    def _pad_seq(self) -> StepSeq:
        return StepSeq([0], 0, [self.pad_page], [self.pad_page] * self.num_groups, True)

    def execute(self, out: SchedulerOutput) -> dict[int, int | list[int]]:
        if not out.chunks and not out.decodes:
            return {}
        chunks = begin_step(self.pool, out)
        seqs = [self._seq(c) for c in chunks]
        score_rows = prompt_score_rows(chunks)
        n = len(seqs)
        size = next((s for s in self.graph_sizes if s >= n), None)
        if self.graphs and not out.chunks and not score_rows and size in self.graphs:
            logits = self._replay(seqs, size)[:n]
            tapped = self.graphs[size].taps
        else:
            step = self._build(seqs, [row for _, row, _ in score_rows])
            logits = self.fwd(step, decode=step.decode_only)
            tapped = self.fwd.tapped
        reqs = [c.req for c in chunks if c.needs_logits and not c.draft_ids]
        verify = [(i, c) for i, c in enumerate(chunks) if c.draft_ids]
        n_plain, n_verify = len(reqs), sum(c.num_fed for _, c in verify)
        if score_rows:
            record_prompt_logprobs(logits[n_plain + n_verify:], score_rows)
        sampled: dict[int, int | list[int]] = sample_step(self.sampler, logits[:n_plain], reqs,
                                                          use_kernels=self.kernels.triton, penalties=self.penalties)
        kept: dict[int, int] = {}  # verify chunk -> its accepted run's fed tokens
        if verify:
            results = verify_requests(self.sampler, logits[n_plain:n_plain + n_verify], [c.req for _, c in verify],
                                      [c.draft_ids for _, c in verify])
            self.fwd.commit_verified(step, [(i, len(res.token_ids), c.req.state_set)
                                            for (i, c), res in zip(verify, results)])
            for (_, c), res in zip(verify, results):
                r = c.req
                # the device penalty counts missed these tokens: rebuilt from token_ids at the next use
                self.penalties.release(r.rid)
                r.sampled.run_logprobs, r.sampled.run_top_logprobs = res.logprobs, res.top_logprobs
                sampled[r.rid] = res.token_ids
            kept = {i: len(res.token_ids) for (i, _), res in zip(verify, results)}
        if self.target_states is not None:
            record_step_states(self.target_states, chunks, tapped, kept)
        return sampled

    def release(self, rid: int) -> None:
        self.penalties.release(rid)
        if self.target_states is not None:
            self.target_states.release(rid)

    def _build(self, seqs: list[StepSeq], extra_rows: list[int]) -> GpuStep:
        return build_step(seqs, block_size=self.block_size, conv_width=self.fwd.conv_width,
                          num_groups=self.num_groups, device=self.device, extra_logit_rows=extra_rows)

    # ---- CUDA graphs ----

    def _pack(self, seqs: list[StepSeq]):
        return pack_step(seqs, block_size=self.block_size, conv_width=self.fwd.conv_width,
                         num_groups=self.num_groups, max_blocks=self.max_blocks)

    def capture(self) -> None:
        """Capture one decode graph per size, largest first (they share one memory pool)."""
        from tqdm import tqdm

        pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for size in tqdm(sorted(self.graph_sizes, reverse=True), desc="capturing decode graphs", unit="graph",
                         leave=False):
            meta, (h64, h32) = self._pack([self._pad_seq()] * size)
            flat64, flat32 = h64.to(self.device), h32.to(self.device)
            step = step_views(meta, flat64, flat32)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile and autotune outside the capture
                    self.fwd(step, decode=True)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.fwd(step, decode=True)
            self.graphs[size] = _Graph(graph, flat64, flat32, logits, dict(self.fwd.tapped))
        torch.cuda.synchronize()
        log.info("captured %d decode graphs in %.1f s", len(self.graphs), time.perf_counter() - t0)

    def _replay(self, seqs: list[StepSeq], size: int) -> torch.Tensor:
        g = self.graphs[size]
        _, (h64, h32) = self._pack(seqs + [self._pad_seq()] * (size - len(seqs)))
        g.flat64.copy_(h64.pin_memory(), non_blocking=True)
        g.flat32.copy_(h32.pin_memory(), non_blocking=True)
        g.graph.replay()
        return g.logits
