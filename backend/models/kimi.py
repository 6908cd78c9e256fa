"""The Kimi hybrid decoder (Kimi-Linear and the Kimi-K3 text backbone) in plain torch.

This is the reference path: it runs on CPU, is the oracle for every kernel, and is what the engine
runs until the GPU path replaces layers with fused kernels. Parameter names follow the published
checkpoint layout where possible (`model.layers.{i}.self_attn.q_proj.weight`, ...); the loader maps
the other spellings onto them.
"""

from __future__ import annotations

import torch
from torch import nn

from k3rt.backend.distributed import SINGLE, TPContext
from k3rt.backend.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from k3rt.backend.layers.linear import ReplicatedLinear
from k3rt.backend.layers.norm import RMSNorm
from k3rt.backend.models.attn_res import AttnResStream
from k3rt.backend.models.batch import ContiguousCache, ForwardBatch
from k3rt.backend.models.kda import KimiDeltaAttention
from k3rt.backend.models.mla import MultiHeadLatentAttention
from k3rt.backend.models.moe import GatedMLP, MoE
from k3rt.model_config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, *, tp: TPContext = SINGLE, ep: int | bool = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.idx = idx
        mixer = KimiDeltaAttention if cfg.layer_types[idx] == "kda" else MultiHeadLatentAttention
        self.self_attn = mixer(cfg, idx, tp=tp, dtype=dtype)
        self.mlp = (
            MoE(cfg, tp=tp, ep=ep, dtype=dtype) if cfg.mlp_types[idx] == "moe"
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.act, tp=tp, dtype=dtype)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.eps = cfg.rms_norm_eps
        if cfg.attn_res_block_size:
            # names as in the K3 checkpoint: weights of the depth-mix logits (norm weight * proj row)
            self.self_attention_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.self_attention_res_proj = ReplicatedLinear(cfg.hidden_size, 1, dtype=dtype)
            self.mlp_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.mlp_res_proj = ReplicatedLinear(cfg.hidden_size, 1, dtype=dtype)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # pre-norm residual: h + attn(norm(h)), then + mlp(norm(.))
        h = h + self.self_attn(self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_attn_res(self, stream: AttnResStream, batch: ForwardBatch) -> None:
        """The same two sub-layers with attention residuals replacing the plain residual (K3)."""
        x = stream.mix(self.self_attention_res_norm.weight, self.self_attention_res_proj.weight, self.eps)
        stream.begin_layer(self.idx)
        stream.add(self.self_attn(self.input_layernorm(x), batch))
        x = stream.mix(self.mlp_res_norm.weight, self.mlp_res_proj.weight, self.eps)
        stream.add(self.mlp(self.post_attention_layernorm(x)))


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp: TPContext = SINGLE, ep: int | bool = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp=tp, ep=ep, dtype=dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.output_attn_res_proj = ReplicatedLinear(cfg.hidden_size, 1, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if not self.cfg.attn_res_block_size:
            for layer in self.layers:
                h = layer(h, batch)
            return self.norm(h)
        stream = AttnResStream(h, self.cfg.attn_res_block_size)
        for layer in self.layers:
            layer.forward_attn_res(stream, batch)
        out = stream.mix(self.output_attn_res_norm.weight, self.output_attn_res_proj.weight, self.cfg.rms_norm_eps)
        return self.norm(out)


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp: TPContext = SINGLE, ep: int | bool = 1,
                 dtype: torch.dtype | None = None) -> None:
        """ep: the expert-parallel degree (model_config.ep_degree): routed experts in ep groups of whole experts."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = KimiModel(cfg, tp=tp, ep=ep, dtype=dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_batch_invariant(self, enabled: bool) -> None:
        """Switch every layer of this instance into (or out of) the deterministic mode: matmuls in fixed
        row tiles, MLA one query at a time, KDA by the per-token recurrence, so each token's logits
        depend only on its own sequence's tokens — not on the other sequences of a step, on where its
        prompt was split into chunks, or on a prefix-cache hit. Set once by the runner that owns the
        model (EngineConfig.deterministic); the varlen (engine) path honours it, the dense [B, T]
        training path does not."""
        for module in self.modules():
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = enabled

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids: [N] flat tokens of the batch -> fp32 logits [len(logits_indices) or N, vocab] (under
        tensor parallelism on rank 0; the other ranks get their vocabulary slice)."""
        if input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"input_ids: {input_ids.shape[0]} tokens but batch.seq_lens sum to {batch.num_tokens}")
        h = self.model(input_ids, batch)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        return self.lm_head(h)

    @torch.no_grad()
    def commit_verified(self, batch: ForwardBatch, seq: int, num_tokens: int) -> None:
        """After a forward with batch.verify[seq]: advance that sequence's KDA states (every KDA layer) by the
        first num_tokens tokens of its run (1 <= num_tokens <= its seq_len)."""
        if not 1 <= num_tokens <= batch.seq_lens[seq]:
            raise ValueError(f"num_tokens: {num_tokens} outside [1, {batch.seq_lens[seq]}]")
        for i, layer in enumerate(self.model.layers):
            if self.cfg.layer_types[i] == "kda":
                layer.self_attn.commit_verified(batch.caches[seq], batch.verify_inputs[(seq, i)], num_tokens)

    def new_cache(self, device: torch.device | str = "cpu") -> ContiguousCache:
        """An empty contiguous cache for one sequence (reference generation path)."""
        kda = {i: l.self_attn.state_shapes() for i, l in enumerate(self.model.layers) if self.cfg.layer_types[i] == "kda"}
        dtype = self.model.embed_tokens.weight.dtype
        return ContiguousCache(kda, list(self.cfg.mla_layers), self.cfg.mla.cache_dim,
                               conv_dtype=dtype, kv_dtype=dtype, device=device)
