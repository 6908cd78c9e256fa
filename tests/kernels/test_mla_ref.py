"""The MLA oracles (kernels/mla/ref.py) against naive loops and against the model's own attention.

`mla_absorbed` / `mla_expanded` (backend/models/mla.py) are what the reference model runs; these
tests show the kernels' contracts (absorbed query over a paged latent cache; expanded varlen
attention with a cached prefix) compute the same thing.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from k3rt.backend.models.mla import mla_absorbed, mla_expanded
from k3rt.kernels.mla.ref import gather_latents, mla_decode_ref, mla_prefill_ref
from tests.kernels.helpers import rel_err

H, L, R, P, V = 4, 32, 16, 16, 16
SCALE = (P + R) ** -0.5


def paged(latents: list[Tensor], block_size: int, gen: torch.Generator, spare_pages: int = 3):
    """Scatter per-sequence latents [S_i, L+R] into a shuffled page pool.

    Returns (kv_cache [num_pages, block_size, L+R], block_table [N, max_blocks] int32, seq_lens [N]).
    Unused pool slots and table entries hold garbage, so a kernel that reads them fails.
    """
    need = [max(1, math.ceil(x.shape[0] / block_size)) for x in latents]
    num_pages = sum(need) + spare_pages
    D = latents[0].shape[1]
    kv = torch.randn(num_pages, block_size, D, generator=gen) * 100
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.randint(0, num_pages, (len(latents), max(need) + 1), generator=gen, dtype=torch.int32)
    used = 0
    for n, x in enumerate(latents):
        pages = perm[used:used + need[n]]
        used += need[n]
        table[n, :need[n]] = pages.int()
        for p in range(x.shape[0]):
            kv[pages[p // block_size], p % block_size] = x[p]
    seq_lens = torch.tensor([x.shape[0] for x in latents], dtype=torch.int32)
    return kv, table, seq_lens


def absorb(q: Tensor, kv_b_weight: Tensor) -> tuple[Tensor, Tensor]:
    """([q_nope @ W_UK ; q_pe] [T, H, L+R], W_UV [H, V, L]) from q [T, H, P+R] (model-facts §5.2)."""
    w = kv_b_weight.view(H, P + V, L)
    w_uk, w_uv = w[:, :P], w[:, P:]
    q_lat = torch.einsum("thp,hpl->thl", q[..., :P], w_uk)
    return torch.cat([q_lat, q[..., P:]], dim=-1), w_uv


def expand(latent: Tensor, kv_b_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(k_nope [S, H, P], k_pe [S, R], v [S, H, V]) from latents [S, L+R], as the runner builds them."""
    kv = (latent[:, :L] @ kv_b_weight.t()).view(-1, H, P + V)
    return kv[..., :P], latent[:, L:], kv[..., P:]


def test_gather_latents_follows_the_block_table() -> None:
    gen = torch.Generator().manual_seed(1)
    lat = [torch.randn(s, L + R, generator=gen) for s in (1, 16, 37)]
    kv, table, seq_lens = paged(lat, 16, gen)
    for n, x in enumerate(lat):
        assert torch.equal(gather_latents(kv, table[n], int(seq_lens[n])), x)


def test_decode_ref_matches_token_loop() -> None:
    """Per (sequence, head): an explicit loop over tokens with a running max (no softmax call)."""
    gen = torch.Generator().manual_seed(2)
    lens = [1, 17, 48, 0]
    lat = [torch.randn(s, L + R, generator=gen) for s in lens]
    kv, table, seq_lens = paged([x if x.shape[0] else torch.randn(1, L + R) for x in lat], 16, gen)
    seq_lens[3] = 0  # padding row
    q = torch.randn(len(lens), H, L + R, generator=gen)
    out = mla_decode_ref(q, kv, table, seq_lens, 0.3, L)
    bs = kv.shape[1]
    for n, S in enumerate(lens):
        for h in range(H):
            m, den, acc = -math.inf, 0.0, torch.zeros(L, dtype=torch.float64)
            for p in range(S):
                e = kv[table[n, p // bs], p % bs].double()
                s = 0.3 * float(q[n, h].double() @ e)
                m_new = max(m, s)
                den = den * math.exp(m - m_new) + math.exp(s - m_new)
                acc = acc * math.exp(m - m_new) + math.exp(s - m_new) * e[:L]
                m = m_new
            if S:
                assert rel_err(out[n, h], acc / den) <= 1e-5
            else:
                assert torch.equal(out[n, h], torch.zeros(L))


@pytest.mark.parametrize("block_size", [16, 48])
def test_decode_ref_matches_model_absorbed_and_expanded(block_size: int) -> None:
    """Latent-space output lifted through W_UV equals mla_absorbed and mla_expanded for the last token."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 50, 97]
    lat = [torch.randn(s, L + R, generator=gen) for s in lens]
    kv_b = torch.randn(H * (P + V), L, generator=gen) * L**-0.5
    q = torch.randn(len(lens), H, P + R, generator=gen)
    kv, table, seq_lens = paged(lat, block_size, gen)
    q_abs, w_uv = absorb(q, kv_b)
    lat_out = mla_decode_ref(q_abs, kv, table, seq_lens, SCALE, L)  # [N, H, L]
    o = torch.einsum("nhl,hvl->nhv", lat_out, w_uv)
    for n, S in enumerate(lens):
        args = (q[n:n + 1], lat[n], kv_b, S - 1, P, R, V, SCALE)
        assert rel_err(o[n], mla_absorbed(*args)[0]) <= 1e-5
        assert rel_err(o[n], mla_expanded(*args)[0]) <= 1e-5


def prefill_case(lens: list[tuple[int, int]], gen: torch.Generator):
    """Per sequence (len_q, len_k): latents [len_k, L+R] and queries [len_q, H, P+R], packed."""
    kv_b = torch.randn(H * (P + V), L, generator=gen) * L**-0.5
    lat = [torch.randn(k, L + R, generator=gen) for _, k in lens]
    qs = [torch.randn(lq, H, P + R, generator=gen) for lq, _ in lens]
    parts = [expand(x, kv_b) for x in lat]
    k_nope, k_pe, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    cu_q = torch.tensor([0, *torch.tensor([lq for lq, _ in lens]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([lk for _, lk in lens]).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=torch.cat(qs), k_nope=k_nope, k_pe=k_pe, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lq for lq, _ in lens), max_seqlen_k=max(lk for _, lk in lens)), lat, qs, kv_b


def test_prefill_ref_matches_model_expanded() -> None:
    gen = torch.Generator().manual_seed(4)
    lens = [(1, 1), (5, 5), (3, 40), (1, 33), (0, 7), (20, 21)]
    case, lat, qs, kv_b = prefill_case(lens, gen)
    out = mla_prefill_ref(**case, scale=SCALE)
    cu = case["cu_seqlens_q"].tolist()
    for i, (lq, lk) in enumerate(lens):
        if lq == 0:
            continue
        want = mla_expanded(qs[i], lat[i], kv_b, lk - lq, P, R, V, SCALE)
        assert rel_err(out[cu[i]:cu[i + 1]], want) <= 1e-5, i


def test_prefill_ref_matches_query_loop() -> None:
    """Per query: softmax over exactly the keys at positions <= its own, written out by hand."""
    gen = torch.Generator().manual_seed(5)
    lens = [(4, 9), (3, 3)]
    case, *_ = prefill_case(lens, gen)
    out = mla_prefill_ref(**case, scale=0.25)
    cq, ck = case["cu_seqlens_q"].tolist(), case["cu_seqlens_k"].tolist()
    for i, (lq, lk) in enumerate(lens):
        for j in range(lq):
            t, keys = cq[i] + j, range(ck[i], ck[i] + lk - lq + j + 1)
            for h in range(H):
                s = torch.stack([case["q"][t, h, :P] @ case["k_nope"][k, h] + case["q"][t, h, P:] @ case["k_pe"][k]
                                 for k in keys]) * 0.25
                w = torch.exp(s - s.max())
                want = sum(w[a] * case["v"][k, h] for a, k in enumerate(keys)) / w.sum()
                assert rel_err(out[t, h], want) <= 1e-5


def test_prefill_ref_rejects_more_queries_than_keys() -> None:
    gen = torch.Generator().manual_seed(6)
    case, *_ = prefill_case([(3, 3)], gen)
    case["cu_seqlens_k"] = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="len_q=3, len_k=2"):
        mla_prefill_ref(**{**case, "k_nope": case["k_nope"][:2], "k_pe": case["k_pe"][:2], "v": case["v"][:2]},
                        scale=SCALE)
