"""The Triton sampler agrees with kernels/sampling/ref.py: processed logits bit for bit, greedy rows
exactly (ties to the lowest index), seeded draws token for token with ref.draw (same philox noise).

Without a GPU the kernels run in the Triton interpreter (set by conftest.py, before Triton is
imported), at tiny vocabularies. The `gpu` cases run B=64, V=163840 with bf16-valued logits.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.kernels import common  # noqa: E402
from k3rt.kernels.sampling import filter_logits, filter_thresholds, process_logits, sample  # noqa: E402
from k3rt.kernels.sampling import ref  # noqa: E402
from k3rt.kernels.sampling.triton_sample import launch_sample_fwd  # noqa: E402
from tests.kernels.helpers import DEV  # noqa: E402

NEG_INF = float("-inf")

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py


def batch(seed: int, B: int, V: int, *, penalties: bool = True, mask: bool = True, S: int | None = None) -> dict:
    """Random per-row sampling inputs on DEV: every stage on, greedy rows (temperature 0, top_k 1) mixed in."""
    gen = torch.Generator().manual_seed(seed)
    S = S or B + 3
    temperature = torch.rand(B, generator=gen) * 1.5 + 0.3
    temperature[::5] = 0.0
    top_k = torch.randint(0, 9, (B,), generator=gen, dtype=torch.int32)
    top_k[3::7] = 1
    top_p = torch.rand(B, generator=gen) * 0.8 + 0.2
    top_p[::3] = 1.0
    min_p = torch.rand(B, generator=gen) * 0.2
    min_p[1::2] = 0.0
    d = dict(logits=torch.randn(B, V, generator=gen) * 2, temperature=temperature, top_k=top_k, top_p=top_p,
             min_p=min_p, seeds=torch.randint(0, 2**63 - 1, (B,), generator=gen),
             offsets=torch.randint(0, 2**40, (B,), generator=gen))
    if mask:
        m = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=gen, dtype=torch.int32)
        d["allowed_mask"] = m | 0x11  # every row keeps tokens 0 and 4
    if penalties:
        d.update(repetition_penalty=torch.rand(B, generator=gen) + 0.5,
                 frequency_penalty=torch.rand(B, generator=gen) * 4 - 2,
                 presence_penalty=torch.rand(B, generator=gen) * 4 - 2,
                 prompt_mask=torch.rand(S, V, generator=gen) < 0.2,
                 output_counts=torch.randint(0, 4, (S, V), generator=gen, dtype=torch.int32)
                 * (torch.rand(S, V, generator=gen) < 0.2),
                 penalty_rows=torch.randperm(S, generator=gen)[:B].to(torch.int32))
        d["repetition_penalty"][::4] = 1.0
    return {k: v.to(DEV) for k, v in d.items()}


def expected(d: dict) -> tuple[Tensor, Tensor]:
    """(processed logits, tokens) from the oracle."""
    pen = {k: d[k] for k in ("allowed_mask", "repetition_penalty", "frequency_penalty", "presence_penalty",
                             "prompt_mask", "output_counts", "penalty_rows") if k in d}
    x = process_logits(d["logits"], d["temperature"], **pen)
    kept = filter_logits(x, d["top_k"], d["top_p"], d["min_p"]) > NEG_INF
    return x, ref.draw(x, kept, d["temperature"], d["top_k"], d["seeds"], d["offsets"])


def test_process_pass_is_bit_exact() -> None:
    d = batch(1, 6, 70)
    B, V = d["logits"].shape
    x = common.poison_like(torch.empty(B, V, device=DEV))
    pen = tuple(d[k] for k in ("repetition_penalty", "frequency_penalty", "presence_penalty", "prompt_mask",
                               "output_counts"))
    launch_sample_fwd(d["logits"], x, d["temperature"], d["top_k"], allowed_mask=d["allowed_mask"], penalties=pen,
                      penalty_rows=d["penalty_rows"], seeds=d["seeds"], offsets=d["offsets"], threshold=None,
                      best=None, lse=None, process=True, block_v=32, use_pdl=False)
    assert torch.equal(x, expected(d)[0])


@pytest.mark.parametrize("block_v", [32, 64])
def test_tokens_and_logprobs_match_ref(block_v: int) -> None:
    d = batch(2, 15, 50)
    x, tokens = expected(d)
    r = sample(**d, num_logprobs=3, block_v=block_v)
    assert r.token_ids.dtype == torch.int64 and torch.equal(r.token_ids, tokens)
    chosen, values, ids = ref.logprobs(x, tokens, 3)
    assert torch.allclose(r.logprobs, chosen, rtol=1e-5, atol=1e-5)
    assert torch.allclose(r.top_logprobs, values, rtol=1e-5, atol=1e-5) and torch.equal(r.top_ids, ids)


def test_greedy_ties_go_to_the_lowest_index_across_slices() -> None:
    gen = torch.Generator().manual_seed(3)
    B, V = 6, 100
    logits = torch.randint(0, 3, (B, V), generator=gen).float().to(DEV)  # ~33 tokens tie at the max
    logits[1, 70] = 5.0  # a unique max in a late slice
    temperature = torch.tensor([0.0, 0.0, 0.0, 0.7, 1.3, 0.0], device=DEV)
    top_k = torch.tensor([0, 5, 0, 1, 1, 0], dtype=torch.int32, device=DEV)
    ones = torch.ones(B, device=DEV)
    zeros = torch.zeros(B, device=DEV)
    seeds = torch.arange(B, device=DEV)
    out = torch.empty(B, dtype=torch.int64, device=DEV)
    r = sample(logits, temperature, top_k, ones, zeros, seeds, seeds, out=out, block_v=32)
    assert r.token_ids is out
    assert torch.equal(out, logits.argmax(-1))


def test_unfiltered_path_and_batch_composition() -> None:
    """apply_filters=False equals the filtered path on rows that filter nothing; a row's token does
    not depend on the rows around it."""
    d = batch(4, 8, 40, penalties=False)
    d["top_k"].zero_()
    d["top_p"].fill_(1.0)
    d["min_p"].zero_()
    a = sample(**d, block_v=32).token_ids
    b = sample(**d, apply_filters=False, block_v=32).token_ids
    assert torch.equal(a, b) and torch.equal(a, expected(d)[1])
    perm = torch.tensor([5, 2, 7], device=DEV)
    sub = {k: v[perm] for k, v in d.items()}
    assert torch.equal(sample(**sub, apply_filters=False, block_v=32).token_ids, a[perm])
    moved = dict(d, offsets=d["offsets"] + 1)
    assert not torch.equal(sample(**moved, apply_filters=False, block_v=32).token_ids, a)


def test_filter_thresholds_equal_ref_filter() -> None:
    gen = torch.Generator().manual_seed(5)
    B, V = 20, 64
    x = torch.randn(B, V, generator=gen) * 2
    x[2, 5:] = NEG_INF
    x[4, :] = torch.randint(0, 4, (V,), generator=gen).float()  # heavy ties
    top_k = torch.randint(0, 12, (B,), generator=gen, dtype=torch.int32)
    top_p = torch.rand(B, generator=gen) * 0.9 + 0.1
    min_p = torch.rand(B, generator=gen) * 0.3
    greedy = torch.zeros(B, dtype=torch.bool)
    thr = filter_thresholds(x, top_k, top_p, min_p, greedy)
    assert torch.equal(x >= thr[:, None], filter_logits(x, top_k, top_p, min_p) > NEG_INF)


def test_contract_errors() -> None:
    d = batch(6, 3, 40)
    with pytest.raises(ValueError, match="logits must be fp32"):
        sample(**dict(d, logits=d["logits"].half()))
    with pytest.raises(ValueError, match="top_k must be"):
        sample(**dict(d, top_k=d["top_k"].long()))
    with pytest.raises(ValueError, match="seeds must be"):
        sample(**dict(d, seeds=d["seeds"][:2]))
    with pytest.raises(ValueError, match="allowed_mask must be"):
        sample(**dict(d, allowed_mask=d["allowed_mask"][:, :1].contiguous()))
    with pytest.raises(ValueError, match="given together"):
        sample(**{k: v for k, v in d.items() if k != "presence_penalty"})
    with pytest.raises(ValueError, match="output_counts must be"):
        sample(**dict(d, output_counts=d["output_counts"].long()))
    with pytest.raises(ValueError, match="S >= B"):
        sample(**{k: (v[:2] if k in ("prompt_mask", "output_counts") else v) for k, v in d.items()
                  if k != "penalty_rows"})
    with pytest.raises(ValueError, match="num_logprobs"):
        sample(**d, num_logprobs=41)
    with pytest.raises(ValueError, match="block_v"):
        sample(**d, block_v=48)


def gpu_batch(seed: int, B: int = 64, V: int = 163840) -> dict:
    d = batch(seed, B, V, S=B + 16)
    # lm_head output is bf16: its fp32 logits carry many exact ties
    d["logits"] = (d["logits"] * 2).bfloat16().float()
    return d


@pytest.mark.gpu
def test_gpu_kimi_vocab_matches_ref() -> None:
    d = gpu_batch(7)
    x, tokens = expected(d)
    r = sample(**d, num_logprobs=5)
    greedy = ref.is_greedy(d["temperature"], d["top_k"])
    assert torch.equal(r.token_ids[greedy], x.argmax(-1)[greedy])
    # the GPU's fast logs may flip a near tie of two Gumbel scores; the kept set may not be left
    kept = filter_logits(x, d["top_k"], d["top_p"], d["min_p"]) > NEG_INF
    assert bool(kept.gather(1, r.token_ids[:, None]).all())
    assert (r.token_ids == tokens).float().mean() >= 0.95
    chosen, values, _ = ref.logprobs(x, r.token_ids, 5)
    assert torch.allclose(r.logprobs, chosen, rtol=1e-4, atol=1e-4)
    assert torch.allclose(r.top_logprobs, values, rtol=1e-4, atol=1e-4)
    again = sample(**d, num_logprobs=5)
    assert torch.equal(again.token_ids, r.token_ids)


@pytest.mark.gpu
def test_gpu_distribution_at_kimi_vocab() -> None:
    """4096 draws of one row over V=163840 (16 live tokens, the rest at -30): chi-square vs the oracle."""
    B, V, live = 64, 163840, 16
    gen = torch.Generator().manual_seed(8)
    logits = torch.full((V,), -30.0)
    ids = torch.randperm(V, generator=gen)[:live]
    logits[ids] = torch.randn(live, generator=gen) * 1.5
    temperature = torch.full((B,), 0.9, device=DEV)
    top_k = torch.full((B,), 10, dtype=torch.int32, device=DEV)
    top_p = torch.full((B,), 0.85, device=DEV)
    min_p = torch.full((B,), 0.02, device=DEV)
    x = (logits / 0.9)[None].to(DEV)
    probs = ref.sampling_probs(x, temperature[:1], top_k[:1], top_p[:1], min_p[:1])[0].double()
    counts = torch.zeros(V, dtype=torch.float64, device=DEV)
    lg = logits[None].expand(B, V).contiguous().to(DEV)
    seeds = torch.randint(0, 2**62, (B,), generator=gen).to(DEV)
    for step in range(64):
        offsets = torch.full((B,), step, dtype=torch.int64, device=DEV)
        t = sample(lg, temperature, top_k, top_p, min_p, seeds, offsets).token_ids
        counts += torch.bincount(t, minlength=V).double()
    assert float(counts[probs == 0].sum()) == 0.0
    livep = probs > 0
    expect = counts.sum() * probs[livep]
    stat, dof = float(((counts[livep] - expect) ** 2 / expect).sum()), int(livep.sum()) - 1
    assert stat < dof + 6 * math.sqrt(2 * dof) + 6, (stat, dof)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay() -> None:
    d = gpu_batch(9)
    out = torch.empty(64, dtype=torch.int64, device=DEV)
    eager = sample(**d).token_ids.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sample(**d, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(**d, out=out, use_pdl=True)
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    d["offsets"] += 1  # new inputs in the captured buffers: the replay follows them
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, sample(**d).token_ids)
