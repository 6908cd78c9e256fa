"""Continuous batching with chunk-aligned prefill over one page pool and the radix prefix cache.

The scheduling model (one rule, no phases): every request has `num_computed` of its `token_ids`
in its cache; a step hands out a token budget, decode-like requests (one token left) first, then
continuing prefills, then new admissions. A request whose fed tokens reach the end of its
`token_ids` gets logits and samples the next token.

Chunk alignment: a non-final chunk ends on the snapshot grid (`hash_block_size`), and a chunk that
starts off the grid (a conversation resuming from an end-of-turn snapshot) stops at the next grid
point, so every snapshot emitted inside a chunk sits a whole number of KDA chunks from its start.
Snapshots are emitted by the forward itself (ForwardBatch.state_positions), so publishing them costs
no extra steps. A snapshot published at p holds the state after exactly p tokens.

Resources: admission counts MLA pages, one live state set, one copy-on-write page when the hit ends
mid-page, and the snapshot state sets of the first chunk. Under pressure the prefix cache is evicted
first, then the newest running request is preempted (its pages and state freed, requeued at the
front; on readmission it recomputes, usually from the cache).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.cache.radix import Node, RadixCache
from k3rt.backend.scheduler.request import FinishReason, Request, Status
from k3rt.config import CacheConfig, SchedulerConfig


@dataclass
class ScheduledChunk:
    req: Request
    start: int  # absolute position of the first fed token
    num_tokens: int
    needs_logits: bool  # the chunk reaches the end of token_ids: sample the next token
    snapshots: list[tuple[int, list[int]]] = field(default_factory=list)  # (position, dest state set)


@dataclass
class SchedulerOutput:
    decodes: list[Request]  # one token each at position num_computed, always sampled (the fast path)
    chunks: list[ScheduledChunk]  # multi-token chunks (prefill, or a resumed request)
    page_copies: list[tuple[int, int]]  # MLA partial-page copy-on-write: (src page, dst page), all tensors
    state_copies: list[tuple[list[int], list[int]]]  # snapshot -> live state set, before the forward

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (counted once per request)
    computed_tokens: int = 0  # tokens fed through the model
    computed_prompt_tokens: int = 0  # of those, prompt positions (recomputation after preemption included)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    preemptions: int = 0
    snapshots_published: int = 0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache_cfg: CacheConfig, pool: PagePool, block_size: int) -> None:
        self.cfg, self.cache_cfg, self.pool, self.B = cfg, cache_cfg, pool, block_size
        self.tree = RadixCache(pool, block_size)
        self.grid = block_size if cache_cfg.full_block_mode else cache_cfg.hash_block_size
        self.S = pool.layout.pages_per_state_set
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._preempted_this_step = False
        self._step_decodes: list[Request] = []
        self.pins: dict[int, Node] = {}  # rid of a finished pinned request -> the node whose snapshot it keeps

    # ---- queue ----

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request, reason: FinishReason = FinishReason.ABORT) -> None:
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, reason
        elif req.status is Status.RUNNING:
            self._finish(req, reason)

    def unpin(self, rid: int) -> None:
        """Release the pin a finished `pin=True` request holds on its end-of-request snapshot."""
        node = self.pins.pop(rid, None)
        if node is not None:
            node.pins -= 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        chunks: dict[int, ScheduledChunk] = {}
        self._preempted_this_step = False
        B = self.B
        # decode-like requests (one token to feed) first, oldest first: the hot path, kept lean
        decodes: list[Request] = []
        multi: list[Request] = []
        for req in self.running:
            (decodes if len(req.token_ids) - req.num_computed == 1 else multi).append(req)
        del decodes[budget:]
        self._step_decodes = decodes
        for req in list(decodes):
            if req.status is not Status.RUNNING:
                continue  # preempted by an earlier request of this loop: it holds nothing now
            nc = req.num_computed
            if nc % B == 0 and nc // B >= len(req.block_table) and not self._ensure_pages(req, nc + 1, chunks):
                continue  # req itself was preempted (and dropped from decodes)
        budget -= len(decodes)
        for req in multi:
            if budget <= 0:
                break
            if req.status is Status.RUNNING:  # not preempted earlier in this step
                budget -= self._schedule_chunk(req, budget, chunks)
        # no admissions in a step that had to preempt: the freed memory belongs to running requests
        deferred: list[Request] = []
        while (self.waiting and budget > 0 and len(self.running) < self.cfg.max_running
               and not self._preempted_this_step):
            req = self.waiting[0]
            if req.grammar_future is not None or self._wait_for_shared_prefix(req):
                # admitted once its grammar is compiled / the sharer published the shared prefix
                deferred.append(self.waiting.popleft())
                continue
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= self._schedule_chunk(req, budget, chunks)
        self.waiting.extendleft(reversed(deferred))
        scheduled = list(chunks.values())
        page_copies: list[tuple[int, int]] = []
        state_copies: list[tuple[list[int], list[int]]] = []
        # copies run before the forward of the step that first schedules the request
        for req in [c.req for c in scheduled] + [r for r in decodes if r.pending_page_copies or r.pending_state_copies]:
            page_copies += req.pending_page_copies
            state_copies += req.pending_state_copies
            req.pending_page_copies, req.pending_state_copies = [], []
        return SchedulerOutput(decodes, scheduled, page_copies, state_copies)

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
        return max(n, 0)

    def _schedule_chunk(self, req: Request, budget: int, chunks: dict[int, ScheduledChunk]) -> int:
        n = self._chunk_len(req, budget)
        if n == 0:
            return 0
        start = req.num_computed
        if not self._ensure_pages(req, start + n, chunks):
            return 0
        snaps = []
        while req.snapshot_plan and req.snapshot_plan[0] <= start:
            req.snapshot_plan.pop(0)
        for p in req.snapshot_plan:
            if p > start + n:
                break
            if self.pool.num_free < self.S:
                self.tree.evict(self.S - self.pool.num_free)
            if self.pool.num_free < self.S:
                break  # snapshots are optional: skip rather than preempt for them
            snaps.append((p, self.pool.allocate(self.S, zero=False)))
        needs_logits = start + n == len(req.token_ids)
        chunks[req.rid] = ScheduledChunk(req, start, n, needs_logits, snaps)
        return n

    def _ensure_pages(self, req: Request, end: int, chunks: dict[int, ScheduledChunk]) -> bool:
        need = (end + self.B - 1) // self.B - len(req.block_table)
        while need > 0 and not self._make_room(need, req, chunks):
            if req.status is not Status.RUNNING:
                return False
        if need > 0:
            req.block_table.extend(self.pool.allocate(need))
        return req.status is Status.RUNNING

    def _make_room(self, need: int, req: Request, chunks: dict[int, ScheduledChunk]) -> bool:
        """Evict cache, then preempt the newest running request, until `need` pages are free."""
        if self.pool.num_free >= need:
            return True
        self.tree.evict(need - self.pool.num_free)
        if self.pool.num_free >= need:
            return True
        victim = self.running[-1]
        self._preempt(victim, chunks)
        return self.pool.num_free >= need and victim is not req

    # ---- admission ----

    def _admit(self, req: Request) -> bool:
        prompt_hit = req.num_preemptions == 0
        n = len(req.token_ids)
        hit_len = hit_state = 0
        node = None
        pages: list[int] = []
        # the last token must be computed (its logits are sampled); scoring needs logits from f-1 on
        limit = n - 1 if req.prompt_logprobs_from is None else min(n - 1, req.prompt_logprobs_from - 1)
        while True:
            if self.cache_cfg.enable_prefix_cache and limit > 0:
                m = self.tree.match(req.token_ids[:limit], req.salt)
                hit_len, hit_state, node, pages = m.kv_hit, m.state_hit, m.state_node, m.block_pages
            partial = hit_state % self.B != 0
            need = self.S + int(partial) + 1
            if self.pool.num_free >= need:
                break
            # eviction may drop the very snapshot and pages just matched: match again after it
            if self.tree.evict(need - self.pool.num_free) == 0:
                return False
        # take the copy sources' references first: the allocations below must not evict them
        full = hit_state // self.B
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
            req.state_set = self.pool.allocate(self.S, zero=False)
            state_copies.append((list(node.snapshot), req.state_set))
            self.tree.lock(node)
            req.lock_node = node
        else:
            req.state_set = self.pool.allocate(self.S, zero=True)
        req.pending_page_copies, req.pending_state_copies = page_copies, state_copies
        req.num_computed = hit_state
        req.status = Status.RUNNING
        req.snapshot_plan = self._plan_snapshots(n, hit_state, hit_len)
        if prompt_hit:
            req.cached_tokens = min(hit_state, req.prompt_len)
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_tokens += req.cached_tokens
        return True

    def _wait_for_shared_prefix(self, req: Request) -> bool:
        """In-batch prefix sharing: if a running request is still prefilling a prefix this one shares
        (beyond what the cache holds), have it publish a snapshot at the shared grid point and keep this
        request waiting until then, so N requests with one system prompt compute it once."""
        g, toks = self.grid, req.token_ids
        if not self.cache_cfg.enable_prefix_cache or self.cache_cfg.full_block_mode or len(toks) <= g:
            return False
        head = toks[:g]
        hit = None
        for p in self.running:
            if p.num_computed >= p.prompt_len or p.salt != req.salt or p.token_ids[:g] != head:
                continue
            n = min(len(toks) - 1, p.prompt_len)
            lo = g
            while lo + g <= n and p.token_ids[lo:lo + g] == toks[lo:lo + g]:
                lo += g  # whole grid blocks in common
            if hit is None:
                hit = self.tree.match(toks[: len(toks) - 1], req.salt, touch=False).state_hit
            if lo <= hit or p.num_computed > lo:
                continue  # nothing to gain, or the sharer already went past that point
            if lo not in p.snapshot_plan:
                bisect.insort(p.snapshot_plan, lo)
            return True
        return False

    def _plan_snapshots(self, n: int, state_hit: int, kv_hit: int) -> list[int]:
        """Positions (absolute, on the grid, in (state_hit, n)) where this request publishes snapshots."""
        if not self.cache_cfg.enable_prefix_cache:
            return []
        g, B = self.grid, self.B
        pos: set[int] = set()
        # physical block boundaries (the grid point at or below each one)
        pos.update((b // g) * g for b in range(B, n, B))
        if not self.cache_cfg.full_block_mode:
            replay = (n - 1) // g * g  # an identical repeat matches n-1 tokens: keep the grid point below
            pos.update(replay - i * g for i in range(self.cache_cfg.tail_snapshots))
            if kv_hit > state_hit:
                pos.add(kv_hit // g * g)  # a junction seen a second time: another path branches here
        return sorted(p for p in pos if state_hit < p < n)

    # ---- after the forward ----

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Request]:
        """Advance requests by what ran; publish snapshots; append sampled tokens. Returns finished requests."""
        finished: list[Request] = []
        stats = self.stats
        stats.computed_tokens += len(out.decodes)
        for req in out.decodes:
            if req.num_computed < req.prompt_len:
                stats.computed_prompt_tokens += 1
            req.num_computed += 1
            if req.fences:
                self.pool.unref(req.fences)  # this step's copies have run
                req.fences = []
            self._append(req, sampled[req.rid], finished)
        for c in out.chunks:
            req = c.req
            req.num_computed += c.num_tokens
            stats.computed_tokens += c.num_tokens
            stats.computed_prompt_tokens += max(0, min(c.start + c.num_tokens, req.prompt_len) - c.start)
            for pos, dest in c.snapshots:
                self._publish(req, pos, dest)
            if req.fences:
                self.pool.unref(req.fences)
                req.fences = []
            if c.needs_logits:
                self._append(req, sampled[req.rid], finished)
        return finished

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

    def _publish(self, req: Request, pos: int, dest: list[int]) -> None:
        node = self.tree.insert(req.token_ids[:pos], req.block_table, req.salt, snapshot=dest)
        self.stats.snapshots_published += 1
        self._move_lock(req, node)

    def _move_lock(self, req: Request, node) -> None:
        self.tree.lock(node)
        old, req.lock_node = req.lock_node, node
        self.tree.unlock(old)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        nc = req.num_computed
        # pending copies: aborted before its first forward, so the live state set was never filled
        if self.cache_cfg.enable_prefix_cache and nc > 0 and req.state_set is not None and (
                not req.pending_state_copies and not req.pending_page_copies) and (
                not self.cache_cfg.full_block_mode or nc % self.B == 0):
            # the live state is the state after exactly nc fed tokens: donate it (no copy)
            node = self.tree.insert(req.token_ids[:nc], req.block_table, req.salt, snapshot=req.state_set)
            req.state_set = None
            self._move_lock(req, node)
            if req.pin and node is not None:
                node.pins += 1
                self.pins[req.rid] = node
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.running.remove(req)

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

    def _preempt(self, req: Request, chunks: dict[int, ScheduledChunk]) -> None:
        if req in self._step_decodes:
            self._step_decodes.remove(req)
        c = chunks.pop(req.rid, None)
        if c is not None:
            for _, dest in c.snapshots:
                self.pool.unref(dest)
        req.pending_page_copies, req.pending_state_copies = [], []
        self._preempted_this_step = True
        self._release(req)
        req.num_computed = 0
        req.snapshot_plan = []
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(req)
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
        for p in self.pool.reserved:
            refs[p] += 1
        assert [refs[p] for p in range(self.pool.num_pages)] == self.pool.refcount, "page refcounts drifted"
        assert sorted(self.pool.free_list) == [p for p in range(self.pool.num_pages) if refs[p] == 0]
