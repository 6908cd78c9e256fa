"""What the program executor needs from the engine: text generation with stop strings, and prompt
scoring. One implementation over any engine client (the ZMQ EngineClient or InProcEngineClient).

Stop strings are matched on the detokenized text across token boundaries and never emitted: text
that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from k3rt.backend.tokenizer import Tokenizer
from k3rt.backend.tokenizer.detokenizer import IncrementalDetokenizer
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


class StopStringMatcher:
    """Feed text deltas; get back what is safe to emit, and whether a stop string ended the text."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.hit = False

    def push(self, delta: str) -> str:
        if not self.stops:
            return delta
        self.buf += delta
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        # hold back the longest suffix of buf that is a proper prefix of some stop string
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Generator:
    def __init__(self, client: Any, tokenizer: Tokenizer) -> None:
        self.client, self.tok = client, tokenizer

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, stop: list[str] = (),
                       grammar: dict | None = None, cache_salt: str | None = None,
                       on_text: Callable[[str], None] | None = None) -> GenResult:
        detok = IncrementalDetokenizer(self.tok, skip_special_tokens=True)
        stops = StopStringMatcher(list(stop))
        text, ids = [], []
        reason, prompt_tokens, cached, error = "abort", len(prompt_ids), 0, None
        stream = self.client.generate(prompt_ids, params_to_dict(params), cache_salt=cache_salt, grammar=grammar)
        try:
            async for u in stream:
                ids += u.token_ids
                prompt_tokens, cached = u.prompt_tokens or prompt_tokens, u.cached_tokens
                delta = stops.push("".join(detok.push(t) for t in u.token_ids))
                if delta:
                    text.append(delta)
                    if on_text:
                        on_text(delta)
                if stops.hit:
                    reason = "stop_string"
                    break  # closing the stream aborts the request in the engine
                if u.finished:
                    reason, error = u.finish_reason or "stop", u.error
                    tail = stops.push(detok.flush()) + stops.flush()
                    if tail:
                        text.append(tail)
                        if on_text:
                            on_text(tail)
                    break
        finally:
            await stream.aclose()
        return GenResult("".join(text), ids, reason, prompt_tokens, cached, error)

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
