"""select: the chosen choice and its meta scores against an independent full forward of the model.

The reference tokenizes prefix + choice jointly and scores from the first token that differs from the
prefix's own tokens: when the choice merges with the prefix's last token (" t" + "he" -> " the"), that merged
token is scored in place of the prefix's last token (token healing, sglang#608/#1257). Nothing here calls the
executor's scoring code; the logits come from a cache-less forward of the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

import k3rt
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.loader import load_model

PREFIX = "Question: which word comes next? Answer: t"
CHOICES = ["he", "wo", "ea", "hree"]  # "he" and "ea" merge with the trailing " t"
METHODS = ["token_length_normalized", "greedy", "unconditional_likelihood_normalized"]


@k3rt.function
def pick(s, prefix, choices, method):
    s += prefix
    s += k3rt.select("answer", choices=choices, choices_method=method)


@k3rt.function
def chat_pick(s, method):
    s += k3rt.system("Reply with one word.")
    s += k3rt.user("Is water wet?")
    s += k3rt.assistant(k3rt.select("answer", ["yes", "no", "maybe", "it depends"], choices_method=method))


@k3rt.function
def chat_prefix(s):
    s += k3rt.system("Reply with one word.")
    s += k3rt.user("Is water wet?")
    s += k3rt.assistant_begin()


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model(tiny_model, progress=False)


def _logprobs(model, ids: list[int], start: int) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor(ids), ForwardBatch([len(ids)])).float(), -1)
    return [lp[p - 1, ids[p]].item() for p in range(start, len(ids))]


def _reference(model, tok, prefix: str, choices: list[str], method: str) -> tuple[int, list[float], list[list[float]]]:
    base = tok.encode(prefix)
    token_lps, scored_ids = [], []
    for c in choices:
        joint = tok.encode(prefix + c)
        k = next((i for i, (a, b) in enumerate(zip(joint, base)) if a != b), min(len(joint), len(base)))
        token_lps.append(_logprobs(model, joint, max(k, 1)))
        scored_ids.append(joint[max(k, 1):])
    means = [sum(t) / len(t) for t in token_lps]
    if method == "token_length_normalized":
        scores = means
    elif method == "greedy":
        # token by token; a shorter choice is padded with its mean logprob
        width = max(len(t) for t in token_lps)
        padded = [t + [sum(t) / len(t)] * (width - len(t)) for t in token_lps]
        best = max(range(len(choices)), key=lambda i: padded[i])
        scores = [float(i == best) for i in range(len(choices))]
    else:
        # sglang's rule: minus the logprobs of the same token ids scored alone, where the first has no
        # context and counts 0
        uncond = [[0.0] + (_logprobs(model, ids, 1) if len(ids) > 1 else []) for ids in scored_ids]
        scores = [sum(a - b for a, b in zip(t, u)) / len(t) for t, u in zip(token_lps, uncond)]
    best = max(range(len(choices)), key=lambda i: scores[i])
    return best, scores, token_lps


def test_prefix_merges_with_choices(tokenizer) -> None:
    base = tokenizer.encode(PREFIX)
    healed = [c for c in CHOICES if tokenizer.encode(PREFIX + c)[len(base) - 1] != base[-1]]
    assert healed == ["he", "ea"]  # the test below covers both a healed and a plain boundary


@pytest.mark.parametrize("method", METHODS)
def test_select_matches_full_forward(rt, model, tokenizer, method: str) -> None:
    state = pick.run(prefix=PREFIX, choices=CHOICES, method=method, backend=rt)
    best, scores, token_lps = _reference(model, tokenizer, PREFIX, CHOICES, method)
    meta = state.meta("answer")
    assert state["answer"] == CHOICES[best]
    assert state.text() == PREFIX + CHOICES[best]
    assert meta["choices"] == CHOICES and meta["method"] == method
    assert [len(t) for t in meta["token_logprobs"]] == [len(t) for t in token_lps]
    for got, want in zip(meta["token_logprobs"], token_lps):
        assert got == pytest.approx(want, abs=1e-4)
    assert meta["scores"] == pytest.approx(scores, abs=1e-4)


def test_healed_choice_scores_the_merged_token(rt, model, tokenizer) -> None:
    """"he" after "... t" is scored as log p(" the" | "... Answer:"), not as " t" followed by "he"."""
    state = pick.run(prefix=PREFIX, choices=["he"], method="token_length_normalized", backend=rt)
    ids = tokenizer.encode(PREFIX + "he")
    assert tokenizer.decode(ids[-1:]) == " the"
    (lps,) = state.meta("answer")["token_logprobs"]
    assert lps == pytest.approx(_logprobs(model, ids, len(ids) - 1), abs=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_select_in_a_chat_turn(rt, model, tokenizer, method: str) -> None:
    prefix = chat_prefix.run(backend=rt).text()  # the template text a select in the assistant turn follows
    state = chat_pick.run(method=method, backend=rt)
    choices = ["yes", "no", "maybe", "it depends"]
    best, scores, _ = _reference(model, tokenizer, prefix, choices, method)
    assert state["answer"] == choices[best]
    assert state.meta("answer")["scores"] == pytest.approx(scores, abs=1e-4)
    assert state.messages()[-1] == {"role": "assistant", "content": choices[best]}


def test_select_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="choices_method"):
        k3rt.select("x", ["a"], choices_method="loudest")
    with pytest.raises(ValueError, match="choices"):
        k3rt.select("x", [])
    with pytest.raises(ValueError, match="temperature"):
        k3rt.select("x", ["a", "b"], temperature=0.5)
