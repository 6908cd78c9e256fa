"""SuffixDecoding-style drafting (model-free): suffix tries over the request's own tokens and over the
recent outputs of this server, with the draft length adapted to how often and how confidently the
matched pattern was continued.

A trie of depth D counts every substring of length <= D of the sequences it indexes (a node's count is
how many times its path occurred; its children count what followed). Appending a token touches the D
nodes of the suffixes ending there, so indexing is O(D) per token. To draft, every suffix of the
request's context found in a trie with a continuation is a candidate pattern (length m); its draft
follows the most frequent child while the product of the children's empirical probabilities stays >=
min_prob, and is at most max_spec_factor * m tokens (a short, weakly supported match drafts little).
Every pattern of the request's own trie and of the global one proposes; the draft with the larger
expected number of accepted tokens (the sum of its prefix probabilities) wins, the longer pattern on a
tie. Not just the longest pattern: a pattern of m tokens has at most D - m tokens of continuation in
the trie, so the longest match (m near D, in a repetitive context) could draft a single token.

Bounded host cost: a request's trie indexes only its last `suffix_index_tokens` tokens when first seen
(a 128K prompt would otherwise cost ~D x 128K dict operations on the scheduler loop), and the global trie
keeps the outputs of the last `suffix_cached_requests` finished requests (older ones are subtracted out).

No Python object per trie node: a node is an int whose fields live in flat lists of ints, and its edges are
entries of one dict of ints (lists and dicts holding only ints are cheap for the collector: a few objects). A trie over a few thousand tokens has D x that many nodes; as objects (each with
its own children dict) they were tracked by the cyclic garbage collector, whose full collections then walked
all of them (a CPU replay: 120 ms pauses at batch 64, 17.5 ms mean per call against 2.9 ms flat). On the H200 the
drafter's mean call at batch 16-64 fell from 9-370 ms to 11-108 ms with flat nodes (a plain k3-tiny step: 1.3-1.9
ms); what is left is mostly indexing each new prompt, ~D nodes per token in Python (session 14).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from k3rt.backend.spec.base import DraftQuery, Drafter, Proposal
from k3rt.config import SpecConfig

# an edge's key: parent << _SHIFT | token (token ids are below 2**32)
_SHIFT = 32


class SuffixTrie:
    """Counts of every substring of length <= depth of the indexed sequences. Nodes are ints, ROOT the root;
    per node: `count` (occurrences of its path), `total` (the sum of its children's counts), `best` (the child
    with the largest count, the earliest created on a tie; -1: none) and `token` (the edge's token)."""

    ROOT = 0

    def __init__(self, depth: int, *, removable: bool = True) -> None:
        """removable: sequences can be un-indexed (add(..., -1)); a trie that never un-indexes (a request's own)
        skips the child lists that needs."""
        self.depth, self.removable = depth, removable
        self._edge: dict[int, int] = {}  # parent << _SHIFT | token -> child
        self.count = [0]
        self.total = [0]
        self.best = [-1]
        self.token = [-1]
        self._serial = [0]  # creation order: ties go to the earliest created child
        self._first = [-1]  # first child (children are a linked list, for un-indexing)
        self._next = [-1]  # next sibling
        self._free: list[int] = []  # ids of unlinked nodes, reused first
        self._created = 0

    def child(self, node: int, tok: int) -> int:
        """The child of node along tok, or -1."""
        return self._edge.get(node << _SHIFT | tok, -1)

    def children(self, node: int) -> dict[int, int]:
        """token -> count of node's children."""
        lo, hi = node << _SHIFT, (node + 1) << _SHIFT
        return {k - lo: self.count[c] for k, c in self._edge.items() if lo <= k < hi}

    def __len__(self) -> int:
        """Live nodes, the root included."""
        return len(self.count) - len(self._free)

    def _new(self, parent: int, tok: int) -> int:
        self._created += 1
        if self._free:
            c = self._free.pop()
            self.count[c], self.total[c], self.best[c], self.token[c], self._serial[c] = 0, 0, -1, tok, self._created
        else:
            c = len(self.count)
            self.count.append(0)
            self.total.append(0)
            self.best.append(-1)
            self.token.append(tok)
            self._serial.append(self._created)
        if self.removable:
            sibling = self._first[parent]
            if c == len(self._first):
                self._first.append(-1)
                self._next.append(sibling)
            else:
                self._first[c], self._next[c] = -1, sibling
            self._first[parent] = c
        self._edge[parent << _SHIFT | tok] = c
        return c

    def add(self, tokens: Sequence[int], delta: int = 1) -> None:
        """Index (delta=1) or un-index (delta=-1, after the same tokens were indexed; removable tries only) one
        whole sequence."""
        if delta < 0 and not self.removable:
            raise ValueError("this trie was built without removal (removable=False)")
        active = [self.ROOT]
        for t in tokens:
            active = self.push(active, t, delta)

    def push(self, active: list[int], tok: int, delta: int = 1) -> list[int]:
        """Extend every suffix in `active` (the nodes of the current suffixes, root first) by tok; returns
        the new suffix nodes. Nodes whose count drops to 0 are unlinked with their subtrees."""
        out = [self.ROOT]
        edge, count, total, best, serial = self._edge, self.count, self.total, self.best, self._serial
        depth = self.depth
        for node in active:
            c = edge.get(node << _SHIFT | tok)
            if c is None:
                if delta < 0:
                    continue  # an un-index of something already pruned below
                c = self._new(node, tok)
            n = count[c] + delta
            count[c] = n
            total[node] += delta
            if delta > 0:
                b = best[node]  # counts only grow here: the best child changes only to c
                if b < 0 or n > count[b] or (n == count[b] and serial[c] < serial[b]):
                    best[node] = c
            elif n <= 0:
                self._unlink(node, c)
                continue
            elif best[node] == c:
                self._rebest(node)
            if len(out) < depth:
                out.append(c)
        return out

    def _rebest(self, node: int) -> None:
        count, serial = self.count, self._serial
        b, c = -1, self._first[node]
        while c >= 0:
            if b < 0 or count[c] > count[b] or (count[c] == count[b] and serial[c] < serial[b]):
                b = c
            c = self._next[c]
        self.best[node] = b

    def _unlink(self, parent: int, c: int) -> None:
        """Remove c (count 0) from parent's children and free its subtree."""
        prev, x = -1, self._first[parent]
        while x != c:
            prev, x = x, self._next[x]
        if prev < 0:
            self._first[parent] = self._next[c]
        else:
            self._next[prev] = self._next[c]
        stack = [(parent, c)]
        while stack:
            p, x = stack.pop()
            del self._edge[p << _SHIFT | self.token[x]]
            self._free.append(x)
            y = self._first[x]
            while y >= 0:
                stack.append((x, y))
                y = self._next[y]
        if self.best[parent] == c:
            self._rebest(parent)

    def find(self, context: Sequence[int], max_len: int) -> tuple[int, int] | None:
        """The node of the longest suffix of context (<= max_len tokens) that has a continuation, and its length."""
        found = self.matches(context, max_len)
        return found[-1] if found else None

    def matches(self, context: Sequence[int], max_len: int) -> list[tuple[int, int]]:
        """(node, length) of every suffix of context (<= max_len tokens) that has a continuation, shortest first."""
        out = []
        n, edge, total = len(context), self._edge, self.total
        for m in range(1, min(max_len, n) + 1):
            node = self.ROOT
            for t in context[n - m:]:
                node = edge.get(node << _SHIFT | t, -1)
                if node < 0:
                    break
            if node < 0:
                break  # a longer suffix contains this one: absent too
            if total[node]:
                out.append((node, m))
        return out

    def draft(self, node: int, m: int, max_tokens: int, min_prob: float, factor: float
              ) -> tuple[list[int], float, list[float]]:
        """Follow the most frequent continuation from node (a pattern of m tokens); -> (draft, expected accepted,
        each draft's empirical probability given the ones before it)."""
        limit = min(max_tokens, int(factor * m))
        count, total, best, token = self.count, self.total, self.best, self.token
        out: list[int] = []
        probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            b = best[node]
            if b < 0:
                break
            p = count[b] / total[node]
            prob *= p
            if prob < min_prob:
                break
            out.append(token[b])
            probs.append(p)
            score += prob
            node = b
        return out, score, probs


class _Index:
    __slots__ = ("trie", "active", "indexed")

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth, removable=False)
        self.active: list[int] = [SuffixTrie.ROOT]
        self.indexed = 0


class SuffixDrafter(Drafter):
    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.depth = cfg.suffix_max_depth
        self.global_trie = SuffixTrie(self.depth)
        self._cached: deque[list[int]] = deque()  # outputs in the global trie, oldest first
        self._reqs: dict[int, _Index] = {}

    def propose(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        return [self._propose(q).token_ids for q in queries]

    def propose_scored(self, queries: Sequence[DraftQuery]) -> list[Proposal]:
        """With each draft's empirical continuation probability in the trie that matched (the speculation
        controller calibrates them against what gets accepted)."""
        return [self._propose(q) for q in queries]

    def finish(self, rid: int, token_ids: Sequence[int], prompt_len: int) -> None:
        self._reqs.pop(rid, None)
        if self.cfg.suffix_cached_requests == 0:
            return
        out = list(token_ids[prompt_len:])
        if len(out) > 1:
            self.global_trie.add(out)
            self._cached.append(out)
        while len(self._cached) > self.cfg.suffix_cached_requests:
            self.global_trie.add(self._cached.popleft(), -1)

    def _propose(self, q: DraftQuery) -> Proposal:
        toks = q.token_ids
        idx = self._reqs.get(q.rid)
        if idx is None:
            idx = self._reqs[q.rid] = _Index(self.depth)
            idx.indexed = max(0, len(toks) - self.cfg.suffix_index_tokens)
        own = idx.trie
        for t in toks[idx.indexed:]:
            idx.active = own.push(idx.active, t)
        idx.indexed = len(toks)
        # patterns leave room for a continuation inside the trie's depth
        max_pattern = self.depth - 1
        # own trie: the suffix nodes are at hand (active[m] is the node of the last m tokens); longest first,
        # so on equal scores the longer (better supported) pattern wins
        cands = [(own, idx.active[m], m) for m in range(min(len(idx.active) - 1, max_pattern), 0, -1)
                 if own.total[idx.active[m]]]
        glob = self.global_trie
        cands += [(glob, node, m) for node, m in glob.matches(toks[-max_pattern:], max_pattern)[::-1]]
        best: tuple[list[int], float, list[float]] = ([], 0.0, [])
        for trie, node, m in cands:
            other = trie.draft(node, m, q.max_tokens, self.cfg.suffix_min_prob, self.cfg.suffix_max_spec_factor)
            if other[1] > best[1]:
                best = other
            if len(best[0]) == q.max_tokens and best[1] == q.max_tokens:
                break  # a certain draft of full length: nothing scores higher
        return Proposal(best[0], best[2])
