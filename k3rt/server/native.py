"""SGLang's native HTTP API, so that an unmodified SGLang frontend (`sgl.RuntimeEndpoint(url)`) and other
SGLang clients run against `k3rt serve`:

  POST /generate          text or input_ids (one or a batch), sampling_params, return_logprob,
                          logprob_start_len, top_logprobs_num, return_text_in_logprobs, stream
  GET  /get_model_info    (and /model_info) the model path, served name, is_generation
  GET  /get_server_info   (and /server_info) the serving configuration and the engine's stats
  POST /flush_cache       (GET too) drop every unlocked prefix-cache entry
  GET  /health_generate   200 once a one-token generation comes back, 503 otherwise
  POST /concate_and_append_request   fork(...).join(mode="concate_and_append"), see below

Wire format, as SGLang's http_server / io_struct define it: a response is `{"text", "output_ids",
"meta_info"}` for one prompt with n = 1, else a list of them (prompt-major, n per prompt). `meta_info` has
id, finish_reason ({"type": "length", "length": N} | {"type": "stop", "matched": id or null} |
{"type": "abort", "message"}), prompt_tokens, completion_tokens, cached_tokens, e2e_latency and, with
return_logprob, input_token_logprobs / output_token_logprobs as [logprob, token_id, text-or-null] entries
(input ones from logprob_start_len on; the first prompt token's logprob is null), output_token_logprobs_length
and, with top_logprobs_num, input_top_logprobs / output_top_logprobs. `max_new_tokens: 0` computes (and caches,
and scores) the prompt without generating, which is how SGLang's `select` and `fork` work. A stream is SSE
`data: {...}` events, each with the choice's cumulative text and its `index`, then `data: [DONE]`.

`concate_and_append_request` is how SGLang's frontend splices its fork children's KV caches into the parent
(global_config.enable_parallel_encoding, on by default). A KDA layer's state is a recurrence over every
token, so k3rt cannot splice it; nothing needs splicing either, because the frontend has already appended
the children's text to the parent's and sends that whole text with its next /generate, whose shared prefix
the prefix cache serves. So the route checks the body's shape and answers success; the join is by text,
as SGLang's own text mode does it (docs/sglang-compat.md).

Constraints: `regex`, `json_schema` (a JSON text) and `ebnf` (GBNF-style, converted to a Lark grammar by
llguidance; refused with `--grammar-backend outlines`). Sampling parameters k3rt does not implement
(stop_regex, structural_tag, custom_params, skip_special_tokens false, no_stop_trim) are refused (400
naming the field), never dropped.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from pydantic import ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from k3rt.sampling_params import MAX_LOGPROBS, SamplingParams
from k3rt.server.errors import APIError, bad_request
from k3rt.server.generation import (
    MIN_TEMPERATURE, SSE_DONE, Choice, ServerContext, check_vocab, delta_error, gateway_error, json_response,
    namespaced_salt, new_id, report_ignored, sse, token_text, until_done_or_gone, validate_grammar,
)
from k3rt.server.limits import PromptBudget
from k3rt.server.schemas import MAX_N, MAX_STOP, _List, _Strict, logit_bias

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" (its frontend sends -1 or this)
MAX_PROMPTS = 64
# GenerateReqInput fields that change the output and that k3rt does not serve
_UNSERVED = frozenset({"image_data", "video_data", "audio_data", "input_embeds", "lora_path", "token_ids_logprob",
                       "return_hidden_states", "custom_logit_processor", "session_params", "return_routed_experts",
                       "bootstrap_host", "data_parallel_rank"})


class NativeSamplingParams(_Strict):
    """SGLang's sampling_params; an unknown key is a 400, as SGLang's own SamplingParams(**d) fails."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int | None = 0
    n: int | None = 1
    stop: str | _List[str] | None = None
    stop_token_ids: _List[int] | None = None
    stop_regex: str | _List[str] | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    ignore_eos: bool | None = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True  # only shapes special tokens' text, which is skipped
    no_stop_trim: bool | None = False
    stream_interval: int | None = None  # delivery granularity only; k3rt streams every update
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None


class NativeGenerateRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    text: str | _List[str] | None = None
    input_ids: _List[int] | _List[_List[int]] | None = None
    # dicts, validated one by one (NativeSamplingParams) so that an error names the field inside
    sampling_params: dict[str, Any] | _List[dict[str, Any]] | None = None
    rid: str | _List[str] | None = None  # accepted; k3rt names its requests itself
    return_logprob: bool | _List[bool] | None = None
    logprob_start_len: int | _List[int] | None = None
    top_logprobs_num: int | _List[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    modalities: _List[str] | None = None


MAX_FORK = 256  # children in one concate_and_append join


class ConcatAppendRequest(_Strict):
    """What SGLang's RuntimeEndpoint.concatenate_and_append posts: the fork children's request ids and the
    parent's."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    src_rids: _List[str]
    dst_rid: str


def concate_and_append(req: ConcatAppendRequest) -> dict[str, Any]:
    if not 1 <= len(req.src_rids) <= MAX_FORK:
        raise bad_request("src_rids", f"must name 1 to {MAX_FORK} requests, got {len(req.src_rids)}")
    return {"success": True, "message": "joined by text: the children's text is in the parent's next prompt"}


def _per_prompt(value: Any, num: int, param: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * num
    if len(value) != num:
        raise bad_request(param, f"has {len(value)} entries for {num} prompts")
    return value


def _params(raw: dict[str, Any] | None, where: str, vocab_size: int, logprobs: int | None, grammar_backend: str
            ) -> tuple[SamplingParams, int, int, tuple[str, ...], Any]:
    """-> (SamplingParams, max_new_tokens as asked (0 allowed), n, stop strings, (field, GrammarSpec) or None).
    An `ebnf` grammar (SGLang's GBNF-style EBNF, `root ::= ...`) is converted to a Lark grammar by llguidance;
    the outlines backend has no grammars, so there it is refused."""
    from k3rt.backend.grammar import GrammarError, GrammarSpec

    try:
        sp = NativeSamplingParams.model_validate(raw or {})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("list[", "str", "int", "float")))
        raise bad_request(f"{where}.{field}" if field else where, err["msg"]) from None
    refuse = [("stop_regex", bool(sp.stop_regex)),
              ("ebnf", sp.ebnf is not None and grammar_backend != "llguidance"),
              ("structural_tag", sp.structural_tag is not None),
              ("custom_params", bool(sp.custom_params)), ("skip_special_tokens", sp.skip_special_tokens is False),
              ("no_stop_trim", bool(sp.no_stop_trim))]
    for name, bad in refuse:
        if bad:
            raise bad_request(f"{where}.{name}", "is not supported by k3rt (refused rather than ignored)",
                              code="unsupported_field")
    max_new = DEFAULT_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens
    if max_new < 0:
        raise bad_request(f"{where}.max_new_tokens", f"must be >= 0, got {max_new}")
    n = 1 if sp.n is None else sp.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"{where}.n", f"must be in [1, {MAX_N}], got {n}")
    stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
    if len(stop) > MAX_STOP or not all(stop):
        raise bad_request(f"{where}.stop", f"at most {MAX_STOP} non-empty stop strings")
    top_k = sp.top_k if sp.top_k is not None else -1
    if top_k == -1 or top_k >= TOP_K_ALL:
        top_k = 0
    elif top_k < 1:
        raise bad_request(f"{where}.top_k", f"must be -1 (all) or >= 1, got {top_k}")
    temperature = 1.0 if sp.temperature is None else sp.temperature
    if not 0.0 <= temperature <= 100.0:
        raise bad_request(f"{where}.temperature", f"must be in [0, 100], got {temperature}")
    bias = logit_bias(sp.logit_bias, vocab_size, f"{where}.logit_bias")
    try:
        params = SamplingParams(
            temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
            top_p=1.0 if sp.top_p is None else sp.top_p, top_k=top_k, min_p=sp.min_p or 0.0,
            repetition_penalty=1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
            frequency_penalty=sp.frequency_penalty or 0.0, presence_penalty=sp.presence_penalty or 0.0,
            logprobs=logprobs, seed=sp.sampling_seed, max_tokens=max(max_new, 1),
            min_tokens=0 if max_new == 0 else sp.min_new_tokens or 0,
            stop_token_ids=tuple(sp.stop_token_ids or ()), ignore_eos=bool(sp.ignore_eos), logit_bias=bias)
    except ValueError as e:  # SamplingParams names the field first (in its own words)
        field, why = str(e).split(":", 1)
        field = {"seed": "sampling_seed", "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}.get(
            field, field)
        raise bad_request(f"{where}.{field}", why.strip()) from None
    grammar = None
    given = [name for name in ("regex", "json_schema", "ebnf") if getattr(sp, name) is not None]
    if len(given) > 1:
        raise bad_request(f"{where}.{given[1]}", f"only one output constraint per request; {given[0]} is already set")
    try:
        if sp.ebnf is not None:
            grammar = ("ebnf", GrammarSpec.lark(_ebnf_to_lark(sp.ebnf, f"{where}.ebnf")))
        elif sp.regex is not None:
            grammar = ("regex", GrammarSpec.regex(sp.regex))
        elif sp.json_schema is not None:
            try:
                schema = orjson.loads(sp.json_schema)
            except orjson.JSONDecodeError as e:
                raise bad_request(f"{where}.json_schema", f"is not JSON: {e}", code="invalid_grammar") from None
            if not isinstance(schema, dict):
                raise bad_request(f"{where}.json_schema", "must be a JSON object (a schema)", code="invalid_grammar")
            grammar = ("json_schema", GrammarSpec.json_schema(schema))
    except GrammarError as e:
        raise bad_request(f"{where}.{given[0]}", str(e), code="invalid_grammar") from None
    return params, max_new, n, stop, grammar


def _ebnf_to_lark(ebnf: str, param: str) -> str:
    from llguidance.gbnf_to_lark import any_to_lark

    if not ebnf.strip():
        raise bad_request(param, "must be a non-empty grammar", code="invalid_grammar")
    try:
        return any_to_lark(ebnf)
    except Exception as e:  # the converter raises plain exceptions for syntax errors
        raise bad_request(param, f"not a valid EBNF grammar: {e}", code="invalid_grammar") from None


class _Group:
    """Prompts that share every setting: one gateway Job."""

    def __init__(self, job: Any, max_new: int, start: int | None, top: int) -> None:
        self.job, self.max_new, self.logprob_start, self.top = job, max_new, start, top
        self.n = job.n
        self.prompts: list[list[int]] = job.prompts  # filled by the caller, with `indices`
        self.indices: list[int] = []  # each prompt's position in the request
        self.choices: list[Choice] = []  # made by `start`, once every prompt is in

    def start(self, gw: Any) -> Any:
        self.choices = [Choice() for _ in range(len(self.prompts) * self.n)]
        try:
            return gw.generate(self.job)
        except Exception as e:
            raise gateway_error(e) from None


async def generate(ctx: ServerContext, req: NativeGenerateRequest, request: Request, budget: PromptBudget
                   ) -> Response:
    from k3rt.backend.gateway import Job

    extra = sorted(req.model_extra or ())
    for name in extra:
        if name in _UNSERVED and (req.model_extra or {})[name] not in (None, False, [], {}):
            raise bad_request(name, "is not supported by k3rt (refused rather than ignored)", code="unsupported_field")
    gw = ctx.gateway
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("text", "send exactly one of text and input_ids")
    single = isinstance(req.text, str) or (req.input_ids is not None and bool(req.input_ids)
                                          and isinstance(req.input_ids[0], int))
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        if len(texts) > MAX_PROMPTS:
            raise bad_request("text", f"at most {MAX_PROMPTS} prompts per request, got {len(texts)}")
        for i, t in enumerate(texts):
            budget.check_text(t, "text" if single else f"text[{i}]")
        prompts = [await gw.encode_prompt(t) for t in texts]
        param = "text"
    else:
        prompts = [req.input_ids] if single else list(req.input_ids or [])
        if len(prompts) > MAX_PROMPTS:
            raise bad_request("input_ids", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        param = "input_ids"
    if not prompts:
        raise bad_request(param, "must not be an empty list")
    check_vocab(prompts, gw.vocab_size, param)
    longest = max(len(p) for p in prompts)
    if longest >= gw.context_length:
        raise APIError(413, f"{param}: a prompt has {longest} tokens; the context length is {gw.context_length}",
                       param=param, code="context_length_exceeded")
    num = len(prompts)
    sps = _per_prompt(req.sampling_params, num, "sampling_params")
    want = _per_prompt(req.return_logprob, num, "return_logprob")
    starts = _per_prompt(req.logprob_start_len, num, "logprob_start_len")
    tops = _per_prompt(req.top_logprobs_num, num, "top_logprobs_num")
    groups: dict[Any, _Group] = {}
    for i, prompt in enumerate(prompts):
        where = "sampling_params" if not isinstance(req.sampling_params, list) else f"sampling_params[{i}]"
        top = tops[i] or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad_request("top_logprobs_num", f"must be in [0, {MAX_LOGPROBS}], got {top}")
        start = starts[i] if want[i] and starts[i] is not None and starts[i] >= 0 else None
        if start is not None and start > len(prompt):
            raise bad_request("logprob_start_len", f"{start} is past the end of prompt {i} ({len(prompt)} tokens)")
        params, max_new, n, stop, grammar = _params(sps[i], where, gw.vocab_size, top if want[i] else None,
                                                    ctx.config.engine.grammar_backend)
        if len(prompt) + params.max_tokens > gw.context_length:
            raise bad_request(f"{where}.max_new_tokens", f"{max_new} new tokens + {len(prompt)} prompt tokens exceed "
                              f"the context length {gw.context_length}", code="context_length_exceeded")
        spec = None if grammar is None else await validate_grammar(ctx, f"{where}.{grammar[0]}", grammar[1])
        key = (params, max_new, n, stop, orjson.dumps(spec), start)
        if key not in groups:
            score_from = None if start is None else max(start, 1)
            job = Job([], params, n, stop, spec, namespaced_salt(request, None), prompt_logprobs_from=score_from,
                      drop_output=max_new == 0)
            groups[key] = _Group(job, max_new, start, top)
        groups[key].indices.append(i)
        groups[key].prompts.append(prompt)
    out = _Output(ctx, req, list(groups.values()))
    if req.stream:
        if len(groups) > 1:
            raise bad_request("stream", "a streamed batch needs the same settings for every prompt")
        g = next(iter(groups.values()))
        stream = g.start(gw)
        return report_ignored(StreamingResponse(out.stream(g, stream), media_type="text/event-stream",
                                                headers={"Cache-Control": "no-cache"}), extra, "generate")
    body = await out.run(request)
    return report_ignored(json_response(body[0] if single and len(body) == 1 else body), extra, "generate")


class _Output:
    def __init__(self, ctx: ServerContext, req: NativeGenerateRequest, groups: list[_Group]) -> None:
        self.ctx, self.req, self.groups = ctx, req, groups
        self.t0 = time.monotonic()
        self.rid = new_id("gen")
        self.eos = frozenset(ctx.gateway.eos_token_ids)

    def _entry(self, token_id: int, logprob: float | None) -> list[Any]:
        text = token_text(self.ctx, token_id)[0] if self.req.return_text_in_logprobs else None
        return [logprob, token_id, text]

    def _finish(self, g: _Group, c: Choice) -> dict[str, Any] | None:
        r = c.finish_reason
        if r is None:
            return None
        if r == "length":
            return {"type": "length", "length": g.max_new}
        if r == "stop":
            last = c.token_ids[-1] if c.token_ids else None
            stops = self.eos | frozenset(g.job.params.stop_token_ids)
            return {"type": "stop", "matched": last if last in stops else None}
        return {"type": "abort", "message": r}

    def _item(self, g: _Group, k: int, c: Choice, index: int) -> dict[str, Any]:
        """One choice as SGLang's response item; k: the choice's index within its group."""
        prompt = g.prompts[k // g.n]
        meta: dict[str, Any] = {
            "id": f"{self.rid}-{index}", "finish_reason": self._finish(g, c), "prompt_tokens": len(prompt),
            "completion_tokens": len(c.token_ids), "cached_tokens": c.cached_tokens,
            "e2e_latency": time.monotonic() - self.t0}
        if g.job.params.logprobs is not None:
            meta["output_token_logprobs"] = [self._entry(lp.token_id, lp.logprob) for lp in c.logprobs]
            meta["output_token_logprobs_length"] = len(c.logprobs)  # SGLang's tokenizer manager sends it too
            inputs, input_tops = [], []
            if g.logprob_start is not None:
                entries = c.prompt_logprobs or [None] * len(prompt)
                for pos in range(min(g.logprob_start, len(prompt)), len(prompt)):
                    e = entries[pos]
                    inputs.append(self._entry(prompt[pos], None if e is None else e.logprob))
                    input_tops.append(None if e is None else [self._entry(t, v) for t, v in e.top])
            meta["input_token_logprobs"] = inputs
            if g.top:
                meta["input_top_logprobs"] = input_tops
                meta["output_top_logprobs"] = [[self._entry(t, v) for t, v in lp.top] for lp in c.logprobs]
        return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta, "index": index}

    def _index(self, g: _Group, k: int) -> int:
        """The response position of group choice k: prompt-major over the request's prompts, n each."""
        return g.indices[k // g.n] * g.n + k % g.n

    async def run(self, request: Request) -> list[dict[str, Any]]:
        gw = self.ctx.gateway
        streams = []
        try:
            for g in self.groups:
                streams.append(g.start(gw))
        except APIError:
            for s in streams:
                s.close()
            raise

        async def consume(g: _Group, stream: Any) -> None:
            async for d in stream:
                if d.finish_reason == "error":
                    raise delta_error(d, self.ctx.shutdown_error)
                g.choices[d.index].add(d)

        consumer = asyncio.ensure_future(asyncio.gather(*(consume(g, s) for g, s in zip(self.groups, streams))))
        await until_done_or_gone(request, consumer, lambda: [s.close() for s in streams])
        items = [self._item(g, k, c, self._index(g, k)) for g in self.groups for k, c in enumerate(g.choices)]
        return sorted(items, key=lambda it: it["index"])

    async def stream(self, g: _Group, stream: Any):
        try:
            async for d in stream:
                if d.finish_reason == "error":
                    yield sse({"error": delta_error(d, self.ctx.shutdown_error).body()["error"]})
                    break
                c = g.choices[d.index]
                c.add(d)
                yield sse(self._item(g, d.index, c, self._index(g, d.index)))
            yield SSE_DONE
        finally:
            stream.close()


def model_info(ctx: ServerContext) -> dict[str, Any]:
    from k3rt.model_config import load_model_config

    cfg = ctx.config
    mc = load_model_config(cfg.engine.model)
    return {"model_path": str(cfg.engine.model), "served_model_name": cfg.model_name,
            "tokenizer_path": str(cfg.engine.model), "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": getattr(mc, "model_type", None), "max_model_len": ctx.gateway.context_length}


def server_info(ctx: ServerContext) -> dict[str, Any]:
    import k3rt

    cfg = ctx.config
    e = cfg.engine
    return {"version": getattr(k3rt, "__version__", None), "model_path": str(e.model),
            "served_model_name": cfg.model_name, "context_length": ctx.gateway.context_length,
            "device": e.device, "tp_size": e.tp, "max_running_requests": e.scheduler.max_running,
            "grammar_backend": e.grammar_backend, "internal_states": [ctx.gateway.stats]}


async def health_generate(ctx: ServerContext, timeout_s: float = 20.0) -> Response:
    """200 once a one-token greedy generation finishes (the engine runs), else 503."""
    from k3rt.backend.gateway import Job

    gw = ctx.gateway
    if not ctx.ready:
        return json_response({"status": "not ready"}, status=503)
    prompt = list(gw.tokenizer.sequence_prefix) or [0]
    try:
        stream = gw.generate(Job([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
    except Exception as e:
        return json_response({"status": f"{type(e).__name__}: {e}"}, status=503)

    async def first_end() -> str | None:
        async for d in stream:
            if d.finish_reason is not None:
                return d.error
        return "no output"

    try:
        error = await asyncio.wait_for(first_end(), timeout_s)
    except asyncio.TimeoutError:
        error = f"no token within {timeout_s:g} s"
    finally:
        stream.close()
    return json_response({"status": "ok"}) if error is None else json_response({"status": error}, status=503)
