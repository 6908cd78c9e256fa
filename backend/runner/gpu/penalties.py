"""Per-request token statistics on the device, for repetition/frequency/presence penalties.

The Triton sampler reads, per batch row, a state row: `prompt_mask[row]` (tokens of the prompt, for
the repetition penalty, which covers prompt and output) and `output_counts[row]` (how often each
token was generated, for all three). A request gets a row the first time it samples with a penalty:
its prompt (and any tokens it already generated, after a preemption) are scattered in once; after
each step the sampled tokens are added with one scatter on the device. The host never rebuilds
histories. Rows go back when the request ends (`release`). With every row taken, `rows_for`
answers None and the step samples on the host path instead.
"""

from __future__ import annotations

import torch

from k3rt.backend.device import to_device


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int = 256) -> None:
        self.vocab_size, self.device, self.max_rows = vocab_size, device, max_rows
        self.prompt_mask: torch.Tensor | None = None  # [S, V] bool, allocated on first use
        self.output_counts: torch.Tensor | None = None  # [S, V] int32
        self.row_of: dict[int, int] = {}
        self.free = list(range(max_rows - 1, -1, -1))

    def rows_for(self, reqs: list) -> list[int] | None:
        """The state row of each request (assigning and filling new ones), or None if rows ran out."""
        new = [r for r in reqs if r.rid not in self.row_of]
        if len(new) > len(self.free):
            return None
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        for r in new:
            row = self.free.pop()
            self.row_of[r.rid] = row
            prompt = to_device(torch.tensor(r.token_ids[:r.prompt_len], dtype=torch.long), self.device)
            out = to_device(torch.tensor(r.token_ids[r.prompt_len:], dtype=torch.long), self.device)
            self.prompt_mask[row].zero_().index_fill_(0, prompt, True)
            self.output_counts[row].zero_().index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        return [self.row_of[r.rid] for r in reqs]

    def add_tokens(self, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Add `counts` (0 for rows that own no state row) of each sampled token to its row's output
        counts; rows, tokens, counts: device tensors [B]."""
        assert self.output_counts is not None
        self.output_counts.index_put_((rows, tokens), counts.to(torch.int32), accumulate=True)

    def release(self, rid: int) -> None:
        row = self.row_of.pop(rid, None)
        if row is not None:
            self.free.append(row)
