"""Kimi Delta Attention layer (reference path): projections, short conv, gate, KDA, gated norm.

Math: ../shared/reference/model-facts.md §1–§2. The KDA core runs per sequence through
`k3rt.kernels.kda.ref` (chunked form for prefill chunks, recurrence for single-token decode),
reading and writing the sequence's state in place through its SequenceCache. A step of fresh
equal-length sequences without caches (training, evaluation) runs as one [B, T] batch instead.
"""

from __future__ import annotations

import torch
from torch import nn

from k3rt.backend.distributed import SINGLE, TPContext
from k3rt.backend.layers.linear import (
    ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, ShardSpec, set_shard_spec,
)
from k3rt.backend.layers.norm import rms_norm_gated
from k3rt.backend.models.batch import ForwardBatch
from k3rt.kernels.kda.ref import kda_chunked, kda_gate_lower_bound, kda_gate_softplus, kda_recurrent
from k3rt.kernels.short_conv.ref import causal_conv1d
from k3rt.model_config import ModelConfig


def _kda_fresh_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return kda_chunked(q, k, v, g, beta)[0]


def _kda_recurrent_at(args: tuple[torch.Tensor, ...], init: torch.Tensor | None,
                      positions: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """kda_recurrent over one sequence's new tokens (args: q, k, v, g, beta as [1, T, ...]), also
    returning the state after each of `positions` (token counts) — run piecewise between them, which
    the recurrence makes exact. Returns (o [1, T, H, V], final state, one state per position)."""
    t = args[0].shape[1]
    outs, state_at, state, b = [], {}, init, 0
    for e in sorted({*positions, t}):
        o, state = kda_recurrent(*(a[:, b:e] for a in args), initial_state=state)
        outs.append(o)
        state_at[e], b = state, e
    return torch.cat(outs, dim=1), state, [state_at[p] for p in positions]


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, tp: TPContext = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kc = cfg.kda
        self.layer_idx, self.eps = layer_idx, cfg.rms_norm_eps
        self.head_dim, self.lower_bound = kc.head_dim, kc.gate_lower_bound
        self.num_heads = tp.shard(kc.num_heads, "linear_attn_config.num_heads")
        p, h, d = kc.proj_dim, cfg.hidden_size, kc.head_dim
        self.local_proj = self.num_heads * d
        self.q_proj = ColumnParallelLinear(h, p, tp=tp, dtype=dtype)
        self.k_proj = ColumnParallelLinear(h, p, tp=tp, dtype=dtype)
        self.v_proj = ColumnParallelLinear(h, p, tp=tp, dtype=dtype)
        # depthwise conv over q|k|v channels, [3*P_local, W]; fp32 like vLLM (costs nothing, exact)
        self.conv_weight = set_shard_spec(
            nn.Parameter(torch.empty(3 * self.local_proj, kc.conv_kernel_size), requires_grad=False),
            ShardSpec(0, (p, p, p)),
        )
        self.f_a_proj = ReplicatedLinear(h, d, dtype=dtype)
        self.f_b_proj = ColumnParallelLinear(d, p, tp=tp, dtype=dtype)
        self.A_log = set_shard_spec(nn.Parameter(torch.empty(self.num_heads), requires_grad=False), ShardSpec(0))
        self.dt_bias = set_shard_spec(nn.Parameter(torch.empty(self.local_proj), requires_grad=False), ShardSpec(0))
        self.b_proj = ColumnParallelLinear(h, kc.num_heads, tp=tp, dtype=dtype)
        if kc.use_full_rank_gate:
            self.g_proj = ColumnParallelLinear(h, p, tp=tp, dtype=dtype)
        else:
            self.g_a_proj = ReplicatedLinear(h, d, dtype=dtype)
            self.g_b_proj = ColumnParallelLinear(d, p, tp=tp, dtype=dtype)
        # core of the dense path: (q, k, v, g, beta) [B, T, ...] -> o [B, T, H, V] from a zero state;
        # training swaps in a faster equivalent form (training/train.py use_fast_kda)
        self.dense_core = _kda_fresh_ref
        self.o_norm_weight = set_shard_spec(nn.Parameter(torch.ones(d, dtype=dtype), requires_grad=False), ShardSpec())
        self.o_proj = RowParallelLinear(p, h, tp=tp, dtype=dtype)
        # deterministic mode (set by KimiForCausalLM.set_batch_invariant): every token goes through the
        # per-token recurrence, prefill included. The chunked form rounds differently from the recurrence
        # and from itself split at another boundary, so the state after p tokens (and every later
        # output) would depend on how the prompt was chunked and where a prefix-cache hit resumed; the
        # recurrence applies the same step to the same state whatever the split.
        self.batch_invariant = False

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv_state, recurrent_state) shapes of one sequence for this layer on this rank."""
        return (self.conv_weight.shape[1] - 1, 3 * self.local_proj), (self.num_heads, self.head_dim, self.head_dim)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        f = self.f_b_proj(self.f_a_proj(x)).view(*x.shape[:-1], self.num_heads, self.head_dim)
        dt_bias = self.dt_bias.view(self.num_heads, self.head_dim)
        if self.lower_bound is None:
            return kda_gate_softplus(f, self.A_log, dt_bias)
        return kda_gate_lower_bound(f, self.A_log, dt_bias, self.lower_bound)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [N, hidden] flat tokens of all sequences in the batch
        n, hd, d = x.shape[0], self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [N, 3P]
        g = self._gate(x)  # [N, H, K] fp32 log-decay
        beta = torch.sigmoid(self.b_proj(x).float())  # [N, H]
        if batch.dense_shape is not None:
            out = self._forward_dense(qkv, g, beta, *batch.dense_shape)
        else:
            out = self._forward_varlen(x, qkv, g, beta, batch)
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = rms_norm_gated(out, gate.view(n, hd, d), self.o_norm_weight, self.eps)
        return self.o_proj(o.reshape(n, hd * d))

    def _forward_dense(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """B fresh equal-length sequences at once: qkv [B*T, 3P], g [B*T, H, K], beta [B*T, H] -> [B*T, H, K]."""
        hd, d = self.num_heads, self.head_dim
        y, _ = causal_conv1d(qkv.view(b, t, -1), self.conv_weight, None, activation="silu")
        q, k, v = y.view(b, t, 3, hd, d).unbind(2)
        # the KDA core is fp32 math (ref.py's contract); keep autocast from lowering its matmuls
        with torch.autocast(qkv.device.type, enabled=False):
            o = self.dense_core(q, k, v, g.view(b, t, hd, d), beta.view(b, t, hd))
        return o.reshape(b * t, hd, d)

    def _forward_varlen(self, x: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        batch: ForwardBatch) -> torch.Tensor:
        """Sequence by sequence, reading and writing each one's cache (prefill chunks and decode)."""
        n, hd, d = x.shape[0], self.num_heads, self.head_dim
        out = torch.empty(n, hd, d, dtype=x.dtype, device=x.device)
        for i, (b, e) in enumerate(batch.spans()):
            if e == b:
                continue
            cache = batch.caches[i] if batch.caches is not None else None
            conv_state, rec_state = cache.kda_state(self.layer_idx) if cache is not None else (None, None)
            y, new_conv = causal_conv1d(qkv[None, b:e], self.conv_weight,
                                        None if conv_state is None else conv_state[None], activation="silu")
            q, k, v = y[0].view(e - b, 3, hd, d).unbind(1)
            args = (q[None], k[None], v[None], g[None, b:e], beta[None, b:e])
            init = None if rec_state is None else rec_state[None]
            start = batch.start_positions[i]
            positions = tuple(p - start for p in (batch.state_positions or [()] * len(batch.seq_lens))[i])
            verify = batch.verify is not None and batch.verify[i]
            if verify:
                # the state stays as it was: commit_verified replays the accepted prefix from these inputs.
                # Token by token, as plain decoding computes each of these positions (same numerics).
                assert not positions, "verify runs publish no snapshots"
                o, _ = kda_recurrent(*args, initial_state=init)
                # copies: a view would keep the whole step's activations alive until the commit
                batch.verify_inputs[(i, self.layer_idx)] = (qkv[b:e].clone(), g[b:e].clone(), beta[b:e].clone())
                out[b:e] = o[0]
                continue
            if self.batch_invariant:
                o, final, states = _kda_recurrent_at(args, init, positions)
            elif e - b == 1 and not positions:
                o, final = kda_recurrent(*args, initial_state=init)
                states: list[torch.Tensor] = []
            else:
                o, final, states = kda_chunked(*args, initial_state=init, state_positions=positions)
            out[b:e] = o[0]
            if positions:
                # conv state after p new tokens = the last W-1 pre-conv inputs: rows p..p+W-2 of [old ; new]
                w = self.conv_weight.shape[1] - 1
                old = conv_state if conv_state is not None else qkv.new_zeros(w, qkv.shape[1])
                hist = torch.cat([old.to(qkv.dtype), qkv[b:e]])
                for p, s in zip(positions, states):
                    batch.emitted_states[(i, self.layer_idx, start + p)] = (hist[p:p + w].clone(), s[0])
            if cache is not None:
                conv_state.copy_(new_conv[0])
                rec_state.copy_(final[0])
        return out

    def commit_verified(self, cache, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_tokens: int) -> None:
        """Advance the sequence's conv and recurrent state by the first num_tokens tokens of a verify run.

        The state was left at the run's start, so this is rollback without a state per draft position:
        the conv window is recomputed from the accepted tokens' pre-conv inputs and the recurrence replayed
        over their k, v, g, beta (inputs: pre-conv qkv [T, 3P], g [T, H, K], beta [T, H], T >= num_tokens;
        about 4P values per token against the H*K*V state)."""
        qkv, g, beta = inputs
        m, hd, d = num_tokens, self.num_heads, self.head_dim
        conv_state, rec_state = cache.kda_state(self.layer_idx)
        y, new_conv = causal_conv1d(qkv[None, :m], self.conv_weight, conv_state[None], activation="silu")
        _, k, v = y[0].view(m, 3, hd, d).unbind(1)
        # the recurrence never reads q for the state; k stands in for it
        _, final = kda_recurrent(k[None], k[None], v[None], g[None, :m], beta[None, :m], initial_state=rec_state[None])
        conv_state.copy_(new_conv[0])
        rec_state.copy_(final[0])
