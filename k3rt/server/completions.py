"""POST /v1/completions: prompt text or token ids (one or a batch) -> a gateway Job -> text_completion.

Choice `index` is prompt_index * n + choice_in_prompt, as OpenAI numbers a batch. `echo` prepends the
prompt as sent (a text prompt's own text, without the BOS the tokenizer adds; a token-id prompt decoded).
`echo` with `logprobs` also returns the prompt tokens' logprobs (the first token's is null, as in vLLM);
with `max_tokens: 0` nothing is generated, which is how evaluation harnesses (lm-eval's
loglikelihood) score a text. Streamed, the echoed prompt is a choice's first chunk, as in vLLM; with
`logprobs` that chunk carries the prompt's logprobs, which the gateway reports with a choice's last update,
so such a choice's chunks are sent when it ends (the echo, then its generated text and logprobs in one).
`suffix` and best_of > n are not served (400).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from k3rt.server.errors import bad_request
from k3rt.server.generation import (
    MIN_LOGPROB, Choice, ServerContext, check_logprobs, check_vocab, grammar_sources, new_id, now,
    json_response, namespaced_salt, report_ignored, resolve_max_tokens, respond, sampling_params, sse, token_text,
    total_usage, validate_grammar,
)
from k3rt.server.limits import BigBodies, PromptBudget
from k3rt.server.schemas import CompletionRequest, check_common, stop_list, unknown_fields

if TYPE_CHECKING:
    from k3rt.backend.gateway import ChoiceDelta, TokenLogprob

MAX_PROMPTS = 64  # prompts per batch request


def prompt_texts(prompt: Any) -> list[str | None]:
    """The text of each prompt as sent, None for a token-id prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    return [None] if prompt and isinstance(prompt[0], int) else [None] * len(prompt)


async def _prompts(ctx: ServerContext, prompt: Any, budget: PromptBudget) -> list[list[int]]:
    """Token ids per prompt. A text that cannot fit the context is refused before it is tokenized
    (limits.py); token-id lists are the parsed lists themselves, not copies."""
    if isinstance(prompt, str):
        budget.check_text(prompt, "prompt")
        return [await ctx.gateway.encode_prompt(prompt)]
    if not prompt:
        raise bad_request("prompt", "must not be an empty list")
    if len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    if isinstance(prompt[0], int):
        return [prompt]
    if isinstance(prompt[0], str):
        for i, p in enumerate(prompt):
            budget.check_text(p, f"prompt[{i}]")
        return [await ctx.gateway.encode_prompt(p) for p in prompt]
    return prompt


async def completion(ctx: ServerContext, req: CompletionRequest, request: Request, budget: PromptBudget,
                     big: BigBodies | None = None) -> Response:
    """`big`: set when the body was big (limits.BIG_BODY_BYTES): its token ids are checked in a worker
    thread."""
    from k3rt.backend.gateway import Job

    check_common(req)
    ignored = unknown_fields(req)
    ctx.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix", "is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of", f"only best_of == n is supported, got best_of={req.best_of}, n={req.n}")
    check_logprobs(req.logprobs, "logprobs")
    score_prompt = req.echo and req.logprobs is not None
    if req.max_tokens is not None and req.max_tokens < 0:
        raise bad_request("max_tokens", f"must be >= 0, got {req.max_tokens}")
    gw = ctx.gateway
    prompts = await _prompts(ctx, req.prompt, budget)
    # max_tokens 0: one token is sampled and dropped (Job.drop_output), so the prompt must leave room for it
    no_output = req.max_tokens == 0
    # lengths first: a list of millions of ids is refused without a pass over it
    max_tokens = resolve_max_tokens(1 if no_output else req.max_tokens, "max_tokens", [len(p) for p in prompts],
                                    "prompt", gw.context_length)
    if big is not None:
        await big.run(lambda: check_vocab(prompts, gw.vocab_size, "prompt"))
    else:
        check_vocab(prompts, gw.vocab_size, "prompt")
    constraints = grammar_sources(req, req.response_format)
    if len(constraints) > 1:
        raise bad_request(constraints[1][0], f"only one output constraint per request; {constraints[0][0]} is "
                          f"already set")
    grammar = await validate_grammar(ctx, *constraints[0]) if constraints else None
    params = sampling_params(req, max_tokens, req.logprobs, gw.vocab_size)
    job = Job(prompts, params, req.n, stop_list(req), grammar, namespaced_salt(request, req.cache_salt),
              prompt_logprobs_from=1 if score_prompt else None, drop_output=no_output)
    out = _CompletionOutput(ctx, req, prompts, prompt_texts(req.prompt))
    response = await respond(ctx, job, req.n, request, "completions", bool(req.stream), out.render_echo,
                             out.render_delta, out.render_end, out.response)
    return report_ignored(response, ignored, "completions")


class _CompletionOutput:
    def __init__(self, ctx: ServerContext, req: CompletionRequest, prompts: list[list[int]],
                 texts: list[str | None]) -> None:
        self.ctx, self.req, self.prompts, self.texts = ctx, req, prompts, texts
        self.id, self.created, self.model = new_id("cmpl"), now(), req.model
        self.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        self.offsets: dict[int, int] = {}  # choice -> characters of text so far (logprobs text_offset)
        # streamed echo with logprobs: each choice's deltas, held until its last one brings the prompt logprobs
        self.held: dict[int, Choice] | None = {} if req.echo and req.logprobs is not None else None

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        text = self.texts[index // self.req.n]
        return self.ctx.gateway.tokenizer.decode(self.prompts[index // self.req.n]) if text is None else text

    def _prompt_logprobs(self, index: int, c: Choice) -> dict[str, Any]:
        """The echoed prompt's entries: every prompt token, its logprob (null where there is no context: the
        first token) and a top dict holding the token itself and the `logprobs` most likely ones."""
        prompt = self.prompts[index // self.req.n]
        entries = c.prompt_logprobs or [None] * len(prompt)
        tokens, values, tops, offsets = [], [], [], []
        offset = 0
        for t, e in zip(prompt, entries):
            text = token_text(self.ctx, t)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if e is None:
                values.append(None)
                tops.append(None)
                continue
            value = max(e.logprob, MIN_LOGPROB)
            values.append(value)
            tops.append({**{token_text(self.ctx, a)[0]: max(v, MIN_LOGPROB) for a, v in e.top}, text: value})
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, index: int, lps: list[TokenLogprob]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        offset = self.offsets.get(index, 0)
        for lp in lps:
            text = token_text(self.ctx, lp.token_id)[0]
            tokens.append(text)
            values.append(max(lp.logprob, MIN_LOGPROB))
            tops.append({token_text(self.ctx, t)[0]: max(v, MIN_LOGPROB) for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def response(self, choices: list[Choice]) -> Response:
        out = []
        for i, c in enumerate(choices):
            logprobs = None
            if self.req.logprobs is not None and self.req.echo:
                head, tail = self._prompt_logprobs(i, c), self._logprobs(i, c.logprobs)
                logprobs = {k: head[k] + tail[k] for k in head}
            elif self.req.logprobs is not None:
                logprobs = self._logprobs(i, c.logprobs)
            choice: dict[str, Any] = {"index": i, "text": self._echo(i) + c.text, "finish_reason": c.finish_reason,
                                      "logprobs": logprobs}
            if self.req.return_token_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        body: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                "model": self.model, "choices": out, "usage": total_usage(choices, self.req.n)}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompts[0] if len(self.prompts) == 1 else self.prompts
        return json_response(body)

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    def render_echo(self) -> list[bytes]:
        if not self.req.echo or self.held is not None:  # with logprobs, the echo waits for them
            return []
        num = len(self.prompts) * self.req.n
        return [self._chunk([{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}])
                for i in range(num)]

    def render_delta(self, d: ChoiceDelta) -> list[bytes]:
        if self.held is not None:
            return self._render_scored(d)
        lps = self._logprobs(d.index, d.logprobs) if self.req.logprobs is not None and d.logprobs else None
        if not d.text and d.finish_reason is None and lps is None:
            return []
        choice: dict[str, Any] = {"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return [self._chunk([choice])]

    def _render_scored(self, d: ChoiceDelta) -> list[bytes]:
        """A streamed echo with logprobs: nothing until the choice's last delta, then the echoed prompt with
        its logprobs and everything generated (the text_offsets go on from the prompt's)."""
        c = self.held.setdefault(d.index, Choice())  # type: ignore[union-attr]
        c.add(d)
        if d.finish_reason is None:
            return []
        del self.held[d.index]  # type: ignore[union-attr]
        echo = {"index": d.index, "text": self._echo(d.index), "logprobs": self._prompt_logprobs(d.index, c),
                "finish_reason": None}
        rest: dict[str, Any] = {"index": d.index, "text": c.text, "logprobs": self._logprobs(d.index, c.logprobs),
                                "finish_reason": c.finish_reason}
        if self.req.return_token_ids:
            echo["token_ids"], rest["token_ids"] = [], c.token_ids
        return [self._chunk([echo]), self._chunk([rest])]

    def render_end(self, choices: list[Choice]) -> list[bytes]:
        if not self.include_usage:
            return []
        return [self._chunk([], total_usage(choices, self.req.n))]
