"""MLA layer on the GPU path: latents written into the pool's pages by one scatter, then

  decode form (one new token): the query is folded through W_UK once, attention runs over the
    latent pages directly (`mla_decode`, split along the context), and the latent-weighted sum is
    lifted through W_UV: K and V are never materialized;
  expanded form (prefill chunks): the whole context's latents are gathered from the pages and
    expanded through kv_b_proj with one GEMM, then varlen causal attention (`mla_prefill`).

Without the Triton kernels both forms fall back to a per-sequence torch loop (eager only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3rt.backend.layers.batch_invariant import ROW_TILE
from k3rt.backend.models.mla import MultiHeadLatentAttention
from k3rt.backend.runner.gpu.ops import KernelConfig, fuse_rows, kernel, linear, norm
from k3rt.backend.runner.gpu.step import GpuStep
from k3rt.kernels.mla.gluon_decode import GLUON_LAUNCH, gluon_runs


# the decode query's fold through [[W_UK, 0], [0, I]] (MlaWeights.w_uk_ext) while the extension costs at most this many
# more weight bytes per layer than W_UK alone (k3-tiny: 0.07 MB; the 48B's 2.9 MB, read every decode step, stay on
# the cat)
QCAT_MAX_EXTRA_BYTES = 1 << 20


@dataclass
class MlaWeights:
    w_in: torch.Tensor  # [q_a or q | kv_a | gate? | pad, hidden]: every projection of x, one GEMM (ops.fuse_rows)
    splits: tuple[int, ...]
    w_uk: torch.Tensor  # [H, P, L]
    w_uv_t: torch.Tensor  # [H, L, V]
    slot: int  # tensor index of this layer in the pool's MLA group
    # [H, P + R, L + R] = [[W_UK, 0], [0, I_R]]: q [T, H, P + R] through it is the decode kernel's query
    # [q_nope W_UK ; q_pe] in one product (the rope part times 1 plus exact zeros: its own value), not a product
    # and a concatenation; None past QCAT_MAX_EXTRA_BYTES
    w_uk_ext: torch.Tensor | None = None
    # kernels/mla mla_pre_one_token's W_UK transposed [H, L, P] (each absorbed output a row over P) and the two
    # persistent launches' counters: a layer they can run (no q_lora, no output gate), whatever the config says (the
    # 48B's 7 layers: 4 MB each)
    w_uk_t: torch.Tensor | None = None
    sync: torch.Tensor | None = None

    @staticmethod
    def of(attn: MultiHeadLatentAttention, slot: int) -> "MlaWeights":
        m, h = attn.cfg, attn.num_heads
        first = attn.q_proj.weight if m.q_lora_rank is None else attn.q_a_proj.weight
        parts = [first, attn.kv_a_proj_with_mqa.weight]
        if m.use_output_gate:
            parts.append(attn.g_proj.weight)
        fused, splits = fuse_rows(parts)
        w = attn.kv_b_proj.weight.detach().view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk = w[:, :m.qk_nope_head_dim].contiguous()
        P, L, R = m.qk_nope_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
        ext = None
        if h * ((P + R) * (L + R) - P * L) * w.element_size() <= QCAT_MAX_EXTRA_BYTES:
            ext = w.new_zeros(h, P + R, L + R)
            ext[:, :P, :L] = w_uk
            ext[:, P:, L:] = torch.eye(R, dtype=w.dtype, device=w.device)
        w_uk_t = sync = None
        if m.q_lora_rank is None and not m.use_output_gate and (words := kernel("mla", "MLA_LAYER_SYNC_WORDS")):
            w_uk_t = w_uk.transpose(1, 2).contiguous()
            sync = torch.zeros(words, dtype=torch.int32, device=w.device)
        return MlaWeights(fused, splits, w_uk, w[:, m.qk_nope_head_dim:].transpose(1, 2).contiguous(), slot, ext,
                          w_uk_t, sync)


def mla_forward(attn: MultiHeadLatentAttention, w: MlaWeights, x: torch.Tensor, step: GpuStep,
                kv_pages: torch.Tensor, k: KernelConfig) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]; kv_pages [P, block_size, L+R] (this layer's pool view)."""
    q, ckv, gate = mla_project(attn, w, x, k)
    return mla_output(attn, mla_attend(attn, w, q, ckv, step, kv_pages, k), gate, k)


def mla_layer_add_norm(attn: MultiHeadLatentAttention, w: MlaWeights, x: torch.Tensor, step: GpuStep,
                       kv_pages: torch.Tensor, k: KernelConfig, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, *, decode: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(residual + layer(x)), residual + layer(x)) of a one-sequence decode through kernels/mla's two persistent
    launches around `mla_decode` (KernelConfig.mla_layer_one_token; no q_lora, no output gate, one rank); else None
    (the caller takes the separate launches)."""
    m = attn.cfg
    if (not (decode and k.triton and k.mla_layer_one_token and not k.batch_invariant) or w.sync is None
            or x.shape[0] != 1 or step.row_seq is not None or attn.o_proj.tp.size != 1
            or not kernel("mla", "mla_layer_fits")(1, m.q_lora_rank is not None, m.use_output_gate, x.shape[1])):
        return None
    qcat = kernel("mla", "mla_pre_one_token")(
        x.contiguous(), w.w_in, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps,
        kv_pages.view(-1, kv_pages.shape[-1]), step.kv_slot[:1], w.w_uk_t, w.sync, qk_rope_head_dim=m.qk_rope_head_dim)
    o_lat = kernel("mla", "mla_decode")(qcat, kv_pages, step.block_table[:1].contiguous(),
                                        step.ctx_lens[:1].contiguous(), m.scale, kv_lora_rank=m.kv_lora_rank,
                                        use_pdl=k.use_pdl, **_decode_launch(k, qcat, kv_pages, m.kv_lora_rank))
    return kernel("mla", "mla_post_one_token")(o_lat.contiguous(), attn.kv_b_proj.weight, attn.o_proj.weight, residual,
                                               weight, eps, w.sync, qk_nope_head_dim=m.qk_nope_head_dim)


def mla_project(attn: MultiHeadLatentAttention, w: MlaWeights, x: torch.Tensor,
                k: KernelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The layer's projections of x [T, hidden], row-wise (no cache, no step): -> (q [T, H, P+R], the latent
    before its norm ckv [T, L+R], the output gate's pre-activation [T, H*V] or None)."""
    m, T, H = attn.cfg, x.shape[0], attn.num_heads
    parts = torch.split(linear(x, w.w_in, k), w.splits, dim=-1)
    if m.q_lora_rank is None:
        q = parts[0]
    else:
        qn = attn.q_a_layernorm
        q = linear(norm(parts[0], qn.weight, qn.eps, k), attn.q_b_proj.weight, k)
    return q.view(T, H, m.qk_head_dim), parts[1], parts[2] if m.use_output_gate else None


def mla_output(attn: MultiHeadLatentAttention, o: torch.Tensor, gate: torch.Tensor | None,
               k: KernelConfig) -> torch.Tensor:
    """o [T, H, V] (mla_attend's) -> the output gate, then o_proj: [T, hidden] (this rank's partial sum)."""
    T, V = o.shape[0], attn.cfg.v_head_dim
    if gate is not None:
        gate = gate.view(T, attn.num_heads, V)
        fused = kernel("mla", "mla_output_gate") if k.triton else None  # one launch, not the torch form's four
        o = fused(o, gate) if fused is not None else o * torch.sigmoid(gate.float()).to(o.dtype)
    return linear(o.reshape(T, attn.num_heads * V), attn.o_proj.weight, k)


def mla_attend(attn: MultiHeadLatentAttention, w: MlaWeights, q: torch.Tensor, ckv: torch.Tensor, step: GpuStep,
               kv_pages: torch.Tensor, k: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention core on the paged cache: the step's latents written into their pages, then each row's
    attention (the decode or the expanded form, module docstring) -> [T, H, V], into `out` (contiguous) when
    given (the piecewise graphs' static buffer, backend/runner/gpu/pieces.py)."""
    m, T, H = attn.cfg, q.shape[0], attn.num_heads
    flat = kv_pages.view(-1, kv_pages.shape[-1])
    store = kernel("mla", "mla_store_latent") if k.triton else None
    if store is not None:  # norm, rope append and scatter in one launch
        store(ckv, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, flat, step.kv_slot, kv_lora_rank=m.kv_lora_rank)
    else:
        lat = torch.cat([attn.kv_a_layernorm(ckv[:, :m.kv_lora_rank]), ckv[:, m.kv_lora_rank:]], dim=-1)
        flat.index_copy_(0, step.kv_slot, lat.to(flat.dtype))
    rows = step.decode_rows
    fresh = None  # a form that returns its own tensor (copied into `out` when given)
    if step.row_seq is not None:  # the verify graphs' form: every row its own decode query (step.py)
        fresh = _decode(q, w, step, kv_pages, m, k, per_row=True)
    elif k.batch_invariant:
        # every row is its own query over exactly the context it sees, the way a decode row is, so a
        # position's output does not depend on the chunk (or the step) it was computed in
        fresh = _decode(q, w, step, kv_pages, m, k, per_row=not (step.decode_seqs.numel() and len(rows) == T))
    elif step.decode_seqs.numel() and len(rows) == T:  # every row decodes (the graphed form): no scatter
        fresh = _decode(q, w, step, kv_pages, m, k)
    else:  # both forms (a mixed step) or prefill only: contiguous row ranges (the usual order) are slices
        if out is None:
            out = torch.empty(T, H, m.v_head_dim, dtype=q.dtype, device=q.device)
        if step.decode_seqs.numel():
            if step.decode_span is not None:
                s, e = step.decode_span
                out[s:e] = _decode(q[s:e], w, step, kv_pages, m, k)
            else:
                out[rows] = _decode(q[rows], w, step, kv_pages, m, k)
    if fresh is not None:
        out = fresh if out is None else out.copy_(fresh)
    if step.prefill_seqs and not k.batch_invariant:
        if step.prefill_span is not None:  # the kernel writes its rows of out in place
            s, e = step.prefill_span
            _expanded(attn, q[s:e], step, flat, m, k, out=out[s:e])
        else:
            out[step.prefill_rows] = _expanded(attn, q[step.prefill_rows], step, flat, m, k)
    return out


def _decode(q: torch.Tensor, w: MlaWeights, step: GpuStep, kv_pages: torch.Tensor, m, k: KernelConfig,
            per_row: bool = False) -> torch.Tensor:
    """The absorbed form for the decode sequences' rows, or (per_row: batch-invariant mode, or the verify
    graphs' form) for every row of the step, each over its own context (position + 1)."""
    P = m.qk_nope_head_dim
    if k.batch_invariant:
        qcat = torch.cat([_per_row_bmm(q[..., :P], w.w_uk.to(q.dtype)), q[..., P:]], dim=-1)  # [N, H, L + R]
    elif w.w_uk_ext is not None:  # one launch: the product leaves it heads outermost, the kernel takes the strides
        qcat = torch.bmm(q.transpose(0, 1), w.w_uk_ext.to(q.dtype)).transpose(0, 1)
    else:
        q_lat = torch.bmm(q[..., :P].transpose(0, 1), w.w_uk.to(q.dtype)).transpose(0, 1)  # [N, H, L]
        qcat = torch.cat([q_lat, q[..., P:]], dim=-1)
    if per_row:
        rows = step.derived.get("mla_rows")  # (table, ctx) per row: once per forward, shared by the MLA layers
        if rows is None:
            seq_of_row = (step.row_seq if step.row_seq is not None else
                          torch.repeat_interleave(torch.arange(step.num_seqs), torch.tensor(step.lens)).to(q.device))
            rows = step.derived["mla_rows"] = (step.block_table[seq_of_row].contiguous(),
                                               (step.pos + 1).to(torch.int32))
        table, ctx = rows
    else:
        seqs = step.decode_seqs
        all_seqs = seqs.numel() == step.num_seqs
        if all_seqs:
            table, ctx = step.block_table, step.ctx_lens
        elif step.decode_block_table is not None:  # packed by pack_step (a mixed step)
            table, ctx = step.decode_block_table, step.decode_ctx_lens
        else:
            table, ctx = step.block_table[seqs], step.ctx_lens[seqs]
    fn = kernel("mla", "mla_decode") if k.triton else None
    if fn is not None:
        # one split in the batch-invariant mode: the split count otherwise follows the batch size
        o_lat = fn(qcat, kv_pages, table.contiguous(), ctx.contiguous(), m.scale, kv_lora_rank=m.kv_lora_rank,
                   use_pdl=k.use_pdl, num_splits=1 if k.batch_invariant else None,
                   **_decode_launch(k, qcat, kv_pages, m.kv_lora_rank))
    else:
        o_lat = _decode_torch(qcat, kv_pages, table, ctx, m)
    if k.batch_invariant:
        return _per_row_bmm(o_lat, w.w_uv_t.to(o_lat.dtype))
    return torch.bmm(o_lat.transpose(0, 1), w.w_uv_t.to(o_lat.dtype)).transpose(0, 1)  # [N, H, V]


def _decode_launch(k: KernelConfig, qcat: torch.Tensor, kv_pages: torch.Tensor, kv_lora_rank: int) -> dict:
    """mla_decode's launch overrides: the Gluon kernel's (KernelConfig.mla_gluon, in mla_gluon_layout) where it runs,
    and the one-pass combine past 32 splits (KernelConfig.mla_wide_combine). The batch-invariant mode keeps the Triton
    kernel (its one split a row is what docs/deterministic.md and its tests pin)."""
    launch = dict(wide_combine=k.mla_wide_combine)
    if (k.mla_gluon and not k.batch_invariant
            and gluon_runs(qcat, kv_pages.shape[1], GLUON_LAUNCH["block_n"], k.mla_gluon_layout, kv_lora_rank)):
        launch.update(GLUON_LAUNCH, gluon_layout=k.mla_gluon_layout)
    return launch


def _per_row_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, H, A] @ w [H, A, B] -> [N, H, B] with each row's products independent of N: head-batched
    matmuls in fixed tiles of rows (torch.bmm over [H, N, A] picks its kernel by N)."""
    n = x.shape[0]
    pad = -(-n // ROW_TILE) * ROW_TILE
    xp = torch.cat([x, x.new_zeros(pad - n, *x.shape[1:])]) if pad != n else x
    outs = [torch.bmm(xp[i:i + ROW_TILE].transpose(0, 1), w).transpose(0, 1) for i in range(0, pad, ROW_TILE)]
    return torch.cat(outs)[:n]


def _decode_torch(qcat: torch.Tensor, kv_pages: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor,
                  m) -> torch.Tensor:
    """Torch fallback (eager only: reads the context lengths on the host): query row j over the first ctx[j]
    positions of the pages in table[j]."""
    B = kv_pages.shape[1]
    flat = kv_pages.view(-1, kv_pages.shape[-1])
    out = torch.empty(*qcat.shape[:2], m.kv_lora_rank, dtype=qcat.dtype, device=qcat.device)
    for j, n in enumerate(ctx.tolist()):
        pos = torch.arange(n, device=qcat.device)
        kv = flat[table[j].long()[pos // B] * B + pos % B].float()  # [S, L+R]
        p = torch.softmax(qcat[j].float() @ kv.t() * m.scale, dim=-1)  # [H, S]
        out[j] = (p @ kv[:, :m.kv_lora_rank]).to(out.dtype)
    return out


def _expanded(attn: MultiHeadLatentAttention, q: torch.Tensor, step: GpuStep, flat: torch.Tensor, m,
              k: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """The expanded form of the prefill sequences' rows q [Tq, H, P+R] over their whole contexts -> [Tq, H, V],
    into `out` when given."""
    H, P, V, L = attn.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
    ctx = flat[step.ctx_slot].to(q.dtype)  # [Tk, L+R]
    kv = attn.kv_b_proj(ctx[:, :L]).view(-1, H, P + V)
    k_nope, v, k_pe = kv[..., :P], kv[..., P:], ctx[:, L:]
    fn = kernel("mla", "mla_prefill") if k.triton else None
    if fn is not None:  # strided rows are fine (the kernel takes row and head strides): no copies of kv's columns
        return fn(q, k_nope, k_pe, v, step.cu_q, step.cu_k, step.max_q, step.max_k, m.scale, out=out,
                  tma=k.mla_prefill_tma)
    if out is None:
        out = torch.empty(q.shape[0], H, V, dtype=q.dtype, device=q.device)
    qo = ko = 0
    for i in step.prefill_seqs:
        nq, nk = step.lens[i], step.starts[i] + step.lens[i]
        kk = torch.cat([k_nope[ko:ko + nk], k_pe[ko:ko + nk, None, :].expand(nk, H, k_pe.shape[-1])], dim=-1)
        # query j sits at absolute position nk - nq + j and sees keys 0..that position
        mask = torch.arange(nk, device=q.device)[None, :] <= (nk - nq + torch.arange(nq, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(q[qo:qo + nq].transpose(0, 1).float(), kk.transpose(0, 1).float(),
                                           v[ko:ko + nk].transpose(0, 1).float(), attn_mask=mask, scale=m.scale)
        out[qo:qo + nq] = o.transpose(0, 1).to(out.dtype)
        qo, ko = qo + nq, ko + nk
    return out
