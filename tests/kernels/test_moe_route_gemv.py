"""kernels/moe moe_route_gemv (session 46, KernelConfig.moe_route_in_gemv): one token's router GEMV and top-k in one
launch, the top-k in the program that arrives last. It must give the two-launch path's bits (skinny_linear's unrolled
form, then moe_route), leave its counter zero, and refuse what it does not take. CPU: the interpreter, whose programs
run one after another (so a top-k done by any program but the last would see missing logits)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.linear import pick_unrolled, skinny_linear, unrolled_tiles  # noqa: E402
from k3rt.kernels.moe import moe_route, moe_route_gemv  # noqa: E402
from k3rt.kernels.moe.ref import route_ref  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA  # noqa: E402


def _case(E: int, D: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, D, generator=gen).to(dtype).to(DEV)
    gate = (torch.randn(E, D, generator=gen) * D ** -0.5).to(DEV)
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEV)
    return x, gate, bias


def _two_launches(x, gate, bias, tiles, **how):
    return moe_route(skinny_linear(x, gate, out_dtype=torch.float32, tiles=tiles), bias, **how)


@pytest.mark.parametrize("E,D,k,dtype", [(64, 96, 6, torch.float16), (40, 600, 8, torch.float16),
                                         (37, 96, 5, torch.float32)],
                         ids=["4_rows_a_program", "1_row_masked_tail", "fp32_odd_E"])
def test_one_launch_gives_the_two_launches_bits(E: int, D: int, k: int, dtype: torch.dtype) -> None:
    """The same ids and weights, bit for bit, as the router's unrolled GEMV and moe_route, and the oracle's ids;
    the counter is zero after each launch, so a second launch (a replayed graph's) gives them again."""
    x, gate, bias = _case(E, D, dtype, seed=E + D)
    tiles = pick_unrolled(E, D)
    how = dict(top_k=k, renormalize=True, scaling=2.5)
    ctr = torch.zeros(1, dtype=torch.int32, device=DEV)
    w, ids = moe_route_gemv(x, gate, bias, ctr, tiles=tiles, **how)
    w2, ids2 = _two_launches(x, gate, bias, tiles, **how)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    _, ids_ref = route_ref(x.float() @ gate.t(), bias, top_k=k, num_expert_group=1, topk_group=1, renormalize=True,
                           scaling=2.5)
    assert torch.equal(ids, ids_ref)
    assert int(ctr.item()) == 0
    out_w, out_ids = torch.empty_like(w), torch.empty_like(ids)
    moe_route_gemv(x, gate, bias, ctr, tiles=tiles, out_weights=out_w, out_ids=out_ids, **how)
    assert torch.equal(out_ids, ids) and torch.equal(out_w, w) and int(ctr.item()) == 0


def test_every_row_count_of_the_unrolled_form() -> None:
    """Its rows a program are the tiles' (1, 2 and 4 here, E = 30 leaving a partial last program at 4)."""
    x, gate, bias = _case(30, 64, torch.float16, seed=5)
    for rows in (1, 2, 4):
        tiles = unrolled_tiles(rows)
        ctr = torch.zeros(1, dtype=torch.int32, device=DEV)
        w, ids = moe_route_gemv(x, gate, bias, ctr, tiles=tiles, top_k=4)
        w2, ids2 = _two_launches(x, gate, bias, tiles, top_k=4)
        assert torch.equal(ids, ids2) and torch.equal(w, w2), rows


def test_it_refuses_what_it_does_not_take() -> None:
    x, gate, bias = _case(16, 64, torch.float16, seed=1)
    ctr, tiles, kw = torch.zeros(1, dtype=torch.int32, device=DEV), unrolled_tiles(1), dict(top_k=2)
    with pytest.raises(ValueError, match=r"x must be one float row \[1, D\]"):
        moe_route_gemv(x.expand(2, 64), gate, bias, ctr, tiles=tiles, **kw)
    with pytest.raises(ValueError, match="tiles must be the unrolled form's"):
        moe_route_gemv(x, gate, bias, ctr, tiles=None, **kw)
    with pytest.raises(ValueError, match="counter"):
        moe_route_gemv(x, gate, bias, torch.zeros(1, dtype=torch.int64, device=DEV), tiles=tiles, **kw)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=16\]"):
        moe_route_gemv(x, gate, bias, ctr, tiles=tiles, top_k=17)
    with pytest.raises(ValueError, match=r"gate_weight must be a float \[E, D=64\]"):
        moe_route_gemv(x, gate[:, :60], bias, ctr, tiles=tiles, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_route_gemv_at_the_48b_shape_in_a_replayed_graph() -> None:
    """The 48B's router (256 x 2304 fp32, bf16 x, top 8) in a CUDA graph with PDL, replayed with new rows: the
    two-launch path's bits each time (the last-arriving program's reads of the others' logits), the counter zero."""
    x, gate, bias = _case(256, 2304, torch.bfloat16, seed=48)
    tiles = pick_unrolled(256, 2304)
    how = dict(top_k=8, renormalize=True, scaling=2.446)
    ctr = torch.zeros(1, dtype=torch.int32, device=DEV)
    w, ids = torch.empty(1, 8, device=DEV), torch.empty(1, 8, dtype=torch.int32, device=DEV)
    moe_route_gemv(x, gate, bias, ctr, tiles=tiles, out_weights=w, out_ids=ids, use_pdl=True, **how)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_route_gemv(x, gate, bias, ctr, tiles=tiles, out_weights=w, out_ids=ids, use_pdl=True, **how)
    for seed in range(3):
        x.copy_(torch.randn(1, 2304, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        w2, ids2 = _two_launches(x, gate, bias, tiles, **how)
        assert torch.equal(ids, ids2) and torch.equal(w, w2), seed
        assert int(ctr.item()) == 0
