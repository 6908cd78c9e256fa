"""What a step's logits give its requests, shared by the runners: sampled tokens and prompt logprobs."""

from __future__ import annotations

import torch

from k3rt.backend.sampling.sampler import Sampler


def sample_requests(sampler: Sampler, logits: torch.Tensor, reqs: list) -> dict[int, int]:
    """Sample one token per request row of `logits` (grammar masks, min_tokens, penalties, logprobs);
    -> {rid: token}."""
    if not reqs:
        return {}
    mask = allowed_mask(reqs, logits.shape[1])
    if mask is not None:
        mask = mask.to(logits.device)
    # penalties need token histories; slice them only for rows that use one
    hist = [r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty
            for r in reqs]
    out = sampler.sample_batch(
        logits, [r.params for r in reqs], [r.generator for r in reqs],
        [r.token_ids[:r.prompt_len] if h else () for r, h in zip(reqs, hist)],
        [r.token_ids[r.prompt_len:] if h else () for r, h in zip(reqs, hist)], allowed_mask=mask)
    for i, (r, tok) in enumerate(zip(reqs, out.token_ids)):
        accept_grammar(r, tok)
        if out.logprobs is not None and r.params.logprobs is not None:
            r.sampled.logprob, r.sampled.top_logprobs = out.logprobs[i], out.top_logprobs[i]
    return {r.rid: t for r, t in zip(reqs, out.token_ids)}


def allowed_mask(reqs: list, vocab: int) -> torch.Tensor | None:
    """The batch's token bitmask [B, ceil(vocab/32)] int32 on the CPU (grammar rows, and the stop tokens of rows
    under min_tokens cleared), or None when no row restricts anything. A grammar that fails sets its request's
    error (the engine fails that request alone)."""
    if not any(r.grammar is not None or under_min_tokens(r) for r in reqs):
        return None
    from k3rt.backend.grammar import fill_batch_bitmask

    # rows without a grammar keep every bit set
    mask = torch.full((len(reqs), (vocab + 31) // 32), -1, dtype=torch.int32)
    grammars = [r.grammar for r in reqs]
    if any(g is not None for g in grammars):
        for row, error in fill_batch_bitmask(grammars, mask).items():
            reqs[row].sampled.error = error
    ban_stop_tokens(reqs, mask)
    return mask


def under_min_tokens(r) -> bool:
    """The request has not generated min_tokens yet, so its stop tokens must not be sampled."""
    return r.num_output < r.params.min_tokens and bool(r.stop_ids)


def ban_stop_tokens(reqs: list, mask: torch.Tensor) -> None:
    """Clear the stop-token bits of the rows still under min_tokens. mask: [B, ceil(V/32)] int32, on the CPU.
    A row whose grammar allows nothing but a stop token keeps it: the grammar has ended the text."""
    for row, r in enumerate(reqs):
        if under_min_tokens(r):
            before = mask[row].clone()
            for t in r.stop_ids:
                if t < mask.shape[1] * 32:
                    word = mask[row, t // 32].item() & 0xFFFFFFFF & ~(1 << (t % 32))  # as uint32
                    mask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # back to int32
            if not bool(mask[row].any()):
                mask[row] = before


def accept_grammar(r, tok: int) -> None:
    """Advance the request's grammar past its sampled token; a failure is the request's, not the step's."""
    if r.grammar is not None and r.sampled.error is None:
        from k3rt.backend.grammar import accept_or_error

        r.sampled.error = accept_or_error(r.grammar, tok)


def prompt_score_rows(chunks: list) -> list[tuple[object, int, int]]:
    """(request, packed row, position p) of each prompt position whose next-token logprob is asked
    for: the logits at p score token p+1, and only tokens the request already has."""
    rows, row = [], 0
    for c in chunks:
        r, f = c.req, c.req.prompt_logprobs_from
        if f is not None:
            for p in range(max(c.start, f - 1), min(c.start + c.num_tokens, len(r.token_ids) - 1)):
                rows.append((r, row + p - c.start, p))
        row += c.num_fed
    return rows


def record_prompt_logprobs(logits: torch.Tensor, rows: list[tuple[object, int, int]]) -> None:
    """logits: one row per entry of `rows` -> each request's prompt_logprobs[p + 1], and its
    prompt_top_logprobs[p + 1] (the params.logprobs most likely tokens) when params.logprobs is set.
    Raw model logprobs: no temperature, penalty, bias or grammar applies to a prompt token."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    nxt = torch.tensor([r.token_ids[p + 1] for r, _, p in rows], device=logits.device)
    for (r, _, p), v in zip(rows, lp.gather(1, nxt[:, None])[:, 0].tolist()):
        r.sampled.prompt_logprobs[p + 1] = v
    num_top = [r.params.logprobs or 0 for r, _, _ in rows]
    n = min(max(num_top), lp.shape[1])
    if n:
        values, ids = (t.tolist() for t in lp.topk(n, -1))  # [R, n] each
        for i, ((r, _, p), k) in enumerate(zip(rows, num_top)):
            if k:
                r.sampled.prompt_top_logprobs[p + 1] = list(zip(ids[i][:k], values[i][:k]))
