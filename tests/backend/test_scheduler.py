"""The scheduler and prefix cache driven through Engine with the null runner (no compute; the fake
next token is a function of the sequence, so cache-on and cache-off runs give the same tokens).

Asserted, with Engine.check() after every step: chunk alignment (a non-final chunk ends on the
snapshot grid, an off-grid start stops at the next grid point, chunk snapshots sit a whole number of
KDA chunks from the chunk start); the token budget; decode-first ordering; every snapshot in the tree
sits on the grid or at the exact end of a finished request's fed tokens; an identical prompt computes
only the tokens after its replay boundary; turn N+1 of a conversation computes only its new tokens;
full-block mode hits only at block multiples; a tiny pool forces eviction and preemption without
changing any token; page accounting returns to the start after finishing or aborting; bad input is
rejected naming the field and leaves other requests alone. Two regression tests pin bugs found here.
"""

from __future__ import annotations

import random

import pytest

from k3rt.backend.cache.radix import RadixCache
from k3rt.config import KDA_CHUNK
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import (
    assert_at_rest, greedy, make_engine, path_tokens, run, snapshot_nodes, tiny_checkpoint,
)

VOCAB = 512  # the tiny checkpoint's


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def workload(seed: int, n: int = 14, max_prompt: int = 260, max_out: int = 12) -> tuple[list[list[int]], list]:
    """Prompts sharing prefixes of assorted lengths with two bases, plus exact repeats."""
    rng = random.Random(seed)
    bases = [rand_tokens(rng, max_prompt) for _ in range(2)]
    prompts = []
    for _ in range(n):
        k = rng.choice([0, 1, 47, 48, 49, 63, 64, 65, 100, 128, 129, 200])
        prompts.append(rng.choice(bases)[:k] + rand_tokens(rng, rng.randrange(1, max_prompt - k + 1)))
    prompts += [prompts[i] for i in rng.sample(range(n), 3)]
    return prompts, [greedy(rng.randrange(1, max_out)) for _ in prompts]


def fed_tokens(prompt: list[int], out) -> tuple[int, ...]:
    """A finished request fed its prompt and every output token but the last."""
    return tuple(prompt + out.output_ids[:-1])


def assert_snapshot_positions(engine, grid: int, finished_fed: set[tuple[int, ...]]) -> None:
    for node in snapshot_nodes(engine):
        assert node.end % grid == 0 or tuple(path_tokens(node)) in finished_fed, \
            f"snapshot at {node.end}: neither on the grid nor the end of a finished request"


# ---- alignment, budget, ordering ----

ALIGN_CASES = [
    pytest.param(64, 64, None, id="budget64-grid64-B48"),
    pytest.param(100, 64, None, id="budget100-grid64-B48"),
    pytest.param(256, 128, None, id="budget256-grid128-B48"),
    pytest.param(300, 64, 128, id="budget300-grid64-B128"),
    pytest.param(1000, 64, 64, id="budget1000-grid64-B64"),
]


@pytest.mark.parametrize("budget, grid, block", ALIGN_CASES)
def test_chunks_align_budget_and_decode_first(ckpt, budget, grid, block):
    eng = make_engine(ckpt, budget=budget, hash_block_size=grid, block_size=block, num_pages=400)
    assert eng.layout.block_size == (block or 48)
    rec = eng.runner
    decode_ready: list[set[int]] = []

    def before_next_step(e):
        decode_ready.append({r.rid for r in e.scheduler.running if len(r.token_ids) - r.num_computed == 1})

    prompts, params = workload(budget)
    decode_ready.append(set())
    outs = run(eng, prompts, params, after_step=before_next_step)
    # turn 2 of every conversation, plus repeats, on the warm cache
    rng = random.Random(budget + 1)
    prompts2 = [p + o.output_ids + rand_tokens(rng, rng.choice([0, 1, 30, 70])) for p, o in zip(prompts, outs)]
    outs2 = run(eng, prompts2 + prompts[:4], greedy(5), after_step=before_next_step)
    assert eng.stats.preemptions == 0

    steps = rec.steps
    assert len(steps) == len(decode_ready) - 1  # the last entry is after the last step
    n_split = n_offgrid = n_snap = 0
    for step, ready in zip(steps, decode_ready):
        assert step.num_tokens <= budget
        # decode-first: every request with one token to feed is in this step's decodes, before any chunk
        assert {rid for rid, _ in step.decodes} == ready
        assert not ready & {c.rid for c in step.chunks}
        assert sum(c.num_tokens for c in step.chunks) <= budget - len(step.decodes)
        for c in step.chunks:
            end = c.start + c.num_tokens
            assert 0 < c.num_tokens and end <= c.total and c.needs_logits == (end == c.total)
            if end < c.total:
                n_split += 1
                # a non-final chunk ends on the grid, or (budget too small to reach the next grid
                # point) stays inside one grid cell, so no snapshot position falls inside it
                assert end % grid == 0 or c.start // grid == end // grid, \
                    f"non-final chunk [{c.start}, {end}) crosses a grid point and ends off the grid"
            if c.start % grid and c.num_tokens > 1:
                n_offgrid += 1
                assert end <= (c.start // grid + 1) * grid, f"off-grid chunk [{c.start}, {end}) crosses the grid"
            for p in c.snapshots:
                n_snap += 1
                assert c.start < p <= end and p % grid == 0
                assert (p - c.start) % KDA_CHUNK == 0 or p == end
            assert c.snapshots == sorted(set(c.snapshots))
    assert n_split > 0 and n_offgrid > 0 and n_snap > 0  # the workload exercised each rule
    finished = {fed_tokens(p, o) for p, o in zip(prompts + prompts2 + prompts[:4], outs + outs2)}
    assert_snapshot_positions(eng, grid, finished)
    assert_at_rest(eng)


def test_decodes_take_budget_first(ckpt):
    eng = make_engine(ckpt, budget=128)
    a = eng.add_request(list(range(10)), greedy(30))
    eng.step()
    eng.step()
    b = eng.add_request(list(range(300)), greedy(1))
    eng.step()
    step = eng.runner.steps[-1]
    assert step.decodes == [(a, 11)]
    # 127 tokens left; a non-final chunk must end on the grid: 64
    assert [(c.rid, c.start, c.num_tokens) for c in step.chunks] == [(b, 0, 64)]
    eng.step()
    assert [(c.rid, c.start, c.num_tokens) for c in eng.runner.steps[-1].chunks] == [(b, 64, 64)]
    eng.abort(a)
    eng.step()
    assert [(c.rid, c.start, c.num_tokens) for c in eng.runner.steps[-1].chunks] == [(b, 128, 128)]
    eng.check()


# ---- hits ----

@pytest.mark.parametrize("block", [None, 128], ids=["B48", "B128"])
@pytest.mark.parametrize("grid", [64, 128], ids=["grid64", "grid128"])
def test_same_prompt_twice_computes_at_most_one_grid(ckpt, grid, block):
    eng = make_engine(ckpt, hash_block_size=grid, block_size=block, num_pages=400)
    rng = random.Random(grid)
    for n in [1, 2, 63, 64, 65, 127, 128, 129, 130, 191, 192, 193, 300]:
        prompt = rand_tokens(rng, n)
        first = run(eng, [prompt], greedy(3))[0]
        assert first.cached_tokens == 0
        before = eng.stats.computed_tokens
        again = run(eng, [prompt], greedy(3))[0]
        replay = (n - 1) // grid * grid  # the last grid point that a match of n-1 tokens reaches
        assert again.cached_tokens == replay, f"n={n}"
        assert eng.stats.computed_tokens - before == (n - replay) + 2  # the prompt's rest, then 2 decodes
        assert n - replay <= grid
        assert again.output_ids == first.output_ids
    assert_at_rest(eng)


@pytest.mark.parametrize("grid, block", [(64, None), (128, None), (64, 128)], ids=["grid64-B48", "grid128-B48", "grid64-B128"])
def test_conversation_turn_computes_only_new_tokens(ckpt, grid, block):
    eng = make_engine(ckpt, hash_block_size=grid, block_size=block, num_pages=400)
    rng = random.Random(7)
    news = [0, 1, 5, 63, 64, 65, 130, 3]  # new user tokens of turns 2, 3, ...
    prompt = rand_tokens(rng, 90)
    for turn in range(len(news) + 1):
        max_tokens = rng.randrange(1, 7)
        before = eng.stats.computed_tokens
        out = run(eng, [prompt], greedy(max_tokens))[0]
        computed = eng.stats.computed_tokens - before - (max_tokens - 1)  # less the decode steps
        if turn:
            new = news[turn - 1]
            # the previous turn left a snapshot at the end of its fed tokens (prompt + output - 1)
            assert out.cached_tokens == len(prompt) - new - 1, f"turn {turn}"
            assert computed == new + 1 <= new + grid, f"turn {turn}"
        if turn < len(news):
            prompt = prompt + out.output_ids + rand_tokens(rng, news[turn])
    assert_at_rest(eng)


@pytest.mark.parametrize("block", [64, 128], ids=["B64", "B128"])
def test_full_block_mode_hits_only_at_block_multiples(ckpt, block):
    eng = make_engine(ckpt, full_block_mode=True, block_size=block, num_pages=400)
    hash_mode = make_engine(ckpt, block_size=block, num_pages=400)  # grid 64
    rng = random.Random(block)
    more_in_hash_mode = 0
    for n in [30, 64, 65, 100, 128, 129, 200, 257, 300]:
        prompt = rand_tokens(rng, n)
        outs = [run(e, [prompt], greedy(4))[0].output_ids for e in (eng, hash_mode)]
        assert outs[0] == outs[1]
        turn2 = prompt + outs[0] + rand_tokens(rng, 40)  # the next turn of a conversation
        for p in (prompt, turn2):
            full, hashed = run(eng, [p], greedy(2))[0], run(hash_mode, [p], greedy(2))[0]
            assert full.output_ids == hashed.output_ids
            if p is prompt:
                assert full.cached_tokens == (len(p) - 1) // block * block
            assert full.cached_tokens % block == 0
            assert full.cached_tokens <= hashed.cached_tokens
            more_in_hash_mode += full.cached_tokens < hashed.cached_tokens
    assert more_in_hash_mode > 0
    assert all(n.end % block == 0 for n in snapshot_nodes(eng))
    assert all(c.start % block == 0 or c.num_tokens == 1 for s in eng.runner.steps for c in s.chunks)
    assert_at_rest(eng)


def test_salts_never_share_hits(ckpt):
    eng = make_engine(ckpt)
    prompt = list(range(200))
    run(eng, [prompt], greedy(2), salts=["a"])
    outs = run(eng, [prompt] * 3, greedy(2), salts=["b", None, "a"])
    assert [o.cached_tokens for o in outs] == [0, 0, 192]


# ---- memory pressure ----

@pytest.mark.parametrize("seed, num_pages, budget, max_out", [(1, 12, 256, 100), (2, 12, 128, 100), (3, 16, 512, 12)],
                         ids=["12pages-budget256", "12pages-budget128", "16pages-budget512"])
def test_tiny_pool_evicts_and_preempts_without_changing_tokens(ckpt, seed, num_pages, budget, max_out):
    prompts, params = workload(seed, n=16, max_prompt=250, max_out=max_out)
    big = make_engine(ckpt, num_pages=2000, budget=budget)
    want = [o.output_ids for o in run(big, prompts, params)]
    assert big.stats.preemptions == 0
    tiny = make_engine(ckpt, num_pages=num_pages, budget=budget)
    evicted = []
    evict = tiny.scheduler.tree.evict
    tiny.scheduler.tree.evict = lambda n, **kw: evicted.append(evict(n, **kw)) or evicted[-1]
    got = run(tiny, prompts, params)
    assert [o.output_ids for o in got] == want
    # long outputs: an older request's decode needs a page a newer one holds. Short ones (16 pages):
    # chunks shrink to the pages there are and the newest waits, so nobody has to be preempted
    assert (tiny.stats.preemptions > 0) == (max_out > 12) and sum(evicted) > 0
    assert_at_rest(tiny)


def test_abort_frees_everything_and_leaves_the_rest_alone(ckpt):
    prompts, params = workload(5, n=10)
    ref = make_engine(ckpt, num_pages=400)
    want = [o.output_ids for o in run(ref, prompts, params)]
    eng = make_engine(ckpt, num_pages=400, budget=128, max_running=6)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {}
    aborted = set()
    for i in range(10_000):
        if i == 3:
            sched = eng.scheduler
            running = [r for r in sched.running if r.num_computed < r.prompt_len]
            decoding = [r for r in sched.running if r.num_computed >= r.prompt_len]
            victims = [sched.waiting[0].rid] + [r.rid for r in running[:1] + decoding[:1]]
            assert len(victims) >= 2
            for rid in victims:
                eng.abort(rid)
            aborted = set(victims)
        for o in eng.step():
            if o.finished:
                outs[o.rid] = o
        eng.check()
        if len(outs) == len(rids):
            break
    assert {r for r, o in outs.items() if o.finish_reason == "abort"} == aborted
    for k, rid in enumerate(rids):
        if rid not in aborted:
            assert outs[rid].output_ids == want[k]
    assert_at_rest(eng)
    # abort everything mid-flight: one step applies it and nothing is left held
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = set()
    for _ in range(4):
        done |= {o.rid for o in eng.step() if o.finished}
    assert eng.scheduler.running and eng.scheduler.waiting
    for rid in rids:
        eng.abort(rid)
    outs = eng.step()
    assert sorted((o.rid, o.finished, o.finish_reason) for o in outs) == [(r, True, "abort") for r in rids if r not in done]
    assert not eng.has_unfinished and not eng.requests
    assert_at_rest(eng)


# ---- bad input ----

BAD = {
    "empty_prompt": ([], 4, ValueError, "^prompt: must contain"),
    "token_id_at_vocab": ([1, 2, VOCAB], 4, ValueError, rf"^prompt: token id {VOCAB} outside"),
    "negative_token_id": ([-1, 2], 4, ValueError, "^prompt: token id -1 outside"),
    "longer_than_context": ([1] * 100, 8192 - 99, ValueError, "^prompt: 100 tokens \\+ max_tokens 8093 exceed"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_rejected_naming_the_field(ckpt, case):
    prompt, max_tokens, exc, msg = BAD[case]
    good = [list(range(1, 80)), list(range(5, 200, 2))]
    want = [o.output_ids for o in run(make_engine(ckpt), good, greedy(6))]
    eng = make_engine(ckpt)
    first = eng.add_request(good[0], greedy(6))
    eng.step()
    with pytest.raises(exc, match=msg):
        eng.add_request(prompt, greedy(max_tokens))
    second = eng.add_request(good[1], greedy(6))
    assert set(eng.requests) == {first, second} and second == first + 1
    outs = {}
    while eng.has_unfinished:
        outs.update((o.rid, o.output_ids) for o in eng.step() if o.finished)
        eng.check()
    assert [outs[first], outs[second]] == want
    assert_at_rest(eng)


def test_max_waiting_overflow_names_the_field(ckpt):
    # the engine holds max_running + max_waiting requests (what the gateway admits), wherever they are:
    # a burst that arrives in one drain queues instead of failing
    eng = make_engine(ckpt, max_waiting=2, max_running=1)
    rids = [eng.add_request(list(range(1, 50)), greedy(3)) for _ in range(3)]
    with pytest.raises(OverflowError, match="^max_waiting: 1 requests running and 2 waiting already"):
        eng.add_request(list(range(1, 50)), greedy(3))
    outs = {}
    while len(eng.requests) == 3:  # the first finishes: room again
        outs.update((o.rid, o.output_ids) for o in eng.step() if o.finished)
    rids.append(eng.add_request(list(range(1, 50)), greedy(3)))
    while eng.has_unfinished:
        outs.update((o.rid, o.output_ids) for o in eng.step() if o.finished)
        eng.check()
    assert sorted(outs) == rids and len({tuple(v) for v in outs.values()}) == 1
    assert_at_rest(eng)


def test_pool_too_small_names_the_field(ckpt):
    with pytest.raises(ValueError, match="^num_pages: the pool holds 4 pages; one request needs at least 5"):
        make_engine(ckpt, num_pages=4)
    with pytest.raises(ValueError, match="^memory_gb: the pool holds 1 pages"):
        make_engine(ckpt, num_pages=None, memory_gb=1e-5)  # 10 KiB: one page of 7680 B


# ---- regressions ----

def test_regression_request_larger_than_the_pool_is_rejected(ckpt):
    """Engine.add_request: a request whose KV and KDA state cannot fit in the whole pool was accepted,
    then preempted itself every step forever (generate never returned)."""
    eng = make_engine(ckpt, num_pages=8)  # 3 pages for the KDA state, 5 x 48 = 240 tokens of KV
    with pytest.raises(ValueError, match="^prompt: 230 tokens \\+ max_tokens 12 need 9 cache pages .* pool has 8"):
        eng.add_request(list(range(230)), greedy(12))
    assert not eng.has_unfinished and not eng.requests
    out = run(eng, [list(range(229))], greedy(12))[0]  # 229 + 12 - 1 = 240 fed tokens: fits exactly
    assert len(out.output_ids) == 12
    assert_at_rest(eng)



def test_regression_preempted_decode_request_gets_no_page(ckpt):
    """Scheduler.schedule: a decode request preempted by an older one in the same decode loop was still
    given a page (its num_computed had been reset to 0, a block boundary), leaking it: refcounts drifted."""
    eng = make_engine(ckpt, num_pages=8, enable_prefix_cache=False)  # 2 requests x (1 page + 3 state pages)
    prompts = [list(range(1, 48)), list(range(2, 49))]  # 47 tokens: the 3rd step decodes position 48, block 1
    want = [o.output_ids for o in run(make_engine(ckpt, enable_prefix_cache=False), prompts, greedy(4))]
    got = run(eng, prompts, greedy(4))  # Engine.check() after every step
    assert [o.output_ids for o in got] == want
    assert eng.stats.preemptions == 1
    assert_at_rest(eng)


def test_regression_admission_eviction_drops_the_match(ckpt):
    """Scheduler._admit: the eviction that makes room for a request could evict the very snapshot and
    pages it had just matched; the admission then referenced freed pages (AssertionError)."""
    eng = make_engine(ckpt, num_pages=10, eviction="lru")  # LRU: the snapshot at 64 goes first
    prompt = list(range(1, 101))
    run(eng, [prompt], greedy(1))
    # snapshots at 64 and 100 (3 pages each) and KV blocks 0-2: 9 of 10 pages
    assert sorted(n.end for n in snapshot_nodes(eng)) == [64, 100] and eng.pool.num_free == 1
    want = run(make_engine(ckpt, num_pages=400), [prompt + list(range(200, 220))], greedy(3))[0].output_ids
    out = run(eng, [prompt + list(range(200, 220))], greedy(3))[0]
    assert out.output_ids == want and out.cached_tokens == 0  # the hit had to go to make room
    assert_at_rest(eng)


def test_radix_cache_is_the_schedulers_tree(ckpt):
    eng = make_engine(ckpt)
    assert isinstance(eng.scheduler.tree, RadixCache) and eng.scheduler.tree.pool is eng.pool


def test_regression_decodes_cannot_starve_a_long_prefill(ckpt):
    # budget 64 with 20 requests decoding leaves 44 tokens per step: less than one grid (64), so
    # grid-aligned chunk ends alone would give the long prefill 0 tokens until every decode finished
    eng = make_engine(ckpt, budget=64, hash_block_size=64, num_pages=400)
    rng = random.Random(7)
    for _ in range(20):
        eng.add_request(rand_tokens(rng, 3), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    long_rid = eng.add_request(rand_tokens(rng, 300), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    done_at = None
    for step in range(60):
        for o in eng.step():
            if o.rid == long_rid and o.finished:
                done_at = step
        eng.check()
        if done_at is not None:
            break
    # 300 prompt tokens at >= 20 per step (44 when the grid allows): well before the decodes end (200 steps)
    assert done_at is not None and done_at < 30, done_at
