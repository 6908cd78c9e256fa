"""kernels/spec: the DSpark drafter's greedy left-to-right steps in one launch against ref.py's loop. Tokens
exactly (ties to the lowest index, as torch.argmax), confidences to fp32 rounding; vocabularies that are not a
multiple of the tile, k = 1 and 7, the Markov and copy heads on and off, planted ties within and across tiles.

Without a GPU the kernel runs in the Triton interpreter (conftest.py), at small vocabularies.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.kernels.spec import DraftHeads, greedy_draft, greedy_draft_ref  # noqa: E402
from tests.kernels.helpers import DEV  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py

H = 6  # the draft-state columns of the confidence layer, which conf_pre already covers


def _inputs(seed: int, B: int, K: int, V: int, R: int, C: int, copy: bool) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(C, H + R + int(copy), generator=g)  # the confidence hidden layer [C, state | code | top]
    heads = DraftHeads(markov_in=torch.randn(V, R, generator=g) if R else None,
                       markov_out=torch.randn(V, R, generator=g) if R else None,
                       conf_prev=w[:, H:H + R] if R else None, conf_top=w[:, H + R] if copy else None,
                       conf_out=torch.randn(C, generator=g), conf_out_bias=torch.randn(1, generator=g))
    base = torch.randn(B, K, V, generator=g) * 3
    cp = gate = None
    if copy:  # a few positions' mass per draft, as copy_probs gives; the last draft has nothing to copy
        cp = torch.zeros(B, K, V).scatter_add_(-1, torch.randint(0, V, (B, K, 4), generator=g),
                                               torch.softmax(torch.randn(B, K, 4, generator=g), -1))
        cp[:, -1] = 0
        gate = torch.rand(B, K, generator=g)
    args = (base, torch.randint(0, V, (B,), generator=g), torch.randn(B, K, C, generator=g), heads, cp, gate)
    return tuple(_to_dev(a) for a in args)


def _to_dev(a):
    if isinstance(a, DraftHeads):
        return DraftHeads(*(None if t is None else t.to(DEV) for t in (a.markov_in, a.markov_out, a.conf_prev,
                                                                         a.conf_top, a.conf_out, a.conf_out_bias)))
    return None if a is None else a.to(DEV)


SPLIT = [pytest.param(False, id="one-program"), pytest.param(True, id="split")]


def _same(args: tuple, split: bool | None = None) -> Tensor:
    tokens, conf = greedy_draft(*args, split=split)
    want_tokens, want_conf = greedy_draft_ref(*args)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-6)
    return tokens


@pytest.mark.parametrize("B,K,V,R,copy,tile", [
    pytest.param(3, 7, 1100, 32, True, None, id="k7-V1100-markov32-copy"),  # 2 tiles of 1024, the last partial
    pytest.param(2, 7, 1100, 32, True, (256, 8), id="k7-V1100-markov32-copy-tile256"),  # 5 tiles
    pytest.param(2, 7, 1100, 4, False, (512, 16), id="k7-V1100-markov4-tile512"),
    pytest.param(2, 1, 1100, 0, False, None, id="k1-V1100-plain"),
    pytest.param(2, 1, 300, 5, True, None, id="k1-V300-markov5-copy"),  # one tile of 512
    pytest.param(1, 7, 70, 0, True, None, id="k7-V70-copy-only"),
])
@pytest.mark.parametrize("split", SPLIT)
def test_kernel_matches_ref(B, K, V, R, copy, tile, split):
    """Both forms: one program per request (tiles of BLOCK_V walked in order), and the split form, where the
    tile is one program's slice (V 1100 in slices of 1024: 2 programs, of 256: 5)."""
    args = _inputs(B * 100 + V + R, B, K, V, R, 8 if R != 32 else 64, copy)
    tokens, conf = greedy_draft(*args, tile=tile, split=split)
    want_tokens, want_conf = greedy_draft_ref(*args)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-6)
    assert tokens.min() >= 0 and tokens.max() < V


@pytest.mark.parametrize("R,copy", [pytest.param(0, False, id="plain"), pytest.param(3, False, id="markov"),
                                    pytest.param(3, True, id="markov-copy")])
@pytest.mark.parametrize("split", SPLIT)
def test_ties_go_to_the_lowest_index(R, copy, split):
    """Planted exact ties (tiles of 1024 here; the split form's slices of 512: 600 vs 601 within one, the rest
    across slices): within one tile (600 vs 601, 5 vs 700) and across tiles (5 vs 1050, 900 vs 1090); the Markov rows of tied tokens are equal so the bias keeps them tied; with the copy
    head, draft 0's tied tokens also get equal copy mass."""
    base, anchors, pre, heads, cp, gate = _inputs(7, 2, 3, 1100, R, 8, copy)
    top = base.abs().max() + 50
    base[0, 0, [600, 601]] = top
    base[0, 1, [5, 700, 1050]] = top
    base[1, :, [900, 1090]] = top
    if R:
        for tied in ([600, 601], [5, 700, 1050], [900, 1090]):
            heads.markov_out[tied] = heads.markov_out[tied[0]].clone()
    if copy:
        cp[0, 0] = 0
        cp[0, 0, [600, 601]] = 0.5
        gate.zero_()  # the other drafts: the logits' ties through the softmax
        gate[0, 0] = 0.9
    tokens = _same((base, anchors, pre, heads, cp, gate), split)
    assert tokens[0, :2].tolist() == [600, 5] and tokens[1].tolist() == [900] * 3


@pytest.mark.parametrize("split", SPLIT)
def test_copy_mass_and_gate_decide_the_mixed_argmax(split):
    """An open gate on a draft with copy mass picks the copied token over the logits' argmax; the same gate on
    a draft with no mass leaves the logits' argmax (the mass check, not the gate, decides)."""
    base, anchors, pre, heads, cp, gate = _inputs(11, 1, 2, 200, 0, 8, True)
    base[0, :, 17] = base.abs().max() + 5
    cp.zero_()
    cp[0, 0, 40] = 1.0
    gate.fill_(0.99)
    assert _same((base, anchors, pre, heads, cp, gate), split)[0].tolist() == [40, 17]


def test_contract_errors_name_the_field():
    base, anchors, pre, heads, cp, gate = _inputs(1, 2, 3, 64, 4, 8, True)
    with pytest.raises(ValueError, match="anchor_ids"):
        greedy_draft(base, anchors.int(), pre, heads, cp, gate)
    with pytest.raises(ValueError, match="conf_pre"):
        greedy_draft(base, anchors, pre[:, :2], heads, cp, gate)
    with pytest.raises(ValueError, match="copy, gate"):
        greedy_draft(base, anchors, pre, heads, cp, None)
    with pytest.raises(ValueError, match="heads.markov_out"):
        greedy_draft(base, anchors, pre, replace(heads, markov_out=heads.markov_out[:10]), cp, gate)
    with pytest.raises(ValueError, match="base"):
        greedy_draft(base.double(), anchors, pre, heads, cp, gate)
    with pytest.raises(ValueError, match="tile"):
        greedy_draft(base, anchors, pre, heads, cp, gate, tile=(100, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-tables"])
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("split", SPLIT)
def test_kernel_matches_ref_at_k3_tiny_shape(table_dtype, B, split):
    """k3-tiny's drafter shape (V 8192, rank 32, confidence width 64, k 7, copy head) at batch 1 and 64 on CUDA; with
    bf16 tables both round the Markov bias to bf16, so tokens still agree exactly."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    base, anchors, pre, heads, cp, gate = _inputs(5, B, 7, 8192, 32, 64, True)
    heads = DraftHeads(*(None if t is None else t.to(table_dtype) for t in (
        heads.markov_in, heads.markov_out, heads.conf_prev, heads.conf_top, heads.conf_out, heads.conf_out_bias)))
    _same((base, anchors, pre.to(table_dtype), heads, cp, gate), split)
