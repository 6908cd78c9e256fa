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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from k3rt.backend.spec.base import DraftQuery, Drafter, Proposal
from k3rt.config import SpecConfig


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of length <= depth of the indexed sequences."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], delta: int = 1) -> None:
        """Index (delta=1) or un-index (delta=-1, after the same tokens were indexed) one whole sequence."""
        active: list[_Node] = [self.root]
        for t in tokens:
            active = self.push(active, t, delta)

    def push(self, active: list[_Node], tok: int, delta: int = 1) -> list[_Node]:
        """Extend every suffix in `active` (the nodes of the current suffixes, root first) by tok; returns
        the new suffix nodes. Nodes whose count drops to 0 are unlinked."""
        out = [self.root]
        for node in active:
            child = node.children.get(tok)
            if child is None:
                if delta < 0:
                    continue  # an un-index of something already pruned below
                child = node.children[tok] = _Node()
            child.count += delta
            if child.count <= 0:
                del node.children[tok]
                continue
            if len(out) < self.depth:
                out.append(child)
        return out

    def find(self, context: Sequence[int], max_len: int) -> tuple[_Node, int] | None:
        """The node of the longest suffix of context (<= max_len tokens) that has a continuation, and its length."""
        found = self.matches(context, max_len)
        return found[-1] if found else None

    def matches(self, context: Sequence[int], max_len: int) -> list[tuple[_Node, int]]:
        """(node, length) of every suffix of context (<= max_len tokens) that has a continuation, shortest first."""
        out = []
        n = len(context)
        for m in range(1, min(max_len, n) + 1):
            node = self.root
            for t in context[n - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is None:
                break  # a longer suffix contains this one: absent too
            if node.children:
                out.append((node, m))
        return out


def _draft(node: _Node, m: int, max_tokens: int, min_prob: float, factor: float
           ) -> tuple[list[int], float, list[float]]:
    """Follow the most frequent continuation from node (a pattern of m tokens); -> (draft, expected accepted, each
    draft's empirical probability given the ones before it)."""
    limit = min(max_tokens, int(factor * m))
    out: list[int] = []
    probs: list[float] = []
    prob, score = 1.0, 0.0
    while len(out) < limit and node.children:
        tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
        p = child.count / sum(c.count for c in node.children.values())
        prob *= p
        if prob < min_prob:
            break
        out.append(tok)
        probs.append(p)
        score += prob
        node = child
    return out, score, probs


class _Index:
    __slots__ = ("trie", "active", "indexed")

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.active: list[_Node] = [self.trie.root]
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
        for t in toks[idx.indexed:]:
            idx.active = idx.trie.push(idx.active, t)
        idx.indexed = len(toks)
        # patterns leave room for a continuation inside the trie's depth
        max_pattern = self.depth - 1
        # own trie: the suffix nodes are at hand (active[m] is the node of the last m tokens); longest first,
        # so on equal scores the longer (better supported) pattern wins
        own = [(idx.active[m], m) for m in range(min(len(idx.active) - 1, max_pattern), 0, -1)
               if idx.active[m].children]
        glob = self.global_trie.matches(toks[-max_pattern:], max_pattern)[::-1]
        best: tuple[list[int], float, list[float]] = ([], 0.0, [])
        for node, m in own + glob:
            other = _draft(node, m, q.max_tokens, self.cfg.suffix_min_prob, self.cfg.suffix_max_spec_factor)
            if other[1] > best[1]:
                best = other
            if len(best[0]) == q.max_tokens and best[1] == q.max_tokens:
                break  # a certain draft of full length: nothing scores higher
        return Proposal(best[0], best[2])
