"""The OpenAI Agents SDK (openai-agents) against a real `k3rt serve`: an Agent with a function tool run through
`Runner.run` on an OpenAI-compatible chat-completions model pointing at k3rt (tracing off: nothing leaves
localhost), a streamed run, and an Agent whose `output_type` is a pydantic model.

The model is k3-tiny's random-weight sibling, so the checks are on the protocol and the constraints: the
forced tool call names the tool with arguments its schema admits, the tool's result goes back, the run ends in
a message, and the structured output validates."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.compat.conftest import MODEL_NAME

pytestmark = pytest.mark.timeout(120)


class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo"]
    celsius: int = Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def agents(compat_server):
    sdk = pytest.importorskip("agents", reason="openai-agents is in the test extra (`make install`)")
    sdk.set_tracing_disabled(True)
    return sdk


@pytest.fixture
def client(compat_server):
    """One per test: its connections belong to the event loop of the test's asyncio.run, which closes it
    (`_closing`) before that loop ends."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=compat_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def model(agents, client):
    return agents.OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client)


async def _closing(client, work):
    try:
        return await work
    finally:
        await client.close()


def test_function_tool_through_runner(agents, client, model):
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    # "required" makes the tiny model call the tool; the SDK resets tool_choice after the call (its default
    # reset_tool_choice), so the second turn writes the final message
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=48, temperature=0)
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, model_settings=settings)
    result = asyncio.run(_closing(client, agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)))

    assert len(calls) == 1 and calls[0] in ("Paris", "Tokyo")
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    call, output = result.new_items[0].raw_item, result.new_items[1].raw_item
    assert call.name == "get_weather" and call.call_id.startswith("functions.get_weather:")
    assert output["call_id"] == call.call_id and output["output"] == f"sunny in {calls[0]}"
    assert isinstance(result.final_output, str) and result.final_output
    usage = result.context_wrapper.usage
    assert usage.requests == 2 and usage.output_tokens > 0 and usage.input_tokens > 0


def test_streamed_run(agents, client, model):
    from openai.types.responses import ResponseTextDeltaEvent

    agent = agents.Agent(name="plain", instructions="Be brief.", model=model,
                         model_settings=agents.ModelSettings(max_tokens=12, temperature=0))

    async def run() -> tuple[list[str], object]:
        streamed = agents.Runner.run_streamed(agent, "Say hello.")
        deltas = [e.data.delta async for e in streamed.stream_events()
                  if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
        return deltas, streamed

    deltas, streamed = asyncio.run(_closing(client, run()))
    assert len(deltas) > 1 and "".join(deltas) == streamed.final_output
    assert streamed.is_complete


def test_structured_output_type(agents, client, model):
    agent = agents.Agent(name="forecast", instructions="Give a forecast.", model=model, output_type=Forecast,
                         model_settings=agents.ModelSettings(max_tokens=40, temperature=0))
    result = asyncio.run(_closing(client, agents.Runner.run(agent, "Forecast for Tokyo.")))
    # the SDK sends the schema as a strict response_format; k3rt decodes under it, so it validates
    assert isinstance(result.final_output, Forecast)
