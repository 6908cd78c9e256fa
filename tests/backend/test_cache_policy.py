"""The snapshot policy (backend/cache/policy.py) in the radix tree's "value" mode, on an accounting-only
pool (block 16 tokens, 3-page state sets): the eviction order by value per page and age, what the
reuse statistics learn from hits, misses and ghosts, admission that never evicts more valuable state,
the conversation's heat moving to its newest end; and, through the null-runner replay, that the
policy learns what a workload reuses and computes fewer tokens than the full-block baseline."""

from __future__ import annotations

import math

import pytest

from k3rt.backend.bench import workloads
from k3rt.backend.bench.cache_replay import replay
from k3rt.backend.cache.policy import CHECKPOINT, END, JUNCTION, MIN_HORIZON, CachePolicy, ReuseStats, tail_kind
from k3rt.backend.cache.pool import PagePool
from k3rt.backend.cache.radix import RadixCache
from k3rt.cache_layout import CacheLayout
from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig

B = 16


def make_tree(num_pages: int = 200, eviction: str = "value") -> tuple[PagePool, RadixCache]:
    layout = CacheLayout(block_size=B, page_size_bytes=B * 32, kda_conv_bytes=32, kda_state_bytes=160,
                         mla_bytes_per_token=32, group_size=1, mla_group=(99,), kda_groups=((0,), (1,), (2,)),
                         kv_dtype="float32", conv_dtype="float32", state_dtype="float32")
    pool = PagePool(layout, num_pages, materialize=False)
    return pool, RadixCache(pool, B, CachePolicy(eviction=eviction))


def publish(tree: RadixCache, tokens: list[int], kind: str, start=None):
    pool = tree.pool
    pages = pool.allocate(-(-len(tokens) // B))
    node = tree.insert(tokens, pages, snapshot=pool.allocate(3), kind=kind, start=start)
    pool.unref(pages)
    return node


def advance(tree: RadixCache, turnovers: float) -> None:
    """Move the policy clock (pages handed out / pool size) without touching the tree."""
    tree.pool.allocated_total += int(turnovers * tree.pool.num_pages)


def test_reuse_stats_learn_from_hits_and_from_misses_only_after_the_horizon() -> None:
    r = ReuseStats(decay=1.0)
    assert r.p(END) == 0.5 and r.horizon(END) == 1.0  # no evidence yet
    for _ in range(8):
        r.on_publish(END)
    r.on_evicted_unused(END, age=0.2)  # evicted young: it had no time, says nothing
    assert r.p(END) == 0.5
    for _ in range(3):
        r.on_first_hit(END)
    r.on_evicted_unused(END, age=1.5)  # outlived the horizon (1.0) unused: a miss
    assert r.p(END) == pytest.approx((3 + 1) / (3 + 1 + 2))
    # reuse ages set the horizon (1.5 x their decayed mean); it moves only by more than a quarter
    assert r.on_hit_age(END, 0.2) is True and r.horizon(END) == pytest.approx(0.3)
    assert r.on_hit_age(END, 0.2) is False
    # a ghost hit on a snapshot evicted unused undoes its miss
    before = r.p(END)
    r.on_ghost_hit(END, age=0.25, was_hit=False)
    assert r.p(END) > before


def test_interior_snapshots_go_before_the_path_end_that_needs_their_kv() -> None:
    pool, tree = make_tree()
    seq = list(range(1, 161))
    cps = [publish(tree, seq[:p], CHECKPOINT) for p in (32, 64, 96, 128)]
    end = publish(tree, seq, END)
    # the interior ones save 32 tokens for 3 pages; the end saves 32 too, but evicting it frees its KV
    # (2 more pages), so per page it is worth less: it goes first, then the path thins from the end
    order = []
    for _ in range(5):
        live = {id(n) for n in tree._nodes() if n.snapshot is not None}
        tree.evict(1)
        order += [n for n in cps + [end] if id(n) in live and n.snapshot is None]
    assert order == [end, cps[3], cps[2], cps[1], cps[0]]
    assert pool.num_free == pool.num_pages
    tree.check()


def test_hits_and_age_order_eviction_and_a_kind_ages_at_its_own_rate() -> None:
    pool, tree = make_tree()
    a = publish(tree, list(range(100, 164)), END)
    b = publish(tree, list(range(200, 264)), END)
    tree.use(a)  # a was resumed from: worth more
    tree.evict(1)
    assert a.snapshot is not None and b.snapshot is None
    c = publish(tree, list(range(300, 364)), END)
    # a is now old: past its kind's horizon its value has decayed below the fresh c's
    advance(tree, 3 * tree.reuse.horizon(END))
    d = publish(tree, list(range(400, 464)), END)
    assert tree.priority(a) > tree.priority(c)  # same age, a has a hit
    assert tree.priority(d) > tree.priority(a)  # d is fresh: a's hit no longer outweighs its age
    # a kind reused quickly gets a short horizon: its old snapshots decay faster than another kind's
    for _ in range(20):
        tree.reuse.on_hit_age(tail_kind(512), 0.01)
    assert tree.reuse.horizon(tail_kind(512)) == MIN_HORIZON < tree.reuse.horizon(CHECKPOINT)
    tree.check()


def test_admission_never_evicts_more_valuable_snapshots() -> None:
    pool, tree = make_tree(num_pages=20)
    pool.allocate(7)  # held elsewhere (running requests)
    hot = publish(tree, list(range(1, 81)), END)  # 5 KV pages + 3
    for _ in range(3):
        tree.use(hot)
    cold = publish(tree, list(range(500, 520)), CHECKPOINT)  # 2 + 3
    assert pool.num_free == 0
    low = math.log(1e-6)
    assert tree.evict(3, below=low) == 0  # a snapshot worth ~nothing may take no one's place
    freed = tree.evict(3, below=tree.admission_priority(JUNCTION, 64))
    assert freed == 5 and cold.snapshot is None and hot.snapshot is not None
    assert tree.evict(3, below=tree.admission_priority(CHECKPOINT, 1)) == 0
    tree.check()


def test_ghost_of_an_evicted_end_counts_as_its_kinds_reuse() -> None:
    pool, tree = make_tree()
    system = list(range(1, 49))
    junction = publish(tree, system, JUNCTION)
    turn = system + list(range(600, 650))
    end = publish(tree, turn, END, start=junction)
    hits_before = tree.reuse.hit[END]
    tree.evict(1)  # the end goes (its KV with it): a ghost hangs on the junction
    assert end.snapshot is None and junction.snapshot is not None and junction.ghosts
    m = tree.match(turn + [7, 8], ghosts=True)  # the conversation's next turn
    assert m.state_hit == 48  # the live tree serves the junction only...
    assert tree.reuse.hit[END] == hits_before + 1  # ...but the policy learns the end was wanted
    assert not any(junction.ghosts.values())  # consumed
    # a snapshot evicted from a node that stays (its KV still needed below) leaves a marker there
    deeper = publish(tree, turn + list(range(700, 720)), END, start=junction)
    mid = tree.insert(turn, [], snapshot=pool.allocate(3), kind=tail_kind(64))
    tree._drop_snapshot(mid)
    assert mid.ghost is not None and deeper.snapshot is not None
    before = tree.reuse.hit[tail_kind(64)]
    tree.match(turn + [9], ghosts=True)
    assert tree.reuse.hit[tail_kind(64)] == before + 1 and mid.ghost is None
    tree.check()


def test_a_conversations_heat_moves_to_its_newest_end_but_a_junction_keeps_its_own() -> None:
    pool, tree = make_tree()
    t1 = list(range(1, 40))
    e1 = publish(tree, t1, END)
    tree.use(e1)
    tree.use(e1)
    e2 = publish(tree, t1 + list(range(50, 70)), END, start=e1)
    assert (e1.hits, e2.hits) == (0, 2)  # e1 is now a waypoint on the way to e2
    # a junction with two branches keeps its hits: both branches resume there
    j = publish(tree, list(range(300, 340)), JUNCTION)
    publish(tree, list(range(300, 340)) + [1, 2, 3], END, start=j)
    tree.use(j)
    hits = j.hits
    publish(tree, list(range(300, 340)) + [9, 9, 9], END, start=j)
    assert j.hits == hits
    tree.check()


# ---- the policy in the replay ----

VOCAB = 163840  # kimi-linear-48b preset


def _cfg(gb: float, full_block: bool) -> EngineConfig:
    return EngineConfig(model="kimi-linear-48b", runner="null",
                        cache=CacheConfig(memory_gb=gb, num_pages=None, full_block_mode=full_block),
                        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_running=64))


@pytest.mark.parametrize("gb", [6, 30], ids=["under-pressure", "roomy"])
def test_agents_compute_fewer_tokens_than_the_full_block_baseline(gb) -> None:
    sessions = workloads.build("agents", VOCAB, sessions=48, turns=8, seed=3)
    k3 = replay(_cfg(gb, False), sessions, concurrency=8, open_sessions=32)
    base = replay(_cfg(gb, True), sessions, concurrency=8, open_sessions=32)
    assert k3.computed_prompt_tokens < base.computed_prompt_tokens, (k3.vs_ideal, base.vs_ideal)


def test_the_policy_learns_that_conversations_resume_from_their_ends() -> None:
    from k3rt.backend.engine import Engine

    eng = Engine(_cfg(6, False))
    sessions = workloads.build("multi-turn", VOCAB, sessions=24, turns=6, seed=1)
    ends = []
    orig = Engine.step

    def step(self):
        out = orig(self)
        ends.append(self.scheduler.tree.reuse.p(END))
        return out

    Engine.step = step
    try:
        replay(_cfg(6, False), sessions, concurrency=8, open_sessions=24)
    finally:
        Engine.step = orig
    assert ends[-1] > 0.8  # the next turn of a conversation extends the end of the last
