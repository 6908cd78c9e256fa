"""CUDA graphs of the DSpark drafter's pass: one per batch bucket, replayed by `DSparkDrafter.propose`.

An eager pass is a few hundred small launches (block layers, the LM head, then k Markov/confidence steps left
to right, ~25 ops each, unless `fused` puts those steps in one Triton launch); at batch 1 on the H200 that was
2.94 ms per step for k3-tiny's drafter, against a target decode step well under 1 ms. Every shape in the pass
follows from the config (context_len, block_size, the tapped width) and the batch, so the whole of
`DSparkModel.greedy_pass` is captured as it is, whatever the model's layers are: this module knows the pass
only through that one call and the input shapes.

A batch of n queries replays the graph of the smallest bucket >= n; the rows past n hold the previous
call's inputs (or zeros), compute drafts nobody reads, and touch no state (the pass has none). Batches
above the largest bucket run eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from k3rt.backend.spec.dspark.model import DSparkModel

log = logging.getLogger(__name__)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [size, k] int64, written by each replay
    confidence: torch.Tensor  # [size, k] fp32 acceptance estimates


class DraftGraphs:
    def __init__(self, model: DSparkModel, embed: torch.Tensor, lm_head: torch.Tensor, sizes: tuple[int, ...],
                 dtype: torch.dtype, *, fused: bool = True) -> None:
        """sizes: the batch buckets to capture (each >= 1); embed, lm_head: the target's shared tables, on the
        CUDA device the graphs run on; dtype: what the drafter computes in (its context rows are cast to it);
        fused: capture the pass with its left-to-right steps in one kernel (DSparkModel.greedy_pass)."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"sizes: need batch buckets >= 1, got {sizes}")
        if embed.device.type != "cuda":
            raise ValueError(f"embed: CUDA graphs need the drafter on a CUDA device, got {embed.device}")
        self.model, self.embed, self.lm_head, self.fused = model, embed, lm_head, fused
        self.sizes = tuple(sorted(set(sizes)))
        cfg = model.cfg
        largest = self.sizes[-1]
        # static inputs: every graph reads the first `size` rows (replays run in stream order, one at a time)
        self.ctx = torch.zeros(largest, cfg.context_len, model.fc.in_features, dtype=dtype, device=embed.device)
        self.anchors = torch.zeros(largest, dtype=torch.int64, device=embed.device)
        # a drafter that reads the window's token ids (context tokens, copy head) gets them, and which rows hold
        # a state, through two more static buffers; padding rows copy their left-pad row (all valid is fine)
        self.tokens = self.valid = None
        if model.needs_tokens:
            self.tokens = torch.zeros(largest, cfg.context_len + 1, dtype=torch.int64, device=embed.device)
            self.valid = torch.ones(largest, cfg.context_len, dtype=torch.bool, device=embed.device)
        self.graphs: dict[int, _DraftGraph] = {}

    def size_for(self, n: int) -> int | None:
        """The bucket a batch of n queries replays, None when n is above every bucket (eager)."""
        return next((s for s in self.sizes if s >= n), None)

    def _extra(self, size: int) -> dict[str, torch.Tensor]:
        if self.tokens is None:
            return {}
        return {"ctx_tokens": self.tokens[:size], "ctx_valid": self.valid[:size]}

    def _pass(self, ctx: torch.Tensor, anchors: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.greedy_pass(ctx, anchors, self.embed, self.lm_head, fused=self.fused, **self._extra(size))

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool; the pass's intermediates (the unfused pass's
        draft logits among them) are dropped at the end of its capture (only tokens and confidences are read),
        so the pool keeps one bucket's, not one per bucket. Logs the time and the device memory the graphs took."""
        t0 = time.perf_counter()
        dev = self.embed.device
        reserved0 = torch.cuda.memory_reserved(dev)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ctx, anchors = self.ctx[:size], self.anchors[:size]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile/autotune and the allocator's warm-up outside the capture
                    self._pass(ctx, anchors, size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                tokens, conf = self._pass(ctx, anchors, size)
            self.graphs[size] = _DraftGraph(graph, tokens, conf)
        torch.cuda.synchronize(dev)
        log.info("captured %d drafter graphs (batch %d to %d) in %.1f s, %.2f GiB of device memory",
                 len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - t0,
                 (torch.cuda.memory_reserved(dev) - reserved0) / 2**30)

    def draft(self, ctx: torch.Tensor, anchors: torch.Tensor, ctx_tokens: torch.Tensor | None = None,
              ctx_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [n, context_len, features], anchors [n] (n <= the largest bucket), and for a drafter that reads
        them the window's token ids [n, context_len + 1] and valid rows [n, context_len] -> (tokens [n, k],
        acceptance estimates [n, k]): views of the replayed graph's outputs, valid until the next call."""
        n = ctx.shape[0]
        size = self.size_for(n)
        if size is None or size not in self.graphs:
            raise ValueError(f"ctx: {n} queries, more than the largest captured drafter graph ({self.sizes[-1]})")
        self.ctx[:n].copy_(ctx, non_blocking=True)
        self.anchors[:n].copy_(anchors, non_blocking=True)
        if self.tokens is not None:
            if ctx_tokens is None or ctx_valid is None:
                raise ValueError("ctx_tokens, ctx_valid: this drafter reads the window's token ids; pass both")
            self.tokens[:n].copy_(ctx_tokens, non_blocking=True)
            self.valid[:n].copy_(ctx_valid, non_blocking=True)
        g = self.graphs[size]
        g.graph.replay()
        return g.tokens[:n], g.confidence[:n]
