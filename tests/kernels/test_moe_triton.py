"""The Triton MoE kernels (router top-k, expert alignment, fused experts) agree with kernels/moe/ref.py.

Without a GPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py
before the kernel modules are imported): tiny fp32 shapes (E=8, k=2, D=32, I=16). The `gpu` cases run
the compiled kernels at the Kimi-Linear-48B shape (E=256, k=8, D=2304, I=1024, bf16).
"""
from __future__ import annotations

from dataclasses import replace

from pathlib import Path

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.kernels.moe import ExpertTiles, fused_experts, moe_align_fwd, moe_route  # noqa: E402
from k3rt.kernels.moe.ref import align_ref, fused_experts_ref, route_ref  # noqa: E402
from k3rt.kernels.moe.triton_align import (  # noqa: E402
    CHUNK, group_table_sizes, moe_align_grouped, num_blocks_max)
from k3rt.kernels.moe.triton_experts import DECODE_CANDIDATES, PREFILL_CANDIDATES  # noqa: E402
from k3rt.model_config import ActivationConfig  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA, rel_err, run_benchmark_smoke  # noqa: E402

ACTS = {
    "silu": ActivationConfig("silu"),
    "situ_lin": ActivationConfig("situ", 4.0, 25.0),
    "situ": ActivationConfig("situ", 1.5, None),
}

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py


def random_ids(gen: torch.Generator, T: int, E: int, k: int, experts: int | None = None) -> Tensor:
    """[T, k] int32 distinct experts per token, drawn from the first `experts` (default all E)."""
    n = experts or E
    rows = [torch.randperm(n, generator=gen)[:k] for _ in range(T)]
    return torch.stack(rows).int() if rows else torch.empty(0, k, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# router


ROUTES = {
    "E8_k2_plain": dict(E=8, top_k=2, num_expert_group=1, topk_group=1, renormalize=True, scaling=2.446),
    "E8_k2_grouped2": dict(E=8, top_k=2, num_expert_group=2, topk_group=1, renormalize=True, scaling=2.5),
    "E12_k3_grouped3_norenorm": dict(E=12, top_k=3, num_expert_group=3, topk_group=2, renormalize=False,
                                     scaling=1.0),
    "E40_k8_grouped4": dict(E=40, top_k=8, num_expert_group=4, topk_group=2, renormalize=True, scaling=1.7),
}


@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("case", list(ROUTES))
def test_route_matches_ref(case: str, T: int) -> None:
    c = dict(ROUTES[case])
    E = c.pop("E")
    gen = torch.Generator().manual_seed(T * 31 + E)
    logits = (torch.randn(T, E, generator=gen) * 2).to(DEV)
    bias = (torch.randn(E, generator=gen) * 0.5).to(DEV)
    w, ids = moe_route(logits, bias, **c)
    w_ref, ids_ref = route_ref(logits, bias, **c)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (T, c["top_k"])
    assert torch.equal(ids, ids_ref)
    assert rel_err(w, w_ref) <= 1e-6


def test_route_bias_changes_selection_strided_logits_and_out_buffers() -> None:
    gen = torch.Generator().manual_seed(11)
    T, E, k = 7, 8, 2
    wide = torch.randn(T, E + 5, generator=gen).to(DEV)
    logits = wide[:, 2:2 + E]  # row stride E + 5
    bias = torch.zeros(E, device=DEV)
    bias[5] = 3.0  # forces expert 5 first in every row, with its un-biased weight
    out_w = torch.full((T, k), float("nan"), device=DEV)
    out_ids = torch.full((T, k), -1, dtype=torch.int32, device=DEV)
    w, ids = moe_route(logits, bias, top_k=k, renormalize=False, scaling=1.0, out_weights=out_w, out_ids=out_ids)
    assert w.data_ptr() == out_w.data_ptr() and ids.data_ptr() == out_ids.data_ptr()
    assert (ids[:, 0] == 5).all()
    assert rel_err(w[:, 0], torch.sigmoid(logits[:, 5])) <= 1e-6
    w_ref, ids_ref = route_ref(logits, bias, top_k=k, num_expert_group=1, topk_group=1, renormalize=False,
                               scaling=1.0)
    assert torch.equal(ids, ids_ref) and rel_err(w, w_ref) <= 1e-6


def test_route_rejects_bad_inputs() -> None:
    logits = torch.randn(3, 8, device=DEV)
    bias = torch.zeros(8, device=DEV)
    kw = dict(top_k=2, num_expert_group=1, topk_group=1, renormalize=True, scaling=1.0)
    with pytest.raises(ValueError, match="logits must be fp32"):
        moe_route(logits.half(), bias, **kw)
    with pytest.raises(ValueError, match="bias must have shape"):
        moe_route(logits, torch.zeros(7, device=DEV), **kw)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, bias, **{**kw, "top_k": 9})
    with pytest.raises(ValueError, match="num_expert_group"):
        moe_route(logits, bias, **{**kw, "num_expert_group": 3})
    with pytest.raises(ValueError, match="topk_group"):
        moe_route(logits, bias, **{**kw, "top_k": 5, "num_expert_group": 2, "topk_group": 1})
    with pytest.raises(ValueError, match="out_ids must be"):
        moe_route(logits, bias, **kw, out_ids=torch.empty(3, 2, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match=r"E must be in \[1, 512\]"):
        moe_route(torch.randn(2, 513, device=DEV), torch.zeros(513, device=DEV), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T,E,D,k", [(1, 8, 384, 2), (16, 12, 200, 3), (3, 64, 512, 6)], ids=str)
def test_route_from_x_matches_the_logits_route(T: int, E: int, D: int, k: int, dtype: torch.dtype) -> None:
    """The small router's logits in the top-k launch (k3-tiny's 8 x 384, a D that is no multiple of the tile, the
    [E, D] bound) select what the router GEMM's fp32 logits select, with the same weights; x's rows strided."""
    from k3rt.kernels.moe import moe_route_from_x

    gen = torch.Generator().manual_seed(T * 7 + E)
    wide = torch.randn(T, D + 8, generator=gen).to(dtype).to(DEV)
    x = wide[:, 8:]
    gate = (torch.randn(E, D, generator=gen) * D ** -0.5).to(DEV)
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEV)
    c = dict(top_k=k, num_expert_group=1, topk_group=1, renormalize=True, scaling=2.5)
    w, ids = moe_route_from_x(x, gate, bias, **c)
    w_ref, ids_ref = route_ref(x.float() @ gate.t(), bias, **c)
    assert torch.equal(ids, ids_ref) and rel_err(w, w_ref) <= 1e-5


def test_route_from_x_rejects_what_it_does_not_fit() -> None:
    from k3rt.kernels.moe import fused_router_fits, moe_route_from_x

    assert fused_router_fits(1, 8, 384) and fused_router_fits(16, 64, 512)
    assert not fused_router_fits(17, 8, 384) and not fused_router_fits(1, 256, 2304)
    assert not fused_router_fits(1, 8, 384, num_expert_group=2)
    bias, kw = torch.zeros(8, device=DEV), dict(top_k=2)
    with pytest.raises(ValueError, match="past fused_router_fits"):
        moe_route_from_x(torch.randn(17, 384, device=DEV), torch.randn(8, 384, device=DEV), bias, **kw)
    with pytest.raises(ValueError, match=r"gate_weight must be a float \[E, D=384\]"):
        moe_route_from_x(torch.randn(1, 384, device=DEV), torch.randn(8, 380, device=DEV), bias, **kw)
    with pytest.raises(ValueError, match="gate_weight must be contiguous"):
        moe_route_from_x(torch.randn(1, 384, device=DEV), torch.randn(384, 8, device=DEV).t(), bias, **kw)


# --------------------------------------------------------------------------------------------
# alignment


@pytest.mark.parametrize(
    "T,k,E,block_m,experts",
    [(1, 2, 8, 16, None), (5, 2, 8, 16, None), (33, 2, 8, 16, 3), (33, 2, 5, 64, None),
     (CHUNK // 2 + 7, 2, 8, 16, None), (2 * CHUNK + 3, 1, 6, 32, 4), (16, 8, 256, 16, None), (64, 8, 256, 16, 40),
     (300, 8, 256, 64, None)],
    ids=["T1", "T5", "T33_3experts", "T33_E5_bm64", "two_chunks", "three_chunks_empty_experts", "T16_k8_E256",
         "T64_k8_E256_40experts", "five_chunks_k8_E256_bm64"],
)
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-program"])
def test_align_matches_ref(T: int, k: int, E: int, block_m: int, experts: int | None, split: bool) -> None:
    """Both single-chunk forms (one program; the chunk's work over programs of SPLIT_PAIRS pairs) and both
    multi-chunk ones (the offsets in one program; one program per chunk placing its share)."""
    gen = torch.Generator().manual_seed(T + E)
    ids = random_ids(gen, T, E, k, experts).to(DEV)
    sorted_ids, block_expert = moe_align_fwd(ids, E, block_m, split=split)
    nb = num_blocks_max(T * k, E, block_m)
    assert sorted_ids.shape == (nb * block_m,) and block_expert.shape == (nb,)
    ref_sorted, ref_blocks = align_ref(ids.cpu(), E, block_m)
    used = len(ref_blocks)
    assert block_expert[:used].tolist() == ref_blocks
    assert (block_expert[used:] == -1).all()
    assert sorted_ids[:used * block_m].tolist() == ref_sorted


def group_tables_ref(block_experts: list[int], group: int) -> tuple[list[int], list[int]]:
    """The grouped tables from align_ref's block experts: per expert run of n blocks from block b, the big tiles'
    first blocks b, b + group, ... (n // group of them), then its n % group leftover blocks as small tiles."""
    big, small, b = [], [], 0
    while b < len(block_experts):
        n = 1
        while b + n < len(block_experts) and block_experts[b + n] == block_experts[b]:
            n += 1
        big += [b + group * m for m in range(n // group)]
        small += list(range(b + (n // group) * group, b + n))
        b += n
    return big, small


@pytest.mark.parametrize(
    "T,k,E,block_m,group,experts",
    [(5, 2, 8, 16, 2, None), (64, 8, 256, 16, 4, 40), (CHUNK // 2 + 7, 2, 8, 16, 2, None),
     (2 * CHUNK + 3, 1, 6, 32, 4, 4), (300, 8, 256, 64, 2, None), (600, 8, 16, 16, 8, None)],
    ids=["T5_g2", "one_chunk_E256_g4", "two_chunks_g2", "three_chunks_empty_experts_g4", "five_chunks_E256_g2",
         "ten_chunks_E16_g8"],
)
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-program"])
def test_align_grouped_tables_match_ref(T: int, k: int, E: int, block_m: int, group: int, experts: int | None,
                                        split: bool) -> None:
    """moe_align_grouped: the same layout as moe_align_fwd, and each expert's run cut into tiles of `group`
    blocks (big) and its leftover blocks (small), in every alignment form, -1 past the used entries."""
    gen = torch.Generator().manual_seed(T + E + group)
    ids = random_ids(gen, T, E, k, experts).to(DEV)
    sorted_ids, block_expert, big, small = moe_align_grouped(ids, E, block_m, group, split=split)
    nb = num_blocks_max(T * k, E, block_m)
    assert (big.numel(), small.numel()) == group_table_sizes(nb, E, group)
    ref_sorted, ref_blocks = align_ref(ids.cpu(), E, block_m)
    used = len(ref_blocks)
    assert block_expert[:used].tolist() == ref_blocks and sorted_ids[:used * block_m].tolist() == ref_sorted
    ref_big, ref_small = group_tables_ref(ref_blocks, group)
    assert big[:len(ref_big)].tolist() == ref_big and (big[len(ref_big):] == -1).all()
    assert small[:len(ref_small)].tolist() == ref_small and (small[len(ref_small):] == -1).all()


def test_align_grouped_rejects_a_bad_group() -> None:
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="group must be a power of two >= 2, got 3"):
        moe_align_grouped(ids, 8, 16, 3)


# --------------------------------------------------------------------------------------------
# fused experts


def experts_case(gen: torch.Generator, T: int, E: int, k: int, D: int, inter: int, dtype: torch.dtype,
                 experts: int | None = None) -> dict:
    return dict(
        x=torch.randn(T, D, generator=gen).to(dtype).to(DEV),
        w13=(torch.randn(E, 2 * inter, D, generator=gen) * D ** -0.5).to(dtype).to(DEV),
        w2=(torch.randn(E, D, inter, generator=gen) * inter ** -0.5).to(dtype).to(DEV),
        topk_weights=torch.rand(T, k, generator=gen).to(DEV) + 0.1,
        topk_ids=random_ids(gen, T, E, k, experts).to(DEV),
    )


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("T", [1, 5, 33])
def test_fused_experts_matches_ref(T: int, act: str) -> None:
    gen = torch.Generator().manual_seed(100 + T)
    case = experts_case(gen, T, E=8, k=2, D=32, inter=16, dtype=torch.float32)
    out = fused_experts(**case, act=ACTS[act])
    ref = fused_experts_ref(**case, act=ACTS[act])
    assert out.shape == (T, 32) and out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("shared", [1, 2])
@pytest.mark.parametrize("T", [1, 20])
def test_fused_experts_shared_experts_after_the_routed_ones(T: int, shared: int) -> None:
    """The last S experts run every token with weight 1 (blocks outside the alignment): equal to the
    oracle's extra slots, and to the routed sum plus each shared expert's own output."""
    gen = torch.Generator().manual_seed(200 + T + shared)
    case = experts_case(gen, T, E=8 + shared, k=2, D=32, inter=16, dtype=torch.float32, experts=8)
    act = ACTS["silu"]
    tiles = ExpertTiles(16, 16, 16, 16, 16, 4, 4, 1)  # T=20: two shared blocks per shared expert
    out = fused_experts(**case, act=act, shared_experts=shared, tiles=tiles)
    ref = fused_experts_ref(**case, act=act, shared_experts=shared)
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(fused_experts(**case, act=act, shared_experts=shared, tiles=replace(tiles, tma=True)), out)
    routed = fused_experts_ref(**case, act=act).float()
    for s in range(shared):
        one = dict(case, topk_ids=torch.full((T, 1), 8 + s, dtype=torch.int32, device=DEV),
                   topk_weights=torch.ones(T, 1, device=DEV))
        routed += fused_experts_ref(**one, act=act).float()
    assert rel_err(out, routed) <= 1e-5
    with pytest.raises(ValueError, match="shared_experts must be in"):
        fused_experts(**case, act=act, shared_experts=8 + shared)


def _sum_norm_case(monkeypatch, path: str, seed: int):
    """(T, generator, experts case, act, norm weight) of the sum-epilogue tests: fp16, D 32; one token for the
    one-token path; NORM_MAX_D below D for wide_rows (the norm kernel after the sum)."""
    import k3rt.kernels.moe.triton_experts as te

    T = 1 if path in ("one_token", "gemv") else 5
    if path == "wide_rows":
        monkeypatch.setattr(te, "NORM_MAX_D", 16)
    gen = torch.Generator().manual_seed(seed + T)
    case = experts_case(gen, T, E=8, k=2, D=32, inter=16, dtype=torch.float16)
    return T, gen, case, ACTS["situ"], (torch.rand(32, generator=gen) + 0.5).half().to(DEV)


@pytest.mark.parametrize("path", ["grouped", "one_token", "gemv", "wide_rows"])
def test_fused_experts_norm_equals_the_norm_kernel_after_the_sum(monkeypatch, path: str) -> None:
    """LatentMoE's routed_expert_norm in the experts' sum launch (`norm=`): bit-identical in fp16 to the sum
    rounded to x's dtype and then kernels/norm's rms_norm, written into a strided out (the latent tail's input
    columns). The one-token path's sum splits rows and the rows past NORM_MAX_D do not fit one program: both
    run the norm kernel after instead, with the same result."""
    from k3rt.kernels.norm import rms_norm

    T, gen, case, act, weight = _sum_norm_case(monkeypatch, path, seed=77)
    want = rms_norm(fused_experts(**case, act=act), weight, 1e-5)
    wide = torch.full((T, 48), float("nan"), dtype=torch.float16, device=DEV)
    got = fused_experts(**case, act=act, out=wide[:, 16:], norm=(weight, 1e-5), one_token=path == "one_token",
                        gemv=path == "gemv")
    if path == "gemv":  # its own fp32 sums: the norm applied to its sum, bit for bit
        want = rms_norm(fused_experts(**case, act=act, gemv=True), weight, 1e-5)
    assert got.data_ptr() == wide[:, 16:].data_ptr() and torch.equal(got, want)
    assert wide[:, :16].isnan().all()
    with pytest.raises(ValueError, match="norm weight must have shape"):
        fused_experts(**case, act=act, norm=(weight[:16], 1e-5))


@pytest.mark.parametrize("path", ["grouped", "one_token", "gemv", "wide_rows", "in_place"])
def test_fused_experts_residual_add_and_norm_equal_the_norm_kernel_after_the_sum(monkeypatch, path: str) -> None:
    """`norm=SumNorm(weight, eps, residual, residual_out)`: the decoder layer's residual add and its next norm in
    the experts' sum launch, bit-identical in fp16 to the sum and then kernels/norm's rms_norm(residual=): the normed
    rows returned (into out), the new residual stream in residual_out (which may be the residual itself). The
    one-token path and rows past NORM_MAX_D take the norm kernel after, with the same result."""
    from k3rt.kernels.moe.triton_experts import SumNorm
    from k3rt.kernels.norm import rms_norm

    T, gen, case, act, weight = _sum_norm_case(monkeypatch, path, seed=91)
    residual = torch.randn(T, 32, generator=gen).half().to(DEV)
    want, want_h = rms_norm(fused_experts(**case, act=act, gemv=path == "gemv"), weight, 1e-5, residual=residual)
    h_out = residual.clone() if path == "in_place" else torch.full_like(residual, float("nan"))
    r_in = h_out if path == "in_place" else residual
    got = fused_experts(**case, act=act, norm=SumNorm(weight, 1e-5, r_in, h_out), one_token=path == "one_token",
                        gemv=path == "gemv")
    assert torch.equal(got, want) and torch.equal(h_out, want_h)
    with pytest.raises(ValueError, match="residual and residual_out must be given together"):
        fused_experts(**case, act=act, norm=SumNorm(weight, 1e-5, residual))
    with pytest.raises(ValueError, match="norm residual must have shape"):
        fused_experts(**case, act=act, norm=SumNorm(weight, 1e-5, residual[:, :16], h_out))


@pytest.mark.parametrize("shared", [0, 1])
def test_few_tokens_of_small_experts_run_their_pairs_as_blocks(monkeypatch, shared: int) -> None:
    """k3-tiny's verify steps (8 or 16 rows): pairs as blocks of one row (no alignment launch) while the experts'
    weights, read once per pair, stay within PAIR_BLOCKS_MAX_BYTES; a shared expert repeated among the pairs and
    tokens whose pairs share experts; the same outputs as the aligned layout's. Past the bound: the alignment."""
    import k3rt.kernels.moe.triton_experts as te

    gen = torch.Generator().manual_seed(400 + shared)
    case = experts_case(gen, 6, E=4 + shared, k=2, D=32, inter=16, dtype=torch.float32, experts=4)
    act = ACTS["situ"]
    real_align, calls = te.moe_align_fwd, []
    monkeypatch.setattr(te, "moe_align_fwd", lambda *a, **kw: calls.append(1) or real_align(*a, **kw))
    out = fused_experts(**case, act=act, shared_experts=shared)
    assert calls == [] and rel_err(out, fused_experts_ref(**case, act=act, shared_experts=shared)) <= 1e-5
    monkeypatch.setattr(te, "PAIR_BLOCKS_MAX_BYTES", 6 * 2 * 3 * 32 * 16 * 4 - 1)  # one byte short of the pairs'
    aligned = fused_experts(**case, act=act, shared_experts=shared)
    assert calls == [1] and torch.equal(aligned, out)
    assert torch.equal(fused_experts(**case, act=act, shared_experts=shared, pair_blocks_bytes=1 << 30), out)
    assert calls == [1]  # the call's own bound (KernelConfig.moe_pair_blocks_bytes) over the module's
    assert torch.equal(fused_experts(**case, act=act, shared_experts=shared, pair_blocks_bytes=0), out)
    assert calls == [1, 1]


@pytest.mark.parametrize("shared", [0, 1])
def test_one_token_runs_its_pairs_as_blocks_without_the_alignment(monkeypatch, shared: int) -> None:
    """Batch-1 decode: the k pairs are k blocks of one row in slot order (no alignment launch), the same
    outputs as the aligned layout's; also with a repeated expert at weight 0 (expert parallelism's local
    routing gives a slot owned by another rank the token's first local expert)."""
    import k3rt.kernels.moe.triton_experts as te

    gen = torch.Generator().manual_seed(300 + shared)
    case = experts_case(gen, 1, E=8 + shared, k=4, D=32, inter=16, dtype=torch.float32, experts=8)
    act = ACTS["silu"]
    ref = fused_experts_ref(**case, act=act, shared_experts=shared)
    monkeypatch.setattr(te, "PAIR_BLOCKS_MAX_BYTES", 0)  # two tokens: the alignment
    aligned = fused_experts(**dict(case, x=case["x"].repeat(2, 1), topk_weights=case["topk_weights"].repeat(2, 1),
                                   topk_ids=case["topk_ids"].repeat(2, 1)), act=act, shared_experts=shared)

    def no_align(*a, **kw):
        raise AssertionError("one token must not run the alignment")

    monkeypatch.setattr(te, "moe_align_fwd", no_align)
    out = fused_experts(**case, act=act, shared_experts=shared)
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out[0], aligned[0])  # the same per-pair products, summed in the same order
    ids, w = case["topk_ids"].clone(), case["topk_weights"].clone()
    ids[0, 2], w[0, 2] = ids[0, 0], 0.0  # a repeated expert at weight 0
    dup = dict(case, topk_ids=ids, topk_weights=w)
    assert rel_err(fused_experts(**dup, act=act, shared_experts=shared),
                   fused_experts_ref(**dup, act=act, shared_experts=shared)) <= 1e-5


def test_fused_experts_skewed_routing_odd_sizes_prefill_tiles() -> None:
    """All tokens on 3 of 8 experts (5 get none), D and I not multiples of the K tile, wider tiles."""
    gen = torch.Generator().manual_seed(7)
    case = experts_case(gen, 37, E=8, k=2, D=40, inter=24, dtype=torch.float32, experts=3)
    act = ACTS["situ_lin"]
    ref = fused_experts_ref(**case, act=act)
    for tiles in (None, ExpertTiles(32, 16, 32, 32, 16, 4, 4, 1), ExpertTiles(32, 16, 32, 32, 16, 4, 4, 1, tma=True)):
        # tma: the weights' tiles past I and D come from the next expert's rows or the zero fill (masked / zero)
        out = fused_experts(**case, act=act, tiles=tiles)
        assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("T,experts,group", [(37, 3, 2), (70, None, 2), (70, 5, 4), (300, None, 4)],
                         ids=["skewed_g2", "spread_g2", "five_experts_g4", "many_chunks_g4"])
def test_fused_experts_grouped_tiles(monkeypatch, T: int, experts: int | None, group: int, shared: int) -> None:
    """ExpertTiles.tail: the runs padded to the tail's 16 rows, tiles of 16 * group rows over their whole groups
    of blocks, the leftovers in a second launch of 16-row tiles; the shared experts' tiles of 16 * group rows after
    the routed rows. Equal to the oracle, with TMA tiles too, and D, I not multiples of the K tiles; the grouped
    alignment is the one that ran."""
    import k3rt.kernels.moe.triton_experts as te

    calls = []
    monkeypatch.setattr(te, "moe_align_grouped", lambda *a, **k: calls.append(a[3]) or moe_align_grouped(*a, **k))
    gen = torch.Generator().manual_seed(400 + T + group + shared)
    case = experts_case(gen, T, E=8 + shared, k=2, D=40, inter=24, dtype=torch.float32, experts=experts or 8)
    act = ACTS["situ_lin"]
    ref = fused_experts_ref(**case, act=act, shared_experts=shared)
    tail = ExpertTiles(16, 16, 16, 16, 16, 4, 4, 1)
    for tma in (False, True):
        tiles = ExpertTiles(16 * group, 16, 32, 32, 16, 4, 4, 1, tma=tma, tail=tail)
        out = fused_experts(**case, act=act, shared_experts=shared, tiles=tiles)
        assert rel_err(out, ref) <= 1e-5, tma
    assert calls == [group, group]


def test_grouped_tiles_pad_each_expert_to_the_tail_block_only() -> None:
    """The point of grouping: 3 experts with 40, 20 and 5 pairs, runs padded to 16 rows: 48 + 32 + 16 = 96 rows, in
    32-row tiles from blocks 0 and 3 and 16-row tiles at blocks 2 and 5 (ungrouped 32-row tiles: 64 + 32 + 32)."""
    ids = torch.tensor([0] * 40 + [1] * 20 + [2] * 5, dtype=torch.int32, device=DEV).view(-1, 1)
    sorted_ids, block_expert, big, small = moe_align_grouped(ids, 4, 16, 2)
    used = (block_expert >= 0).sum().item()
    assert used * 16 == 96
    assert big[big >= 0].tolist() == [0, 3] and small[small >= 0].tolist() == [2, 5]


@pytest.mark.parametrize("path", ["one_token", "gemv"])
@pytest.mark.parametrize("act", ["silu", "situ_lin"])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("D,inter", [(40, 24), (64, 32), (24, 20)], ids=["odd", "even", "short"])
def test_one_token_paths(monkeypatch, path: str, D: int, inter: int, shared: int, act: str) -> None:
    """The one-token paths instead of the grouped GEMMs: one_token (triton_one_token.py: the gate/up and the down
    product of each (slot, column tile) in one program, the partials summed per slot, weighted, rounded and summed
    over the slots in a second launch) and gemv (triton_gemv_experts.py, KernelConfig.moe_gemv, session 45: each
    program a few gate/up or down rows of one slot's expert through rows_dot, then the grouped path's slot sum): the
    oracle's values, with D and I not multiples of the tiles, rows or K step and a shared expert;
    bit-reproducible; the grouped GEMMs do not run."""
    import k3rt.kernels.moe.triton_experts as te

    gen = torch.Generator().manual_seed(500 + D + shared)
    case = experts_case(gen, 1, E=8 + shared, k=4, D=D, inter=inter, dtype=torch.float32, experts=8)
    kw = dict(act=ACTS[act], shared_experts=shared)
    grouped_path = fused_experts(**case, **kw)

    def no_grouped(*a, **k):
        raise AssertionError(f"{path} ran the grouped GEMMs")
    monkeypatch.setattr(te, "align_blocks", no_grouped)
    out = fused_experts(**case, **kw, **{path: True})
    assert rel_err(out, fused_experts_ref(**case, **kw)) <= 1e-5
    assert rel_err(out, grouped_path) <= 1e-5
    assert torch.equal(fused_experts(**case, **kw, **{path: True}), out)


@pytest.mark.parametrize("rows", [(1, 1, 1, 1), (2, 4, 2, 4), (8, 16, 4, 8)])
def test_gemv_experts_per_slot_outputs_at_every_row_count(rows) -> None:
    """The per-slot outputs (routing weight applied, rounded to x's dtype: the grouped path's per-pair rounding)
    against the oracle slot by slot in fp16, at row counts that do and do not divide I = 20 and D = 36."""
    from k3rt.kernels.moe.triton_gemv_experts import gemv_expert_outputs

    gen = torch.Generator().manual_seed(41)
    case = experts_case(gen, 1, E=9, k=3, D=36, inter=20, dtype=torch.float16, experts=8)
    y = gemv_expert_outputs(case["x"], case["w13"], case["w2"], case["topk_weights"], case["topk_ids"], situ=False,
                            beta=1.0, lin_beta=None, shared_experts=1, use_pdl=False, rows=rows)
    for j in range(3):
        one = dict(case, topk_ids=case["topk_ids"][:, j:j + 1].contiguous(),
                   topk_weights=case["topk_weights"][:, j:j + 1].contiguous())
        assert rel_err(y[j:j + 1], fused_experts_ref(**one, act=ACTS["silu"])) <= 2e-3, j
    shared = dict(case, topk_ids=torch.full((1, 1), 8, dtype=torch.int32, device=DEV),
                  topk_weights=torch.ones(1, 1, device=DEV))
    assert rel_err(y[3:4], fused_experts_ref(**shared, act=ACTS["silu"])) <= 2e-3


def test_tma_tiles_fall_back_to_pointer_loads_where_rows_are_not_16_byte_aligned(monkeypatch) -> None:
    """fp16 with D = 36 and I = 20: rows of 72 and 40 bytes, which a TMA descriptor cannot take; the TMA tiles
    then run the pointer loads (the same bits as the pointer tiles), and no descriptor is built."""
    import k3rt.kernels.moe.triton_experts as te

    gen = torch.Generator().manual_seed(17)
    case = experts_case(gen, 9, E=4, k=2, D=36, inter=20, dtype=torch.float16)
    act = ACTS["silu"]
    tiles = ExpertTiles(16, 16, 16, 16, 16, 4, 4, 1)
    want = fused_experts(**case, act=act, tiles=tiles)

    def no_descriptor(*a, **kw):
        raise AssertionError("a TMA descriptor over unaligned rows")
    monkeypatch.setattr(te.TensorDescriptor, "from_tensor", no_descriptor)
    assert torch.equal(fused_experts(**case, act=act, tiles=replace(tiles, tma=True)), want)


def test_fused_experts_out_buffer_strided_and_reproducible() -> None:
    gen = torch.Generator().manual_seed(8)
    case = experts_case(gen, 5, E=8, k=2, D=32, inter=16, dtype=torch.float32)
    wide = torch.full((5, 48), float("nan"), device=DEV)
    out = wide[:, 8:40]
    res = fused_experts(**case, act=ACTS["silu"], out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isnan(wide[:, :8]).all() and torch.isnan(wide[:, 40:]).all()  # nothing outside out
    assert rel_err(out, fused_experts_ref(**case, act=ACTS["silu"])) <= 1e-4
    assert torch.equal(fused_experts(**case, act=ACTS["silu"]), out)


def test_fused_experts_fp16() -> None:
    gen = torch.Generator().manual_seed(9)
    case = experts_case(gen, 5, E=8, k=2, D=32, inter=16, dtype=torch.float16)
    out = fused_experts(**case, act=ACTS["situ"])
    assert out.dtype == torch.float16
    assert rel_err(out, fused_experts_ref(**case, act=ACTS["situ"])) <= 2e-3


def test_fused_experts_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(10)
    case = experts_case(gen, 3, E=8, k=2, D=32, inter=16, dtype=torch.float32)
    act = ACTS["silu"]

    def bad(match: str, **over) -> None:
        kw = {**case, "act": act, **over}
        with pytest.raises(ValueError, match=match):
            fused_experts(**kw)

    bad("x must be", x=case["x"].to(torch.int32))
    bad("w13 must be", w13=case["w13"][:, :, :16])
    bad("w2 must have shape", w2=case["w2"][:, :, :8])
    bad("w13 must be contiguous", w13=case["w13"].transpose(1, 2).contiguous().transpose(1, 2))
    bad("topk_ids must be torch.int32", topk_ids=case["topk_ids"].long())
    bad("topk_weights must have shape", topk_weights=case["topk_weights"][:, :1])
    bad("topk_ids must be", topk_ids=case["topk_ids"][:2])
    bad("act must be silu", act=ActivationConfig("situ"))
    bad("situ_linear_beta", act=ActivationConfig("situ", 4.0, -1.0))
    bad("out must have shape", out=torch.empty(3, 31, device=DEV))
    bad("w2 must be torch.float32", w2=case["w2"].half())


def test_fused_experts_empty_batch() -> None:
    case = experts_case(torch.Generator().manual_seed(0), 0, E=8, k=2, D=32, inter=16, dtype=torch.float32)
    assert fused_experts(**case, act=ACTS["silu"]).shape == (0, 32)


def test_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/kernels_moe.py --smoke runs end to end on the CPU interpreter and writes its JSON."""
    out = tmp_path / "kernels_moe.json"
    result = run_benchmark_smoke("kernels_moe.py", out)
    assert result["mode"] == "smoke"
    assert result["correctness"] and all(c["ok"] for c in result["correctness"]), result["correctness"]
    # item 6: the one-token layer's phased form checked against its oracle and timed beside the grouped path
    layer = {r["name"]: r for r in result["layer"]}
    assert layer["phased (3 launches)"]["ok"] and "us" in layer["grouped (5 launches)"], layer
    # T = 1's GEMV form (session 45): checked against the grouped path, then timed
    gemv = [r for r in result["decode"] if "gemv_rows" in r]
    assert gemv and all(r["ok"] and "us" in r for r in gemv), gemv


# --------------------------------------------------------------------------------------------
# GPU, Kimi-Linear-48B shapes

E48, K48, D48, I48 = 256, 8, 2304, 1024


def gpu_case(T: int, seed: int) -> dict:
    """48B-shaped bf16 experts with real routing (router logits through moe_route)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E48, device="cuda", generator=gen)
    bias = torch.randn(E48, device="cuda", generator=gen) * 0.1
    w, ids = moe_route(logits, bias, top_k=K48, renormalize=True, scaling=2.446)
    return dict(
        x=torch.randn(T, D48, device="cuda", generator=gen).bfloat16(),
        w13=(torch.randn(E48, 2 * I48, D48, device="cuda", generator=gen) * D48 ** -0.5).bfloat16(),
        w2=(torch.randn(E48, D48, I48, device="cuda", generator=gen) * I48 ** -0.5).bfloat16(),
        topk_weights=w, topk_ids=ids,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 16, 64, 4096])
@pytest.mark.parametrize("shared", [0, 1])
def test_gpu_fused_experts_48b(T: int, shared: int) -> None:
    case = gpu_case(T, seed=T)  # with shared=1 the last of the 256 experts is the shared one
    if shared:  # routed ids must stay below 255 (a repeated id in a token is fine: it runs twice)
        case["topk_ids"] = case["topk_ids"] % 255
    out = fused_experts(**case, act=ACTS["silu"], shared_experts=shared)
    ref = fused_experts_ref(**case, act=ACTS["silu"], shared_experts=shared)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 1e-2
    assert torch.equal(fused_experts(**case, act=ACTS["silu"], shared_experts=shared), out)  # bit-reproducible


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T,tiles", [(64, t) for t in DECODE_CANDIDATES] + [(2048, t) for t in PREFILL_CANDIDATES],
                         ids=[f"decode{i}" for i in range(len(DECODE_CANDIDATES))]
                         + [f"prefill{i}" for i in range(len(PREFILL_CANDIDATES))])
def test_gpu_fused_experts_tile_candidates(T: int, tiles: ExpertTiles) -> None:
    """Every tile config the benchmark times is correct (the defaults are among them)."""
    case = gpu_case(T, seed=11)
    out = fused_experts(**case, act=ACTS["situ_lin"], tiles=tiles)
    assert rel_err(out, fused_experts_ref(**case, act=ACTS["situ_lin"])) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("path", ["one_token", "gemv"])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_gpu_one_token_paths_48b(path: str, use_pdl: bool) -> None:
    """The one-token paths (one_token: two launches; gemv, session 45: rows a program) at the 48B shape (8 routed + 1
    shared expert, SiTU), from a CUDA graph replayed with new routing between: the oracle's values and the grouped
    path's to bf16 rounding, bit-reproducible."""
    case = gpu_case(1, seed=17)
    E = case["w13"].shape[0]
    case = dict(case, topk_ids=case["topk_ids"].clamp(max=E - 2))  # the last expert is shared
    kw = dict(act=ACTS["situ_lin"], shared_experts=1)
    out = torch.empty(1, D48, dtype=torch.bfloat16, device="cuda")
    fused_experts(**case, **kw, **{path: True}, use_pdl=use_pdl, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_experts(**case, **kw, **{path: True}, use_pdl=use_pdl, out=out)
    gen = torch.Generator(device="cuda").manual_seed(23)
    for _ in range(2):
        w, ids = moe_route(torch.randn(1, E48, device="cuda", generator=gen), torch.zeros(E48, device="cuda"),
                           top_k=K48, renormalize=True, scaling=2.446)
        case["topk_ids"].copy_(ids.clamp(max=E - 2))
        case["topk_weights"].copy_(w)
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, fused_experts_ref(**case, **kw)) <= 1e-2
        assert rel_err(out, fused_experts(**case, **kw)) <= 1e-2
        assert torch.equal(out, fused_experts(**case, **kw, **{path: True}))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_grouped_tiles_at_prefill_size_with_a_shared_expert() -> None:
    """grouped_tiles (KernelConfig.moe_grouped_tiles) at 8K tokens: pick_tiles' 128-row tiles over runs padded to 64
    rows, a shared expert's 128-row tiles after them; equal to the oracle and close to the ungrouped default."""
    case = gpu_case(8192, seed=13)
    E = case["w13"].shape[0]
    ids = case["topk_ids"].clamp(max=E - 2)  # the last expert is shared
    case = dict(case, topk_ids=ids)
    out = fused_experts(**case, act=ACTS["situ_lin"], shared_experts=1, grouped_tiles=True)
    assert rel_err(out, fused_experts_ref(**case, act=ACTS["situ_lin"], shared_experts=1)) <= 1e-2
    assert rel_err(out, fused_experts(**case, act=ACTS["situ_lin"], shared_experts=1)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("act", ["situ_lin", "situ"])
def test_gpu_fused_experts_situ_pdl_graph(act: str) -> None:
    """SiTU at T=64 with PDL, captured in and replayed from a CUDA graph."""
    case = gpu_case(64, seed=3)
    ref = fused_experts_ref(**case, act=ACTS[act])
    out = torch.empty_like(case["x"])
    fused_experts(**case, act=ACTS[act], out=out, use_pdl=True)  # warm-up compiles outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(**case, act=ACTS[act], out=out, use_pdl=True)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("E,k,groups,topk_group", [(256, 8, 1, 1), (256, 8, 8, 4), (512, 16, 1, 1)])
def test_gpu_route(E: int, k: int, groups: int, topk_group: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(E + k)
    logits = torch.randn(4096, E, device="cuda", generator=gen)
    bias = torch.randn(E, device="cuda", generator=gen) * 0.1
    kw = dict(top_k=k, num_expert_group=groups, topk_group=topk_group, renormalize=True, scaling=2.446)
    w, ids = moe_route(logits, bias, **kw)
    w_ref, ids_ref = route_ref(logits, bias, **kw)
    assert torch.equal(ids, ids_ref)
    assert rel_err(w, w_ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_align_prefill_many_chunks() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(16384, E48, device="cuda", generator=gen)
    _, ids = moe_route(logits, torch.zeros(E48, device="cuda"), top_k=K48)
    for block_m in (16, 64, 128):
        sorted_ids, block_expert = moe_align_fwd(ids, E48, block_m)
        ref_sorted, ref_blocks = align_ref(ids.cpu(), E48, block_m)
        used = len(ref_blocks)
        assert block_expert[:used].tolist() == ref_blocks
        assert (block_expert[used:] == -1).all()
        assert sorted_ids[:used * block_m].tolist() == ref_sorted


# --------------------------------------------------------------------------------------------
# the dense MLP's gated activation (triton_act.py)


@pytest.mark.parametrize("T,I", [(1, 96), (3, 1500), (0, 64)])
@pytest.mark.parametrize("act", list(ACTS))
def test_act_and_mul_matches_ref(act: str, T: int, I: int) -> None:
    """fp32: the kernel equals the torch expression to fp32 rounding, from a strided (column-sliced) input into a
    given output buffer; the values span both tanh branches' saturation (|x| up to ~40)."""
    from k3rt.kernels.moe import act_and_mul, act_and_mul_ref

    gen = torch.Generator().manual_seed(T * 7 + I)
    wide = (torch.randn(T, 2 * I + 5, generator=gen) * 12).to(DEV)
    gate_up = wide[:, :2 * I]  # row stride 2I + 5: the kernel reads rows by their stride
    want = act_and_mul_ref(gate_up[:, :I], gate_up[:, I:], ACTS[act])
    out = torch.full((T, I), float("nan"), device=DEV)
    got = act_and_mul(gate_up, ACTS[act], out=out)
    assert got.data_ptr() == out.data_ptr()
    assert got.shape == (T, I)
    if T:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-5)


def test_act_and_mul_names_what_it_refuses() -> None:
    from k3rt.kernels.moe import act_and_mul

    with pytest.raises(ValueError, match="gate_up: expected"):
        act_and_mul(torch.zeros(2, 5, device=DEV), ACTS["silu"])
    with pytest.raises(ValueError, match="act must be silu or situ"):
        act_and_mul(torch.zeros(2, 4, device=DEV), ActivationConfig("gelu"))
    with pytest.raises(ValueError, match="out: expected"):
        act_and_mul(torch.zeros(2, 4, device=DEV), ACTS["silu"], out=torch.zeros(2, 3, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("act", list(ACTS))
def test_gpu_act_and_mul_bf16(act: str) -> None:
    """bf16 at K3's shared-expert width: within bf16 rounding of the fp32 expression on the same inputs."""
    from k3rt.kernels.moe import act_and_mul, act_and_mul_ref

    gate_up = (torch.randn(16, 2 * 2048, device="cuda") * 8).to(torch.bfloat16)
    want = act_and_mul_ref(gate_up[:, :2048].float(), gate_up[:, 2048:].float(), ACTS[act])
    assert rel_err(act_and_mul(gate_up, ACTS[act]).float(), want) < 8e-3
