"""An adversarial fuzzer over the HTTP API of a real `k3rt serve` (issue 19): 2,000 hypothesis-generated
bodies for /v1/completions, /v1/chat/completions, SGLang's /generate and /tokenize, /detokenize, from nearly valid requests with one field made wrong to
arbitrary JSON and non-JSON bytes. Every answer must be a 2xx or a 4xx carrying OpenAI's error object (never a
5xx, never a hang), the server must stay up, and /health must keep answering. Derandomized: the same 2,000
bodies every run, so a failure reproduces."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, log_dir, serving, tiny_model  # noqa: F401

EXAMPLES = 2000

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=40))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                        max_leaves=12)

# fields a client sends, each with a value that is sometimes right and often not
FIELD_VALUES = {
    "model": st.one_of(st.just(MODEL_NAME), anything),
    "max_tokens": st.one_of(st.integers(min_value=1, max_value=3), anything),
    "temperature": st.one_of(st.floats(min_value=0, max_value=2), anything),
    "top_p": st.one_of(st.floats(min_value=0, max_value=1), anything),
    "top_k": anything,
    "n": st.one_of(st.integers(min_value=-2, max_value=200), anything),
    "stop": st.one_of(st.lists(st.text(max_size=5), max_size=5), anything),
    "seed": anything,
    "logprobs": anything,
    "stream": st.one_of(st.booleans(), anything),
    "regex": st.one_of(st.text(max_size=20), anything),
    "choice": st.one_of(st.lists(st.text(max_size=8), max_size=4), anything),
    "response_format": st.one_of(st.just({"type": "json_object"}), anything),
    "logit_bias": anything,
    "frequency_penalty": anything,
    "presence_penalty": anything,
    "ignore_eos": anything,
    "tools": anything,
    "tool_choice": anything,
}


def request_body(prompt_field: str, prompt):
    return st.fixed_dictionaries({prompt_field: prompt}, optional=FIELD_VALUES).map(
        lambda d: d | {"max_tokens": d["max_tokens"]} if isinstance(d.get("max_tokens"), int) and
        0 < d["max_tokens"] <= 3 else d | {"max_tokens": 2} if "max_tokens" not in d else d)


completion_bodies = request_body("prompt", st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 300_000),
                                                                                       max_size=20), anything))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.one_of(st.text(max_size=60), anything)}),
                    max_size=4)
chat_bodies = request_body("messages", st.one_of(messages, anything))
# SGLang's native /generate and the tokenizer routes
native_sampling = st.one_of(st.fixed_dictionaries({"max_new_tokens": st.one_of(st.integers(0, 3), anything)}, optional={
    k: anything for k in ("temperature", "top_k", "top_p", "n", "stop", "regex", "json_schema", "ebnf", "logit_bias",
                          "min_new_tokens", "sampling_seed", "stop_token_ids", "ignore_eos", "bogus")}), anything)
native_bodies = st.fixed_dictionaries({}, optional={
    "text": st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3), anything),
    "input_ids": st.one_of(st.lists(st.integers(-5, 600), max_size=8), anything),
    "sampling_params": st.one_of(native_sampling, st.lists(native_sampling, max_size=3)),
    "return_logprob": anything, "logprob_start_len": anything, "top_logprobs_num": anything,
    "return_text_in_logprobs": anything, "stream": st.one_of(st.booleans(), anything), "image_data": anything})
tokenizer_bodies = st.fixed_dictionaries({}, optional={"prompt": st.one_of(st.text(max_size=40), anything),
                                                       "tokens": st.one_of(st.lists(st.integers(-5, 600)), anything),
                                                       "messages": st.one_of(messages, anything),
                                                       "add_special_tokens": anything})
bodies = st.one_of(
    st.tuples(st.just("/v1/completions"), completion_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/generate"), native_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(["/tokenize", "/detokenize"]), tokenizer_bodies.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"]),
              st.one_of(st.binary(max_size=200), anything.map(lambda v: json.dumps(v).encode()))),
)


@pytest.fixture(scope="module")
def srv(tiny_model, log_dir):  # noqa: F811
    with serving(tiny_model, log_dir, "--cache-pages", "512") as s:
        yield s


@pytest.mark.timeout(900)
def test_http_fuzz_never_5xx_never_dies(srv):
    client = httpx.Client(base_url=srv.url, timeout=30)
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def one(case):
        path, data = case
        r = client.post(path, content=data, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, data[:300], r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert "error" in r.json() and r.json()["error"]["message"], r.text[:300]

    one()
    client.close()
    assert sum(seen.values()) >= EXAMPLES and any(200 <= k < 300 for k in seen), seen
    assert srv.proc.poll() is None
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
