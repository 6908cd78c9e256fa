"""SGLang-style programs run unchanged apart from the import (`import k3rt` for `import sglang as sgl`,
`k3rt.` for `sgl.`): multi-turn chat, fork/join, select, regex and JSON-schema constrained generation.

The programs below are written the way SGLang's README and examples write them. The model is random, so
the tests assert structure: variables exist, roles and messages line up, constraints hold exactly, and
greedy decoding is deterministic.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import k3rt


@k3rt.function
def multi_turn_question(s, question_1, question_2):
    s += k3rt.system("You are a helpful assistant.")
    s += k3rt.user(question_1)
    s += k3rt.assistant(k3rt.gen("answer_1", max_tokens=16))
    s += k3rt.user(question_2)
    s += k3rt.assistant(k3rt.gen("answer_2", max_tokens=16))


@k3rt.function
def tip_suggestion(s):
    s += (
        "Here are two tips for staying healthy: "
        "1. Balanced Diet. 2. Regular Exercise.\n\n"
    )
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i+1} into a paragraph:\n"
        f += k3rt.gen("detailed_tip", max_tokens=12, stop="\n\n")
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + k3rt.gen("summary", max_tokens=8)


@k3rt.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + k3rt.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + k3rt.gen("expression", max_tokens=8)
    elif s["tool"] == "search engine":
        s += "The key word to search is" + k3rt.gen("word", max_tokens=8)


IP_REGEX = r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"


@k3rt.function
def regex_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + k3rt.gen("answer", temperature=0, regex=IP_REGEX)


CHARACTER_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "house": {"enum": ["Gryffindor", "Slytherin", "Ravenclaw", "Hufflepuff"]},
        "blood_status": {"enum": ["Pure-blood", "Half-blood", "Muggle-born"]},
        "wand": {
            "type": "object",
            "properties": {"wood": {"type": "string", "maxLength": 10},
                           "length": {"type": "integer", "minimum": 5, "maximum": 20}},
            "required": ["wood", "length"],
            "additionalProperties": False,
        },
        "alive": {"type": "boolean"},
    },
    "required": ["name", "house", "blood_status", "wand", "alive"],
    "additionalProperties": False,
}


@k3rt.function
def character_gen(s, name):
    s += name + " is a character in Harry Potter. Please fill in the following information about this character.\n"
    s += k3rt.gen("json_output", max_tokens=160, json_schema=json.dumps(CHARACTER_SCHEMA))


def test_multi_turn_chat(rt) -> None:
    state = multi_turn_question.run(question_1="What is the capital of France?",
                                    question_2="And of Germany?", temperature=0, backend=rt)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == "You are a helpful assistant."
    assert msgs[1]["content"] == "What is the capital of France?"
    assert msgs[2]["content"] == state["answer_1"] and msgs[4]["content"] == state["answer_2"]
    text = state.text()
    assert text.index("France") < text.index(state["answer_1"]) < text.index("Germany")
    assert state.meta("answer_1")["completion_tokens"] <= 16
    # the second turn's prompt is the first turn's prompt plus its answer and the next question
    assert state.meta("answer_2")["prompt_tokens"] > state.meta("answer_1")["prompt_tokens"] + 4
    again = multi_turn_question.run(question_1="What is the capital of France?",
                                    question_2="And of Germany?", temperature=0, backend=rt)
    assert (again["answer_1"], again["answer_2"], again.text()) == (state["answer_1"], state["answer_2"], text)


def test_default_backend_and_positional_arguments(rt) -> None:
    k3rt.set_default_backend(rt)
    try:
        assert k3rt.get_default_backend() is rt
        state = multi_turn_question("Hi", "Bye", temperature=0)  # calling the function runs it, as in SGLang
        assert [m["content"] for m in state.messages()][1::2] == ["Hi", "Bye"]
    finally:
        k3rt.set_default_backend(None)


def test_fork_read_children_like_sglang(rt) -> None:
    state = tip_suggestion.run(temperature=0, backend=rt)
    text = state.text()
    assert text.startswith("Here are two tips for staying healthy")
    # the children's text stays in the children; the parent gets what the program appended
    assert "expand tip" not in text
    tips = re.search(r"Tip 1:(.*)\nTip 2:(.*)\nIn summary", text, re.S)
    assert tips is not None
    assert "\n\n" not in tips.group(1) and "\n\n" not in tips.group(2)  # the stop string ended each draft
    assert text.endswith("In summary" + state["summary"])


def test_select_then_branch(rt) -> None:
    state = tool_use.run(question="What is 12 * 7?", temperature=0, backend=rt)
    assert state["tool"] in ("calculator", "search engine")
    branch = "expression" if state["tool"] == "calculator" else "word"
    assert isinstance(state[branch], str)
    assert f"I need to use a {state['tool']}. " in state.text()


def test_regex(rt) -> None:
    state = regex_gen.run(backend=rt)
    assert re.fullmatch(IP_REGEX, state["answer"]), state["answer"]
    assert state.text().endswith("A: " + state["answer"])


@pytest.mark.parametrize("name", ["Harry Potter", "Hermione Granger"])
def test_json_schema(rt, name: str) -> None:
    state = character_gen.run(name=name, temperature=0, backend=rt)
    assert state.meta("json_output")["finish_reason"] == "stop"  # the grammar ended it, not max_tokens
    jsonschema.validate(json.loads(state["json_output"]), CHARACTER_SCHEMA)


def test_gen_int_is_ascii(rt) -> None:
    """Regression: gen_int used \\d, which in the grammar's (Rust) regex matches any Unicode digit."""

    @k3rt.function
    def numbers(s):
        for i in range(4):
            s += f"\nx{i} = " + k3rt.gen_int(f"x{i}", max_tokens=4)

    for seed in range(3):
        state = numbers.run(temperature=1.0, seed=seed, backend=rt)
        for i in range(4):
            v = state[f"x{i}"]
            # sglang's REGEX_INT; cut by max_tokens the value may be only a sign; it never holds a non-ASCII digit
            assert re.fullmatch(r"[-+]?[0-9]*", v), repr(v)


def test_append_a_fork_childs_variable(rt) -> None:
    """Regression: `s += forks[i]["x"]` (and the same inside a role) read variable x of `s`, not of the child."""

    @k3rt.function
    def gather(s):
        s += "Tips:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i}:" + k3rt.gen("tip", max_tokens=4)
        s += "First: "
        s += forks[0]["tip"]
        s += k3rt.user(forks[1]["tip"])

    @k3rt.function
    def child_alone(s, i):
        s += "Tips:\n" + f"Tip {i}:" + k3rt.gen("tip", max_tokens=4)

    state = gather.run(backend=rt, temperature=0)
    tips = [child_alone.run(i=i, backend=rt, temperature=0)["tip"] for i in (0, 1)]
    assert tips[0] != tips[1]
    assert state.text().startswith(f"Tips:\nFirst: {tips[0]}")
    assert state.messages() == [{"role": "user", "content": tips[1]}]


def test_bind_and_run_defaults(rt) -> None:
    bound = multi_turn_question.bind(question_2="And of Germany?")
    a = bound.run(question_1="Capital of France?", backend=rt, temperature=0, max_tokens=4)
    b = multi_turn_question.run(question_1="Capital of France?", question_2="And of Germany?", backend=rt,
                                temperature=0, max_tokens=4)
    assert a.text() == b.text()
    # run()'s max_tokens is a default: the gen's own max_tokens=16 wins
    m = a.meta("answer_1")
    assert m["completion_tokens"] == 16 or m["finish_reason"] == "stop", m


def test_program_root_state_starts_like_every_sequence() -> None:
    # a model trained with BOS first (add_bos_token) gets it at the start of every program, before any text
    from types import SimpleNamespace

    from k3rt.backend.program.executor import ProgramSession

    tok = SimpleNamespace(sequence_prefix=(7,), encode=lambda text, allow_special=True: [ord(c) for c in text])
    session = ProgramSession("p", SimpleNamespace(tok=tok), roles=None)
    root = session.states[0]
    assert session.prompt_ids(root) == [7]
    root.run = "ab"
    assert session.prompt_ids(root) == [7, 97, 98]
    assert session.states[0].fork_copy().base_ids == [7]
