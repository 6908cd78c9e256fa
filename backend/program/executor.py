"""Executes program ops (frontend/ir.py) against the engine, one asyncio task per program state.

A state is text built from segments. Its prompt token ids are the token ids of every generated span
(exactly what the model produced) with each run of constant text between them tokenized as a whole;
shipped and client-side runs therefore produce identical prompts. Ops of one state run in order;
forked states run concurrently. A fork first commits the parent's uncomputed text (a one-token
request), so the children find the shared prefix in the cache instead of computing it n times.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from k3rt.backend.program.generator import Generator, GenResult
from k3rt.backend.program.roles import RoleText
from k3rt.frontend.ir import GEN_OPTIONS, Op, Program
from k3rt.protocol import params_from_dict
from k3rt.sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_MAX_TOKENS = 128
COMMIT_MIN_TOKENS = 64  # a fork commits the parent's prefix when at least this much is uncomputed
ENCODE_IN_THREAD_CHARS = 64 << 10  # longer texts are tokenized in a worker thread, off the gateway's event loop


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_DEFAULT_KEYS = _SAMPLING_FIELDS | {"stop"} | set(GEN_OPTIONS)  # what run() may set for every gen
MAX_SAMPLES = 64  # gen(n=...): samples of one gen, run at once


def check_options(opts: dict[str, Any]) -> str | None:
    """Why a gen's options (GEN_OPTIONS, from a program off the wire) cannot run, or None."""
    n = opts.get("n", 1)
    if type(n) is not int or not 1 <= n <= MAX_SAMPLES:
        return f"n: must be an int in [1, {MAX_SAMPLES}], got {n!r}"
    sr = opts.get("stop_regex", [])
    if type(sr) is not list or not all(type(x) is str for x in sr):
        return "stop_regex: must be a list of strings"
    k = opts.get("top_logprobs_num")
    if k is not None and (type(k) is not int or not 0 <= k <= MAX_LOGPROBS):
        return f"top_logprobs_num: must be an int in [0, {MAX_LOGPROBS}], got {k!r}"
    start = opts.get("logprob_start_len")
    if start is not None and type(start) is not int:
        return f"logprob_start_len: must be an int, got {start!r}"
    for key in ("return_logprob", "return_text_in_logprobs", "own_stop"):
        if key in opts and type(opts[key]) is not bool:
            return f"{key}: must be a bool, got {opts[key]!r}"
    return None


class OpError(Exception):
    def __init__(self, message: str, line: int) -> None:
        super().__init__(message)
        self.line = line


@dataclass
class StateData:
    base_ids: list[int] = field(default_factory=list)  # tokens up to the end of the last generated span
    run: str = ""  # constant text after it, not yet tokenized
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None
    role_start: int = 0  # offset in text where the current role's content starts
    vars: dict[str, Any] = field(default_factory=dict)
    new_vars: list[str] = field(default_factory=list)  # names set since this state was forked (for join)
    meta: dict[str, Any] = field(default_factory=dict)
    computed: int = 0  # prompt tokens known to be in the prefix cache
    pinned_rid: str | None = None  # the last gen's engine request, whose end snapshot stays pinned
    gen_rid: str | None = None  # the gen in flight (pin=True): unpinned too if the state is cancelled
    fork_start: int = 0  # offset in text where this state was forked off its parent (concate_and_append)
    scopes: dict[str, int] = field(default_factory=dict)  # open var_scope name -> text offset at its start

    def fork_copy(self) -> "StateData":
        child = copy.deepcopy(self)
        child.new_vars = []
        child.pinned_rid = child.gen_rid = None  # the parent's pins stay the parent's
        child.fork_start = len(self.text)
        return child


class ProgramSession:
    def __init__(self, pid: str, gen: Generator, roles: RoleText, *,
                 on_event: Callable[[int, str | None, str, bool], None] | None = None,
                 cache_salt: str | None = None) -> None:
        self.pid, self.gen, self.roles, self.on_event, self.salt = pid, gen, roles, on_event, cache_salt
        # the root state starts as every sequence of this model does (BOS for `add_bos_token` models)
        self.states: dict[int, StateData] = {0: StateData(base_ids=list(gen.tok.sequence_prefix))}
        self.queues: dict[int, asyncio.Queue] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.ready: dict[int, asyncio.Event] = {}
        self.defaults: dict[str, Any] = {}
        self.error: OpError | None = None
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}  # of this ProgramRun's engine requests

    # ---- tokens ----

    def prompt_ids(self, st: StateData) -> list[int]:
        return st.base_ids + (self.gen.tok.encode(st.run) if st.run else [])

    async def _prompt_ids(self, st: StateData) -> list[int]:
        """prompt_ids, with a long run of text tokenized off the event loop (a program's 8 MB text op
        took the loop, /health included, for 10 s)."""
        return st.base_ids + (await self._encode(st.run) if st.run else [])

    async def _encode(self, text: str) -> list[int]:
        if len(text) < ENCODE_IN_THREAD_CHARS:
            return self.gen.tok.encode(text)
        return await asyncio.to_thread(self.gen.tok.encode, text)

    def _append_text(self, st: StateData, text: str) -> None:
        st.run += text
        st.text += text

    # ---- running ----

    def _queue(self, sid: int) -> asyncio.Queue:
        if sid not in self.queues:
            self.queues[sid] = asyncio.Queue()
            self.ready.setdefault(sid, asyncio.Event())
            if sid == 0:
                self.ready[0].set()
            self.tasks[sid] = asyncio.create_task(self._worker(sid))
        return self.queues[sid]

    async def _worker(self, sid: int) -> None:
        q = self.queues[sid]
        await self.ready[sid].wait()
        while True:
            op: Op = await q.get()
            try:
                if self.error is None:
                    await self._apply(sid, op)
            except OpError as e:
                self.error = self.error or e
            except asyncio.CancelledError:
                q.task_done()
                raise
            except Exception as e:  # a bug or an engine failure: report it against the op's line
                self.error = self.error or OpError(f"{type(e).__name__}: {e}", op.line)
            q.task_done()

    async def run(self, program: Program) -> None:
        """Run these ops (appended to any earlier ones of this session); returns when all have run."""
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        unknown = set(program.default_params) - _DEFAULT_KEYS
        if unknown:
            raise ValueError(f"program.default_params: unknown {sorted(unknown)}")
        stop = program.default_params.get("stop", [])
        if type(stop) is not list or not all(type(x) is str for x in stop):
            raise ValueError("program.default_params.stop: must be a list of strings")
        self.defaults.update(program.default_params)
        for op in program.ops:
            self._queue(op.state).put_nowait(op)
        await asyncio.gather(*(q.join() for q in list(self.queues.values())))
        # forks inside this batch may have created queues after the gather started
        await asyncio.gather(*(q.join() for q in list(self.queues.values())))

    def cancel(self) -> None:
        """Stop the session: cancel its tasks and release the cache pins its states hold."""
        for t in self.tasks.values():
            t.cancel()
        loop = asyncio.get_running_loop()
        for st in self.states.values():
            for rid in (st.pinned_rid, st.gen_rid):  # an in-flight gen: the engine will not pin it
                if rid is not None:
                    loop.create_task(self.gen.unpin(rid))
            st.pinned_rid = st.gen_rid = None

    # ---- ops ----

    async def _apply(self, sid: int, op: Op) -> None:
        st = self.states[sid]
        k = op.kind
        before = len(st.text)
        await self._apply_op(sid, st, op)
        # gen streams its own deltas; other text reaches the whole-text stream here, a select's
        # choice also its variable's stream (which it completes)
        if self.on_event is not None and k != "gen" and len(st.text) > before:
            self.on_event(sid, op.name if k == "select" else None, st.text[before:], k == "select")

    async def _apply_op(self, sid: int, st: StateData, op: Op) -> None:
        k = op.kind
        if k == "text":
            self._append_text(st, op.value or "")
        elif k == "role_begin":
            if st.role is not None:
                raise OpError(f"role {op.value!r} begins inside role {st.role!r}", op.line)
            self._append_text(st, self.roles.prefix[op.value])
            st.role, st.role_start = op.value, len(st.text)
        elif k == "role_end":
            if st.role != op.value:
                raise OpError(f"role {op.value!r} ends but {st.role!r} is open", op.line)
            st.messages.append({"role": op.value, "content": st.text[st.role_start:]})
            self._append_text(st, self.roles.suffix[op.value])
            st.role = None
        elif k == "gen":
            await self._gen(sid, st, op)
        elif k == "select":
            await self._select(sid, st, op)
        elif k == "fork":
            await self._commit(st)
            for c in op.children:
                self.states[c] = st.fork_copy()
                self._queue(c)
                self.ready[c].set()
        elif k == "join":
            for c in op.children:
                if c in self.queues:
                    await self.queues[c].join()
            if op.value == "concate_and_append":
                # as text, child by child: a KDA state cannot be spliced the way sglang splices KV caches
                for c in op.children:
                    child = self.states[c]
                    self._append_text(st, child.text[child.fork_start:])
                return
            gathered: dict[str, list[Any]] = {}
            for c in op.children:
                child = self.states[c]
                for name in child.new_vars:
                    gathered.setdefault(name, []).append(child.vars[name])
            for name, values in gathered.items():
                self._set_var(st, name, values)
        elif k == "var_begin":
            st.scopes[op.name] = len(st.text)
        elif k == "var_end":
            if op.name not in st.scopes:
                raise OpError(f"var_scope {op.name!r} ends but never began in this state", op.line)
            self._set_var(st, op.name, st.text[st.scopes.pop(op.name):])
        elif k == "set_var":
            self._set_var(st, op.name, op.params["value"])

    @staticmethod
    def _set_var(st: StateData, name: str, value: Any) -> None:
        st.vars[name] = value
        if name not in st.new_vars:
            st.new_vars.append(name)

    def _params(self, op: Op) -> SamplingParams:
        defaults = {k: v for k, v in self.defaults.items() if k in _SAMPLING_FIELDS}
        merged = {"max_tokens": DEFAULT_MAX_TOKENS, **defaults, **op.params}
        if merged.get("min_tokens", 0) > merged["max_tokens"]:
            raise OpError(f"min_tokens: {merged['min_tokens']} exceeds max_tokens {merged['max_tokens']}", op.line)
        try:
            return params_from_dict(merged)
        except (ValueError, TypeError) as e:
            raise OpError(str(e), op.line) from None

    def _count(self, res: GenResult) -> None:
        self.usage["prompt_tokens"] += res.prompt_tokens
        self.usage["completion_tokens"] += len(res.token_ids)

    async def _gen(self, sid: int, st: StateData, op: Op) -> None:
        opts = {**{k: v for k, v in self.defaults.items() if k in GEN_OPTIONS}, **op.options}
        why = check_options(opts)
        if why is not None:
            raise OpError(why, op.line)
        stop = list(op.stop) if op.options.get("own_stop") else [*self.defaults.get("stop", []), *op.stop]
        want_lp = bool(opts.get("return_logprob"))
        top_n = opts.get("top_logprobs_num") or 0
        params = self._params(op)
        if want_lp:
            params = replace(params, logprobs=top_n)
        prompt = await self._prompt_ids(st)
        # input_token_logprobs from prompt position logprob_start_len (None or < 0: none); position 0 has no
        # context, so its logprob is None, and the engine scores from position 1
        start = opts.get("logprob_start_len")
        from_pos = None
        if want_lp and start is not None and 0 <= start < len(prompt) and len(prompt) > 1:
            from_pos = max(start, 1)
        n = opts.get("n") or 1
        stop_regex = opts.get("stop_regex", ())
        emit = None
        if self.on_event is not None:
            def emit(delta: str, ids: list[int], lps: list[float], tops: list) -> None:
                meta: dict[str, Any] = {"completion_tokens": len(ids)}
                if want_lp:
                    new_ids = ids[len(ids) - len(lps):]
                    meta["output_token_logprobs"] = self._token_logprobs(lps, new_ids, opts)
                    meta["output_token_logprobs_length"] = len(ids)
                    if top_n:
                        meta["output_top_logprobs"] = [self._tops(t, opts) for t in tops]
                self.on_event(sid, op.name, delta, False, meta)
        # pin the end-of-generation snapshot: the program's next call resumes from it, so it must survive
        # cache pressure in between; the previous pin of this state is released once this one exists
        st.gen_rid = uuid.uuid4().hex  # known before the request starts: a cancel mid-gen unpins it
        # n > 1: the other samples run alongside, from the same prompt; the state continues with sample 0
        res, *others = await asyncio.gather(
            self.gen.generate(prompt, params, stop=stop, stop_regex=stop_regex, grammar=op.grammar,
                              cache_salt=self.salt, on_text=emit, pin=True, rid=st.gen_rid,
                              prompt_logprobs_from=from_pos),
            *(self.gen.generate(prompt, params, stop=stop, stop_regex=stop_regex, grammar=op.grammar,
                                cache_salt=self.salt, prompt_logprobs_from=from_pos) for _ in range(n - 1)))
        for r in (res, *others):
            self._count(r)
        previous, st.pinned_rid, st.gen_rid = st.pinned_rid, res.rid, None
        if previous is not None:
            await self.gen.unpin(previous)
        error = next((r.error for r in (res, *others) if r.error), None)
        if error:
            raise OpError(error, op.line)
        if self.on_event is not None:
            self.on_event(sid, op.name, "", True)
        ids = res.token_ids
        eos = set(self.gen.tok.eos_token_ids) | set(params.stop_token_ids)
        if res.finish_reason == "stop_string":
            self._append_text(st, res.text)  # the tokens ran past the stop string: keep text only
        else:
            if ids and ids[-1] in eos and not params.ignore_eos:
                ids = ids[:-1]  # the stop token ends the span; role_end adds the template's own end text
            st.base_ids = prompt + ids
            st.run = ""
            st.text += res.text
        st.computed = max(st.computed, len(prompt) + len(res.token_ids) - 1)
        if op.name:
            metas = [self._gen_meta(r, prompt, start, from_pos, want_lp, opts) for r in [res, *others]]
            self._set_var(st, op.name, res.text if n == 1 else [res.text] + [r.text for r in others])
            st.meta[op.name] = metas[0] if n == 1 else metas

    def _gen_meta(self, res: GenResult, prompt: list[int], start: int | None, from_pos: int | None, want_lp: bool,
                  opts: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {"prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.token_ids),
                                "cached_tokens": res.cached_tokens, "finish_reason": res.finish_reason}
        if res.matched is not None:
            meta["matched_stop"] = res.matched
        if want_lp:
            meta["output_token_logprobs"] = self._token_logprobs(res.logprobs, res.token_ids, opts)
            meta["output_token_logprobs_length"] = len(res.logprobs)
            if opts.get("top_logprobs_num"):
                meta["output_top_logprobs"] = [self._tops(t, opts) for t in res.top_logprobs]
            if from_pos is not None:
                meta["input_token_logprobs"] = [[None, prompt[0], self._text(prompt[0], opts)]] if start == 0 else []
                meta["input_token_logprobs"] += [[res.prompt_logprobs.get(p), prompt[p], self._text(prompt[p], opts)]
                                                 for p in range(from_pos, len(prompt))]
        return meta

    def _text(self, token_id: int, opts: dict[str, Any]) -> str | None:
        return self.gen.tok.decode([token_id]) if opts.get("return_text_in_logprobs") else None

    def _token_logprobs(self, lps: list[float], ids: list[int], opts: dict[str, Any]) -> list[list[Any]]:
        """sglang's (logprob, token_id, text or None) per token."""
        return [[lp, tid, self._text(tid, opts)] for lp, tid in zip(lps, ids)]

    def _tops(self, top: list, opts: dict[str, Any]) -> list[list[Any]]:
        return [[lp, int(t), self._text(int(t), opts)] for t, lp in top]

    async def _select(self, sid: int, st: StateData, op: Op) -> None:
        tok = self.gen.tok
        run_ids = await self._encode(st.run) if st.run else []
        prompts, starts, spans = [], [], []
        for choice in op.choices:
            # tokenize the constant text and the choice jointly: the choice may merge with the text's
            # last token, so scoring starts where the joint tokens first differ (token healing)
            joint = await self._encode(st.run + choice)
            k = 0
            while k < min(len(joint), len(run_ids)) and joint[k] == run_ids[k]:
                k += 1
            if k == len(joint):  # the choice added nothing new (empty choice): score its last token
                k -= 1
            k = max(k, 0)
            p = st.base_ids + joint
            start = max(len(st.base_ids) + k, 1)
            prompts.append(p)
            starts.append(start)
            spans.append(len(p) - start)
        scored = await self.gen.score(prompts, starts, cache_salt=self.salt)
        self.usage["prompt_tokens"] += sum(map(len, prompts))
        token_lps = [[lp[i] for i in sorted(lp)] for lp in scored]
        if any(not t for t in token_lps):
            raise OpError("select: a choice produced no scorable tokens", op.line)
        means = [sum(t) / len(t) for t in token_lps]
        scored_ids = [p[s:] for p, s in zip(prompts, starts)]
        meta: dict[str, Any] = {
            "normalized_prompt_logprobs": means,
            "input_token_logprobs": [[[lp, tid, tok.decode([tid])] for lp, tid in zip(t, ids)]
                                     for t, ids in zip(token_lps, scored_ids)],
            "output_token_logprobs": [[] for _ in op.choices]}
        scores: list[float]
        if op.method == "token_length_normalized":
            scores = means
        elif op.method == "greedy":
            # token by token; a choice out of tokens continues with its mean (sglang's GreedyTokenSelection)
            width = max(len(t) for t in token_lps)
            padded = [t + [sum(t) / len(t)] * (width - len(t)) for t in token_lps]
            best = max(range(len(padded)), key=lambda i: padded[i])  # lexicographic: the greedy filter
            scores = [1.0 if i == best else 0.0 for i in range(len(padded))]
            meta["greedy_logprob_matrix"] = padded
        else:
            # unconditional_likelihood_normalized, as sglang: the same token ids scored with no context;
            # the first has none at all and counts 0
            multi = [i for i, ids in enumerate(scored_ids) if len(ids) > 1]
            uncond_lps: list[list[float]] = [[0.0] for _ in scored_ids]
            if multi:
                got = await self.gen.score([scored_ids[i] for i in multi], [1] * len(multi), cache_salt=self.salt)
                self.usage["prompt_tokens"] += sum(len(scored_ids[i]) for i in multi)
                for i, lp in zip(multi, got):
                    uncond_lps[i] = [0.0] + [lp[j] for j in sorted(lp)]
            scores = [sum(a - b for a, b in zip(t, u)) / len(t) for t, u in zip(token_lps, uncond_lps)]
            meta["unconditional_token_logprobs"] = [[[None if j == 0 else lp, tid, None]
                                                     for j, (lp, tid) in enumerate(zip(u, ids))]
                                                    for u, ids in zip(uncond_lps, scored_ids)]
            meta["normalized_unconditional_prompt_logprobs"] = scores
        best = max(range(len(scores)), key=lambda i: scores[i])
        self._append_text(st, op.choices[best])
        if op.name:
            self._set_var(st, op.name, op.choices[best])
            st.meta[op.name] = {"choices": op.choices, "scores": scores, "token_logprobs": token_lps,
                                "method": op.method, **meta}

    async def _commit(self, st: StateData) -> None:
        prompt = await self._prompt_ids(st)
        if len(prompt) - st.computed >= COMMIT_MIN_TOKENS:
            res = await self.gen.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                          cache_salt=self.salt)
            self._count(res)
            if res.error is None:
                st.computed = len(prompt)

    # ---- results ----

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"variables": {}, "texts": {}, "messages": {}, "meta": {}}
        for sid, st in self.states.items():
            out["variables"][str(sid)] = st.vars
            out["texts"][str(sid)] = st.text
            out["messages"][str(sid)] = st.messages
            out["meta"][str(sid)] = st.meta
        if self.error is not None:
            out["error"], out["error_line"] = str(self.error), self.error.line
        out["usage"] = dict(self.usage)
        return out
