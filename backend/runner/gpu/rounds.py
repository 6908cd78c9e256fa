"""Several speculative rounds in one engine step, on the device (issue 16's batch-1 goal).

Why: at small batch a verify round of k3-tiny is host-bound. On the H200 (benchmarks/spec_round.py, session 18)
a DSpark round at batch 1 took 2.30 ms of wall for 1.30 ms of device work (verify graph 0.95, commit 0.05,
drafter 0.30): the host packed the step, waited for the logits, accepted on the host, recorded the target states,
built the drafter's window and waited for the drafts, with the device idle meanwhile. Here the first round is the
step the scheduler planned (its drafts came from the host); each further round is derived on the device from
the one before, with no host round trip:

  accept    greedy chain acceptance of the round's drafts (the argmax of every row; drafts accepted while they
            equal the row before's argmax), the run cut at the first stop token and at the request's token budget
            exactly as backend/spec/rejection.py cuts it; a request that ended keeps nothing in later rounds;
  commit    the verify form's commit (graph) with those counts: the live KDA states advance by the kept tokens;
  window    the drafter's context window (target states of the last W positions, their token ids, the anchor)
            shifted by the kept rows, whose states the verify forward tapped;
  draft     the drafter's pass on that window (its graph when captured);
  advance   the verify step's device buffers moved to the next round: token ids (the new anchor and the drafts),
            positions, MLA cache rows (from the step's block table: the scheduler allocated pages for every
            round), context lengths; then the verify forward again (graph replay, or the same padded step eagerly).

One read-back at the end returns every round's tokens. Only greedy requests without grammar, logit bias,
penalties or logprobs take this path (the scheduler plans the rounds; the runner checks the rest), so the
output equals the one-round path token for token; the functions below are pure tensor code, graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RoundsRun(list):
    """A verify chunk's emitted tokens over several rounds (what `sampled[rid]` holds), with per round the
    drafts verified and the drafts accepted (the scheduler's acceptance statistics and controller)."""

    def __init__(self, tokens, rounds: list[tuple[int, int]]) -> None:
        super().__init__(tokens)
        self.rounds = rounds


def greedy_accept(argmax: torch.Tensor, fed: torch.Tensor, num_drafts: torch.Tensor, stop_ids: torch.Tensor,
                  budget: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify round's greedy outcome per sequence.

    argmax [S, R]: the target's argmax at each row; fed [S, R]: the fed tokens (anchor, then drafts);
    num_drafts [S]: real drafts per sequence (rows past 1 + num_drafts are padding); stop_ids [S, P]: each
    sequence's stop token ids (-1 pads); budget [S]: tokens it may still emit; live [S] bool.
    -> (kept [S]: tokens the round emits = fed tokens the state keeps (0 when not live), ended [S] bool).
    The emitted tokens are argmax[:, :kept]: a draft accepted at row j equals row j's argmax."""
    S, R = argmax.shape
    j = torch.arange(R - 1, device=argmax.device)
    match = (argmax[:, :-1] == fed[:, 1:]) & (j[None, :] < num_drafts[:, None])
    accepted = match.to(torch.int64).cumprod(1).sum(1)  # [S]
    idx = torch.arange(R, device=argmax.device)
    stop = (argmax[:, :, None] == stop_ids[:, None, :]).any(-1) & (idx[None, :] <= accepted[:, None])
    first_stop = torch.where(stop, idx[None, :], R).amin(1)  # R: none
    cut = torch.minimum(torch.minimum(accepted, first_stop), budget - 1)
    kept = torch.where(live & (budget > 0), cut + 1, 0)
    ended = live & ((first_stop == cut) | (budget - kept <= 0))
    return kept, ended


def shift_window(ctx: torch.Tensor, tokens: torch.Tensor | None, valid: torch.Tensor | None, taps: torch.Tensor,
                 fed: torch.Tensor, kept: torch.Tensor, anchor: torch.Tensor) -> None:
    """In place: the drafter's window after a round that kept `kept` [n] of each sequence's fed rows.
    ctx [n, W, F]: states of the W positions before the anchor, oldest first; tokens [n, W + 1]: their ids, then
    the anchor's; valid [n, W]: rows that hold a state (left padding of short requests is not); taps [n, R, F]:
    the round's states of its fed rows; fed [n, R]: the fed ids; anchor [n]: the new anchor (the last emitted
    token; where kept is 0 the window stays as it was)."""
    n, W, F = ctx.shape
    idx = kept[:, None] + torch.arange(W, device=ctx.device)[None, :]  # [n, W] rows of [old window | fed rows]
    ctx.copy_(torch.cat([ctx, taps.to(ctx.dtype)], 1).gather(1, idx[:, :, None].expand(n, W, F)))
    if tokens is not None:
        shifted = torch.cat([tokens[:, :W], fed], 1).gather(1, idx)
        tokens[:, :W] = shifted
        tokens[:, W] = torch.where(kept > 0, anchor, tokens[:, W])
    if valid is not None:
        valid.copy_(torch.cat([valid, torch.ones_like(fed, dtype=valid.dtype)], 1).gather(1, idx))


def advance_step(ids: torch.Tensor, pos: torch.Tensor, kv_slot: torch.Tensor, ctx_lens: torch.Tensor,
                 table: torch.Tensor, kept: torch.Tensor, anchor: torch.Tensor, drafts: torch.Tensor,
                 block_size: int) -> None:
    """In place, for the first n sequences of a verify-form step (views [n, R] of its ids, positions and cache
    rows; ctx_lens [n] int32; table [n, max_blocks] int32): the next round feeds the anchor and R - 1 drafts at
    the positions right after the kept tokens. Pages for every position the rounds can reach are in the table
    (the scheduler allocated them before packing)."""
    R = ids.shape[1]
    start = pos[:, 0] + kept
    p = start[:, None] + torch.arange(R, device=pos.device)[None, :]
    ids[:, 0] = anchor
    ids[:, 1:] = drafts[:, :R - 1]
    pos.copy_(p)
    kv_slot.copy_(table.gather(1, p // block_size).to(torch.int64) * block_size + p % block_size)
    ctx_lens.add_(kept.to(ctx_lens.dtype))


@dataclass
class RoundsResult:
    tokens: dict[int, RoundsRun]  # rid -> the run over every round
    kept: list[int]  # per sequence: fed tokens the live state advanced by, over every round
    window_rows: list[int]  # per sequence: valid rows of its final drafter window (what to record)


def stop_table(reqs: list, size: int, device: torch.device) -> torch.Tensor:
    """[size, P] int64: each request's stop token ids, -1 padded (rows past the requests: none)."""
    width = max([len(r.stop_ids) for r in reqs] + [1])
    t = torch.full((size, width), -1, dtype=torch.int64)
    for i, r in enumerate(reqs):
        ids = sorted(r.stop_ids)
        if ids:
            t[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return t.to(device, non_blocking=True)


def run_rounds(runner, chunks: list, step, first: tuple, size: int, rounds: int, drafter) -> RoundsResult:
    """Rounds 2..`rounds` of a verify-form step whose first round already ran (see the module docstring).
    chunks: the step's verify chunks, in its sequence order (no plain decodes); step: the verify form's GpuStep
    (views of the graph's static buffers, or of the eager step's); first: (logits [size * R, V], taps
    {layer: [size * R, hidden]}) of round one's forward; drafter: the DSpark drafter (`window`, `draft_tokens`)."""
    from k3rt.backend.spec.base import DraftQuery

    fwd, R, n = runner.fwd, runner.verify_run_len, len(chunks)
    dev = step.ids.device
    g = runner.verify_graphs.get(size)
    reqs = [c.req for c in chunks]
    store = runner.target_states
    queries = [DraftQuery(r.rid, r.token_ids, r.prompt_len, R - 1, store.get(r.rid)) for r in reqs]
    ctx, anchors, tokens, valid = drafter.window(queries)
    host = torch.zeros(3, size, dtype=torch.int64)
    host[0, :n] = torch.tensor([len(c.draft_ids) for c in chunks])
    host[1, :n] = torch.tensor([r.params.max_tokens - r.num_output for r in reqs])
    num_drafts, budget = host[0].to(dev, non_blocking=True), host[1].to(dev, non_blocking=True)
    live = budget > 0
    stops = stop_table(reqs, size, dev)
    ids, pos, slot = step.ids.view(size, R), step.pos.view(size, R), step.kv_slot.view(size, R)
    logits, taps = first
    outs, kepts = [], []
    for r in range(rounds):
        am = logits.view(size, R, -1).argmax(-1)
        kept, ended = greedy_accept(am, ids, num_drafts, stops, budget, live)
        outs.append(am)
        kepts.append(kept)
        if g is not None:
            g.accepted.copy_(kept)
            g.commit.replay()
        else:
            fwd.commit_graphed(step, kept)
        tapped = torch.cat([taps[layer].view(size, R, -1)[:n] for layer in store.layers], -1)
        k = kept[:n]
        anchor = am[:n].gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
        anchor = torch.where(k > 0, anchor, anchors)
        shift_window(ctx, tokens, valid, tapped, ids[:n], k, anchor)
        anchors = anchor
        budget, live = budget - kept, live & ~ended
        if r == rounds - 1:
            break
        drafts = drafter.draft_tokens(ctx, anchors, tokens, valid)
        advance_step(ids[:n], pos[:n], slot[:n], step.ctx_lens[:n], step.block_table[:n], k, anchors, drafts,
                     runner.block_size)
        num_drafts = torch.where(torch.arange(size, device=dev) < n, R - 1, 0)
        if g is not None:
            g.graph.replay()
            runner.verify_graph_replays += 1
            logits, taps = g.logits, g.taps
        else:
            logits = fwd(step)
            taps = dict(fwd.tapped)
    counts = valid.sum(1) if valid is not None else torch.full((n,), ctx.shape[1], device=dev)
    flat = torch.cat([torch.stack(outs).flatten(), torch.stack(kepts).flatten(), counts.to(torch.int64)]).tolist()
    ams = [flat[i * size * R:(i + 1) * size * R] for i in range(rounds)]
    at = rounds * size * R
    kept_h = [flat[at + i * size:at + (i + 1) * size] for i in range(rounds)]
    rows = flat[at + rounds * size:]
    result = RoundsResult({}, [], rows)
    for i, c in enumerate(chunks):
        toks, per = [], []
        for r in range(rounds):
            m = kept_h[r][i]
            if m == 0:
                continue
            toks += ams[r][i * R:i * R + m]
            per.append((len(c.draft_ids) if r == 0 else R - 1, m - 1))
        result.tokens[c.req.rid] = RoundsRun(toks, per)
        result.kept.append(len(toks))
    W = ctx.shape[1]
    for i, c in enumerate(chunks):
        nv = rows[i]
        if nv > 0:
            store.record(c.req.rid, c.start + result.kept[i] - nv, ctx[i, W - nv:])
    return result
