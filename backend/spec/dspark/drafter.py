"""`DSparkDrafter`: the scheduler-facing drafter over a DSparkModel and its target's shared weights.

What a query must carry (the one extension of `DraftQuery`): `hidden` is [context_len, len(target_layers)
* target_hidden] — the drafter's `target_layers` states (target.py) at the request's last `context_len`
positions the target has run, oldest first. The newest token (token_ids[-1], just sampled) has not run
yet and is the block's anchor. A request with fewer positions run than context_len (a prompt shorter than
the window) sends what it has; the oldest row is repeated to fill the window, and a drafter with
context tokens or a copy head also masks those padding rows out. The window's token ids are the query's
own `token_ids` (the rows end right before the anchor, so they are the last rows + 1 token ids).

Drafts are the argmax of base + Markov logits: deterministic, so for a sampled target the rejection
sampler's usual one-hot draft distribution applies unchanged. Per request, only the first
`verify_length` drafts are returned (cumulative confidence >= threshold, at least min_verify, at most
max_tokens): a confident request verifies up to k, a lost one verifies few.

The pass is `DSparkModel.greedy_pass`: the block pass, then the k left-to-right steps either in one Triton
launch (`fused`, kernels/spec: the default on a CUDA device) or as the torch loop of `DSparkModel.draft`.
On a CUDA device with graph sizes given, it replays a CUDA graph per batch bucket (graph.py): the eager
pass's computation at the bucket's batch size (the rows past the batch are padding nobody reads). The
batch's inputs are built with a fixed number of device ops (`_inputs`) and read back with one sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from k3rt.backend.device import to_device
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import CheckpointError
from k3rt.backend.spec.base import DraftQuery, Drafter, Proposal
from k3rt.backend.spec.dspark.checkpoint import load_drafter
from k3rt.backend.spec.dspark.graph import DraftGraphs
from k3rt.backend.spec.dspark.model import DSparkModel, clamp_verify, confident_prefix
from k3rt.backend.spec.dspark.target import check_layers


class DSparkDrafter(Drafter):
    def __init__(self, model: DSparkModel, embed: torch.Tensor, lm_head: torch.Tensor, *,
                 confidence_threshold: float | None = None, graph_sizes: tuple[int, ...] = (),
                 fused: bool | None = None) -> None:
        """embed, lm_head: the target's [vocab, hidden] token embedding and LM head (the same tensor when
        tied). confidence_threshold overrides the config's (0 verifies every draft). graph_sizes: batch
        buckets whose pass is captured in a CUDA graph (on a CUDA device only; empty: every pass eager).
        fused: the left-to-right steps in one Triton launch (kernels/spec) instead of ~25 torch ops per draft;
        None: on a CUDA device only (on the CPU the kernel needs the Triton interpreter, which tests use)."""
        cfg = model.cfg
        for name, w in (("embed", embed), ("lm_head", lm_head)):
            if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise CheckpointError(f"{name}: target has [{', '.join(map(str, w.shape))}], drafter config "
                                      f"needs [vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}]")
        # on a GPU the drafter computes in the target's dtype and reads the target's tensors in place: fp32
        # copies of two [vocab, hidden] tables would cost 2 x 4.7 GB at K3's shape. On the CPU (the reference
        # path, bf16 matmuls slow or missing) it computes in fp32 from fp32 copies, as it was trained.
        self.dtype = embed.dtype if embed.device.type == "cuda" else torch.float32
        self.model = model.to(self.dtype).eval()
        self.embed, self.lm_head = embed.detach().to(self.dtype), lm_head.detach().to(self.dtype)
        self.threshold = cfg.confidence_threshold if confidence_threshold is None else confidence_threshold
        self.fused = embed.device.type == "cuda" if fused is None else fused
        self.graphs: DraftGraphs | None = None
        self._last: tuple | None = None  # the last pass's inputs (window)
        # rid -> (token count, drafts + confident prefix, estimates): a pass the device rounds ran after a step's
        # last round (`pass_on`, `carry`), used by the next step's proposal while the request's tokens match
        self._carried: dict[int, tuple[int, list[int], list[float]]] = {}
        if graph_sizes and embed.device.type == "cuda":
            self.graphs = DraftGraphs(self.model, self.embed, self.lm_head, graph_sizes, self.dtype, fused=self.fused)
            self.graphs.capture()

    @classmethod
    def from_folder(cls, folder: str | Path, target: KimiForCausalLM, *, num_tokens: int | None = None,
                    **kwargs) -> "DSparkDrafter":
        """The drafter in `folder` for `target`, on the target's device. num_tokens: the drafts per request the
        engine asks for (SpecConfig.num_tokens), at most the drafter's block_size."""
        embed = target.model.embed_tokens.weight
        model = load_drafter(folder, device=str(embed.device))
        cfg = model.cfg
        where = Path(folder) / "config.json"
        try:
            check_layers(target, cfg.target_layers)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        if cfg.target_hidden_size != target.cfg.hidden_size:
            raise CheckpointError(f"{where}: target_hidden_size {cfg.target_hidden_size} but "
                                  f"the target's hidden_size is {target.cfg.hidden_size}")
        if cfg.vocab_size != target.cfg.vocab_size or cfg.hidden_size != target.cfg.hidden_size:
            raise CheckpointError(f"{where}: vocab_size {cfg.vocab_size}, hidden_size {cfg.hidden_size} but the "
                                  f"target's are {target.cfg.vocab_size}, {target.cfg.hidden_size} (the drafter "
                                  "shares the target's embedding and LM head)")
        if num_tokens is not None and num_tokens > cfg.block_size:
            raise ValueError(f"spec_tokens: the drafter in {folder} drafts block_size={cfg.block_size} tokens per "
                             f"pass, got {num_tokens}")
        return cls(model, embed, target.lm_head.weight, **kwargs)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Which target states the runner must capture (target.py numbering)."""
        return self.model.cfg.target_layers

    @property
    def context_len(self) -> int:
        """How many of the newest run positions' states a query carries."""
        return self.model.cfg.context_len

    def _inputs(self, queries: Sequence[DraftQuery]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's pass inputs, built with a fixed number of device ops whatever the batch: (states
        [n, context_len, F] left-padded with each request's oldest row, anchors [n], and for a drafter that
        reads them ctx_tokens [n, context_len + 1] (context positions then the anchor, left-padded with the
        anchor) and ctx_valid [n, context_len] (False on padding rows)). The per-request work is host lists;
        one host tensor carries every index and id to the device, one gather builds the windows."""
        cfg = self.model.cfg
        w, width = cfg.context_len, len(cfg.target_layers) * cfg.target_hidden_size
        held: list[int] = []
        ids: list[list[int]] = []
        for q in queries:
            h = q.hidden
            if h.dim() != 2 or h.shape[1] != width or not 1 <= h.shape[0] <= w:
                raise ValueError(f"dspark: request {q.rid} hidden is {list(h.shape)}, expected [1..{w}, {width}]")
            n = h.shape[0]
            if self.model.needs_tokens:  # an old-format drafter reads states only (its tests send few token ids)
                if len(q.token_ids) < n + 1:
                    raise ValueError(f"dspark: request {q.rid} has {n} state rows but only {len(q.token_ids)} "
                                     "tokens (the rows must end right before the anchor)")
                tail = list(q.token_ids[len(q.token_ids) - n - 1:])
                ids.append([tail[-1]] * (w - n) + tail)
            else:
                ids.append([q.token_ids[-1]])
            held.append(n)
        n_held = torch.tensor(held)
        pad = w - n_held[:, None]  # [n, 1] padding rows at the front of each window
        pos = torch.arange(w)[None, :]
        # window row p of request i is its state row max(0, p - pad_i), a row of the concatenated states
        index = (torch.cumsum(n_held, 0) - n_held)[:, None] + (pos - pad).clamp(min=0)
        # pinned and non-blocking: no wait for the device's queued work (the runner queues a pass right after a step)
        meta = to_device(torch.cat([index, (pos >= pad).long(), torch.tensor(ids)], 1), self.embed.device)
        rows = torch.cat([q.hidden for q in queries]) if len(queries) > 1 else queries[0].hidden
        ctx = rows.to(self.embed.device)[meta[:, :w]].to(self.dtype)
        extra = {}
        if self.model.needs_tokens:
            extra = dict(ctx_tokens=meta[:, 2 * w:], ctx_valid=meta[:, w:2 * w].bool())
        return ctx, meta[:, -1], extra

    def window(self, queries: Sequence[DraftQuery]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                             torch.Tensor]:
        """The pass inputs of queries that all carry states, as tensors the caller may update in place (the
        device rounds of backend/runner/gpu/rounds.py shift them): (states [n, context_len, F], anchors [n],
        window token ids [n, context_len + 1] or None when this drafter reads none, valid rows [n, context_len]).
        Rows of this step's proposal are taken from it (a gather) when every query is one of its requests at the
        same token count; otherwise built again."""
        last = self._last
        if last is not None and all(last[0].get(q.rid, (None, -1))[1] == len(q.token_ids) for q in queries):
            rows = torch.tensor([last[0][q.rid][0] for q in queries], device=last[1].device)
            ctx, anchors, tokens, valid = (t.index_select(0, rows) if t is not None else None for t in last[1:])
            return ctx, anchors, tokens, valid
        return self.fresh_window(queries)

    def fresh_window(self, queries: Sequence[DraftQuery]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor]:
        """`window`'s tensors built from the queries' recorded states and token ids, never taken from a pass."""
        ctx, anchors, extra = self._inputs(queries)
        return (ctx, anchors, extra["ctx_tokens"].clone() if "ctx_tokens" in extra else None,
                self._valid(queries, ctx, extra))

    @staticmethod
    def _valid(queries: Sequence[DraftQuery], ctx: torch.Tensor, extra: dict) -> torch.Tensor:
        """[n, context_len] bool: the window rows that hold a state (a drafter that reads token ids has them in
        extra; else the rows each query holds, right-aligned)."""
        if "ctx_valid" in extra:
            return extra["ctx_valid"]
        w = ctx.shape[1]
        held = to_device(torch.tensor([q.hidden.shape[0] for q in queries]), ctx.device)
        return torch.arange(w, device=ctx.device)[None, :] >= (w - held)[:, None]

    def propose(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        return [p.token_ids for p in self._pass(queries)]

    def propose_scored(self, queries: Sequence[DraftQuery], full: bool = False) -> list[Proposal]:
        return self._pass(queries, full)

    def finish(self, rid: int, token_ids: Sequence[int], prompt_len: int) -> None:
        self._carried.pop(rid, None)

    @torch.no_grad()
    def pass_on(self, ctx: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor | None,
                valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pass over windows already on the device (`window`'s form, e.g. a device round's after its last
        acceptance) -> (drafts [n, k], estimates [n, k], confident prefix [n]) on the device, no sync."""
        extra = {"ctx_tokens": tokens, "ctx_valid": valid} if self.model.needs_tokens else {}
        if self.graphs is not None and self.graphs.size_for(ctx.shape[0]) is not None:
            drafts, conf = self.graphs.draft(ctx, anchors, **extra)
        else:
            drafts, conf = self.model.greedy_pass(ctx, anchors, self.embed, self.lm_head, fused=self.fused, **extra)
        return drafts, conf, confident_prefix(conf, self.threshold)

    def carry(self, rids: Sequence[int], counts: Sequence[int], rows: Sequence[list[int]],
              confs: Sequence[list[float]], window: tuple) -> None:
        """Keep a `pass_on` pass for the next proposal: per request its token count once the pass's anchor is
        its last token, its drafts followed by the confident prefix (as read back), its estimates; window: the
        pass's (ctx, anchors, tokens, valid), rows in rids' order, kept for `window` (the next step's device
        rounds start from it). Why: at batch 1 the next step's proposal otherwise builds the window again from
        the recorded states and runs the pass with the host waiting (~1.1 ms of an 11 ms 8-round k3-tiny step
        on the H200, session 25, where the pass itself is 0.32 ms of device time)."""
        for rid, n, row, c in zip(rids, counts, rows, confs):
            self._carried[rid] = (n, row, c)
        self._last = ({rid: (i, n) for i, (rid, n) in enumerate(zip(rids, counts))}, *window)

    def _carried_for(self, q: DraftQuery) -> tuple[list[int], list[float]] | None:
        got = self._carried.get(q.rid)
        return (got[1], got[2]) if got is not None and got[0] == len(q.token_ids) else None

    def _proposal(self, row: list[int], conf: list[float], max_tokens: int, full: bool) -> Proposal:
        """A pass's row (drafts, then the confident prefix) -> the drafts to offer (see _pass)."""
        k = self.model.cfg.block_size
        n = clamp_verify(k if full else row[-1], self.model.cfg.min_verify, max_tokens, k)
        return Proposal(row[:n], conf[:n])

    @torch.no_grad()
    def _pass(self, queries: Sequence[DraftQuery], full: bool = False) -> list[Proposal]:
        """One batched block pass over every query that carries target states; a query without them (its
        states were not recorded, e.g. right after a preemption) gets no drafts this step. A request whose
        confidence says no draft pays (min_verify 0) also gets none: it decodes plainly. Each proposal carries
        the confidence head's per-draft acceptance estimates of the drafts it returns. full: no confidence cut
        (every request gets min(K, max_tokens) drafts; see Drafter.propose_scored). A request with a carried
        pass at its current tokens (`carry`) takes that pass's drafts instead of running one."""
        out: list[Proposal] = [Proposal([]) for _ in queries]
        ready = []
        for i, q in enumerate(queries):
            got = self._carried_for(q) if q.hidden is not None else None
            if got is not None:
                out[i] = self._proposal(*got, q.max_tokens, full)
            elif q.hidden is not None:
                ready.append(i)
        if not ready:
            return out
        asked = [queries[i] for i in ready]
        ctx, anchors, extra = self._inputs(asked)
        # kept for `window` (the device rounds of this step start from the same windows): rid -> (row, tokens)
        self._last = ({q.rid: (row, len(q.token_ids)) for row, q in enumerate(asked)}, ctx, anchors,
                      extra.get("ctx_tokens"), self._valid(asked, ctx, extra))
        if self.graphs is not None and self.graphs.size_for(len(ready)) is not None:
            tokens, conf = self.graphs.draft(ctx, anchors, **extra)
        else:
            tokens, conf = self.model.greedy_pass(ctx, anchors, self.embed, self.lm_head, fused=self.fused, **extra)
        # each request's confident prefix on the device, read with the tokens: one wait for the device, no
        # per-request tensor op (the confidences' copy follows it, the pass already done)
        prefix = confident_prefix(conf, self.threshold)
        rows, confs = torch.cat([tokens, prefix[:, None]], 1).tolist(), conf.float().tolist()
        for row, c, i in zip(rows, confs, ready):
            out[i] = self._proposal(row, c, queries[i].max_tokens, full)
        return out
