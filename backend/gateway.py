"""The gateway: the asyncio side of serving, between the HTTP edge and the engine process.

It owns the tokenizer (prompts in, incremental text out), stop strings, grammar validation (compiled
here, in a worker thread, so a bad or slow grammar becomes a 400 before the engine sees it), admission
(too many engine requests in flight -> `Overloaded`, retry later; a job larger than that whole capacity ->
`TooLarge`, never admissible), and the `EngineClient` (the engine process and its ZMQ sockets). It knows
nothing of HTTP or OpenAI's JSON: a `Job` goes in, `ChoiceDelta`s come out.

One job fans out into one engine request per (prompt, choice); each runs in its own asyncio task that
turns the engine's token updates into text deltas. Closing the job's stream early (the HTTP client went
away) cancels those tasks, and a cancelled task aborts its engine request, which frees its pages and
state. A stop string ends a choice the same way, so the engine stops generating tokens nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k3rt.backend.engine_client import EngineClient, EngineDead
from k3rt.backend.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from k3rt.config import EngineConfig
from k3rt.model_config import load_model_config
from k3rt.protocol import params_to_dict
from k3rt.sampling_params import SamplingParams

if TYPE_CHECKING:
    from k3rt.backend.grammar import GrammarBackend, GrammarSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    engine: EngineConfig
    context_length: int | None = None  # prompt + output tokens per request; None: the model's maximum
    log_level: str = "WARNING"  # the engine process's logging level

    @property
    def max_in_flight(self) -> int:
        """Engine requests the gateway lets in before answering Overloaded (running + waiting)."""
        s = self.engine.scheduler
        return s.max_running + s.max_waiting


class Overloaded(Exception):
    """Too many requests in flight; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooLarge(ValueError):
    """A job the gateway's capacity rule can never admit, however idle the engine: a 400, not a retry.
    The message starts with the field to blame (`n`, or `prompt` for several prompts)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class EngineUnavailable(Exception):
    """The engine is still starting, is shutting down, or has died."""


@dataclass(frozen=True)
class Job:
    """One HTTP request's generation work: `n` choices for each prompt."""

    prompts: list[list[int]]
    params: SamplingParams  # per choice i of a job with a seed, the seed is params.seed + i
    n: int = 1
    stop: tuple[str, ...] = ()  # stop strings: never emitted; text that could begin one is held back
    grammar: dict[str, Any] | None = None  # GrammarSpec.to_dict(), validated with `validate_grammar` first
    cache_salt: str | None = None
    # tokens from this id on are structured output (a tool-call section), not text: they are passed on in
    # `token_ids` but not detokenized into `text`
    text_end_id: int | None = None
    # score the prompt: each choice's last delta carries `prompt_logprobs` for positions >= this (>= 1)
    prompt_logprobs_from: int | None = None
    # max_tokens 0: params.max_tokens is 1 and that one sampled token is dropped (the choice has no output,
    # finish_reason "length"); the prompt is still computed (cached, scored)
    drop_output: bool = False


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, most likely first


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since its last delta. Choice `index` is prompt_index * n + choice_in_prompt."""

    index: int
    text: str  # new text, with stop strings cut and possible stop-string prefixes held back
    token_ids: list[int]  # new token ids (all of them, special and structured tokens included)
    logprobs: list[TokenLogprob] | None  # one per token id when params.logprobs is set
    finish_reason: str | None = None  # set on the choice's last delta: "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why the engine rejected or failed this choice (finish_reason "error")
    engine_dead: bool = False  # the error is the engine process's death, not this request's fault
    internal: bool = False  # the error is a gateway bug (logged), not the request's fault
    # on the last delta of a job with prompt_logprobs_from: one entry per prompt token, None where not scored
    # (position 0, and positions before prompt_logprobs_from)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    spec_accepted_tokens: int = 0  # draft tokens accepted for this choice so far (speculative decoding)


class TextStream:
    """One choice's text: incremental detokenization plus stop strings matched across token boundaries.

    `push` takes token ids one update at a time and returns how many of them count (tokens after the one
    that completed a stop string are dropped); `take` releases the text that can no longer turn into a
    stop string. Text that ends in a proper prefix of a stop string is held until the next tokens decide.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), text_end_id: int | None = None) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._text_end_id = text_end_id
        self._pending = ""
        self._structured = False
        self.stopped = False  # a stop string was found; the choice is over
        self.stop_string: str | None = None

    def push(self, token_ids: Sequence[int]) -> int:
        for i, t in enumerate(token_ids):
            if t == self._text_end_id:
                self._structured = True
            if not self._structured:
                self._append(self._detok.push(t))
            if self.stopped:
                return i + 1
        return len(token_ids)

    def finish(self) -> None:
        """End of output: flush the detokenizer (an unfinished character becomes U+FFFD)."""
        if not self.stopped and not self._structured:
            self._append(self._detok.flush())

    def take(self, final: bool = False) -> str:
        if final or self.stopped:
            out, self._pending = self._pending, ""
            return out
        hold = self._held_suffix()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out):]
        return out

    def _append(self, text: str) -> None:
        if not text or self.stopped:
            return
        self._pending += text
        if not self._stop:
            return
        # the output ends where the first stop string to complete ends (the longest one, if several end there),
        # whatever the tokenization; the pending text held no complete stop string before this append
        hits = [(i + len(s), -len(s), s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        if hits:
            end, neg_len, s = min(hits)
            self._pending = self._pending[:end + neg_len]
            self.stopped, self.stop_string = True, s

    def _held_suffix(self) -> int:
        p = self._pending
        for k in range(min(len(p), self._longest - 1), 0, -1):
            tail = p[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


class JobStream:
    """The deltas of a running job, in arrival order; ends when every choice has finished."""

    def __init__(self, tasks: list[asyncio.Task], out: asyncio.Queue[ChoiceDelta]) -> None:
        self._tasks, self._out = tasks, out
        self._remaining = len(tasks)

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        if not self._remaining:
            raise StopAsyncIteration
        delta = await self._out.get()
        if delta.finish_reason is not None:
            self._remaining -= 1
        return delta

    def close(self) -> None:
        """Abort the choices still running. Synchronous, so it is safe where an await would be cancelled
        again (a handler whose client disconnected); each cancelled choice task sends its engine abort."""
        self._remaining = 0
        for t in self._tasks:
            if not t.done():
                t.cancel()


class Gateway:
    """Tokenizer + grammar validation + admission + the engine process. Use from one event loop."""

    def __init__(self, cfg: GatewayConfig, *, client: Any = None) -> None:
        """`client`: an engine client (default: an `EngineClient`, which spawns the engine process); tests
        pass an `InProcEngineClient`, which has the same interface and runs the engine on a thread."""
        self.cfg = cfg
        self.tokenizer: Tokenizer = load_tokenizer(cfg.engine.model)
        model_len = load_model_config(cfg.engine.model).max_position_embeddings
        if cfg.context_length is not None and not 1 <= cfg.context_length <= model_len:
            raise ValueError(f"context_length: must be in [1, {model_len}] (the model's maximum), "
                             f"got {cfg.context_length}")
        self.context_length = cfg.context_length or model_len
        self.eos_token_ids = list(self.tokenizer.eos_token_ids)
        self.client = client if client is not None else EngineClient(cfg.engine, log_level=cfg.log_level)
        self.in_flight = 0  # engine requests started and not yet ended
        self.draining = False  # shutting down: no new requests
        self.last_update_at = 0.0  # time.monotonic() of the last engine update a choice received (/health)
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = asyncio.Lock()
        self._ready = False

    # ---- lifecycle ----

    async def start(self) -> None:
        """Spawn the engine process and wait for Ready. Raises EngineDead if it fails to start."""
        await self.client.start()
        self._ready = True

    @property
    def ready(self) -> bool:
        return self._ready and self.client.dead is None and not self.draining

    @property
    def dead(self) -> str | None:
        return self.client.dead

    async def shutdown(self) -> None:
        """The drain handshake (Shutdown -> ShutdownAck), then join the engine process."""
        self.draining = True
        await self.client.shutdown()
        if self._grammar is not None:
            self._grammar.close()

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: the model's vocabulary (logits width) once the engine is up."""
        return int(self.client.info.get("vocab_size", self.tokenizer.vocab_size))

    @property
    def stats(self) -> dict[str, Any]:
        """The engine's latest stats (running, waiting, pages, snapshots, tokens) plus the gateway's."""
        return {**self.client.stats, "in_flight": self.in_flight, "engine_pid": self.client.info.get("pid")}

    async def flush_cache(self) -> None:
        await self.client.flush_cache()

    # ---- prompts and grammars ----

    async def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a text prompt (`Tokenizer.encode_prompt`: BOS first for `add_bos_token` models);
        special-token text becomes special tokens (chat templates need that)."""
        if len(text) < 4096:
            return self.tokenizer.encode_prompt(text)
        return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode_prompt, text)

    async def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of a chat prompt; message contents never become special tokens (Tokenizer.encode_chat)."""
        size = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0 for m in messages)
        if size < 4096:
            return self.tokenizer.encode_chat(messages, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.tokenizer.encode_chat(messages, **kwargs))

    def special_token_id(self, text: str) -> int | None:
        """The id of a special token such as "<|tool_call_begin|>", or None if the vocabulary lacks it."""
        ids = self.tokenizer.encode(text)
        return ids[0] if len(ids) == 1 and ids[0] in self.tokenizer.special_token_ids else None

    async def validate_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` in a worker thread; raises GrammarError (a ValueError) naming the problem."""
        loop = asyncio.get_running_loop()
        async with self._grammar_lock:
            if self._grammar is None:
                from k3rt.backend.grammar import create_grammar_backend

                self._grammar = await loop.run_in_executor(
                    None, lambda: create_grammar_backend(self.cfg.engine.grammar_backend, self.tokenizer))
        await loop.run_in_executor(None, self._grammar.validate, spec)

    # ---- generation ----

    def _admit(self, job: Job) -> None:
        num_requests = len(job.prompts) * job.n
        limit = self.cfg.max_in_flight
        if num_requests > limit:
            whole = f"the server runs at most {limit} generations at once (max_running + max_waiting)"
            if len(job.prompts) == 1 or job.n > limit:
                raise TooLarge("n", f"{job.n} choices per prompt; {whole}")
            raise TooLarge("prompt", f"{len(job.prompts)} prompts x n {job.n} = {num_requests} generations; {whole}")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if self.client.dead:
            raise EngineUnavailable(f"the engine is not running: {self.client.dead}")
        if not self._ready:
            raise EngineUnavailable("the engine is still starting")
        if self.in_flight + num_requests > limit:
            raise Overloaded(f"too many requests: {self.in_flight} generations in flight, the limit is {limit} "
                             f"(max_running + max_waiting); this request needs {num_requests}")

    def generate(self, job: Job) -> JobStream:
        """Start every choice of `job` now; returns the stream of their deltas.

        Raises TooLarge, Overloaded or EngineUnavailable at once, before anything starts. Iterate the stream
        to the end, or `close()` it to abort the choices still running (a job nobody reads runs to its end)."""
        self._admit(job)
        out: asyncio.Queue[ChoiceDelta] = asyncio.Queue()
        tasks = []
        for p, prompt_ids in enumerate(job.prompts):
            for i in range(job.n):
                index = p * job.n + i
                params = job.params
                if params.seed is not None and index:
                    params = dataclasses.replace(params, seed=(params.seed + index) % 2**63)
                task = asyncio.create_task(self._run_choice(index, prompt_ids, params, job, out))
                self.in_flight += 1
                # a done callback, not a finally: a task cancelled before it starts never runs its body
                task.add_done_callback(self._choice_done)
                tasks.append(task)
        return JobStream(tasks, out)

    def _choice_done(self, task: asyncio.Task) -> None:
        self.in_flight -= 1
        if not task.cancelled() and task.exception() is not None:
            log.error("choice task failed", exc_info=task.exception())

    async def _run_choice(self, index: int, prompt_ids: list[int], params: SamplingParams, job: Job,
                          out: asyncio.Queue[ChoiceDelta]) -> None:
        text = TextStream(self.tokenizer, job.stop, job.text_end_id)
        want_logprobs = params.logprobs is not None
        # a one-token prompt has no position to score (position 0 has no context)
        score_from = job.prompt_logprobs_from if job.prompt_logprobs_from is not None and (
            job.prompt_logprobs_from < len(prompt_ids)) else None
        try:
            updates = self.client.generate(prompt_ids, params_to_dict(params), cache_salt=job.cache_salt,
                                           grammar=job.grammar, eos_token_ids=self.eos_token_ids,
                                           prompt_logprobs_from=score_from)
            async with contextlib.aclosing(updates):
                async for u in updates:
                    self.last_update_at = time.monotonic()
                    kept = 0 if job.drop_output else text.push(u.token_ids)
                    ids = u.token_ids[:kept]
                    lps = None
                    if want_logprobs:
                        lps = [TokenLogprob(t, lp, [(int(a), float(b)) for a, b in top])
                               for t, lp, top in zip(ids, u.logprobs or [], u.top_logprobs or [[]] * len(ids))]
                    finish = "stop" if text.stopped else (u.finish_reason or "stop") if u.finished else None
                    if job.drop_output and finish not in (None, "error", "abort"):
                        finish = "length"
                    if finish is not None and not job.drop_output:
                        text.finish()
                    delta = ChoiceDelta(index, text.take(final=finish is not None), ids, lps, finish,
                                        u.prompt_tokens, u.cached_tokens,
                                        spec_accepted_tokens=u.spec_accepted_tokens)
                    if job.prompt_logprobs_from is not None and u.finished and finish != "error":
                        delta.prompt_logprobs = _prompt_logprobs(prompt_ids, u.prompt_logprobs,
                                                                 u.prompt_top_logprobs)
                    if finish == "error" and not text.stopped:
                        delta.error = u.error or "generation failed"
                        delta.engine_dead = self.client.dead is not None
                    if delta.text or delta.token_ids or finish is not None:
                        out.put_nowait(delta)
                    if finish is not None:
                        # leaving the `async with` closes the engine stream, which aborts a request that is
                        # still running (a stop string ended it first)
                        return
        except EngineDead as e:
            out.put_nowait(ChoiceDelta(index, "", [], None, "error", len(prompt_ids), error=str(e), engine_dead=True))
        except Exception as e:
            # whatever went wrong, this choice must end, or its HTTP request would wait forever
            log.exception("choice %d failed", index)
            out.put_nowait(ChoiceDelta(index, "", [], None, "error", len(prompt_ids), error=f"{type(e).__name__}: {e}",
                                       internal=True))


def _prompt_logprobs(prompt_ids: list[int], scores: dict[str, float] | None,
                     tops: dict[str, list] | None) -> list[TokenLogprob | None]:
    """The engine's prompt scores (position -> logprob, position -> top pairs) as one entry per prompt token."""
    scores, tops = scores or {}, tops or {}
    out: list[TokenLogprob | None] = []
    for p, t in enumerate(prompt_ids):
        v = scores.get(str(p))
        out.append(None if v is None else TokenLogprob(t, v, [(int(a), float(b)) for a, b in tops.get(str(p), ())]))
    return out
