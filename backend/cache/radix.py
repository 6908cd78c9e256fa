"""The prefix cache (DESIGN.md §5): a radix tree of token ids whose nodes reference MLA pages and may
hold a KDA *snapshot* (a state set holding the state after exactly the node's end depth).

Invariants (asserted by `check()`, which rebuilds every count from the tree):
  * a node covers tokens [start, end) of its path; `pages[i]` is the page of block start//B + i and
    holds correct KV for every position of that block below `end` on this path;
  * a snapshot at a node holds the KDA state after exactly `end` tokens of the node's path;
  * no empty node; children keyed by their first token; every namespace (cache_salt) has its root;
  * an unlocked leaf always has a snapshot (KV past the deepest snapshot cannot be used: prefill must
    resume where a state exists), so evicting a leaf's snapshot deletes the leaf, iteratively;
  * `lock` = number of requests that hold this node or a descendant (protects the path to the root);
    pages and snapshot pages carry one pool reference per tree use.

Pages of tree nodes are never written again: a request that extends a partially filled page copies
it first (the scheduler does that), and snapshots are immutable.

Match returns two lengths: `kv_hit` (tokens whose KV is in the tree) and `state_hit` (the deepest
snapshot at or below kv_hit). Prefill must resume at `state_hit`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

from k3rt.backend.cache.pool import PagePool


class Node:
    __slots__ = ("key", "start", "parent", "children", "pages", "snapshot", "lock", "last_access", "pins")

    def __init__(self, key: list[int], start: int, parent: Node | None) -> None:
        self.key = key
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.pages: list[int] = []
        self.snapshot: list[int] | None = None
        self.lock = 0
        self.last_access = 0
        self.pins = 0  # holders that need this node's snapshot kept (a DSL program between its calls)

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


class RadixCache:
    def __init__(self, pool: PagePool, block_size: int) -> None:
        self.pool, self.B = pool, block_size
        self.roots: dict[str | None, Node] = {}
        self._tick = itertools.count(1)
        self.state_pages = pool.layout.pages_per_state_set
        self.snapshot_count = 0  # kept incrementally; check() recounts

    def root(self, salt: str | None) -> Node:
        r = self.roots.get(salt)
        if r is None:
            r = self.roots[salt] = Node([], 0, None)
        return r

    # ---- lookup ----

    def match(self, tokens: Sequence[int], salt: str | None = None, *, touch: bool = True) -> MatchResult:
        node, depth, path = self.root(salt), 0, []
        while depth < len(tokens):
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
        for n in path:
            if n.snapshot is not None and n.end <= depth:
                state_node = n
        state_hit = state_node.end if state_node is not None else 0
        pages = self._block_pages(path, state_hit)
        if touch and state_node is not None:
            state_node.last_access = next(self._tick)  # refresh only the consumed snapshot
        return MatchResult(depth, state_hit, state_node, pages)

    def _block_pages(self, path: list[Node], depth: int) -> list[int]:
        B = self.B
        table = [-1] * ((depth + B - 1) // B)
        for n in path:
            if n.start >= depth:
                break
            first = n.start // B
            for i, p in enumerate(n.pages):
                b = first + i
                if b * B < min(n.end, depth) and b < len(table):
                    table[b] = p  # deeper nodes overwrite a shared boundary block
        assert -1 not in table, "tree path lacks a page"
        return table

    # ---- insertion ----

    def insert(self, tokens: Sequence[int], block_table: Sequence[int], salt: str | None = None,
               snapshot: list[int] | None = None) -> Node | None:
        """Publish tokens[0:len] with the request's pages (block_table[b] = page of block b).

        The tree takes its own page references. `snapshot` (the state after all of `tokens`) is
        handed over with its reference: kept if the node has none, else released. Returns the node
        ending exactly at len(tokens) (None for an empty sequence).
        """
        n = len(tokens)
        if n == 0:
            if snapshot is not None:
                self.pool.unref(snapshot)
            return None
        node, depth = self.root(salt), 0
        tick = next(self._tick)
        while depth < n:
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = Node(list(tokens[depth:n]), depth, node)
                first, last = depth // self.B, (n - 1) // self.B
                leaf.pages = list(block_table[first:last + 1])
                self.pool.ref(leaf.pages)
                node.children[tokens[depth]] = leaf
                node = leaf
                depth = n
                break
            m = _common(child.key, tokens, depth)
            if m < len(child.key):
                child = self._split(child, depth + m)  # m >= 1: the first token matched
            node = child
            depth = child.end
        node.last_access = max(node.last_access, tick)
        if snapshot is not None:
            if node.snapshot is None:
                node.snapshot = snapshot
                self.snapshot_count += 1
            else:
                self.pool.unref(snapshot)
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
        upper.lock, upper.last_access = node.lock, node.last_access
        assert node.parent is not None
        node.parent.children[upper.key[0]] = upper
        node.key, node.start, node.pages, node.parent = node.key[at - s:], at, lower_pages, upper
        upper.children[node.key[0]] = node
        return upper

    # ---- locks ----

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

    # ---- eviction ----

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pool pages if possible; returns pages actually freed.

        Candidates are all unpinned snapshots, least recently used first; ties go to the snapshot that saves
        the least recompute per byte. A snapshot that is the source of a pending copy carries the
        copier's extra page references, so evicting it from the tree never frees it under the copy.
        Evicting an unlocked leaf's snapshot deletes the leaf and its pages (and then every parent
        that became an unlocked leaf without a snapshot). Locked paths keep their pages.
        """
        if num_pages <= 0:
            return 0
        before = self.pool.num_free
        heap = [(n.last_access, self._saved_per_byte(n), id(n), n) for n in self._nodes()
                if n.snapshot is not None and not n.pins]
        heapq.heapify(heap)
        while heap and self.pool.num_free - before < num_pages:
            *_, n = heapq.heappop(heap)
            if n.snapshot is None:
                continue
            snap, n.snapshot = n.snapshot, None
            self.snapshot_count -= 1
            self.pool.unref(snap)
            self._prune(n)
        return self.pool.num_free - before

    def _saved_per_byte(self, n: Node) -> float:
        anc, d = n.parent, 0
        while anc is not None and anc.parent is not None:
            if anc.snapshot is not None:
                d = anc.end
                break
            anc = anc.parent
        return (n.end - d) / max(1, self.state_pages)

    def _prune(self, n: Node) -> None:
        """Delete n and its ancestors while they are unlocked leaves without a snapshot."""
        while n.parent is not None and not n.children and n.snapshot is None and n.lock == 0:
            parent = n.parent
            del parent.children[n.key[0]]
            self.pool.unref(n.pages)
            n.parent = None
            n = parent

    def reset(self) -> None:
        """Drop every unlocked node (tests and `flush_cache`)."""
        while self.evict(self.pool.num_pages):
            pass

    # ---- introspection ----

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

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
        for salt, r in self.roots.items():
            assert r.parent is None and not r.key and r.snapshot is None and not r.pages
            for tok, c in r.children.items():
                assert c.parent is r and c.start == 0 and c.key[0] == tok
        for n in self._nodes():
            assert n.key, f"empty node {n}"
            assert n.parent is not None and n.parent.children.get(n.key[0]) is n
            assert n.start == n.parent.end, f"{n} does not start where its parent ends"
            assert len(n.pages) == (n.end - 1) // B - n.start // B + 1, f"{n}: wrong page count"
            assert n.lock == expected_lock.get(id(n), 0), f"{n}: lock {n.lock} != {expected_lock.get(id(n), 0)}"
            for c in n.children.values():
                assert c.key[0] not in (k for k in n.children if n.children[k] is not c)
            if not n.children and n.lock == 0:
                assert n.snapshot is not None, f"unlocked leaf without snapshot {n}"
            if n.snapshot is not None:
                assert len(n.snapshot) == self.state_pages
            assert n.pins >= 0 and (not n.pins or n.snapshot is not None), f"{n}: pinned without a snapshot"
        assert self.snapshot_count == self.num_snapshots(), "snapshot count drifted"
        for p, k in self.tree_page_refs().items():
            assert self.pool.refcount[p] >= k, f"page {p}: refcount {self.pool.refcount[p]} < tree refs {k}"


def _common(key: list[int], tokens: Sequence[int], offset: int) -> int:
    n = min(len(key), len(tokens) - offset)
    i = 0
    while i < n and key[i] == tokens[offset + i]:
        i += 1
    return i
