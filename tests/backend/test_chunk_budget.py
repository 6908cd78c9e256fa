"""The decode-aware chunk budget (Scheduler.prefill_budget): with many decodes running, a step's prefill
chunks shrink so the step's time stays bounded and a long prompt does not stall the decodes."""

from __future__ import annotations

import pytest

from k3rt.config import SchedulerConfig
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import make_engine, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def _engine(ckpt, cost: float, min_prefill: int = 256):
    eng = make_engine(ckpt, budget=2048, max_running=512, num_pages=4096)
    sched = eng.scheduler
    sched.cfg = SchedulerConfig(max_num_batched_tokens=2048, max_running=512, decode_token_cost=cost,
                                min_prefill_tokens=min_prefill)
    return eng


def _prefill_tokens_per_step(eng, num_decodes: int) -> list[tuple[int, int]]:
    """num_decodes requests decoding, then a 6000-token prompt: (decode rows, prefill tokens) of each step
    until the long prompt is in."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(num_decodes):
        eng.add_request([3 + i % 100, 4, 5], params)
    eng.step()  # every short prompt in one step
    long_rid = eng.add_request([3 + i % 500 for i in range(6000)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    rows = []
    while eng.requests[long_rid].num_computed < 6000:
        eng.step()
        s = eng.runner.steps[-1]
        rows.append((len(s.decodes), sum(c.num_tokens for c in s.chunks)))
    return rows


def test_prefill_budget_values() -> None:
    from k3rt.backend.scheduler.scheduler import Scheduler

    class _S:  # prefill_budget reads only cfg
        cfg = SchedulerConfig(max_num_batched_tokens=2048, decode_token_cost=8, min_prefill_tokens=256)

    budget = lambda n: Scheduler.prefill_budget(_S(), n)  # noqa: E731
    assert [budget(n) for n in (0, 1, 64, 100, 200, 250, 10_000)] == [2048, 1984, 1536, 1216, 448, 256, 256]
    _S.cfg = SchedulerConfig(max_num_batched_tokens=2048, decode_token_cost=0)
    assert budget(500) == 2048


@pytest.mark.parametrize("num_decodes,cost,want_max", [(64, 8.0, 1536), (250, 8.0, 256), (64, 0.0, 2048 - 64)],
                         ids=["64-decodes", "250-decodes-floor", "off"])
def test_long_prompt_chunks_shrink_with_running_decodes(ckpt, num_decodes, cost, want_max) -> None:
    rows = _prefill_tokens_per_step(_engine(ckpt, cost), num_decodes)
    assert all(d == num_decodes for d, _ in rows)  # the decodes ran in every step of the prefill
    assert max(p for _, p in rows) == want_max
    assert sum(p for _, p in rows) == 6000


def test_bad_budget_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        SchedulerConfig(min_prefill_tokens=100)
    with pytest.raises(ValueError, match="decode_token_cost"):
        SchedulerConfig(decode_token_cost=-1)
