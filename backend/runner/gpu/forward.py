"""The model's forward pass on the GPU path.

It runs the same modules (and weights) as the reference path in `backend/models/`, rearranged once
(fused input GEMMs, absorbed MLA weights) and with the attention/expert/norm math routed to the
Triton kernels. Everything the layers index with comes from the device-side `GpuStep`, so a
decode step contains no host synchronization and can be captured in a CUDA graph.
"""

from __future__ import annotations

import logging

import torch

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.layers.norm import rms_norm
from k3rt.backend.models.attn_res import AttnResStream, attn_res_mix
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.moe import MoE
from k3rt.backend.runner.gpu.ffn import MoeWeights, mlp_forward, moe_add_norm, moe_forward, sums_add_norm
from k3rt.backend.runner.gpu.kda import KdaWeights, kda_commit, kda_commit_graphed, kda_forward, kda_layer_add_norm
from k3rt.backend.runner.gpu.mla import MlaWeights, mla_forward, mla_layer_add_norm
from k3rt.backend.runner.gpu.ops import KernelConfig, kernel, linear, norm
from k3rt.backend.runner.gpu.step import GpuStep

log = logging.getLogger(__name__)


class GpuForward:
    def __init__(self, model: KimiForCausalLM, pool: PagePool, kernels: KernelConfig, *, max_batch: int = 4096) -> None:
        self.model, self.pool, self.k = model, pool, kernels
        L = pool.layout
        self.cfg = model.cfg
        # tensor parallelism: this rank holds its shard of every TP-aware layer (heads, widths, vocabulary) and
        # reduces at the points the reference layers do (backend/runner/gpu/tp.py says where)
        self.tp = model.tp
        self.layers = list(model.model.layers)
        self.prepared: dict[int, KdaWeights | MlaWeights] = {}
        for g, group in enumerate(L.kda_groups):
            for t, i in enumerate(group):
                self.prepared[i] = KdaWeights.of(self.layers[i].self_attn, g, t)
        for t, i in enumerate(L.mla_group):
            self.prepared[i] = MlaWeights.of(self.layers[i].self_attn, t)
        self.moe = {i: MoeWeights.of(layer.mlp, kernels) for i, layer in enumerate(self.layers)
                    if isinstance(layer.mlp, MoE)}
        for why in sorted({w.unfit for w in self.moe.values() if w.unfit is not None}):
            log.info("MXFP4 experts: the dot_scaled kernel where the planar layout does not fit (%s)", why)
        kda = [w for w in self.prepared.values() if isinstance(w, KdaWeights)]
        self.conv_width = kda[0].conv_weight.shape[1] if kda else 1
        self.norm_kernel = kernel("norm", "rms_norm") if kernels.triton else None
        ws = kernel("kda", "kda_decode_workspace") if kernels.triton else None
        heads = max((w.A_log.numel() for w in self.prepared.values() if isinstance(w, KdaWeights)), default=0)
        # one set of per-head counters serves every KDA layer and step (allocated outside graph capture)
        self.kda_workspace = ws(max_batch, heads, pool.tensors[0].device) if ws is not None and heads else None
        self.mix_kernel = kernel("attn_res", "attn_res_mix") if kernels.triton else None
        # target states a model drafter reads (backend/spec/dspark/target.py numbering): every forward keeps
        # each tapped layer's state over all rows in `tapped` (inside a CUDA graph: the graph's own tensors)
        self.taps: frozenset[int] = frozenset()
        self.tapped: dict[int, torch.Tensor] = {}
        # verify graphs: per KDA layer, the buffers their forward copies its commit inputs into (qkv, g, beta for
        # up to `rows` rows), shared by every bucket's graph (reserve_verify_inputs, before capture)
        self.verify_keep: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def reserve_verify_inputs(self, rows: int) -> None:
        """Allocate `verify_keep` for verify-graph steps of up to `rows` rows (outside any capture: the graphs
        of every bucket then write the same buffers, where each graph's own outputs would cost one set per
        bucket; a step's commit reads them before the next replay, in stream order). The buffers hold
        kda_decode's inputs (pre-conv qkv, f, b in the activation dtype), what the kernels' form keeps."""
        dev = self.pool.tensors[0].device
        for i, w in self.prepared.items():
            if isinstance(w, KdaWeights):
                attn = self.layers[i].self_attn
                H, D = attn.num_heads, attn.head_dim
                self.verify_keep[i] = (torch.empty(rows, 3 * H * D, dtype=w.w_in.dtype, device=dev),
                                       torch.empty(rows, H * D, dtype=w.w_in.dtype, device=dev),
                                       torch.empty(rows, H, dtype=w.w_in.dtype, device=dev))

    def persistent_counters(self) -> dict[str, torch.Tensor]:
        """Each persistent one-token launch's counters (kernels/persistent.py) by the layer that owns them ("layer 3
        moe"): every word is zero whenever the stream is idle, after each launch that finished cleanly (the last
        program zeroes the arrival counts; a wait that gave up counts itself in a sticky word)."""
        out = {f"layer {i} {'kda' if isinstance(w, KdaWeights) else 'mla'}": w.sync
               for i, w in self.prepared.items() if w.sync is not None}
        out.update({f"layer {i} moe": w.sync for i, w in self.moe.items() if w.sync is not None})
        return out

    def persistent_faults(self) -> list[str]:
        """The persistent launches whose counters are not all zero, each with its nonzero words ("layer 3 moe: words
        {4: 2}"): a wait gave up (a grid larger than the SMs hold at once) or a launch never finished. Reads the
        counters back (waits for the device)."""
        counters = self.persistent_counters()
        if not counters:
            return []
        flat = torch.cat(list(counters.values())).cpu().tolist()
        faults, at = [], 0
        for name, t in counters.items():
            words = {j: v for j, v in enumerate(flat[at:at + t.numel()]) if v}
            at += t.numel()
            if words:
                faults.append(f"{name}: words {words}")
        return faults

    def _tap(self, i: int, x: torch.Tensor) -> None:
        if i in self.taps:
            self.tapped[i] = x

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm(x, weight, eps, self.k)

    def add_norm(self, delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta), the sum rounded to the activation dtype first."""
        if self.norm_kernel is not None:
            return self.norm_kernel(delta, weight, eps, residual=residual)
        h = residual + delta
        return rms_norm(h, weight, eps), h

    def logits(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # rounded to the activation dtype, then fp32, as the reference lm_head does (into `out` if given).
        # Under TP: this rank's vocabulary slice in the activation dtype (gathered by `full_logits` outside any
        # graph: half the bytes of fp32, and the same values, since fp32 is only the rounded value widened)
        y = linear(x, self.model.lm_head.weight, self.k)
        if self.tp.size > 1:
            return y if out is None else out.copy_(y)
        return y.float() if out is None else out.copy_(y)

    def logits_dtype(self) -> torch.dtype:
        """dtype of what __call__ returns: fp32 at TP 1, the activation dtype (this rank's slice) under TP."""
        return torch.float32 if self.tp.size == 1 else self.model.lm_head.weight.dtype

    def full_logits(self, local: torch.Tensor) -> torch.Tensor:
        """__call__'s output -> fp32 logits over the whole vocabulary on rank 0 (a worker gets its own slice
        back: it only takes part in the gather)."""
        if self.tp.size == 1:
            return local
        out = self.tp.gather_last_dim(local)
        return out.float() if self.tp.rank == 0 else out

    @property
    def mix_stacked(self) -> bool | None:
        """The mix kernel's `stacked` (KernelConfig.attn_res_stacked, read per call: benchmarks swap `k`): None lets
        it take its stacked form where that fits, False keeps the online one."""
        return None if self.k.attn_res_stacked else False

    def mix(self, stream: AttnResStream, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float,
            then_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The attention-residual mix of the stream's sources, then (then_norm: its weight) the next sub-layer's
        RMSNorm. From a SlotStream, one launch: the sub-layer output the stream holds back (SlotStream.add), the
        mix and the norm (where the stream, mix and norm were three launches: a k3 forward's 16 mixes took 48)."""
        if isinstance(stream, SlotStream):
            if stream.blocks:  # the sources where they are: no stack per mix
                delta, opens = stream.take_pending()
                return self.mix_kernel(stream.buf, norm_w, proj_w.reshape(-1), eps, num_sources=stream.num_sources,
                                       delta=delta, delta_add=not opens, out_norm_weight=then_norm, out_norm_eps=eps,
                                       stacked=self.mix_stacked)
            stream.flush()
        assert stream.prefix is not None
        if not stream.blocks:
            x = stream.prefix
        elif self.mix_kernel is not None:  # the list form (pieces.py): the sources stacked, the norm in the launch
            return self.mix_kernel(torch.stack([*stream.blocks, stream.prefix]), norm_w, proj_w.reshape(-1), eps,
                                   out_norm_weight=then_norm, out_norm_eps=eps, stacked=self.mix_stacked)
        else:
            x = attn_res_mix(stream.blocks, stream.prefix, norm_w, proj_w, eps)
        return x if then_norm is None else self.norm(x, then_norm, eps)

    def attention(self, i: int, x: torch.Tensor, step: GpuStep, decode: bool) -> torch.Tensor:
        w = self.prepared[i]
        attn = self.layers[i].self_attn
        if isinstance(w, KdaWeights):
            y = kda_forward(attn, w, x, step, self.pool.conv[w.tensor], self.pool.rec[w.tensor], self.k,
                            decode=decode, workspace=self.kda_workspace, keep=self.verify_keep.get(i))
        else:
            y = mla_forward(attn, w, x, step, self.pool.mla[w.slot], self.k)
        # o_proj is row-parallel: each rank holds the partial sum over its heads (the identity at TP 1)
        return self.tp.all_reduce(y)

    def attention_add_norm(self, i: int, x: torch.Tensor, step: GpuStep, decode: bool, residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """add_norm(attention(i, x), residual, weight, eps): a one-sequence decode's KDA layer in one launch, its MLA
        layer in three around the attention core, where they can run there (kda.py kda_layer_add_norm, mla.py
        mla_layer_add_norm)."""
        w, attn = self.prepared[i], self.layers[i].self_attn
        if isinstance(w, KdaWeights):
            fused = kda_layer_add_norm(attn, w, x, step, self.pool.conv[w.tensor], self.pool.rec[w.tensor], self.k,
                                       residual, weight, eps, decode=decode)
        else:
            fused = mla_layer_add_norm(attn, w, x, step, self.pool.mla[w.slot], self.k, residual, weight, eps,
                                       decode=decode)
        return fused if fused is not None else self.add_norm(self.attention(i, x, step, decode), residual, weight, eps)

    @torch.no_grad()
    def commit_verified(self, step: GpuStep, runs: list[tuple[int, int, list[int]]]) -> None:
        """After a verify step: every KDA layer advances each run's states by its accepted prefix.
        runs: (sequence in the step, fed tokens to keep, its live state set)."""
        for i, w in self.prepared.items():
            if isinstance(w, KdaWeights):
                kda_commit(self.layers[i].self_attn, w, step, [(s, m, pages[w.group]) for s, m, pages in runs],
                           self.pool.conv[w.tensor], self.pool.rec[w.tensor], self.k.batch_invariant)

    @torch.no_grad()
    def commit_graphed(self, step: GpuStep, accepted: torch.Tensor) -> None:
        """After a verify-graph step (device tensors only, captured per bucket): every KDA layer advances
        sequence i of the step by accepted[i] tokens on the step's own state pages (0: as it was)."""
        for i, w in self.prepared.items():
            if isinstance(w, KdaWeights):
                kda_commit_graphed(self.layers[i].self_attn, w, step, accepted, self.pool.conv[w.tensor],
                                   self.pool.rec[w.tensor], self.k, self.kda_workspace)

    def ffn_add_norm(self, i: int, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """add_norm(ffn(i, x), residual, weight, eps), with the add and the norm in the MoE's experts' sum launch
        where it can run there (ffn.py sums_add_norm)."""
        mlp = self.layers[i].mlp
        if isinstance(mlp, MoE) and sums_add_norm(mlp, self.moe[i], x, weight, self.k):
            return moe_add_norm(mlp, self.moe[i], x, residual, weight, eps, self.k)
        return self.add_norm(self.ffn(i, x), residual, weight, eps)

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        mlp = self.layers[i].mlp
        if isinstance(mlp, MoE):
            return moe_forward(mlp, self.moe[i], x, self.k)  # reduces inside (routed + shared, the latent tail)
        y = mlp_forward(mlp, x, self.k)
        return self.tp.all_reduce(y) if mlp.down_proj.reduce else y

    @torch.no_grad()
    def __call__(self, step: GpuStep, *, decode: bool = False, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """-> fp32 logits [len(step.logit_rows), vocab], written into `logits_out` when given (the decode graphs
        all write one buffer: a [B, vocab] fp32 output per graph size is 1.6 GiB at 163,840 words up to 512)."""
        m, eps = self.model.model, self.cfg.rms_norm_eps
        step.derived.clear()  # what the layers derive from the step's buffers is re-derived by this forward
        h = m.embed_tokens(step.ids)
        if not self.cfg.attn_res_block_size:
            # pre-norm residual stream; each residual add is fused into the next norm
            x = self.norm(h, self.layers[0].input_layernorm.weight, eps)
            self._tap(0, x)
            for i, layer in enumerate(self.layers):
                x, h = self.attention_add_norm(i, x, step, decode, h, layer.post_attention_layernorm.weight, eps)
                nxt = self.layers[i + 1].input_layernorm.weight if i + 1 < len(self.layers) else m.norm.weight
                x, h = self.ffn_add_norm(i, x, h, nxt, eps)
                self._tap(i + 1, x)  # layer i + 1's normalized input; the final norm's output after the last
            x = x if step.logits_every_row else x[step.logit_rows]
            return self.logits(x, logits_out)
        bs = self.cfg.attn_res_block_size
        stream = SlotStream(h, bs, len(self.layers)) if self.mix_kernel is not None else AttnResStream(h, bs)
        for i, layer in enumerate(self.layers):
            x = self.mix(stream, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, eps,
                         then_norm=layer.input_layernorm.weight)
            stream.begin_layer(i)
            self._tap(i, x)
            stream.add(self.attention(i, x, step, decode))
            x = self.mix(stream, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps,
                         then_norm=layer.post_attention_layernorm.weight)
            stream.add(self.ffn(i, x))
        # the final norm is row-wise: every row normalized with the mix (one launch), then the logit rows taken
        x = self.mix(stream, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, eps, then_norm=m.norm.weight)
        self._tap(len(self.layers), x)  # the final normalized state of every row, not only the logit rows
        return self.logits(x if step.logits_every_row else x[step.logit_rows], logits_out)


class SlotStream(AttnResStream):
    """The attention-residual stream with its blocks and running prefix in the slots of one [J, T, D] buffer
    (slot j: block j, then the prefix after the last block), so the mix kernel reads its sources in place. The
    list form stacks every source for every mix: 15 copies per k3-tiny forward, against none here (the first
    sub-layer output of a block goes into its slot; each later one is added into it, with the rounding of
    `prefix + y`). The add is held back until the mix that follows it, which the mix kernel then does in the same
    launch (`take_pending`); anything else reading the prefix first applies it (`flush`)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int, num_layers: int) -> None:
        # blocks close before layers 0, B, 2B, ...: ceil(L / B) of them, then the running prefix
        self.buf = embeddings.new_empty(-(-num_layers // block_size) + 1, *embeddings.shape)
        self.buf[0].copy_(embeddings)
        super().__init__(self.buf[0], block_size)
        self.pending: tuple[torch.Tensor, bool] | None = None  # (sub-layer output, it opens a block)

    @property
    def num_sources(self) -> int:
        return len(self.blocks) + 1

    def add(self, y: torch.Tensor) -> None:
        self.flush()
        self.pending = (y, self.prefix is None)
        self.prefix = self.buf[len(self.blocks)]  # the slot the add writes (once applied)

    def take_pending(self) -> tuple[torch.Tensor | None, bool]:
        """(the held-back output, whether it opens its block) for the mix kernel to apply, or (None, False)."""
        pending, self.pending = self.pending, None
        return pending if pending is not None else (None, False)

    def flush(self) -> None:
        if self.pending is not None:
            (y, opens), self.pending = self.pending, None
            if opens:
                self.prefix.copy_(y)
            else:
                torch.add(self.prefix, y, out=self.prefix)

    def begin_layer(self, idx: int) -> None:
        self.flush()
        super().begin_layer(idx)

