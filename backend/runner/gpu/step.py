"""The per-step batch description of the GPU runner, built on the host and sent in one copy.

A step is a packed (varlen) batch of sequences: sequence i feeds `n_i` tokens starting at absolute
position `start_i` (its cache length before the step). Every index the layers need is computed here
on the host with numpy, packed into one pinned int64 buffer and copied to the device with one
non-blocking copy, so no layer ever synchronizes with the host:

  ids, pos            [T]       token ids and absolute positions of the packed rows
  kv_slot             [T]       flat MLA cache row (page * block_size + offset) each row writes
  cu_seqlens          [B+1]     row offsets (int32 copy for the kernels)
  ctx_lens            [B]       start + n (int32): the context each sequence attends to
  block_table         [B, M]    MLA pages (int32, padded with 0)
  state_pages         [G, B]    the live KDA state sets: row g holds each sequence's page of group g
  conv_idx            [T, W]    rows of `ext = [old conv windows (B*(W-1) rows) ; the step's
                                pre-conv rows (T)]` that form each row's causal conv window
  conv_tail_idx       [B, W-1]  rows of `ext` that form each sequence's new conv window
  logit_rows          [R]       rows whose logits are returned: the last row of each sampled sequence,
                                then every row of each verify sequence (speculative decoding), then extras
  ctx_slot, cu_k      [Tk], [B+1]  flat MLA cache rows of every context position of the
                                sequences that take the expanded (prefill) form; decode-form
                                sequences (n == 1) read their pages through block_table instead
  snap_conv_idx       [S, W-1]  conv windows at snapshot positions (S snapshots)
  snap_dest           [G, S]    each snapshot's destination state set, by group

The host-side lists (cu, starts, snapshots) stay on the object for launchers that need Python ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StepSeq:
    """One sequence of a step, as the runner hands it to the builder."""

    token_ids: list[int]  # the tokens fed this step
    start: int  # absolute position of the first fed token
    block_table: list[int]
    state_pages: list[int] | None  # live KDA state set (one page per group), None without KDA layers
    needs_logits: bool
    snapshots: list[tuple[int, list[int]]] = field(default_factory=list)  # (absolute position, dest state set)
    # a speculative verify run (last token + drafts): logits at every row, and KDA layers leave its states as
    # they were (backend/runner/gpu/kda.py kda_commit replays the accepted prefix after sampling)
    verify: bool = False


@dataclass
class GpuStep:
    num_seqs: int
    num_tokens: int
    cu: list[int]  # host copy of cu_seqlens
    starts: list[int]
    lens: list[int]
    decode_form: list[bool]  # n == 1: MLA absorbed decode over pages
    snapshots: list[tuple[int, int, list[int]]]  # (seq, absolute position, dest state set), in snap_conv_idx order
    ids: torch.Tensor
    pos: torch.Tensor
    kv_slot: torch.Tensor
    cu_seqlens: torch.Tensor  # int32
    ctx_lens: torch.Tensor  # int32
    block_table: torch.Tensor  # int32
    state_pages: torch.Tensor  # int64 [G, B]: row g (contiguous, as kernels index it) = each sequence's page of group g
    conv_idx: torch.Tensor
    conv_tail_idx: torch.Tensor
    logit_rows: torch.Tensor
    logits_every_row: bool  # logit_rows is 0..T-1 in order (decode steps): no gather needed
    prefill_seqs: list[int]  # sequences in the expanded MLA form
    prefill_rows: torch.Tensor  # packed rows of those sequences
    ctx_slot: torch.Tensor
    cu_k: torch.Tensor  # int32 [len(prefill_seqs)+1]
    cu_q: torch.Tensor  # int32 [len(prefill_seqs)+1]
    max_q: int
    max_k: int
    decode_seqs: torch.Tensor  # int64: sequences in the decode form
    decode_rows: torch.Tensor  # their packed rows
    snap_conv_idx: torch.Tensor
    snap_dest: torch.Tensor  # int64 [G, S]: row g = each snapshot's destination page of group g
    verify_seqs: list[int] = field(default_factory=list)  # sequences that are verify runs (host list)
    # filled by the KDA layers for verify steps: layer index -> (pre-conv qkv [T, 3P], g [T, H, K], beta [T, H])
    verify_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def decode_only(self) -> bool:
        return all(self.decode_form) and not self.snapshots


def _window_rows(seq: int, rel: np.ndarray, row0: int, w1: int, old_base: int) -> np.ndarray:
    """Rows of ext holding relative positions `rel` of sequence `seq` (negative: its old conv window)."""
    return np.where(rel >= 0, old_base + row0 + rel, seq * w1 + (rel + w1))


@dataclass(frozen=True)
class StepMeta:
    """The host-side half of a step: sizes of the packed buffers and the lists launchers need as ints."""

    num_seqs: int
    num_tokens: int
    max_blocks: int
    num_snapshots: int
    w1: int
    sizes64: list[int]
    sizes32: list[int]
    cu: list[int]
    starts: list[int]
    lens: list[int]
    decode_form: list[bool]
    snapshots: list[tuple[int, int, list[int]]]
    prefill_seqs: list[int]
    max_q: int
    max_k: int
    logits_every_row: bool
    verify_seqs: list[int]


def pack_step(seqs: list[StepSeq], *, block_size: int, conv_width: int, num_groups: int,
              max_blocks: int | None = None, extra_logit_rows: list[int] = ()) -> tuple[StepMeta, tuple[torch.Tensor, torch.Tensor]]:
    """Compute every index of the step on the host: (meta, (int64 buffer, int32 buffer))."""
    B, w1 = len(seqs), conv_width - 1
    lens = [len(s.token_ids) for s in seqs]
    starts = [s.start for s in seqs]
    cu = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    T = int(cu[-1])
    ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=T)
    seq_of_row = np.repeat(np.arange(B), lens)
    rel = np.arange(T) - cu[seq_of_row]  # position within the step's tokens
    pos = rel + np.asarray(starts, dtype=np.int64)[seq_of_row]
    need = max(1, max(len(s.block_table) for s in seqs))
    if max_blocks is None:
        max_blocks = need
    elif need > max_blocks:
        raise ValueError(f"block_table: a sequence holds {need} pages, more than max_blocks={max_blocks}")
    table = np.zeros((B, max_blocks), dtype=np.int64)
    for i, s in enumerate(seqs):
        table[i, :len(s.block_table)] = s.block_table
    kv_slot = table[seq_of_row, pos // block_size] * block_size + pos % block_size
    states = np.asarray([s.state_pages if s.state_pages is not None else [0] * num_groups for s in seqs],
                        dtype=np.int64).reshape(B, num_groups)
    old_base = B * w1
    taps = np.arange(-w1, 1)  # window of row r: relative positions r-w1 .. r
    conv_idx = _window_rows(seq_of_row[:, None], rel[:, None] + taps[None, :], cu[seq_of_row][:, None], w1, old_base)
    tail_rel = np.asarray(lens, dtype=np.int64)[:, None] + np.arange(-w1, 0)[None, :]
    conv_tail = _window_rows(np.arange(B)[:, None], tail_rel, cu[:-1][:, None], w1, old_base)
    snaps, snap_rows = [], []
    for i, s in enumerate(seqs):
        for p, dest in s.snapshots:
            snaps.append((i, p, dest))
            snap_rows.append(_window_rows(i, p - s.start + np.arange(-w1, 0), cu[i], w1, old_base))
    snap_conv = np.asarray(snap_rows, dtype=np.int64).reshape(len(snaps), w1)
    verify_seqs = [i for i, s in enumerate(seqs) if s.verify]
    logit_rows = np.asarray([cu[i + 1] - 1 for i, s in enumerate(seqs) if s.needs_logits and not s.verify]
                            + [r for i in verify_seqs for r in range(cu[i], cu[i + 1])] + list(extra_logit_rows),
                            dtype=np.int64)
    decode_form = [n == 1 for n in lens]
    pre = [i for i in range(B) if not decode_form[i]]
    dec = np.asarray([i for i in range(B) if decode_form[i]], dtype=np.int64)
    ctx = np.asarray(starts, dtype=np.int64) + np.asarray(lens, dtype=np.int64)
    ctx_pos = [np.arange(ctx[i]) for i in pre]
    ctx_slot = (np.concatenate([table[i, p // block_size] * block_size + p % block_size for i, p in zip(pre, ctx_pos)])
                if pre else np.zeros(0, dtype=np.int64))
    cu_k = np.concatenate([[0], np.cumsum([ctx[i] for i in pre])]).astype(np.int64)
    cu_q = np.concatenate([[0], np.cumsum([lens[i] for i in pre])]).astype(np.int64)
    pre_rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in pre]) if pre else np.zeros(0, dtype=np.int64)

    snap_dest = np.asarray([d for _, _, d in snaps], dtype=np.int64).reshape(len(snaps), num_groups)
    i64 = [ids, pos, kv_slot, states.T.ravel(), conv_idx.ravel(), conv_tail.ravel(), logit_rows, ctx_slot,
           pre_rows, dec, cu[dec] if len(dec) else dec, snap_conv.ravel(), snap_dest.T.ravel()]
    i32 = [cu, ctx, table.ravel(), cu_k, cu_q]
    meta = StepMeta(B, T, max_blocks, len(snaps), w1, [p.size for p in i64], [p.size for p in i32],
                    cu.tolist(), starts, lens, decode_form, snaps, pre,
                    max((lens[i] for i in pre), default=0), int(max((ctx[i] for i in pre), default=0)),
                    bool(np.array_equal(logit_rows, np.arange(T))), verify_seqs)
    host = (torch.from_numpy(np.concatenate(i64).astype(np.int64)),
            torch.from_numpy(np.concatenate(i32).astype(np.int32)))
    return meta, host


def step_views(meta: StepMeta, flat64: torch.Tensor, flat32: torch.Tensor) -> GpuStep:
    """The GpuStep whose tensors are views of the two device buffers (static ones under CUDA graphs)."""
    def split(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        out, o = [], 0
        for n in sizes:
            out.append(flat[o:o + n])
            o += n
        return out

    B, T, w1 = meta.num_seqs, meta.num_tokens, meta.w1
    (t_ids, t_pos, t_slot, t_states, t_conv, t_tail, t_logit, t_ctx_slot, t_pre_rows, t_dec, t_dec_rows,
     t_snap, t_snap_dest) = split(flat64, meta.sizes64)
    t_cu, t_ctx, t_table, t_cuk, t_cuq = split(flat32, meta.sizes32)
    return GpuStep(
        num_seqs=B, num_tokens=T, cu=meta.cu, starts=meta.starts, lens=meta.lens, decode_form=meta.decode_form,
        snapshots=meta.snapshots, ids=t_ids, pos=t_pos, kv_slot=t_slot, cu_seqlens=t_cu, ctx_lens=t_ctx,
        block_table=t_table.view(B, meta.max_blocks), state_pages=t_states.view(-1, B), conv_idx=t_conv.view(T, w1 + 1),
        conv_tail_idx=t_tail.view(B, w1), logit_rows=t_logit, logits_every_row=meta.logits_every_row,
        prefill_seqs=meta.prefill_seqs, prefill_rows=t_pre_rows,
        ctx_slot=t_ctx_slot, cu_k=t_cuk, cu_q=t_cuq, max_q=meta.max_q, max_k=meta.max_k, decode_seqs=t_dec,
        decode_rows=t_dec_rows, snap_conv_idx=t_snap.view(meta.num_snapshots, w1),
        snap_dest=t_snap_dest.view(t_states.numel() // B, meta.num_snapshots), verify_seqs=meta.verify_seqs,
    )


def build_step(seqs: list[StepSeq], *, block_size: int, conv_width: int, num_groups: int, device: torch.device,
               max_blocks: int | None = None, extra_logit_rows: list[int] = ()) -> GpuStep:
    """Pack on the host, copy to the device (pinned, non-blocking), return the views."""
    meta, (h64, h32) = pack_step(seqs, block_size=block_size, conv_width=conv_width, num_groups=num_groups,
                                 max_blocks=max_blocks, extra_logit_rows=extra_logit_rows)
    if device.type == "cuda":
        h64, h32 = h64.pin_memory(), h32.pin_memory()
    return step_views(meta, h64.to(device, non_blocking=True), h32.to(device, non_blocking=True))
