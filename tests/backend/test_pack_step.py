"""`pack_step` (vectorized) equals the per-sequence implementation it replaced, field for field and byte for byte,
on randomized batches: decode-only steps (positions on and next to page boundaries, graph-width tables, padding
rows), mixed prefill/decode steps with KDA snapshot rows, verify runs, prompt-scoring rows, sequences without
KDA state, and every conv width the models use. The reference below is the implementation as it was before
vectorizing (commit e9be71b), kept verbatim as the oracle."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from k3rt.backend.runner.gpu.step import StepMeta, StepSeq, pack_step


def _window_rows_reference(seq, rel, row0, w1, old_base):
    return np.where(rel >= 0, old_base + row0 + rel, seq * w1 + (rel + w1))


def _pack_step_reference(seqs: list[StepSeq], *, block_size: int, conv_width: int, num_groups: int,
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
    conv_idx = _window_rows_reference(seq_of_row[:, None], rel[:, None] + taps[None, :], cu[seq_of_row][:, None], w1,
                                      old_base)
    tail_rel = np.asarray(lens, dtype=np.int64)[:, None] + np.arange(-w1, 0)[None, :]
    conv_tail = _window_rows_reference(np.arange(B)[:, None], tail_rel, cu[:-1][:, None], w1, old_base)
    snaps, snap_rows = [], []
    for i, s in enumerate(seqs):
        for p, dest in s.snapshots:
            snaps.append((i, p, dest))
            snap_rows.append(_window_rows_reference(i, p - s.start + np.arange(-w1, 0), cu[i], w1, old_base))
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
    # the verify graphs' row_seq and the KDA split's rows and pages: empty here; then the sequences that are no
    # verify run and the verify runs' rows (both empty without verify runs)
    none = np.zeros(0, dtype=np.int64)
    live = [i for i in range(B) if not seqs[i].verify] if verify_seqs else []
    verify_rows = [r for i in verify_seqs for r in range(cu[i], cu[i + 1])]
    i64 += [none] * 5 + [np.asarray(live, dtype=np.int64), np.asarray(verify_rows, dtype=np.int64)]
    i32 = [cu, ctx, table.ravel(), cu_k, cu_q]
    # a step with both MLA forms also packs its decodes' table rows and contexts
    mla_mixed = 0 < len(dec) < B
    if mla_mixed:
        i32 += [table[dec].ravel(), ctx[dec]]

    def span(rows) -> tuple[int, int] | None:
        rows = [int(r) for r in rows]
        return (rows[0], rows[-1] + 1) if rows and rows == list(range(rows[0], rows[-1] + 1)) else None

    meta = StepMeta(B, T, max_blocks, len(snaps), w1, [p.size for p in i64], [p.size for p in i32],
                    cu.tolist(), starts, lens, decode_form, snaps, pre,
                    max((lens[i] for i in pre), default=0), int(max((ctx[i] for i in pre), default=0)),
                    bool(np.array_equal(logit_rows, np.arange(T))), verify_seqs, mla_mixed=mla_mixed,
                    decode_span=span(cu[dec]), prefill_span=span(pre_rows))
    host = (torch.from_numpy(np.concatenate(i64).astype(np.int64)),
            torch.from_numpy(np.concatenate(i32).astype(np.int32)))
    return meta, host


def _random_seq(rng: random.Random, *, block_size: int, groups: int | None, kind: str) -> StepSeq:
    """kind: decode (one token), prefill (a chunk, maybe with snapshots, maybe unsampled) or verify."""
    # starts on, just before and just after page boundaries, and anywhere
    start = rng.choice([0, block_size - 1, block_size, 2 * block_size - 1, 2 * block_size,
                        rng.randrange(0, 4 * block_size)])
    n = {"decode": 1, "prefill": rng.randint(1, 3 * block_size), "verify": rng.randint(2, 5)}[kind]
    pages = [rng.randrange(1, 10_000) for _ in range(-(-(start + n) // block_size) + rng.randint(0, 2))]
    states = None if groups is None else [rng.randrange(1, 10_000) for _ in range(groups)]
    snaps = []
    if kind == "prefill" and groups is not None and rng.random() < 0.5:
        for p in sorted(rng.sample(range(start + 1, start + n + 1), min(n, rng.randint(1, 3)))):
            snaps.append((p, [rng.randrange(1, 10_000) for _ in range(groups)]))
    tokens = [rng.randrange(0, 150_000) for _ in range(n)]
    sampled = kind != "prefill" or rng.random() < 0.7
    return StepSeq(tokens, start, pages, states, sampled, snaps, verify=kind == "verify")


def _assert_same(seqs: list[StepSeq], **kw) -> StepMeta:
    want_meta, (want64, want32) = _pack_step_reference(seqs, **kw)
    meta, (h64, h32) = pack_step(seqs, **kw)
    # arrays added after the reference was written (it lists every array now): a new one must be empty in the
    # steps it describes
    extra = meta.sizes64[len(want_meta.sizes64):]
    assert extra == [0] * len(extra) and len(meta.sizes32) == len(want_meta.sizes32)
    assert meta == replace(want_meta, sizes64=want_meta.sizes64 + extra)
    assert [type(x) for x in meta.cu + meta.starts + meta.lens + meta.prefill_seqs + meta.verify_seqs] == [int] * (
        len(meta.cu) + len(meta.starts) + len(meta.lens) + len(meta.prefill_seqs) + len(meta.verify_seqs))
    assert type(meta.max_q) is int and type(meta.max_k) is int and type(meta.logits_every_row) is bool
    assert h64.dtype == torch.int64 and h32.dtype == torch.int32
    assert torch.equal(h64, want64) and torch.equal(h32, want32)
    return meta


@pytest.mark.parametrize("seed", range(12))
def test_decode_only_steps_equal_the_reference(seed) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([16, 64, 1888])
    groups = rng.choice([None, 1, 3])
    seqs = [_random_seq(rng, block_size=block_size, groups=groups, kind="decode") for _ in range(rng.randint(1, 300))]
    need = max(len(s.block_table) for s in seqs)
    num_groups = groups or 1
    pad = StepSeq([0], 0, [7], [7] * num_groups, True)  # the runner's graph padding row
    padded = seqs + [pad] * rng.randint(0, 40)
    for batch, max_blocks in ((seqs, None), (padded, need + rng.randint(0, 600))):
        meta = _assert_same(batch, block_size=block_size, conv_width=rng.choice([2, 4]), num_groups=num_groups,
                            max_blocks=max_blocks)
        assert all(meta.decode_form) and meta.logits_every_row


@pytest.mark.parametrize("seed", range(16))
def test_mixed_steps_equal_the_reference(seed) -> None:
    rng = random.Random(100 + seed)
    block_size = rng.choice([16, 64, 1888])
    groups = rng.choice([None, 1, 2, 3])
    kinds = rng.choices(["decode", "prefill", "verify"], weights=[5, 2, 1], k=rng.randint(1, 40))
    seqs = [_random_seq(rng, block_size=block_size, groups=groups, kind=k) for k in kinds]
    T = sum(len(s.token_ids) for s in seqs)
    extra = sorted(rng.sample(range(T), min(T, rng.randint(0, 5))))  # scored prompt rows
    _assert_same(seqs, block_size=block_size, conv_width=rng.choice([2, 3, 4]), num_groups=groups or 1,
                 max_blocks=rng.choice([None, 3 * block_size]), extra_logit_rows=extra)


def test_snapshot_rows_and_conv_windows_of_one_prefill() -> None:
    """One chunk of 40 tokens at position 30 with 16-token pages, snapshots at 32 and 70 (its end): the
    snapshot conv windows are the 3 rows before each position, the first one reaching into the old window."""
    seq = StepSeq(list(range(100, 140)), 30, [5, 6, 7, 8, 9], [11, 12], True, [(32, [21, 22]), (70, [31, 32])])
    meta = _assert_same([seq], block_size=16, conv_width=4, num_groups=2)
    assert meta.snapshots == [(0, 32, [21, 22]), (0, 70, [31, 32])] and meta.prefill_seqs == [0]
    assert meta.max_q == 40 and meta.max_k == 70


def test_more_pages_than_max_blocks_is_refused_by_name() -> None:
    seq = StepSeq([1], 40, [1, 2, 3], [4], True)
    with pytest.raises(ValueError, match="block_table: a sequence holds 3 pages, more than max_blocks=2"):
        pack_step([seq], block_size=16, conv_width=4, num_groups=1, max_blocks=2)
    with pytest.raises(ValueError, match="seqs: a step needs at least one sequence"):
        pack_step([], block_size=16, conv_width=4, num_groups=1)


def _views(packed):
    from k3rt.backend.runner.gpu.step import step_views

    meta, (h64, h32) = packed
    return step_views(meta, h64, h32)


@pytest.mark.parametrize("seed", range(8))
def test_a_split_step_packs_the_rest_as_a_step_of_its_own(seed) -> None:
    """kda_split: the plain decodes' rows and pages, and for the other sequences exactly the KDA arrays that
    packing those sequences alone gives (their ext, offsets, snapshots and verify runs renumbered among
    them); every other array is the unsplit step's. A step of one kind only is not split."""
    rng = random.Random(300 + seed)
    block_size, groups, width = rng.choice([16, 64]), rng.choice([1, 3]), rng.choice([2, 4])
    kinds = rng.choices(["decode", "prefill", "verify"], weights=[5, 2, 1], k=rng.randint(2, 30))
    kinds[rng.randrange(len(kinds))] = "decode"
    kinds[rng.randrange(len(kinds))] = "prefill"
    seqs = [_random_seq(rng, block_size=block_size, groups=groups, kind=k) for k in kinds]
    if rng.random() < 0.5:  # a one-token chunk with a snapshot is no plain decode
        seqs.append(StepSeq([5], 40, [3, 4, 5], [9] * groups, True, [(41, [8] * groups)]))
    kw = dict(block_size=block_size, conv_width=width, num_groups=groups)
    whole = _views(pack_step(seqs, **kw))
    step = _views(pack_step(seqs, kda_split=True, **kw))
    for name in ("ids", "pos", "kv_slot", "cu_seqlens", "ctx_lens", "block_table", "state_pages", "logit_rows",
                 "ctx_slot", "prefill_rows", "decode_seqs", "decode_rows"):
        assert torch.equal(getattr(step, name), getattr(whole, name)), name
    assert (step.snapshots, step.verify_seqs, step.cu) == (whole.snapshots, whole.verify_seqs, whole.cu)
    assert whole.kda_split is None
    plain = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1 and not s.snapshots and not s.verify]
    rest = [i for i in range(len(seqs)) if i not in plain]
    sp = step.kda_split
    assert sp.dec_rows.tolist() == [whole.cu[i] for i in plain]
    assert sp.dec_pages.tolist() == [[seqs[i].state_pages[g] for i in plain] for g in range(groups)]
    assert sp.rest_rows.tolist() == [r for i in rest for r in range(whole.cu[i], whole.cu[i + 1])]
    for span, rows in ((sp.dec_span, sp.dec_rows), (sp.rest_span, sp.rest_rows)):
        assert (span is not None) == (rows.tolist() == list(range(rows[0], rows[-1] + 1)))
        assert span is None or list(range(*span)) == rows.tolist()
    alone = _views(pack_step([seqs[i] for i in rest], **kw)).kda_rows
    got = sp.rest
    assert step.kda_rows is got and got.verify_inputs is step.verify_inputs
    for name in ("num_seqs", "cu", "starts", "lens", "snapshots", "verify_seqs"):
        assert getattr(got, name) == getattr(alone, name), name
    for name in ("cu_seqlens", "state_pages", "conv_idx", "conv_tail_idx", "snap_conv_idx", "snap_dest"):
        assert torch.equal(getattr(got, name), getattr(alone, name)), name
    only_decodes = [seqs[i] for i in plain]
    assert _views(pack_step(only_decodes, kda_split=True, **kw)).kda_split is None


def test_chunk_tables_are_packed_once_for_the_general_form() -> None:
    """Issue 18: with chunk_tables the step carries the chunked kernel's tables of the general form's sequences
    (a split step's rest), its snapshots both as copy slots (Bk + j) and as each group's destination pages; a
    snapshot position the kernel cannot take is refused by name here; a decode-only step packs none."""
    dec = StepSeq([5], 40, [3, 4, 5], [9, 10], True)
    chunk = StepSeq(list(range(130)), 0, [11, 12, 13, 14, 15], [16, 17], True, [(64, [20, 21]), (130, [22, 23])])
    verify = StepSeq([1, 2, 3], 70, [30, 31, 32, 33, 34], [35, 36], True, verify=True)
    kw = dict(block_size=32, conv_width=4, num_groups=2, kda_split=True)
    rows = _views(pack_step([dec, chunk, verify], chunk_tables=True, **kw)).kda_rows
    c = rows.chunk
    assert c.num_chunks == 4 and c.chunk_seq.tolist() == [0, 0, 0, 1] and c.chunk_idx.tolist() == [0, 1, 2, 0]
    assert c.chunk_off.tolist() == [0, 3] and c.init.tolist() == [1, 1] and rows.chunk_slots.tolist() == [0, 1]
    assert c.snap.tolist() == [2, -1, 3, -1]  # after chunk 0 (position 64) and after the last (130): slots Bk + j
    assert rows.chunk_snap_pages.tolist() == [[20, -1, 22, -1], [21, -1, 23, -1]]
    assert rows.live_seqs.tolist() == [0] and rows.verify_rows.tolist() == [130, 131, 132]
    assert _views(pack_step([dec, chunk, verify], **kw)).kda_rows.chunk is None
    assert _views(pack_step([dec, dec], chunk_tables=True, **kw)).kda_rows.chunk is None
    bad = StepSeq(list(range(130)), 0, [11, 12, 13, 14, 15], [16, 17], True, [(32, [20, 21])])
    with pytest.raises(ValueError, match="snapshot position must satisfy 0 < p <= T=130 and be a multiple of 64"):
        pack_step([dec, bad], chunk_tables=True, **kw)


def test_the_copy_forms_state_slots_have_the_in_place_forms_dtype() -> None:
    """Regression (session 21): the chunked KDA kernel got int64 slots from the in-place form (the state pages) and
    int32 slots from the copy form (chunk_slots: steps with a verify run), so a slot pointer of each dtype was a
    binary of its own; the speculative engine compiled `_kda_chunk_state_kernel` inside the H200 gate's measured
    runs (code, batch 16 and 64) at its first step that mixed a verify run with a prefill chunk. One dtype now (the
    Triton interpreter's launch keys showed the churn on the slot pointer: ('*i32', '') against ('*i64', ''))."""
    chunk = StepSeq(list(range(70)), 0, [11, 12, 13], [16, 17], True)
    verify = StepSeq([1, 2, 3], 70, [30, 31, 32, 33, 34], [35, 36], True, verify=True)
    kw = dict(block_size=32, conv_width=4, num_groups=2, chunk_tables=True)
    copy = _views(pack_step([chunk, verify], **kw)).kda_rows
    in_place = _views(pack_step([chunk], **kw)).kda_rows
    assert copy.live_seqs is not None and in_place.live_seqs is None  # the two forms kda._general takes
    assert copy.chunk_slots.tolist() == [0, 1]
    assert copy.chunk_slots.dtype == in_place.state_pages.dtype == torch.int64


def test_snapshot_and_new_windows_are_one_store_when_no_snapshot_reads_a_cached_row() -> None:
    """merge_stores (issue 18: one launch less per KDA layer in a prefill step with snapshots): the snapshot windows
    then the new windows, with their destination pages, when every snapshot window lies in the step's own rows;
    two stores (None here) when one reaches into the cached window that the new windows overwrite, or with a
    verify run (its form stores a subset). The one store writes exactly what the two wrote in order."""
    from k3rt.kernels.short_conv.ref import conv_windows_store

    dec = StepSeq([5], 40, [3, 4, 5], [9, 10], True)
    chunk = StepSeq(list(range(130)), 0, [11, 12, 13, 14, 15], [16, 17], True, [(64, [20, 21]), (130, [22, 23])])
    kw = dict(block_size=32, conv_width=4, num_groups=2)
    merged = _views(pack_step([dec, chunk], merge_stores=True, **kw)).kda_rows
    two = _views(pack_step([dec, chunk], **kw)).kda_rows
    assert two.store_idx is None and two.store_dest is None
    assert torch.equal(merged.store_idx, torch.cat([two.snap_conv_idx, two.conv_tail_idx]))
    assert torch.equal(merged.store_dest, torch.cat([two.snap_dest, two.state_pages], 1))
    assert merged.store_dest.tolist() == [[20, 22, 9, 16], [21, 23, 10, 17]]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(131, 6, generator=gen)
    for g in range(2):
        pages = two.state_pages[g]
        want = torch.randn(30, 3, 6, generator=gen)
        got = want.clone()
        conv_windows_store(x, want, pages, two.snap_conv_idx, two.snap_dest[g])
        conv_windows_store(x, want, pages, two.conv_tail_idx, pages)
        conv_windows_store(x, got, pages, merged.store_idx, merged.store_dest[g])
        assert torch.equal(got, want)
    # a chunk from position 62 with a snapshot at 64: that window's first row is a cached one -> two stores
    late = StepSeq(list(range(10)), 62, [11, 12, 13], [16, 17], True, [(64, [20, 21])])
    assert _views(pack_step([dec, late], merge_stores=True, **kw)).kda_rows.store_idx is None
    verify = StepSeq([1, 2, 3], 70, [30, 31, 32], [25, 26], True, verify=True)
    assert _views(pack_step([chunk, verify], merge_stores=True, **kw)).kda_rows.store_idx is None
    assert _views(pack_step([dec, dec], merge_stores=True, **kw)).kda_rows.store_idx is None  # no snapshot
    # a split step merges the rest's windows (the plain decode runs through the decode kernel)
    split = _views(pack_step([dec, chunk], merge_stores=True, kda_split=True, **kw)).kda_rows
    assert split.store_dest.tolist() == [[20, 22, 16], [21, 23, 17]]
