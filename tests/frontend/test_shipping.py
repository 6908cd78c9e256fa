"""Shipped programs vs the client-side fallback.

A program whose control flow never reads a generated value ships whole: one client round trip however many
gen/select calls it makes. `run(..., ship=False)` sends one request per call instead (SGLang's interpreter
model). Both run the same ops on the same server-side state, so greedy output is identical. A program that
reads a value (an `if` on it, an f-string) pays one round trip per read and otherwise behaves the same.
"""

from __future__ import annotations

import pytest

import k3rt


@k3rt.function
def eight_calls(s, topic):
    s += k3rt.system("You answer in a few words.")
    s += k3rt.user(f"Tell me about {topic}.")
    s += k3rt.assistant(k3rt.gen("intro", max_tokens=8))
    for i in range(3):
        s += k3rt.user(f"Detail {i}?")
        s += k3rt.assistant(k3rt.gen(f"detail_{i}", max_tokens=6, stop="\n"))
    s += k3rt.user("Is it good?")
    s += k3rt.assistant(k3rt.select("verdict", ["yes", "no", "unsure"]))
    s += k3rt.user("Rate it.")
    s += k3rt.assistant(k3rt.select("rating", ["1", "2", "3", "4", "5"], choices_method="greedy"))
    s += k3rt.user("A year?")
    s += k3rt.assistant(k3rt.gen("year", regex=r"(19|20)[0-9]{2}"))
    s += k3rt.user("Summary?")
    s += k3rt.assistant(k3rt.gen("summary", max_tokens=10))


VARS = ["intro", "detail_0", "detail_1", "detail_2", "verdict", "rating", "year", "summary"]


@k3rt.function
def reads_values(s, topic):
    s += f"Topic: {topic}. Colour: " + k3rt.select("colour", ["red", "green", "blue"])
    if s["colour"] == "red":  # read 1
        s += " Warm, because" + k3rt.gen("why", max_tokens=6)
    else:
        s += " Cool, because" + k3rt.gen("why", max_tokens=6)
    s += f"\nYou said: {s['why']}\nShort version:" + k3rt.gen("short", max_tokens=6)  # read 2
    s += "\nNumber: " + k3rt.gen("n", regex=r"[0-9]{2}")


def _run(rt, prog, ship: bool, **kw):
    before = rt.backend.round_trips
    state = prog.run(backend=rt, ship=ship, temperature=0, **kw)
    return state, rt.backend.round_trips - before


def test_shipped_program_makes_one_round_trip_and_matches_client_side(rt) -> None:
    shipped, shipped_trips = _run(rt, eight_calls, True, topic="lighthouses")
    local, local_trips = _run(rt, eight_calls, False, topic="lighthouses")
    assert shipped_trips == 1
    # client-side: one request per gen/select, plus one for the text after the last call
    assert local_trips == len(VARS) + 1
    assert {v: shipped[v] for v in VARS} == {v: local[v] for v in VARS}
    assert shipped.text() == local.text()
    assert shipped.messages() == local.messages()
    assert shipped.meta("verdict")["scores"] == pytest.approx(local.meta("verdict")["scores"], abs=1e-5)
    assert shipped["verdict"] in ("yes", "no", "unsure") and shipped["rating"] in "12345"
    # reading results after the program ended costs nothing
    before = rt.backend.round_trips
    assert shipped.text() and shipped["summary"] == local["summary"]
    assert rt.backend.round_trips == before


def test_program_reading_values_pays_one_round_trip_per_read(rt) -> None:
    shipped, shipped_trips = _run(rt, reads_values, True, topic="tea")
    local, _ = _run(rt, reads_values, False, topic="tea")
    assert shipped_trips == 3  # two reads, then the rest of the program
    assert shipped.text() == local.text()
    assert {v: shipped[v] for v in ("colour", "why", "short", "n")} == {v: local[v] for v in ("colour", "why", "short", "n")}
    text = shipped.text()
    assert (" Warm, because" in text) == (shipped["colour"] == "red")
    assert f"\nYou said: {shipped['why']}\nShort version:{shipped['short']}" in text


def test_run_batch_matches_single_runs(rt) -> None:
    topics = ["owls", "rivers", "clocks"]
    states = eight_calls.run_batch([{"topic": t} for t in topics], backend=rt, temperature=0, progress_bar=True)
    for t, st in zip(topics, states):
        single = eight_calls.run(topic=t, backend=rt, temperature=0)
        assert st.messages()[1]["content"] == f"Tell me about {t}."  # results come back in input order
        assert {v: st[v] for v in VARS} == {v: single[v] for v in VARS}
