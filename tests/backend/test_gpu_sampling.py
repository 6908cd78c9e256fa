"""The GPU runner's sampling glue: per-request penalty statistics kept on the device and fed to
the Triton sampler equal the host sampler's penalties (which rebuild them from token histories).

On the CPU the Triton sampler runs under the interpreter (tests/conftest.py sets TRITON_INTERPRET),
at a tiny vocabulary. Greedy rows make the comparison exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.backend.runner.gpu.penalties import PenaltyState  # noqa: E402
from k3rt.backend.runner.gpu.sample import device_sample  # noqa: E402
from k3rt.backend.runner.sampling import sample_requests  # noqa: E402
from k3rt.backend.scheduler.request import Request  # noqa: E402
from k3rt.backend.sampling.sampler import Sampler  # noqa: E402
from k3rt.kernels.sampling import sample  # noqa: E402
from k3rt.sampling_params import SamplingParams  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V = 64


def Req(rid: int, params: SamplingParams, token_ids: list[int], prompt_len: int) -> Request:
    # the scheduler's own (slotted) Request: a stand-in class would accept attributes the real one refuses
    return Request(rid, token_ids, prompt_len, params)


def requests(g: torch.Generator) -> list[Req]:
    pens = [dict(repetition_penalty=1.6), dict(frequency_penalty=0.7, presence_penalty=0.4),
            dict(repetition_penalty=1.3, frequency_penalty=0.3), dict()]  # the last row: no penalty
    out = []
    for i, kw in enumerate(pens):
        prompt = torch.randint(0, V, (12,), generator=g).tolist()
        out.append(Req(i, SamplingParams(temperature=0.0, max_tokens=8, **kw), prompt, len(prompt)))
    return out


def test_device_penalty_state_matches_the_host_sampler_over_steps() -> None:
    g = torch.Generator().manual_seed(0)
    reqs = requests(g)
    state = PenaltyState(V, DEV, max_rows=8)
    host = Sampler(V, DEV)
    for step in range(4):
        # logits with ties broken and a few large entries the penalties must push down
        logits = torch.randn(len(reqs), V, generator=g).to(DEV)
        for r in reqs:
            logits[r.rid, r.token_ids[-3:]] += 2.0
        want = sample_requests(host, logits, reqs)
        got = device_sample(sample, logits, reqs, state)
        assert got == want, f"step {step}"
        for r in reqs:
            r.token_ids.append(got[r.rid])
    pen = reqs[:3]
    counts = state.output_counts[[state.row_of[r.rid] for r in pen]].cpu()
    assert 3 not in state.row_of  # the unpenalized request holds no row
    for i, r in enumerate(pen):
        assert counts[i].sum() == 4 and all(counts[i, t] >= 1 for t in r.token_ids[r.prompt_len:])


def test_rows_run_out_then_come_back() -> None:
    g = torch.Generator().manual_seed(1)
    reqs = requests(g)
    state = PenaltyState(V, DEV, max_rows=3)
    logits = torch.randn(len(reqs), V, generator=g).to(DEV)
    assert device_sample(sample, logits, reqs, state) is not None  # 3 penalized rows, 3 state rows
    assert set(state.row_of) == {0, 1, 2}  # the unpenalized request took none
    extra = Req(9, SamplingParams(temperature=0.0, repetition_penalty=1.2), [1, 2, 3], 3)
    assert device_sample(sample, logits[:1], [extra], state) is None  # rows ran out: host path
    state.release(reqs[0].rid)
    assert device_sample(sample, logits[:1], [extra], state) is not None and state.row_of[9] == 0


def test_seeded_device_sampling_is_reproducible_and_unseeded_keeps_its_draw() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, V, generator=g).to(DEV)

    def draw(seed):
        reqs = [Req(i, SamplingParams(temperature=1.0, seed=seed, max_tokens=4), [1, 2, 3], 3) for i in range(2)]
        return reqs, [device_sample(sample, logits, reqs, None) for _ in range(3)]

    (a, ta), (_, tb) = draw(7), draw(7)
    assert ta == tb and all(r.sampled.device_seed == 7 for r in a)
    reqs, _ = draw(None)
    seeds = [r.sampled.device_seed for r in reqs]
    assert all(s is not None for s in seeds)
    device_sample(sample, logits, reqs, None)
    assert [r.sampled.device_seed for r in reqs] == seeds  # drawn once, then kept
