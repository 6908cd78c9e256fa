"""The OpenAI-compatible API of a real `k3rt serve`, driven with the official `openai` client.

Outputs of the random tiny model are noise, so tests assert structure, counts and equalities between
runs (greedy is deterministic): streaming == non-streaming, server == offline engine, stop strings cut
exactly where the unstopped text has them, constrained outputs validate.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME

GREEDY = {"temperature": 0.0}


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}], **kw)


def test_health_models_and_readiness(server, client) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_chat_non_streaming(client) -> None:
    r = chat(client, "Hello, who are you?", max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.object == "chat.completion" and r.model == MODEL_NAME and r.id.startswith("chatcmpl-")
    (c,) = r.choices
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 10  # the chat template's turns
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_equals_non_streaming(client) -> None:
    kw = dict(max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    whole = chat(client, "Tell me a story.", **kw)
    chunks = list(chat(client, "Tell me a story.", stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(client) -> None:
    kw = dict(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=7, extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 7
    stream = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    echo = client.completions.create(echo=True, **kw)
    assert echo.choices[0].text == "def add(a, b):" + whole.choices[0].text


def test_n2_chat_and_completions(client) -> None:
    r = chat(client, "Pick a number.", n=2, max_tokens=5, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 10
    again = chat(client, "Pick a number.", n=2, max_tokens=5, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Once upon", n=2, max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True}, **GREEDY))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1]  # greedy: both choices are the same text


def test_stop_string_across_token_boundary(client, tokenizer) -> None:
    kw = dict(model=MODEL_NAME, prompt="The scheduler waits; when a request", max_tokens=16,
              extra_body={"ignore_eos": True, "return_token_ids": True}, **GREEDY)
    full = client.completions.create(**kw).choices[0]
    ids = full.model_extra["token_ids"]
    pieces = [tokenizer.token_bytes(t).decode("utf-8", errors="strict") if _utf8(tokenizer, t) else None for t in ids]
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(2, len(ids) - 2)
             if pieces[i] and pieces[i + 1] and pieces[i].strip() and pieces[i + 1].strip())
    stop = pieces[k][-1] + pieces[k + 1][:2]
    text = full.text
    assert stop in text
    expected = text[: text.find(stop)]
    r = client.completions.create(**kw, stop=[stop, "\x00never"]).choices[0]
    assert r.finish_reason == "stop" and r.text == expected
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def _utf8(tokenizer, t: int) -> bool:
    try:
        tokenizer.token_bytes(t).decode("utf-8")
        return t not in tokenizer.special_token_ids
    except UnicodeDecodeError:
        return False


def test_logprobs(client) -> None:
    r = chat(client, "Count to three.", max_tokens=5, logprobs=True, top_logprobs=3,
             extra_body={"ignore_eos": True}, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    c = client.completions.create(model=MODEL_NAME, prompt="1, 2,", max_tokens=4, logprobs=2,
                                  extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    assert len(c.logprobs.tokens) == 4 and len(c.logprobs.token_logprobs) == 4
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs)
    streamed = list(chat(client, "Count to three.", max_tokens=5, logprobs=True, top_logprobs=3, stream=True,
                         extra_body={"ignore_eos": True}, **GREEDY))
    lp = [e.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert lp == pytest.approx([e.logprob for e in content], abs=1e-6)


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


def test_json_schema_output_validates(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True}}
    r = chat(client, "Weather as JSON.", max_tokens=64, response_format=fmt, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER_SCHEMA)
    chunks = list(chat(client, "Weather as JSON.", max_tokens=64, response_format=fmt, stream=True, temperature=1.0,
                       seed=3))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)),
                        WEATHER_SCHEMA)
    obj = chat(client, "Any JSON object.", max_tokens=12, response_format={"type": "json_object"}, **GREEDY)
    assert obj.choices[0].message.content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
               "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": CITY_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]


def test_forced_tool_call_arguments_validate(client) -> None:
    r = chat(client, "What's the weather in Paris?", max_tokens=64, tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id == "functions.get_weather:0"
    jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
    # streamed: the call's head first, then argument fragments
    chunks = list(chat(client, "What's the weather in Paris?", max_tokens=64, tools=TOOLS, stream=True,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id == "functions.get_weather:0"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # "required": at least one call of a declared function, each validating against its schema
    req = chat(client, "Do something.", max_tokens=64, tools=TOOLS, tool_choice="required",
               parallel_tool_calls=False, **GREEDY)
    assert req.choices[0].finish_reason == "tool_calls"
    (call,) = req.choices[0].message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # a conversation that already holds a call numbers the next one after it
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "functions.get_time:0", "type": "function",
                    "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}]},
               {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "12:00"}]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=1, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    assert r2.choices[0].message.tool_calls[0].id == "functions.get_weather:1"


def test_auto_tool_choice_answers(client) -> None:
    r = chat(client, "Hi", max_tokens=6, tools=TOOLS, tool_choice="auto", **GREEDY)
    c = r.choices[0]
    assert c.finish_reason in ("length", "stop", "tool_calls")
    assert c.message.content is not None or c.message.tool_calls


def test_regex_and_choice(client) -> None:
    pattern = r"[a-z]{3}-[0-9]{2,4}"
    r = chat(client, "An id please.", max_tokens=16, extra_body={"regex": pattern}, **GREEDY)
    assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content
    c = client.completions.create(model=MODEL_NAME, prompt="yes or no?", max_tokens=8, temperature=1.0, seed=5,
                                  extra_body={"choice": ["yes", "no", "maybe so"]})
    assert c.choices[0].text in ("yes", "no", "maybe so")


def test_greedy_matches_offline_engine(client, tiny_model) -> None:
    from k3rt.backend.engine import Engine
    from k3rt.config import EngineConfig
    from k3rt.sampling_params import SamplingParams

    prompt = "An inference engine schedules requests, runs the model and"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    served_ids = r.choices[0].model_extra["token_ids"]
    prompt_ids = r.model_extra["prompt_token_ids"]
    engine = Engine(EngineConfig(model=str(tiny_model)))
    (offline,) = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert served_ids == offline.output_ids


def test_cached_prompt_tokens_reported(client) -> None:
    long_prompt = "The radix cache keeps KDA snapshots of shared prefixes. " * 20  # well past one 64-token grid
    first = chat(client, long_prompt, max_tokens=2, **GREEDY)
    second = chat(client, long_prompt, max_tokens=2, **GREEDY)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_n_choices_compute_the_prompt_once(server, client) -> None:
    prompt = "Four answers to one long question about prefix caching and state snapshots. " * 12
    before = server.stats()["stats"]["computed_tokens"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, n=4, max_tokens=2, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True, "cache_salt": "n-choices"})
    computed = server.stats()["stats"]["computed_tokens"] - before
    assert len(r.choices) == 4 and r.usage.completion_tokens == 8
    assert computed < 2 * r.usage.prompt_tokens, (computed, r.usage)


def test_metrics_endpoint(server, client) -> None:
    chat(client, "metrics please", max_tokens=3, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    for name in ("k3rt_requests_total", "k3rt_prompt_tokens_total", "k3rt_generation_tokens_total",
                 "k3rt_cached_prompt_tokens_total", "k3rt_time_to_first_token_seconds_bucket",
                 "k3rt_inter_token_latency_seconds_bucket", "k3rt_num_requests_running", "k3rt_num_requests_waiting",
                 "k3rt_cache_pages_used", "k3rt_cache_snapshots", "k3rt_cache_hit_rate"):
        assert name in text, name
    assert re.search(r'k3rt_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text)
    ttft = re.search(r"k3rt_time_to_first_token_seconds_count (\S+)", text)
    assert ttft and float(ttft.group(1)) >= 1
