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
  commit    the verify form's commit (`commit_graphed`) with those counts: the live KDA states advance by the kept
            tokens;
  window    the drafter's context window (target states of the last W positions, their token ids, the anchor)
            shifted by the kept rows, whose states the verify forward tapped;
  draft     the drafter's pass on that window (all K drafts: no confidence cut);
  advance   the verify step's device buffers moved to the next round: token ids (the new anchor and the drafts),
            positions, MLA cache rows (from the step's block table: the scheduler allocated pages for every
            round), context lengths; then the verify forward again.

On CUDA each further round is one replay of the verify bucket's RoundGraph (all of the above, captured at engine
start); without graphs the same functions run eagerly (the CPU tests' path).

One read-back at the end returns every round's tokens. Only greedy requests without grammar, logit bias,
penalties or logprobs take this path (the scheduler plans the rounds; the runner checks the rest), so the
output equals the one-round path token for token; the functions below are pure tensor code, graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rt.backend.device import read_back, to_device
# the pure tensor steps of a round: the kernels' torch oracles (kernels/spec/ref.py), the path without kernels
from k3rt.kernels.spec.ref import advance_step, greedy_accept, shift_window


class RoundsRun(list):
    """A verify chunk's emitted tokens over several rounds (what `sampled[rid]` holds), with per round the
    drafts verified and the drafts accepted (the scheduler's acceptance statistics and controller)."""

    def __init__(self, tokens, rounds: list[tuple[int, int]]) -> None:
        super().__init__(tokens)
        self.rounds = rounds


@dataclass
class RoundState:
    """What the rounds carry from one to the next, per sequence of the verify bucket (device tensors; static
    buffers of a round graph, or fresh ones on the eager path)."""

    ctx: torch.Tensor  # [S, W, F] drafter window states
    tokens: torch.Tensor | None  # [S, W + 1] its token ids and the anchor (drafters that read them)
    valid: torch.Tensor  # [S, W] bool
    anchors: torch.Tensor  # [S]
    num_drafts: torch.Tensor  # [S] real drafts of the round being accepted
    budget: torch.Tensor  # [S] tokens each may still emit
    live: torch.Tensor  # [S] bool
    real: torch.Tensor  # [S] bool: sequences of the step (not padding)
    limit: torch.Tensor  # [S] last position each may feed (advance_step)
    stops: torch.Tensor  # [S, P] stop ids, -1 padded
    argmax: torch.Tensor  # [S, R] the accepted round's argmax rows (out)
    kept: torch.Tensor  # [S] its kept counts (out)

    @classmethod
    def empty(cls, size: int, run: int, window: int, features: int, stops: int, dtype: torch.dtype,
              tokens: bool, device) -> "RoundState":
        z = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(size, window, features, dtype=dtype, device=device),
                   torch.zeros(size, window + 1, **z) if tokens else None,
                   torch.zeros(size, window, dtype=torch.bool, device=device), torch.zeros(size, **z),
                   torch.zeros(size, **z), torch.zeros(size, **z), torch.zeros(size, dtype=torch.bool, device=device),
                   torch.zeros(size, dtype=torch.bool, device=device), torch.zeros(size, **z),
                   torch.full((size, stops), -1, **z),
                   torch.zeros(size, run, **z), torch.zeros(size, **z))


def accept_round(runner, step, st: RoundState, logits: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
    """Accept the round whose forward wrote `logits` [S * R, V] and `taps`, commit its kept tokens into the live
    KDA states and shift the window past them."""
    S, R = st.argmax.shape
    ids = step.ids.view(S, R)
    tapped = torch.cat([taps[layer].view(S, R, -1) for layer in runner.target_states.layers], -1)
    fused = _fused(runner)
    if fused is not None:  # the same steps in three launches where ~50 torch ops ran (kernels/spec/triton_rounds.py)
        torch.argmax(logits.view(S, R, -1), -1, out=st.argmax)
        fused.round_accept(st.argmax, ids, st.num_drafts, st.stops, st.budget, st.live, st.anchors, st.kept)
        runner.fwd.commit_graphed(step, st.kept)
        fused.round_shift(st.ctx, st.tokens, st.valid, tapped, ids, st.kept, st.anchors)
        return
    am = logits.view(S, R, -1).argmax(-1)
    kept, ended = greedy_accept(am, ids, st.num_drafts, st.stops, st.budget, st.live)
    st.argmax.copy_(am)
    st.kept.copy_(kept)
    runner.fwd.commit_graphed(step, st.kept)
    anchor = am.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0]
    anchor = torch.where(kept > 0, anchor, st.anchors)
    shift_window(st.ctx, st.tokens, st.valid, tapped, ids, kept, anchor)
    st.anchors.copy_(anchor)
    st.budget.sub_(kept)
    st.live.logical_and_(~ended)


def _fused(runner):
    """kernels/spec (its round_accept, round_shift, round_advance) when the runner's kernels are on, else None."""
    if not runner.fwd.k.triton:
        return None
    import k3rt.kernels.spec as fused  # Triton: imported only where the kernels run

    return fused


def next_round(runner, drafter, step, st: RoundState, logits_out: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """Draft from the window, move the step to the next round, run its verify forward -> (logits, taps)."""
    S, R = st.argmax.shape
    extra = {"ctx_tokens": st.tokens, "ctx_valid": st.valid} if drafter.model.needs_tokens else {}
    drafts = drafter.model.greedy_pass(st.ctx, st.anchors, drafter.embed, drafter.lm_head, fused=drafter.fused,
                                       **extra)[0]
    views = (step.ids.view(S, R), step.pos.view(S, R), step.kv_slot.view(S, R), step.ctx_lens, step.block_table,
             st.kept, st.anchors, drafts, runner.block_size, st.real, st.limit)
    fused = _fused(runner)
    if fused is not None:
        fused.round_advance(*views, st.num_drafts)
    else:
        advance_step(*views)
        st.num_drafts.copy_(torch.where(st.real, R - 1, 0))
    logits = runner.fwd(step, logits_out=logits_out)
    return logits, dict(runner.fwd.tapped)


class RoundGraph:
    """One verify bucket's round in a CUDA graph: accept the last forward, commit, shift, draft, advance, verify
    forward (its logits into the verify graph's buffer, its taps copied into the verify graph's, so the next
    replay reads them where the first round left them). Captured once, at engine start, on pad sequences."""

    STOPS = 16  # stop ids per request a round graph checks (a request with more takes one round per step)

    def __init__(self, runner, drafter, size: int, pool) -> None:
        g = runner.verify_graphs[size]
        cfg = drafter.model.cfg
        R = runner.verify_run_len
        self.size, self.g = size, g
        self.st = RoundState.empty(size, R, cfg.context_len, drafter.model.fc.in_features, self.STOPS,
                                   drafter.dtype, drafter.model.needs_tokens, g.logits.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())

        def body() -> None:
            accept_round(runner, g.step, self.st, g.logits, g.taps)
            _, taps = next_round(runner, drafter, g.step, self.st, g.logits)
            for layer, t in taps.items():
                g.taps[layer].copy_(t)

        with torch.cuda.stream(side):
            body()  # compile and warm up outside the capture (pad sequences, nothing live: kept 0)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            body()


def stop_table(reqs: list, size: int, device: torch.device) -> torch.Tensor:
    """[size, P] int64: each request's stop token ids, -1 padded (rows past the requests: none)."""
    width = max([len(r.stop_ids) for r in reqs] + [1])
    t = torch.full((size, width), -1, dtype=torch.int64)
    for i, r in enumerate(reqs):
        ids = sorted(r.stop_ids)
        if ids:
            t[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return t.to(device, non_blocking=True)


def run_rounds(runner, chunks: list, step, first: tuple, size: int, rounds: int, drafter) -> dict[int, RoundsRun]:
    """Rounds 2..`rounds` of a verify-form step whose first round already ran (see the module docstring).
    chunks: the step's verify chunks, in its sequence order (no plain decodes); step: the verify form's GpuStep
    (views of the graph's static buffers, or of the eager step's); first: (logits [size * R, V], taps
    {layer: [size * R, hidden]}) of round one's forward; drafter: the DSpark drafter. Each further round replays
    the bucket's round graph when one was captured (runner.round_graphs), else runs the same ops eagerly.
    -> rid -> its run over every round; the final windows are recorded as the requests' target states."""
    from k3rt.backend.spec.base import DraftQuery

    R, n = runner.verify_run_len, len(chunks)
    dev = step.ids.device
    reqs = [c.req for c in chunks]
    store = runner.target_states
    queries = [DraftQuery(r.rid, r.token_ids, r.prompt_len, R - 1, store.get(r.rid)) for r in reqs]
    ctx, anchors, tokens, valid = drafter.window(queries)
    host = torch.zeros(3, size, dtype=torch.int64)
    host[0, :n] = torch.tensor([len(c.draft_ids) for c in chunks])
    host[1, :n] = torch.tensor([r.params.max_tokens - r.num_output for r in reqs])
    host[2, :n] = torch.tensor([r.prompt_len + r.params.max_tokens - 1 for r in reqs])
    host = host.to(dev, non_blocking=True)
    stops = stop_table(reqs, size, dev)
    rg = runner.round_graphs.get(size)
    if rg is not None and stops.shape[1] > RoundGraph.STOPS:
        rg = None
    st = rg.st if rg is not None else RoundState.empty(size, R, ctx.shape[1], ctx.shape[2], stops.shape[1],
                                                       ctx.dtype, tokens is not None, dev)
    fill_state(st, ctx, anchors, tokens, valid, host[0], host[1], host[2], stops, n)
    logits, taps = first
    outs, kepts = [], []
    for _ in range(rounds - 1):
        if rg is not None:
            rg.graph.replay()
            runner.verify_graph_replays += 1
        else:
            accept_round(runner, step, st, logits, taps)
            logits, taps = next_round(runner, drafter, step, st, None)
        outs.append(st.argmax.clone())
        kepts.append(st.kept.clone())
    if rg is not None:
        logits, taps = rg.g.logits, rg.g.taps
    accept_round(runner, step, st, logits, taps)
    outs.append(st.argmax)
    kepts.append(st.kept)
    # the next step's drafts from the final windows, read back with this step's tokens (DSparkDrafter.carry); the
    # window's token ids on padding rows as the host builds them (the anchor), so the window is the one the next
    # step would build from the recorded states
    valid = st.valid[:n].clone()
    tokens = None
    if st.tokens is not None:
        tokens = st.tokens[:n].clone()
        tokens[:, :-1] = torch.where(valid, tokens[:, :-1], st.anchors[:n, None])
    window = (st.ctx[:n].clone(), st.anchors[:n].clone(), tokens, valid)
    drafts, conf, prefix = drafter.pass_on(*window)
    K = drafts.shape[1]
    flat = torch.cat([torch.stack(outs).flatten(), torch.stack(kepts).flatten(),
                      st.valid[:n].sum(1).to(torch.int64), torch.cat([drafts, prefix[:, None]], 1).flatten()]).tolist()
    confs = conf.float().tolist()
    ams = [flat[i * size * R:(i + 1) * size * R] for i in range(rounds)]
    at = rounds * size * R
    kept_h = [flat[at + i * size:at + (i + 1) * size] for i in range(rounds)]
    at += rounds * size
    rows, nxt = flat[at:at + n], flat[at + n:]
    runs: dict[int, RoundsRun] = {}
    W = st.ctx.shape[1]
    counts = []
    for i, c in enumerate(chunks):
        toks, per = [], []
        for r in range(rounds):
            m = kept_h[r][i]
            if m:
                toks += ams[r][i * R:i * R + m]
                per.append((len(c.draft_ids) if r == 0 else R - 1, m - 1))
        runs[c.req.rid] = RoundsRun(toks, per)
        counts.append(len(c.req.token_ids) + len(toks))
        if rows[i] > 0:
            store.record(c.req.rid, c.start + len(toks) - rows[i], st.ctx[i, W - rows[i]:])
    drafter.carry([c.req.rid for c in chunks], counts, [nxt[i * (K + 1):(i + 1) * (K + 1)] for i in range(n)],
                  confs, window)
    return runs


def fill_state(st: RoundState, ctx, anchors, tokens, valid, num_drafts, budget, limit, stops, n: int) -> None:
    """The first n sequences' window and counts into `st` (the rest: padding, never live)."""
    st.ctx[:n].copy_(ctx)
    st.anchors[:n].copy_(anchors)
    if st.tokens is not None:
        st.tokens[:n].copy_(tokens)
    st.valid[:n].copy_(valid)
    st.num_drafts.copy_(num_drafts)
    st.budget.copy_(budget)
    st.limit.copy_(limit)
    st.live.copy_(budget > 0)
    st.real.copy_(torch.arange(st.real.shape[0], device=budget.device) < n)
    st.stops.fill_(-1)
    st.stops[:, :stops.shape[1]].copy_(stops)


@dataclass
class PendingCarry:
    """A drafter pass queued on the device after a plain step (`queue_first_pass`), read back by the step's collect
    (`carry_back`): the next step's proposal for these requests then takes it instead of building their windows and
    running a pass with the host waiting."""

    rids: list[int]
    counts: list[int]  # each request's token count once the step's sampled token (the pass's anchor) is appended
    drafts: torch.Tensor  # [n, K + 1]: the drafts, then the confident prefix (pinned host memory on CUDA)
    conf: torch.Tensor  # [n, K] fp32 (likewise)
    window: tuple  # (ctx, anchors, tokens, valid), rows in rids' order
    # CUDA: recorded after the copies to the host; `carry_back` waits for it, not for the stream, which by then may
    # hold the next step's work (overlap scheduling); None elsewhere
    ready: torch.cuda.Event | None = None


def queue_first_pass(drafter, store, chunks: list, tokens: torch.Tensor, rows: dict[int, int]) -> PendingCarry | None:
    """After a step that sampled on the device (`tokens`, one per entry of `rows`: rid -> index): for each request
    whose prompt this step completed (its first sampled token; a speculative request with recorded target states),
    the drafter's window with that token as the anchor and its pass, queued on the device (no sync). Why: at batch
    1 a request's first drafting step otherwise builds the window from the recorded states and runs the pass with the
    host waiting (session 33 on the H200: 1.2 ms of host time in a 15 ms k3-tiny step of 16 rounds, once per
    request), while its later steps draft from the pass the previous step's rounds carried (DSparkDrafter.carry).
    The window is `drafter.window`'s for the token ids with the sampled token appended: built with a placeholder
    anchor, whose places (the last token id, the padding rows' ids, the anchor) then take the sampled token on the
    device. No host sync: every host-to-device copy here is pinned and non-blocking."""
    from k3rt.backend.spec.base import DraftQuery

    picked = [c for c in chunks if c.needs_logits and not c.draft_ids and c.req.params.speculative
              and c.start + c.num_tokens == c.req.prompt_len and c.req.rid in rows]
    queries = []
    for c in picked:
        hidden = store.get(c.req.rid)
        if hidden is not None and store.end(c.req.rid) == c.start + c.num_tokens:
            queries.append(DraftQuery(c.req.rid, [*c.req.token_ids[:c.req.prompt_len], 0], c.req.prompt_len,
                                      drafter.model.cfg.block_size, hidden))
    if not queries:
        return None
    ctx, anchors, ids, valid = drafter.fresh_window(queries)
    sampled = tokens.index_select(0, to_device(torch.tensor([rows[q.rid] for q in queries]), tokens.device))
    anchors = sampled.to(anchors.dtype)
    if ids is not None:
        # the anchor's places: the left padding (the window rows that hold no state: `_inputs` pads with the
        # anchor) and the last column
        anchor_at = torch.cat([~valid, torch.ones_like(valid[:, :1])], 1)
        ids = torch.where(anchor_at, sampled[:, None].to(ids.dtype), ids)
    window = (ctx, anchors, ids, valid)
    drafts, conf, prefix = drafter.pass_on(*window)
    drafts, conf, ready = torch.cat([drafts, prefix[:, None].to(drafts.dtype)], 1), conf.float(), None
    if drafts.is_cuda:
        (drafts, conf), ready = read_back(drafts, conf)
    return PendingCarry([q.rid for q in queries], [q.prompt_len + 1 for q in queries], drafts, conf, window, ready)


def carry_back(drafter, pending: PendingCarry) -> None:
    """Hand a queued pass to the drafter once the device has run it (its own event, not the stream)."""
    if pending.ready is not None:
        pending.ready.synchronize()
    drafter.carry(pending.rids, pending.counts, pending.drafts.tolist(), pending.conf.tolist(), pending.window)
