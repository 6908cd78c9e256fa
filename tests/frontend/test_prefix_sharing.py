"""Shared prefixes are computed once: run_batch over a common system prompt, and fork.

Counts come from Runtime.engine_stats: `computed_prompt_tokens` is prompt positions the model actually ran.
A hit in the prefix cache lands on the KDA snapshot grid (CacheConfig.hash_block_size), so each program may
recompute up to one grid block of the shared part besides its own tokens.
"""

from __future__ import annotations

import k3rt
from k3rt.config import CacheConfig

from .conftest import stats_delta, words

GRID = CacheConfig().hash_block_size


def test_run_batch_computes_a_shared_system_prompt_once(rt, tokenizer) -> None:
    system = words(265, seed=64)
    sys_tokens = len(tokenizer.encode(system))
    assert 900 <= sys_tokens <= 1100  # the ~1,000-token prompt the acceptance asks for

    @k3rt.function
    def ask(s, i):
        s += k3rt.system(system)
        s += k3rt.user(f"Question {i}: what is {i} squared?")
        s += k3rt.assistant(k3rt.gen("answer", max_tokens=4))

    before = rt.engine_stats
    states = ask.run_batch([{"i": i} for i in range(64)], backend=rt, temperature=0, progress_bar=False)
    d = stats_delta(rt, before)
    prompts = [st.meta("answer")["prompt_tokens"] for st in states]
    assert d["prompt_tokens"] == sum(prompts) >= 64 * sys_tokens
    own = sum(p - sys_tokens for p in prompts)  # each program's question and role text
    assert d["computed_prompt_tokens"] <= sys_tokens + own + 64 * GRID, d
    assert d["computed_prompt_tokens"] < 0.1 * d["prompt_tokens"], d  # vs ~64x the system prompt without sharing
    assert [st.messages()[1]["content"] for st in states] == [f"Question {i}: what is {i} squared?" for i in range(64)]
    for i in (0, 37):  # concurrency does not change greedy results
        assert ask.run(i=i, backend=rt, temperature=0)["answer"] == states[i]["answer"]


def test_fork_computes_the_prefix_once_and_join_gathers_in_child_order(rt, tokenizer) -> None:
    prefix = words(200, seed=7)
    n = 4

    @k3rt.function
    def drafts(s):
        s += prefix + "\n"
        forks = s.fork(n)
        for i, f in enumerate(forks):
            f += f"Draft {i}:"
            f += k3rt.gen("draft", max_tokens=6)
            f += k3rt.select("tag", [f"c{i}"])  # a one-choice select: child i's value is known
        forks.join()
        s += "\nBest draft: " + k3rt.select("best", [str(i) for i in range(n)])

    @k3rt.function
    def one_child(s, i):
        s += prefix + "\n"
        s += f"Draft {i}:"
        s += k3rt.gen("draft", max_tokens=6)

    prefix_tokens = len(tokenizer.encode(prefix + "\n"))
    before = rt.engine_stats
    state = drafts.run(backend=rt, temperature=0)
    d = stats_delta(rt, before)
    # without sharing: n x prefix; with it: the prefix once plus, per child, its own text and a grid block
    assert d["computed_prompt_tokens"] <= prefix_tokens + n * (GRID + 16), (d, prefix_tokens)
    assert d["computed_prompt_tokens"] < 2 * prefix_tokens, (d, prefix_tokens)
    assert state["tag"] == [f"c{i}" for i in range(n)]
    assert len(state["draft"]) == n
    for i in range(n):  # each gathered draft is what that child alone would have produced
        assert state["draft"][i] == one_child.run(i=i, backend=rt, temperature=0)["draft"]
    assert state["best"] in [str(i) for i in range(n)]
    # the parent's text holds none of the children's text
    assert "Draft 0:" not in state.text()
