"""The part of a generation request that chat and completions share: from OpenAI fields to a gateway
`Job` (sampling parameters, length limits, grammar), running it (to the end, or as an SSE stream,
aborting either way when the client goes away), and the OpenAI shapes both endpoints use (usage,
logprob entries, SSE framing, gateway errors as HTTP errors). An error after a stream started is a final
`data: {"error": ...}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from k3rt.sampling_params import MAX_LOGPROBS, SamplingParams
from k3rt.server.config import ServerConfig
from k3rt.server.errors import APIError, bad_request
from k3rt.server.metrics import RequestTimer, ServerMetrics
from k3rt.server.schemas import SamplingFields

if TYPE_CHECKING:
    from k3rt.backend.gateway import ChoiceDelta, Gateway, Job, JobStream, TokenLogprob
    from k3rt.server.health import EngineWatch

log = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # what OpenAI reports for impossible tokens (JSON has no -inf)


@dataclass
class ServerContext:
    """What every route needs: the gateway, the config, the metrics, the engine watch. One per app."""

    gateway: Gateway
    config: ServerConfig
    metrics: ServerMetrics
    health: EngineWatch
    shutdown_error: str | None = None  # set by `cut_requests`: the error the requests it ended carry
    # False from `k3rt serve`'s start until every endpoint it was asked for is bound (the DSL port binds after the
    # engine is up): a server whose DSL port turns out taken exits, and must never have answered /health 200
    endpoints_bound: bool = True

    @property
    def ready(self) -> bool:
        """Ready for traffic: the engine is up and not draining, and every front door is open."""
        return self.endpoints_bound and self.gateway.ready

    def cut_requests(self, why: str) -> int:
        """End every running generation now (shutdown: the drain timeout passed, or a second signal). Each
        is answered 503 `server_shutdown` (a final error event then [DONE] on a stream) and its engine request
        is aborted. Returns how many engine requests were running."""
        self.shutdown_error = f"the server is shutting down: {why}"
        return self.gateway.client.cut(self.shutdown_error)

    def check_model(self, name: str) -> None:
        if name not in (self.config.model_name, self.config.engine.model):
            raise APIError(404, f"model: `{name}` does not exist; this server serves `{self.config.model_name}`",
                           param="model", code="model_not_found")


# Below this a temperature is greedy: dividing float32 logits by it would overflow to inf (vLLM does the same).
MIN_TEMPERATURE = 1e-5


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
    from k3rt.server.schemas import logit_bias

    bias = logit_bias(req.logit_bias, vocab_size)
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        return SamplingParams(
            temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty, logprobs=logprobs, seed=req.seed, max_tokens=max_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logit_bias=bias,
            min_tokens=req.min_tokens, speculative=req.speculative)
    except ValueError as e:  # SamplingParams names the field first
        raise bad_request(str(e).split(":", 1)[0], str(e).split(":", 1)[1].strip()) from None


def report_ignored(response: Response, ignored: list[str], endpoint: str) -> Response:
    """Name the request's ignored unknown fields (schemas.unknown_fields) in a response header, and log them."""
    if ignored:
        names = ", ".join(n[:64] for n in ignored[:32]) + (", ..." if len(ignored) > 32 else "")
        log.warning("%s: ignored unknown fields: %s", endpoint, names[:2048])
        # a header value holds printable ASCII only (a field name may be any JSON string)
        response.headers["X-K3rt-Ignored-Fields"] = "".join(c if " " <= c <= "~" else "?" for c in names)
    return response


def resolve_max_tokens(requested: int | None, param: str, prompt_lens: list[int], prompt_param: str,
                       context_length: int) -> int:
    """Output tokens per choice: `requested`, or what is left of the context. 413 if a prompt alone fills
    the context, 400 naming `param` if prompt + requested exceeds it."""
    longest = max(prompt_lens)
    if longest >= context_length:
        raise APIError(413, f"{prompt_param}: the prompt has {longest} tokens; the context length is "
                       f"{context_length}, which leaves no room for output", param=prompt_param,
                       code="context_length_exceeded")
    if requested is None:
        return context_length - longest
    if requested < 1:
        raise bad_request(param, f"must be >= 1, got {requested}")
    if longest + requested > context_length:
        raise bad_request(param, f"{requested} output tokens + {longest} prompt tokens exceed the context length "
                          f"{context_length}", code="context_length_exceeded")
    return requested


def check_vocab(prompts: list[list[int]], vocab_size: int, param: str) -> None:
    for p in prompts:
        if not p:
            raise bad_request(param, "must contain at least one token")
        bad = next((t for t in p if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(param, f"token id {bad} outside the vocabulary [0, {vocab_size})")


def namespaced_salt(request: Any, cache_salt: str | None) -> str | None:
    """The request's prefix-cache namespace: its key's (ServerConfig.cache_isolation), within which the
    client's own cache_salt may namespace further."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:
        return cache_salt
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


def grammar_sources(req: SamplingFields, response_format: Any) -> list[tuple[str, Any]]:
    """(param, GrammarSpec) for every constraint the request asked for via response_format, regex, choice."""
    from k3rt.backend.grammar import GrammarError, GrammarSpec

    out: list[tuple[str, Any]] = []
    try:
        if response_format is not None and response_format.type == "json_object":
            out.append(("response_format", GrammarSpec.json_object()))
        elif response_format is not None and response_format.type == "json_schema":
            js = response_format.json_schema
            if js is None or js.schema_ is None:
                raise bad_request("response_format.json_schema.schema", "a JSON schema object is required")
            out.append(("response_format", GrammarSpec.json_schema(js.schema_, strict=bool(js.strict))))
        if req.regex is not None:
            out.append(("regex", GrammarSpec.regex(req.regex)))
        if req.choice is not None:
            out.append(("choice", GrammarSpec.choice(req.choice)))
    except GrammarError as e:
        param = next((p for p in ("regex", "choice") if str(e).startswith(p)), "response_format")
        raise bad_request(param, str(e), code="invalid_grammar") from None
    return out


async def validate_grammar(ctx: ServerContext, param: str, spec: Any) -> dict[str, Any]:
    from k3rt.backend.grammar import GrammarError

    try:
        orjson.dumps(spec.to_dict())  # it travels to the engine as JSON (64-bit integers at most)
    except TypeError as e:
        raise bad_request(param, f"cannot be sent to the engine: {e}", code="invalid_grammar") from None
    try:
        await ctx.gateway.validate_grammar(spec)
    except GrammarError as e:
        raise bad_request(param, str(e), code="invalid_grammar") from None
    return spec.to_dict()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, accepted_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object. Draft tokens accepted by speculative decoding are reported the way OpenAI reports
    accepted predicted-output tokens (completion_tokens_details.accepted_prediction_tokens), only when there are any."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if accepted_tokens:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted_tokens}
    return out


def token_text(ctx: ServerContext, token_id: int) -> tuple[str, bytes]:
    raw = ctx.gateway.tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def chat_logprob(ctx: ServerContext, lp: TokenLogprob) -> dict[str, Any]:
    def entry(t: int, v: float) -> dict[str, Any]:
        text, raw = token_text(ctx, t)
        return {"token": text, "logprob": max(v, MIN_LOGPROB), "bytes": list(raw)}

    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


def check_logprobs(num: int | None, param: str) -> None:
    if num is not None and not 0 <= num <= MAX_LOGPROBS:
        raise bad_request(param, f"must be in [0, {MAX_LOGPROBS}], got {num}")


@dataclass
class Choice:
    """One choice accumulated from its deltas (non-streaming responses, usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (Job.prompt_logprobs_from)
    spec_accepted_tokens: int = 0

    def add(self, d: ChoiceDelta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.prompt_tokens, self.cached_tokens = d.prompt_tokens or self.prompt_tokens, d.cached_tokens
        self.spec_accepted_tokens = max(self.spec_accepted_tokens, d.spec_accepted_tokens)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason


def total_usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompts count once per prompt (not per choice); cached tokens are the best of a prompt's choices."""
    prompt = cached = 0
    for p in range(0, len(choices), n):
        group = choices[p:p + n]
        prompt += group[0].prompt_tokens
        cached += max(c.cached_tokens for c in group)
    # a stop string may drop accepted tokens after it: never report more accepted than delivered
    return usage(prompt, sum(len(c.token_ids) for c in choices), cached,
                 sum(min(c.spec_accepted_tokens, len(c.token_ids)) for c in choices))


def delta_error(d: ChoiceDelta, shutdown_error: str | None = None) -> APIError:
    """The HTTP error of a choice that ended in error; `shutdown_error`: `ServerContext.shutdown_error`."""
    if d.engine_dead:
        return APIError(503, f"the engine failed: {d.error}", code="engine_failed")
    if shutdown_error is not None and d.error == shutdown_error:
        return APIError(503, shutdown_error, code="server_shutdown")
    if d.internal:
        return APIError(500, f"internal error: {d.error}", code="internal_error")
    msg = d.error or "generation failed"
    if msg.startswith("max_waiting"):
        return APIError(429, msg, code="too_many_requests", headers={"Retry-After": "1"})
    param = msg.split(":", 1)[0] if ":" in msg and " " not in msg.split(":", 1)[0] else None
    return APIError(400, msg, param=param, code="rejected_by_engine")


def gateway_error(e: Exception) -> APIError:
    from k3rt.backend.gateway import EngineUnavailable, Overloaded, TooLarge

    if isinstance(e, TooLarge):
        return APIError(400, str(e), param=e.param, code="request_too_large")
    if isinstance(e, Overloaded):
        return APIError(429, str(e), code="too_many_requests", headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), code="unavailable", headers={"Retry-After": "5"})
    raise e


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_done_or_gone(request: Request, consumer: asyncio.Future, close) -> None:
    """Wait for `consumer` (collecting a job's choices) or the client's disconnect, whichever comes first;
    then stop both and `close()` the streams (which aborts choices still running). Raises the 499 APIError when
    the client left first, or the consumer's own error (a choice the engine failed)."""
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        consumer.cancel()
        close()
    if not consumer.done() or consumer.cancelled():
        raise APIError(499, "the client closed the connection", code="client_closed")
    consumer.result()


async def run_to_end(ctx: ServerContext, job: Job, n: int, request: Request, endpoint: str) -> list[Choice]:
    """Run `job` and collect every choice. Aborts the job if the client disconnects first; raises APIError
    for a choice the engine rejected or could not finish."""
    choices = [Choice() for _ in range(len(job.prompts) * n)]
    timer = RequestTimer(ctx.metrics)
    try:
        stream = ctx.gateway.generate(job)
    except Exception as e:
        raise gateway_error(e) from None

    async def consume() -> None:
        async for d in stream:
            if d.finish_reason == "error":
                raise delta_error(d, ctx.shutdown_error)
            choices[d.index].add(d)
            timer.tokens(d.index, len(d.token_ids))

    try:
        # closing the stream aborts the choices still running: the client is gone, or one choice failed
        await until_done_or_gone(request, asyncio.create_task(consume()), stream.close)
    except APIError as e:
        if e.status == 499:
            ctx.metrics.disconnects.labels(endpoint).inc()
        raise
    u = total_usage(choices, n)
    timer.done(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
    return choices


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def stream_deltas(ctx: ServerContext, job: Job, n: int, endpoint: str, start: list[bytes],
                  render: Callable[[ChoiceDelta], list[bytes]],
                  finish: Callable[[list[Choice]], list[bytes]]) -> AsyncIterator[bytes]:
    """SSE bytes for `job`: the `start` events (roles, echo), then `render` of each delta, then `finish`'s
    closing events (usage).
    Admission errors (429, 503) are raised here, before any response starts; an error after the stream
    started is sent as an OpenAI error event, then [DONE]. A client disconnect cancels the body iterator inside its
    await; its `finally` then closes the job, which aborts the choices' engine requests."""
    try:
        stream = ctx.gateway.generate(job)
    except Exception as e:
        raise gateway_error(e) from None
    return _stream(ctx, stream, job, n, endpoint, start, render, finish)


async def _stream(ctx: ServerContext, stream: JobStream, job: Job, n: int, endpoint: str, start: list[bytes],
                  render: Callable[[ChoiceDelta], list[bytes]],
                  finish: Callable[[list[Choice]], list[bytes]]) -> AsyncIterator[bytes]:
    choices = [Choice() for _ in range(len(job.prompts) * n)]
    timer = RequestTimer(ctx.metrics)
    completed = False
    try:
        for event in start:
            yield event
        async for d in stream:
            if d.finish_reason == "error":
                yield sse(delta_error(d, ctx.shutdown_error).body())
                yield SSE_DONE
                completed = True
                return
            choices[d.index].add(d)
            timer.tokens(d.index, len(d.token_ids))
            for event in render(d):
                yield event
        for event in finish(choices):
            yield event
        yield SSE_DONE
        completed = True
        u = total_usage(choices, n)
        timer.done(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
    finally:
        if not completed:
            ctx.metrics.disconnects.labels(endpoint).inc()
        stream.close()  # also reached when an abandoned body iterator is finalized


async def respond(ctx: ServerContext, job: Job, n: int, request: Request, endpoint: str, stream: bool,
                  start: Callable[[], list[bytes]], render: Callable[[ChoiceDelta], list[bytes]],
                  finish: Callable[[list[Choice]], list[bytes]],
                  response: Callable[[list[Choice]], Response]) -> Response:
    """The end of every generation endpoint: the job's deltas as an SSE stream, or the whole response."""
    if stream:
        body = stream_deltas(ctx, job, n, endpoint, start(), render, finish)
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return response(await run_to_end(ctx, job, n, request, endpoint))
