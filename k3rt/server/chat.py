"""POST /v1/chat/completions: messages -> chat template -> a gateway Job -> chat.completion (or chunks).

Tool use (see tools.py): with `tools` and tool_choice "auto" the model's own tool-call tokens are parsed
out of each choice; "required" and a named function constrain the output with a grammar and report it
as tool calls; "none" declares the tools but never parses calls. Only one output constraint may be set:
response_format (json_object / json_schema), regex, choice, or a forced tool call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from k3rt.server import tools as tool_calls
from k3rt.server.errors import APIError, bad_request
from k3rt.server.generation import (
    Choice, ServerContext, chat_logprob, check_logprobs, check_vocab, grammar_sources, json_response, new_id, now,
    namespaced_salt, report_ignored, resolve_max_tokens, respond, sampling_params, sse, total_usage, validate_grammar,
)
from k3rt.server.limits import BigBodies, PromptBudget, dismantle
from k3rt.server.schemas import ChatCompletionRequest, check_common, stop_list, unknown_fields

if TYPE_CHECKING:
    from k3rt.backend.gateway import ChoiceDelta

_ROLE_MAP = {"developer": "system"}


@dataclass(frozen=True)
class _ToolMode:
    kind: str  # "none" | "auto" | "named" | "required"
    name: str | None = None  # the forced function ("named")
    first_index: int = 0  # IDX of this turn's first call in Kimi's "functions.NAME:IDX" ids


def _messages(req: ChatCompletionRequest, budget: PromptBudget) -> list[dict[str, Any]]:
    """Validated messages as template dicts. Content parts must be text (no image input). A content that
    cannot fit the context is refused here, before the template and the tokenizer see it (limits.py)."""
    if not req.messages:
        raise bad_request("messages", "must contain at least one message")
    out = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        content: Any = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"{where}.content[{j}]", f"only text parts are supported, got type {part.type!r}")
                budget.check_text(part.text, f"{where}.content[{j}].text")
            content = "".join(p.text or "" for p in content)
        if isinstance(content, str):
            budget.check_text(content, f"{where}.content")
        if content is None and m.role in ("system", "developer", "user"):
            raise bad_request(f"{where}.content", f"required for role {m.role!r}")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"{where}.tool_call_id", "required for role 'tool'")
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"{where}.tool_calls", "only assistant messages carry tool calls")
        if m.role == "assistant" and content is None and not m.tool_calls:
            raise bad_request(f"{where}.content", "an assistant message needs content or tool_calls")
        d: dict[str, Any] = {"role": _ROLE_MAP.get(m.role, m.role), "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        out.append(d)
    return out


def _tool_mode(req: ChatCompletionRequest) -> _ToolMode:
    tools = req.tools or []
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if not tool_calls.FUNCTION_NAME.match(name):
            raise bad_request(f"tools[{i}].function.name",
                              f"must match {tool_calls.FUNCTION_NAME.pattern}, got {name!r}")
    if len(set(names)) != len(names):
        raise bad_request("tools", "function names must be unique")
    choice = req.tool_choice
    first = tool_calls.count_calls(req.messages)
    if choice is None:
        return _ToolMode("auto" if tools else "none", first_index=first)
    if isinstance(choice, str):
        if choice in ("auto", "required") and not tools:
            raise bad_request("tool_choice", f"{choice!r} needs a non-empty tools list")
        return _ToolMode(choice, first_index=first)
    if choice.function.name not in names:
        raise bad_request("tool_choice", f"function {choice.function.name!r} is not among the tools {names}")
    return _ToolMode("named", choice.function.name, first)


# below this many characters of message text, the template and the tokenizer run on the event loop (as in
# Gateway.encode_chat); above it, or for a big body, in a worker thread
_INLINE_CHARS = 4096


def _encode(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    try:
        # message contents cannot inject special tokens: only the template's text may produce them
        return tokenizer.encode_chat(messages, tools=tools)
    except Exception as e:  # jinja2.TemplateError (e.g. an unsupported role), ValueError (no template)
        raise bad_request("messages", f"the chat template rejected them: {e}") from None


def _prepare(ctx: ServerContext, req: ChatCompletionRequest, budget: PromptBudget) -> tuple[list[int], _ToolMode, int]:
    """Messages -> chat template -> token ids -> max_tokens, with the checks on the way: content parts,
    the prompt budget, tool names, tools that fill the context (a 413 naming `tools` when the messages
    alone would fit), the context length, the vocabulary. Synchronous: a worker thread runs it unless the
    request is small, so the message dicts it builds are also taken apart there."""
    held = [_messages(req, budget)]  # the only reference, so that `dismantle` may take it apart
    mode = _tool_mode(req)
    gw = ctx.gateway
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    prompt_ids = _encode(gw.tokenizer, held[0], tools)
    if len(prompt_ids) >= gw.context_length and tools:
        without = len(_encode(gw.tokenizer, held[0], None))
        if without < gw.context_length:
            raise APIError(413, f"tools: the {len(tools)} tool declarations take {len(prompt_ids) - without} of "
                           f"the prompt's {len(prompt_ids)} tokens; the context length is {gw.context_length}, "
                           f"which leaves no room for output", param="tools", code="context_length_exceeded")
    dismantle(held)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(requested, param, [len(prompt_ids)], "messages", gw.context_length)
    check_vocab([prompt_ids], gw.vocab_size, "messages")
    return prompt_ids, mode, max_tokens


def _text_chars(req: ChatCompletionRequest) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or ())
               for m in req.messages)


async def chat_completion(ctx: ServerContext, req: ChatCompletionRequest, request: Request, budget: PromptBudget,
                          big: BigBodies | None = None) -> Response:
    """`big`: set when the body was big (limits.BIG_BODY_BYTES): its messages are prepared and tokenized
    in a worker thread, away from the garbage collector."""
    from k3rt.backend.gateway import Job
    from k3rt.backend.grammar import GrammarSpec

    check_common(req)
    ignored = unknown_fields(req)
    ctx.check_model(req.model)
    if req.top_logprobs is not None:
        check_logprobs(req.top_logprobs, "top_logprobs")
        if not req.logprobs:
            raise bad_request("top_logprobs", "requires logprobs to be true")
    gw = ctx.gateway
    if big is not None:
        prompt_ids, mode, max_tokens = await big.run(lambda: _prepare(ctx, req, budget))
    elif _text_chars(req) < _INLINE_CHARS:
        prompt_ids, mode, max_tokens = _prepare(ctx, req, budget)
    else:
        prompt_ids, mode, max_tokens = await asyncio.to_thread(_prepare, ctx, req, budget)

    constraints = grammar_sources(req, req.response_format)
    tools_by_name = {t.function.name: t.function for t in req.tools or []}
    if mode.kind == "named":
        f = tools_by_name[mode.name]  # type: ignore[index]
        constraints.append(("tool_choice", GrammarSpec.json_schema(tool_calls.function_schema(f.parameters),
                                                                   strict=bool(f.strict))))
    elif mode.kind == "required":
        schema = tool_calls.required_schema([(f.name, f.parameters) for f in tools_by_name.values()],
                                            parallel=req.parallel_tool_calls)
        constraints.append(("tool_choice", GrammarSpec.json_schema(schema)))
    if len(constraints) > 1:
        raise bad_request(constraints[1][0], f"only one output constraint per request; {constraints[0][0]} is "
                          f"already set")
    grammar = await validate_grammar(ctx, *constraints[0]) if constraints else None

    make_parser = None
    text_end_id = None
    probe = tool_calls.KimiToolParser.create(gw.special_token_id, gw.tokenizer.decode) if mode.kind == "auto" else None
    if probe is not None:  # None: the vocabulary has no tool-call tokens, so there is nothing to parse
        text_end_id = probe.section_begin_id

        def make_parser() -> tool_calls.KimiToolParser:
            return tool_calls.KimiToolParser(probe.ids, gw.tokenizer.decode)

    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                             ctx.gateway.vocab_size)
    job = Job([prompt_ids], params, req.n, stop_list(req), grammar, namespaced_salt(request, req.cache_salt), text_end_id)
    out = _ChatOutput(ctx, req, mode, prompt_ids, make_parser)
    response = await respond(ctx, job, req.n, request, "chat", bool(req.stream), out.render_start,
                             out.render_delta, out.render_end, out.response)
    return report_ignored(response, ignored, "chat")


class _ChatOutput:
    """Renders one request's choices: the whole chat.completion, or its stream of chunks."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, mode: _ToolMode, prompt_ids: list[int],
                 make_parser: Callable[[], tool_calls.KimiToolParser] | None) -> None:
        self.ctx, self.req, self.mode, self.prompt_ids = ctx, req, mode, prompt_ids
        self.id, self.created, self.model = new_id("chatcmpl"), now(), req.model
        self.parsers = {i: make_parser() for i in range(req.n)} if make_parser else {}
        self.sent_call_head: set[int] = set()  # "named" streams: choices whose first call chunk went out
        self.required_text: dict[int, str] = {}  # "required" streams: the JSON array so far, per choice
        self.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)

    # ---- whole response ----

    def response(self, choices: list[Choice]) -> Response:
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [self._choice(i, c) for i, c in enumerate(choices)],
                "usage": total_usage(choices, self.req.n)}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return json_response(body)

    def _choice(self, index: int, c: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        calls = self._final_calls(index, c)
        if calls is not None:
            message["content"] = c.text if self.mode.kind == "auto" and c.text else None
            message["tool_calls"] = calls
            if finish == "stop":
                finish = "tool_calls"
        out: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish,
                               "logprobs": self._logprobs(c.logprobs) if self.req.logprobs else None}
        if self.req.return_token_ids:
            out["token_ids"] = c.token_ids
        return out

    def _final_calls(self, index: int, c: Choice) -> list[dict[str, Any]] | None:
        m = self.mode
        if m.kind == "named":
            return [_call(None, tool_calls.call_id(m.name, m.first_index), m.name, c.text)]  # type: ignore[arg-type]
        if m.kind == "required":
            parsed = tool_calls.parse_required(c.text)
            if parsed is None:
                return None
            return [_call(None, tool_calls.call_id(name, m.first_index + j), name, args)
                    for j, (name, args) in enumerate(parsed)]
        parser = self.parsers.get(index)
        if parser is None:
            return None
        parser.feed(c.token_ids)
        if not parser.calls:
            return None
        return [_call(None, call.id, call.name, call.arguments) for call in parser.calls]

    def _logprobs(self, lps: list[Any]) -> dict[str, Any]:
        return {"content": [chat_logprob(self.ctx, lp) for lp in lps]}

    # ---- stream ----

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    def render_start(self) -> list[bytes]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.req.n)]

    def render_delta(self, d: ChoiceDelta) -> list[bytes]:
        delta: dict[str, Any] = {}
        kind = self.mode.kind
        finish = d.finish_reason
        if kind in ("none", "auto") and d.text:
            delta["content"] = d.text
        if kind == "auto" and d.index in self.parsers:
            parser = self.parsers[d.index]
            done = parser.feed(d.token_ids)
            if done:
                start = len(parser.calls) - len(done)
                delta["tool_calls"] = [_call(start + j, c.id, c.name, c.arguments) for j, c in enumerate(done)]
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
        elif kind == "named":
            if d.index not in self.sent_call_head:
                self.sent_call_head.add(d.index)
                name = self.mode.name or ""
                delta["tool_calls"] = [_call(0, tool_calls.call_id(name, self.mode.first_index), name, d.text)]
            elif d.text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": d.text}}]
            if finish == "stop":
                finish = "tool_calls"
        elif kind == "required":
            # the array is parsed at the end; keep its text until then
            self.required_text[d.index] = self.required_text.get(d.index, "") + d.text
            if finish is not None:
                parsed = tool_calls.parse_required(self.required_text[d.index])
                if parsed is None:
                    delta["content"] = self.required_text[d.index]
                else:
                    delta["tool_calls"] = [_call(j, tool_calls.call_id(name, self.mode.first_index + j), name, args)
                                           for j, (name, args) in enumerate(parsed)]
                    if finish == "stop":
                        finish = "tool_calls"
        lps = self._logprobs(d.logprobs) if self.req.logprobs and d.logprobs else None
        if not delta and finish is None and lps is None:
            return []
        choice = {"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        return [self._chunk([choice])]

    def render_end(self, choices: list[Choice]) -> list[bytes]:
        if not self.include_usage:
            return []
        return [self._chunk([], total_usage(choices, self.req.n))]


def _call(index: int | None, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool call; stream deltas carry the call's `index` within the choice, whole messages do not."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}
