"""litellm against a real `k3rt serve` through its OpenAI-compatible provider (`openai/<model>` with
`api_base`): completion, streaming with usage, acompletion (whole and streamed), a forced tool call,
text_completion (/v1/completions) and token counting.

Kept local: LITELLM_LOCAL_MODEL_COST_MAP=True makes litellm read its bundled model-cost map instead of
fetching one at import; its token counter uses the tiktoken files litellm ships (it points TIKTOKEN_CACHE_DIR
at them when imported), so nothing is downloaded. The model is a random-weight tiny one: the checks are on
the protocol and the constraints."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.compat.conftest import MODEL_NAME

# litellm's own pydantic models warn on import and on every response (pydantic 2.11+ deprecations)
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                   "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def litellm(compat_server):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        return pytest.importorskip("litellm", reason="litellm is in the test extra (`make install`)")


@pytest.fixture(scope="module")
def kw(compat_server) -> dict:
    return {"model": "openai/" + MODEL_NAME, "api_base": compat_server.url + "/v1", "api_key": "unused",
            "temperature": 0, "max_tokens": 8, "timeout": 60, "num_retries": 0}


def test_completion_and_stream(litellm, kw):
    r = litellm.completion(messages=MESSAGES, **kw)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0

    chunks = list(litellm.completion(messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # greedy: the same
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 8


def test_acompletion(litellm, kw):
    async def run() -> tuple[str, str]:
        whole = await litellm.acompletion(messages=MESSAGES, **kw)
        stream = await litellm.acompletion(messages=MESSAGES, stream=True, **kw)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole and streamed == whole


def test_forced_tool_call(litellm, kw):
    r = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                           **{**kw, "max_tokens": 32})
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    # the arguments are decoded under the tool's schema: exactly its one property, one of its values
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Tokyo"})


def test_text_completion_and_token_counter(litellm, kw):
    r = litellm.text_completion(prompt="def add(a, b):", **kw)
    assert r.choices[0].text and r.usage.completion_tokens == 8
    n = litellm.token_counter(model=kw["model"], messages=[{"role": "user", "content": "Hi there"}])
    assert isinstance(n, int) and n > 0
