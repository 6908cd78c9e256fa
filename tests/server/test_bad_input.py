"""Malformed and out-of-range requests get a 4xx naming the problem, while a good streaming request runs
to its correct end and the server stays up."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 2, **fields}


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}


# (id, endpoint, body, expected status, text the error message must contain)
BAD = [
    ("truncated-json", CHAT, b'{"model": "tiny-k3", "messages": [', 400, "not valid JSON"),
    ("empty-body", CHAT, b"", 400, "empty"),
    ("body-is-array", CHAT, b"[1, 2]", 400, "JSON object"),
    ("body-is-string", CHAT, b'"hello"', 400, "JSON object"),
    ("nan-literal", CHAT, b'{"model": "tiny-k3", "messages": [], "temperature": NaN}', 400, "temperature"),
    ("missing-messages", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("missing-model", CHAT, {"messages": MSGS}, 400, "model"),
    ("messages-not-list", CHAT, _chat(messages="hi"), 400, "messages"),
    ("messages-empty", CHAT, _chat(messages=[]), 400, "messages"),
    ("message-without-role", CHAT, _chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("unknown-role", CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("content-wrong-type", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("image-part", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0]"),
    ("tool-without-id", CHAT, _chat(messages=[{"role": "tool", "content": "x"}]), 400, "tool_call_id"),
    ("unknown-model", CHAT, _chat(model="gpt-9"), 404, "model"),
    ("model-wrong-type", CHAT, _chat(model=3), 400, "model"),
    ("n-zero", CHAT, _chat(n=0), 400, "n:"),
    ("n-huge", CHAT, _chat(n=1000), 400, "n:"),
    ("n-string", CHAT, _chat(n="2"), 400, "n:"),
    ("max-tokens-zero", CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", COMPLETIONS, _completion(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-string", CHAT, _chat(max_tokens="ten"), 400, "max_tokens"),
    ("max-tokens-past-context", CHAT, _chat(max_tokens=10**6), 400, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("temperature-negative", CHAT, _chat(temperature=-1), 400, "temperature"),
    ("temperature-too-high", CHAT, _chat(temperature=5), 400, "temperature"),
    ("temperature-string", CHAT, _chat(temperature="hot"), 400, "temperature"),
    ("top-p-zero", CHAT, _chat(top_p=0), 400, "top_p"),
    ("top-p-too-high", COMPLETIONS, _completion(top_p=1.5), 400, "top_p"),
    ("presence-penalty", CHAT, _chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty", CHAT, _chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("logprobs-string", CHAT, _chat(logprobs="yes"), 400, "logprobs"),
    ("top-logprobs-too-many", CHAT, _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    ("completion-logprobs-too-many", COMPLETIONS, _completion(logprobs=99), 400, "logprobs"),
    ("stop-wrong-type", CHAT, _chat(stop=123), 400, "stop"),
    ("stop-empty-string", CHAT, _chat(stop=[""]), 400, "stop"),
    ("stop-too-many", CHAT, _chat(stop=[f"s{i}" for i in range(40)]), 400, "stop"),
    ("seed-string", CHAT, _chat(seed="abc"), 400, "seed"),
    ("seed-negative", CHAT, _chat(seed=-1), 400, "seed"),
    ("stream-string", CHAT, _chat(stream="yes"), 400, "stream"),
    ("stream-options-without-stream", CHAT, _chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("response-format-type", CHAT, _chat(response_format={"type": "xml"}), 400, "response_format"),
    ("json-schema-missing", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema.schema"),
    ("json-schema-invalid", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), 400, "response_format"),
    ("regex-invalid", CHAT, _chat(regex="(("), 400, "regex"),
    ("regex-wrong-type", CHAT, _chat(regex=5), 400, "regex"),
    ("choice-empty", CHAT, _chat(choice=[]), 400, "choice"),
    ("two-constraints", CHAT, _chat(regex="a+", choice=["a"]), 400, "choice"),
    ("tools-wrong-shape", CHAT, _chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    ("tool-name-invalid", CHAT, _chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools[0].function.name"),
    ("tool-choice-unknown-function", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                 tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice"),
    ("tool-choice-required-without-tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    ("tool-choice-bogus", CHAT, _chat(tool_choice="sometimes"), 400, "tool_choice"),
    ("top-k-huge", CHAT, _chat(top_k=10**25), 400, "top_k"),
    ("stop-token-id-huge", CHAT, _chat(stop_token_ids=[10**25]), 400, "stop_token_ids"),
    ("schema-int-past-64-bits", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 10**25}}}), 400, "response_format"),
    ("repetition-penalty-tiny", CHAT, _chat(repetition_penalty=1e-300), 400, "repetition_penalty"),
    ("ignore-eos-wrong-type", CHAT, _chat(ignore_eos="x"), 400, "ignore_eos"),
    ("cache-salt-wrong-type", CHAT, _chat(cache_salt=5), 400, "cache_salt"),
    ("user-wrong-type", CHAT, _chat(user=5), 400, "user"),
    ("prompt-missing", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt"),
    ("prompt-empty-string", COMPLETIONS, _completion(prompt=""), 400, "prompt"),
    ("prompt-empty-list", COMPLETIONS, _completion(prompt=[]), 400, "prompt"),
    ("prompt-token-out-of-vocab", COMPLETIONS, _completion(prompt=[1, 2, 10**9]), 400, "prompt"),
    ("prompt-mixed-list", COMPLETIONS, _completion(prompt=[1, "a"]), 400, "prompt"),
    ("prompt-past-context", COMPLETIONS, _completion(prompt=[5] * 9000), 413, "prompt"),
    ("suffix", COMPLETIONS, _completion(suffix="x"), 400, "suffix"),
    ("best-of", COMPLETIONS, _completion(best_of=3), 400, "best_of"),
    ("logit-bias-not-a-token", COMPLETIONS, _completion(logit_bias={"²": 1}), 400, "logit_bias"),
    ("logit-bias-out-of-vocab", CHAT, _chat(logit_bias={"100000": 1}), 400, "logit_bias"),
    ("logit-bias-too-big", CHAT, _chat(logit_bias={"5": -100.5}), 400, "logit_bias"),
    ("logit-bias-not-a-number", COMPLETIONS, _completion(logit_bias={"5": "1"}), 400, "logit_bias"),
    ("logit-bias-too-many", COMPLETIONS, _completion(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    ("unserved-field", COMPLETIONS, _completion(use_beam_search=True), 400, "use_beam_search"),
    ("min-tokens-over-max", COMPLETIONS, _completion(min_tokens=5), 400, "min_tokens"),
    ("unserved-field-chat", CHAT, _chat(guided_regex="a+"), 400, "guided_regex"),
]


class GoodStream(threading.Thread):
    """A greedy streaming chat request consumed in the background."""

    def __init__(self, url: str, max_tokens: int = 24) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Write a long poem."}],
                     "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        self.text, self.finish, self.error = "", None, None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + CHAT, json={**self.body, "stream": True}, timeout=300) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    self.started.set()
                    for c in chunk["choices"]:
                        self.text += c["delta"].get("content") or ""
                        self.finish = c["finish_reason"] or self.finish
        except Exception as e:  # reported by check()
            self.error = e
        finally:
            self.started.set()

    def check(self) -> None:
        self.join(300)
        assert not self.is_alive() and self.error is None, self.error
        assert self.finish == "length"
        reference = httpx.post(self.url + CHAT, json=self.body, timeout=300).json()
        assert self.text == reference["choices"][0]["message"]["content"]


def _error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_bad_requests_get_4xx_naming_the_field(server) -> None:
    assert len({case[0] for case in BAD}) == len(BAD) >= 30
    good = GoodStream(server.url)
    good.start()
    good.started.wait(120)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        failures = []
        for name, path, body, status, needle in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = http.post(path, headers={"content-type": "application/json"}, **kw)
            if r.status_code != status:
                failures.append(f"{name}: status {r.status_code} != {status}: {r.text[:300]}")
                continue
            err = _error_of(r)
            if needle not in err["message"]:
                failures.append(f"{name}: {needle!r} not in {err['message']!r}")
        assert not failures, "\n".join(failures)
        assert http.get("/v1/nowhere").status_code == 404
        assert http.get(CHAT).status_code == 405
    good.check()
    assert httpx.get(server.url + "/health").status_code == 200


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)

MUTABLE = ["model", "messages", "temperature", "top_p", "stop", "seed", "logprobs", "top_logprobs",
           "presence_penalty", "frequency_penalty", "response_format", "tools", "tool_choice", "user", "regex",
           "choice", "cache_salt", "ignore_eos", "top_k", "min_p", "repetition_penalty", "stream_options"]


@st.composite
def _bodies(draw) -> tuple[str | None, bytes]:
    kind = draw(st.sampled_from(["value", "mutated", "bytes"]))
    if kind == "bytes":
        return None, draw(st.binary(max_size=64))
    if kind == "value":
        return None, json.dumps(draw(_json)).encode()
    field = draw(st.sampled_from(MUTABLE))
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 1, field: draw(_json)}
    return field, json.dumps(body).encode()


def test_random_bodies_never_hurt_the_server(server) -> None:
    good = GoodStream(server.url, max_tokens=32)
    good.start()
    good.started.wait(120)
    http = httpx.Client(base_url=server.url, timeout=120)

    @settings(max_examples=50, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_bodies())
    def one(case: tuple[str | None, bytes]) -> None:
        field, body = case
        r = http.post(CHAT, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, body, r.text[:300])
        if r.status_code != 200:
            err = _error_of(r)
            if field is not None:
                assert field in err["message"] or (err["param"] or "").startswith(field), (body, err)

    try:
        one()
    finally:
        http.close()
    good.check()
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/k3rt/stats", "/v1/models"])
def test_get_routes_answer(server, path: str) -> None:
    assert httpx.get(server.url + path).status_code == 200
