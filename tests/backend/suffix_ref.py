"""The uncompressed suffix trie (every node explicit, D node updates per indexed token): the oracle the
compressed `SuffixTrie` (backend/spec/suffix.py) is checked against, node for node in its logical view and
draft for draft through `SuffixDrafter`. It is the implementation k3rt shipped until session 15, reduced to the
compressed trie's interface (`extend`/`active`, `add` -> sequence id, `remove`, positions as (node, 0))."""

from __future__ import annotations

from collections.abc import Sequence

_SHIFT = 32


class RefSuffixTrie:
    ROOT = 0

    def __init__(self, depth: int, *, removable: bool = True) -> None:
        self.depth, self.removable = depth, removable
        self._edge: dict[int, int] = {}
        self.count, self.total, self.best, self.token, self.serial = [0], [0], [-1], [-1], [0]
        self._kids: list[list[int]] = [[]]
        self._free: list[int] = []
        self._created = 0
        self._seqs: dict[int, list[int]] = {}
        self._sid = 0
        self.active: list[int] = [self.ROOT]

    def __len__(self) -> int:
        return len(self.count) - len(self._free)

    def _new(self, parent: int, tok: int) -> int:
        self._created += 1
        if self._free:
            c = self._free.pop()
            self.count[c], self.total[c], self.best[c], self.token[c], self.serial[c] = 0, 0, -1, tok, self._created
            self._kids[c] = []
        else:
            c = len(self.count)
            for lst, v in ((self.count, 0), (self.total, 0), (self.best, -1), (self.token, tok),
                           (self.serial, self._created)):
                lst.append(v)
            self._kids.append([])
        self._kids[parent].append(c)
        self._edge[parent << _SHIFT | tok] = c
        return c

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.active = self._push(self.active, t, 1)

    def add(self, tokens: Sequence[int]) -> int:
        sid, self._sid = self._sid, self._sid + 1
        self._seqs[sid] = list(tokens)
        active = [self.ROOT]
        for t in tokens:
            active = self._push(active, t, 1)
        return sid

    def remove(self, sid: int) -> None:
        active = [self.ROOT]
        for t in self._seqs.pop(sid):
            active = self._push(active, t, -1)

    def _push(self, active: list[int], tok: int, delta: int) -> list[int]:
        out = [self.ROOT]
        for node in active:
            c = self._edge.get(node << _SHIFT | tok)
            if c is None:
                if delta < 0:
                    continue
                c = self._new(node, tok)
            n = self.count[c] = self.count[c] + delta
            self.total[node] += delta
            if n <= 0:
                self._unlink(node, c)
                continue
            self._rebest(node)
            if len(out) < self.depth:
                out.append(c)
        # suffixes that occurred only now have no continuation: the compressed trie keeps them implicit
        return out

    def _rebest(self, node: int) -> None:
        b = -1
        for c in self._kids[node]:
            if b < 0 or self.count[c] > self.count[b] or (self.count[c] == self.count[b]
                                                          and self.serial[c] < self.serial[b]):
                b = c
        self.best[node] = b

    def _unlink(self, parent: int, c: int) -> None:
        self._kids[parent].remove(c)
        stack = [(parent, c)]
        while stack:
            p, x = stack.pop()
            del self._edge[p << _SHIFT | self.token[x]]
            self._free.append(x)
            stack += [(x, y) for y in self._kids[x]]
        self._rebest(parent)

    def step(self, pos: tuple[int, int], tok: int) -> tuple[int, int] | None:
        c = self._edge.get(pos[0] << _SHIFT | tok)
        return None if c is None else (c, 0)

    def continues(self, pos: tuple[int, int]) -> bool:
        return self.total[pos[0]] > 0

    def count_at(self, pos: tuple[int, int]) -> int:
        return self.count[pos[0]]

    def children_at(self, pos: tuple[int, int]) -> dict[int, int]:
        return {self.token[c]: self.count[c] for c in self._kids[pos[0]]}

    def matches(self, context: Sequence[int], max_len: int) -> list[tuple[int, int, int]]:
        out = []
        n = len(context)
        for m in range(1, min(max_len, n) + 1):
            node = self.ROOT
            for t in context[n - m:]:
                node = self._edge.get(node << _SHIFT | t, -1)
                if node < 0:
                    break
            if node < 0:
                break
            if self.total[node]:
                out.append((node, 0, m))
        return out

    def draft(self, node: int, off: int, m: int, max_tokens: int, min_prob: float, factor: float
              ) -> tuple[list[int], float, list[float]]:
        limit = min(max_tokens, int(factor * m))
        out: list[int] = []
        probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            b = self.best[node]
            if b < 0:
                break
            p = self.count[b] / self.total[node]
            prob *= p
            if prob < min_prob:
                break
            out.append(self.token[b])
            probs.append(p)
            score += prob
            node = b
        return out, score, probs
