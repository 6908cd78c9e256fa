"""langchain-openai's ChatOpenAI against a real `k3rt serve`: invoke, stream (with usage), batch, bind_tools
(a named tool and "any", whole and streamed) and with_structured_output (json_schema and function_calling).

Token counting stays local: ChatOpenAI.get_num_tokens uses tiktoken's cl100k_base, which tiktoken downloads
on first use; `custom_get_token_ids` (a BaseLanguageModel field) hands counting to k3rt's /tokenize instead,
which is also the count the model sees. The model is a random-weight tiny one: the checks are on the protocol
and the constraints."""

from __future__ import annotations

from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.compat.conftest import MODEL_NAME

pytestmark = pytest.mark.timeout(120)


class Person(BaseModel):
    name: Literal["Ann", "Bob"]
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def chat(compat_server):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra (`make install`)")

    def make(**kw):
        kw = {"max_tokens": 12, "temperature": 0, **kw}
        return lc.ChatOpenAI(model=MODEL_NAME, base_url=compat_server.url + "/v1", api_key="unused", max_retries=0,
                             timeout=60, **kw)

    return make


@pytest.fixture(scope="module")
def weather_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        return "sunny"

    return get_weather


def test_invoke_stream_batch(chat):
    llm = chat(stream_usage=True)
    msg = llm.invoke("Hello")
    assert isinstance(msg.content, str) and msg.content
    assert msg.response_metadata["finish_reason"] == "length" and msg.response_metadata["model_name"] == MODEL_NAME
    assert msg.usage_metadata["output_tokens"] == 12 and msg.usage_metadata["input_tokens"] > 0

    chunks = list(llm.stream("Hello"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert whole.content == msg.content  # greedy: the same text, streamed
    assert whole.response_metadata["finish_reason"] == "length"
    assert whole.usage_metadata == msg.usage_metadata  # from the stream's include_usage chunk

    # concurrent requests: batched together, so greedy text may differ from the one-by-one run (without
    # --deterministic); the shape must not
    batch = llm.batch(["Hello", "Hi"])
    assert len(batch) == 2 and all(m.content and m.usage_metadata["output_tokens"] == 12 for m in batch)


def test_bind_tools(chat, weather_tool):
    named = chat(max_tokens=32).bind_tools([weather_tool], tool_choice="get_weather")
    msg = named.invoke("What is the weather in Paris?")
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Tokyo")
    assert call["id"].startswith("functions.get_weather:") and not msg.invalid_tool_calls

    # "any" is OpenAI's "required": one call, as a JSON array constrained to the tools' schemas
    any_tool = chat(max_tokens=48).bind_tools([weather_tool], tool_choice="any", parallel_tool_calls=False)
    msg = any_tool.invoke("What is the weather in Tokyo?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and not msg.invalid_tool_calls

    chunks = list(named.stream("What is the weather in Paris?"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    [streamed] = whole.tool_calls  # tool_call_chunks reassembled into one call
    assert streamed["name"] == "get_weather" and streamed["args"]["city"] in ("Paris", "Tokyo")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat, method):
    structured = chat(max_tokens=40).with_structured_output(Person, method=method, include_raw=True)
    out = structured.invoke("Make up a person.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person), out["raw"]


def test_token_counting_stays_local(chat, compat_server):
    def k3rt_token_ids(text: str) -> list[int]:
        r = httpx.post(compat_server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                       timeout=30)
        r.raise_for_status()
        return r.json()["tokens"]

    llm = chat(custom_get_token_ids=k3rt_token_ids)
    text = "The quick brown fox jumps over the lazy dog"
    assert llm.get_num_tokens(text) == len(k3rt_token_ids(text)) > 0
