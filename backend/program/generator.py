"""What the program executor needs from the engine: text generation with stop strings, and prompt
scoring. One implementation over any engine client (the ZMQ EngineClient or InProcEngineClient).
Text and stop strings go through the gateway's TextStream, so programs and the HTTP API agree.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from k3rt.backend.gateway import TextStream
from k3rt.backend.tokenizer import Tokenizer
from k3rt.protocol import params_to_dict
from k3rt.sampling_params import SamplingParams


@dataclass
class GenResult:
    text: str
    token_ids: list[int]  # every sampled token (a trailing stop token included)
    finish_reason: str  # "stop" | "length" | "stop_string" | "abort" | "error"
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    rid: str = ""  # the engine request id (to unpin a pin=True request later)
    logprobs: list[float] = field(default_factory=list)  # per token of token_ids, when params.logprobs is set
    top_logprobs: list[list[list[float]]] = field(default_factory=list)  # per token: [[token_id, logprob], ...]
    prompt_logprobs: dict[int, float] = field(default_factory=dict)  # position -> logprob (prompt_logprobs_from)
    matched: str | None = None  # the stop string or stop regex that ended the text


REGEX_BUDGET_S = 0.5  # a gen's stop_regex searches together (they run on the gateway's event loop)

# on_text(delta, token ids so far, logprobs of the tokens since the last call, their top alternatives):
# called per engine update (delta may be "": tokens that add no text yet)
TextCallback = Callable[[str, list[int], list[float], list], None]


class _Stops:
    """Stop strings and stop regexes matched by the generator itself, for gens whose stops the gateway's
    TextStream cannot express: stop_regex, and min_tokens (no stop counts before that many tokens; a stop
    string must end in text produced after it, as in SGLang, whose check looks at the output's tail).
    The text is cut where the earliest match starts.

    Regexes run on the gateway's event loop, so a pattern that backtracks without end ("(a|a)*$") must not
    hold it: they are matched with the `regex` module (a tiktoken dependency), whose searches take a
    timeout, and a gen's regex searches together get REGEX_BUDGET_S; past it the gen fails."""

    def __init__(self, stop: Sequence[str], stop_regex: Sequence[str], min_tokens: int) -> None:
        import regex

        self.stop, self.min_tokens = tuple(stop), min_tokens
        try:
            self.regexes = [regex.compile(r) for r in stop_regex]
        except regex.error as e:
            raise ValueError(f"stop_regex: {e}") from None
        self.budget = REGEX_BUDGET_S
        self.hold = max((len(x) for x in self.stop), default=1) - 1  # a stop string's chars that can hide in a tail
        self.armed_at: int | None = None  # text offset when min_tokens was reached

    def find(self, text: str, num_tokens: int, released: int) -> tuple[int, str] | None:
        """(cut offset, what matched), or None. released: text already streamed, never cut again."""
        if num_tokens < self.min_tokens:
            return None
        if self.armed_at is None:
            # from min_tokens on, a match may begin in the held tail of the text before it
            self.armed_at = 0 if self.min_tokens == 0 else max(released, len(text) - self.hold)
        hits = []
        for x in self.stop:
            i = text.find(x, self.armed_at)
            if i >= 0:
                hits.append((i + len(x), i, x))
        for r in self.regexes:
            started = time.monotonic()
            try:
                m = r.search(text, self.armed_at, timeout=max(self.budget, 0.001))
            except TimeoutError:
                raise ValueError(f"stop_regex: matching {r.pattern!r} took more than {REGEX_BUDGET_S:g} s "
                                 "(a pattern that backtracks, like nested repetition?)") from None
            self.budget -= time.monotonic() - started
            if m is not None:
                hits.append((m.end(), m.start(), r.pattern))
        if not hits:
            return None
        _, start, what = min(hits)  # the first to complete
        return start, what

    def safe(self, text: str) -> int:
        """How much of `text` can be streamed: a stop regex may still match anything, a stop string only a tail."""
        return 0 if self.regexes else max(0, len(text) - self.hold)


class Generator:
    def __init__(self, client: Any, tokenizer: Tokenizer) -> None:
        self.client, self.tok = client, tokenizer

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, stop: Sequence[str] = (),
                       stop_regex: Sequence[str] = (), grammar: dict | None = None, cache_salt: str | None = None,
                       on_text: TextCallback | None = None, pin: bool = False, rid: str | None = None,
                       prompt_logprobs_from: int | None = None) -> GenResult:
        """rid: the engine request id to use (a caller that pins picks it first, so it can unpin the
        request even if it is cancelled before this returns)."""
        own = _Stops(stop, stop_regex, params.min_tokens) if stop_regex or (stop and params.min_tokens) else None
        ts = TextStream(self.tok, () if own else tuple(stop))  # the gateway's detokenizer + stop-string logic
        text, ids, lps, tops = [], [], [], []
        reason, prompt_tokens, cached, error, matched = "abort", len(prompt_ids), 0, None, None
        prompt_lps: dict[int, float] = {}
        rid = rid or uuid.uuid4().hex
        stream = self.client.generate(prompt_ids, params_to_dict(params), cache_salt=cache_salt, grammar=grammar,
                                      rid=rid, pin=pin, prompt_logprobs_from=prompt_logprobs_from)
        full = ""  # own stops: all text so far; `text` holds what was released
        released = 0
        sent = 0  # logprobs already passed to on_text

        def emit(delta: str) -> None:
            nonlocal sent
            if delta:
                text.append(delta)
            if on_text:
                on_text(delta, ids, lps[sent:], tops[sent:])
                sent = len(lps)

        try:
            async for u in stream:
                counted = ts.push(u.token_ids)
                ids += u.token_ids[:counted]
                if u.logprobs is not None:
                    lps += u.logprobs[:counted]
                if u.top_logprobs is not None:
                    tops += u.top_logprobs[:counted]
                prompt_tokens, cached = u.prompt_tokens or prompt_tokens, u.cached_tokens
                if u.finished and u.prompt_logprobs is not None:
                    prompt_lps = {int(k): v for k, v in u.prompt_logprobs.items()}
                if own is not None:
                    if u.finished:
                        ts.finish()
                    full += ts.take(final=True)
                    try:
                        hit = own.find(full, len(ids), released)
                    except ValueError as e:
                        reason, error = "error", str(e)
                        break
                    if hit is not None:
                        full, matched, reason = full[:hit[0]], hit[1], "stop_string"
                        emit(full[released:])
                        break
                    if u.finished:
                        reason, error = u.finish_reason or "stop", u.error
                        emit(full[released:])
                        break
                    upto = own.safe(full)
                    if upto > released:
                        emit(full[released:upto])
                        released = upto
                    elif on_text:
                        emit("")
                    continue
                if ts.stopped:
                    emit(ts.take(final=True))
                    reason, matched = "stop_string", ts.stop_string
                    break  # closing the stream aborts the request in the engine
                if u.finished:
                    ts.finish()
                    emit(ts.take(final=True))
                    reason, error = u.finish_reason or "stop", u.error
                    break
                emit(ts.take())
        finally:
            await stream.aclose()
        return GenResult("".join(text), ids, reason, prompt_tokens, cached, error, rid, lps, tops, prompt_lps,
                         matched)

    async def unpin(self, rid: str) -> None:
        """Let the cache evict the snapshot a pin=True generation kept."""
        await self.client.unpin(rid)

    async def score(self, prompts: list[list[int]], starts: list[int], *, cache_salt: str | None = None,
                    ) -> list[dict[int, float]]:
        """log p(token_i | tokens_<i) for i >= start, for every prompt, submitted together (one batch)."""
        params = replace(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))

        async def one(p: list[int], s: int) -> dict[int, float]:
            out: dict[int, float] = {}
            async for u in self.client.generate(p, params_to_dict(params), cache_salt=cache_salt,
                                                prompt_logprobs_from=s):
                if u.error:
                    raise ValueError(u.error)
                if u.finished and u.prompt_logprobs is not None:
                    out = {int(k): v for k, v in u.prompt_logprobs.items()}
            return out

        return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, starts))))
