"""Errors surface at run(): an exception the program raises comes out as itself; a failure on the server (a bad
sampling value, a role misuse) comes out as k3rt.ProgramError naming the
program's source line. Either way the Runtime keeps serving."""

from __future__ import annotations

import inspect
import json

import pytest

import k3rt


def _line(prog, marker: str) -> int:
    lines, first = inspect.getsourcelines(prog.func)
    return first + next(i for i, line in enumerate(lines) if marker in line)


@k3rt.function
def bad_temperature(s):
    s += "Hello" + k3rt.gen("a", max_tokens=4)
    s += k3rt.gen("b", max_tokens=4, temperature=-1)  # BAD
    s += k3rt.gen("c", max_tokens=4)


@k3rt.function
def nested_roles(s):
    s += k3rt.user_begin()
    s += k3rt.assistant("hi")  # BAD


@k3rt.function
def raises_midway(s):
    s += "Hello" + k3rt.gen("a", max_tokens=3)
    if s["a"] is not None:
        raise LookupError("the program's own error")


@k3rt.function
def healthy(s):
    s += k3rt.user("ping")
    s += k3rt.assistant(k3rt.gen("pong", max_tokens=4))


@pytest.mark.parametrize("ship", [True, False], ids=["shipped", "client_side"])
@pytest.mark.parametrize("prog, match", [
    (bad_temperature, "temperature: must be >= 0"),
    (nested_roles, "role 'assistant' begins inside role 'user'"),
], ids=["bad_temperature", "nested_roles"])
def test_server_side_failure_names_the_source_line(rt, prog, match: str, ship: bool) -> None:
    line = _line(prog, "# BAD")
    with pytest.raises(k3rt.ProgramError, match=match) as e:
        prog.run(backend=rt, temperature=0, ship=ship)
    assert f"{prog.__name__}, line {line}:" in str(e.value)
    assert healthy.run(backend=rt, temperature=0)["pong"] is not None


def test_reading_an_undefined_variable_is_a_key_error(rt) -> None:
    @k3rt.function
    def reads_undefined(s):
        s += "Hello" + k3rt.gen("a", max_tokens=2)
        s += "and " + s["never_generated"]  # str + value: read here, on the client

    with pytest.raises(KeyError, match="never_generated"):
        reads_undefined.run(backend=rt, temperature=0)
    assert healthy.run(backend=rt, temperature=0)["pong"] is not None


def test_exception_in_the_program_surfaces_at_run(rt) -> None:
    open_before = len(rt.server.sessions)
    with pytest.raises(LookupError, match="the program's own error"):
        raises_midway.run(backend=rt, temperature=0)
    # the program's server-side session is closed (ProgramClose is fire-and-forget: poll briefly)
    import time

    deadline = time.monotonic() + 5
    while len(rt.server.sessions) > open_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(rt.server.sessions) == open_before
    assert healthy.run(backend=rt, temperature=0)["pong"] is not None


def test_errors_in_a_batch_stay_in_their_program(rt) -> None:
    @k3rt.function
    def maybe_bad(s, t):
        s += "Hi" + k3rt.gen("x", max_tokens=3, temperature=t)

    with pytest.raises(k3rt.ProgramError, match="temperature"):
        maybe_bad.run_batch([{"t": 0.0}, {"t": -1.0}, {"t": 0.0}], backend=rt)
    ok = maybe_bad.run_batch([{"t": 0.0}, {"t": 0.0}], backend=rt)
    assert ok[0]["x"] == ok[1]["x"]


def test_client_side_argument_errors_raise_before_anything_runs(rt) -> None:
    with pytest.raises(ValueError, match="regex"):
        k3rt.gen("x", regex="([unclosed")
    with pytest.raises(ValueError, match="at most one"):
        k3rt.gen("x", regex="a", json_schema={"type": "string"})
    with pytest.raises(TypeError, match="first argument"):
        k3rt.function(lambda: None)

    @k3rt.function
    def appends_a_number(s):
        s += 42

    with pytest.raises(TypeError, match="cannot append int"):
        appends_a_number.run(backend=rt)


def test_no_backend_is_a_clear_error() -> None:
    k3rt.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend"):
        healthy.run()


def test_values_read_inside_a_program_are_plain_strings(rt) -> None:
    # SGLang programs parse generated text with json.loads / int(): s["x"] must be a real str
    @k3rt.function
    def parses(s):
        s += "Give a number: " + k3rt.gen("n", regex=r"[0-9]{2}", max_tokens=4)
        n = int(s["n"])
        # bounded so that any model (these are random tiny ones) closes the object within max_tokens
        s += f" doubled is {2 * n}. JSON: " + k3rt.gen("j", json_schema={"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
            "additionalProperties": False}, max_tokens=32)
        s += " a=" + str(json.loads(s["j"])["a"])

    st = parses.run(backend=rt, temperature=0)
    assert isinstance(st["n"], str) and st.text().endswith(f" a={json.loads(st['j'])['a']}")
