"""The radix prefix cache (DESIGN.md §5) over a small accounting-only page pool (block 16 tokens).

Exact match lengths (kv_hit, state_hit) and block pages after inserts; node splits (start/end, which
half keeps the snapshot, the shared boundary page's extra reference); namespaces never share; lock
counts along the path, also across a split; LRU eviction order with the exact page ids freed, only the
consumed snapshot refreshed by a match; the tombstone-leaf cascade; a locked path keeps its pages when
its snapshot goes. A seeded random sequence of request-like inserts, matches, locks, unlocks and
evictions checks `check()`, exact pool refcounts, match results against a brute-force search of the
tree, and (through a simulated page content) that every matched page holds this path's KV.
"""

from __future__ import annotations

import random

import pytest

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.cache.radix import Node, RadixCache
from k3rt.cache_layout import CacheLayout

B = 16


def make_tree(num_pages: int = 64, state_pages: int = 1) -> tuple[PagePool, RadixCache]:
    layout = CacheLayout(block_size=B, page_size_bytes=B * 32, kda_conv_bytes=32, kda_state_bytes=160,
                         mla_bytes_per_token=32, group_size=1, mla_group=(99,),
                         kda_groups=tuple((i,) for i in range(state_pages)),
                         kv_dtype="float32", conv_dtype="float32", state_dtype="float32")
    pool = PagePool(layout, num_pages, materialize=False)
    return pool, RadixCache(pool, B)


def publish(tree: RadixCache, tokens: list[int], table: list[int] | None = None, salt: str | None = None,
            snapshot: bool = True) -> tuple[Node, list[int], list[int] | None]:
    """A finished request: its block table (fresh pages unless given) and a snapshot go to the tree."""
    pool = tree.pool
    if table is None:
        table = pool.allocate((len(tokens) + B - 1) // B)
    else:
        pool.ref(table)
    snap = pool.allocate(tree.state_pages) if snapshot else None
    node = tree.insert(tokens, table, salt, snapshot=snap)
    pool.unref(table)
    return node, table, snap


def tree_refs_equal_pool(tree: RadixCache) -> None:
    refs = tree.tree_page_refs()
    assert [refs.get(p, 0) for p in range(tree.pool.num_pages)] == tree.pool.refcount
    assert sorted(tree.pool.free_list) == [p for p in range(tree.pool.num_pages) if p not in refs]


def shape(tree: RadixCache, salt: str | None = None) -> list[tuple]:
    """(start, end, pages, snapshot, lock) of every node, depth first in token order."""
    out = []

    def walk(n: Node) -> None:
        for t in sorted(n.children):
            c = n.children[t]
            out.append((c.start, c.end, c.pages, c.snapshot, c.lock))
            walk(c)
    walk(tree.root(salt))
    return out


A = list(range(100, 140))  # 40 tokens: blocks [0,16) [16,32) [32,40)


def test_match_lengths_and_pages():
    pool, tree = make_tree()
    node, table, snap = publish(tree, A)
    assert (table, snap) == ([0, 1, 2], [3])
    assert shape(tree) == [(0, 40, [0, 1, 2], [3], 0)]
    assert pool.refcount[:5] == [1, 1, 1, 1, 0]
    cases = {
        "exact": (A, (40, 40, [0, 1, 2])),
        "longer": (A + [7, 8], (40, 40, [0, 1, 2])),
        "one_short": (A[:39], (39, 0, [])),  # KV is there, but no state at or below 39
        "diverge_mid_node": (A[:25] + [1, 2], (25, 0, [])),
        "miss": ([7] + A, (0, 0, [])),
        "empty": ([], (0, 0, [])),
    }
    for name, (q, want) in cases.items():
        m = tree.match(q)
        assert (m.kv_hit, m.state_hit, m.block_pages) == want, name
        assert m.state_node is (node if want[1] else None), name
    tree.check()
    tree_refs_equal_pool(tree)


def test_split_mid_block_shares_the_boundary_page():
    pool, tree = make_tree()
    lower, _, _ = publish(tree, A)
    upper = tree.insert(A[:20], [], snapshot=pool.allocate(1))  # the path exists: no pages taken from the table
    assert upper is not lower and lower.parent is upper
    # the upper half is new and holds the new snapshot; the original node keeps its own
    assert shape(tree) == [(0, 20, [0, 1], [4], 0), (20, 40, [1, 2], [3], 0)]
    assert pool.refcount[1] == 2  # block 1 = tokens 16..31 is held by both halves
    m = tree.match(A[:30])
    assert (m.kv_hit, m.state_hit, m.state_node, m.block_pages) == (30, 20, upper, [0, 1])
    m = tree.match(A)
    assert (m.kv_hit, m.state_hit, m.state_node, m.block_pages) == (40, 40, lower, [0, 1, 2])
    # a split on a block boundary shares nothing
    mid = tree.insert(A[:32], [], snapshot=pool.allocate(1))
    assert shape(tree) == [(0, 20, [0, 1], [4], 0), (20, 32, [1], [5], 0), (32, 40, [2], [3], 0)]
    assert (mid.start, mid.end, lower.start) == (20, 32, 32)
    assert pool.refcount[:6] == [1, 2, 1, 1, 1, 1]
    # a split without a snapshot leaves a tombstone; a match ending in it stops at the snapshot above
    tree.insert(A[:36], [], snapshot=None)
    assert shape(tree)[2:] == [(32, 36, [2], None, 0), (36, 40, [2], [3], 0)]
    assert pool.refcount[2] == 2
    m = tree.match(A[:38])
    assert (m.kv_hit, m.state_hit, m.block_pages) == (38, 32, [0, 1])
    tree.check()
    tree_refs_equal_pool(tree)


def test_branch_uses_its_own_pages_after_the_junction():
    pool, tree = make_tree()
    publish(tree, A)
    other = A[:20] + list(range(500, 520))
    # as the scheduler builds it: block 0 shared, block 1 copied (copy-on-write), block 2 new
    cow, new = pool.allocate(2)
    pool.ref([0])
    leaf, _, snap = publish(tree, other, table=[0, cow, new])
    pool.unref([0, cow, new])
    # the junction shares the branch's copy of block 1 (it holds the junction's positions too)
    assert shape(tree) == [(0, 20, [0, cow], None, 0), (20, 40, [1, 2], [3], 0), (20, 40, [cow, new], snap, 0)]
    m = tree.match(other)
    assert (m.kv_hit, m.state_hit, m.state_node, m.block_pages) == (40, 40, leaf, [0, cow, new])
    m = tree.match(A[:20] + [0])
    assert (m.kv_hit, m.state_hit) == (20, 0)  # the junction has no snapshot
    tree.check()
    tree_refs_equal_pool(tree)


def test_extending_a_partial_page_through_a_copy_leaves_no_dead_page():
    """A conversation's next turn resumes mid-page (copy-on-write) and publishes its end: the old
    partial page, which the copy supersedes on this path, was kept alive for the life of the path
    (one dead page per turn); now the path's nodes share the copy and the original is freed."""
    pool, tree = make_tree()
    turn1, table1, _ = publish(tree, A)  # 40 tokens: blocks [0,16) [16,32) [32,40): pages 0, 1, 2
    mid = tree.insert(A[:36], [], snapshot=None)  # a node ending in the same page, above turn 1's end
    assert mid.pages[-1] == 2 and turn1.pages[-1] == 2
    cow = pool.allocate(1)[0]  # turn 2: blocks 0-1 shared, block 2 copied, then extended into block 3
    nxt = pool.allocate(1)[0]
    pool.ref([0, 1])
    turn2, _, _ = publish(tree, A + list(range(60, 70)), table=[0, 1, cow, nxt])
    pool.unref([0, 1, cow, nxt])
    assert mid.pages[-1] == cow and turn1.pages[-1] == cow and turn2.pages == [cow, nxt]
    assert pool.refcount[2] == 0 and 2 in pool.free_list  # the original partial page is free
    m = tree.match(A + [7])
    assert (m.kv_hit, m.state_hit, m.block_pages) == (40, 40, [0, 1, cow])
    tree.check()
    tree_refs_equal_pool(tree)


def test_namespaces_never_share():
    pool, tree = make_tree()
    plain, _, _ = publish(tree, A)
    salted, table, snap = publish(tree, A, salt="tenant-1")
    assert salted is not plain and set(table + snap).isdisjoint([0, 1, 2, 3])
    assert tree.match(A, "tenant-1").block_pages == table
    assert tree.match(A).block_pages == [0, 1, 2]
    m = tree.match(A, "tenant-2")
    assert (m.kv_hit, m.state_hit) == (0, 0)
    assert shape(tree, "tenant-1") == [(0, 40, table, snap, 0)]
    # splitting one namespace leaves the other untouched
    tree.insert(A[:20], [], "tenant-1", snapshot=pool.allocate(1))
    assert shape(tree) == [(0, 40, [0, 1, 2], [3], 0)]
    tree.check()
    tree_refs_equal_pool(tree)


def test_lock_counts_along_the_path_and_across_splits():
    pool, tree = make_tree()
    a, _, _ = publish(tree, A)
    b, _, _ = publish(tree, A[:20] + list(range(500, 520)))
    junction = a.parent
    assert junction is b.parent and junction.end == 20
    tree.lock(b)
    tree.lock(a)
    tree.lock(a)
    assert (junction.lock, a.lock, b.lock) == (3, 2, 1)
    tree.check([a, a, b])
    with pytest.raises(AssertionError, match="lock"):
        tree.check([a, b])  # a count that does not match the holders is caught
    # a split of a locked node: the new upper half carries the same count
    upper = tree.insert(A[:36], [], snapshot=pool.allocate(1))
    assert upper.parent is junction and a.parent is upper and (upper.lock, a.lock) == (2, 2)
    tree.check([a, a, b])
    tree.unlock(a)
    tree.unlock(a)
    tree.unlock(b)
    assert [n.lock for n in tree._nodes()] == [0, 0, 0, 0]
    tree.check()
    with pytest.raises(AssertionError, match="unlock of unlocked"):
        tree.unlock(b)


def test_eviction_is_lru_with_exact_pages():
    pool, tree = make_tree(num_pages=16)
    x, _, _ = publish(tree, list(range(1, 33)))  # pages [0, 1], snapshot [2]
    y, _, _ = publish(tree, list(range(2000, 2020)))  # pages [3, 4], snapshot [5]
    z, _, _ = publish(tree, list(range(3000, 3010)))  # page [6], snapshot [7]
    assert (x.pages, x.snapshot, y.pages, y.snapshot, z.pages, z.snapshot) == ([0, 1], [2], [3, 4], [5], [6], [7])
    tree.match(list(range(1, 33)))  # x is now the most recently used
    assert tree.evict(0) == 0
    free_before = set(pool.free_list)
    assert tree.evict(1) == 3  # y: its snapshot, then its pages (the leaf goes with it)
    assert set(pool.free_list) - free_before == {3, 4, 5}
    assert pool.free_list[-3:] == [5, 4, 3]
    assert [n.key[0] for n in tree._nodes()] and {n.key[0] for n in tree._nodes()} == {1, 3000}
    tree.check()
    assert tree.evict(2) == 2  # z only: x is newer
    assert {n.key[0] for n in tree._nodes()} == {1}
    assert tree.evict(100) == 3  # everything left
    assert pool.num_free == 16 and not list(tree._nodes())
    tree.check()


def test_match_refreshes_only_the_consumed_snapshot():
    pool, tree = make_tree()
    seq = list(range(1, 129))
    outer, _, _ = publish(tree, seq[:64])  # pages [0..3], snapshot [4]
    inner, _, _ = publish(tree, seq)  # a new leaf [64, 128) below it
    assert tree.match(seq + [5]).state_node is inner  # refreshes inner, not its ancestor
    assert tree.evict(1) == 1  # the ancestor's snapshot goes first; its node stays (it has a child)
    assert outer.snapshot is None and outer.parent is not None and outer.pages == [0, 1, 2, 3]
    assert pool.free_list[-1] == 4
    m = tree.match(seq)
    assert (m.kv_hit, m.state_hit) == (128, 128)
    m = tree.match(seq[:100])
    assert (m.kv_hit, m.state_hit) == (100, 0)
    tree.check()
    tree_refs_equal_pool(tree)


def test_leaf_eviction_deletes_tombstone_leaves_in_cascade():
    pool, tree = make_tree()
    a, _, _ = publish(tree, A)
    tree.insert(A[:30], [], snapshot=pool.allocate(1))
    t20 = tree.insert(A[:20], [], snapshot=None)  # a tombstone between root and [20, 30)
    t10 = tree.insert(A[:10], [], snapshot=None)
    assert shape(tree) == [(0, 10, [0], None, 0), (10, 20, [0, 1], None, 0), (20, 30, [1], [4], 0),
                           (30, 40, [1, 2], [3], 0)]
    assert (t20.start, t10.end) == (10, 10)
    # a's snapshot is the oldest: its leaf goes, [20, 30) becomes a leaf that still has a snapshot
    assert tree.evict(1) == 2  # snapshot 3 and page 2 (page 1 is still held by [20, 30))
    assert shape(tree) == [(0, 10, [0], None, 0), (10, 20, [0, 1], None, 0), (20, 30, [1], [4], 0)]
    tree.check()
    # the last snapshot: its leaf and then both tombstones above it go, in one eviction
    assert tree.evict(1) == 3
    assert shape(tree) == [] and pool.num_free == pool.num_pages
    tree.check()


def test_evicting_a_snapshot_on_a_locked_path_keeps_its_pages():
    pool, tree = make_tree()
    a, _, _ = publish(tree, A)
    mid = tree.insert(A[:20], [], snapshot=pool.allocate(1))
    tree.lock(a)
    assert tree.evict(100) == 2  # both snapshots (pages 3 and 4), no KV page
    assert shape(tree) == [(0, 20, [0, 1], None, 1), (20, 40, [1, 2], None, 1)]
    assert (mid.snapshot, a.snapshot) == (None, None)
    tree.check([a])  # a locked leaf may be state-less
    assert tree.match(A).state_hit == 0
    tree.unlock(a)  # the unlock prunes the now useless path
    assert shape(tree) == [] and pool.num_free == pool.num_pages
    tree.check()


def test_reset_drops_everything_unlocked():
    pool, tree = make_tree()
    a, _, _ = publish(tree, A)
    b, _, _ = publish(tree, list(range(7, 60)), salt="s")
    tree.lock(b)
    tree.reset()
    assert shape(tree) == [] and shape(tree, "s") == [(0, 53, b.pages, None, 1)]
    tree.unlock(b)
    assert pool.num_free == pool.num_pages and tree.num_snapshots() == 0
    tree.check()


# ---- randomized: request-like sequences of operations, everything checked after each ----

class Sim:
    """Drives a RadixCache the way the scheduler does, with simulated page contents.

    content[page][offset] is the (salt, token prefix) whose KV the position holds, so a matched page
    can be checked to hold exactly this path's KV; snap[page] is the (salt, prefix) a snapshot is of.
    """

    def __init__(self, seed: int, num_pages: int, state_pages: int) -> None:
        self.rng = random.Random(seed)
        self.pool, self.tree = make_tree(num_pages, state_pages)
        self.content: dict[int, dict[int, tuple]] = {}
        self.snap: dict[int, tuple] = {}
        self.holders: list[Node] = []
        self.bases = [[self.rng.randrange(1, 40) for _ in range(130)] for _ in range(3)]

    def seq(self) -> tuple[list[int], str | None]:
        base = self.rng.choice(self.bases)
        k = self.rng.choice([0, self.rng.randrange(130), 16, 32, 48, 64, 100, 130])
        tail = [self.rng.randrange(1, 40) for _ in range(self.rng.choice([0, 1, 5, 17, 40]))]
        s = base[:k] + tail
        return (s or [1]), self.rng.choice([None, None, "x"])

    def alloc(self, n: int, hold: list[int]) -> list[int] | None:
        if self.pool.num_free < n:
            self.tree.evict(n - self.pool.num_free)
        if self.pool.num_free < n:
            return None
        pages = self.pool.allocate(n)
        for p in pages:
            self.content[p] = {}
            self.snap.pop(p, None)
        hold += pages
        return pages

    def verify_match(self, q: list[int], salt: str | None) -> None:
        m = self.tree.match(q, salt, touch=False)
        best_kv, best_state, best_node = 0, 0, None
        for n in self.tree._nodes():
            path, r = [], n
            while r.parent is not None:
                path[:0] = r.key
                r = r.parent
            if r is not self.tree.roots.get(salt):
                continue
            lcp = 0
            while lcp < min(len(path), len(q)) and path[lcp] == q[lcp]:
                lcp += 1
            best_kv = max(best_kv, lcp)
            if n.snapshot is not None and lcp == len(path) and n.end > best_state:
                best_state, best_node = n.end, n
        assert (m.kv_hit, m.state_hit, m.state_node) == (best_kv, best_state, best_node)
        assert len(m.block_pages) == -(-m.state_hit // B)
        for pos in range(m.state_hit):
            page = m.block_pages[pos // B]
            assert self.content[page].get(pos % B) == (salt, tuple(q[:pos + 1])), f"page {page} pos {pos}"
        if best_node is not None:
            for p in best_node.snapshot:
                assert self.snap[p] == (salt, tuple(q[:m.state_hit]))

    def check(self, extra_holders: list[Node] = ()) -> None:
        self.tree.check(self.holders + list(extra_holders))
        for _ in range(2):
            self.verify_match(*self.seq())

    def run_request(self) -> None:
        """Match, copy-on-write the partial block, compute the rest, publish snapshots on the way."""
        seq, salt = self.seq()
        self.verify_match(seq, salt)
        m = self.tree.match(seq, salt)
        full = m.state_hit // B
        table = m.block_pages[:full]
        self.pool.ref(table)
        held = list(table)
        lock = m.state_node
        self.tree.lock(lock)
        try:
            if m.state_hit % B:
                cow = self.alloc(1, held)
                if cow is None:
                    return
                self.content[cow[0]] = dict(self.content[m.block_pages[full]])
                table += cow
            need = -(-len(seq) // B) - len(table)
            new = self.alloc(need, held)
            if new is None:
                return
            table += new
            for pos in range(m.state_hit, len(seq)):
                self.content[table[pos // B]][pos % B] = (salt, tuple(seq[:pos + 1]))
            points = {p for p in range(B, len(seq) + 1, B) if self.rng.random() < 0.5}
            points.add(self.rng.randrange(1, len(seq) + 1))  # off the block grid: partial tails
            if self.rng.random() < 0.7:
                points.add(len(seq))
            points = sorted(points)
            for p in points:
                if p <= m.state_hit:
                    continue
                snap = self.alloc(self.tree.state_pages, [])
                if snap is None:
                    continue
                for s in snap:
                    self.snap[s] = (salt, tuple(seq[:p]))
                node = self.tree.insert(seq[:p], table, salt, snapshot=snap)
                assert node.end == p
                self.tree.lock(node)
                self.tree.unlock(lock)
                lock = node
                self.check([lock])
        finally:
            self.tree.unlock(lock)
            self.pool.unref(held)

    def step(self) -> str:
        op = self.rng.choices(["request", "lock", "unlock", "evict"], weights=[5, 1, 1, 1])[0]
        if op == "request":
            self.run_request()
        elif op == "lock":
            seq, salt = self.seq()
            node = self.tree.match(seq, salt).state_node
            if node is not None:
                self.tree.lock(node)
                self.holders.append(node)
        elif op == "unlock" and self.holders:
            self.tree.unlock(self.holders.pop(self.rng.randrange(len(self.holders))))
        elif op == "evict":
            want = self.rng.randrange(1, 7)
            before = self.pool.num_free
            got = self.tree.evict(want)
            assert got == self.pool.num_free - before
            if got < want:
                assert self.tree.num_snapshots() == 0  # it only stops short when nothing is left to evict
        return op


@pytest.mark.parametrize("seed, num_pages, state_pages", [(0, 24, 1), (1, 40, 2), (2, 64, 1), (3, 20, 3)],
                         ids=["24pages-S1", "40pages-S2", "64pages-S1", "20pages-S3"])
def test_random_operations_keep_every_invariant(seed, num_pages, state_pages):
    sim = Sim(seed, num_pages, state_pages)
    ops = []
    for _ in range(300):
        ops.append(sim.step())
        sim.check()
        tree_refs_equal_pool(sim.tree)
    assert ops.count("request") > 100 and sim.tree.num_snapshots() > 0
    while sim.holders:
        sim.tree.unlock(sim.holders.pop())
    sim.tree.reset()
    sim.check()
    assert sim.pool.num_free == num_pages
