"""The chunked KDA form's row kernels against their torch references: `kda_chunk_prep` (the short conv over
row-index windows with SiLU, the gate and beta, one launch) and `conv_windows_store_fwd` (new and snapshot conv
windows into the cache). Ragged sequences (shorter than the window, one token, longer), cached windows in a
strided pool view (a page apart, another dtype than the rows), column views of a wider projection, a steep f
that crosses the softplus threshold, snapshot windows stored before the sequences' new windows."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.kda import kda_chunk_prep, kda_gate_lower_bound, kda_gate_softplus  # noqa: E402
from k3rt.kernels.short_conv import causal_conv1d_rows, conv_windows_store, conv_windows_store_fwd  # noqa: E402
from tests.kernels.helpers import DEV, rel_err, run_benchmark_smoke  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")
W, H, D = 4, 3, 32
C = 3 * H * D + 8  # the conv's channels: two column blocks (the interpreter's 256), the second partial


def _case(lens: list[int], x_dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 0, C: int = C):
    """(x, pool view [S, W-1, C] a page apart, slots, conv idx [T, W], tail idx [B, W-1], weight) as the GPU
    runner's pack_step builds them: rows of ext = [cached windows (B*(W-1)) ; x]."""
    g = torch.Generator().manual_seed(seed)
    B, T, w1 = len(lens), sum(lens), W - 1
    pages = torch.randn(9, w1 * C + 13, generator=g).to(state_dtype)  # a page is wider than the window
    pool = pages[:, :w1 * C].view(9, w1, C)
    slots = torch.tensor([7, 2, 5, 0][:B], dtype=torch.int64)
    x = torch.randn(T, C + 6, generator=g).to(x_dtype)[:, 3:C + 3]  # a column view: row stride C + 6
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]

    def row(i: int, rel: int) -> int:  # rel < 0: the cached window of sequence i
        return i * w1 + rel + w1 if rel < 0 else B * w1 + cu[i] + rel

    idx = torch.tensor([[row(i, r - w1 + t) for t in range(W)] for i, n in enumerate(lens) for r in range(n)])
    tail = torch.tensor([[row(i, n - w1 + t) for t in range(w1)] for i, n in enumerate(lens)])
    return x.to(DEV), pool.to(DEV), slots.to(DEV), idx.to(DEV), tail.to(DEV), torch.randn(C, W, generator=g).to(DEV)


def _gate_case(T: int, kind: str, dtype: torch.dtype, H: int = H, D: int = D):
    g = torch.Generator().manual_seed(2)
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=g)) if kind == "softplus" else torch.zeros(H)
    dt = torch.exp(torch.empty(H * D).uniform_(math.log(1e-3), math.log(0.1), generator=g))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    proj = (torch.randn(T, H * D + H + 7, generator=g) * 8).to(dtype)  # |f| up to ~30: both softplus branches
    return proj[:, :H * D], proj[:, H * D:H * D + H], A_log, dt_bias


@pytest.mark.parametrize("kind", ["softplus", "lower_bound"])
@pytest.mark.parametrize("x_dtype,state_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32)],
                         ids=["fp32", "fp16_rows_fp32_cache"])
def test_chunk_prep_matches_refs(kind, x_dtype, state_dtype) -> None:
    lens = [2, 1, 20, 3]
    _check_prep(lens, kind, x_dtype, state_dtype, H, D, tol=1e-6 if x_dtype == torch.float32 else 1e-3)


def _check_prep(lens: list[int], kind: str, x_dtype, state_dtype, H: int, D: int, tol: float,
                one_seq: bool = False) -> None:
    x, pool, slots, idx, _, w = _case(lens, x_dtype, state_dtype, C=3 * H * D)
    f, b, A_log, dt_bias = _gate_case(sum(lens), kind, x_dtype, H, D)
    lb = -5.0 if kind == "lower_bound" else None
    pool0 = pool.clone()
    y, g, beta = kda_chunk_prep(x, pool, slots, idx, w, f.to(DEV), A_log.to(DEV), dt_bias.to(DEV), b.to(DEV), lb,
                                one_seq=one_seq)
    assert torch.equal(pool, pool0)  # the cached windows are only read
    want = causal_conv1d_rows(x, pool, slots, idx, w)
    assert y.dtype == x_dtype and rel_err(y, want) < tol
    fh, dth = f.view(-1, H, D), dt_bias.view(H, D)
    g_ref = kda_gate_softplus(fh, A_log, dth) if lb is None else kda_gate_lower_bound(fh, A_log, dth, lb)
    assert g.shape == (sum(lens), H, D) and g.dtype == beta.dtype == torch.float32
    assert rel_err(g.cpu(), g_ref) < 1e-6 and rel_err(beta.cpu(), torch.sigmoid(b.float())) < 1e-6


@pytest.mark.parametrize("n,block_t", [(1, None), (3, None), (20, 16), (150, 16), (150, None)])
def test_one_sequence_path_equals_the_indexed_one(n: int, block_t: int | None) -> None:
    """`one_seq`: the taps' rows computed, not loaded, and read straight from x past the first W-1 rows: the same
    bits as the indexed path and the references, for a step shorter than the window and for several row blocks
    (the first one reads the cached window)."""
    x, pool, slots, idx, _, w = _case([n], torch.float16, torch.float32, seed=n)
    f, b, A_log, dt_bias = (t.to(DEV) for t in _gate_case(n, "softplus", torch.float16))
    got = kda_chunk_prep(x, pool, slots, idx, w, f, A_log, dt_bias, b, one_seq=True, block_t=block_t)
    base = kda_chunk_prep(x, pool, slots, idx, w, f, A_log, dt_bias, b, block_t=block_t)
    for a, e in zip(got, base):
        assert torch.equal(a, e)
    assert rel_err(got[0], causal_conv1d_rows(x, pool, slots, idx, w)) < 1e-3
    x2, pool2, slots2, idx2, _, w2 = _case([2, 3], torch.float32, torch.float32)
    f2, b2, A2, dt2 = (t.to(DEV) for t in _gate_case(5, "softplus", torch.float32))
    with pytest.raises(ValueError, match="one_seq needs slots to hold one"):
        kda_chunk_prep(x2, pool2, slots2, idx2, w2, f2, A2, dt2, b2, one_seq=True)


def test_row_blocks_of_natural_windows_read_x_directly_and_others_the_indices() -> None:
    """Several sequences, 16-row blocks: a block whose every row's window is its natural one inside the step's rows
    takes the taps straight from x, the others (a sequence's first W-1 rows, its cached window) through conv_idx;
    the reference's values either way. A window that differs from the natural one in any tap (here the third of
    a row in the middle of a long sequence) keeps its block on the indices: the check is over all W taps."""
    lens = [40, 3, 70]
    x, pool, slots, idx, _, w = _case(lens, torch.float32, torch.float32, seed=5)
    f, b, A_log, dt_bias = (t.to(DEV) for t in _gate_case(sum(lens), "softplus", torch.float32))
    for odd in (False, True):
        if odd:
            idx = idx.clone()
            idx[60, 2] = idx[10, 1]  # row 60 (sequence 2, block 3: otherwise natural) reads another row there
        y, _, _ = kda_chunk_prep(x, pool, slots, idx, w, f, A_log, dt_bias, b, block_t=16)
        assert rel_err(y, causal_conv1d_rows(x, pool, slots, idx, w)) < 1e-6, odd


def test_benchmark_smoke(tmp_path) -> None:
    """benchmarks/kda_prep.py --smoke runs on the CPU interpreter (one sequence, its one_seq tiles, several
    sequences) and every variant passes its check."""
    rows = run_benchmark_smoke("kda_prep.py", tmp_path / "kda_prep.json")["rows"]
    assert [r["variant"] for r in rows] == ["indexed", "one_seq 16x128w4", "indexed, 3 sequences"]
    assert all(r["equal"] for r in rows), rows


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["softplus", "lower_bound"])
def test_gpu_chunk_prep_kimi_shape(kind) -> None:
    """The compiled kernel at the 48B head (H=32, D=128: 96 conv column blocks, 32 gate blocks), bf16 rows and
    cache, a 200-token chunk beside short sequences."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check_prep([200, 1, 2, 5], kind, torch.bfloat16, torch.bfloat16, 32, 128, tol=1e-2)
    _check_prep([300], kind, torch.bfloat16, torch.bfloat16, 32, 128, tol=1e-2, one_seq=True)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16_rows_fp32_cache"])
def test_window_stores_match_ref(x_dtype) -> None:
    """A snapshot window of sequence 0 after its first token (reads its cached rows) into page 1, then the new
    windows in place: the references' stores, in the same order, are copies, so equal bit for bit."""
    x, pool, slots, idx, tail, w = _case([2, 1, 20, 3], x_dtype, torch.float32)
    snap_idx, snap_dest = tail[:1].clone(), torch.tensor([1], device=DEV)
    snap_idx[0] = torch.tensor([1, 2, 4 * (W - 1)])  # cached rows 1, 2 of sequence 0, then its first row
    ref_pool = pool.clone()
    for store, p in ((conv_windows_store, ref_pool), (conv_windows_store_fwd, pool)):
        store(x, p, slots, snap_idx, snap_dest)
        store(x, p, slots, tail, slots)
    assert torch.equal(pool, ref_pool)


def test_row_kernels_reject_bad_inputs() -> None:
    x, pool, slots, idx, tail, w = _case([3, 5], torch.float32, torch.float32)
    f, b, A_log, dt_bias = (t.to(DEV) for t in _gate_case(8, "softplus", torch.float32))
    with pytest.raises(ValueError, match="conv_idx must be contiguous int64"):
        kda_chunk_prep(x, pool, slots, idx.int(), w, f, A_log, dt_bias, b)
    with pytest.raises(ValueError, match="conv_weight must be"):
        kda_chunk_prep(x, pool, slots, idx, w.half(), f, A_log, dt_bias, b)
    with pytest.raises(ValueError, match="b must be"):
        kda_chunk_prep(x, pool, slots, idx, w, f, A_log, dt_bias, b[:, :2])
    with pytest.raises(ValueError, match="dest must be"):
        conv_windows_store_fwd(x, pool, slots, tail, slots[:1])
