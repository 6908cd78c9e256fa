"""A runner with no compute: deterministic fake next tokens (a function of the token prefix).

Drives scheduler and cache tests and trace replays (`k3rt bench cache`). Because the fake token
depends only on the sequence so far, cache-on and cache-off runs produce the same tokens.
"""

from __future__ import annotations

from k3rt.backend.runner.base import LaunchedStep, Runner
from k3rt.backend.scheduler.request import PENDING
from k3rt.backend.scheduler.scheduler import SchedulerOutput


class NullRunner(Runner):
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def next_token(self, token_ids: list[int]) -> int:
        n = len(token_ids)
        last = token_ids[-1]
        prev = token_ids[-2] if n > 1 else 0
        return (last * 1000003 + prev * 9176 + n * 31) % self.vocab_size

    def execute(self, out: SchedulerOutput) -> dict[int, int | list[int]]:
        return self._execute(out, None)

    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Eager: the fake tokens are computed now (a continuing request's PENDING token is prev's)."""
        return LaunchedStep(sampled=self._execute(out, prev))

    def _execute(self, out: SchedulerOutput, prev: LaunchedStep | None) -> dict[int, int | list[int]]:
        def history(r) -> list[int]:
            ids = r.token_ids
            return ids[:-1] + [prev.sampled[r.rid]] if ids[-1] == PENDING else ids

        sampled: dict[int, int | list[int]] = {r.rid: self.next_token(history(r)) for r in out.decodes}
        sampled.update((c.req.rid, self.next_token(history(c.req))) for c in out.chunks
                       if c.needs_logits and not c.draft_ids)
        for c in out.chunks:
            if c.draft_ids:
                sampled[c.req.rid] = self._verify(c.req, c.draft_ids)
        return sampled

    def _verify(self, req, drafts: list[int]) -> list[int]:
        """Greedy chain verification against the fake next tokens, ending at a token that ends the request
        (as the real verifier does)."""
        seq, run = list(req.token_ids), []
        for j in range(len(drafts) + 1):
            tok = self.next_token(seq)
            run.append(tok)
            seq.append(tok)
            if (j == len(drafts) or tok != drafts[j] or tok in req.stop_ids
                    or req.num_output + len(run) >= req.params.max_tokens):
                break
        return run
