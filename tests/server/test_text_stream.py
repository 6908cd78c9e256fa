"""The gateway's TextStream (detokenization + stop strings) and the Kimi tool-call parser, without a server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3rt.backend.gateway import TextStream
from k3rt.server import tools
from k3rt.server.errors import from_validation_error


def _run(tokenizer, ids: list[int], stop: list[str], updates: list[int]) -> tuple[str, int, bool]:
    """Feed `ids` in updates of the given sizes, as the engine would; returns (text, tokens kept, stopped)."""
    ts = TextStream(tokenizer, stop)
    out, kept, i = "", 0, 0
    for size in updates + [len(ids)]:
        chunk = ids[i:i + size]
        i += len(chunk)
        n = ts.push(chunk)
        kept += n
        if ts.stopped:
            break
        out += ts.take()
        if i >= len(ids):
            break
    ts.finish()
    return out + ts.take(final=True), kept, ts.stopped


def _reference(tokenizer, ids: list[int], stop: list[str]) -> str:
    """The text up to the first stop string to complete (character by character), without it."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))]
    return text


WORDS = ["the", " cache", " keeps", " snapshots", ";", " when", " a", " request", " ends", ",", " its", " pages",
         " return", "\n", " café", " 你好", "!", " Grüße", " 🚀"]


@settings(max_examples=150, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=1, max_size=14), data=st.data())
def test_stop_strings_match_across_tokens_and_are_never_emitted(tokenizer, words, data) -> None:
    text = "".join(words)
    ids = tokenizer.encode(text, allow_special=False)
    # stop strings: substrings of the text (often spanning token boundaries) and strings that never occur
    picks = data.draw(st.lists(st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)), max_size=2))
    stop = [text[a:a + n] for a, n in picks] + data.draw(st.lists(st.sampled_from(["zzz", "pages!", "re"]), max_size=1))
    updates = data.draw(st.lists(st.integers(1, 3), max_size=len(ids)))
    out, kept, stopped = _run(tokenizer, ids, stop, updates)
    expected = _reference(tokenizer, ids, stop)
    assert out == expected
    assert stopped == (expected != tokenizer.decode(ids, skip_special_tokens=True))
    if stopped:
        # the kept tokens are exactly those up to the one that completed the stop string
        assert all(s not in tokenizer.decode(ids[:kept - 1], skip_special_tokens=True) for s in stop)


def test_held_back_prefix_is_released_when_it_stops_matching(tokenizer) -> None:
    stop = "pages!"
    ts = TextStream(tokenizer, [stop])
    ids = tokenizer.encode(" its pages return", allow_special=False)
    released = ""
    for k, t in enumerate(ids):
        ts.push([t])
        released += ts.take()
        so_far = tokenizer.decode(ids[:k + 1])
        held = max((n for n in range(1, len(stop)) if so_far.endswith(stop[:n])), default=0)
        assert released == so_far[:len(so_far) - held]  # exactly the text that could still become "pages!"
    ts.finish()
    assert released + ts.take(final=True) == " its pages return" and not ts.stopped


def test_text_end_id_keeps_structured_tokens_out_of_text(tokenizer) -> None:
    begin = tokenizer.encode(tools.SECTION_BEGIN)[0]
    ids = tokenizer.encode("Sure." + tools.SECTION_BEGIN + tools.CALL_BEGIN + "functions.f:0")
    ts = TextStream(tokenizer, (), text_end_id=begin)
    assert ts.push(ids) == len(ids)
    ts.finish()
    assert ts.take(final=True) == "Sure."


def _parser(tokenizer) -> tools.KimiToolParser:
    def special(text: str) -> int | None:
        ids = tokenizer.encode(text)
        return ids[0] if len(ids) == 1 and ids[0] in tokenizer.special_token_ids else None

    parser = tools.KimiToolParser.create(special, tokenizer.decode)
    assert parser is not None
    return parser


def test_kimi_tool_calls_parse_from_token_ids(tokenizer) -> None:
    text = ("Let me check." + tools.SECTION_BEGIN
            + tools.CALL_BEGIN + "functions.get_weather:0" + tools.ARGUMENT_BEGIN + '{"city": "Paris"}' + tools.CALL_END
            + tools.CALL_BEGIN + "functions.get_time:1" + tools.ARGUMENT_BEGIN + '{"zone": "UTC"}' + tools.CALL_END
            + tools.SECTION_END)
    ids = tokenizer.encode(text)
    parser = _parser(tokenizer)
    completed = []
    for i in range(0, len(ids), 3):  # streamed in small updates
        completed += parser.feed(ids[i:i + 3])
    assert [(c.id, c.name, c.arguments) for c in completed] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        ("functions.get_time:1", "get_time", '{"zone": "UTC"}')]
    assert parser.calls == completed


def test_unfinished_or_garbled_calls_are_dropped(tokenizer) -> None:
    parser = _parser(tokenizer)
    ids = tokenizer.encode(tools.SECTION_BEGIN + tools.CALL_BEGIN + "not a : valid id" + tools.ARGUMENT_BEGIN + "{}"
                           + tools.CALL_END + tools.CALL_BEGIN + "functions.f:2" + tools.ARGUMENT_BEGIN + '{"a"')
    assert parser.feed(ids) == [] and parser.calls == []


def test_required_mode_schema_and_parse() -> None:
    schema = tools.required_schema([("f", None), ("g", {"type": "object", "properties": {"x": {"type": "integer"}}})],
                                   parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert tools.parse_required('[{"name": "g", "parameters": {"x": 1}}]') == [("g", '{"x":1}')]
    assert tools.parse_required('[{"name": "g", "parameters": {"x": 1}') is None
    assert tools.parse_required('{"name": "g"}') is None


@pytest.mark.parametrize("loc, param", [
    (("temperature",), "temperature"),
    (("messages", 0, "role"), "messages[0].role"),
    (("stop", "list[str]", 3), "stop"),
    (("tool_choice", "NamedToolChoice", "function"), "tool_choice"),
    ((), None),
], ids=["field", "nested", "union-member", "model-member", "body"])
def test_validation_errors_name_the_field(loc, param) -> None:
    err = from_validation_error([{"type": "int_type", "loc": loc, "msg": "Input should be a valid integer",
                                  "input": "x"}])
    assert err.status == 400 and err.param == param
    if param:
        assert err.message.startswith(param + ":")
