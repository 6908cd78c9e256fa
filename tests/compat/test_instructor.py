"""instructor against a real `k3rt serve`: a pydantic response_model through JSON-schema mode (OpenAI's
response_format json_schema) and tools mode (a forced function call), sync, async and streamed as partial
objects.

k3rt decodes under the schema, so even the random-weight tiny model's output validates: a model with
`Literal` and bounded fields leaves nothing for the model to get wrong. Regression: pydantic's schema says
nothing about other properties, and llguidance used to let the model add keys until max_tokens
(IncompleteOutputException); k3rt now generates only the declared ones (backend/grammar/base.closed_schema)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.compat.conftest import MODEL_NAME

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Make up a person."}]


class Person(BaseModel):
    name: Literal["Ann", "Bob"]
    age: int = Field(ge=0, le=120)


class Team(BaseModel):
    lead: Person
    size: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def instructor(compat_server):
    return pytest.importorskip("instructor", reason="instructor is in the test extra (`make install`)")


def _client(instructor, url: str, mode, *, asynchronous: bool = False):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return instructor.from_openai(cls(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), mode=mode)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_response_model(instructor, compat_server, mode):
    client = _client(instructor, compat_server.url, instructor.Mode[mode])
    person, raw = client.chat.completions.create_with_completion(
        model=MODEL_NAME, response_model=Person, messages=MESSAGES, max_tokens=40, temperature=0, max_retries=0)
    assert isinstance(person, Person)
    assert raw.choices[0].finish_reason == ("stop" if mode == "JSON_SCHEMA" else "tool_calls")
    # a nested model: both levels decode to their declared fields only
    team = client.chat.completions.create(model=MODEL_NAME, response_model=Team, messages=MESSAGES, max_tokens=60,
                                          temperature=0, max_retries=0)
    assert isinstance(team, Team) and isinstance(team.lead, Person)


def test_async_and_partial_stream(instructor, compat_server):
    aclient = _client(instructor, compat_server.url, instructor.Mode.JSON_SCHEMA, asynchronous=True)

    async def run() -> Person:
        return await aclient.chat.completions.create(model=MODEL_NAME, response_model=Person, messages=MESSAGES,
                                                     max_tokens=40, temperature=0, max_retries=0)

    person = asyncio.run(run())
    assert isinstance(person, Person)

    client = _client(instructor, compat_server.url, instructor.Mode.JSON_SCHEMA)
    partials = list(client.chat.completions.create_partial(
        model=MODEL_NAME, response_model=Person, messages=MESSAGES, max_tokens=40, temperature=0, max_retries=0))
    assert len(partials) > 1 and partials[0].name is None  # filled in as the JSON streams
    assert partials[-1].model_dump() == person.model_dump()  # greedy: the same object, streamed
