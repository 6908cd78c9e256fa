"""Streaming: `prog.run(..., stream=True)` returns at once; `s.text_iter(name)` yields the variable's text as it
is generated and `s.text_async_iter(name)` does the same under asyncio."""

from __future__ import annotations

import asyncio
import threading

import pytest

import k3rt

# a streaming bug shows as a hang (sessions once deadlocked on their lock): fail instead
pytestmark = pytest.mark.timeout(120)


@k3rt.function
def story(s, topic):
    s += k3rt.system("You tell stories.")
    s += k3rt.user(f"A story about {topic}.")
    s += k3rt.assistant(k3rt.gen("story", max_tokens=24, ignore_eos=True))
    s += k3rt.user("Happy or sad?")
    s += k3rt.assistant(k3rt.select("mood", ["happy", "sad"]))
    s += k3rt.user("A title?")
    s += k3rt.assistant(k3rt.gen("title", max_tokens=8, ignore_eos=True))


def test_text_iter_yields_the_variable_incrementally(rt) -> None:
    reference = story.run(topic="a fox", backend=rt, temperature=0)
    state = story.run(topic="a fox", backend=rt, temperature=0, stream=True)
    chunks = list(state.text_iter("story"))
    assert len(chunks) > 1  # incremental, not one block at the end
    assert "".join(chunks) == state["story"] == reference["story"]
    title = list(state.text_iter("title"))
    assert "".join(title) == state["title"] == reference["title"]
    assert list(state.text_iter("mood")) == [reference["mood"]]  # a select arrives whole
    assert state.text() == reference.text()


def test_text_iter_without_a_name_yields_the_whole_text(rt) -> None:
    state = story.run(topic="a river", backend=rt, temperature=0, stream=True)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text()
    assert state.text().startswith(chunks[0])  # the constant text streams too, in order


def test_text_async_iter(rt) -> None:
    async def consume() -> tuple[list[str], str, str]:
        state = story.run(topic="a boat", backend=rt, temperature=0, stream=True)
        ticks = 0

        async def ticker() -> None:  # the event loop stays free while chunks are awaited
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        chunks = [c async for c in state.text_async_iter("story")]
        t.cancel()
        assert ticks > 1
        return chunks, state["story"], state.text()

    chunks, value, _ = asyncio.run(consume())
    assert len(chunks) > 1 and "".join(chunks) == value
    assert value == story.run(topic="a boat", backend=rt, temperature=0)["story"]


def test_text_iter_after_the_program_ended_does_not_block(rt) -> None:
    """Regression: a stream asked for after the end (or a name never generated) blocked forever."""
    state = story.run(topic="a cat", backend=rt, temperature=0, stream=True)
    "".join(state.text_iter("title"))
    state.text()  # waits for the program's end
    out: list = []
    t = threading.Thread(target=lambda: out.append(list(state.text_iter("no_such_variable"))), daemon=True)
    t.start()
    t.join(10)
    assert out == [[]]


def test_text_iter_on_a_state_run_without_stream(rt) -> None:
    state = story.run(topic="a cat", backend=rt, temperature=0)
    assert list(state.text_iter("story")) == [state["story"]]
    assert list(state.text_iter()) == [state.text()]
