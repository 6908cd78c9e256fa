"""The packed-step short conv kernels (kernels/short_conv/triton_rows.py) against their torch references:
ragged sequences (shorter than the window, one token, longer), cached windows in a strided pool view (a page
apart, another dtype than the rows), snapshot windows stored before the sequences' new windows."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.short_conv import (  # noqa: E402
    causal_conv1d_rows,
    causal_conv1d_rows_fwd,
    conv_windows_store,
    conv_windows_store_fwd,
)
from tests.kernels.helpers import DEV, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")
W, C = 4, 40  # C not a multiple of the channel block


def _case(lens: list[int], x_dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 0):
    """(x, pool view [S, W-1, C] a page apart, slots, conv idx [T, W], tail idx [B, W-1]) as the GPU runner's
    pack_step builds them: rows of ext = [cached windows (B*(W-1)) ; x]."""
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


@pytest.mark.parametrize("x_dtype,state_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32)],
                         ids=["fp32", "fp16_rows_fp32_cache"])
def test_conv_rows_and_window_stores_match_ref(x_dtype, state_dtype) -> None:
    lens = [2, 1, 20, 3]
    x, pool, slots, idx, tail, w = _case(lens, x_dtype, state_dtype)
    want = causal_conv1d_rows(x, pool, slots, idx, w)
    got = causal_conv1d_rows_fwd(x, pool, slots, idx, w)
    assert got.dtype == x_dtype and rel_err(got, want) < (1e-6 if x_dtype == torch.float32 else 1e-3)
    # a snapshot window of sequence 0 after its first token (reads its cached rows) into page 1, then the new
    # windows in place: the references' stores, in the same order, are copies, so equal bit for bit
    snap_idx, snap_dest = tail[:1].clone(), torch.tensor([1], device=DEV)
    snap_idx[0] = torch.tensor([1, 2, 4 * (W - 1)])  # cached rows 1, 2 of sequence 0, then its first row
    ref_pool = pool.clone()
    for store, p in ((conv_windows_store, ref_pool), (conv_windows_store_fwd, pool)):
        store(x, p, slots, snap_idx, snap_dest)
        store(x, p, slots, tail, slots)
    assert torch.equal(pool, ref_pool)


def test_conv_rows_reject_bad_inputs() -> None:
    x, pool, slots, idx, tail, w = _case([3, 5], torch.float32, torch.float32)
    with pytest.raises(ValueError, match="idx must be contiguous int64"):
        causal_conv1d_rows_fwd(x, pool, slots, idx.int(), w)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d_rows_fwd(x, pool, slots, idx, w.half())
    with pytest.raises(ValueError, match="dest must be"):
        conv_windows_store_fwd(x, pool, slots, tail, slots[:1])
