"""KDA layer on the GPU path: one fused q|k|v GEMM, conv windows read on the device, the
recurrence through the Triton kernels (torch reference when kernels are off), states in the pool.

Two forms:
  general (any step): conv over the windows pack_step names (rows of [cached windows ; the step's rows]),
    `kda_chunk_fwd` over the packed varlen batch, snapshot states written to their destination state sets.
    With the kernels it issues Triton launches only (issue 18: an eager step is bound by its host's launches):
    conv with gate and beta, window stores, the chunk kernels on the states' pool pages in place, with the chunk
    tables pack_step built once for every layer;
  decode (every sequence feeds one token, no snapshots; the form captured in CUDA graphs): the
    fused `kda_decode` step, conv cache and recurrent state updated in place.
A mixed step (plain decodes beside prefill chunks, snapshot rows or verify runs; pack_step kda_split,
whenever the decode kernel runs outside the batch-invariant mode) is split: the plain decodes' rows take the
decode form on their live states (the same kernel on the same inputs as a decode step, so bit-identical to
one) and only the other sequences the general form (`GpuStep.kda_rows`: its conv and chunk kernels then cover
those sequences only; a one-token decode costs the chunk kernel a whole chunk).
Verify runs (speculative decoding) take the general form but leave their conv and recurrent states as
they were; `kda_commit` replays the accepted prefix into them once the sampler has decided.
  verify graph form (pack_step row_queries: every sequence a verify run of the same length R, the form
    captured in the verify graphs): the runs step through scratch copies of their states with the decode
    kernel, R launches (the chunked kernel builds its tables on the host); nothing live is written. The
    commit (`kda_commit_graphed`) replays the kept tokens through the same kernel on the live states, so
    they end as the scratch states did after those tokens (and a plain decode's as a decode step's).
    That is 2R KDA launches per layer per round, which dominate at small models (k3-tiny, K = 7: a graphed
    verify step 1.84x a plain one on the H200). With `KernelConfig.kda_verify_launch = "multi"` both go
    through `kda_decode_multi` (kernels/kda/triton_multi.py), one launch each: the pass runs every run's R
    rows from the live pages with the state tile in registers and writes nothing back (no scratch copies,
    no state per position: the rollback is the live state plus the kept inputs), the commit runs each
    run's first accepted[i] rows and writes the state and conv window after them in place. Same per-token
    math as the decode kernel. "multi" is the default: faster on the H200 (benchmarks/spec_verify.py,
    RESULTS.md).
Batch-invariant mode (docs/deterministic.md): every step token by token through the decode kernel;
verify runs step through scratch copies of their states, and the commit replays the accepted tokens
through the same kernel on the live states, so they end bit-identical to plain decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3rt.backend.layers.norm import rms_norm_gated
from k3rt.backend.models.kda import KimiDeltaAttention
from k3rt.backend.runner.gpu.ops import ROW_ALIGN, KernelConfig, fuse_rows, gemv_launch, kernel, linear
from k3rt.backend.runner.gpu.step import GpuStep, KdaRows
from k3rt.kernels.kda.ref import kda_chunked, kda_gate_lower_bound, kda_gate_softplus, kda_recurrent
from k3rt.kernels.short_conv.ref import causal_conv1d_rows, conv_windows_store


@dataclass
class KdaWeights:
    """Weights of one KDA layer, rearranged once for the GPU path (views share storage where possible)."""

    # [3P + (P full-rank gate | D g_a) + D(f_a) + H(b) + pad, hidden]: every projection of x, one GEMM
    w_in: torch.Tensor
    splits: tuple[int, ...]  # the column widths of its output: qkv, gate, f_a, b, then the zero pad
    # low-rank gate (None: full rank): [[g_b, 0], [0, f_b]] [2P, 2D]: both up-projections of the adjacent (g_a | f_a)
    # columns in one GEMM (the zero blocks add exact zeros; at decode one launch less per layer)
    w_up: torch.Tensor | None
    conv_weight: torch.Tensor  # [3P, W] fp32
    A_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [H*D] fp32
    group: int  # KDA group (page of the state set) and tensor index in the pool
    tensor: int
    # kernels/kda kda_layer_one_token's counters (zero between launches; the forward runs on one stream)
    sync: torch.Tensor | None = None

    @staticmethod
    def of(attn: KimiDeltaAttention, group: int, tensor: int) -> "KdaWeights":
        p = attn.local_proj
        parts = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        low_rank = not hasattr(attn, "g_proj")
        parts.append(attn.g_a_proj.weight if low_rank else attn.g_proj.weight)
        parts += [attn.f_a_proj.weight, attn.b_proj.weight]
        w, rows = fuse_rows(parts)  # padded to ROW_ALIGN columns of output (ops.py says why)
        splits = (3 * p, *rows[3:])
        w_up = None
        if low_rank:
            gb, fb = attn.g_b_proj.weight.detach(), attn.f_b_proj.weight.detach()
            w_up = torch.zeros(gb.shape[0] + fb.shape[0], gb.shape[1] + fb.shape[1], dtype=gb.dtype, device=gb.device)
            w_up[:gb.shape[0], :gb.shape[1]] = gb
            w_up[gb.shape[0]:, gb.shape[1]:] = fb
        sync = None
        if low_rank and (words := kernel("kda", "kda_layer_sync_words")) is not None:
            sync = torch.zeros(words(attn.num_heads), dtype=torch.int32, device=w.device)
        return KdaWeights(w, splits, w_up, attn.conv_weight.detach().float().contiguous(),
                          attn.A_log.detach().float().reshape(-1).contiguous(),
                          attn.dt_bias.detach().float().reshape(-1).contiguous(), group, tensor, sync)


def _gate(attn: KimiDeltaAttention, w: KdaWeights, f: torch.Tensor) -> torch.Tensor:
    """The decay gate from f = f_b_proj(f_a) [T, H*D]."""
    f = f.view(f.shape[0], attn.num_heads, attn.head_dim)
    dt = w.dt_bias.view(attn.num_heads, attn.head_dim)
    if attn.lower_bound is None:
        return kda_gate_softplus(f, w.A_log, dt)
    return kda_gate_lower_bound(f, w.A_log, dt, attn.lower_bound)


def kda_forward(attn: KimiDeltaAttention, w: KdaWeights, x: torch.Tensor, step: GpuStep,
                conv_pool: torch.Tensor, rec_pool: torch.Tensor, k: KernelConfig, *, decode: bool,
                workspace: torch.Tensor | None = None,
                keep: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]; conv_pool [P, W-1, 3P], rec_pool [P, H, K, V] (pool views, a
    page apart); workspace: kda_decode's per-head counters (decode form); keep: buffers the verify graph
    form copies its commit inputs into (GpuForward.verify_keep; None: the step keeps its own tensors)."""
    T, H, D = x.shape[0], attn.num_heads, attn.head_dim
    qkv, gate, f, b = kda_project(attn, w, x, k, trigger=decode and T == 1 and k.kda_decode_pdl_trigger)
    if (decode and T == 1 and k.triton and k.skinny_gemv and k.kda_norm_in_o_proj and not k.batch_invariant
            and step.row_seq is None):
        return _decode_norm_in_o_proj(attn, w, qkv, f, b, gate, conv_pool, rec_pool, step.state_pages[w.group], k,
                                      workspace)
    o = kda_attend(attn, w, qkv, gate, f, b, step, conv_pool, rec_pool, k, decode=decode, workspace=workspace,
                   keep=keep)
    return linear(o.reshape(T, H * D), attn.o_proj.weight, k)


def kda_layer_add_norm(attn: KimiDeltaAttention, w: KdaWeights, x: torch.Tensor, step: GpuStep,
                       conv_pool: torch.Tensor, rec_pool: torch.Tensor, k: KernelConfig, residual: torch.Tensor,
                       weight: torch.Tensor, eps: float, *, decode: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(residual + layer(x)), residual + layer(x)) from kernels/kda kda_layer_one_token, where it runs: a
    one-sequence decode step (not a verify run) with KernelConfig.kda_layer_one_token, the low-rank gates, one rank
    (o_proj's output needs no reduction), the kernel's shapes; else None (the caller takes the separate launches)."""
    if (not (decode and k.triton and k.kda_layer_one_token and not k.batch_invariant and w.sync is not None)
            or x.shape[0] != 1 or step.row_seq is not None or attn.o_proj.tp.size != 1):
        return None
    fits, layer = kernel("kda", "kda_layer_fits"), kernel("kda", "kda_layer_one_token")
    tiles = kernel("kda", "KDA_LAYER_TILES")
    if not fits(1, True, attn.num_heads, attn.head_dim, x.shape[1], tiles):
        return None
    return layer(x.contiguous(), w.w_in, w.w_up, w.conv_weight, conv_pool, w.A_log, w.dt_bias, rec_pool,
                 step.state_pages[w.group][:1], attn.o_norm_weight, attn.o_proj.weight, residual, weight, w.sync,
                 o_norm_eps=attn.eps, eps=eps, lower_bound=attn.lower_bound, use_pdl=k.use_pdl)


def kda_attend(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, gate: torch.Tensor, f: torch.Tensor,
               b: torch.Tensor, step: GpuStep, conv_pool: torch.Tensor, rec_pool: torch.Tensor, k: KernelConfig, *,
               decode: bool, workspace: torch.Tensor | None = None,
               keep: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The layer between its projections (`kda_project`) and o_proj: the step's form (module docstring) on its
    states. -> o [T, H, D] (gated, normed), written into `out` (contiguous [T, H, D]) when given: the piecewise
    graphs' static buffer (backend/runner/gpu/pieces.py; the mixed step's forms write it in place)."""
    pages = step.state_pages[w.group]
    if step.row_seq is not None and k.triton and not k.batch_invariant:
        o = _verify_runs(attn, w, qkv, f, b, gate, step, conv_pool, rec_pool, pages, k, workspace, keep)
    elif k.batch_invariant and not decode:
        o = _token_by_token(attn, w, qkv, f, b, gate, step, conv_pool, rec_pool, pages, k)
    elif decode and k.triton:
        return _decode(attn, w, qkv, f, b, gate, conv_pool, rec_pool, pages, k, workspace, out=out)
    elif step.kda_split is not None:
        return _split(attn, w, qkv, f, b, gate, step, conv_pool, rec_pool, k, workspace, out=out)
    else:
        return _general_gated(attn, w, qkv, f, b, gate, step.kda_rows, conv_pool, rec_pool, k, out=out)
    return o if out is None else out.copy_(o)


def kda_project(attn: KimiDeltaAttention, w: KdaWeights, x: torch.Tensor,
                k: KernelConfig, trigger: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (pre-conv qkv [T, 3P], output gate [T, P], f [T, P], b [T, H]): column views of the
    fused GEMMs' outputs. trigger (one decode row, KernelConfig.kda_decode_pdl_trigger): the last projection runs
    in the skinny GEMV, which lets the PDL-launched decode step after it start at once (skinny_linear trigger=)."""
    proj = linear(x, w.w_in, k)
    qkv, gate, f_a, b = torch.split(proj, w.splits, dim=-1)[:4]
    if w.w_up is not None:  # (g_a | f_a) -> (gate | f), one GEMM
        s0 = w.splits[0]
        gate, f = _gate_linear(proj[:, s0:s0 + w.w_up.shape[1]], w.w_up, k, trigger).split(w.w_up.shape[0] // 2,
                                                                                            dim=-1)
    else:
        f = _gate_linear(f_a, attn.f_b_proj.weight, k, trigger)
    return qkv, gate, f, b


def _gate_linear(x: torch.Tensor, wt: torch.Tensor, k: KernelConfig, trigger: bool) -> torch.Tensor:
    """linear(), or with trigger the skinny GEMV with its PDL trigger first where that kernel takes the operands
    (16-bit, the kernels on, not batch-invariant)."""
    if (trigger and k.triton and k.skinny_gemv and not k.batch_invariant
            and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and x.stride(-1) == 1):
        return kernel("linear", "skinny_linear")(x, wt, trigger=True, **gemv_launch(x, wt, k))
    return linear(x, wt, k)


def _decode(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
            gate: torch.Tensor, conv_pool: torch.Tensor, rec_pool: torch.Tensor, pages: torch.Tensor, k: KernelConfig,
            workspace: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The decode form: conv, gates, delta rule and the gated output norm in one launch, states in their pages
    (pages[i]: row i's). -> o [N, H, D] (gated, normed), into `out` when given."""
    from k3rt.kernels.kda import kda_decode

    N, H, D = qkv.shape[0], attn.num_heads, attn.head_dim
    return kda_decode(qkv, w.conv_weight, conv_pool, f, w.A_log, w.dt_bias, b, rec_pool, pages,
                      lower_bound=attn.lower_bound, use_pdl=k.use_pdl or k.kda_decode_pdl,
                      late_wait=k.kda_decode_pdl, o_gate=gate.reshape(N, H, D),
                      o_norm_weight=attn.o_norm_weight, o_norm_eps=attn.eps, workspace=workspace,
                      v_split=1 if k.batch_invariant else None, out=out)


def _decode_norm_in_o_proj(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, f: torch.Tensor,
                           b: torch.Tensor, gate: torch.Tensor, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
                           pages: torch.Tensor, k: KernelConfig, workspace: torch.Tensor | None) -> torch.Tensor:
    """The decode form of one sequence with its output norm finished in o_proj's launch
    (KernelConfig.kda_norm_in_o_proj): the decode launch writes o * weight * sigmoid(gate) and each program's sum of
    o^2, the skinny GEMV scales each head's columns by the rms factor as it reads them. -> [1, hidden]."""
    from k3rt.kernels.kda import kda_decode_split_norm
    from k3rt.kernels.linear import skinny_linear

    H, D = attn.num_heads, attn.head_dim
    y, partials = kda_decode_split_norm(qkv, w.conv_weight, conv_pool, f, w.A_log, w.dt_bias, b, rec_pool, pages,
                                        lower_bound=attn.lower_bound, use_pdl=k.use_pdl or k.kda_decode_pdl,
                                        late_wait=k.kda_decode_pdl, o_gate=gate.reshape(1, H, D),
                                        o_norm_weight=attn.o_norm_weight, workspace=workspace)
    return skinny_linear(y.reshape(1, H * D), attn.o_proj.weight, row_rms=(partials, attn.eps))


def _general_gated(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                   gate: torch.Tensor, rows: KdaRows, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
                   k: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """The general form and the gated output norm over `rows`' sequences. -> o [T, H, D], into `out` (contiguous)
    when given."""
    o = _general(attn, w, qkv, f, b, rows, conv_pool, rec_pool, rows.state_pages[w.group], k)
    gated = kernel("norm", "rms_norm_gated") if k.triton else None
    if gated is not None:
        return gated(o, gate.reshape(o.shape), attn.o_norm_weight, attn.eps, out=out)
    normed = rms_norm_gated(o, gate.reshape(o.shape), attn.o_norm_weight, attn.eps)
    return normed if out is None else out.copy_(normed)


def _split(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
           gate: torch.Tensor, step: GpuStep, conv_pool: torch.Tensor, rec_pool: torch.Tensor, k: KernelConfig,
           workspace: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A mixed step (GpuStep.kda_split): the plain decodes' rows through the decode form on their live states,
    the other sequences' rows through the general form, both written into the step's row order. Contiguous
    row ranges (decodes first: the usual plan) are slices, so the decode rows are neither gathered nor
    scattered; the decode kernel writes its rows of the output in place. -> o [T, H, D] (gated, normed)."""
    if not k.triton:
        raise ValueError("kda_split: a split step needs the decode kernel (KernelConfig.triton); pack it unsplit")
    sp = step.kda_split
    T, H, D = qkv.shape[0], attn.num_heads, attn.head_dim
    o = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device) if out is None else out
    pages = sp.dec_pages[w.group]
    if sp.dec_span is not None:
        s, e = sp.dec_span
        _decode(attn, w, qkv[s:e], f[s:e], b[s:e], gate[s:e], conv_pool, rec_pool, pages, k, workspace, out=o[s:e])
    else:
        r = sp.dec_rows
        o[r] = _decode(attn, w, qkv[r], f[r], _gather_rows(b, r), gate[r], conv_pool, rec_pool, pages, k, workspace)
    if sp.rest_span is not None:
        s, e = sp.rest_span
        _general_gated(attn, w, qkv[s:e], f[s:e], b[s:e], gate[s:e], sp.rest, conv_pool, rec_pool, k, out=o[s:e])
    else:
        r = sp.rest_rows
        o[r] = _general_gated(attn, w, qkv[r], f[r], _gather_rows(b, r), gate[r], sp.rest, conv_pool, rec_pool, k)
    return o


def _gather_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows] with a row stride that is a multiple of ROW_ALIGN, as the projection's column views have: a
    gathered b [n, H] would otherwise have stride H (4 at k3-tiny), a second binary of every kernel that reads
    it, compiled the first time a step's rows come unordered (kernels/common.py, "Compiles")."""
    width = -(-t.shape[1] // ROW_ALIGN) * ROW_ALIGN
    if width == t.shape[1]:
        return t[rows]
    out = t.new_empty(rows.shape[0], width)[:, :t.shape[1]]
    return out.copy_(t[rows])


def _verify_runs(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                 gate: torch.Tensor, step: GpuStep, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
                 pages: torch.Tensor, k: KernelConfig, workspace: torch.Tensor | None,
                 keep: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The verify graph form: B sequences of R rows each, every one a verify run. Scratch copies of the B conv
    windows and states (one per sequence, not one per position) go through `kda_decode` R times, the t-th
    rows of all runs in launch t, so the live pages stay at the runs' start; the kernel's inputs (pre-conv
    qkv, f, b) of every row are kept for `kda_commit_graphed`. No host data and shapes fixed by (B, R):
    capturable. -> o [T, H, D] (gated, normed)."""
    from k3rt.kernels.kda import kda_decode

    T, H, D = qkv.shape[0], attn.num_heads, attn.head_dim
    B = step.num_seqs
    R = T // B
    kept = (qkv, f, b)
    if keep is not None:  # into the buffers every verify graph shares (rows past T are another bucket's)
        kept = tuple(buf[:T].copy_(t) for buf, t in zip(keep, kept))
    step.verify_inputs[attn.layer_idx] = kept
    if k.kda_verify_launch == "multi":  # one launch from the live pages, nothing written back
        from k3rt.kernels.kda import kda_decode_multi

        q3, f3, b3, g3 = (t.reshape(B, R, *t.shape[1:]) for t in (qkv, f, b, gate))  # views: rows keep their stride
        every = step.derived.get("kda_runs")  # every run's R rows: one tensor for the step's KDA layers
        if every is None:
            every = step.derived["kda_runs"] = torch.full((B,), R, dtype=torch.int32, device=qkv.device)
        o = kda_decode_multi(q3, w.conv_weight, conv_pool, f3, w.A_log, w.dt_bias, b3, rec_pool, pages, every,
                             commit=False, lower_bound=attn.lower_bound, use_pdl=k.use_pdl,
                             o_gate=g3.reshape(B, R, H, D), o_norm_weight=attn.o_norm_weight, o_norm_eps=attn.eps,
                             workspace=workspace, hoist=k.kda_multi_hoist)
        return o.view(T, H, D)
    convs, recs = conv_pool[pages].clone(), rec_pool[pages].clone()  # [B, W-1, C], [B, H, D, D]
    slots = torch.arange(B, device=qkv.device)
    runs = [t.reshape(B, R, *t.shape[1:]) for t in (qkv, f, b, gate)]
    o = torch.empty(B, R, H, D, dtype=qkv.dtype, device=qkv.device)
    for t in range(R):
        q_t, f_t, b_t, gate_t = (x[:, t].contiguous() for x in runs)
        o[:, t] = kda_decode(q_t, w.conv_weight, convs, f_t, w.A_log, w.dt_bias, b_t, recs, slots,
                             lower_bound=attn.lower_bound, use_pdl=k.use_pdl, o_gate=gate_t.reshape(B, H, D),
                             o_norm_weight=attn.o_norm_weight, o_norm_eps=attn.eps, workspace=workspace)
    return o.view(T, H, D)


def _token_by_token(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                    gate: torch.Tensor, step: GpuStep, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
                    pages: torch.Tensor, k: KernelConfig) -> torch.Tensor:
    """Batch-invariant mode, any step: every token through the decode kernel (one program per head),
    the t-th tokens of all sequences in launch t, so a position's state and output are computed the
    same way in a prefill chunk of any length, after a prefix-cache hit, and in decode (the chunked
    kernel's sums would depend on where the chunk starts and ends). Snapshot states are copied out
    of the live pages right after the token that ends them.
    Verify runs (speculative decoding) step through scratch copies of their conv windows and states,
    so the live ones stay at the run's start; their kernel inputs are kept for `kda_commit`, which
    replays the accepted prefix through the same kernel on the live pages. -> o [T, H, D] (gated, normed)."""
    from k3rt.kernels.kda import kda_decode

    T, H, D = qkv.shape[0], attn.num_heads, attn.head_dim
    dev = qkv.device
    o = torch.empty(T, H, D, dtype=qkv.dtype, device=dev)
    snaps: dict[tuple[int, int], list[int]] = {(i, p - step.starts[i]): dest for i, p, dest in step.snapshots}
    verify = {i: j for j, i in enumerate(step.verify_seqs)}  # verify sequence -> its scratch slot
    if verify:
        vpages = pages[torch.tensor(step.verify_seqs, device=dev)]
        scratch_conv, scratch_rec = conv_pool[vpages].clone(), rec_pool[vpages].clone()
        rows = torch.cat([torch.arange(step.cu[i], step.cu[i + 1]) for i in step.verify_seqs]).to(dev)
        step.verify_inputs[attn.layer_idx] = (qkv[rows], f[rows], b[rows], gate[rows])
    for t in range(max(step.lens, default=0)):
        for scratch in (False, True):
            seqs = [i for i, n in enumerate(step.lens) if n > t and (i in verify) == scratch]
            if not seqs:
                continue
            rows = torch.tensor([step.cu[i] + t for i in seqs], device=dev)
            if scratch:
                convs, recs, slots = scratch_conv, scratch_rec, torch.tensor([verify[i] for i in seqs], device=dev)
            else:
                convs, recs, slots = conv_pool, rec_pool, pages[torch.tensor(seqs, device=dev)]
            o[rows] = kda_decode(qkv[rows], w.conv_weight, convs, f[rows], w.A_log, w.dt_bias, b[rows], recs, slots,
                                 lower_bound=attn.lower_bound, o_gate=gate[rows].reshape(len(seqs), H, D),
                                 o_norm_weight=attn.o_norm_weight, o_norm_eps=attn.eps, v_split=1)
        for i in range(step.num_seqs):
            dest = snaps.get((i, t + 1))
            if dest is not None:
                src, dst = pages[i], dest[w.group]
                conv_pool[dst] = conv_pool[src]
                rec_pool[dst] = rec_pool[src]
    return o


def _general(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
             step: KdaRows, conv_pool: torch.Tensor, rec_pool: torch.Tensor, pages: torch.Tensor,
             k: KernelConfig) -> torch.Tensor:
    """The general form over `step`'s sequences (GpuStep.kda_rows: the whole step, or a split step's rest; qkv, f,
    b: their rows only) on their state pages `pages`: conv over the windows step.conv_idx names, the new and
    snapshot windows stored, the chunked recurrence (with the kernels and the step's chunk tables: on the pool
    pages in place; else on a contiguous copy of the states, which leaves verify runs' states as they were),
    snapshots written to their destination sets. -> o [T, H, D] (before the gated norm)."""
    T, H, D = qkv.shape[0], attn.num_heads, attn.head_dim
    if k.triton:  # conv, gate and beta in one launch, the cached windows read in place (kernels/kda/triton_prep.py)
        y, g, beta = kernel("kda", "kda_chunk_prep")(qkv, conv_pool, pages, step.conv_idx, w.conv_weight, f, w.A_log,
                                                     w.dt_bias, b, attn.lower_bound,
                                                     one_seq=k.kda_prep_one_seq and step.num_seqs == 1)
        store = kernel("short_conv", "conv_windows_store_fwd")
    else:
        y = causal_conv1d_rows(qkv, conv_pool, pages, step.conv_idx, w.conv_weight)
        g, beta = _gate(attn, w, f), torch.sigmoid(b.float())
        store = conv_windows_store
    nseq, snaps = step.num_seqs, step.snapshots
    live = step.live_seqs
    if step.store_idx is not None:  # snapshot and new windows in one store (no snapshot reads a cached row)
        store(qkv, conv_pool, pages, step.store_idx, step.store_dest[w.group])
    else:
        if snaps:  # first: a snapshot's window may read cached rows that the new windows overwrite
            store(qkv, conv_pool, pages, step.snap_conv_idx, step.snap_dest[w.group])
        # verify runs keep their states: only the other sequences' windows and states are written back
        if live is None:
            store(qkv, conv_pool, pages, step.conv_tail_idx, pages)
        else:
            store(qkv, conv_pool, pages, step.conv_tail_idx[live], pages[live])
    q, kk, v = y.view(T, 3, H, D).unbind(1)
    if live is not None:
        # only the verify runs' rows, gathered (the step's activations are not kept alive until the commit)
        rows = step.verify_rows
        step.verify_inputs[attn.layer_idx] = (qkv[rows], g[rows], beta[rows])
    if k.triton:
        from k3rt.kernels.kda import kda_chunk_fwd

        # the step's tables: the runner packs them whenever the kernels run (GpuModelRunner._build)
        assert step.chunk is not None, "the chunked KDA kernel needs the step's tables: pack_step(chunk_tables=True)"
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        form = dict(intra=k.kda_intra, fuse_gc_blocks=k.kda_blocks_fuse_gc,
                    inverse_regs_blocks=k.kda_blocks_inverse_regs, out_chunk_blocks=k.kda_blocks_out_chunk,
                    l_chunk_blocks=k.kda_blocks_l_chunk)
        if live is None and rec_pool.dtype == torch.float32:
            # the states read and written on their pages in place, snapshots straight to their destination
            # pages: no state copy, nothing built here
            return kda_chunk_fwd(q, kk, v, g, beta, step.cu_seqlens, rec_pool, pages,
                                 tables=step.chunk._replace(snap=step.chunk_snap_pages[w.group]), precision=prec,
                                 scratch=step.chunk_scratch, **form)
    # else the recurrence runs on a contiguous copy of the sequences' states: slots 0..B-1 live, B.. snapshots
    # (verify runs' states are computed but not written back)
    if snaps or rec_pool.dtype != torch.float32:
        states = torch.empty(nseq + len(snaps), H, D, D, dtype=torch.float32, device=qkv.device)
        states[:nseq] = rec_pool[pages]
    else:  # the gather is the copy
        states = rec_pool[pages]
    if k.triton:
        o = kda_chunk_fwd(q, kk, v, g, beta, step.cu_seqlens, states, step.chunk_slots, tables=step.chunk,
                          precision=prec, scratch=step.chunk_scratch, **form)
    else:
        o = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
        for i in range(nseq):
            s, e = step.cu[i], step.cu[i + 1]
            mine = [(j, p - step.starts[i]) for j, (si, p, _) in enumerate(snaps) if si == i]
            out, final, emitted = kda_chunked(q[None, s:e].float(), kk[None, s:e].float(), v[None, s:e].float(),
                                              g[None, s:e], beta[None, s:e], initial_state=states[i:i + 1],
                                              state_positions=tuple(p for _, p in mine))
            o[s:e] = out[0].to(o.dtype)
            states[i] = final[0]
            for (j, _), st in zip(mine, emitted):
                states[nseq + j] = st[0]
    if live is None:
        rec_pool[pages] = states[:nseq]
    else:
        rec_pool[pages[live]] = states[live]
    if snaps:
        rec_pool[step.snap_dest[w.group]] = states[nseq:]
    return o


def kda_commit(attn: KimiDeltaAttention, w: KdaWeights, step: GpuStep, runs: list[tuple[int, int, int]],
               conv_pool: torch.Tensor, rec_pool: torch.Tensor, batch_invariant: bool = False) -> None:
    """After a verify step: advance each verify sequence's conv window and recurrent state by the first m
    tokens of its run. runs: (sequence, m, its state page of this layer's group).

    Rollback without a state per draft position: the states were left at the run's start, and the step's
    inputs (pre-conv qkv, g, beta) re-derive the state after the accepted prefix. Batched over the runs,
    padded to the longest (a padded position leaves its run's state as it was); the conv is the general
    form's (fp32 taps in order) and the recurrence the exact per-token one.
    Cost: about max(m) small launches per layer per verify step (a fused kda_decode-style replay would be
    one; not built yet, issue 16); after a verify-graph step the runner replays it captured instead
    (`kda_commit_graphed`).
    batch_invariant: the run went through `_token_by_token` on scratch states; replay through its kernel."""
    if batch_invariant:
        _replay_token_by_token(attn, w, step, runs, conv_pool, rec_pool)
        return
    qkv, g, beta = step.verify_inputs[attn.layer_idx]  # rows of the verify runs, in step order
    dev = qkv.device
    first, off = {}, 0  # each verify sequence's first row among the kept rows
    for i in step.verify_seqs:
        first[i], off = off, off + step.lens[i]
    pages = torch.tensor([p for _, _, p in runs], dtype=torch.long, device=dev)
    ms = torch.tensor([m for _, m, _ in runs], dtype=torch.long, device=dev)
    offs = torch.tensor([first[s] for s, _, _ in runs], dtype=torch.long, device=dev)
    _advance(attn, w, qkv, g, beta, pages, ms, offs, max(m for _, m, _ in runs), conv_pool, rec_pool)


def kda_commit_graphed(attn: KimiDeltaAttention, w: KdaWeights, step: GpuStep, accepted: torch.Tensor,
                       conv_pool: torch.Tensor, rec_pool: torch.Tensor, k: KernelConfig,
                       workspace: torch.Tensor | None = None) -> None:
    """`kda_commit` for a verify-graph step (every sequence a run of R rows): sequence i advanced by
    accepted[i] tokens ([B] int64 on the device; 0 leaves it as it was: the pad sequences, and anything not
    to commit) on the step's own state pages. Device tensors only, padded to R: capturable (the runner
    replays it as the verify graph's commit graph).
    With the kernels (`_verify_runs` kept kda_decode's inputs): R launches of kda_decode on the live pages,
    a run's slot masked to padding (-1: nothing touched) from its accepted count on; one pass over each state
    per token, where the torch replay (`_advance`, the torch-op path's) makes several."""
    B = step.num_seqs
    pages = step.state_pages[w.group]
    if k.triton:
        from k3rt.kernels.kda import kda_decode

        qkv, f, b = step.verify_inputs[attn.layer_idx]  # [T, 3P], [T, H*D], [T, H]: _verify_runs' inputs
        R = qkv.shape[0] // B
        if k.kda_verify_launch == "multi":  # one launch: each run's first accepted[i] tokens, in place
            from k3rt.kernels.kda import kda_decode_multi

            kda_decode_multi(qkv.reshape(B, R, -1), w.conv_weight, conv_pool,
                             f.reshape(B, R, -1), w.A_log, w.dt_bias, b.reshape(B, R, -1), rec_pool, pages, accepted,
                             commit=True, lower_bound=attn.lower_bound, use_pdl=k.use_pdl, workspace=workspace,
                             hoist=k.kda_multi_hoist)
            return
        runs = [t.reshape(B, R, *t.shape[1:]) for t in (qkv, f, b)]
        for t in range(R):
            slots = torch.where(accepted > t, pages, torch.full_like(pages, -1))
            q_t, f_t, b_t = (x[:, t].contiguous() for x in runs)
            kda_decode(q_t, w.conv_weight, conv_pool, f_t, w.A_log, w.dt_bias, b_t, rec_pool, slots,
                       lower_bound=attn.lower_bound, use_pdl=k.use_pdl, workspace=workspace)
        return
    qkv, g, beta = step.verify_inputs[attn.layer_idx]  # _general's: (pre-conv qkv, g, beta)
    R = qkv.shape[0] // B
    offs = torch.arange(B, device=qkv.device) * R
    _advance(attn, w, qkv, g, beta, pages, accepted, offs, R, conv_pool, rec_pool)


def _advance(attn: KimiDeltaAttention, w: KdaWeights, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             pages: torch.Tensor, ms: torch.Tensor, offs: torch.Tensor, M: int, conv_pool: torch.Tensor,
             rec_pool: torch.Tensor) -> None:
    """The commit's math, on the device: run i (state page pages[i], rows offs[i].. of qkv/g/beta) advances
    by its first ms[i] <= M tokens; positions past ms[i] (and runs with ms[i] = 0) leave it as it was."""
    H, D = attn.num_heads, attn.head_dim
    W = w.conv_weight.shape[1]
    dev = qkv.device
    n = pages.shape[0]
    t = torch.arange(M, device=dev)
    # [n, M]; past m: the last kept row again (m = 0: the run's first row, read but never applied)
    rows = offs[:, None] + torch.minimum(t[None, :], (ms[:, None] - 1).clamp(min=0))
    ext = torch.cat([conv_pool[pages].to(qkv.dtype), qkv[rows]], dim=1)  # [n, W-1+M, C]
    y = torch.zeros(n, M, qkv.shape[1], dtype=torch.float32, device=dev)
    for tap in range(W):  # output t reads ext rows t..t+W-1: real rows for every t < m
        y.addcmul_(ext[:, tap:tap + M].float(), w.conv_weight[:, tap])
    y = F.silu(y).to(qkv.dtype)
    tail = ms[:, None] + torch.arange(W - 1, device=dev)[None, :]  # the window after m tokens
    conv_pool[pages] = ext[torch.arange(n, device=dev)[:, None], tail].to(conv_pool.dtype)
    _, kk, v = y.view(n, M, 3, H, D).unbind(2)
    kk, v, gg, bb = kk.float(), v.float(), g[rows], beta[rows]
    S = rec_pool[pages]  # [n, H, D, D]
    for j in range(M):
        # the state never reads q; kk stands in for it
        _, nxt = kda_recurrent(kk[:, j:j + 1], kk[:, j:j + 1], v[:, j:j + 1], gg[:, j:j + 1], bb[:, j:j + 1],
                               initial_state=S)
        S = torch.where((j < ms)[:, None, None, None], nxt, S)
    rec_pool[pages] = S


def _replay_token_by_token(attn: KimiDeltaAttention, w: KdaWeights, step: GpuStep, runs: list[tuple[int, int, int]],
                           conv_pool: torch.Tensor, rec_pool: torch.Tensor) -> None:
    """Batch-invariant commit: the accepted tokens of each run through `kda_decode` (one program per head)
    on the live pages, the t-th tokens of all runs in launch t, from the inputs `_token_by_token` kept:
    the same kernel on the same inputs and states as the decode steps plain decoding would have run, so
    the states come out bit-identical to them. The outputs are discarded (the verify step produced them)."""
    from k3rt.kernels.kda import kda_decode

    qkv, f, b, gate = step.verify_inputs[attn.layer_idx]  # rows of the verify runs, in step order
    H, D = attn.num_heads, attn.head_dim
    first, off = {}, 0
    for i in step.verify_seqs:
        first[i], off = off, off + step.lens[i]
    for t in range(max((m for _, m, _ in runs), default=0)):
        live = [(s, p) for s, m, p in runs if m > t]
        rows = torch.tensor([first[s] + t for s, _ in live], device=qkv.device)
        slots = torch.tensor([p for _, p in live], dtype=torch.long, device=qkv.device)
        kda_decode(qkv[rows], w.conv_weight, conv_pool, f[rows], w.A_log, w.dt_bias, b[rows], rec_pool, slots,
                   lower_bound=attn.lower_bound, o_gate=gate[rows].reshape(len(live), H, D),
                   o_norm_weight=attn.o_norm_weight, o_norm_eps=attn.eps, v_split=1)
