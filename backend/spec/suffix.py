"""SuffixDecoding-style drafting (model-free): suffix tries over the request's own tokens and over the
recent outputs of this server, with the draft length adapted to how often and how confidently the
matched pattern was continued.

A trie of depth D counts every substring of length <= D of the sequences it indexes (a node's count is
how many times its path occurred; its children count what followed). A path that occurred once is kept
as a leaf pointing into its sequence (its continuation is read there), so appending a token touches only
the suffixes ending there that occurred before, not all D of them (`SuffixTrie`). To draft, every suffix of the
request's context found in a trie with a continuation is a candidate pattern (length m); its draft
follows the most frequent child while the product of the children's empirical probabilities stays >=
min_prob, and is at most max_spec_factor * m tokens (a short, weakly supported match drafts little).
Every pattern of the request's own trie and of the global one proposes; the draft with the larger
expected number of accepted tokens (the sum of its prefix probabilities) wins, the longer pattern on a
tie. Not just the longest pattern: a pattern of m tokens has at most D - m tokens of continuation in
the trie, so the longest match (m near D, in a repetitive context) could draft a single token.

Bounded host cost: a request's trie indexes only its last `suffix_index_tokens` tokens when first seen
(a 128K prompt would otherwise cost ~D x 128K dict operations on the scheduler loop), and the global trie
keeps the outputs of the last `suffix_cached_requests` finished requests (older ones are subtracted out), indexed
`suffix_drain_tokens` at a time per proposal (a batch's outputs are spread over calls). A
request's matches in the global trie are carried forward token by token while that trie is unchanged
(`advance_matches`), and a candidate pattern whose longest possible draft cannot beat the best so far is not
drafted: a decode step's call at batch 64 (context 256+) 51 -> 41 us a request on the CI machine, same drafts.

No Python object per trie node: a node is an int whose fields live in flat lists of ints, and its edges are
entries of one dict of ints (lists and dicts holding only ints are cheap for the collector: a few objects). As
objects (each with its own children dict) the nodes were tracked by the cyclic garbage collector, whose full
collections then walked all of them (a CPU replay: 120 ms pauses at batch 64). On the H200 the drafter's mean
call at batch 16-64 fell from 9-370 ms to 11-108 ms with flat nodes (a plain k3-tiny step: 1.3-1.9 ms), most of
what was left being the D node updates per indexed token (session 14). With count-1 paths as leaves
(session 15; benchmarks/suffix_host.py, on the CI machine against the uncompressed trie, same drafts): a new
prompt's indexing 9-16x cheaper for code, 3-13x for an agent's repetitive context; a drain of 64 outputs into
the full global trie 5-9x; a decode step's call at batch 64 1.7-3x.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from k3rt.backend.spec.base import DraftQuery, Drafter, Proposal
from k3rt.config import SpecConfig

# an edge's key: parent << _SHIFT | token (token ids are below 2**32)
_SHIFT = 32
# `best` of a node whose best child lost count or was unlinked: recomputed when a draft reads it (the root of a
# global trie has thousands of children, and un-indexing an output decrements its best child at every token)
_STALE = -2


class SuffixTrie:
    """Counts of every substring of length <= depth of the indexed sequences, with count-1 chains implicit.

    Nodes are ints; per node: `count` (occurrences of its path), `total` (the sum of its explicit children's
    counts), `best` (the explicit child with the largest count, the earliest created on a tie; -1: none;
    _STALE: to be found again),
    `token` (the edge's token), `depth`, and `serial` (creation order: (global position of the occurrence's
    last token) x (depth + 1) + depth, the order an uncompressed trie creates its nodes in).

    A path that occurred once is a leaf: `leaf_seq` names the sequence of its one occurrence (-1: not a leaf)
    and `leaf_end` the position of its last token there; its descendants are implicit, read off that
    sequence (each count 1, up to `depth`). A second occurrence splits the leaf: its chain's next node is made
    explicit (a leaf itself) and the node counts 2. So indexing a token touches only the suffixes that occurred
    before (the nodes in `active`) plus one new leaf per suffix that is new, not all `depth` suffixes: text that
    does not repeat costs a few dict operations per token (an uncompressed trie: `depth` node updates, 45 us a
    token on the CI machine at depth 24). A position in the trie's logical view is (node, off): `off` steps
    down node's implicit chain (0: the node itself).

    Sequences: `add` indexes a whole one (-> its id; `remove(id)` un-indexes it, removable tries only);
    `extend` appends to the trie's one growing sequence (id 0, a request's own tokens), keeping `active`, the
    explicit non-leaf nodes of its current suffixes, root first: active[m] is the suffix of length m."""

    ROOT = 0

    def __init__(self, depth: int, *, removable: bool = True) -> None:
        """removable: sequences can be un-indexed (`remove`); a trie that never un-indexes (a request's own)
        skips the child lists that needs."""
        self.depth, self.removable = depth, removable
        self._edge: dict[int, int] = {}  # parent << _SHIFT | token -> child
        self.count = [0]
        self.total = [0]
        self.best = [-1]
        self.token = [-1]
        self.node_depth = [0]
        self.serial = [0]
        self.leaf_seq = [-1]
        self.leaf_end = [0]
        self._first = [-1]  # first child (children are a doubly linked list, for un-indexing)
        self._next = [-1]  # next sibling
        self._prev = [-1]  # previous sibling (-1: the first)
        self._free: list[int] = []  # ids of unlinked nodes, reused first
        self._seqs: dict[int, list[int]] = {}  # sequence id -> its tokens (leaves read their chains there)
        self._base: dict[int, int] = {}  # sequence id -> global position of its first token
        self._pushed = 0  # tokens of every sequence added so far
        self._next_sid = 1  # id 0 is extend()'s
        self.active: list[int] = [self.ROOT]

    def __len__(self) -> int:
        """Explicit live nodes, the root included."""
        return len(self.count) - len(self._free)

    # ---- indexing ----

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the trie's own sequence (id 0), indexing every new suffix."""
        seq = self._seqs.get(0)
        if seq is None:
            seq = self._seqs[0] = []
            self._base[0] = 0
        active = self.active
        for t in tokens:
            seq.append(t)  # first: a leaf's chain may read the token now pushed
            active = self._push(active, 0, len(seq) - 1, 1)
        self.active = active

    def add(self, tokens: Sequence[int]) -> int:
        """Index one whole sequence -> its id (for `remove`)."""
        sid, self._next_sid = self._next_sid, self._next_sid + 1
        seq = self._seqs[sid] = list(tokens)
        self._base[sid], self._pushed = self._pushed, self._pushed + len(seq)
        active = [self.ROOT]
        for p in range(len(seq)):
            active = self._push(active, sid, p, 1)
        return sid

    def remove(self, sid: int) -> None:
        """Un-index sequence `sid` (removable tries only). Nodes whose count drops to 0 are unlinked."""
        if not self.removable:
            raise ValueError("this trie was built without removal (removable=False)")
        active = [self.ROOT]
        for p in range(len(self._seqs[sid])):
            active = self._push(active, sid, p, -1)
        del self._seqs[sid], self._base[sid]

    def _new(self, parent: int, tok: int, sid: int, end: int, depth: int) -> int:
        """A new leaf, count 1: the path parent + tok, whose one occurrence ends at `end` in sequence `sid`."""
        serial = (self._base[sid] + end) * (self.depth + 1) + depth
        if self._free:
            c = self._free.pop()
            self.count[c], self.total[c], self.best[c], self.token[c] = 1, 0, -1, tok
            self.node_depth[c], self.serial[c], self.leaf_seq[c], self.leaf_end[c] = depth, serial, sid, end
        else:
            c = len(self.count)
            self.count.append(1)
            self.total.append(0)
            self.best.append(-1)
            self.token.append(tok)
            self.node_depth.append(depth)
            self.serial.append(serial)
            self.leaf_seq.append(sid)
            self.leaf_end.append(end)
        if self.removable:
            sibling = self._first[parent]
            if c == len(self._first):
                self._first.append(-1)
                self._next.append(sibling)
                self._prev.append(-1)
            else:
                self._first[c], self._next[c], self._prev[c] = -1, sibling, -1
            if sibling >= 0:
                self._prev[sibling] = c
            self._first[parent] = c
        self._edge[parent << _SHIFT | tok] = c
        return c

    def _split(self, c: int) -> None:
        """Leaf c gets a second occurrence: its chain's next node (if any) becomes an explicit leaf of count 1."""
        sid, end = self.leaf_seq[c], self.leaf_end[c]
        self.leaf_seq[c] = -1
        seq, d = self._seqs[sid], self.node_depth[c]
        if d < self.depth and end + 1 < len(seq):
            self.best[c] = self._new(c, seq[end + 1], sid, end + 1, d + 1)
            self.total[c] = 1

    def _push(self, active: list[int], sid: int, p: int, delta: int) -> list[int]:
        """Extend every suffix in `active` (explicit non-leaf nodes of the suffixes ending at p - 1, root first)
        by token p of sequence sid, counting it (delta 1) or un-counting it (delta -1); returns the new active
        list. A suffix seen for the first time becomes a leaf and leaves the list: its extensions are implicit."""
        tok = self._seqs[sid][p]
        out = [self.ROOT]
        edge, count, total, best, serial, leaf_seq = (self._edge, self.count, self.total, self.best, self.serial,
                                                      self.leaf_seq)
        depth, node_depth = self.depth, self.node_depth
        for node in active:
            c = edge.get(node << _SHIFT | tok)
            if c is None:
                if delta < 0:
                    continue  # an un-index of something already pruned below
                c = self._new(node, tok, sid, p, node_depth[node] + 1)
                total[node] += 1
                if best[node] == -1:
                    best[node] = c  # count 1, created last: it wins only over no child at all
                continue
            if leaf_seq[c] >= 0:
                if delta < 0:  # a leaf's one occurrence is the one being un-indexed
                    count[c] = 0
                    total[node] -= 1
                    self._unlink(node, c)
                    continue
                self._split(c)
            n = count[c] + delta
            count[c] = n
            total[node] += delta
            if delta > 0:
                b = best[node]  # counts only grow here: the best child changes only to c (a stale one stays stale)
                if b == -1 or (b >= 0 and (n > count[b] or (n == count[b] and serial[c] < serial[b]))):
                    best[node] = c
            elif n <= 0:
                self._unlink(node, c)
                continue
            elif best[node] == c:
                best[node] = _STALE  # found again when a draft reads it: a removal scans no sibling list
            if node_depth[c] < depth:
                out.append(c)
        return out

    def _rebest(self, node: int) -> int:
        count, serial = self.count, self.serial
        b, c = -1, self._first[node]
        while c >= 0:
            if b < 0 or count[c] > count[b] or (count[c] == count[b] and serial[c] < serial[b]):
                b = c
            c = self._next[c]
        self.best[node] = b
        return b

    def _unlink(self, parent: int, c: int) -> None:
        """Remove c (count 0) from parent's children and free its subtree."""
        prev, nxt = self._prev[c], self._next[c]
        if prev < 0:
            self._first[parent] = nxt
        else:
            self._next[prev] = nxt
        if nxt >= 0:
            self._prev[nxt] = prev
        stack = [(parent, c)]
        while stack:
            p, x = stack.pop()
            del self._edge[p << _SHIFT | self.token[x]]
            self._free.append(x)
            self.leaf_seq[x] = -1
            y = self._first[x]
            while y >= 0:
                stack.append((x, y))
                y = self._next[y]
        if self.best[parent] == c:
            self.best[parent] = _STALE

    # ---- the logical view: positions (node, off) ----

    def _chain(self, node: int, off: int) -> tuple[list[int], int, int] | None:
        """(sequence, position of the last token, depth) of an implicit position or a leaf; None if explicit."""
        sid = self.leaf_seq[node]
        if sid < 0:
            return None
        return self._seqs[sid], self.leaf_end[node] + off, self.node_depth[node] + off

    def step(self, pos: tuple[int, int], tok: int) -> tuple[int, int] | None:
        """The position one token further along tok, or None."""
        node, off = pos
        chain = self._chain(node, off)
        if chain is None:
            c = self._edge.get(node << _SHIFT | tok)
            return None if c is None else (c, 0)
        seq, end, d = chain
        return (node, off + 1) if d < self.depth and end + 1 < len(seq) and seq[end + 1] == tok else None

    def continues(self, pos: tuple[int, int]) -> bool:
        """Whether the position has a continuation (a child) in the trie."""
        node, off = pos
        chain = self._chain(node, off)
        if chain is None:
            return self.total[node] > 0
        seq, end, d = chain
        return d < self.depth and end + 1 < len(seq)

    def count_at(self, pos: tuple[int, int]) -> int:
        return self.count[pos[0]] if pos[1] == 0 else 1

    def children_at(self, pos: tuple[int, int]) -> dict[int, int]:
        """token -> count of the position's children (explicit: a scan of every edge; tests)."""
        node, off = pos
        chain = self._chain(node, off)
        if chain is None:
            lo, hi = node << _SHIFT, (node + 1) << _SHIFT
            return {k - lo: self.count[c] for k, c in self._edge.items() if lo <= k < hi}
        seq, end, d = chain
        return {seq[end + 1]: 1} if d < self.depth and end + 1 < len(seq) else {}

    def matches(self, context: Sequence[int], max_len: int) -> list[tuple[int, int, int]]:
        """(node, off, length) of every suffix of context (<= max_len tokens) that has a continuation, shortest
        first."""
        out = []
        context = list(context[-max_len:])  # a list: the chains compare slices with it
        n, edge, leaf_seq, depth = len(context), self._edge, self.leaf_seq, self.depth
        for m in range(1, n + 1):
            node, i = self.ROOT, n - m
            while i < n:
                sid = leaf_seq[node]
                if sid >= 0:  # one occurrence: the rest of the suffix must follow it, in one slice compare
                    seq, e, rest = self._seqs[sid], self.leaf_end[node], n - i
                    if self.node_depth[node] + rest > depth or seq[e + 1:e + 1 + rest] != context[i:]:
                        node = -1
                    break
                node = edge.get(node << _SHIFT | context[i], -1)
                if node < 0:
                    break
                i += 1
            if node < 0:
                break  # a longer suffix contains this one: absent too
            off = n - i  # steps down a leaf's chain (0: the walk ended on an explicit node)
            if self.continues((node, off)):
                out.append((node, off, m))
        return out

    def draft(self, node: int, off: int, m: int, max_tokens: int, min_prob: float, factor: float
              ) -> tuple[list[int], float, list[float]]:
        """Follow the most frequent continuation from position (node, off), a pattern of m tokens; -> (draft,
        expected accepted, each draft's empirical probability given the ones before it)."""
        limit = min(max_tokens, int(factor * m))
        count, total, best, token = self.count, self.total, self.best, self.token
        out: list[int] = []
        probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            chain = self._chain(node, off)
            if chain is not None:  # one occurrence: its continuation, each token certain given the ones before
                seq, end, d = chain
                k = min(limit - len(out), self.depth - d, len(seq) - 1 - end)
                if k > 0:
                    out += seq[end + 1:end + 1 + k]
                    probs += [1.0] * k
                    score += prob * k
                break
            b = best[node]
            if b == _STALE:
                b = self._rebest(node)
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
    """A request's own trie (indexed up to `indexed` tokens), and its context's matches in the global trie as of
    global version `version` and `matched` tokens (`SuffixTrie.matches`' list, carried forward token by token)."""

    __slots__ = ("trie", "indexed", "glob", "version", "matched")

    def __init__(self, trie: SuffixTrie, indexed: int) -> None:
        self.trie, self.indexed = trie, indexed
        self.glob: list[tuple[int, int, int]] = []
        self.version, self.matched = -1, 0


def advance_matches(trie, found: list[tuple[int, int, int]], tok: int, max_len: int) -> list[tuple[int, int, int]]:
    """`trie.matches(context + [tok], max_len)` from `found` = `trie.matches(context, max_len)`: the suffixes of the
    longer context that have a continuation are the one-token one and those of `found` extended by tok (a suffix
    present in the trie comes from a shorter one with tok as a child), shortest first. O(D) per token where
    matches walks O(D^2)."""
    out = []
    for node, off, m in [(trie.ROOT, 0, 0), *found]:
        if m < max_len:
            nxt = trie.step((node, off), tok)
            if nxt is not None and trie.continues(nxt):
                out.append((nxt[0], nxt[1], m + 1))
    return out


class SuffixDrafter(Drafter):
    Trie = SuffixTrie  # tests swap in the uncompressed oracle (tests/backend/suffix_ref.py)

    def __init__(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.depth = cfg.suffix_max_depth
        self.global_trie = self.Trie(self.depth)
        self._cached: deque[int] = deque()  # ids of the outputs in the global trie, oldest first
        # outputs of finished requests not yet in the global trie (finish -> index_finished), oldest first: a
        # batch's outputs cost ~10-40 us per token to index (a drain of 64 outputs of 128 tokens: ~0.3 s on the
        # CI machine, benchmarks/suffix_host.py), which in `finish` landed on the step that ended them, drafting
        # or not; at the next proposal it is part of the drafter's measured pass
        self._finished: deque[list[int]] = deque()
        self._reqs: dict[int, _Index] = {}
        self._version = 0  # the global trie's, bumped when it changes (a request's matches there are then redone)

    def propose(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        return [p.token_ids for p in self.propose_scored(queries)]

    def propose_scored(self, queries: Sequence[DraftQuery], full: bool = False) -> list[Proposal]:
        """With each draft's empirical continuation probability in the trie that matched (the speculation
        controller calibrates them against what gets accepted). full changes nothing: a suffix match's length
        is what the trie holds, not a cut by confidence."""
        self.index_finished(self.cfg.suffix_drain_tokens)
        return [self._propose(q) for q in queries]

    def finish(self, rid: int, token_ids: Sequence[int], prompt_len: int) -> None:
        """Drop the request's trie; queue its output for the global trie, indexed at the next proposal
        (`index_finished`): not in the step that finished it, and not at all while nothing asks for drafts."""
        self._reqs.pop(rid, None)
        if self.cfg.suffix_cached_requests == 0:
            return
        out = token_ids[prompt_len:]
        if len(out) > 1:
            self._finished.append(list(out))
            if len(self._finished) > self.cfg.suffix_cached_requests:
                self._finished.popleft()  # it would leave the global trie before any proposal read it

    def index_finished(self, budget: int | None = None) -> None:
        """Index the queued outputs into the global trie, oldest first; it keeps the newest
        suffix_cached_requests outputs (older ones are subtracted out). budget: index outputs only until this many
        tokens are indexed (at least one output; None: all). Each proposal drains suffix_drain_tokens: a batch
        of 64 outputs of 128 tokens into the full trie costs ~0.5 s on the CI machine (benchmarks/suffix_host.py),
        and landed whole on one proposal: on the H200 the suffix drafter's calls at code batch 64 (a drain and a
        wave's new prompts each) averaged 30 ms against a ~1.7 ms plain step, the row at 0.83x of plain decoding
        with 1% of its steps drafting (session 23). The global trie serves other requests' repetitions, which
        can wait a few calls."""
        spent = 0
        while self._finished and (budget is None or spent < budget):
            spent += len(self._finished[0])
            self._version += 1
            self._cached.append(self.global_trie.add(self._finished.popleft()))
            while len(self._cached) > self.cfg.suffix_cached_requests:
                self.global_trie.remove(self._cached.popleft())

    def _propose(self, q: DraftQuery) -> Proposal:
        toks = q.token_ids
        idx = self._reqs.get(q.rid)
        if idx is None:
            idx = self._reqs[q.rid] = _Index(self.Trie(self.depth, removable=False),
                                             max(0, len(toks) - self.cfg.suffix_index_tokens))
        own = idx.trie
        own.extend(toks[idx.indexed:])
        idx.indexed = len(toks)
        active = own.active
        # patterns leave room for a continuation inside the trie's depth
        max_pattern = self.depth - 1
        # own trie: the suffix nodes are at hand (active[m] is the node of the last m tokens); longest first,
        # so on equal scores the longer (better supported) pattern wins
        cands = [(own, active[m], 0, m) for m in range(min(len(active) - 1, max_pattern), 0, -1)
                 if own.total[active[m]]]
        glob = self.global_trie
        cands += [(glob, node, off, m) for node, off, m in self._global_matches(idx, toks, max_pattern)[::-1]]
        best: tuple[list[int], float, list[float]] = ([], 0.0, [])
        factor = self.cfg.suffix_max_spec_factor
        for trie, node, off, m in cands:
            # a draft from a pattern of m tokens has at most this many tokens, each scoring at most 1: a candidate
            # that cannot score above the best so far is not drafted (it could not win)
            if min(q.max_tokens, int(factor * m), self.depth - m) <= best[1]:
                continue
            other = trie.draft(node, off, m, q.max_tokens, self.cfg.suffix_min_prob, factor)
            if other[1] > best[1]:
                best = other
            if len(best[0]) == q.max_tokens and best[1] == q.max_tokens:
                break  # a certain draft of full length: nothing scores higher
        return Proposal(best[0], best[2])

    def _global_matches(self, idx: _Index, toks: Sequence[int], max_pattern: int) -> list[tuple[int, int, int]]:
        """`global_trie.matches(toks[-max_pattern:], max_pattern)`, carried forward from the request's last call
        while the global trie has not changed since (tokens only grow) and a walk would not be cheaper, else walked
        afresh."""
        glob = self.global_trie
        if idx.version != self._version or not 0 <= len(toks) - idx.matched <= max_pattern:
            idx.glob, idx.version = glob.matches(toks[-max_pattern:], max_pattern), self._version
        else:
            for t in toks[idx.matched:]:
                idx.glob = advance_matches(glob, idx.glob, t, max_pattern)
        idx.matched = len(toks)
        return idx.glob
