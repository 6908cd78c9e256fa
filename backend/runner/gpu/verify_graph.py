"""The padding plan of verify steps replayed from CUDA graphs (host only: python and numpy, no device).

A graph is captured per (batch bucket, run length R = K + 1) and runs every one of its `size` sequences for R
rows, each as a verify run: KDA leaves every live state at the run's start (the runner's commit replays
each request's kept prefix afterwards: 1 token for a plain decode, the accepted run for a verify), and every
MLA row is its own decode query over the context it sees (pack_step's row_queries form). A step of n <= size
requests, each a plain decode (1 row) or a verify of d <= K drafts (1 + d rows), fits it by padding:

  rows past a request's real length feed token 0 at the position of the request's last real row (so the
    query sees exactly the real context and no page past the request's table is looked up) and write
    their MLA latent into the runner's reserved pad page, never into a page the request or anyone owns;
  requests n..size-1 are pad sequences: pad page as table and state set, position 0;
  KDA scratch rows past the real length are never committed (the commit keeps at most the real length),
    and the pad sequences are not committed at all.

Sampling and verification read only the real rows: `logit_rows` lists them in the eager step's logit order
(each plain decode's row, then every row of each verify run), `fed_rows` maps each row of the eager packing
(request after request, its real rows) to its graph row (target-state taps, tokens fed from the device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from k3rt.backend.runner.gpu.step import StepMeta, StepSeq


@dataclass(frozen=True)
class VerifyPlan:
    size: int  # the batch bucket (sequences in the graph)
    run_len: int  # R = K + 1: rows per sequence in the graph
    real_lens: tuple[int, ...]  # rows each real request feeds (1: a plain decode; 1 + d: a verify of d drafts)
    logit_rows: tuple[int, ...]  # graph rows the sampler reads, in the eager step's logit order
    fed_rows: tuple[int, ...]  # graph row of each eager packed row (real rows only, request by request)

    @property
    def num_rows(self) -> int:
        return self.size * self.run_len


def plan_verify(seqs: list[StepSeq], size: int, run_len: int, pad_seq: StepSeq) -> tuple[list[StepSeq], VerifyPlan]:
    """The step's sequences padded to `size` sequences of `run_len` rows each, and the plan that reads them.
    seqs: the step's requests as the eager step packs them (plain decodes and verify runs, one fed token plus
    the drafts, no snapshots); pad_seq: the runner's pad sequence (pad page table and state set)."""
    if not 1 <= len(seqs) <= size:
        raise ValueError(f"seqs: a verify graph of batch {size} takes 1..{size} requests, got {len(seqs)}")
    padded, logit_plain, logit_verify, fed = [], [], [], []
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        if not 1 <= n <= run_len or s.snapshots or not s.needs_logits:
            raise ValueError(f"seqs[{i}]: a verify graph row runs 1..{run_len} sampled tokens with no snapshots, "
                             f"got {n} tokens, {len(s.snapshots)} snapshots, needs_logits={s.needs_logits}")
        row0 = i * run_len
        fed.extend(range(row0, row0 + n))
        if s.verify:
            logit_verify.extend(range(row0, row0 + n))
        else:
            logit_plain.append(row0)
        padded.append(replace(s, token_ids=list(s.token_ids) + [0] * (run_len - n), verify=True, snapshots=[]))
    pad = replace(pad_seq, token_ids=[0] * run_len, start=0, verify=True, needs_logits=True, snapshots=[])
    padded += [pad] * (size - len(seqs))
    plan = VerifyPlan(size, run_len, tuple(len(s.token_ids) for s in seqs) + (1,) * (size - len(seqs)),
                      tuple(logit_plain + logit_verify), tuple(fed))
    return padded, plan


def pad_rows(meta: StepMeta, h64: torch.Tensor, plan: VerifyPlan, pad_slot: int) -> None:
    """In place, in pack_step's int64 buffer of the padded sequences: every row past its sequence's real
    length takes the position of the sequence's last real row and writes its MLA latent to `pad_slot` (a row
    of the reserved pad page). The token ids, positions and cache rows lead the buffer (step.py)."""
    T = plan.num_rows
    if meta.num_tokens != T or not meta.row_queries:
        raise ValueError(f"meta: a verify graph step packs {T} rows in the row_queries form, got "
                         f"{meta.num_tokens} rows, row_queries={meta.row_queries}")
    flat = h64.numpy()
    pos, kv_slot = flat[T:2 * T].reshape(plan.size, plan.run_len), flat[2 * T:3 * T].reshape(plan.size, plan.run_len)
    lens = np.asarray(plan.real_lens, dtype=np.int64)
    pad = np.arange(plan.run_len)[None, :] >= lens[:, None]  # [size, R]
    last = pos[np.arange(plan.size), lens - 1]
    pos[pad] = np.broadcast_to(last[:, None], pad.shape)[pad]
    kv_slot[pad] = pad_slot
