"""One request must never take the engine down (issue 19, part 1).

A grammar that compiles in a millisecond can fail at its first consumed token (llguidance: "too many
expressions constructed" for `a{1000000}`); that raised inside Engine.step and the engine process exited
with every request in flight. Now: a failing grammar fails its request alone (FinishReason "error", the
reason named), the others finish with the tokens they would have had anyway, and the accounting stays
exact; a step the runner cannot run fails that step's requests and the engine goes on; grammar specs too
large to run are refused when made (a 400 naming the field at the server)."""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.grammar import GrammarError, GrammarMatcher, GrammarSpec
from k3rt.backend.grammar.base import MAX_EXPANSION, regex_expansion
from tests.backend.engine_fixtures import assert_at_rest, greedy, make_engine, tiny_checkpoint

PROMPTS = [list(range(3, 40)), list(range(50, 90)), list(range(100, 130))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


class Breaking(GrammarMatcher):
    """Allows every token, and raises in `where` ("accept" or "fill") after `after` accepted tokens."""

    def __init__(self, where: str, after: int) -> None:
        self.where, self.after, self.accepted = where, after, 0

    def fill_bitmask(self, mask_row: torch.Tensor) -> None:
        if self.where == "fill" and self.accepted >= self.after:
            raise RuntimeError("lexer error: too many expressions constructed")
        mask_row.fill_(-1)

    def accept(self, token_id: int) -> bool:
        if self.where == "accept" and self.accepted >= self.after:
            raise RuntimeError("lexer error: too many expressions constructed")
        self.accepted += 1
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError


class Dead(Breaking):
    """A matcher in an error state: it allows no token at all."""

    def fill_bitmask(self, mask_row: torch.Tensor) -> None:
        mask_row.zero_()


def run_all(eng, rids):
    outs = {}
    for _ in range(500):
        if not eng.has_unfinished:
            break
        for o in eng.step():
            if o.finished and o.rid in rids:
                outs[o.rid] = o
        eng.check()
    return outs


@pytest.mark.parametrize("runner", ["model", "gpu"], ids=["reference", "gpu-path-torch-ops"])
@pytest.mark.parametrize("matcher", [Breaking("accept", 0), Breaking("accept", 2), Breaking("fill", 2), Dead("x", 0)],
                         ids=["accept-first", "accept-third", "fill-third", "dead"])
def test_a_failing_grammar_fails_its_request_alone(ckpt, runner, matcher):
    extra = {} if runner == "model" else {"engine": {"kernels": False, "cuda_graphs": False}}
    want = [o.output_ids for o in make_engine(ckpt, runner=runner, **extra).generate(PROMPTS[:2], greedy(6))]
    eng = make_engine(ckpt, runner=runner, **extra)
    rids = [eng.add_request(p, greedy(6)) for p in PROMPTS]
    eng.requests[rids[2]].grammar = matcher  # as a compiled grammar would be attached
    outs = run_all(eng, rids)
    bad = outs[rids[2]]
    assert bad.finish_reason == "error" and bad.error.startswith("grammar: ")
    assert [outs[r].output_ids for r in rids[:2]] == want
    assert all(outs[r].finish_reason == "length" for r in rids[:2])
    assert_at_rest(eng)


def test_a_step_the_runner_cannot_run_fails_its_requests_and_the_engine_goes_on(ckpt):
    eng = make_engine(ckpt, runner="model", budget=64)
    first = eng.add_request(PROMPTS[0], greedy(4))
    execute, calls = eng.runner.execute, []

    def flaky(out):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a request-specific shape the kernel refuses")
        return execute(out)

    eng.runner.execute = flaky
    eng.step()
    outs = eng.step()
    assert [(o.rid, o.finish_reason) for o in outs] == [(first, "error")]
    assert "could not run this request's step: ValueError: a request-specific shape" in outs[0].error
    eng.check()
    later = eng.add_request(PROMPTS[1], greedy(3))
    got = run_all(eng, {later})
    assert got[later].finish_reason == "length" and len(got[later].output_ids) == 3
    assert_at_rest(eng)


def test_a_cuda_error_is_still_fatal(ckpt):
    eng = make_engine(ckpt, runner="model")
    eng.add_request(PROMPTS[0], greedy(2))

    def broken(out):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng.runner.execute = broken
    with pytest.raises(RuntimeError, match="CUDA error"):
        eng.step()


@pytest.mark.parametrize("kind, payload, match", [
    ("regex", "a{1000000}", "regex: its repetitions expand to 1000000 positions"),
    ("regex", "(ab){300000}", "regex: its repetitions expand to 600000 positions"),
    ("regex", "(a{1000}){1000}", "expand to 1000000"),
    ("regex", "a" * 70_000, "regex: 70000 characters"),
    ("choice", ["x" * 1_000_000], "choice: 1000000 characters in all"),
    ("choice", [str(i) for i in range(20_000)], "choice: 20000 choices"),
    ("lark", 'start: "a"{1000000}', "lark: its repetitions expand to 1000000"),
], ids=["a-1e6", "ab-3e5", "nested", "long-regex", "choice-1M", "many-choices", "lark"])
def test_grammars_too_large_to_run_are_refused_when_made(kind, payload, match):
    with pytest.raises(GrammarError, match=match):
        GrammarSpec(kind, payload)


def test_the_largest_grammars_the_limits_allow_still_run(ckpt):
    """The limits sit where llguidance still runs: a repetition of MAX_EXPANSION positions compiles and
    steps (measured: a{1000000} fails, [a-z]{0,100000} runs)."""
    assert regex_expansion("[a-z]{0,100000}") == MAX_EXPANSION
    GrammarSpec.regex("[a-z]{0,100000}")
    GrammarSpec.choice(["y" * MAX_EXPANSION])
    eng = make_engine(ckpt, runner="model")
    rid = eng.add_request(PROMPTS[0], greedy(5), grammar=GrammarSpec.regex("[a-z]{0,100000}").to_dict())
    got = run_all(eng, {rid})
    assert got[rid].finish_reason in ("length", "stop") and got[rid].error is None
