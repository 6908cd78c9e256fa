"""Plain-torch oracles for the MLA attention kernels (Kimi's NoPE MLA, model-facts §5).

What this module knows: the two attention forms the kernels implement, with exactly their input
contracts.
  decode (absorbed): every token caches one latent entry [c (L) ; k_pe (R)] in a paged pool; a
    query already folded through W_UK attends to the entries of its sequence as one shared head
    (MQA over dim L+R) and returns the probability-weighted sum of the c parts, [N, H, L].
  prefill (expanded): per-head K = [k_nope ; k_pe] (k_pe shared by all heads) and V; varlen causal
    attention where each sequence's queries are the last len_q of its len_k keys.

What it does not know: the projections (W_UK/W_UV absorption, kv_b_proj expansion), writing the
cache, or anything about speed. Math is fp32 whatever the input dtype; outputs are fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor


def gather_latents(kv_cache: Tensor, block_table_row: Tensor, seq_len: int) -> Tensor:
    """The first seq_len cache entries of one sequence, in position order: [seq_len, L+R].

    Token p lives at kv_cache[block_table_row[p // block_size], p % block_size].
    """
    block_size = kv_cache.shape[1]
    pos = torch.arange(seq_len, device=kv_cache.device)
    pages = block_table_row.long()[pos // block_size]
    return kv_cache[pages, pos % block_size]


def mla_decode_ref(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                   kv_lora_rank: int) -> Tensor:
    """Absorbed MLA decode over a paged latent cache.

    Args:
        q: [N, H, L+R] absorbed queries ([q_nope @ W_UK ; q_pe]).
        kv_cache: [num_pages, block_size, L+R] latent entries [c ; k_pe].
        block_table: [N, max_blocks] int page ids; entries past a sequence's pages are ignored.
        seq_lens: [N] int context lengths (including the current token). A length of 0 is a
            padding row: its output is zero.
        scale: softmax scale ((P+R)^-0.5 for Kimi).
        kv_lora_rank: L, the width of the c part (the value).

    Returns:
        [N, H, L] fp32: softmax_s(scale * q·kv_s) · c_s per head.
    """
    N, H, _ = q.shape
    L = kv_lora_rank
    out = torch.zeros(N, H, L, dtype=torch.float32, device=q.device)
    for n, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        kv = gather_latents(kv_cache, block_table[n], seq_len).float()  # [S, L+R]
        probs = torch.softmax(scale * (q[n].float() @ kv.t()), dim=-1)  # [H, S]
        out[n] = probs @ kv[:, :L]
    return out


def mla_prefill_ref(q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float) -> Tensor:
    """Expanded-form varlen causal attention (prefill and extend).

    Sequence i owns queries cu_seqlens_q[i]:cu_seqlens_q[i+1] and keys cu_seqlens_k[i]:cu_seqlens_k[i+1];
    its len_q queries are the last len_q of its len_k keys, so local query j sees keys
    0..(len_k - len_q + j).

    Args:
        q: [Tq, H, P+R] ([q_nope ; q_pe]).
        k_nope: [Tk, H, P].
        k_pe: [Tk, R], shared by all heads.
        v: [Tk, H, V].
        cu_seqlens_q, cu_seqlens_k: [B+1] int, with len_k >= len_q per sequence.
        max_seqlen_q, max_seqlen_k: upper bounds of the lengths (checked here, used by kernels).
        scale: softmax scale.

    Returns:
        [Tq, H, V] fp32.
    """
    Tq, H, _ = q.shape
    P = k_nope.shape[-1]
    out = torch.zeros(Tq, H, v.shape[-1], dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qb, qe, kb, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        len_q, len_k = qe - qb, ke - kb
        if len_q > len_k or len_q > max_seqlen_q or len_k > max_seqlen_k:
            raise ValueError(f"sequence {i}: len_q={len_q}, len_k={len_k} violate len_q <= len_k "
                             f"and the max_seqlen bounds ({max_seqlen_q}, {max_seqlen_k})")
        if len_q == 0:
            continue
        qi = q[qb:qe].float()  # [Tq_i, H, P+R]
        scores = torch.einsum("thp,shp->hts", qi[..., :P], k_nope[kb:ke].float())
        scores = scores + torch.einsum("thr,sr->hts", qi[..., P:], k_pe[kb:ke].float())
        q_pos = (len_k - len_q) + torch.arange(len_q, device=q.device)
        mask = torch.arange(len_k, device=q.device)[None, :] > q_pos[:, None]  # [Tq_i, Tk_i]
        probs = torch.softmax((scale * scores).masked_fill(mask, float("-inf")), dim=-1)
        out[qb:qe] = torch.einsum("hts,shv->thv", probs, v[kb:ke].float())
    return out


def mla_store_latent_ref(ckv: Tensor, norm_weight: Tensor, eps: float, kv_flat: Tensor, slots: Tensor,
                         kv_lora_rank: int) -> None:
    """Write tokens' cache entries [kv_a_layernorm(c) ; k_pe] into kv_flat[slots] (in place).

    ckv: [T, L+R] the kv_a projection; norm_weight [L]; kv_flat [S, L+R] the pages as rows; slots [T]
    int64. The norm rounds like the model's RMSNorm: normalized in fp32, cast to ckv.dtype, times the
    weight in promote(weight, ckv) dtype, then cast to the cache dtype.
    """
    c = ckv[:, :kv_lora_rank]
    cf = c.float()
    cf = cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + eps)
    lat = torch.cat([norm_weight * cf.to(c.dtype), ckv[:, kv_lora_rank:]], dim=-1)
    kv_flat[slots] = lat.to(kv_flat.dtype)


def mla_output_gate_ref(o: Tensor, gate: Tensor) -> Tensor:
    """MLA's output gate (model-facts §5, `mla_use_output_gate`): o * sigmoid(gate), the sigmoid in fp32 rounded to
    o's dtype before the product (the model's order, backend/models/mla.py).

    Args:
        o: [N, H, V] attention output.
        gate: [N, H, V] the gate's pre-activation (g_proj(x)).

    Returns:
        [N, H, V] in o.dtype.
    """
    return o * torch.sigmoid(gate.float()).to(o.dtype)
