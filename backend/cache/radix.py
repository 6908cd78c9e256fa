"""The prefix cache (DESIGN.md §5): a radix tree of token ids whose nodes reference MLA pages and may
hold a KDA *snapshot* (a state set holding the state after exactly the node's end depth).

Invariants (asserted by `check()`, which rebuilds every count from the tree):
  * a node covers tokens [start, end) of its path; `pages[i]` is the page of block start//B + i and
    holds correct KV for every position of that block below `end` on this path;
  * a snapshot at a node holds the KDA state after exactly `end` tokens of the node's path;
  * no empty node; children keyed by their first token; a namespace (cache_salt) root exists only
    while it has children (the default namespace's root always exists);
  * an unlocked leaf always has a snapshot (KV past the deepest snapshot cannot be used: prefill must
    resume where a state exists), so evicting a leaf's snapshot deletes the leaf, iteratively;
  * `lock` = number of requests that hold this node or a descendant (protects the path to the root);
    pages and snapshot pages carry one pool reference per tree use;
  * every unpinned snapshot has exactly one live entry in the eviction heap.

Pages of tree nodes are never written again: a request that extends a partially filled page copies
it first (the scheduler does that), and snapshots are immutable.

Match returns two lengths: `kv_hit` (tokens whose KV is in the tree) and `state_hit` (the deepest
snapshot at or below kv_hit). Prefill resumes at `state_hit`.

Eviction takes snapshots in priority order from a heap (O(log n) per victim, entries invalidated
lazily); evicting a leaf's snapshot also frees the KV below it that no remaining snapshot can use.
Two priorities (`CachePolicy`):
  * "lru": least recently used snapshot first (the full-block baseline, and a reference);
  * "value": GreedyDual-Size-Frequency (Cao & Irani 1997; Cherkasova 1998), the priority of a snapshot
    is `clock + uses * recompute_saved / pages_freed`: `recompute_saved` = tokens between it and the
    nearest snapshot above it (what a request resuming here instead of there does not compute),
    `pages_freed` = its state set plus the KV pages only it keeps alive, `uses` = publishes that
    wanted it plus hits, and `clock` = the priority of the last victim (so what has not been used
    for a while ages out, whatever its value). Interior snapshots of one path save little per byte
    and go first; evicting one doubles its neighbour's saving, so paths thin out before their ends
    go. Priorities are recomputed when a victim is popped (the tree may have changed around it).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from k3rt.backend.cache.pool import PagePool


class Node:
    __slots__ = ("key", "start", "parent", "children", "pages", "snapshot", "lock", "pins", "uses", "base",
                 "heap_seq", "salt")

    def __init__(self, key: list[int], start: int, parent: Node | None) -> None:
        self.key = key
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.pages: list[int] = []
        self.snapshot: list[int] | None = None
        self.lock = 0
        self.pins = 0  # holders that need this node's snapshot kept (a DSL program between its calls)
        self.uses = 0  # publishes that wanted this snapshot + hits on it (the policy's frequency)
        self.base = 0.0  # the policy clock (or LRU tick) at the last use
        self.heap_seq = -1  # the sequence number of this node's live eviction-heap entry
        self.salt: str | None = None  # roots only: the namespace

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def __repr__(self) -> str:
        return f"Node([{self.start},{self.end}) pages={self.pages} snap={self.snapshot} lock={self.lock})"


class MatchResult(NamedTuple):
    kv_hit: int  # tokens of the query present in the tree (may end mid-node)
    state_hit: int  # end depth of the deepest snapshot at or below kv_hit (0: none)
    state_node: Node | None  # the node holding that snapshot
    block_pages: list[int]  # pages for blocks 0..ceil(state_hit / block_size)-1, in order


@dataclass(frozen=True)
class CachePolicy:
    eviction: str = "value"  # "value" (GreedyDual-Size-Frequency) or "lru"

    def __post_init__(self) -> None:
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction: {self.eviction!r} not one of value, lru")


@dataclass
class CacheStats:
    evicted_snapshots: int = 0
    evicted_pages: int = 0  # pool pages freed by evictions (snapshots and KV)


class RadixCache:
    def __init__(self, pool: PagePool, block_size: int, policy: CachePolicy | None = None) -> None:
        self.pool, self.B = pool, block_size
        self.policy = policy or CachePolicy(eviction="lru")
        self._value = self.policy.eviction == "value"
        self.roots: dict[str | None, Node] = {}
        self.root(None)
        self._tick = itertools.count(1)
        self._seq = itertools.count()
        self.clock = 0.0  # "value": the priority of the last victim
        self.heap: list[tuple[float, int, Node]] = []
        self.state_pages = pool.layout.pages_per_state_set
        self.snapshot_count = 0  # kept incrementally; check() recounts
        self.pinned_count = 0  # nodes with pins > 0
        self.node_count = 0  # nodes below the roots
        self.stats = CacheStats()

    def root(self, salt: str | None) -> Node:
        r = self.roots.get(salt)
        if r is None:
            r = self.roots[salt] = Node([], 0, None)
            r.salt = salt
        return r

    # ---- lookup ----

    def match(self, tokens: Sequence[int], salt: str | None = None, *, touch: bool = True) -> MatchResult:
        if not isinstance(tokens, list):
            tokens = list(tokens)
        node = self.roots.get(salt)
        depth, path, n = 0, [], len(tokens)
        while node is not None and depth < n:
            child = node.children.get(tokens[depth])
            if child is None:
                break
            m = _common(child.key, tokens, depth)
            path.append(child)
            depth += m
            if m < len(child.key):
                break
            node = child
        state_node = None
        for nd in reversed(path):
            if nd.snapshot is not None and nd.end <= depth:
                state_node = nd
                break
        state_hit = state_node.end if state_node is not None else 0
        pages = self._block_pages(path, state_hit)
        if touch and state_node is not None:
            self.use(state_node)  # refresh only the consumed snapshot
        return MatchResult(depth, state_hit, state_node, pages)

    def _block_pages(self, path: list[Node], depth: int) -> list[int]:
        B = self.B
        table = [-1] * ((depth + B - 1) // B)
        for n in path:
            if n.start >= depth:
                break
            first = n.start // B
            last = min(len(n.pages), len(table) - first)
            table[first:first + last] = n.pages[:last]  # deeper nodes overwrite a shared boundary block
        assert -1 not in table, "tree path lacks a page"
        return table

    # ---- insertion ----

    def insert(self, tokens: Sequence[int], block_table: Sequence[int], salt: str | None = None,
               snapshot: list[int] | None = None, *, start: Node | None = None, uses: int = 1,
               length: int | None = None) -> Node | None:
        """Publish tokens[0:length] (default: all) with the request's pages (block_table[b] = page of
        block b). `length` lets a request publish a prefix of its token list without copying it.

        The tree takes its own page references. `snapshot` (the state after all of `tokens`) is
        handed over with its reference: kept if the node has none, else released (and the existing
        one counts `uses` more uses). `start`: a node on this path at or above len(tokens) to walk
        from (the publishing request's locked node), instead of the root. `uses`: the weight the
        eviction policy starts the snapshot with (2 for a junction seen a second time). Returns the
        node ending exactly at len(tokens) (None for an empty sequence).
        """
        if not isinstance(tokens, list):
            tokens = list(tokens)
        n = len(tokens) if length is None else length
        if n == 0:
            if snapshot is not None:
                self.pool.unref(snapshot)
            return None
        node = start if start is not None and start.end <= n else self.root(salt)
        depth = node.end
        while depth < n:
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = Node(list(tokens[depth:n]), depth, node)
                first, last = depth // self.B, (n - 1) // self.B
                leaf.pages = list(block_table[first:last + 1])
                self.pool.ref(leaf.pages)
                node.children[tokens[depth]] = leaf
                self.node_count += 1
                node = leaf
                depth = n
                break
            m = _common(child.key, tokens, depth, n)
            if m < len(child.key):
                child = self._split(child, depth + m)  # m >= 1: the first token matched
            node = child
            depth = child.end
        if snapshot is not None:
            if node.snapshot is None:
                node.snapshot = snapshot
                self.snapshot_count += 1
                node.uses = uses
                self._refresh(node)
            else:
                self.pool.unref(snapshot)
                node.uses += uses
                self._refresh(node)
        elif node.snapshot is not None and not self._value:
            self._refresh(node)  # LRU: publishing a path refreshes the snapshot already at its end
        return node

    def _split(self, node: Node, at: int) -> Node:
        """Cut node [s, e) at s < at < e; returns the new upper node [s, at) (a tombstone)."""
        s, B = node.start, self.B
        assert s < at < node.end, "split must leave both halves non-empty"
        upper = Node(node.key[: at - s], s, node.parent)
        upper.pages = node.pages[: (at - 1) // B - s // B + 1]
        lower_pages = node.pages[at // B - s // B:]
        if (at - 1) // B == at // B:
            self.pool.ref([lower_pages[0]])  # the boundary page is now held by both halves
        upper.lock = node.lock
        assert node.parent is not None
        node.parent.children[upper.key[0]] = upper
        node.key, node.start, node.pages, node.parent = node.key[at - s:], at, lower_pages, upper
        upper.children[node.key[0]] = node
        self.node_count += 1
        return upper

    # ---- locks and pins ----

    def lock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        start = node
        while node is not None and node.parent is not None:
            assert node.lock > 0, f"unlock of unlocked {node}"
            node.lock -= 1
            node = node.parent
        if start is not None:
            self._prune(start)  # its snapshot may have been evicted while it was locked

    def pin(self, node: Node) -> None:
        assert node.snapshot is not None, f"pin of {node} without a snapshot"
        node.pins += 1
        if node.pins == 1:
            self.pinned_count += 1
            node.heap_seq = -1  # out of the heap: its entry is dead

    def unpin(self, node: Node) -> None:
        assert node.pins > 0, f"unpin of unpinned {node}"
        node.pins -= 1
        if node.pins == 0:
            self.pinned_count -= 1
            if node.snapshot is not None:
                self._refresh(node)

    @property
    def pinned_pages(self) -> int:
        return self.pinned_count * self.state_pages

    # ---- the eviction policy ----

    def use(self, node: Node) -> None:
        """A request resumes from node's snapshot: one more use, priority refreshed."""
        node.uses += 1
        self._refresh(node)

    def _refresh(self, node: Node) -> None:
        node.base = self.clock if self._value else next(self._tick)
        if node.pins == 0:
            self._push(node, self._priority(node))

    def _push(self, node: Node, prio: float) -> None:
        seq = next(self._seq)
        node.heap_seq = seq
        heapq.heappush(self.heap, (prio, seq, node))
        if len(self.heap) > 2 * self.snapshot_count + 256:
            self._compact()

    def _compact(self) -> None:
        self.heap = [e for e in self.heap if e[2].heap_seq == e[1] and e[2].snapshot is not None]
        heapq.heapify(self.heap)

    def _priority(self, node: Node) -> float:
        if not self._value:
            return node.base
        return node.base + node.uses * self.recompute_saved(node) / self.pages_freed(node)

    def recompute_saved(self, node: Node) -> int:
        """Tokens between node's end and the nearest snapshot above it (a resume there computes them)."""
        anc = node.parent
        while anc is not None and anc.parent is not None and anc.snapshot is None:
            anc = anc.parent
        return node.end - (anc.end if anc is not None else 0)

    def pages_freed(self, node: Node) -> int:
        """Pages evicting node's snapshot would free: its state set, plus, for an unlocked leaf, the KV
        of the path segment only it keeps alive (up to the nearest node with a snapshot, a lock or
        another child). Shared boundary pages are counted once per node (an estimate)."""
        freed = self.state_pages
        n = node
        if not n.children and n.lock == 0:
            while True:
                freed += len(n.pages)
                p = n.parent
                if p is None or p.parent is None or p.snapshot is not None or p.lock or len(p.children) > 1:
                    break
                n = p
        return freed

    # ---- eviction ----

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pool pages if possible; returns pages actually freed.

        Victims are unpinned snapshots in priority order. A snapshot that is the source of a pending
        copy carries the copier's extra page references, so evicting it from the tree never frees it
        under the copy. Evicting an unlocked leaf's snapshot deletes the leaf and its pages (and then
        every parent that became an unlocked leaf without a snapshot). Locked paths keep their pages.
        """
        if num_pages <= 0:
            return 0
        before = self.pool.num_free
        heap = self.heap
        while heap and self.pool.num_free - before < num_pages:
            prio, seq, n = heapq.heappop(heap)
            if n.heap_seq != seq or n.snapshot is None:
                continue  # a stale entry (re-pushed, pinned or already evicted)
            if self._value:
                now = self._priority(n)
                if now > prio + 1e-9:  # the tree changed around it (an ancestor snapshot went): requeue
                    self._push(n, now)
                    continue
                self.clock = max(self.clock, prio)
            self._drop_snapshot(n)
        freed = self.pool.num_free - before
        self.stats.evicted_pages += freed
        return freed

    def _drop_snapshot(self, n: Node) -> None:
        snap, n.snapshot = n.snapshot, None
        n.heap_seq = -1
        self.snapshot_count -= 1
        self.stats.evicted_snapshots += 1
        self.pool.unref(snap)
        self._prune(n)

    def _prune(self, n: Node) -> None:
        """Delete n and its ancestors while they are unlocked leaves without a snapshot; then a
        namespace root left without children."""
        while n.parent is not None and not n.children and n.snapshot is None and n.lock == 0:
            parent = n.parent
            del parent.children[n.key[0]]
            self.pool.unref(n.pages)
            self.node_count -= 1
            n.parent = None
            n = parent
        if n.parent is None and not n.children and n.salt is not None and self.roots.get(n.salt) is n:
            del self.roots[n.salt]

    def reset(self) -> None:
        """Drop every unlocked node's snapshot (tests and `flush_cache`); pinned ones stay."""
        while self.evict(self.pool.num_pages):
            pass

    def drop_all(self) -> None:
        """Drop every unlocked snapshot, pinned or not (the caller forgets its pins)."""
        for n in list(self._nodes()):
            if n.pins:
                n.pins = 0
                self.pinned_count -= 1
                self._push(n, self._priority(n))
        self.reset()

    # ---- introspection ----

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def num_nodes(self) -> int:
        return self.node_count

    def num_snapshots(self) -> int:
        return sum(1 for n in self._nodes() if n.snapshot is not None)

    def tree_page_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for n in self._nodes():
            for p in n.pages + (n.snapshot or []):
                refs[p] = refs.get(p, 0) + 1
        return refs

    def check(self, lock_holders: Sequence[Node] = ()) -> None:
        """Rebuild every count from the tree and assert the invariants (tests run this after every op)."""
        B = self.B
        expected_lock: dict[int, int] = {}
        for h in lock_holders:
            n = h
            while n is not None and n.parent is not None:
                expected_lock[id(n)] = expected_lock.get(id(n), 0) + 1
                n = n.parent
        assert None in self.roots, "the default namespace lost its root"
        for salt, r in self.roots.items():
            assert r.parent is None and not r.key and r.snapshot is None and not r.pages and r.salt == salt
            assert salt is None or r.children, f"namespace {salt!r}: an empty root was kept"
            for tok, c in r.children.items():
                assert c.parent is r and c.start == 0 and c.key[0] == tok
        live = {seq for _, seq, n in self.heap if n.heap_seq == seq}
        pinned = 0
        for n in self._nodes():
            assert n.key, f"empty node {n}"
            assert n.parent is not None and n.parent.children.get(n.key[0]) is n
            assert n.start == n.parent.end, f"{n} does not start where its parent ends"
            assert len(n.pages) == (n.end - 1) // B - n.start // B + 1, f"{n}: wrong page count"
            assert n.lock == expected_lock.get(id(n), 0), f"{n}: lock {n.lock} != {expected_lock.get(id(n), 0)}"
            if not n.children and n.lock == 0:
                assert n.snapshot is not None, f"unlocked leaf without snapshot {n}"
            if n.snapshot is not None:
                assert len(n.snapshot) == self.state_pages
                if n.pins == 0:
                    assert n.heap_seq in live, f"{n}: evictable snapshot missing from the eviction heap"
            assert n.pins >= 0 and (not n.pins or n.snapshot is not None), f"{n}: pinned without a snapshot"
            pinned += n.pins > 0
        assert self.snapshot_count == self.num_snapshots(), "snapshot count drifted"
        assert self.node_count == sum(1 for _ in self._nodes()), "node count drifted"
        assert self.pinned_count == pinned, "pinned count drifted"
        for p, k in self.tree_page_refs().items():
            assert self.pool.refcount[p] >= k, f"page {p}: refcount {self.pool.refcount[p]} < tree refs {k}"


def _common(key: list[int], tokens: list[int], offset: int, end: int | None = None) -> int:
    """Length of the common prefix of key and tokens[offset:end], compared in slices (C speed)."""
    kl = len(key)
    n = min(kl, (len(tokens) if end is None else end) - offset)
    if (key if n == kl else key[:n]) == tokens[offset:offset + n]:
        return n
    lo, hi = 0, n  # key[:lo] matches, key[:hi] does not
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if key[lo:mid] == tokens[offset + lo:offset + mid]:
            lo = mid
        else:
            hi = mid
    while key[lo] == tokens[offset + lo]:
        lo += 1
    return lo


def common_prefix(a: list[int], b: list[int], n: int) -> int:
    """Length of the common prefix of a[:n] and b[:n] (both at least n long)."""
    return _common(a, b, 0, n) if n > 0 else 0
