"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the request's last n tokens
in its own history (n from ngram_max down to ngram_min) and propose what followed it.

Each request keeps a dict from n-gram to the end position of its latest occurrence, extended as
tokens arrive, so a proposal is (ngram_max - ngram_min + 1) dict lookups whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3rt.backend.spec.base import DraftQuery, Drafter


class _History:
    __slots__ = ("index", "indexed")

    def __init__(self) -> None:
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end position of its latest occurrence
        self.indexed = 0  # n-grams ending before this position are in `index`


class NgramDrafter(Drafter):
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._reqs: dict[int, _History] = {}

    def propose(self, queries: Sequence[DraftQuery]) -> list[list[int]]:
        return [self._propose(q) for q in queries]

    def finish(self, rid: int, token_ids: Sequence[int], prompt_len: int) -> None:
        self._reqs.pop(rid, None)

    def _propose(self, q: DraftQuery) -> list[int]:
        toks = q.token_ids
        h = self._reqs.get(q.rid)
        if h is None:
            h = self._reqs[q.rid] = _History()
        n_tok = len(toks)
        # index every n-gram ending before the last token: the one ending at the last token is the query,
        # and an occurrence must have at least one token after it
        for end in range(h.indexed, n_tok - 1):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                h.index[tuple(toks[end - n + 1:end + 1])] = end
        h.indexed = max(h.indexed, n_tok - 1)
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            end = h.index.get(tuple(toks[n_tok - n:]))
            if end is None:
                continue
            # copy what followed; past the end of the history the match repeats with period n_tok-1-end
            draft: list[int] = []
            for i in range(q.max_tokens):
                j = end + 1 + i
                draft.append(toks[j] if j < n_tok else draft[j - n_tok])
            return draft
        return []
