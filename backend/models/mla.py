"""Multi-head latent attention as Kimi uses it (NoPE; reference path).

Each token caches one latent entry [c (kv_lora_rank) ; k_pe (qk_rope_head_dim)]; the "rope" slice is
projected, cached and dotted, never rotated (model-facts §5). Two equivalent forms:
  expanded (prefill/extend): K, V = kv_b_proj(c) per head; ordinary causal attention, qk dim P+R.
  absorbed (decode): q_nope folded through W_UK so scores are taken against the latent directly, and
    the latent-weighted sum is lifted through W_UV afterwards. Never materializes per-head K/V.
A step of fresh equal-length sequences without caches (training, evaluation) takes the expanded
form on [B, T] at once through F.scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3rt.backend.distributed import SINGLE, TPContext
from k3rt.backend.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from k3rt.backend.layers.norm import RMSNorm
from k3rt.backend.models.batch import ForwardBatch
from k3rt.model_config import ModelConfig

# transformers' KimiLinearAttention and Moonshot's reference code build q_a_layernorm and
# kv_a_layernorm with the RMSNorm class default 1e-6, not rms_norm_eps (vLLM uses rms_norm_eps).
LATENT_NORM_EPS = 1e-6


def mla_expanded(q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, start: int,
                 nope: int, rope: int, v_dim: int, scale: float) -> torch.Tensor:
    """q: [T, H, P+R]; latent: [S, L+R] with S = start + T; kv_b_weight: [H*(P+V), L]. Returns [T, H, V]."""
    t, h = q.shape[:2]
    s, lora = latent.shape[0], kv_b_weight.shape[1]
    kv = (latent[:, :lora] @ kv_b_weight.t()).view(s, h, nope + v_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_pe = latent[:, lora:]  # [S, R], shared by all heads
    scores = torch.einsum("thd,shd->hts", q[..., :nope].float(), k_nope.float())
    scores = scores + torch.einsum("thr,sr->hts", q[..., nope:].float(), k_pe.float())
    scores = scores * scale
    # query i sits at absolute position start+i and sees keys 0..start+i
    mask = torch.arange(s, device=q.device)[None, :] > (start + torch.arange(t, device=q.device))[:, None]
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shv->thv", probs, v.float()).to(q.dtype)


def mla_absorbed(q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, start: int,
                 nope: int, rope: int, v_dim: int, scale: float) -> torch.Tensor:
    """Same contract as mla_expanded, computed in the latent space (decode form)."""
    t, h = q.shape[:2]
    s, lora = latent.shape[0], kv_b_weight.shape[1]
    w = kv_b_weight.view(h, nope + v_dim, lora).float()
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, P, L], [H, V, L]
    q_lat = torch.einsum("thp,hpl->thl", q[..., :nope].float(), w_uk)  # [T, H, L]
    c, k_pe = latent[:, :lora].float(), latent[:, lora:].float()
    scores = (torch.einsum("thl,sl->hts", q_lat, c) + torch.einsum("thr,sr->hts", q[..., nope:].float(), k_pe)) * scale
    mask = torch.arange(s, device=q.device)[None, :] > (start + torch.arange(t, device=q.device))[:, None]
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    lat = torch.einsum("hts,sl->thl", probs, c)  # [T, H, L]
    return torch.einsum("thl,hvl->thv", lat, w_uv).to(q.dtype)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, tp: TPContext = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        m, hsz = cfg.mla, cfg.hidden_size
        self.layer_idx, self.cfg = layer_idx, m
        self.num_heads = tp.shard(m.num_heads, "num_attention_heads")
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hsz, m.num_heads * m.qk_head_dim, tp=tp, dtype=dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hsz, m.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, m.num_heads * m.qk_head_dim, tp=tp, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hsz, m.cache_dim, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), tp=tp, dtype=dtype)
        if m.use_output_gate:
            self.g_proj = ColumnParallelLinear(hsz, m.num_heads * m.v_head_dim, tp=tp, dtype=dtype)
        self.o_proj = RowParallelLinear(m.num_heads * m.v_head_dim, hsz, tp=tp, dtype=dtype)
        # deterministic mode (set by KimiForCausalLM.set_batch_invariant): every query is attended alone
        # in the absorbed (decode) form over exactly the keys it sees. Prefill's expanded form reduces
        # over a [T, S] block whose shape (and so whose kernel and softmax width) depends on where the
        # chunk starts and ends; one query against its own start+1 keys depends only on its position.
        self.batch_invariant = False

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The cache entries of tokens x: [N, L+R] = [kv_a_layernorm(c) ; k_pe]."""
        ckv = self.kv_a_proj_with_mqa(x)
        lora = self.cfg.kv_lora_rank
        return torch.cat([self.kv_a_layernorm(ckv[:, :lora]), ckv[:, lora:]], dim=-1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        m, n, h = self.cfg, x.shape[0], self.num_heads
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, h, m.qk_head_dim)
        lat = self.latent(x)
        if batch.dense_shape is not None:
            out = self._attend_dense(q, lat, *batch.dense_shape)
        else:
            out = self._attend_varlen(x, q, lat, batch)
        if m.use_output_gate:
            out = out * torch.sigmoid(self.g_proj(x).float()).view(n, h, m.v_head_dim).to(out.dtype)
        return self.o_proj(out.reshape(n, h * m.v_head_dim))

    def _attend_dense(self, q: torch.Tensor, lat: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """Expanded form for B fresh equal-length sequences at once (training, evaluation), through
        SDPA: q [B*T, H, P+R], lat [B*T, L+R] -> [B*T, H, V]."""
        m, h = self.cfg, self.num_heads
        lora, nope = m.kv_lora_rank, m.qk_nope_head_dim
        kv = self.kv_b_proj(lat[:, :lora]).view(b, t, h, nope + m.v_head_dim)
        k_pe = lat[:, lora:].view(b, t, 1, m.qk_rope_head_dim).expand(b, t, h, m.qk_rope_head_dim)
        k = torch.cat([kv[..., :nope].float(), k_pe.float()], dim=-1)  # [B, T, H, P+R]
        v = kv[..., nope:].float()
        # fp32 like mla_expanded; under autocast SDPA itself lowers the inputs (flash attention on GPU)
        o = F.scaled_dot_product_attention(q.view(b, t, h, -1).transpose(1, 2).float(), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, scale=m.scale)
        return o.transpose(1, 2).reshape(b * t, h, m.v_head_dim).to(q.dtype)

    def _attend_varlen(self, x: torch.Tensor, q: torch.Tensor, lat: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        m, n, h = self.cfg, x.shape[0], self.num_heads
        out = torch.empty(n, h, m.v_head_dim, dtype=x.dtype, device=x.device)
        dims = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.scale)
        for i, (b, e) in enumerate(batch.spans()):
            if e == b:
                continue
            start = batch.start_positions[i]
            if batch.caches is not None:
                full = batch.caches[i].mla_extend(self.layer_idx, start, lat[b:e]).to(x.dtype)
            else:
                full = lat[b:e]
            if self.batch_invariant:
                for t in range(e - b):
                    pos = start + t
                    out[b + t] = mla_absorbed(q[b + t:b + t + 1], full[:pos + 1], self.kv_b_proj.weight, pos, *dims)[0]
                continue
            # a verify run takes the decode form too: its rows then compute as plain decode steps would
            # (the expanded form rounds differently, which can flip a near-tie in bf16)
            verify = batch.verify is not None and batch.verify[i]
            attend = mla_absorbed if ((e - b == 1 or verify) and start > 0) else mla_expanded
            out[b:e] = attend(q[b:e], full, self.kv_b_proj.weight, start, *dims)
        return out
