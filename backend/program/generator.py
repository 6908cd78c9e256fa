"""What the program executor needs from the engine: text generation with stop strings, and prompt
scoring. One implementation over any engine client (the ZMQ EngineClient or InProcEngineClient).
Text and stop strings go through the gateway's TextStream, so programs and the HTTP API agree.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
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


class Generator:
    def __init__(self, client: Any, tokenizer: Tokenizer) -> None:
        self.client, self.tok = client, tokenizer

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, stop: list[str] = (),
                       grammar: dict | None = None, cache_salt: str | None = None,
                       on_text: Callable[[str], None] | None = None, pin: bool = False,
                       rid: str | None = None) -> GenResult:
        """rid: the engine request id to use (a caller that pins picks it first, so it can unpin the
        request even if it is cancelled before this returns)."""
        ts = TextStream(self.tok, tuple(stop))  # the gateway's detokenizer + stop-string logic
        text, ids = [], []
        reason, prompt_tokens, cached, error = "abort", len(prompt_ids), 0, None
        rid = rid or uuid.uuid4().hex
        stream = self.client.generate(prompt_ids, params_to_dict(params), cache_salt=cache_salt, grammar=grammar,
                                      rid=rid, pin=pin)

        def emit(delta: str) -> None:
            if delta:
                text.append(delta)
                if on_text:
                    on_text(delta)

        try:
            async for u in stream:
                ids += u.token_ids
                prompt_tokens, cached = u.prompt_tokens or prompt_tokens, u.cached_tokens
                ts.push(u.token_ids)
                if ts.stopped:
                    emit(ts.take(final=True))
                    reason = "stop_string"
                    break  # closing the stream aborts the request in the engine
                if u.finished:
                    ts.finish()
                    emit(ts.take(final=True))
                    reason, error = u.finish_reason or "stop", u.error
                    break
                emit(ts.take())
        finally:
            await stream.aclose()
        return GenResult("".join(text), ids, reason, prompt_tokens, cached, error, rid)

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
