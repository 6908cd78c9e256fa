"""Chain verification of draft tokens against the target's logits: greedy exact, lossless otherwise.

Request r with drafts d_1..d_k has k+1 logits rows; row j is the target's next-token distribution after
the accepted tokens and d_1..d_j. Every row goes through the sampler's own stages exactly as a plain
decode step at that position would (Sampler.process: grammar mask with the matcher advanced past
d_1..d_j, penalties over the output plus d_1..d_j, temperature; Sampler.target_probs: top-k/min-p/top-p),
so speculation changes neither greedy outputs nor the sampled distribution.

Greedy rows accept d_{j+1} iff it is row j's argmax; the first mismatch emits the argmax instead.
Sampled rows use rejection sampling with a one-hot draft distribution q = delta(d) (model-free drafters):
accept d with probability min(1, p(d)/q(d)) = p(d); on rejection draw from the residual (p - q)+
normalized, which is p with d removed and renormalized. If all k drafts pass, row k gives a bonus token.
The emitted run stops early at the first token that ends the request (a stop id, the grammar's end,
max_tokens), so the tokens the scheduler appends and the states the runner commits always agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3rt.backend.sampling.sampler import Sampler


class VerifyResult(NamedTuple):
    token_ids: list[int]  # accepted drafts, then (unless the run ended on a draft) one sampled token
    num_accepted: int  # drafts among token_ids (a prefix of the drafts)
    logprobs: list[float] | None  # per token, when params.logprobs is set (the sampler's convention)
    top_logprobs: list[list[tuple[int, float]]] | None


def _ends(req, tokens: list[int]) -> bool:
    """Would appending `tokens` (the last one just emitted) end the request? The scheduler's rule
    (Scheduler._append), evaluated here so the run stops at the same token."""
    tok = tokens[-1]
    if tok in req.stop_ids or (req.grammar is not None and req.grammar.is_terminated()):
        return True
    return req.num_output + len(tokens) >= req.params.max_tokens


def _grammar_masks(req, drafts: list[int], mask: torch.Tensor) -> None:
    """mask[j] (int32 [k+1, W], CPU) = the grammar's allowed tokens after d_1..d_j. The matcher is advanced
    through the drafts and rolled back, so it ends where it started. Rows after a draft the grammar
    refuses are left all ones: that draft is rejected at its own row (masked to p = 0)."""
    from k3rt.backend.grammar.base import shorten

    g = req.grammar
    mask.fill_(-1)
    advanced = 0
    try:
        for j in range(len(drafts) + 1):
            g.fill_bitmask(mask[j])
            if not bool(mask[j].any()):
                raise ValueError("no token is allowed here (the grammar is in an error state)")
            if j == len(drafts):
                break
            d = drafts[j]
            if not (int(mask[j, d // 32]) >> (d % 32)) & 1 or not g.accept(d):
                break
            advanced += 1
    except Exception as e:
        req.sampled.error = f"grammar: {shorten(str(e))}"
        mask.fill_(-1)
    finally:
        if advanced:
            g.rollback(advanced)


def _race(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from probs [V] by exponential race (the sampler's method)."""
    q = torch.empty_like(probs).exponential_(generator=gen).clamp_(min=torch.finfo(probs.dtype).tiny)
    return int((probs / q).argmax())


def verify_requests(sampler: Sampler, logits: torch.Tensor, reqs: list, drafts: list[list[int]]) -> list[VerifyResult]:
    """logits: [sum(len(d) + 1), V] fp32, request i's rows consecutive in order -> one VerifyResult each.
    Advances each request's grammar matcher past its emitted tokens (a grammar failure is recorded in
    req.sampled.error for the engine to fail that request alone)."""
    params, prompts, outputs, starts = [], [], [], []
    row = 0
    for r, d in zip(reqs, drafts):
        starts.append(row)
        hist = r.params.has_penalties
        for j in range(len(d) + 1):
            params.append(r.params)
            prompts.append(r.token_ids[:r.prompt_len] if hist else ())
            outputs.append(r.token_ids[r.prompt_len:] + d[:j] if hist else ())
        row += len(d) + 1
    mask = None
    if any(r.grammar is not None for r in reqs):
        mask = torch.full((row, (logits.shape[1] + 31) // 32), -1, dtype=torch.int32)
        for r, d, s in zip(reqs, drafts, starts):
            if r.grammar is not None and r.sampled.error is None:
                _grammar_masks(r, d, mask[s:s + len(d) + 1])
        mask = mask.to(logits.device)
    x = sampler.process(logits, params, prompts, outputs, mask)  # [R, V]
    greedy_tok = x.argmax(-1).tolist()
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    probs = {}
    if sampled_rows:
        p = sampler.target_probs(x[sampled_rows], [params[i] for i in sampled_rows])
        probs = {i: p[n] for n, i in enumerate(sampled_rows)}
    results = []
    for r, d, s in zip(reqs, drafts, starts):
        emitted, rows = [], []
        gen = r.generator
        for j in range(len(d) + 1):
            i = s + j
            if r.params.greedy:
                tok = greedy_tok[i]
            elif j < len(d) and float(torch.rand((), generator=gen, device=probs[i].device)) < float(probs[i][d[j]]):
                tok = d[j]
            else:
                p = probs[i]
                if j < len(d):
                    p = p.clone()
                    p[d[j]] = 0.0  # the residual (p - delta(d))+; its normalization does not change the race
                tok = _race(p, gen)
            emitted.append(tok)
            rows.append(i)
            if r.grammar is not None and r.sampled.error is None:
                from k3rt.backend.grammar import accept_or_error

                r.sampled.error = accept_or_error(r.grammar, tok)
            if j == len(d) or tok != d[j] or _ends(r, emitted):
                break
        accepted = next((n for n, (a, b) in enumerate(zip(emitted, d)) if a != b), min(len(emitted), len(d)))
        lp = top = None
        if r.params.logprobs is not None:
            lps = x[rows].log_softmax(-1)
            ids = torch.tensor(emitted, device=lps.device)
            lp = lps.gather(1, ids[:, None])[:, 0].tolist()
            n = min(r.params.logprobs, lps.shape[1])
            top = [[] for _ in rows]
            if n:
                v, t = lps.topk(n, -1)
                top = [list(zip(a, b)) for a, b in zip(t.tolist(), v.tolist())]
        results.append(VerifyResult(emitted, accepted, lp, top))
    return results
