"""kernels/spec/triton_rounds.py: a device round's acceptance, window shift and step advance equal their torch
oracles (kernels/spec/ref.py: greedy_accept with accept_round's updates, shift_window, advance_step) exactly,
on batches that mix every case: drafts all accepted (with the bonus token), a mismatch, a stop id inside and past
the accepted run, a budget that ends the request, a request no longer live, kept 0 (the window stays), pad
sequences (advance leaves them put), a window without token ids.

Without a GPU the kernels run in the Triton interpreter (conftest.py).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.spec import round_accept, round_advance, round_shift  # noqa: E402
from k3rt.kernels.spec.ref import advance_step, greedy_accept, shift_window  # noqa: E402
from tests.kernels.helpers import DEV  # noqa: E402


def _accept_case(seed: int, S: int, R: int, P: int):
    g = torch.Generator().manual_seed(seed)
    fed = torch.randint(0, 6, (S, R), generator=g)
    am = torch.randint(0, 6, (S, R), generator=g)
    # plant accepted runs of every length: argmax row j equals the fed draft j + 1 for j < run
    for s in range(S):
        run = int(torch.randint(0, R, (1,), generator=g))
        am[s, :run] = fed[s, 1:run + 1]
    num_drafts = torch.randint(0, R, (S,), generator=g)
    stops = torch.full((S, P), -1, dtype=torch.int64)
    for s in range(S):
        n = int(torch.randint(0, P + 1, (1,), generator=g))
        stops[s, :n] = torch.randint(0, 6, (n,), generator=g)
    budget = torch.randint(-1, 2 * R, (S,), generator=g)
    live = (budget > 0) & (torch.rand(S, generator=g) < 0.85)
    anchors = torch.randint(100, 200, (S,), generator=g)
    return am, fed, num_drafts, stops, budget, live, anchors


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("S,R,P", [(1, 8, 1), (13, 8, 3), (9, 4, 16), (5, 1, 2)])
def test_round_accept_equals_greedy_accept_and_the_rounds_updates(seed: int, S: int, R: int, P: int) -> None:
    am, fed, nd, stops, budget, live, anchors = _accept_case(seed * 97 + S, S, R, P)
    kept, ended = greedy_accept(am, fed, nd, stops, budget, live)
    last = am.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0]
    want_anchor = torch.where(kept > 0, last, anchors)
    t = [x.to(DEV, copy=True) for x in (am, fed, nd, stops, budget, live, anchors)]
    got_kept = torch.full((S,), -7, dtype=torch.int64, device=DEV)
    round_accept(*t, got_kept)
    assert got_kept.cpu().tolist() == kept.tolist()
    assert t[6].cpu().tolist() == want_anchor.tolist()  # anchors
    assert t[4].cpu().tolist() == (budget - kept).tolist()  # budget
    assert t[5].cpu().tolist() == (live & ~ended).tolist()  # live


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "no_tokens"])
@pytest.mark.parametrize("S,W,R,F", [(3, 8, 4, 5), (4, 16, 8, 40), (2, 128, 8, 24)])
def test_round_shift_equals_shift_window(S: int, W: int, R: int, F: int, tokens: bool) -> None:
    g = torch.Generator().manual_seed(S * W + F)
    ctx = torch.randn(S, W, F, generator=g).to(torch.float16)
    tok = torch.randint(0, 1000, (S, W + 1), generator=g) if tokens else None
    valid = torch.rand(S, W, generator=g) < 0.7
    taps = torch.randn(S, R, F, generator=g)  # fp32 taps into an fp16 window: cast as the torch path does
    fed = torch.randint(0, 1000, (S, R), generator=g)
    kept = torch.tensor([0, R, 1, R - 1][:S] + [2] * max(0, S - 4))
    anchor = torch.randint(0, 1000, (S,), generator=g)
    want = [ctx.clone(), tok.clone() if tokens else None, valid.clone()]
    shift_window(want[0], want[1], want[2], taps, fed, kept, anchor)
    got = [x.to(DEV, copy=True) if x is not None else None for x in (ctx, tok, valid)]
    round_shift(got[0], got[1], got[2], taps.to(DEV), fed.to(DEV), kept.to(DEV), anchor.to(DEV))
    assert torch.equal(got[0].cpu(), want[0])
    assert torch.equal(got[2].cpu(), want[2])
    if tokens:
        assert torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("R", [8, 3])
def test_round_advance_equals_advance_step(R: int) -> None:
    S, bs, M = 5, 4, 12
    g = torch.Generator().manual_seed(R)
    ids = torch.randint(0, 50, (S, R), generator=g)
    start = torch.randint(0, 20, (S,), generator=g)
    pos = start[:, None] + torch.arange(R)[None, :]
    kv_slot = torch.randint(0, 99, (S, R), generator=g)
    ctx_lens = (start + 1).to(torch.int32)
    table = torch.randint(0, 60, (S, M), generator=g).to(torch.int32)
    kept = torch.tensor([R, 1, 0, 2, R])
    anchor = torch.randint(0, 50, (S,), generator=g)
    drafts = torch.randint(0, 50, (S, 7), generator=g)
    real = torch.tensor([True, True, True, True, False])
    limit = torch.tensor([99, 99, 99, int(start[3]) + 3, 99])  # sequence 3 feeds past its last position
    want = [ids.clone(), pos.clone(), kv_slot.clone(), ctx_lens.clone()]
    advance_step(*want, table, kept, anchor, drafts[:, :max(R - 1, 1)], bs, real, limit)
    got = [x.to(DEV, copy=True) for x in (ids, pos, kv_slot, ctx_lens)]
    nd = torch.full((S,), 5, dtype=torch.int64, device=DEV)
    round_advance(*got, table.to(DEV), kept.to(DEV), anchor.to(DEV), drafts.to(DEV), bs, real.to(DEV),
                  limit.to(DEV), nd)
    for name, w, x in zip(("ids", "pos", "kv_slot", "ctx_lens"), want, got):
        assert torch.equal(x.cpu(), w), name
    assert nd.cpu().tolist() == [R - 1] * 4 + [0]
