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
  decode table/ctx    [Nd, M], [Nd]  (int32, steps with both MLA forms) the decode sequences' block_table rows
                                and ctx_lens, so no MLA layer gathers them (decode/prefill rows also come as
                                spans when contiguous: the layers slice)
  row_seq             [T]       (row_queries: verify graphs) the sequence of each row; every row is then its
                                own MLA decode query over its context (pos + 1), and no sequence takes
                                the expanded form, so no array's size depends on the context lengths
  kda_dec_rows/pages  [Nd], [G, Nd]  (kda_split, a step with both kinds of rows) the rows and state pages of
                                the plain KDA decodes (one token, no snapshot, not a verify run), which
                                run through the decode kernel on their live states
  kda_rest_rows/pages [Tr], [G, Br]  the rows and state pages of the other sequences; conv_idx,
                                conv_tail_idx and snap_conv_idx then index THEIR ext (as if they were the
                                whole step), and cu_seqlens of the rest is packed as an int32 array of its own
  kda_live, kda_verify_rows [Bl], [Tv]  (steps with verify runs) the general form's sequences that are no
                                verify run, and the rows of those that are: what every KDA layer writes back and keeps
  store_idx/dest      [M, W-1], [G, M]  (merge_stores, a step with snapshots whose windows all lie in the step's
                                rows, no verify run) the snapshot windows then the new windows, M = S + the
                                general form's sequences, and each window's destination page: one store launch
                                per KDA layer instead of two (the two must stay ordered when a snapshot window
                                reads cached rows the new windows overwrite)
  chunk tables        (chunk_tables: eager steps the chunked KDA kernel runs in) int32 chunk_seq, chunk_idx [NC],
                                chunk_off [Bk], snap [NC], init [Bk] (kernels/kda/chunk_tables.py) and snap as
                                destination pages [G, NC]; int64 (last in that buffer, like the state pages the
                                in-place form passes): the state slots 0..Bk-1 of the general form's sequences.
                                Built and checked once per step here, so the 20 KDA layers of a 48B step neither
                                rebuild nor copy them

The host-side lists (cu, starts, snapshots) stay on the object for launchers that need Python ints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from k3rt.kernels.kda.chunk_tables import ChunkTables, chunk_tables


@dataclass(slots=True)
class StepSeq:
    """One sequence of a step, as the runner hands it to the builder (slots: a 1,000-decode step builds 1,000)."""

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
class KdaRows:
    """The sequences KDA's general (chunked) form runs, as a step of their own: every sequence of the step, or
    in a split step the rest (backend/runner/gpu/kda.py `_general` reads only these fields). Indices of
    sequences (snapshots, verify_seqs) are positions among these sequences; conv_idx and the others index
    the ext these sequences build (their old windows, then their rows)."""

    num_seqs: int
    cu: list[int]
    starts: list[int]
    lens: list[int]
    snapshots: list[tuple[int, int, list[int]]]
    verify_seqs: list[int]
    cu_seqlens: torch.Tensor  # int32 [num_seqs + 1]
    state_pages: torch.Tensor  # int64 [G, num_seqs]
    conv_idx: torch.Tensor  # [rows, W]
    conv_tail_idx: torch.Tensor  # [num_seqs, W-1]
    snap_conv_idx: torch.Tensor  # [S, W-1]
    snap_dest: torch.Tensor  # int64 [G, S]
    live_seqs: torch.Tensor | None  # int64 [Bl]: the sequences that are no verify run (None: there is no verify run)
    verify_rows: torch.Tensor | None  # int64 [Tv]: the rows of the verify runs, in order (None: no verify run)
    # the chunked kernel's tables and the sequences' state slots 0..num_seqs-1 (int64), built once per step
    # (pack_step chunk_tables, which the runner asks for whenever the kernels run); None: the torch-op path
    chunk: ChunkTables | None
    chunk_slots: torch.Tensor | None
    # int32 [G, NC]: the chunk tables' snapshots as each group's destination pages (-1: none), for the layers
    # whose chunked kernel runs on the pool's pages in place
    chunk_snap_pages: torch.Tensor | None
    # the step's dict (kda_commit reads the verify runs' rows from it, in step order: the rest keeps that order)
    verify_inputs: dict[int, tuple[torch.Tensor, ...]]
    # the chunked kernel's intermediates, allocated by the first KDA layer and reused by the others
    # (kda_chunk_fwd scratch): every layer's chunks have the same shapes
    chunk_scratch: dict = field(default_factory=dict)
    # pack_step merge_stores: the snapshot windows and the new windows in one store ([M, W-1] rows of ext, [G, M]
    # destination pages); None: two stores, snapshots first
    store_idx: torch.Tensor | None = None
    store_dest: torch.Tensor | None = None


@dataclass
class KdaSplit:
    """A step with plain decodes and other rows, split for the KDA layers (pack_step kda_split): the plain
    decodes' rows go through `kda_decode` on their live states, exactly as in a decode step, and only `rest`
    through the chunked form. A span (first row, end row) is set when those rows are contiguous in the step
    (decodes come first: the common case), so the layer slices instead of gathering and scattering."""

    dec_rows: torch.Tensor  # int64 [Nd]
    dec_pages: torch.Tensor  # int64 [G, Nd]
    dec_span: tuple[int, int] | None
    rest_rows: torch.Tensor  # int64 [Tr]
    rest_span: tuple[int, int] | None
    rest: KdaRows


@dataclass(frozen=True)
class KdaSplitMeta:
    """The host half of a KdaSplit: the rest's lists (KdaRows' host fields) and the spans."""

    num_decodes: int
    rest_cu: list[int]
    rest_starts: list[int]
    rest_lens: list[int]
    rest_snapshots: list[tuple[int, int, list[int]]]
    rest_verify_seqs: list[int]
    dec_span: tuple[int, int] | None
    rest_span: tuple[int, int] | None


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
    # a step with both MLA forms: the decode sequences' block_table rows [Nd, M] and ctx_lens [Nd] (int32); None
    # otherwise (every sequence decodes: block_table and ctx_lens themselves)
    decode_block_table: torch.Tensor | None
    decode_ctx_lens: torch.Tensor | None
    decode_span: tuple[int, int] | None  # decode_rows as (first, end) when contiguous: slices, not gathers
    prefill_span: tuple[int, int] | None  # prefill_rows likewise
    # what the general KDA form runs: every sequence (kda_split None), or the rest of a split step
    kda_rows: KdaRows
    kda_split: KdaSplit | None
    verify_seqs: list[int] = field(default_factory=list)  # sequences that are verify runs (host list)
    # filled by the KDA layers for verify steps: layer index -> (pre-conv qkv [T, 3P], g [T, H, K], beta [T, H]),
    # or in the batch-invariant mode kda_decode's inputs (pre-conv qkv [T, 3P], f [T, P], b [T, H], gate [T, P])
    verify_inputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # the verify graphs' form (pack_step row_queries): each row's sequence [T] int64; None otherwise
    row_seq: torch.Tensor | None = None
    # device tensors the layers derive from the step's buffers once per forward and share (the verify form's per-row
    # MLA block table and context lengths, its KDA run lengths): one launch or three per step instead of per layer.
    # GpuForward clears it as each forward starts: device rounds (rounds.py) advance the buffers between forwards
    derived: dict[str, torch.Tensor] = field(default_factory=dict)

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
    row_queries: bool = False
    kda_split: KdaSplitMeta | None = None
    num_chunks: int | None = None  # chunk tables packed (pack_step chunk_tables): their chunk count
    mla_mixed: bool = False  # both MLA forms: the decodes' table rows and contexts packed
    decode_span: tuple[int, int] | None = None  # the MLA decode rows (first, end) when contiguous
    prefill_span: tuple[int, int] | None = None  # the expanded-form rows (first, end) when contiguous
    merged_stores: bool = False  # store_idx / store_dest packed (pack_step merge_stores)


def pack_step(seqs: list[StepSeq], *, block_size: int, conv_width: int, num_groups: int,
              max_blocks: int | None = None, extra_logit_rows: list[int] = (),
              row_queries: bool = False, kda_split: bool = False, chunk_tables: bool = False,
              merge_stores: bool = False) -> tuple[StepMeta, tuple[torch.Tensor, torch.Tensor]]:
    """Compute every index of the step on the host: (meta, (int64 buffer, int32 buffer)).
    row_queries: the verify graphs' form (every MLA row a decode query, row_seq packed; module docstring).
    kda_split: a step with plain decodes (one token, no snapshot, not a verify run) and other sequences is
    split for the KDA layers (KdaSplit; the runner asks for it when the decode kernel runs, not in the
    batch-invariant mode): the general form's conv indices are built over the other sequences only.
    chunk_tables: pack the chunked KDA kernel's tables of the general form's sequences (the runner asks for them
    on eager steps with the kernels, outside the batch-invariant mode; none for a decode-only step, which
    never runs the chunked form); a bad snapshot position is refused here (ValueError naming it).
    merge_stores: a step whose snapshot windows all lie in its own rows (none reads a cached window row) and that
    has no verify run packs its snapshot and new conv windows as one store (store_idx, store_dest): the KDA layers
    then launch one store each instead of two.

    Vectorized over sequences: each per-sequence field is read once in a C-level map (no Python loop over
    the batch, which cost 4 ms at 1,000 decodes with the graph table width), and every index array is a
    numpy expression over the packed rows. Only the sequences that carry snapshots are looped over."""
    B, w1 = len(seqs), conv_width - 1
    if B == 0:
        raise ValueError("seqs: a step needs at least one sequence")
    tokens = list(map(_TOKENS, seqs))
    lens_np = np.fromiter(map(len, tokens), dtype=np.int64, count=B)
    lens = lens_np.tolist()
    starts = list(map(_START, seqs))
    starts_np = np.asarray(starts, dtype=np.int64)
    cu = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(lens_np, out=cu[1:])
    T = int(cu[-1])
    ids = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=T)
    arange_b = np.arange(B)
    seq_of_row = np.repeat(arange_b, lens_np)
    row0 = cu[seq_of_row]
    rel = np.arange(T) - row0  # position within the step's tokens
    pos = rel + starts_np[seq_of_row]

    tables = list(map(_TABLE, seqs))
    num_pages = np.fromiter(map(len, tables), dtype=np.int64, count=B)
    need = max(1, int(num_pages.max()))
    if max_blocks is None:
        max_blocks = need
    elif need > max_blocks:
        raise ValueError(f"block_table: a sequence holds {need} pages, more than max_blocks={max_blocks}")

    state_lists = list(map(_STATES, seqs))
    if None in state_lists:  # a model without KDA layers: page 0 of each group (the kernels never read it)
        state_lists = [p if p is not None else [0] * num_groups for p in state_lists]
    states = np.fromiter(chain.from_iterable(state_lists), dtype=np.int64).reshape(B, num_groups)
    snap_lists = list(map(_SNAPSHOTS, seqs))
    has_snaps = any(snap_lists)
    verify = np.fromiter(map(_VERIFY, seqs), dtype=bool, count=B)
    is_decode = lens_np == 1
    plain = is_decode & ~verify  # KDA plain decodes: one token, no snapshot, states advanced live
    if has_snaps:
        plain &= ~np.fromiter(map(bool, snap_lists), dtype=bool, count=B)
    n_plain = int(np.count_nonzero(plain)) if kda_split and not row_queries else 0
    split = n_plain if 0 < n_plain < B else None  # the number of plain decodes of a split step

    if split is None:  # the general form over every sequence: the step's own rows and offsets
        k_seqs, k_lens, k_cu, k_seq_of_row, k_row0, k_rel = arange_b, lens_np, cu, seq_of_row, row0, rel
        kda_extra = [np.zeros(0, dtype=np.int64)] * 4
    else:
        dec_seqs, k_seqs = np.flatnonzero(plain), np.flatnonzero(~plain)
        k_lens = lens_np[k_seqs]
        k_cu = np.zeros(len(k_seqs) + 1, dtype=np.int64)
        np.cumsum(k_lens, out=k_cu[1:])
        k_seq_of_row = np.repeat(np.arange(len(k_seqs)), k_lens)
        k_row0 = k_cu[k_seq_of_row]
        k_rel = np.arange(int(k_cu[-1])) - k_row0
        dec_rows, rest_rows = cu[dec_seqs], np.flatnonzero(~plain[seq_of_row])
        kda_extra = [dec_rows, states[dec_seqs].T.ravel(), rest_rows, states[k_seqs].T.ravel()]
    Bk = len(k_seqs)
    old_base = Bk * w1
    taps = np.arange(-w1, 1)  # window of row r: relative positions r-w1 .. r
    conv_idx = _window_rows(k_seq_of_row[:, None], k_rel[:, None] + taps[None, :], k_row0[:, None], w1, old_base)
    tail_rel = k_lens[:, None] + np.arange(-w1, 0)[None, :]
    conv_tail = _window_rows(np.arange(Bk)[:, None], tail_rel, k_cu[:-1][:, None], w1, old_base)

    snaps, k_snaps, snap_rows = [], [], []
    if has_snaps:
        local = {int(i): j for j, i in enumerate(k_seqs.tolist())} if split is not None else None
        for i in np.flatnonzero(np.fromiter(map(bool, snap_lists), dtype=bool, count=B)).tolist():
            j = i if local is None else local[i]  # snapshot rows are never plain decodes: always among k_seqs
            for p, dest in snap_lists[i]:
                snaps.append((i, p, dest))
                k_snaps.append((j, p, dest))
                snap_rows.append(_window_rows(j, p - starts[i] + np.arange(-w1, 0), k_cu[j], w1, old_base))
    snap_conv = np.asarray(snap_rows, dtype=np.int64).reshape(len(snaps), w1)
    snap_dest = np.asarray([d for _, _, d in snaps], dtype=np.int64).reshape(len(snaps), num_groups)
    # the general form's verify runs keep their states: its layers write back the others' (k_live) and keep
    # the runs' rows (k_verify_rows) for the commit
    k_verify = verify[k_seqs]
    k_live, k_verify_rows = ((np.flatnonzero(~k_verify), np.flatnonzero(k_verify[k_seq_of_row])) if k_verify.any()
                             else (np.zeros(0, dtype=np.int64),) * 2)
    # one store of the snapshot windows and the new windows: safe when no snapshot window reads an old window row
    # (rows below old_base), which the new windows overwrite; the verify runs' form stores a subset (no merge)
    merged = bool(merge_stores and snaps and not k_verify.any() and (snap_conv >= old_base).all())
    store64 = ([np.concatenate([snap_conv, conv_tail]).ravel(), np.concatenate([snap_dest, states[k_seqs]]).T.ravel()]
               if merged else [np.zeros(0, dtype=np.int64)] * 2)
    chunk32, chunk64 = [], []
    if chunk_tables and (has_snaps or not is_decode.all()):
        # the general form's state copy holds its sequences in slots 0..Bk-1, then one slot per snapshot
        positions: list[list[int]] = [[] for _ in range(Bk)]
        slots: list[list[int]] = [[] for _ in range(Bk)]
        k_starts = starts_np[k_seqs]
        for j, (i, p, _) in enumerate(k_snaps):
            positions[i].append(p - int(k_starts[i]))
            slots[i].append(Bk + j)
        c_seq, c_idx, c_off, c_snap = _chunk_tables(k_lens, positions if k_snaps else None, slots if k_snaps else None)
        # the same snapshots straight into the pool (the layers that run on their live pages): each group's
        # destination page of the snapshot taken after each chunk, or -1
        snap_pages = np.full((num_groups, c_snap.size), -1, dtype=np.int64)
        taken = c_snap >= 0
        if taken.any():
            snap_pages[:, taken] = np.asarray([d for _, _, d in k_snaps], dtype=np.int64)[c_snap[taken] - Bk].T
        chunk32 = [c_seq, c_idx, c_off, c_snap, np.ones(Bk, dtype=np.int64), snap_pages.ravel()]
        # the state copy's slots in the int64 buffer, as the in-place form's state pages are: the chunk state
        # kernel takes either, and a slot dtype per form was one more binary (compiled mid-run on the H200 by the
        # first step that mixed a verify run, which takes the copy, with a prefill chunk)
        chunk64 = [np.arange(Bk, dtype=np.int64)]

    # the ragged tables scattered into [B, max_blocks] through flat indices (row * width + column)
    filled = int(num_pages.sum())
    page_row = np.repeat(arange_b, num_pages)
    cu_pages = np.cumsum(num_pages) - num_pages
    # the int32 buffer is allocated once and the table written in place: at graph width (every page of the
    # longest context) the table is the largest array of the step, and a fresh zeroed array plus a concatenated
    # copy of it cost 0.4 ms of page faults at 512 x 556 where one reused allocation costs 0.03 ms
    # sequences in the expanded (prefill) MLA form; none when every row is its own decode query
    pre_np = np.flatnonzero(lens_np != 1) if not row_queries else np.zeros(0, dtype=np.int64)
    dec = np.flatnonzero(is_decode)
    ctx = starts_np + lens_np
    # a step with both MLA forms: its decode sequences' table rows and context lengths, packed once here
    # rather than gathered by each MLA layer
    mla_mixed = 0 < dec.size < B and not row_queries
    # cu, ctx, table, cu_k, cu_q, then (MLA mixed) the decodes' table rows and contexts, then (a split step) the
    # rest's cu, then (chunk_tables) the chunk tables
    tail32 = ([k_cu] if split is not None else []) + chunk32
    sizes32 = ([B + 1, B, B * max_blocks, len(pre_np) + 1, len(pre_np) + 1]
               + ([dec.size * max_blocks, dec.size] if mla_mixed else []) + [a.size for a in tail32])
    flat32 = np.empty(sum(sizes32), dtype=np.int32)
    cu32, ctx32, table, cu_k32, cu_q32, *tail_views = _split(flat32, sizes32)
    dec_views = [tail_views.pop(0), tail_views.pop(0)] if mla_mixed else []
    for view, a in zip(tail_views, tail32):
        view[:] = a
    table = table.reshape(B, max_blocks)
    table.fill(0)
    table.ravel()[page_row * max_blocks + (np.arange(filled) - cu_pages[page_row])] = np.fromiter(
        chain.from_iterable(tables), dtype=np.int64, count=filled)
    if mla_mixed:
        dec_views[0][:], dec_views[1][:] = table[dec].ravel(), ctx[dec]
    kv_slot = table[seq_of_row, pos // block_size].astype(np.int64) * block_size + pos % block_size

    sampled = np.fromiter(map(_NEEDS_LOGITS, seqs), dtype=bool, count=B) & ~verify
    verify_seqs = np.flatnonzero(verify).tolist()
    logit_rows = np.concatenate([cu[1:][sampled] - 1, np.flatnonzero(verify[seq_of_row]),
                                 np.asarray(extra_logit_rows, dtype=np.int64)])
    decode_form = is_decode.tolist()
    pre = pre_np.tolist()
    # every context position of the expanded-form sequences, their flat cache rows
    ctx_pre = ctx[pre_np]
    cu_k = np.zeros(len(pre) + 1, dtype=np.int64)
    np.cumsum(ctx_pre, out=cu_k[1:])
    cu_q = np.zeros(len(pre) + 1, dtype=np.int64)
    np.cumsum(lens_np[pre_np], out=cu_q[1:])
    ctx_seq = np.repeat(pre_np, ctx_pre)
    ctx_pos = np.arange(int(cu_k[-1])) - np.repeat(cu_k[:-1], ctx_pre)
    ctx_slot = table[ctx_seq, ctx_pos // block_size].astype(np.int64) * block_size + ctx_pos % block_size
    pre_rows = np.flatnonzero(~is_decode[seq_of_row]) if not row_queries else np.zeros(0, dtype=np.int64)

    i64 = [ids, pos, kv_slot, states.T.ravel(), conv_idx.ravel(), conv_tail.ravel(), logit_rows, ctx_slot,
           pre_rows, dec, cu[dec], snap_conv.ravel(), snap_dest.T.ravel(),
           seq_of_row if row_queries else np.zeros(0, dtype=np.int64), *kda_extra, k_live, k_verify_rows, *store64,
           *chunk64]
    cu32[:], ctx32[:], cu_k32[:], cu_q32[:] = cu, ctx, cu_k, cu_q
    split_meta = None
    if split is not None:
        k_list = k_seqs.tolist()
        split_meta = KdaSplitMeta(split, k_cu.tolist(), [starts[i] for i in k_list], k_lens.tolist(), k_snaps,
                                  np.flatnonzero(verify[k_seqs]).tolist(), _span(kda_extra[0]), _span(kda_extra[2]))
    meta = StepMeta(B, T, max_blocks, len(snaps), w1, [p.size for p in i64], sizes32,
                    cu.tolist(), starts, lens, decode_form, snaps, pre,
                    int(lens_np[pre_np].max(initial=0)), int(ctx_pre.max(initial=0)),
                    bool(logit_rows.size == T and np.array_equal(logit_rows, np.arange(T))), verify_seqs, row_queries,
                    split_meta, len(chunk32[0]) if chunk32 else None, mla_mixed,
                    _span(cu[dec]) if dec.size else None, _span(pre_rows) if pre_rows.size else None, merged)
    host = (torch.from_numpy(np.concatenate(i64, dtype=np.int64)), torch.from_numpy(flat32))
    return meta, host


def _span(rows: np.ndarray) -> tuple[int, int] | None:
    """(first, end) when the (ascending) rows are one contiguous range, else None."""
    first, last = int(rows[0]), int(rows[-1])
    return (first, last + 1) if last - first + 1 == rows.size else None


_TOKENS, _START, _TABLE, _STATES = (attrgetter(n) for n in ("token_ids", "start", "block_table", "state_pages"))
_SNAPSHOTS, _VERIFY, _NEEDS_LOGITS = attrgetter("snapshots"), attrgetter("verify"), attrgetter("needs_logits")
_chunk_tables = chunk_tables  # pack_step's flag of the same name shadows it there


def _split(flat, sizes: list[int]) -> list:
    """Consecutive slices (views) of `flat` of these sizes (a tensor or a numpy array)."""
    out, o = [], 0
    for n in sizes:
        out.append(flat[o:o + n])
        o += n
    return out


def step_views(meta: StepMeta, flat64: torch.Tensor, flat32: torch.Tensor) -> GpuStep:
    """The GpuStep whose tensors are views of the two device buffers (static ones under CUDA graphs)."""
    B, T, w1 = meta.num_seqs, meta.num_tokens, meta.w1
    (t_ids, t_pos, t_slot, t_states, t_conv, t_tail, t_logit, t_ctx_slot, t_pre_rows, t_dec, t_dec_rows,
     t_snap, t_snap_dest, t_row_seq, t_kdec_rows, t_kdec_pages, t_krest_rows,
     t_krest_pages, t_live, t_verify_rows, t_store_idx, t_store_dest, *t_chunk64) = _split(flat64, meta.sizes64)
    t_cu, t_ctx, t_table, t_cuk, t_cuq, *tail32 = _split(flat32, meta.sizes32)
    G = t_states.numel() // B
    state_pages = t_states.view(G, B)
    verify_inputs: dict[int, tuple[torch.Tensor, ...]] = {}
    sm = meta.kda_split
    dec_table, dec_ctx = (tail32.pop(0), tail32.pop(0)) if meta.mla_mixed else (None, None)
    t_krest_cu = tail32.pop(0) if sm is not None else None
    chunk, chunk_slots, chunk_snap_pages = None, None, None
    if meta.num_chunks is not None:
        c_seq, c_idx, c_off, c_snap, c_init, c_snap_pages = tail32
        (chunk_slots,) = t_chunk64
        chunk = ChunkTables(c_seq, c_idx, c_off, c_snap, c_init, meta.num_chunks)
        chunk_snap_pages = c_snap_pages.view(G, meta.num_chunks)
    verify_any = t_verify_rows.numel() > 0
    rows_kw = dict(live_seqs=t_live if verify_any else None, verify_rows=t_verify_rows if verify_any else None,
                   chunk=chunk, chunk_slots=chunk_slots, chunk_snap_pages=chunk_snap_pages, verify_inputs=verify_inputs)
    if meta.merged_stores:
        M = t_store_idx.numel() // w1
        rows_kw.update(store_idx=t_store_idx.view(M, w1), store_dest=t_store_dest.view(G, M))
    if sm is None:
        kda_rows = KdaRows(B, meta.cu, meta.starts, meta.lens, meta.snapshots, meta.verify_seqs, t_cu, state_pages,
                           t_conv.view(T, w1 + 1), t_tail.view(B, w1), t_snap.view(meta.num_snapshots, w1),
                           t_snap_dest.view(G, meta.num_snapshots), **rows_kw)
        split = None
    else:
        Br = len(sm.rest_lens)
        kda_rows = KdaRows(Br, sm.rest_cu, sm.rest_starts, sm.rest_lens, sm.rest_snapshots, sm.rest_verify_seqs,
                           t_krest_cu, t_krest_pages.view(G, Br), t_conv.view(sm.rest_cu[-1], w1 + 1),
                           t_tail.view(Br, w1), t_snap.view(meta.num_snapshots, w1),
                           t_snap_dest.view(G, meta.num_snapshots), **rows_kw)
        split = KdaSplit(t_kdec_rows, t_kdec_pages.view(G, sm.num_decodes), sm.dec_span, t_krest_rows, sm.rest_span,
                         kda_rows)
    return GpuStep(
        num_seqs=B, num_tokens=T, cu=meta.cu, starts=meta.starts, lens=meta.lens, decode_form=meta.decode_form,
        snapshots=meta.snapshots, ids=t_ids, pos=t_pos, kv_slot=t_slot, cu_seqlens=t_cu, ctx_lens=t_ctx,
        block_table=t_table.view(B, meta.max_blocks), state_pages=state_pages, logit_rows=t_logit,
        logits_every_row=meta.logits_every_row, prefill_seqs=meta.prefill_seqs, prefill_rows=t_pre_rows,
        ctx_slot=t_ctx_slot, cu_k=t_cuk, cu_q=t_cuq, max_q=meta.max_q, max_k=meta.max_k, decode_seqs=t_dec,
        decode_rows=t_dec_rows,
        decode_block_table=dec_table.view(-1, meta.max_blocks) if dec_table is not None else None,
        decode_ctx_lens=dec_ctx, decode_span=meta.decode_span, prefill_span=meta.prefill_span, kda_rows=kda_rows,
        kda_split=split, verify_seqs=meta.verify_seqs,
        verify_inputs=verify_inputs, row_seq=t_row_seq if meta.row_queries else None,
    )


def build_step(seqs: list[StepSeq], *, block_size: int, conv_width: int, num_groups: int, device: torch.device,
               max_blocks: int | None = None, extra_logit_rows: list[int] = (), kda_split: bool = False,
               chunk_tables: bool = False, merge_stores: bool = False,
               before_copy: Callable[[], None] | None = None) -> GpuStep:
    """Pack on the host, copy to the device (pinned, non-blocking), return the views. before_copy: called between
    the two (the GPU-idle metric's start mark: backend/runner/gpu/idle.py)."""
    meta, (h64, h32) = pack_step(seqs, block_size=block_size, conv_width=conv_width, num_groups=num_groups,
                                 max_blocks=max_blocks, extra_logit_rows=extra_logit_rows, kda_split=kda_split,
                                 chunk_tables=chunk_tables, merge_stores=merge_stores)
    if before_copy is not None:
        before_copy()
    if device.type == "cuda":
        h64, h32 = h64.pin_memory(), h32.pin_memory()
    return step_views(meta, h64.to(device, non_blocking=True), h32.to(device, non_blocking=True))
