"""A shipped program pins its state's cache prefix between calls and releases every pin when it ends."""

from __future__ import annotations

import time

import k3rt


@k3rt.function
def two_calls(s, topic):
    s += k3rt.user(f"Tell me about {topic}.")
    s += k3rt.assistant(k3rt.gen("first", max_tokens=6, ignore_eos=True))
    s += k3rt.user("And then?")
    s += k3rt.assistant(k3rt.gen("second", max_tokens=6, ignore_eos=True))
    forks = s.fork(2)
    for f in forks:
        f += k3rt.gen("draft", max_tokens=4, ignore_eos=True)
    forks.join()


def _pins(rt: k3rt.Runtime) -> int:
    deadline = time.monotonic() + 10
    while rt.engine_stats.get("pins", 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # unpins are sent as the session closes
    return rt.engine_stats.get("pins", 0)


def test_program_pins_are_released_when_it_ends(rt) -> None:
    assert _pins(rt) == 0
    st = two_calls.run(topic="rivers", backend=rt, temperature=0)
    assert len(st["draft"]) == 2
    assert _pins(rt) == 0
    states = two_calls.run_batch([{"topic": t} for t in ("owls", "clocks", "tea")], backend=rt, temperature=0)
    assert all(len(s["draft"]) == 2 for s in states)
    assert _pins(rt) == 0


def test_a_program_holds_a_pin_between_its_calls(rt) -> None:
    seen: list[int] = []

    @k3rt.function
    def looks_midway(s):
        s += k3rt.user("Name a colour.")
        s += k3rt.assistant(k3rt.gen("colour", max_tokens=4, ignore_eos=True))
        _ = s["colour"]  # ships what came before: the server now holds this state's pin
        seen.append(rt.engine_stats["pins"])
        s += k3rt.user("Why?") + k3rt.assistant(k3rt.gen("why", max_tokens=4, ignore_eos=True))

    looks_midway.run(backend=rt, temperature=0)
    assert seen == [1]
    assert _pins(rt) == 0


def test_second_call_resumes_from_the_pinned_prefix(rt) -> None:
    before = rt.engine_stats
    two_calls.run(topic="lighthouses", backend=rt, temperature=0)
    after = rt.engine_stats
    # each later call recomputes only its new text: the cached share of the prompts is large
    assert after["cached_tokens"] - before["cached_tokens"] > 0
