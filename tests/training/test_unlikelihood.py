"""Unlikelihood training against repetition loops (training/unlikelihood.py): which tokens are marked,
which completions are kept, how they are batched, the loss itself; and the shape of the function test's
complete completions (training/function_test.py), which says what a completion rate is made of.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3rt.training import function_test as ft
from k3rt.training import train as T
from k3rt.training.unlikelihood import (RunawaySequence, UnlikelihoodBatch, repeated_ngram_mask,
                                        runaway_sequences, unlikelihood_loss)
from tests.training.test_training import _few_threads, smoke_model  # noqa: F401 (the fixture applies here too)

F, X = False, True  # mask literals



# ---- repeated_ngram_mask --------------------------------------------------------------------------

def test_repeated_1grams_mark_every_later_occurrence() -> None:
    #                          prompt  completion
    assert repeated_ngram_mask([9, 1, 2, 1, 3, 2, 2], 1, 1) == [F, F, F, X, F, X, X]
    assert repeated_ngram_mask([4, 4, 4], 0, 1) == [F, X, X]
    assert repeated_ngram_mask([1, 2, 3], 0, 1) == [F, F, F]


def test_repeated_2grams_and_3grams() -> None:
    assert repeated_ngram_mask([1, 2, 3, 1, 2, 3, 1, 2], 0, 2) == [F, F, F, F, X, X, X, X]
    # a repeated token is not a repeated 2-gram: (1, 2), (2, 1), (1, 3), (3, 1) are all new
    assert repeated_ngram_mask([1, 2, 1, 3, 1], 0, 2) == [F, F, F, F, F]
    assert repeated_ngram_mask([1, 2, 3, 1, 2, 4, 1, 2, 3], 0, 3) == [F, F, F, F, F, F, F, F, X]
    # n longer than the completion: nothing can repeat
    assert repeated_ngram_mask([1, 1], 0, 3) == [F, F]


def test_overlapping_periodic_repeats_are_marked() -> None:
    # the occurrence ending at t overlaps the one ending at t - 1 (period 1) or t - 2 (period 2)
    assert repeated_ngram_mask([4, 4, 4, 4, 4], 0, 3) == [F, F, F, X, X]
    assert repeated_ngram_mask([1, 2, 1, 2, 1, 2], 0, 3) == [F, F, F, F, X, X]
    assert repeated_ngram_mask([5, 1, 2, 1, 2, 1, 2], 1, 2) == [F, F, F, F, X, X, X]


def test_the_prompt_is_neither_marked_nor_searched() -> None:
    # the completion restates the prompt's tokens: not a loop
    assert repeated_ngram_mask([5, 6, 5, 6, 7], 2, 1) == [F, F, F, F, F]
    assert repeated_ngram_mask([5, 6, 5, 6, 7], 0, 1) == [F, F, X, X, F]  # the same ids as one completion
    # an n-gram reaching back into the prompt is not searched either: (2, 1) spans ids 1..2
    assert repeated_ngram_mask([1, 2, 1, 2, 1, 2], 2, 2) == [F, F, F, F, F, X]
    assert repeated_ngram_mask([1, 2, 1, 2, 1, 2], 0, 2) == [F, F, F, X, X, X]
    # an empty completion, or start past the end
    assert repeated_ngram_mask([1, 1, 1], 3, 1) == [F, F, F]
    assert repeated_ngram_mask([], 0, 1) == []


@pytest.mark.parametrize("n", [0, -1])
def test_ngram_size_must_be_positive(n: int) -> None:
    with pytest.raises(ValueError):
        repeated_ngram_mask([1, 1, 1], 0, n)


# ---- runaway_sequences ----------------------------------------------------------------------------

def test_runaway_sequences_keep_capped_completions_that_repeat() -> None:
    prompts = [[1, 2], [1, 2], [1, 2], [5], [3]]
    completions = [
        ({"stop": "dedent", "completion": "    x\n"}, [5, 5, 5]),  # ended at the function's end: left alone
        ({"stop": "stop", "completion": "    x"}, [5, 5, 0]),  # ended at EOS: left alone
        ({"stop": "length", "completion": "abc"}, [5, 6, 7]),  # capped, but no token repeats
        ({"stop": "length", "completion": "xy"}, [5, 6]),  # repeats only the prompt's token
        ({"stop": "length", "completion": "abab"}, [5, 6, 5, 6]),
    ]
    [kept] = runaway_sequences(prompts, completions, n=1)
    assert kept == RunawaySequence([3, 5, 6, 5, 6], [F, F, F, X, X]) and kept.num_marked == 2
    [kept2] = runaway_sequences(prompts, completions, n=2)
    assert kept2 == RunawaySequence([3, 5, 6, 5, 6], [F, F, F, F, X]) and kept2.num_marked == 1
    assert runaway_sequences(prompts, completions, n=3) == []  # (5, 6, 5) then (6, 5, 6): no repeat
    with pytest.raises(ValueError):  # one completion per prompt
        runaway_sequences(prompts[:-1], completions, n=1)


# ---- UnlikelihoodBatch ----------------------------------------------------------------------------

def test_batch_shifts_to_next_token_windows_and_never_marks_padding() -> None:
    seqs = [RunawaySequence([1, 2, 3, 4, 5], [F, F, F, X, X]), RunawaySequence([7, 8, 9], [F, X, X])]
    b = UnlikelihoodBatch.build(seqs, pad_id=0)
    assert b.inputs.tolist() == [[1, 2, 3, 4], [7, 8, 9, 0]]
    assert b.targets.tolist() == [[2, 3, 4, 5], [8, 9, 0, 0]]
    assert b.mask.tolist() == [[F, F, X, X], [X, X, F, F]]
    assert (b.inputs.dtype, b.targets.dtype, b.mask.dtype) == (torch.long, torch.long, torch.bool)
    # the marked targets are exactly the marked tokens, in order; padding (the pad id 0 here) never is
    assert b.targets[b.mask].tolist() == [4, 5, 8, 9]
    # a pad id that also occurs as a marked token stays marked there, and only there
    c = UnlikelihoodBatch.build([RunawaySequence([3, 7, 7], [F, F, X]), RunawaySequence([3], [F])], pad_id=7)
    assert c.inputs.tolist() == [[3, 7], [3, 7]] and c.targets.tolist() == [[7, 7], [7, 7]]
    assert c.mask.tolist() == [[F, X], [F, F]]
    moved = b.to(torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip((moved.inputs, moved.targets, moved.mask),
                                                  (b.inputs, b.targets, b.mask)))


# ---- unlikelihood_loss ----------------------------------------------------------------------------

def trainable_smoke_model():
    model = smoke_model(vocab=64)
    T.make_trainable(model)
    return model


def test_loss_equals_a_per_position_computation_with_its_gradient() -> None:
    model = trainable_smoke_model()
    g = torch.Generator().manual_seed(3)
    seqs = []
    for length in (14, 9, 11):
        ids = torch.randint(0, 64, (length,), generator=g).tolist()
        mask = (torch.rand(length, generator=g) < 0.4).tolist()
        mask[0] = False  # the first token is never a target
        seqs.append(RunawaySequence(ids, mask))
    assert sum(s.num_marked for s in seqs) > 0
    params = [p for p in model.parameters() if p.requires_grad]

    got_sum, got_count = unlikelihood_loss(model, UnlikelihoodBatch.build(seqs, pad_id=0))
    got_grads = torch.autograd.grad(got_sum, params, allow_unused=True)

    # each sequence alone (no padding), position by position
    want_sum = torch.zeros(())
    for s in seqs:
        logits = T.window_logits(model, torch.tensor([s.ids[:-1]]))
        probs = torch.softmax(logits.double(), dim=-1)
        for j in range(len(s.ids) - 1):
            if s.mask[j + 1]:
                want_sum = want_sum + (-torch.log(1 - probs[j, s.ids[j + 1]])).float()
    want_grads = torch.autograd.grad(want_sum, params, allow_unused=True)

    assert got_count.item() == sum(s.num_marked for s in seqs) and got_count.dtype == torch.long
    assert got_sum.item() == pytest.approx(want_sum.item(), rel=1e-5) and got_sum.item() > 0
    # (layer 0's attention-residual norm and projection have a single block to mix and take no part: None on
    # both sides)
    assert [a is None for a in got_grads] == [b is None for b in want_grads]
    for a, b in zip(got_grads, want_grads):
        if a is not None:
            assert torch.isfinite(a).all()
            assert (a - b).abs().max() <= 1e-4 * max(1e-6, b.abs().max().item())
    used = [a for a in got_grads if a is not None]
    assert len(used) > len(params) // 2 and all(a.abs().max() > 0 for a in used)  # gradients flow into the model

    none = UnlikelihoodBatch.build([RunawaySequence(s.ids, [False] * len(s.ids)) for s in seqs], pad_id=0)
    zero_sum, zero_count = unlikelihood_loss(model, none)
    assert zero_sum.item() == 0.0 and zero_count.item() == 0


class _TableModel(torch.nn.Module):
    """The two attributes `train.window_logits` uses: logits are a learned row per input token."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table))
        self.model = lambda ids, batch: self.table[ids]
        self.lm_head = torch.nn.Identity()


def test_loss_values_and_a_certain_token_stays_finite() -> None:
    # after token 0: tokens 0 and 1 equally likely, 2 never; after 1: token 0 with p = 1 in float32 (e^-200
    # underflows); after 2: token 0 with p = 1 / (1 + e^-10)
    model = _TableModel([[0.0, 0.0, -1e4], [200.0, 0.0, -1e4], [10.0, 0.0, -1e4]])
    # (input -> target): 0->1 p=.5, 1->0 p=1, 0->1 p=.5, 1->0 p=1 (unmarked), 0->2 p=0, 2->0 p~1, 0->1 (unmarked)
    seq = RunawaySequence([0, 1, 0, 1, 0, 2, 0, 1], [F, X, X, X, F, X, X, F])
    total, count = unlikelihood_loss(model, UnlikelihoodBatch.build([seq], pad_id=0))
    floor = -math.log(1e-6)  # 1 - p is floored at 1e-6
    near = math.log1p(math.exp(10.0))  # -log(1 - p) = log(1 + e^10)
    assert count.item() == 5 and math.isfinite(total.item())
    assert total.item() == pytest.approx(2 * math.log(2) + floor + 0.0 + near, abs=2e-3)
    total.backward()
    # d(-log(1 - p_t)) / dz = p_t for the target, -p_t p_j / (1 - p_t) for the others: [-0.5, 0.5, 0] for each
    # p = 0.5 target, nothing for p = 0; the floored positions pass no gradient (nor the unmarked one);
    # the p = 1 - 4.5e-5 one about [1, -1, 0]
    grad = model.table.grad
    assert torch.isfinite(grad).all()
    assert grad[0].tolist() == pytest.approx([-1.0, 1.0, 0.0], abs=1e-6)
    assert grad[1].tolist() == [0.0, 0.0, 0.0]
    assert grad[2].tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-3)


# ---- the shape of the complete completions --------------------------------------------------------

@pytest.mark.parametrize("completion, want", [
    ('    """Doc."""\n', True),
    ('    """Doc."""\n    # a comment\n\n', True),
    ('    "a"\n    \'b\'\n', True),
    ('    """Doc."""\n    return 1\n', False),
    ("    pass\n", False),
    ('    b"bytes"\n', False),
    ('    f"{x}"\n', False),
    ("    return (\n", False),  # does not parse
    ("", False),  # no body at all
])
def test_docstring_only(completion: str, want: bool) -> None:
    assert ft._docstring_only(completion) is want


def _row(header: str, completion: str, body: str, complete: bool = True) -> dict:
    return {"header": header, "completion": completion, "reference": header + body, "complete": complete}


def test_shape_of_complete_counts_and_means_exactly() -> None:
    rows = [
        # a docstring alone: 1 line, against a 2-line true body
        _row("def f(x):\n", '    """Only a docstring."""\n', '    """Only a docstring."""\n    return x\n'),
        # a line 3 times (once at another indentation, blank lines skipped): 4 lines against 1
        _row('def g(x):\n    """Doc."""\n', "    y = x\n    y = x\n\n        y = x\n    return y\n",
             "    return x + 1\n"),
        # a line twice is no loop: 3 lines against 3
        _row("def h():\n", "    a = 1\n    a = 1\n    return a\n", "    a = 1\n    b = 2\n    return a + b\n"),
        # not complete: neither its docstring nor its loop counts
        _row("def k():\n", '    """x"""\n' * 3, "    return 0\n", complete=False),
    ]
    assert ft.shape_of_complete(rows) == {"complete_mean_lines": 2.67, "reference_mean_lines": 2.0,
                                          "complete_docstring_only": 1, "complete_with_repeated_line": 1}
    assert ft.shape_of_complete(rows[1:2]) == {"complete_mean_lines": 4.0, "reference_mean_lines": 1.0,
                                               "complete_docstring_only": 0, "complete_with_repeated_line": 1}
    nothing = {"complete_mean_lines": 0.0, "reference_mean_lines": 0.0, "complete_docstring_only": 0,
               "complete_with_repeated_line": 0}
    assert ft.shape_of_complete(rows[3:]) == nothing and ft.shape_of_complete([]) == nothing

    scored = [{**r, "stop": "dedent" if r["complete"] else "length", "parses": True} for r in rows]
    summary = ft.summarize(scored, "valid", 64)
    assert {k: summary[k] for k in ft.shape_of_complete(rows)} == ft.shape_of_complete(rows)
    assert (summary["complete_rate"], summary["parse_rate"]) == (0.75, 1.0)
    assert summary["stops"] == {"dedent": 3, "length": 1}
