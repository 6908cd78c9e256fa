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

Eviction takes snapshots in priority order from heaps (O(log n) per victim, entries invalidated
lazily); evicting a leaf's snapshot also frees the KV below it that no remaining snapshot can use.
Two priorities (`CachePolicy`, backend/cache/policy.py):
  * "lru": least recently used snapshot first (the full-block baseline, and a reference);
  * "value": value per page decayed by age, ln(value) - age / horizon(kind), where value = (hits +
    P(kind)) * recompute_saved / pages_freed (policy.py explains it); one heap per kind, keyed by
    ln(value) + last_use / horizon(kind), so that heads of different kinds compare at the current
    time. Interior snapshots of one path save little per page and go first; evicting one doubles its
    neighbour's saving, so paths thin out before their ends go. Priorities are recomputed when a
    victim is popped (the tree may have changed around it), and a parent's when its last child goes
    (it became a leaf). Evicted snapshots leave ghosts (`Ghost`) that let the policy learn from the
    requests that would have resumed from them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from k3rt.backend.cache.policy import CONFIRMED, END, PREEMPTED, CachePolicy, ReuseStats
from k3rt.backend.cache.pool import PagePool


class Node:
    __slots__ = ("key", "start", "parent", "children", "pages", "snapshot", "lock", "pins", "hits", "used", "kind",
                 "base", "heap_seq", "salt", "ghost", "ghosts")

    def __init__(self, key: list[int], start: int, parent: Node | None) -> None:
        self.key = key
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.pages: list[int] = []
        self.snapshot: list[int] | None = None
        self.lock = 0
        self.pins = 0  # holders that need this node's snapshot kept (a DSL program between its calls)
        self.hits = 0  # requests that resumed from this snapshot (or published it again): its heat
        self.used = False  # resumed from at least once (the heat may have moved on: a conversation's old end)
        self.kind = ""  # what the snapshot was published for (policy.py)
        self.base = 0.0  # the policy clock (or LRU tick) at the last use
        self.heap_seq = -1  # the sequence number of this node's live eviction-heap entry
        self.salt: str | None = None  # roots only: the namespace
        self.ghost: Ghost | None = None  # the snapshot this node had, evicted (its KV is still here)
        self.ghosts: dict[int, list[Ghost]] | None = None  # evicted paths below it, by first token

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def __repr__(self) -> str:
        return f"Node([{self.start},{self.end}) pages={self.pages} snap={self.snapshot} lock={self.lock})"


class Ghost(NamedTuple):
    """What the tree remembers of an evicted snapshot (no memory of the model's: a fingerprint): where
    it was, what it was for and when it was last used. A request that would have resumed from it
    tells the policy that its kind is reused, and after how long (ARC's ghost lists, for kinds)."""

    length: int  # tokens from the node it hangs on to the snapshot's depth (0: on that node itself)
    fingerprint: int  # hash of those tokens
    kind: str
    base: float  # the policy clock at its last use
    was_hit: bool


class MatchResult(NamedTuple):
    kv_hit: int  # tokens of the query present in the tree (may end mid-node)
    state_hit: int  # end depth of the deepest snapshot at or below kv_hit (0: none)
    state_node: Node | None  # the node holding that snapshot
    block_pages: list[int]  # pages for blocks 0..ceil(state_hit / block_size)-1, in order


@dataclass
class CacheStats:
    evicted_snapshots: int = 0
    evicted_pages: int = 0  # pool pages freed by evictions (snapshots and KV)


class RadixCache:
    def __init__(self, pool: PagePool, block_size: int, policy: CachePolicy | None = None) -> None:
        self.pool, self.B = pool, block_size
        self.policy = policy or CachePolicy(eviction="lru")
        self._value = self.policy.eviction == "value"
        self.reuse = ReuseStats(self.policy.decay)
        self.roots: dict[str | None, Node] = {}
        self.root(None)
        self._tick = itertools.count(1)
        self._seq = itertools.count()
        # eviction heaps: "lru" one, keyed by access tick; "value" one per snapshot kind, keyed by
        # ln(value) + last_use / horizon(kind) (see _key), compared across kinds at the current time
        self.heaps: dict[str, list[tuple[float, int, Node]]] = {}
        self._entries = 0  # heap entries, live or stale (for compaction)
        self._learning = True  # evictions teach the policy (not a flush)
        self._ghost_fifo: deque[tuple[Node, int | None, Ghost]] = deque()
        self._ghost_cap = max(1024, 4 * pool.num_pages // max(1, pool.layout.pages_per_state_set))
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

    def match(self, tokens: Sequence[int], salt: str | None = None, *, touch: bool = True,
              ghosts: bool = False) -> MatchResult:
        """ghosts: also look for an evicted snapshot deeper than the state hit that this query would
        have resumed from (a request's first admission), and tell the policy about it."""
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
        if ghosts and self._value:
            self._ghost_hit(tokens, salt, path, depth, state_hit)
        return MatchResult(depth, state_hit, state_node, pages)

    def _ghost_hit(self, tokens: list[int], salt: str | None, path: list[Node], depth: int, state_hit: int) -> None:
        hit: Ghost | None = None
        end = path[-1] if path and depth == path[-1].end else (self.roots.get(salt) if not path else None)
        if end is not None and end.ghosts and depth < len(tokens):
            lst = end.ghosts.get(tokens[depth], [])
            for g in lst:
                if depth + g.length <= len(tokens) and hash(tuple(tokens[depth:depth + g.length])) == g.fingerprint:
                    lst.remove(g)
                    hit = g
                    break
        if hit is None:
            for nd in reversed(path):
                if nd.end <= state_hit:
                    break
                if nd.ghost is not None and nd.end <= depth:
                    hit, nd.ghost = nd.ghost, None
                    break
        if hit is not None:
            self._relearn(hit.kind, self.reuse.on_ghost_hit(hit.kind, self.now() - hit.base, hit.was_hit))

    def _add_ghost(self, node: Node, first: int | None, g: Ghost) -> None:
        if first is None:
            node.ghost = g
        else:
            if node.ghosts is None:
                node.ghosts = {}
            node.ghosts.setdefault(first, []).append(g)
        self._ghost_fifo.append((node, first, g))
        while len(self._ghost_fifo) > self._ghost_cap:
            old, tok, og = self._ghost_fifo.popleft()
            if tok is None:
                if old.ghost is og:
                    old.ghost = None
            elif old.ghosts and og in old.ghosts.get(tok, ()):
                old.ghosts[tok].remove(og)

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
               snapshot: list[int] | None = None, *, start: Node | None = None, kind: str = "",
               length: int | None = None) -> Node | None:
        """Publish tokens[0:length] (default: all) with the request's pages (block_table[b] = page of
        block b). `length` lets a request publish a prefix of its token list without copying it.

        The tree takes its own page references. `snapshot` (the state after all of `tokens`) is
        handed over with its reference: kept if the node has none, else released (and the existing
        one counts as used again). `start`: a node on this path at or above len(tokens) to walk
        from (the publishing request's locked node), instead of the root. `kind`: what the snapshot
        is for (policy.py), which the value policy learns reuse rates by. Returns the node ending
        exactly at len(tokens) (None for an empty sequence).
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
                if depth % self.B and node.parent is not None and node.pages[-1] != leaf.pages[0]:
                    self._adopt_copy(node, depth // self.B, leaf.pages[0])
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
                node.ghost = None
                self.snapshot_count += 1
                node.kind, node.hits, node.used = kind, int(kind in CONFIRMED), False
                self.reuse.on_publish(kind)
                if self._value and kind == END:
                    self._pass_heat(node)
                self._refresh(node)
            else:
                self.pool.unref(snapshot)
                self.use(node)  # computed twice: wanted by more than one request
        elif node.snapshot is not None and not self._value:
            self._refresh(node)  # LRU: publishing a path refreshes the snapshot already at its end
        return node

    def _adopt_copy(self, node: Node, block: int, copy: int) -> None:
        """A request extended node's partially filled last page through a copy-on-write copy, which
        holds every position of the page below its own, so node's too: node and the ancestors that
        end in that page share the copy, and the original page is released (it would otherwise stay
        alive beside the copy for the life of the path: one dead page per conversation turn)."""
        B = self.B
        old = node.pages[-1]
        while node.parent is not None and node.start // B <= block <= (node.end - 1) // B:
            i = block - node.start // B
            if node.pages[i] != old:
                break
            node.pages[i] = copy
            self.pool.ref([copy])
            self.pool.unref([old])
            node = node.parent

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
        """A request resumes from node's snapshot: one more hit, priority refreshed."""
        if not node.used:
            node.used = True
            self.reuse.on_first_hit(node.kind)
        if self._value:
            self._relearn(node.kind, self.reuse.on_hit_age(node.kind, self.now() - node.base))
        node.hits += 1
        self._refresh(node)

    def _relearn(self, kind: str, horizon_changed: bool) -> None:
        """A kind's reuse horizon moved: its heap's keys are rebuilt with the new one."""
        if horizon_changed and kind in self.heaps:
            h = self.heaps[kind]
            self.heaps[kind] = [(self._key(e[2]), e[1], e[2]) for e in h
                                if e[2].heap_seq == e[1] and e[2].snapshot is not None]
            heapq.heapify(self.heaps[kind])

    def now(self) -> float:
        """The policy's clock: pool turnovers (pages handed out / pages in the pool) since start."""
        return self.pool.allocated_total / self.pool.num_pages

    def _refresh(self, node: Node) -> None:
        node.base = self.now() if self._value else next(self._tick)
        if node.pins == 0:
            self._push(node)

    def _heap_of(self, node: Node) -> str:
        return node.kind if self._value else "lru"

    def _push(self, node: Node, key: float | None = None) -> None:
        seq = next(self._seq)
        node.heap_seq = seq
        h = self.heaps.setdefault(self._heap_of(node), [])
        heapq.heappush(h, (self._key(node) if key is None else key, seq, node))
        self._entries += 1
        if self._entries > 2 * self.snapshot_count + 256:
            self._compact()

    def _compact(self) -> None:
        for k, h in self.heaps.items():
            self.heaps[k] = [e for e in h if e[2].heap_seq == e[1] and e[2].snapshot is not None]
            heapq.heapify(self.heaps[k])
        self._entries = sum(map(len, self.heaps.values()))

    def value(self, node: Node) -> float:
        """Expected recompute saved per page of keeping node's snapshot (policy.py)."""
        return (node.hits + self.reuse.p(node.kind)) * self.recompute_saved(node) / self.pages_freed(node)

    def _key(self, node: Node) -> float:
        """Heap key. "value": ln(value) + last_use / horizon, so that key - now / horizon =
        ln(value) - age / horizon, the log of the value decayed by the time since the last use, at
        the rate its kind's reuses are seen to come: an entry older than its kind's reuse horizon
        is probably dead (a finished conversation), whatever it was worth. "lru": the access tick."""
        if not self._value:
            return node.base
        return math.log(max(self.value(node), 1e-9)) + node.base / self.reuse.horizon(node.kind)

    def priority(self, node: Node) -> float:
        """The node's eviction priority now (lower goes first)."""
        if not self._value:
            return node.base
        return self._key(node) - self.now() / self.reuse.horizon(node.kind)

    def admission_priority(self, kind: str, saved: int) -> float:
        """The priority a new interior snapshot of `kind` saving `saved` tokens would start with."""
        reuse = int(kind in CONFIRMED) + self.reuse.p(kind)
        return math.log(max(reuse * saved / self.state_pages, 1e-9))

    def _pass_heat(self, end: Node) -> None:
        """A conversation's next turn ended below the end of the last one: the hits of the last end
        (the nearest end above with hits, through a chain without branches) were hits of the
        conversation's end, which is now `end`; they move down, and the old end is a waypoint,
        valued as its kind is. Junctions, and anything below which paths branch, keep their hits."""
        anc = end.parent
        while anc is not None and anc.parent is not None and len(anc.children) == 1:
            if anc.snapshot is not None and anc.hits and anc.kind in (END, PREEMPTED):
                end.hits, anc.hits = end.hits + anc.hits, 0
                if anc.pins == 0:
                    self._push(anc)
                return
            anc = anc.parent

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

    def evict(self, num_pages: int, *, below: float | None = None) -> int:
        """Free at least num_pages pool pages if possible; returns pages actually freed.

        Victims are unpinned snapshots in priority order; with `below`, only snapshots of lower
        priority (admitting a new snapshot never evicts more valuable ones). A snapshot that is the source of a pending
        copy carries the copier's extra page references, so evicting it from the tree never frees it
        under the copy. Evicting an unlocked leaf's snapshot deletes the leaf and its pages (and then
        every parent that became an unlocked leaf without a snapshot). Locked paths keep their pages.
        """
        if num_pages <= 0:
            return 0
        before = self.pool.num_free
        while self.pool.num_free - before < num_pages:
            victim = self._lowest()
            if victim is None:
                break
            kind, prio = victim
            if below is not None and prio >= below:
                break
            key, seq, n = heapq.heappop(self.heaps[kind])
            if self._value:
                now = self._key(n)
                if now > key + 1e-9:  # the tree changed around it (an ancestor snapshot went): requeue
                    self._push(n, now)
                    continue
            self._drop_snapshot(n)
        freed = self.pool.num_free - before
        self.stats.evicted_pages += freed
        return freed

    def _lowest(self) -> tuple[str, float] | None:
        """The heap whose head has the lowest priority now, and that priority (stale heads dropped)."""
        best, best_prio = None, math.inf
        now = self.now()
        for kind, h in self.heaps.items():
            while h and (h[0][2].heap_seq != h[0][1] or h[0][2].snapshot is None):
                heapq.heappop(h)
            if h:
                prio = h[0][0] - now / self.reuse.horizon(kind) if self._value else h[0][0]
                if prio < best_prio:
                    best, best_prio = kind, prio
        return None if best is None else (best, best_prio)

    def _drop_snapshot(self, n: Node) -> None:
        snap, n.snapshot = n.snapshot, None
        n.heap_seq = -1
        self.snapshot_count -= 1
        self.stats.evicted_snapshots += 1
        self.pool.unref(snap)
        if not (self._value and self._learning):
            self._prune(n)
            return
        if not n.used:
            self.reuse.on_evicted_unused(n.kind, self.now() - n.base)
        kind, base, was_hit = n.kind, n.base, n.used
        attach, keys = self._prune(n)
        if not keys:
            self._add_ghost(n, None, Ghost(0, 0, kind, base, was_hit))  # its KV stays (a locked or inner node)
        elif attach is not None:
            toks = [t for k in reversed(keys) for t in k]
            self._add_ghost(attach, toks[0], Ghost(len(toks), hash(tuple(toks)), kind, base, was_hit))

    def _prune(self, n: Node) -> tuple[Node | None, list[list[int]]]:
        """Delete n and its ancestors while they are unlocked leaves without a snapshot; then a
        namespace root left without children. Returns the node pruning stopped at (None when that was
        a namespace root, now gone) and the keys of the deleted nodes, deepest first."""
        keys = []
        while n.parent is not None and not n.children and n.snapshot is None and n.lock == 0:
            parent = n.parent
            del parent.children[n.key[0]]
            self.pool.unref(n.pages)
            self.node_count -= 1
            n.parent = None
            keys.append(n.key)
            n = parent
        if keys and self._value and n.snapshot is not None and n.pins == 0 and not n.children:
            self._push(n)  # now a leaf: it frees its KV too, its value per page dropped
        if n.parent is None and not n.children and n.salt is not None and self.roots.get(n.salt) is n:
            del self.roots[n.salt]
            return None, keys
        return n, keys

    def reset(self) -> None:
        """Drop every unlocked node's snapshot (tests and `flush_cache`); pinned ones stay. Nothing is
        learned from it (no ghosts, no misses): the operator's flush is not the policy's choice."""
        self._learning = False
        try:
            while self.evict(self.pool.num_pages):
                pass
        finally:
            self._learning = True
        for node, first, g in self._ghost_fifo:
            if first is None:
                node.ghost = None
            elif node.ghosts:
                node.ghosts.clear()
        self._ghost_fifo.clear()

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
        live = {seq for h in self.heaps.values() for _, seq, n in h if n.heap_seq == seq}
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
