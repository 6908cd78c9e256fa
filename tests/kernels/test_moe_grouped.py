"""The grouped-GEMM routed experts (kernels/moe/grouped.py) against the oracle: its row layout, routed and
shared experts, skewed routing, and on the GPU the 48B shape inside a CUDA graph.

Without a GPU the Triton parts run in the interpreter and torch._grouped_mm takes its CPU loop (fp32)."""
from __future__ import annotations

import pytest
import torch

from k3rt.kernels.moe.grouped import fused_experts_grouped, group_layout
from k3rt.kernels.moe.ref import fused_experts_ref
from k3rt.model_config import ActivationConfig
from tests.kernels.helpers import DEV, HAS_CUDA, rel_err
from tests.kernels.test_moe_triton import ACTS, experts_case, gpu_case, random_ids

pytestmark = pytest.mark.usefixtures("poison_outputs")


def test_group_layout_rows_cover_every_pair_once_in_expert_order() -> None:
    """offs are the padded group ends (routed experts, then one group of T rows per shared expert right after the
    routed rows in use); every pair's row lies in its expert's group and holds that pair's token."""
    gen = torch.Generator().manual_seed(3)
    T, k, E, S = 11, 3, 6, 2
    ids = random_ids(gen, T, E, k).to(DEV)
    offs, tok, rows, used = group_layout(ids, E, S, T)
    offs, tok, rows, used = offs.cpu(), tok.cpu(), rows.cpu(), int(used)
    counts = torch.bincount(ids.cpu().long().view(-1), minlength=E)
    padded = (counts + 15) // 16 * 16
    assert offs[:E].tolist() == torch.cumsum(padded, 0).tolist()
    assert used == int(padded.sum())
    assert offs[E:].tolist() == [used + T, used + 2 * T]
    assert sorted(rows.tolist()) == sorted(set(rows.tolist()))  # distinct rows
    for p, r in enumerate(rows.tolist()):
        t, e = p // k, int(ids.view(-1)[p])
        start = 0 if e == 0 else int(offs[e - 1])
        assert start <= r < int(offs[e]) and int(tok[r]) == t
    for s in range(S):
        assert tok[used + s * T:used + (s + 1) * T].tolist() == list(range(T))


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("T", [1, 5, 40])
def test_grouped_matches_ref(T: int, act: str) -> None:
    gen = torch.Generator().manual_seed(300 + T)
    case = experts_case(gen, T, E=8, k=2, D=32, inter=16, dtype=torch.float32)
    out = fused_experts_grouped(**case, act=ACTS[act])
    assert out.shape == (T, 32) and out.dtype == torch.float32
    assert rel_err(out, fused_experts_ref(**case, act=ACTS[act])) <= 1e-5


@pytest.mark.parametrize("shared", [1, 2])
def test_grouped_shared_experts_and_skewed_routing(shared: int) -> None:
    """Shared experts after the routed rows in use; most pairs on one expert, some experts with none; a zero
    routing weight (expert parallelism's pairs of other ranks) adds nothing."""
    gen = torch.Generator().manual_seed(400 + shared)
    T = 37
    case = experts_case(gen, T, E=8 + shared, k=2, D=32, inter=16, dtype=torch.float32, experts=8)
    case["topk_ids"][: T - 5, 0] = 3
    case["topk_ids"][: T - 5, 1] = 5
    case["topk_weights"][::4, 1] = 0.0
    act = ACTS["situ_lin"]
    out = fused_experts_grouped(**case, act=act, shared_experts=shared)
    assert rel_err(out, fused_experts_ref(**case, act=act, shared_experts=shared)) <= 1e-5
    buf = torch.empty_like(case["x"])
    assert fused_experts_grouped(**case, act=act, shared_experts=shared, out=buf) is buf
    assert torch.equal(buf, out)


def test_grouped_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    case = experts_case(gen, 4, E=8, k=2, D=32, inter=16, dtype=torch.float32)
    act = ActivationConfig("silu")
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_experts_grouped(**dict(case, w2=case["w2"][:, :16]), act=act)
    with pytest.raises(ValueError, match="w2 must be contiguous"):
        fused_experts_grouped(**dict(case, w2=case["w2"].transpose(1, 2).contiguous().transpose(1, 2)), act=act)
    with pytest.raises(ValueError, match="topk_ids must be"):
        fused_experts_grouped(**dict(case, topk_ids=case["topk_ids"][:3]), act=act)
    with pytest.raises(ValueError, match="shared_experts must be in"):
        fused_experts_grouped(**case, act=act, shared_experts=8)
    empty = dict(case, x=case["x"][:0], topk_weights=case["topk_weights"][:0], topk_ids=case["topk_ids"][:0])
    assert fused_experts_grouped(**empty, act=act).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [64, 2048])
@pytest.mark.parametrize("shared", [0, 1])
def test_gpu_grouped_48b_in_a_graph(T: int, shared: int) -> None:
    """The 48B's expert shape in bf16 against the oracle, eager and replayed from a CUDA graph (no host sync)."""
    case = gpu_case(T, seed=T + 1)
    if shared:
        case["topk_ids"] = case["topk_ids"] % 255
    act = ACTS["silu"]
    ref = fused_experts_ref(**case, act=act, shared_experts=shared)
    out = fused_experts_grouped(**case, act=act, shared_experts=shared)
    assert rel_err(out, ref) <= 1e-2
    buf = torch.empty_like(out)
    fused_experts_grouped(**case, act=act, shared_experts=shared, out=buf)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts_grouped(**case, act=act, shared_experts=shared, out=buf)
    buf.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf, out)
