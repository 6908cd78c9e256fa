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


# ---- admission batching (SchedulerConfig.prefill_delay_steps) ----

def _held_engine(ckpt, delay: int | None, budget: int = 2048):
    eng = make_engine(ckpt, budget=budget, max_running=512, num_pages=4096)
    eng.scheduler.cfg = SchedulerConfig(max_num_batched_tokens=budget, max_running=512, prefill_delay_steps=delay)
    return eng


def _arrivals(eng, num_decodes: int, arrivals: int, prompt_len: int = 40) -> list[tuple[int, int]]:
    """num_decodes requests decoding, then one new prompt per step for `arrivals` steps, then steps until every
    arrival is admitted: (step, prefill tokens) of the steps that mixed prefill in, and the queue wait per arrival
    (steps from add to the step that admitted it) in eng.waits."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(num_decodes):
        eng.add_request([3 + i % 100, 4, 5], params)
    eng.step()
    added: dict[int, int] = {}
    mixed, eng.waits = [], []
    n = 0
    while n < arrivals or any(eng.requests[r].num_computed == 0 for r in added):
        if n < arrivals:
            added[eng.add_request([7 + (n + j) % 300 for j in range(prompt_len)], params)] = len(eng.runner.steps)
            n += 1
        eng.step()
        s = eng.runner.steps[-1]
        assert len(s.decodes) >= num_decodes  # the decodes run in every step, held or not
        if s.chunks:
            mixed.append((len(eng.runner.steps), sum(c.num_tokens for c in s.chunks)))
            eng.waits += [len(eng.runner.steps) - added[c.rid] for c in s.chunks if c.start == 0]
    return mixed


def test_admissions_wait_for_the_delay_and_share_one_mixed_step(ckpt) -> None:
    """One arrival per step while 16 requests decode: with no delay every step mixes a prefill in (each one an
    eager step on the GPU); with prefill_delay_steps=4 the arrivals are admitted four at a time, each after at
    most 4 steps, and the held steps are counted."""
    now = _held_engine(ckpt, 0)
    assert len(_arrivals(now, 16, 12)) == 12 and now.waits == [1] * 12 and now.stats.admissions_held == 0
    held = _held_engine(ckpt, 4)
    mixed = _arrivals(held, 16, 12)
    assert [p for _, p in mixed] == [4 * 40] * 3, mixed  # the head waited 4 steps: it and the 3 behind it
    assert held.waits == [4, 3, 2, 1] * 3  # oldest first
    assert held.stats.admissions_held == 9


def test_waiting_prompts_that_fill_the_budget_are_admitted_at_once(ckpt) -> None:
    """The delay holds small arrivals only: prompts that fill the step's prefill budget go in without waiting."""
    eng = _held_engine(ckpt, 50, budget=256)
    mixed = _arrivals(eng, 8, 6, prompt_len=100)
    # 100-token prompts against 256 - 8 decode rows: the third arrival fills the budget (step 1 was the decodes')
    assert mixed[0] == (4, 248) and eng.waits[:3] == [3, 2, 1], (mixed, eng.waits)
    # the next two ride along with the steps that finish those prompts' chunks; the last one, alone and small,
    # waits the whole delay
    assert eng.waits[3:] == [1, 1, 50], eng.waits


def test_no_hold_without_decodes_or_when_the_step_already_mixes(ckpt) -> None:
    eng = _held_engine(ckpt, 100)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rid = eng.add_request([5, 6, 7], params)
    eng.step()  # nothing decodes yet: admitted at once
    assert eng.requests[rid].num_computed == 3
    # a long prompt's later chunks make steps mixed anyway: arrivals ride along with them
    long_rid = eng.add_request([3 + i % 500 for i in range(2100)], params)
    eng.step()
    assert eng.requests[long_rid].num_computed < 2100
    short = eng.add_request([8, 9, 10], params)
    eng.step()  # the long prompt's last chunk
    assert eng.requests[long_rid].num_computed == 2100 and eng.requests[short].num_computed == 3
    assert eng.stats.admissions_held == 0


def test_prefill_delay_default_follows_the_runner(ckpt) -> None:
    from dataclasses import replace

    from k3rt.config import PREFILL_DELAY_STEPS_GRAPHS, EngineConfig

    cfg = EngineConfig(model=str(ckpt), device="cuda", runner="gpu")
    assert cfg.scheduler.prefill_delay_steps == PREFILL_DELAY_STEPS_GRAPHS
    assert replace(cfg, cuda_graphs=False, scheduler=SchedulerConfig()).scheduler.prefill_delay_steps == 0
    assert EngineConfig(model=str(ckpt), device="cpu").scheduler.prefill_delay_steps == 0
    assert EngineConfig(model=str(ckpt), device="cuda", runner="gpu",
                        scheduler=SchedulerConfig(prefill_delay_steps=3)).scheduler.prefill_delay_steps == 3
    with pytest.raises(ValueError, match="prefill_delay_steps"):
        SchedulerConfig(prefill_delay_steps=-1)
