"""The FastAPI app: routes, body parsing, the API-key check, error rendering and request counting.

Routes
  GET  /health                  200 once the engine is ready; 503 while starting, shutting down, or dead,
                                and when it is stalled or pinned snapshots leave no room (health.py)
  GET  /v1/models               the served model (also GET /v1/models/{id})
  POST /v1/chat/completions     chat.py
  POST /v1/completions          completions.py
  GET  /metrics                 Prometheus text format (metrics.py)
  GET  /v1/k3rt/stats           debug: the engine's latest stats (running, waiting, pages, snapshots, ...)
  POST /v1/k3rt/flush_cache     debug: drop every unlocked prefix-cache entry
  POST /tokenize, /detokenize   the tokenizer, as vLLM serves it; GET /tokenizer_info (tokenize.py)
  POST /generate                SGLang's native API, with GET /get_model_info, /get_server_info,
                                /health_generate, POST /flush_cache and /concate_and_append_request
                                (native.py)

Every route but /health (and /metrics with --metrics-public) needs the API key when keys are set.

Bodies are read (up to `max_body_bytes`) and parsed by the schemas' strict pydantic models here, not by
FastAPI's validation, so that every error is OpenAI's error object with a 400 naming the field. A declared
Content-Length over the limit is answered 413 before any of the body is read; a chunked body is cut off
(413) as soon as it passes the limit. A body over `BIG_BODY_BYTES` is parsed in a worker thread (its prompts
are tokenized in one too), so the event loop keeps serving /health and the other requests; what it builds is
kept from the garbage collector's full passes, and the C heap is trimmed after it (limits.BigBodies).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import logging
import re
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRouter
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from k3rt.server import native
from k3rt.server.chat import chat_completion
from k3rt.server.completions import completion
from k3rt.server.errors import APIError, from_validation_error
from k3rt.server.generation import ServerContext, json_response
from k3rt.server.limits import BIG_BODY_BYTES, BigBodies, PromptBudget, dismantle
from k3rt.server.metrics import CONTENT_TYPE
from k3rt.server.schemas import ChatCompletionRequest, CompletionRequest, check_prompt_shape
from k3rt.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info

# What request handling imports inside functions (grammars, the GBNF converter, model info). Imported when the
# app is made: a first import on the event loop compiles modules with the GIL held, and a server's first chat
# or completion held /health ~0.7 s while k3rt.backend.grammar was imported (tests/server/test_gateway_heap.py)
FIRST_USE_IMPORTS = ("k3rt.backend.gateway", "k3rt.backend.grammar", "k3rt.model_config", "k3rt.sampling_params",
                     "llguidance.gbnf_to_lark")

log = logging.getLogger(__name__)


# the endpoint label of k3rt_requests_total; other paths count as "other" (no label per unknown path)
ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
                    "/v1/k3rt/stats", "/v1/k3rt/flush_cache", "/tokenize", "/detokenize", "/tokenizer_info",
                    "/generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info",
                    "/flush_cache", "/health_generate", "/concate_and_append_request"})


_BIG_BODY = "k3rt.big_body"  # scope key, set when the body was big: a list holding the parsed request


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit} bytes",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    if len(chunks) == 1:
        return chunks[0]
    if size <= BIG_BODY_BYTES:
        return b"".join(chunks)
    # a worker thread's join lets the loop run: joining 20 MB held it 5-35 ms (page faults of the new copy)
    return await asyncio.to_thread(b"".join, chunks)


def _validate(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e.errors(include_url=False), body) from None


_TOKEN_ARRAY = re.compile(rb'"prompt"\s*:\s*\[\s*(\[\s*)?-?\d')
_ID_CHARS = b"0123456789,- \n\t\r"
_SLICE_BYTES = 1 << 18  # ids parsed per GIL hold: ~40K ids, ~1.5 ms
_ITEM_SLICE_BYTES = 1 << 16  # other JSON items per GIL hold (_json_array): ~16K short strings, 1-4 ms


def _token_arrays(body: bytes, context_length: int) -> tuple[int, int, list] | None:
    """The token ids of a big completions body whose prompt is a flat array of ids or a list of such
    arrays, parsed piecewise: (start, end, ids) of the prompt's value in the body, or None when the
    prompt is not that (the parser handles it). Parsing one JSON array builds every id as a Python int
    in a single GIL hold (~35 ns each: 5M ids held the event loop ~180 ms); here each slice of ~40K ids
    is its own orjson call, so the loop runs between them. An array longer than the context is refused
    (413) from its byte count before anything is built. Runs in a worker thread."""
    m = _TOKEN_ARRAY.search(body, 0, 4096)  # the field sits near the start of any real client's body
    if m is None:
        return None
    start = body.index(b"[", m.start() + len(b'"prompt"'))
    nested = m.group(1) is not None
    ids: list = []
    pos = body.index(b"[", start + 1) if nested else start
    while True:
        end = body.find(b"]", pos)
        if end < 0 or body[pos + 1:min(end, pos + 4096)].translate(None, _ID_CHARS) or \
                body[pos + 1:end].translate(None, _ID_CHARS):  # (the head first: a string item ends it at once)
            return None  # malformed, or not only integers: the parser names what is wrong
        n = body.count(b",", pos + 1, end) + 1
        if n > context_length:
            raise APIError(413, f"prompt: {n} tokens cannot fit the context of {context_length} tokens",
                           param="prompt", code="context_length_exceeded")
        one: list[int] = []
        a = pos + 1
        while a < end:  # slices that end at a comma (or at the array's end)
            b = body.find(b",", min(a + _SLICE_BYTES, end), end)
            b = end if b < 0 else b
            one += orjson.loads(b"[" + body[a:b] + b"]") if body[a:b].strip() else []
            a = b + 1
        ids.append(one)
        if not nested:
            return start, end + 1, ids[0]
        rest = body[end + 1:end + 4096].lstrip()
        if rest.startswith(b"]"):
            return start, end + 1 + body[end + 1:].index(b"]") + 1, ids
        if not rest.startswith(b","):
            return None
        pos = body.find(b"[", end + 1)
        if pos < 0:
            return None


def _json_array(body: bytes, start: int) -> tuple[int, list] | None:
    """The JSON array whose "[" is at body[start], parsed a slice of ~_ITEM_SLICE_BYTES at a time, so no one
    orjson call holds the GIL for long: (end, items), end just past its "]"; None when it is not valid JSON
    there (the full parse then names what is wrong). Runs in a worker thread.

    A slice runs from an item's start to a comma and is parsed as the items of an array. One that parses
    is whole items, so that comma is the array's own separator; one that ends inside a string or a nested
    value fails and is tried again twice as long. When the array ends inside a slice, the parse stops
    just past the array's "]" (the content after it is "unexpected"); the items up to that "]" are parsed
    again on their own to confirm it."""
    items: list = []
    a, n = start + 1, len(body)
    while True:
        size = _ITEM_SLICE_BYTES
        while True:
            c = body.find(b",", min(a + size, n))
            c = n if c < 0 else c
            try:
                got = orjson.loads(b"[" + body[a:c] + b"]")
            except orjson.JSONDecodeError as e:
                end = a + len(e.doc[:e.pos].encode("utf-8", "surrogatepass")) - 2  # the "]" it stopped after
                if a <= end < c and body[end] == 0x5D:
                    try:
                        got = orjson.loads(b"[" + body[a:end] + b"]")
                    except orjson.JSONDecodeError:
                        got = None
                    if got is not None:
                        if not got and (items or a > start + 1):  # "[1,]": not JSON
                            return None
                        items += got
                        return end + 1, items
                if c >= n:
                    return None
                size *= 2
                continue
            if c >= n or not got:  # the body ended inside the array, or "[," / ",,"
                return None
            items += got
            a = c + 1
            break


_PROMPT_ARRAY = re.compile(rb'"prompt"\s*:\s*\[')


def _validate_completion(body: bytes, context_length: int) -> Any:
    """CompletionRequest from a big body; a prompt array is parsed piecewise: token ids by _token_arrays,
    any other array by _json_array (then checked by the schema's Python loop)."""
    found, checked = _token_arrays(body, context_length), True
    if found is None and (m := _PROMPT_ARRAY.search(body, 0, 4096)) is not None:
        if (array := _json_array(body, m.end() - 1)) is not None:
            found, checked = (m.end() - 1, *array), False
        array = None  # (as `found` below: `prompt` must be the array's only holder for `dismantle`)
    if found is None:
        return _validate(CompletionRequest, body)
    start, end, prompt = found
    found = None
    error: APIError | None = None
    try:
        req = _validate(CompletionRequest, body[:start] + b"[]" + body[end:])
        own = req.prompt == []  # else that array was not the body's own prompt (a nested or repeated key)
        if own and not checked:
            check_prompt_shape(prompt)
    except PydanticCustomError as e:
        error = from_validation_error([{"type": e.type, "loc": ("prompt",), "msg": e.message()}])
    except APIError as e:
        error = e
    else:
        if own:
            req.prompt = prompt
            return req
    stack = [prompt]
    del prompt
    dismantle(stack)  # its items freed a piece at a time: in one C call, 1M of them held the GIL ~40 ms
    if error is not None:
        raise error from None
    return _validate(CompletionRequest, body)


async def _parse(request: Request, model: type[BaseModel], limit: int, bigs: BigBodies,
                 context_length: int | None = None) -> tuple[Any, bool]:
    """The request parsed into `model`, and whether its body was big (more than BIG_BODY_BYTES).
    context_length: completions only, for the piecewise token-id parse of big bodies."""
    body = await _read_body(request, limit)
    if not body or body.isspace():
        raise APIError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    if len(body) <= BIG_BODY_BYTES:
        return _validate(model, body), False
    bigs.begin()
    held = request.scope[_BIG_BODY] = []  # freed piecewise when the request ends (BigBodies.end)
    if context_length is not None:
        req = await bigs.run(lambda: _validate_completion(body, context_length))
    else:
        req = await bigs.run(lambda: _validate(model, body))
    held.append(req)
    return req, True


class _EndBigBodies:
    """ASGI middleware: tells `BigBodies` when a request with a big body has ended (its response sent)."""

    def __init__(self, app: ASGIApp, bigs: BigBodies) -> None:
        self.app, self.bigs = app, bigs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            held = scope.pop(_BIG_BODY, None)
            if held is not None:
                await self.bigs.end(held)


class _CountRequests:
    """ASGI middleware: counts responses by route and status code (k3rt_requests_total)."""

    def __init__(self, app: ASGIApp, ctx: ServerContext, routes: set[str]) -> None:
        self.app, self.ctx, self.routes = app, ctx, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.routes else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.ctx.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _native_router(ctx: ServerContext, budget: PromptBudget, bigs: BigBodies, check_api_key: Any) -> APIRouter:
    """The routes outside /v1: the tokenizer (vLLM's) and SGLang's native API."""
    cfg = ctx.config
    router = APIRouter(dependencies=[Depends(check_api_key)])

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        req, _ = await _parse(request, TokenizeRequest, cfg.max_body_bytes, bigs)
        return json_response(await tokenize(ctx, req, budget))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        req, _ = await _parse(request, DetokenizeRequest, cfg.max_body_bytes, bigs)
        return json_response(detokenize(ctx, req))

    @router.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        return json_response(tokenizer_info(ctx))

    @router.post("/generate")
    async def generate_route(request: Request) -> Response:
        req, _ = await _parse(request, native.NativeGenerateRequest, cfg.max_body_bytes, bigs)
        return await native.generate(ctx, req, request, budget)

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info_route() -> Response:
        return json_response(native.model_info(ctx))

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def server_info_route() -> Response:
        return json_response(native.server_info(ctx))

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache_route() -> Response:
        await ctx.gateway.flush_cache()
        return Response("Cache flushed.\n", media_type="text/plain")

    @router.get("/health_generate")
    async def health_generate_route() -> Response:
        return await native.health_generate(ctx)

    @router.post("/concate_and_append_request")
    async def concate_and_append_route(request: Request) -> Response:
        req, _ = await _parse(request, native.ConcatAppendRequest, cfg.max_body_bytes, bigs)
        return json_response(native.concate_and_append(req))

    return router


def create_app(ctx: ServerContext) -> FastAPI:
    for name in FIRST_USE_IMPORTS:
        importlib.import_module(name)
    cfg = ctx.config
    budget = PromptBudget.of(ctx.gateway.tokenizer, ctx.gateway.context_length)
    bigs = BigBodies()
    app = FastAPI(title="k3rt", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx

    keys = [k.encode() for k in cfg.api_keys]

    async def check_api_key(request: Request) -> None:
        """401 without one of the keys; the request's cache namespace (request.state.tenant) from its key."""
        request.state.tenant = None
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode()
        # every key compared (in constant time each): which one matched, or none, takes the same time
        match = [hmac.compare_digest(given, k) for k in keys]
        if scheme.lower() != "bearer" or not any(match):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        request.state.tenant = cfg.tenant(cfg.api_keys[match.index(True)])

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> Response:
        gw = ctx.gateway
        if not ctx.ready:
            why = "draining" if gw.draining else ("dead" if gw.dead else "starting")
            return json_response({"status": why}, status=503)
        problem = ctx.health.problem()
        return json_response(problem, status=503) if problem else json_response({"status": "ok"})

    @app.get("/metrics", dependencies=[] if cfg.metrics_public else [Depends(check_api_key)])
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "k3rt",
                "max_model_len": ctx.gateway.context_length}

    @v1.get("/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        ctx.check_model(model_id)
        return json_response(model_card())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req, big = await _parse(request, ChatCompletionRequest, cfg.max_body_bytes, bigs)
        return await chat_completion(ctx, req, request, budget, bigs if big else None)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req, big = await _parse(request, CompletionRequest, cfg.max_body_bytes, bigs, ctx.gateway.context_length)
        return await completion(ctx, req, request, budget, bigs if big else None)

    @v1.get("/k3rt/stats")
    async def stats() -> Response:
        return json_response({"stats": ctx.gateway.stats, "info": ctx.gateway.client.info,
                              "ready": ctx.ready})

    @v1.post("/k3rt/flush_cache")
    async def flush_cache() -> Response:
        await ctx.gateway.flush_cache()
        return json_response({"flushed": True})

    app.include_router(v1)
    app.include_router(_native_router(ctx, budget, bigs, check_api_key))

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on "
                   f"{request.url.path}"}.get(e.status_code, str(e.detail))
        return APIError(e.status_code, message, code="not_found" if e.status_code == 404 else None,
                        headers=dict(e.headers or {})).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").response()

    app.add_middleware(_EndBigBodies, bigs=bigs)
    app.add_middleware(_CountRequests, ctx=ctx, routes=ROUTES)
    return app
