"""The batched sampler: greedy, seeded reproducibility, top-k / top-p / min-p kept sets, penalties,
grammar bitmasks, logprobs, and the sampled distribution itself. CPU, seeded, hand-built inputs."""

from __future__ import annotations

import math

import pytest
import torch

from k3rt.backend.sampling import Sampler, apply_token_bitmask, make_generator, sample, unpack_token_bitmask
from k3rt.backend.sampling.penalties import apply_penalties
from k3rt.backend.sampling.ref import filter_logits
from k3rt.backend.sampling.sampler import filter_batch
from k3rt.sampling_params import SamplingParams

V = 50
NEG_INF = float("-inf")


def _run(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
         prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None,
         allowed_mask: torch.Tensor | None = None):
    b = logits.shape[0]
    return Sampler(logits.shape[1], "cpu").sample_batch(
        logits, params, generators or [None] * b, prompt_ids or [[]] * b, output_ids or [[]] * b, allowed_mask)


def _filter(logits: torch.Tensor, top_k: list[int] | None = None, top_p: list[float] | None = None,
            min_p: list[float] | None = None) -> torch.Tensor:
    b = logits.shape[0]
    return filter_batch(logits, torch.tensor(top_k or [0] * b), torch.tensor(top_p or [1.0] * b),
                        torch.tensor(min_p or [0.0] * b))


def _kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """allowed: [B, V] bool -> [B, ceil(V/32)] int32, bit t%32 of word t//32 (the python-loop oracle)."""
    b, v = allowed.shape
    words = [[0] * ((v + 31) // 32) for _ in range(b)]
    for r in range(b):
        for t in range(v):
            if allowed[r, t]:
                words[r][t // 32] |= 1 << (t % 32)
    # reinterpret as signed int32 (bit 31 set -> negative)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


@pytest.mark.parametrize("greedy", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1),
                                    SamplingParams(temperature=0.0, top_p=0.5, repetition_penalty=1.0)],
                         ids=["temperature0", "top_k1", "temperature0_top_p"])
def test_greedy_is_argmax_and_draws_no_random_numbers(greedy: SamplingParams) -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    gens = [make_generator(s) for s in (1, 2, 3)] + [None, None, None]
    states = [g.get_state() for g in gens[:3]]
    out = _run(logits, [greedy] * 6, gens)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens[:3], states))
    # seeds don't matter, and sampled neighbours don't move the greedy rows
    mixed = [greedy, SamplingParams(temperature=1.0, seed=5)] * 3
    other = _run(logits, mixed, [make_generator(9), make_generator(5)] * 3)
    assert other.token_ids[0::2] == out.token_ids[0::2]


def _request_logits(request: int, step: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(1000 * request + step)) * 2


REQUESTS = {  # request id -> params; 0 is the seeded request under test
    0: SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=7),
    1: SamplingParams(temperature=1.0),
    2: SamplingParams(temperature=0.0),
    3: SamplingParams(temperature=1.3, min_p=0.02, seed=8),
    4: SamplingParams(temperature=1.0, seed=7, presence_penalty=0.5),
}


@pytest.mark.parametrize("batch", [[0], [1, 0], [0, 2, 3], [3, 2, 1, 0], [4, 0, 1]],
                         ids=["alone", "after_unseeded", "with_greedy_and_seeded", "last_of_four", "beside_same_seed"])
def test_seeded_row_is_independent_of_batch_composition(batch: list[int]) -> None:
    def tokens_of_request_0(requests: list[int]) -> list[int]:
        gens = {r: make_generator(REQUESTS[r].seed) for r in requests}
        outputs: dict[int, list[int]] = {r: [] for r in requests}
        for step in range(8):
            logits = torch.stack([_request_logits(r, step) for r in requests])
            out = _run(logits, [REQUESTS[r] for r in requests], [gens[r] for r in requests],
                       [[1, 2, 3]] * len(requests), [outputs[r] for r in requests])
            for r, t in zip(requests, out.token_ids):
                outputs[r].append(t)
        return outputs[0]

    torch.manual_seed(123)  # unseeded neighbours draw from here
    want = tokens_of_request_0([0])
    assert tokens_of_request_0(batch) == want
    assert len(set(want)) > 1  # it really sampled


def test_different_seeds_give_different_tokens() -> None:
    def five_tokens(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [_run(torch.zeros(1, 1000), [SamplingParams(seed=seed)], [gen]).token_ids[0] for _ in range(5)]

    assert five_tokens(1) == five_tokens(1) != five_tokens(2)


# probabilities 0.4 0.3 0.2 0.06 0.04, stored out of order; the masses before each (sorted) token are
# 0, 0.4, 0.7, 0.9, 0.96
TOP_P_PROBS = [0.06, 0.3, 0.04, 0.4, 0.2]


@pytest.mark.parametrize("top_p,kept", [(0.3, {3}), (0.4, {3}), (0.5, {3, 1}), (0.65, {3, 1}), (0.8, {3, 1, 4}),
                                        (0.95, {3, 1, 4, 0}), (0.99, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})],
                         ids=["p0.3", "p0.4", "p0.5", "p0.65", "p0.8", "p0.95", "p0.99", "p1"])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    logits = torch.tensor(TOP_P_PROBS).log()
    # the row under test sits between rows with other settings that must not leak into it
    batch = torch.stack([logits, logits, logits])
    out = _filter(batch, top_p=[0.5, top_p, 1.0], top_k=[0, 0, 2])
    assert _kept(out[1]) == kept
    assert _kept(out[0]) == {3, 1} and _kept(out[2]) == {3, 1}
    assert torch.equal(out[1][list(kept)], logits[list(kept)])


@pytest.mark.parametrize("top_k,kept", [(1, {2}), (2, {2, 0, 4}), (3, {2, 0, 4}), (4, {2, 0, 4, 3}), (5, {0, 1, 2, 3, 4}), (0, {0, 1, 2, 3, 4})],
                         ids=["k1", "k2_tie", "k3_tie", "k4", "k5_all", "off"])
def test_top_k_keeps_k_largest_and_ties(top_k: int, kept: set[int]) -> None:
    logits = torch.tensor([[1.0, -1.0, 3.0, 0.0, 1.0]])  # token 0 and 4 tie for second place
    assert _kept(_filter(logits, top_k=[top_k])[0]) == kept


@pytest.mark.parametrize("min_p,kept", [(0.0, {0, 1, 2, 3, 4, 5}), (0.1, {0, 1, 2, 3, 4}), (0.2, {0, 1, 2}),
                                        (0.5, {0}), (1.0, {0})], ids=["off", "m0.1", "m0.2", "m0.5", "m1"])
def test_min_p_drops_exactly_tokens_below_min_p_times_pmax(min_p: float, kept: set[int]) -> None:
    probs = torch.tensor([0.5, 0.2, 0.12, 0.08, 0.06, 0.04])
    assert _kept(_filter(probs.log()[None], min_p=[min_p])[0]) == kept


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed0", "seed1", "seed2"])
def test_min_p_on_random_rows_matches_the_definition(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    min_p = [0.0, 0.01, 0.05, 0.2, 0.7]
    logits = torch.randn(len(min_p), V, generator=g) * 3
    out = _filter(logits, min_p=min_p)
    probs = logits.softmax(-1)
    for row, m in enumerate(min_p):
        assert _kept(out[row]) == set((probs[row] >= m * probs[row].max()).nonzero().flatten().tolist())


@pytest.mark.parametrize("seed", [0, 1, 2, 3], ids=["seed0", "seed1", "seed2", "seed3"])
def test_filter_batch_matches_per_row_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = 16
    logits = torch.randn(rows, V, generator=g) * 2
    params = [SamplingParams(temperature=1.0, top_k=int(torch.randint(0, 12, (1,), generator=g)),
                             top_p=float(torch.rand(1, generator=g)) * 0.9 + 0.1 if r % 3 else 1.0,
                             min_p=float(torch.rand(1, generator=g)) * 0.3 if r % 2 else 0.0) for r in range(rows)]
    got = _filter(logits, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
    for row, p in enumerate(params):
        want = filter_logits(logits[row], p)
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want)), f"row {row}: {p}"
        assert torch.equal(got[row][torch.isfinite(want)], want[torch.isfinite(want)])


def test_rows_with_filters_off_are_bit_exact() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    out = _filter(logits, top_k=[0, 5, 0, V + 10], top_p=[1.0, 1.0, 0.5, 1.0], min_p=[0.0, 0.0, 0.0, 0.0])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[3], logits[3])
    assert len(_kept(out[1])) == 5 and len(_kept(out[2])) < V


LOGITS = [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]


@pytest.mark.parametrize("penalty,want", [(2.0, [1.0, -2.0, 0.5, -6.0, 1.0, 0.0]), (0.5, [4.0, -0.5, 0.5, -1.5, 1.0, 0.0]),
                                          (1.0, LOGITS)], ids=["discourage", "encourage", "off"])
def test_repetition_penalty_exact_values(penalty: float, want: list[float]) -> None:
    # token 0 in the prompt and the output (penalized once), 3 prompt only, 1 output only (twice)
    logits = torch.tensor([LOGITS, LOGITS])
    params = [SamplingParams(repetition_penalty=penalty), SamplingParams()]
    got = apply_penalties(logits, params, [[0, 3], [0, 3]], [[1, 0, 1], [1, 0, 1]])
    assert got[0].tolist() == want
    assert torch.equal(got[1], logits[1])


@pytest.mark.parametrize("frequency,presence,want", [
    (0.5, 0.25, [1.0, -0.75, 0.25, 1.0, 1.0, 0.25]),
    (-0.5, 0.0, [1.0, 2.5, 1.5, 1.0, 1.0, 1.5]),
    (0.0, -2.0, [1.0, 3.0, 3.0, 1.0, 1.0, 3.0]),
], ids=["both", "negative_frequency", "negative_presence"])
def test_frequency_and_presence_penalties_count_output_only(frequency: float, presence: float, want: list[float]) -> None:
    # output: token 1 x3, tokens 2 and 5 once; prompt tokens 3 and 4 are not penalized
    logits = torch.ones(1, 6)
    params = [SamplingParams(frequency_penalty=frequency, presence_penalty=presence)]
    assert apply_penalties(logits, params, [[3, 4, 4]], [[1, 2, 1, 5, 1]])[0].tolist() == want


def test_sampler_applies_penalties_then_temperature_in_logprobs() -> None:
    logits = torch.tensor([LOGITS])
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=6)
    out = _run(logits, [params], [make_generator(0)], [[0, 3]], [[1, 0, 1]])
    # repetition -> [1, -2, .5, -6, 1, 0]; output counts: 0 x1, 1 x2 -> -(0.5 + 0.25), -(1.0 + 0.25)
    want = (torch.tensor([[0.25, -3.25, 0.5, -6.0, 1.0, 0.0]]) / 0.5).log_softmax(-1)[0]
    assert out.logprobs[0] == pytest.approx(want[out.token_ids[0]].item(), abs=1e-6)
    assert dict(out.top_logprobs[0]) == pytest.approx(dict(enumerate(want.tolist())), abs=1e-6)


def test_sample_requires_histories_when_penalties_are_set() -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [None])
    assert sample(torch.tensor([[0.0, 5.0, 1.0]]), [SamplingParams(temperature=0)], [None]) == [1]


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 64, 70, 100], ids=lambda v: f"V{v}")
def test_unpack_token_bitmask_matches_python_loop(vocab_size: int) -> None:
    g = torch.Generator().manual_seed(vocab_size)
    words = (vocab_size + 31) // 32
    mask = torch.randint(-2**31, 2**31, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0, 0] = -1  # every bit
    mask[1, -1] = -2**31  # only the sign bit: token 31 of the last word
    want = torch.tensor([[bool((int(mask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab_size)] for r in range(3)])
    assert torch.equal(unpack_token_bitmask(mask, vocab_size), want)
    assert torch.equal(unpack_token_bitmask(_pack(want), vocab_size), want)  # the oracle packer round-trips


def test_masked_tokens_are_never_sampled() -> None:
    vocab_size, rows = 70, 256
    g = torch.Generator().manual_seed(0)
    # the model strongly prefers the disallowed tokens
    logits = torch.randn(rows, vocab_size, generator=g)
    allowed = torch.zeros(rows, vocab_size, dtype=torch.bool)
    allowed[:, [3, 40, 64, 69]] = True
    logits[:, ~allowed[0]] += 10.0
    allowed[-1] = True  # last row unconstrained
    params = [SamplingParams(temperature=2.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3), SamplingParams(temperature=1.0, min_p=0.1)] * (rows // 4)
    out = _run(logits, params, [make_generator(i) if i % 4 == 2 else None for i in range(rows)], allowed_mask=_pack(allowed))
    assert set(out.token_ids[:-1]) <= {3, 40, 64, 69}
    assert out.token_ids[-1] not in {3, 40, 64, 69}


def test_all_bits_set_is_unconstrained() -> None:
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(seed=s) for s in range(3)]
    free = _run(logits, params, [make_generator(s) for s in range(3)])
    masked = _run(logits, params, [make_generator(s) for s in range(3)], allowed_mask=torch.full((3, 3), -1, dtype=torch.int32))
    assert free == masked
    assert torch.equal(apply_token_bitmask(logits, torch.full((3, 3), -1, dtype=torch.int32)), logits)


@pytest.mark.parametrize("mask,field", [(torch.zeros(2, 2, dtype=torch.int32), "allow no token"),
                                        (torch.full((2, 3), -1, dtype=torch.int32), "allowed_mask: expected int32 \\[B, 2\\]"),
                                        (torch.full((2, 2), -1, dtype=torch.int64), "allowed_mask: expected int32"),
                                        (torch.full((3, 2), -1, dtype=torch.int32), "expected 2 rows")],
                         ids=["empty_rows", "wrong_words", "wrong_dtype", "wrong_rows"])
def test_bad_masks_raise(mask: torch.Tensor, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _run(torch.zeros(2, 40), [SamplingParams()] * 2, allowed_mask=mask)


def test_logprobs_equal_log_softmax_of_the_processed_logits() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=1.0, logprobs=5), SamplingParams(temperature=0.7, top_p=0.8, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=20), SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=1.0)]
    out = _run(logits, params, [make_generator(i) for i in range(5)])
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.0])[:, None]
    want = (logits / temperature).log_softmax(-1)
    for row, p in enumerate(params):
        assert out.logprobs[row] == pytest.approx(want[row, out.token_ids[row]].item(), abs=1e-6)
        values, ids = want[row].topk(p.logprobs or 0)
        assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-6)
    assert _run(logits, [SamplingParams()] * 5)[1:] == (None, None)


PROBS = [0.1, 0.2, 0.3, 0.4]


@pytest.mark.parametrize("params,want", [
    (SamplingParams(temperature=1.0, seed=0), PROBS),
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=2.0, seed=0), [math.sqrt(p) / sum(math.sqrt(q) for q in PROBS) for p in PROBS]),
    (SamplingParams(temperature=1.0, top_k=3, seed=0), [0.0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
    (SamplingParams(temperature=1.0, top_p=0.65, seed=0), [0.0, 0.0, 0.3 / 0.7, 0.4 / 0.7]),
], ids=["seeded", "unseeded", "temperature2", "top_k3", "top_p0.65"])
def test_sampled_frequencies_match_the_distribution(params: SamplingParams, want: list[float]) -> None:
    n = 20_000
    torch.manual_seed(0)
    gen = make_generator(params.seed)
    # one generator shared by every row: they draw from it in row order
    out = _run(torch.tensor(PROBS).log().expand(n, 4).contiguous(), [params] * n, [gen] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).double() / n
    assert freq.tolist() == pytest.approx(want, abs=0.02)
    if params.seed is not None:
        assert _run(torch.tensor(PROBS).log().expand(n, 4).contiguous(), [params] * n,
                    [make_generator(params.seed)] * n).token_ids == out.token_ids


@pytest.mark.parametrize("field,value,limit", [
    ("repetition_penalty", 0.0, "> 0"), ("repetition_penalty", -1.0, "> 0"), ("repetition_penalty", float("nan"), "> 0"),
    ("frequency_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -2.01, "[-2, 2]"),
    ("presence_penalty", 3.0, "[-2, 2]"), ("presence_penalty", -2.5, "[-2, 2]"),
    ("logprobs", -1, "[0, 20]"), ("logprobs", 21, "[0, 20]"), ("logprobs", True, "[0, 20]"),
    ("temperature", -0.1, ">= 0"), ("top_p", 0.0, "(0, 1]"), ("top_k", -1, ">= 0"), ("min_p", 1.5, "[0, 1]"),
], ids=lambda v: str(v))
def test_invalid_params_raise_naming_the_field_and_limit(field: str, value: object, limit: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert str(err.value).startswith(f"{field}:") and limit in str(err.value)


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1e-3), ("frequency_penalty", -2.0), ("frequency_penalty", 2.0),
                                         ("presence_penalty", 2.0), ("logprobs", 0), ("logprobs", 20)],
                         ids=lambda v: str(v))
def test_limits_are_inclusive_where_documented(field: str, value: object) -> None:
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_sampler_rejects_mismatched_inputs() -> None:
    sampler = Sampler(8, "cpu")
    with pytest.raises(ValueError, match=r"logits: expected float32 \[B, 8\]"):
        sampler.sample_batch(torch.zeros(2, 9), [SamplingParams()] * 2, [None] * 2, [[]] * 2, [[]] * 2)
    with pytest.raises(ValueError, match="output_ids: expected 2 entries"):
        sampler.sample_batch(torch.zeros(2, 8), [SamplingParams()] * 2, [None] * 2, [[]] * 2, [[]])
    with pytest.raises(ValueError, match=r"token ids: must be in \[0, 8\)"):
        sampler.sample_batch(torch.zeros(1, 8), [SamplingParams(presence_penalty=1.0)], [None], [[]], [[8]])
