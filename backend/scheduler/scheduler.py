"""Continuous batching with chunk-aligned prefill over one page pool and the radix prefix cache.

The scheduling model (one rule, no phases): every request has `num_computed` of its `token_ids`
in its cache; a step hands out a token budget, decode-like requests (one token left) first, then
continuing prefills, then new admissions. A request whose fed tokens reach the end of its
`token_ids` gets logits and samples the next token. Prefill tokens are further capped by the
decode-aware chunk budget (`prefill_budget`): each running decode takes `decode_token_cost` of them,
so a step with many decodes stays about as long as a plain prefill step.

After the forward, `update` = `advance` (what the step fed is computed; a sampled request gets a PENDING
token) + `resolve` (the real tokens; stops and ends). With overlap scheduling (backend/overlap.py) the
two are a step apart: the next step is scheduled and launched between them, so a request whose token is
in flight is a plain decode of its PENDING token; one whose in-flight token is its last (max_tokens) is
not scheduled again.

Chunk alignment: a non-final chunk ends on the snapshot grid (`hash_block_size`), and a chunk that
starts off the grid (a conversation resuming from an end-of-turn snapshot) stops at the next grid
point, so every snapshot emitted inside a chunk sits a whole number of KDA chunks (64) from its start;
a planned snapshot that would not (the full-block baseline's grid is the page size, e.g. 1888) ends
the chunk instead. Snapshots are emitted by the forward itself (ForwardBatch.state_positions), so
publishing them costs no extra steps. A snapshot published at p holds the state after exactly p tokens.

Resources: a request is admitted with its first chunk (MLA pages for it, one live state set, one
copy-on-write page when the hit ends mid-page); a chunk that does not fit shrinks to what fits (on
the grid) before anything is preempted. Under pressure the prefix cache is evicted first, then the
running requests newer than the one asking are preempted, newest first (a preempted request's live
state is donated to the cache as a snapshot, so while memory allows it resumes where it stopped); a
request that is itself the newest waits (skips the step, keeps what it holds) rather than preempt
itself. Pinned snapshots (a DSL program between its calls) never block progress: a lone request that
cannot get pages drops the oldest pins, and pins never hold more than `max_pinned_fraction` of the
pool. A request that could never fit is refused by Engine.add_request; one that still cannot be
scheduled with nothing running and nothing cached fails with an error instead of spinning.

What gets published, and as what kind (`_plan_snapshots`), is the cache policy's admission half; a
publish may evict only snapshots worth less than it, and interior checkpoints use free memory only.
Eviction by value per page is the tree's (backend/cache/radix.py, backend/cache/policy.py).

Speculative decoding (with a drafter): a decode-like request may instead feed its last token plus k
draft tokens in one verify chunk (`ScheduledChunk.draft_ids`). Drafts are opportunistic: they take the
token budget left after the decodes and the per-step draft budget, and lookahead pages only from free
memory (never evicting or preempting for them). The runner verifies, emits the accepted run (ending at the
first token that ends the request) and leaves the live state after exactly the fed tokens of that run;
`update` advances num_computed by the run's length. Rejected positions' KV is past num_computed and is
overwritten later, so nothing is published there: snapshots stay at accepted positions only.

Whether a step drafts at all is the speculation controller's (backend/spec/gate.py, when one is given): it
plans before the drafter's pass (skipping the pass when drafting is not expected to pay) and trims each
request's drafts after it, from step costs and acceptance it learns; the scheduler feeds it the drafter's
pass time and every verify's outcome.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from k3rt.backend.cache.policy import CHECKPOINT, END, JUNCTION, PREEMPTED, tail_kind
from k3rt.backend.cache.pool import PagePool
from k3rt.backend.cache.radix import Node, RadixCache, common_prefix as _common_prefix
from k3rt.backend.scheduler.request import PENDING, FinishReason, Request, Status
from k3rt.backend.spec.base import DraftQuery, Drafter
from k3rt.backend.spec.gate import Plan, SpecGate, Why
from k3rt.config import KDA_CHUNK, CacheConfig, SchedulerConfig, SpecConfig

if TYPE_CHECKING:
    from k3rt.backend.spec.target_states import TargetStates

log = logging.getLogger(__name__)

# waiting requests compared token by token with a running request per step (~0.1 ms each for a 4K
# prefix): a thousand requests arriving together are looked at over a few steps, not in one
PREFIX_CHECKS_PER_STEP = 32
# device rounds are planned on this share of a request's expected accepted drafts per round: a round too many costs
# one replay (~0.9 ms for k3-tiny at batch 1 on the H200), a round too few another step, whose first round the
# host drafts (~2 ms), so the plan errs toward one round more
PLAN_YIELD_SHARE = 0.85
# a model drafter drafts for a request once its recorded target states hold this many positions (or all it has):
# k3-tiny's drafter at K 7 on held-out code drafts at tau 1.80 / 1.97 / 2.17 / 2.61 / 3.32 / 3.48 / 3.52 with the
# last 1 / 2 / 4 / 8 / 16 / 32 / 128 window rows valid (the CPU replay of session 22)
MIN_STATE_ROWS = 16


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # absolute position of the first fed token
    num_tokens: int
    needs_logits: bool  # the chunk reaches the end of token_ids: sample the next token
    snapshots: list[tuple[int, list[int]]] = field(default_factory=list)  # (position, dest state set)
    # a verify chunk: these draft tokens are fed after token_ids[start:start + num_tokens] (num_tokens == 1,
    # needs_logits), logits come back for every fed position and the runner returns the accepted run
    draft_ids: list[int] = field(default_factory=list)
    # the accepted drafts the drafter's own estimates predicted (DSpark confidence), for the controller's calibration
    draft_estimate: float | None = None

    @property
    def num_fed(self) -> int:
        """Tokens this chunk puts through the model (drafts included)."""
        return self.num_tokens + len(self.draft_ids)


@dataclass
class SchedulerOutput:
    decodes: list[Request]  # one token each at position num_computed, always sampled (the fast path)
    chunks: list[ScheduledChunk]  # multi-token chunks (prefill, or a resumed request)
    page_copies: list[tuple[int, int]]  # MLA partial-page copy-on-write: (src page, dst page), all tensors
    state_copies: list[tuple[list[int], list[int]]]  # snapshot -> live state set, before the forward
    # speculative rounds the runner may run on the device in this step (backend/runner/gpu/rounds.py): > 1 only
    # for a step of greedy verify chunks whose pages cover every round (_plan_rounds)
    spec_rounds: int = 1
    # the runner may queue the drafter's pass for the requests whose prompt this step completes, their first drafts
    # (backend/runner/gpu/rounds.py queue_first_pass): device rounds run, and the controller's latest plan drafted
    first_pass: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_fed for c in self.chunks)


@dataclass
class AdvancedStep:
    """A launched step as `Scheduler.advance` left it: the tokens it will sample, not yet known."""

    pending: list[tuple[Request, int]]  # (request, index in its token_ids holding PENDING)
    verify: list[ScheduledChunk]  # verify chunks: advanced by `resolve`, once their accepted run is known
    fences: list[int]  # refs on the sources of the step's copies, held until the step has run


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once per request)
    computed_tokens: int = 0  # tokens fed through the model
    computed_prompt_tokens: int = 0  # of those, prompt positions (recomputation after preemption included)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    preemptions: int = 0
    snapshots_published: int = 0
    pins_dropped: int = 0  # pins released by the cap or to let a request run, not by their owner
    admissions_held: int = 0  # steps that held the waiting queue back (SchedulerConfig.prefill_delay_steps)
    spec_verifies: int = 0  # verify chunks run (speculative decoding)
    spec_drafted_tokens: int = 0  # draft tokens fed to verification
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_steps: int = 0  # steps in which some request could speculate (the controller was asked)
    spec_steps_speculated: int = 0  # of those, steps that verified drafts
    spec_steps_skipped: int = 0  # of those, steps the controller decoded plainly (before or after the drafter's pass)
    spec_probes: int = 0  # steps the controller drafted while speculation did not pay, to refresh its estimates
    spec_drafter_errors: int = 0  # drafter calls that raised (the step decoded without drafts; the log has each)
    # the controller's plans by their reason (gate.Why values): why a step drafted or did not
    spec_plan_whys: dict[str, int] = field(default_factory=dict)

    @property
    def spec_tau(self) -> float:
        """Mean tokens emitted per verify (accepted drafts + 1); 0 before the first verify."""
        v = self.spec_verifies
        return (self.spec_accepted_tokens + v) / v if v else 0.0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache_cfg: CacheConfig, pool: PagePool, tree: RadixCache,
                 drafter: Drafter | None = None, spec_cfg: SpecConfig | None = None,
                 target_states: TargetStates | None = None, gate: SpecGate | None = None,
                 device_rounds: bool = False) -> None:
        """target_states: the target states a model drafter reads (the runner records them), put into each
        DraftQuery.hidden; None for model-free drafters. gate: the speculation controller (None: every step that
        can draft does). device_rounds: the runner can run several verify rounds of a step on the device
        (spec_cfg.rounds of them at most: `_plan_rounds`)."""
        self.cfg, self.cache_cfg, self.pool, self.tree = cfg, cache_cfg, pool, tree
        if drafter is not None and spec_cfg is None:
            raise ValueError("spec_cfg: a drafter needs its SpecConfig (draft lengths and budget)")
        self.drafter, self.spec_cfg, self.target_states, self.gate = drafter, spec_cfg, target_states, gate
        self.device_rounds = device_rounds  # the runner runs several verify rounds per step (_plan_rounds)
        self.step_draft_s = 0.0  # seconds of the drafter's pass in the last schedule() (the engine takes it off the step)
        self.step_rounds = 1  # most verify rounds a request ran in the steps resolved since the engine last reset it
        self.step_drafted = 0  # draft tokens verified, over every round, in the steps resolved since then
        self._next_plan: Plan | None = None  # the controller's plan for the next step, made early (overlap)
        # whether the controller's latest plan drafted (True with no controller): a new request's first pass is queued
        # only then (SchedulerOutput.first_pass), so steps that decode plainly pay no drafter pass per arrival
        self._last_plan_drafted = True
        self.B = tree.B
        self.grid = self.B if cache_cfg.full_block_mode else cache_cfg.hash_block_size
        self.S = pool.layout.pages_per_state_set
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._preempted_this_step = False
        self._step_decodes: list[Request] = []
        self._chunks: dict[int, ScheduledChunk] = {}
        self._prefix_checks = 0
        # rid of a finished pinned request -> the node whose snapshot it keeps; oldest first
        self.pins: OrderedDict[int, Node] = OrderedDict()
        self.failed: list[Request] = []  # requests schedule() had to fail; the engine reports them
        self.admitted_now: list[Request] = []  # first admissions since the engine last looked (queue wait)
        self.step_fences: list[list[int]] = []  # fences of the advanced steps not resolved yet (overlap)
        self.steps = 0  # schedule() calls so far (admission batching counts a wait in steps)

    @property
    def usable_pages(self) -> int:
        """Pages the scheduler can ever hand out (the runner's reserved scratch pages excluded)."""
        return self.pool.num_pages - len(self.pool.reserved)

    # ---- queue ----

    def add(self, req: Request) -> None:
        req.queued_step = self.steps
        self.waiting.append(req)

    def abort(self, req: Request, reason: FinishReason = FinishReason.ABORT) -> None:
        _drop_pending(req)
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, reason
            if self.drafter is not None:
                self._drafter_finish(req)
        elif req.status is Status.RUNNING:
            # a live state that holds a dropped in-flight token is not a state of the known tokens
            self._finish(req, reason, donate=req.num_computed <= len(req.token_ids))

    def unpin(self, req: Request | None, rid: int) -> None:
        """Release the pin request `rid` holds (or, still live, will not take) on its end snapshot."""
        if req is not None and not req.finished:
            req.pin = False  # the owner is done with it before it finished: never pin it
            return
        node = self.pins.pop(rid, None)
        if node is not None:
            self.tree.unpin(node)

    def _drop_oldest_pin(self) -> bool:
        if not self.pins:
            return False
        _, node = self.pins.popitem(last=False)
        self.tree.unpin(node)
        self.stats.pins_dropped += 1
        return True

    def drop_pins(self) -> None:
        """`flush_cache`: every pin goes (its owners recompute what they need)."""
        while self._drop_oldest_pin():
            pass

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        self.steps += 1
        self.step_draft_s = 0.0
        budget = self.cfg.max_num_batched_tokens
        chunks = self._chunks = {}
        self._preempted_this_step = False
        B = self.B
        # decode-like requests (one token to feed) first, oldest first: the hot path, kept lean
        decodes: list[Request] = []
        multi: list[Request] = []
        for req in self.running:
            if req.num_output >= req.params.max_tokens:
                continue  # its in-flight token (overlap) is its last: it ends when that token is resolved
            (decodes if len(req.token_ids) - req.num_computed == 1 else multi).append(req)
        del decodes[budget:]
        self._step_decodes = decodes
        for req in list(decodes):
            if req.status is not Status.RUNNING:
                continue  # preempted by an earlier request of this loop: it holds nothing now
            nc = req.num_computed
            if nc % B == 0 and nc // B >= len(req.block_table) and not self._ensure_pages(req, nc + 1):
                self._drop_from_step(req)  # the newest, out of pages: waits for the older requests
        budget -= len(decodes)
        if self.drafter is not None and budget > 0:
            if self.gate is not None and self._prefill_coming(multi, decodes, budget):
                # the controller drafts in decode-only steps only: a step with a prefill chunk is no sample of
                # any step cost it learns (cost.py), and verify rows there were far from free (k3-tiny at batch
                # 64 on the H200: such calls took 57-62 ms against 9-17 ms without the rows, session 16)
                self._next_plan = None
                if any(self._draft_limit(r) > 0 for r in decodes):
                    self.stats.spec_steps += 1
                    self.stats.spec_steps_skipped += 1
            else:
                budget -= self._schedule_drafts(budget)
            decodes = self._step_decodes
        budget = min(budget, self.prefill_budget(len(decodes)))
        for req in multi:
            if budget <= 0:
                break
            if req.status is Status.RUNNING:  # not preempted earlier in this step
                budget -= self._schedule_chunk(req, budget)
        # no admissions in a step that had to preempt: the freed memory belongs to running requests
        deferred: list[Request] = []
        self._prefix_checks = 0
        can_admit = budget > 0 and len(self.running) < self.cfg.max_running and not self._preempted_this_step
        hold = can_admit and self.hold_admissions(decodes, budget)
        if hold:
            self.stats.admissions_held += 1
        while (self.waiting and budget > 0 and len(self.running) < self.cfg.max_running
               and not self._preempted_this_step and not hold):
            req = self.waiting[0]
            if self._prefix_checks >= PREFIX_CHECKS_PER_STEP and req.wait_on is None:
                break  # the rest of the queue is looked at in the next steps (bounded host time)
            if req.grammar_future is not None or self._wait_for_shared_prefix(req):
                # admitted once its grammar is compiled / the sharer published the shared prefix
                deferred.append(self.waiting.popleft())
                continue
            n = self._admit(req, budget)
            if n == 0:
                break
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if not self.running and self.waiting and not deferred and budget > 0 and not self.step_fences:
            # nothing runs (or is in flight), nothing is cached or pinned any more, and the head still does
            # not fit: it never will (add_request's size check makes this unreachable; never spin on it)
            head = self.waiting.popleft()
            head.status, head.finish_reason = Status.FINISHED, FinishReason.ERROR
            head.error = (f"prompt: {len(head.token_ids)} tokens could not be scheduled: the pool has "
                          f"{self.pool.num_free} free pages of {self.usable_pages} usable")
            self.failed.append(head)
        scheduled = list(chunks.values())
        page_copies: list[tuple[int, int]] = []
        state_copies: list[tuple[list[int], list[int]]] = []
        # copies run before the forward of the step that first schedules the request
        decodes = self._step_decodes  # less any request preempted or moved to a verify chunk
        for req in [c.req for c in scheduled] + [r for r in decodes if r.pending_page_copies or r.pending_state_copies]:
            page_copies += req.pending_page_copies
            state_copies += req.pending_state_copies
            req.pending_page_copies, req.pending_state_copies = [], []
        return SchedulerOutput(decodes, scheduled, page_copies, state_copies, self._plan_rounds(scheduled, decodes),
                               first_pass=self.device_rounds and self._last_plan_drafted)

    def _round_tokens(self, req: Request) -> float:
        """Tokens one device round is expected to emit for req: 1 + PLAN_YIELD_SHARE of the accepted drafts per
        drafting round the controller expects of it (its yield; with device rounds each round is one outcome), 1
        without a controller or before it has an estimate."""
        y = self.gate.yield_(req.rid) if self.gate is not None else None
        return 1.0 + PLAN_YIELD_SHARE * max(y or 0.0, 0.0)

    def _plan_rounds(self, scheduled: list[ScheduledChunk], decodes: list[Request]) -> int:
        """Device rounds for this step (SpecConfig.rounds): only when every request of the step verifies drafts of
        a drafter that drafts on the device, and each is greedy with nothing the host must see per token
        (grammar, logprobs, logit bias, penalties); no more rounds than the most tokens a request may still emit
        (each live round emits one at least). Each round feeds K + 1 tokens at most up to the request's last
        position (prompt + max_tokens - 1: rounds.advance_step), so every request gets pages up to
        min(start + rounds * (K + 1), that reach); without free pages for that, one round.

        The device replays every planned round whether or not a request is still live in it, so a request's rounds
        are its tokens left over the tokens a round is expected to emit (`_round_tokens`), not one per round: with
        one per round, k3-tiny's code requests at batch 1 on the H200 (64 tokens, tau ~4) ran 8 rounds for the ~20
        tokens their second step had left, 3-4 of them live, and the controller, pricing a round as the step's time
        over its live rounds, saw verify rounds at 2.3x a plain step and turned speculation off (session 22). A step
        of several requests runs the median request's rounds."""
        sc = self.spec_cfg
        if not self.device_rounds or sc.rounds <= 1 or decodes or not scheduled:
            return 1
        run = sc.num_tokens + 1
        needs = []
        for c in scheduled:
            r, p = c.req, c.req.params
            if (not c.draft_ids or not p.greedy or r.grammar is not None or p.logprobs is not None or p.logit_bias
                    or p.has_penalties or r.prompt_logprobs_from is not None):
                return 1
            needs.append(math.ceil((p.max_tokens - r.num_output) / self._round_tokens(r)))
        # the median request's rounds, not the most any request needs: a round is replayed for the whole batch, so
        # rounds past the median run with most requests ended (k3-tiny code at batch 64 on the H200, a wave's tail:
        # 8-round steps of 19 ms delivering 41 tokens a round where a plain step gives 64 in 1.8 ms); the requests
        # that need more go on in the next step
        rounds = min(sc.rounds, sorted(needs)[(len(needs) - 1) // 2])
        if rounds <= 1:
            return 1
        need = [max(0, -(-min(c.start + rounds * run, c.req.prompt_len + c.req.params.max_tokens) // self.B)
                    - len(c.req.block_table)) for c in scheduled]
        if sum(need) > self.pool.num_free:
            return 1
        for c, n in zip(scheduled, need):
            if n:
                c.req.block_table.extend(self.pool.allocate(n))
        return rounds

    def _prefill_coming(self, multi: list[Request], decodes: list[Request], budget: int) -> bool:
        """Will this step (being scheduled) carry prefill work: a running request's next chunk, or an admission
        (waiting requests, room to run them, and admissions not held)?"""
        return bool(multi) or (bool(self.waiting) and len(self.running) < self.cfg.max_running
                               and not self.hold_admissions(decodes, min(budget, self.prefill_budget(len(decodes)))))

    def hold_admissions(self, decodes: list[Request], budget: int) -> bool:
        """Admission batching (SchedulerConfig.prefill_delay_steps): hold the waiting queue this step? Only
        while decodes run in a step with no prefill chunk of its own (a step that already mixes admits for
        free), until the head has waited prefill_delay_steps steps or the waiting prompts would fill `budget`
        (the prefill tokens this step may add). A held step stays a decode-only graph replay."""
        delay = self.cfg.prefill_delay_steps or 0  # None (the engine did not pick): admit at once
        # verify chunks (speculative decoding) ride in graph-replayed steps too; a prefill chunk makes it mixed
        if (delay == 0 or not self.waiting or not (decodes or self._chunks)
                or any(not c.draft_ids for c in self._chunks.values())):
            return False
        if self.steps - self.waiting[0].queued_step >= delay:
            return False
        want = 0
        for req in self.waiting:
            want += len(req.token_ids) - req.num_computed
            if want >= budget:
                return False
        return True

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens (chunks and admissions) a step with `num_decodes` decode rows may add: the decode-aware
        chunk budget. A decode row costs the step about `decode_token_cost` prefill tokens' time (it reads its
        whole context), so the step's time stays near that of a full prefill step: max_num_batched_tokens less
        num_decodes * decode_token_cost, never below min_prefill_tokens (prefill always progresses), rounded
        down to the KDA chunk (64) so chunks still end on the grid. decode_token_cost 0: the plain budget."""
        cfg = self.cfg
        if cfg.decode_token_cost <= 0 or num_decodes == 0:
            return cfg.max_num_batched_tokens
        left = cfg.max_num_batched_tokens - int(num_decodes * cfg.decode_token_cost)
        return max(min(cfg.min_prefill_tokens, cfg.max_num_batched_tokens), left // KDA_CHUNK * KDA_CHUNK)

    def _draft_limit(self, req: Request, in_flight_ok: bool = False) -> int:
        """Draft tokens req may be asked for this step (0: it decodes plainly). in_flight_ok: ask about the tokens
        known so far although one is still in flight (drafts_next's look ahead)."""
        k = min(self.spec_cfg.num_tokens, req.params.max_tokens - req.num_output - 1)
        # under min_tokens the sampler bans stop tokens per position; verify positions would each need their own
        # ban, so such a request decodes plainly until it has its minimum. A token still in flight (overlap) cannot
        # be drafted after.
        if (k <= 0 or not req.params.speculative or req.prompt_logprobs_from is not None
                or req.num_output < req.params.min_tokens or (not in_flight_ok and req.token_ids[-1] == PENDING)):
            return 0
        return k

    def drafts_next(self, reqs: list[Request]) -> bool:
        """Overlap scheduling: will the step after the one just launched (for `reqs`) draft? Asked before that
        step's tokens are read back: the controller plans the next step now (kept for it), and a plan without
        drafts lets the launched step stay in flight. Without a controller every step may draft. A model-free
        drafter that is asked every step (Why.CHEAP) is asked now about the tokens known so far (all but the
        one in flight), while the device runs: only a proposal worth verifying makes the next step draft."""
        if self.gate is None:
            return True
        live = [r for r in reqs if r.status is Status.RUNNING and r.num_output < r.params.max_tokens]
        if self.gate.off(len(live)):
            # the governor has speculation off at this bucket: the plan (Why.OFF) reads no request, so the
            # first one that could be asked is enough (at batch 64 the full list cost ~5% of a profiled k3-tiny step)
            if any(self._draft_limit(r, in_flight_ok=True) for r in live):
                self._next_plan = self._plan(len(live), ())
            return False
        asked = [r for r in live if self._draft_limit(r, in_flight_ok=True)
                 and (self.target_states is None or self._states_ready(r, 1))]
        if not asked:
            return False
        plan = self._plan(len(live), [r.rid for r in asked])
        if plan.why is Why.CHEAP:
            plan = self._peek(asked, len(live))
        self._next_plan = plan
        return plan.draft

    def _plan(self, batch: int, rids: list[int]) -> Plan:
        """The controller's plan for a step; while its governor has speculation off, the target states (a model
        drafter's) are not recorded either, except over the last MIN_STATE_ROWS steps of a hold off: the trial of
        speculation that follows it then starts with states to draft from (recorded from its first step, they were
        ready only after its 8 steps had ended, so every such trial measured plain steps)."""
        plan = self.gate.plan(batch, rids, model_free=self.target_states is None)
        self._last_plan_drafted = plan.draft
        whys = self.stats.spec_plan_whys
        whys[plan.why.value] = whys.get(plan.why.value, 0) + 1
        if self.target_states is not None:
            self.target_states.paused = plan.why is Why.OFF and not self.gate.resumes_within(batch, MIN_STATE_ROWS)
        return plan

    def _peek(self, reqs: list[Request], batch: int) -> Plan:
        """Would the drafter's proposals for `reqs`, given their tokens known now (a trailing PENDING left out),
        be worth a verify? The proposals are dropped: the next step asks again with the token in place."""
        queries = []
        for r in reqs:
            ids = _Known(r.token_ids)
            k = self._draft_limit(r, in_flight_ok=True)
            if len(ids) and k > 0:
                queries.append(DraftQuery(r.rid, ids, r.prompt_len, k))
        try:
            proposals = self.drafter.propose_scored(queries)
        except Exception:
            self.stats.spec_drafter_errors += 1
            log.exception("the drafter failed; the next step decodes without drafts")
            return Plan(False, Why.NOT_WORTH)
        offered = [(q.rid, len(p.token_ids[:q.max_tokens]), p.accept_probs)
                   for q, p in zip(queries, proposals) if p.token_ids]
        keep = self.gate.trim(batch, offered, Why.CHEAP, record=False).keep if offered else []
        return Plan(True, Why.CHEAP) if any(keep) else Plan(False, Why.NOT_WORTH)

    def _schedule_drafts(self, budget: int) -> int:
        """Turn decodes of requests that speculate into verify chunks with the drafter's tokens; returns the
        draft tokens scheduled. The controller (when there is one) first decides whether this step drafts at
        all, then trims each request's drafts. Bounds per request: spec num_tokens, the tokens it may still emit
        (a verify emits up to k + 1), the step's token and draft budgets, and the pages free now."""
        sc, stats, gate = self.spec_cfg, self.stats, self.gate
        plan, self._next_plan = self._next_plan, None
        if plan is not None and not plan.draft:
            # planned a step early (overlap): the step after a plain one kept in flight decodes plainly
            stats.spec_steps += 1
            stats.spec_steps_skipped += 1
            return 0
        batch = len(self._step_decodes)
        if gate is not None and plan is None and gate.off(batch):
            # the governor has speculation off at this bucket: the plan (Why.OFF) reads no request, so the first one
            # that could be asked is enough (building every request's query first cost a k3-tiny engine at batch 64
            # ~0.2 ms of host time per step with speculation off, ~12% of an H200 step; drafts_next does the same)
            if any(self._draft_limit(r) > 0 for r in self._step_decodes):
                self._plan(batch, [])
                stats.spec_steps += 1
                stats.spec_steps_skipped += 1
            return 0
        # where the verify replays a CUDA graph of K + 1 rows per request, a draft costs nothing to verify: the
        # drafter's own confidence cut would only lose tokens (k3-tiny's drafter cut code at batch 1 to ~1 draft
        # of 7, so one measured verify priced every later one as hopeless), and so would the per-step draft cap,
        # which bounds eager verify work (at batch 64, K 7: 256 of 448 drafts, the rest plain decodes that held
        # the step to one device round); the controller's trim decides
        full = gate is not None and batch <= gate.fixed_verify_upto
        left = budget if full else min(budget, sc.max_draft_tokens_per_step)
        if gate is not None and self.target_states is not None:
            # allowed now: recording resumes here too, not only in _plan (with every request still without states,
            # paused while off, no plan would be asked for and recording would never resume)
            self.target_states.paused = False
        queries: list[DraftQuery] = []
        for req in self._step_decodes:
            k = self._draft_limit(req)
            if k <= 0:
                continue
            hidden = self._hidden(req)
            if hidden is None and self.target_states is not None:
                # a model drafter without the request's states (not recorded while the governor had speculation
                # off, or right after a preemption) has nothing to draft from: the request decodes plainly, and
                # that is no outcome of drafting (counted as one, it drove the controller's yield to ~0 at batch
                # 16 on the H200: every request came back without states when the governor allowed drafting again)
                continue
            queries.append(DraftQuery(req.rid, req.token_ids, req.prompt_len, k, hidden))
        if not queries:
            if gate is not None and plan is not None and plan.why is Why.PROBE:
                gate.void_probe(batch)  # planned a step early, before any request had states: owed again
            return 0
        stats.spec_steps += 1
        if gate is not None:
            if plan is None:
                plan = self._plan(batch, [q.rid for q in queries])
            stats.spec_probes += plan.why is Why.PROBE
            if not plan.draft:
                stats.spec_steps_skipped += 1
                return 0
        t0 = time.perf_counter()
        try:
            proposals = self.drafter.propose_scored(queries, full)
        except Exception:  # drafts are optional: a drafter bug costs this step's speculation, not the engine
            stats.spec_drafter_errors += 1
            log.exception("the drafter failed; this step decodes without drafts")
            return 0
        self.step_draft_s = time.perf_counter() - t0
        props = {q.rid: (q, p.token_ids[:q.max_tokens], p.accept_probs) for q, p in zip(queries, proposals)}
        keep: dict[int, int] = {}
        if gate is not None:
            gate.observe_draft(len(queries), self.step_draft_s)
            for rid, (_, d, _) in props.items():
                if not d:
                    gate.observe(rid, 0, 0)  # the drafter had nothing for it: a drafting step that gained nothing
            offered = [(rid, len(d), est) for rid, (_, d, est) in props.items() if d]
            trimmed = gate.trim(batch, offered, plan.why)
            stats.spec_probes += trimmed.probe and plan.why is Why.CHEAP  # a PROBE plan was counted above
            keep = dict(zip((rid for rid, _, _ in offered), trimmed.keep))
            for rid, k in keep.items():
                if k == 0:
                    # trimmed away: this drafting step gained it nothing, so its yield (what plan() expects of
                    # the next drafting step) falls, and a drafter pass whose drafts never pay stops being run
                    gate.observe(rid, 0, 0)
        used = 0
        for req in list(self._step_decodes):
            _, d, est = props.get(req.rid, (None, None, None))
            if not d or left <= 0:
                continue
            d = list(d[:min(left, keep.get(req.rid, len(d)))])
            if req.grammar is not None:
                d = _grammar_prefix(req.grammar, d)
            nc = req.num_computed
            # lookahead pages for positions nc .. nc + k, from free memory only
            fits = (len(req.block_table) + self.pool.num_free) * self.B - nc - 1
            d = d[:max(fits, 0)]
            if not d:
                continue
            need = (nc + 1 + len(d) + self.B - 1) // self.B - len(req.block_table)
            if need > 0:
                req.block_table.extend(self.pool.allocate(need))
            self._step_decodes.remove(req)
            estimate = None
            if est is not None:  # the drafter's own prediction of the accepted count: sum_j prod_{i<=j} p_i
                estimate, p = 0.0, 1.0
                for x in est[:len(d)]:
                    p *= x
                    estimate += p
            self._chunks[req.rid] = ScheduledChunk(req, nc, 1, True, draft_ids=d, draft_estimate=estimate)
            left -= len(d)
            used += len(d)
        if used:
            stats.spec_steps_speculated += 1
        elif gate is not None and any(props[r][1] for r in props) and not any(keep.values()):
            stats.spec_steps_skipped += 1  # the controller trimmed every draft: decoded plainly
        return used

    def _hidden(self, req: Request):
        """The request's recorded target states, when they end exactly where its next fed token sits (the
        anchor) and are enough to draft from (`_states_ready`); anything else would condition the drafter on the
        wrong positions or on next to nothing, so it drafts nothing."""
        ts = self.target_states
        if ts is None or not self._states_ready(req, 0):
            return None
        return ts.get(req.rid)

    def _states_ready(self, req: Request, slack: int) -> bool:
        """Whether req's recorded target states end at its next fed position (within `slack` positions: a step
        still in flight records one more) and hold MIN_STATE_ROWS of them, or all it has. After a period with
        recording paused (the governor had speculation off) a request's states restart from the resumption: with
        the last 1-2 positions only, k3-tiny's drafter drafts at tau 1.8-2.0 against 3.5 with its full window (held-
        out code, K 7, replayed on the CPU, session 22), and a probe there judged speculation not worth it."""
        ts = self.target_states
        end = ts.end(req.rid)
        if end is None or not 0 <= req.num_computed - end <= slack:
            return False
        return ts.held(req.rid) + slack >= min(MIN_STATE_ROWS, ts.window, req.num_computed)

    def _chunk_len(self, req: Request, budget: int) -> int:
        start, remaining = req.num_computed, len(req.token_ids) - req.num_computed
        n = min(remaining, budget)
        if n < remaining:
            aligned = (start + n) // self.grid * self.grid - start  # non-final chunks end on the grid
            # ...unless the budget left cannot reach the next grid point: then take what there is (no grid
            # point lies inside, so no snapshot is due) and the next chunk realigns, rather than starving
            n = aligned if aligned > 0 else n
        if n > 1 and start % self.grid:
            nxt = (start // self.grid + 1) * self.grid
            if start + n > nxt:
                n = nxt - start  # off-grid start: stop at the next grid point
        if self.grid % KDA_CHUNK:
            # the chunked KDA kernel emits a state only a whole number of its chunks from the chunk's
            # start, or at its end: a planned snapshot off that lattice ends the chunk (full-block grids)
            for p in req.snapshot_plan:
                if p >= start + n:
                    break
                if p > start and (p - start) % KDA_CHUNK:
                    n = p - start
                    break
        return max(n, 0)

    def _schedule_chunk(self, req: Request, budget: int) -> int:
        """Schedule req's next chunk (shrunk to the pages it can get); returns its tokens (0: none)."""
        start = req.num_computed
        n = self._chunk_len(req, budget)
        while n > 0:
            need = (start + n + self.B - 1) // self.B - len(req.block_table)
            if need <= self.pool.num_free or self.tree.evict(need - self.pool.num_free) and need <= self.pool.num_free:
                break
            # shrink to the pages there are (a smaller chunk still on the grid), before preempting anyone
            fits = (len(req.block_table) + self.pool.num_free) * self.B - start
            if fits > 0:
                n = self._chunk_len(req, min(budget, fits))
                continue
            if not self._make_room(1, req):
                return 0  # req is the newest and out of pages: it waits
        if n == 0:
            return 0
        need = (start + n + self.B - 1) // self.B - len(req.block_table)
        if need > 0:
            req.block_table.extend(self.pool.allocate(need))
        snaps = []
        plan = req.snapshot_plan
        while plan and plan[0] <= start:
            req.plan_kinds.pop(plan.pop(0), None)
        prev = req.lock_node.end if req.lock_node is not None else 0
        for p in plan:
            if p > start + n:
                break
            dest = self._snapshot_dest(req.plan_kinds.get(p, CHECKPOINT), p - prev)
            if dest is None:
                continue  # snapshots are optional: skip rather than preempt (or evict more valuable ones)
            snaps.append((p, dest))
            prev = p
        needs_logits = start + n == len(req.token_ids)
        self._chunks[req.rid] = ScheduledChunk(req, start, n, needs_logits, snaps)
        return n

    def _snapshot_dest(self, kind: str, saved: int) -> list[int] | None:
        """A state set for a new snapshot: free pages, or pages of snapshots worth less than it."""
        if self.pool.num_free < self.S:
            value = self.tree.policy.eviction == "value"
            if value and kind == CHECKPOINT:
                return None  # interior checkpoints are opportunistic: written into free memory only
            below = self.tree.admission_priority(kind, saved) if value else None
            self.tree.evict(self.S - self.pool.num_free, below=below)
        if self.pool.num_free < self.S:
            return None
        return self.pool.allocate(self.S, zero=False)

    def _ensure_pages(self, req: Request, end: int) -> bool:
        need = (end + self.B - 1) // self.B - len(req.block_table)
        if need > 0:
            if not self._make_room(need, req):
                return False
            req.block_table.extend(self.pool.allocate(need))
        return True

    def _make_room(self, need: int, req: Request) -> bool:
        """Get `need` free pages for running request req: evict cache, then preempt running requests
        newer than req, newest first. When req is itself the newest it waits (False: it skips this
        step and keeps what it holds; the older requests progress, and preempt it if they need its
        memory). Pins give way when nothing else can: a lone request always makes progress."""
        while self.pool.num_free < need:
            if self.tree.evict(need - self.pool.num_free):
                continue
            victim = self.running[-1]
            if victim is not req:
                self._preempt(victim)  # newer than req: running is in admission order
                continue
            if len(self.running) > 1:
                return False
            if self._drop_oldest_pin():
                continue
            # alone, nothing cached or pinned, and still short: cannot happen for a request that
            # add_request let in; fail it rather than spin
            self._fail(req, f"prompt: {len(req.token_ids)} tokens need more than the {self.usable_pages} "
                            "usable cache pages")
            return False
        return True

    def _fail(self, req: Request, error: str) -> None:
        req.error = error
        self._drop_from_step(req)
        self._finish(req, FinishReason.ERROR)
        self.failed.append(req)

    def fail(self, req: Request, error: str) -> None:
        """After update(): req could not be served (its grammar failed). It ends with FinishReason.ERROR
        and `error`; what it computed stays valid, so its state still goes to the cache as usual. A
        request that update() already finished keeps its cache work and is reported as failed."""
        req.error = error
        if req.status is Status.RUNNING:
            self._finish(req, FinishReason.ERROR)
        else:
            req.finish_reason = FinishReason.ERROR

    def fail_step(self, out: SchedulerOutput, error: str) -> list[Request]:
        """The step `out` could not run (the runner raised): its requests end with `error`. Their live
        states may be half-updated, so nothing of theirs goes to the cache; the snapshot destinations
        of their chunks are freed. Returns them."""
        reqs = out.decodes + [c.req for c in out.chunks]
        for c in out.chunks:
            for _, dest in c.snapshots:
                self.pool.unref(dest)
        for req in reqs:
            _drop_pending(req)
            if req.status is Status.RUNNING:
                req.error = error
                req.pending_page_copies, req.pending_state_copies = [], []
                self._finish(req, FinishReason.ERROR, donate=False)
        return reqs

    def _drop_from_step(self, req: Request) -> None:
        """req will not run this step: out of the decodes, its chunk (and snapshot destinations) gone."""
        if req in self._step_decodes:
            self._step_decodes.remove(req)
        c = self._chunks.pop(req.rid, None)
        if c is not None:
            for _, dest in c.snapshots:
                self.pool.unref(dest)

    # ---- admission ----

    def _admit(self, req: Request, budget: int) -> int:
        """Admit the head of the queue with its first chunk scheduled; returns that chunk's tokens (0:
        not admitted, nothing was changed). The first chunk is shrunk to the pages there are."""
        n_tok = len(req.token_ids)
        # the last token must be computed (its logits are sampled); scoring needs logits from f-1 on
        limit = n_tok - 1 if req.prompt_logprobs_from is None else min(n_tok - 1, req.prompt_logprobs_from - 1)
        S, B = self.S, self.B
        while True:
            hit_len = hit_state = 0
            node, pages = None, []
            if self.cache_cfg.enable_prefix_cache and limit > 0:
                m = self.tree.match(req.token_ids[:limit], req.salt, touch=False, ghosts=not req.admitted)
                hit_len, hit_state, node, pages = m.kv_hit, m.state_hit, m.state_node, m.block_pages
            partial = hit_state % B != 0
            req.num_computed = hit_state
            # the pages beyond the live state and the copy-on-write page that the first chunk can use
            free = self.pool.num_free - S - int(partial)
            held = hit_state // B + int(partial)
            fits = (held + max(free, 0)) * B - hit_state
            n = self._chunk_len(req, min(budget, fits)) if free >= 0 and fits > 0 else 0
            if n > 0:
                break
            # evict for one more page; eviction may drop the very snapshot and pages just matched: match again
            want = S + int(partial) + 1 - self.pool.num_free
            if self.tree.evict(max(want, 1)) == 0 and not (not self.running and self._drop_oldest_pin()):
                req.num_computed = 0
                return 0
        if node is not None:
            self.tree.use(node)
        # take the copy sources' references first: the allocations below must not evict them
        full = hit_state // B
        req.block_table = pages[:full]
        self.pool.ref(req.block_table)
        page_copies, state_copies = [], []
        if partial:
            src = pages[full]
            self.pool.ref([src])
            req.fences.append(src)
            dst = self.pool.allocate(1, zero=False)[0]
            page_copies.append((src, dst))
            req.block_table.append(dst)
        if node is not None:
            assert node.snapshot is not None
            self.pool.ref(node.snapshot)
            req.fences.extend(node.snapshot)
            req.state_set = self.pool.allocate(S, zero=False)
            state_copies.append((list(node.snapshot), req.state_set))
            self.tree.lock(node)
            req.lock_node = node
        else:
            req.state_set = self.pool.allocate(S, zero=True)
        req.pending_page_copies, req.pending_state_copies = page_copies, state_copies
        req.status = Status.RUNNING
        req.wait_on = None
        self._plan_snapshots(req, hit_state, hit_len)
        if not req.admitted:
            req.admitted = True
            self.admitted_now.append(req)
            req.cached_tokens = min(hit_state, req.prompt_len)
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_tokens += req.cached_tokens
        self.waiting.popleft()
        self.running.append(req)
        return self._schedule_chunk(req, budget)

    def _wait_for_shared_prefix(self, req: Request) -> bool:
        """In-batch prefix sharing: if a running request is still prefilling a prefix this one shares
        (beyond what the cache holds), have it publish a snapshot at the shared grid point and keep this
        request waiting until then, so N requests with one system prompt compute it once."""
        if req.wait_on is not None:
            sharer, lo = req.wait_on
            if sharer.status is Status.RUNNING and sharer.num_computed < lo:
                return True  # still coming (checked in O(1): a thousand waiters cost nothing per step)
            req.wait_on = None
            return False  # published (or the sharer went away): admit, matching what is there
        g, toks = self.grid, req.token_ids
        if not self.cache_cfg.enable_prefix_cache or self.cache_cfg.full_block_mode or len(toks) <= g:
            return False
        hit = None
        first = toks[0]
        for p in self.running:
            if p.num_computed >= p.prompt_len or p.salt != req.salt or p.token_ids[0] != first:
                continue
            n = min(len(toks) - 1, p.prompt_len)
            if n // g * g <= p.num_computed:
                continue  # p is past every grid point the two could share
            self._prefix_checks += 1
            lo = _common_prefix(p.token_ids, toks, n) // g * g  # whole grid blocks in common
            if lo == 0:
                continue
            if hit is None:
                hit = self.tree.match(toks[: len(toks) - 1], req.salt, touch=False).state_hit
            if lo <= hit or p.num_computed >= lo:
                continue  # nothing to gain, or the sharer already went past that point
            self._add_junction(p, lo)
            req.wait_on = (p, lo)
            return True
        return False

    def _add_junction(self, p: Request, lo: int) -> None:
        """Make running request p publish a snapshot at lo: in the chunk it runs this step when that
        chunk covers lo (its plan was already consumed for this step), else in its plan."""
        c = self._chunks.get(p.rid)
        # never into a verify chunk: its KDA state is only known after verification (the plan takes it)
        if c is not None and not c.draft_ids and c.start < lo <= c.start + c.num_tokens:
            if all(pos != lo for pos, _ in c.snapshots) and ((lo - c.start) % KDA_CHUNK == 0
                                                                or lo == c.start + c.num_tokens):
                below = max((pos for pos, _ in c.snapshots if pos < lo), default=c.start)
                dest = self._snapshot_dest(JUNCTION, lo - below)
                if dest is not None:
                    c.snapshots.append((lo, dest))
                    c.snapshots.sort(key=lambda s: s[0])
                    p.plan_kinds[lo] = JUNCTION
            return
        if lo not in p.snapshot_plan:
            bisect.insort(p.snapshot_plan, lo)
        p.plan_kinds[lo] = JUNCTION

    def _plan_snapshots(self, req: Request, state_hit: int, kv_hit: int) -> None:
        """Positions (absolute, on the grid, in (state_hit, n)) where this request publishes snapshots,
        and what each is for (its kind, by which the cache policy learns what gets reused). The
        admission half of the cache policy; the publish itself still has to beat what it would evict."""
        req.snapshot_plan, req.plan_kinds = [], {}
        if not self.cache_cfg.enable_prefix_cache:
            return
        n = len(req.token_ids)
        g, B = self.grid, self.B
        kinds: dict[int, str] = {}
        iv = self.cache_cfg.checkpoint_interval
        if self.cache_cfg.full_block_mode or iv < 0:
            kinds.update(((b // g) * g, CHECKPOINT) for b in range(B, n, B))  # physical block boundaries
        elif iv > 0:
            kinds.update((p, CHECKPOINT) for p in range(iv, n, iv))
        if not self.cache_cfg.full_block_mode:
            # the tail ladder: the replay boundary (an identical repeat matches n-1 tokens), then grid
            # points 64, 128, 256, ... below it (a prompt resent with its end changed)
            replay = (n - 1) // g * g
            for k in range(self.cache_cfg.tail_snapshots):
                off = 0 if k == 0 else g << (k - 1)
                kinds[replay - off] = tail_kind(off)
            if kv_hit > state_hit:
                kinds[kv_hit // g * g] = JUNCTION  # a junction seen a second time: another path branches here
        req.snapshot_plan = sorted(p for p in kinds if state_hit < p < n)
        req.plan_kinds = {p: kinds[p] for p in req.snapshot_plan}

    # ---- after the forward ----

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Request]:
        """Advance requests by what ran; publish snapshots; append sampled tokens (a verify chunk's entry is
        its accepted run). Returns finished requests. The synchronous form of advance + resolve."""
        return self.resolve(self.advance(out), sampled)

    def advance(self, out: SchedulerOutput) -> AdvancedStep:
        """The step `out` was launched: advance num_computed by what it feeds, publish its snapshots, take its
        copy fences (released by `resolve`, once the step and so its copies have run), and give each sampled
        request a PENDING token in its token_ids until `resolve` learns the real one. Verify
        chunks are left to `resolve` (their advance depends on the accepted run)."""
        stats = self.stats
        pending: list[tuple[Request, int]] = []
        fences: list[int] = []
        stats.computed_tokens += len(out.decodes)
        for req in out.decodes:
            if req.num_computed < req.prompt_len:
                stats.computed_prompt_tokens += 1
            req.num_computed += 1
            fences += req.fences
            req.fences = []
            req.token_ids.append(PENDING)
            pending.append((req, len(req.token_ids) - 1))
        verify = []
        for c in out.chunks:
            req = c.req
            if c.draft_ids:
                verify.append(c)
                continue
            req.num_computed += c.num_tokens
            stats.computed_tokens += c.num_tokens
            stats.computed_prompt_tokens += max(0, min(c.start + c.num_tokens, req.prompt_len) - c.start)
            for pos, dest in c.snapshots:
                self._publish(req, pos, dest, req.plan_kinds.pop(pos, CHECKPOINT))
            fences += req.fences
            req.fences = []
            if c.needs_logits:
                req.token_ids.append(PENDING)
                pending.append((req, len(req.token_ids) - 1))
        for c in verify:  # a verify chunk's copies ran with it too
            fences += c.req.fences
            c.req.fences = []
        self.step_fences.append(fences)
        return AdvancedStep(pending, verify, fences)

    def resolve(self, step: AdvancedStep, sampled: dict[int, int | list[int]]) -> list[Request]:
        """The sampled tokens of an advanced step are known: they replace its PENDING tokens; requests that
        they end finish. With overlap the next step may already have been launched (and advanced): a request
        that ends here drops the tokens after this one (that step's work for it is discarded; its live state
        then holds every token it has, so it is donated at num_computed == len(token_ids)). Requests that
        finished in between (aborted) are skipped. Returns the requests that finished."""
        finished: list[Request] = []
        # the step has run, so have its copies: their sources may be reused now (not earlier: a source freed
        # while its copy is still queued could be zeroed for a new owner first, if zeroing were not ordered)
        self.step_fences.remove(step.fences)
        self.pool.unref(step.fences)
        for c in step.verify:
            self._update_verify(c, sampled[c.req.rid], finished)
        for req, idx in step.pending:
            if req.finished:
                continue  # aborted while its token was in flight: nobody reads it
            tok = sampled[req.rid]
            req.token_ids[idx] = tok
            if tok in req.stop_ids or (req.grammar is not None and req.grammar.is_terminated()):
                reason = FinishReason.STOP
            elif idx + 1 - req.prompt_len >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            else:
                continue
            del req.token_ids[idx + 1:]
            if req.status is Status.WAITING:
                # preempted while its token was in flight: it holds nothing; it ends where it waits
                self.waiting.remove(req)
                req.status, req.finish_reason = Status.FINISHED, reason
                if self.drafter is not None:
                    self._drafter_finish(req)
            else:
                self._finish(req, reason)
            finished.append(req)
        return finished

    def _update_verify(self, c: ScheduledChunk, run: list[int], finished: list[Request]) -> None:
        """A verify chunk ran: the runner left the live state after the run's fed tokens (the last token
        and the accepted drafts, len(run) in all), so num_computed advances by len(run)."""
        req, stats = c.req, self.stats
        rounds = getattr(run, "rounds", None)  # (drafted, accepted) per device round (backend/runner/gpu/rounds.py)
        if rounds is None:
            accepted = 0
            while accepted < min(len(run), len(c.draft_ids)) and run[accepted] == c.draft_ids[accepted]:
                accepted += 1
            rounds = [(len(c.draft_ids), accepted)]
        self.step_rounds = max(self.step_rounds, len(rounds))
        for i, (drafted, accepted) in enumerate(rounds):
            self.step_drafted += drafted
            stats.spec_verifies += 1
            stats.spec_drafted_tokens += drafted
            stats.spec_accepted_tokens += accepted
            req.spec_drafted += drafted
            req.spec_accepted += accepted
            if self.gate is not None:
                self.gate.observe(req.rid, drafted, accepted, c.draft_estimate if i == 0 else None)
        req.num_computed += len(run)
        stats.computed_tokens += len(run)
        # the verifier ends the run at the first token that ends the request, so only the last one can; the
        # grammar matcher is already past the whole run, so it is asked (by _append) about the last one only
        *body, last = run
        assert not req.stop_ids.intersection(body) and req.num_output + len(run) <= req.params.max_tokens, (
            f"request {req.rid}: a verify run continued past its end")
        req.token_ids.extend(body)
        self._append(req, last, finished)

    def _append(self, req: Request, tok: int, finished: list[Request]) -> None:
        req.token_ids.append(tok)
        if tok in req.stop_ids or (req.grammar is not None and req.grammar.is_terminated()):
            reason = FinishReason.STOP
        elif len(req.token_ids) - req.prompt_len >= req.params.max_tokens:
            reason = FinishReason.LENGTH
        else:
            return
        self._finish(req, reason)
        finished.append(req)

    def _publish(self, req: Request, pos: int, dest: list[int], kind: str) -> Node | None:
        node = self.tree.insert(req.token_ids, req.block_table, req.salt, snapshot=dest,
                                start=req.lock_node, kind=kind, length=pos)
        self.stats.snapshots_published += 1
        self._move_lock(req, node)
        return node

    def _move_lock(self, req: Request, node) -> None:
        self.tree.lock(node)
        old, req.lock_node = req.lock_node, node
        self.tree.unlock(old)

    def _donate(self, req: Request, kind: str) -> Node | None:
        """Hand the live state (the state after exactly num_computed tokens) to the tree, no copy."""
        nc = req.num_computed
        # pending copies: never ran a forward, so the live state set was never filled
        if not (self.cache_cfg.enable_prefix_cache and nc > 0 and req.state_set is not None
                and not req.pending_state_copies and not req.pending_page_copies
                and (not self.cache_cfg.full_block_mode or nc % self.B == 0)):
            return None
        node = self._publish(req, nc, req.state_set, kind)
        req.state_set = None
        return node

    def _drafter_finish(self, req: Request) -> None:
        self.drafter.finish(req.rid, req.token_ids, req.prompt_len)
        if self.gate is not None:
            self.gate.finish(req.rid)

    def _finish(self, req: Request, reason: FinishReason, *, donate: bool = True) -> None:
        node = self._donate(req, END) if donate else None
        if self.drafter is not None:
            self._drafter_finish(req)
        if req.pin and node is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._pin(req.rid, node)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.running.remove(req)

    def _pin(self, rid: int, node: Node) -> None:
        self.tree.pin(node)
        self.pins[rid] = node
        cap = int(self.cache_cfg.max_pinned_fraction * self.usable_pages)
        while self.tree.pinned_pages > cap and self._drop_oldest_pin():
            pass

    def _release(self, req: Request) -> None:
        self.tree.unlock(req.lock_node)
        req.lock_node = None
        self.pool.unref(req.block_table)
        req.block_table = []
        if req.state_set is not None:
            self.pool.unref(req.state_set)
            req.state_set = None
        if req.fences:
            self.pool.unref(req.fences)
            req.fences = []

    def _preempt(self, req: Request) -> None:
        self._drop_from_step(req)
        self._donate(req, PREEMPTED)  # it resumes from here (unless the cache needs the memory more)
        req.pending_page_copies, req.pending_state_copies = [], []
        self._preempted_this_step = True
        self._release(req)
        req.num_computed = 0
        req.snapshot_plan, req.plan_kinds = [], {}
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(req)
        req.queued_step = self.steps - (self.cfg.prefill_delay_steps or 0)  # a preempted request is not held again
        self.waiting.appendleft(req)

    # ---- accounting ----

    def check(self) -> None:
        """Rebuild page references from requests and the tree; compare with the pool's counts."""
        for r in self.running:
            assert not r.fences or r.pending_page_copies or r.pending_state_copies, f"request {r.rid}: stale fences"
        holders = [r.lock_node for r in self.running if r.lock_node is not None]
        pinned: dict[int, int] = {}
        for node in self.pins.values():
            pinned[id(node)] = pinned.get(id(node), 0) + 1
        for n in self.tree._nodes():
            assert n.pins == pinned.get(id(n), 0), f"{n}: pins {n.pins} != {pinned.get(id(n), 0)}"
        self.tree.check(holders)
        refs = dict.fromkeys(range(self.pool.num_pages), 0)
        for p, k in self.tree.tree_page_refs().items():
            refs[p] += k
        for r in self.running:
            for p in r.block_table + (r.state_set or []) + r.fences:
                refs[p] += 1
        for fences in self.step_fences:
            for p in fences:
                refs[p] += 1
        for p in self.pool.reserved:
            refs[p] += 1
        assert [refs[p] for p in range(self.pool.num_pages)] == self.pool.refcount, "page refcounts drifted"
        assert sorted(self.pool.free_list) == [p for p in range(self.pool.num_pages) if refs[p] == 0]


class _Known(Sequence):
    """A request's token ids without a trailing PENDING (overlap: the token in flight), as a view (no copy of a
    long context per peek)."""

    __slots__ = ("ids", "n")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.n = len(ids) - (1 if ids and ids[-1] == PENDING else 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.ids[slice(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.ids[i if i >= 0 else self.n + i]


def _drop_pending(req: Request) -> None:
    """An ending request's tokens still in flight (overlap) never reach the caller. (Its live state may hold
    one of them already, fed by a later launched step: such a state is not donated, see `abort`.)"""
    while req.token_ids and req.token_ids[-1] == PENDING:
        req.token_ids.pop()


def _grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The drafts up to (not including) the first one the grammar refuses; the matcher ends where it began."""
    n = 0
    try:
        for t in drafts:
            if not matcher.accept(t):
                break
            n += 1
    except Exception:  # a failing grammar is the verifier's to report; draft nothing past it
        pass
    if n:
        matcher.rollback(n)
    return drafts[:n]
