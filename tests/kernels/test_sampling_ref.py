"""The sampling oracle (kernels/sampling/ref.py) equals backend/sampling's semantics, and its seeded
draw has the distribution it claims (many seeds, chi-square bound)."""
from __future__ import annotations

import pytest
import torch

from k3rt.backend.sampling.bitmask import apply_token_bitmask
from k3rt.backend.sampling.penalties import apply_penalties
from k3rt.backend.sampling.ref import filter_logits as backend_row_filter
from k3rt.backend.sampling.sampler import filter_batch
from k3rt.kernels.sampling import filter_logits, process_logits, sampling_probs
from k3rt.kernels.sampling import ref
from k3rt.sampling_params import SamplingParams

NEG_INF = float("-inf")


def random_params(gen: torch.Generator, B: int) -> list[SamplingParams]:
    out = []
    for i in range(B):
        u = torch.rand(6, generator=gen).tolist()
        out.append(SamplingParams(
            temperature=0.0 if i % 5 == 0 else 0.3 + 1.5 * u[0], top_k=int(u[1] * 8), top_p=0.3 + 0.7 * u[2],
            min_p=0.2 * u[3] if i % 2 else 0.0, repetition_penalty=0.5 + u[4] if i % 3 else 1.0,
            frequency_penalty=4 * u[5] - 2 if i % 4 else 0.0, presence_penalty=1.5 - 3 * u[4] if i % 3 == 1 else 0.0))
    return out


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) over tokens with p > 0; any draw of a p == 0 token gives inf."""
    n = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return float("inf"), 0
    live = probs > 0
    expect = n * probs[live]
    return float(((counts[live] - expect) ** 2 / expect).sum()), int(live.sum()) - 1


def chi_square_bound(dof: int) -> float:
    """chi-square(dof) has mean dof and sd sqrt(2 dof); 6 sd above the mean is a ~1e-6 tail."""
    return dof + 6 * (2 * dof) ** 0.5 + 6


def test_process_logits_equals_backend_pipeline() -> None:
    gen = torch.Generator().manual_seed(21)
    B, V, S = 12, 70, 20
    params = random_params(gen, B)
    logits = torch.randn(B, V, generator=gen) * 3
    prompt_ids = [torch.randint(0, V, (int(torch.randint(0, 9, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(B)]
    output_ids = [torch.randint(0, V, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(B)]
    mask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=gen, dtype=torch.int32)
    mask[:, 0] |= 1  # every row keeps token 0 (the backend rejects rows with none)

    x = apply_token_bitmask(logits, mask)
    x = apply_penalties(x, params, prompt_ids, output_ids)
    expect = x / torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])[:, None]

    # the runner's device state: S persistent rows, batch row i lives in state row rows[i]
    rows = torch.randperm(S, generator=gen)[:B]
    prompt_mask = torch.zeros(S, V, dtype=torch.bool)
    output_counts = torch.zeros(S, V, dtype=torch.int32)
    for i in range(B):
        prompt_mask[rows[i], prompt_ids[i]] = True
        output_counts[rows[i]].index_put_((torch.tensor(output_ids[i], dtype=torch.long),),
                                          torch.ones(len(output_ids[i]), dtype=torch.int32), accumulate=True)
    got = process_logits(
        logits, torch.tensor([p.temperature for p in params]), allowed_mask=mask,
        repetition_penalty=torch.tensor([p.repetition_penalty for p in params]),
        frequency_penalty=torch.tensor([p.frequency_penalty for p in params]),
        presence_penalty=torch.tensor([p.presence_penalty for p in params]),
        prompt_mask=prompt_mask, output_counts=output_counts, penalty_rows=rows.int())
    assert torch.equal(got, expect)


def test_filter_equals_backend_batch_and_row_filters() -> None:
    gen = torch.Generator().manual_seed(22)
    B, V = 16, 40
    x = torch.randn(B, V, generator=gen) * 2
    x[3, ::3] = NEG_INF  # grammar-masked tokens
    top_k = torch.randint(0, 10, (B,), generator=gen, dtype=torch.int32)
    top_p = torch.rand(B, generator=gen) * 0.9 + 0.1
    top_p[::4] = 1.0
    min_p = torch.rand(B, generator=gen) * 0.3
    min_p[1::3] = 0.0
    got = filter_logits(x, top_k, top_p, min_p)
    assert torch.equal(got, filter_batch(x, top_k.long(), top_p, min_p))
    for b in range(B):
        p = SamplingParams(temperature=1.0, top_k=int(top_k[b]), top_p=float(top_p[b]), min_p=float(min_p[b]))
        assert torch.equal(got[b] > NEG_INF, backend_row_filter(x[b], p) > NEG_INF)
    assert bool(((got > NEG_INF).sum(-1) < (x > NEG_INF).sum(-1)).any())  # the case filters something


def test_top_p_keeps_every_token_tied_at_the_cut() -> None:
    x = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    # mass before the tied group is 0.4 < 0.5: the group is kept whole (backend keeps one of three)
    got = filter_logits(x, torch.zeros(1, dtype=torch.int32), torch.tensor([0.5]), torch.zeros(1))
    assert torch.equal(got > NEG_INF, torch.ones(1, 4, dtype=torch.bool))


def test_philox_known_answer() -> None:
    """Random123's published Philox4x32-10 vectors (kat_vectors), first output word."""
    import numpy as np

    u = np.uint64
    assert ref.philox4x32(np.array([0], u), u(0), u(0), u(0), u(0))[0] == 0x6627E8D5
    ones = u(0xFFFFFFFF)
    assert ref.philox4x32(np.array([0xFFFFFFFFFFFFFFFF], u), ones, ones, ones, ones)[0] == 0x408F276D
    key = np.array([(0x299F31D0 << 32) | 0xA4093822], u)
    assert ref.philox4x32(key, u(0x243F6A88), u(0x85A308D3), u(0x13198A2E), u(0x03707344))[0] == 0xD16CFE09


@pytest.mark.parametrize("case", ["plain", "top_k", "top_p", "min_p", "all"])
def test_seeded_draw_has_the_filtered_distribution(case: str) -> None:
    gen = torch.Generator().manual_seed(23)
    V, n = 12, 40000
    x = torch.randn(1, V, generator=gen) * 1.5
    knobs = {"plain": (0, 1.0, 0.0), "top_k": (4, 1.0, 0.0), "top_p": (0, 0.7, 0.0), "min_p": (0, 1.0, 0.15),
             "all": (6, 0.8, 0.05)}[case]
    one = lambda v, dt: torch.full((1,), v, dtype=dt)  # noqa: E731
    args = (one(0.8, torch.float32), one(knobs[0], torch.int32), one(knobs[1], torch.float32),
            one(knobs[2], torch.float32))
    xt = x / 0.8
    probs = sampling_probs(xt, *args)[0]
    kept = filter_logits(xt, *args[1:]) > NEG_INF
    seeds = torch.randint(0, 2**63 - 1, (n,), generator=gen)
    offsets = torch.randint(0, 2**40, (n,), generator=gen)
    tokens = ref.draw(xt.expand(n, V), kept.expand(n, V), args[0].expand(n), args[1].expand(n), seeds, offsets)
    counts = torch.bincount(tokens, minlength=V).double()
    stat, dof = chi_square(counts, probs.double())
    assert stat < chi_square_bound(dof), (stat, dof)
    # the bound has power: the unfiltered softmax (a filter left out) is rejected
    if case != "plain":
        wrong, dof = chi_square(counts, torch.softmax(xt[0], -1).double())
        assert wrong > chi_square_bound(dof)


def test_same_seed_same_token_greedy_ignores_seed() -> None:
    gen = torch.Generator().manual_seed(24)
    x = torch.randn(3, 30, generator=gen)
    kept = torch.ones(3, 30, dtype=torch.bool)
    temp, top_k = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 0], dtype=torch.int32)
    seeds, offsets = torch.tensor([5, 5, 5]), torch.tensor([9, 9, 9])
    a = ref.draw(x[[0, 0, 2]], kept, temp, top_k, seeds, offsets)
    assert a[0] == a[1] and a[2] == x[2].argmax()
    many = [int(ref.draw(x[:1], kept[:1], temp[:1], top_k[:1], torch.tensor([5]), torch.tensor([o]))[0])
            for o in range(20)]
    assert len(set(many)) > 3  # the offset moves the draw
