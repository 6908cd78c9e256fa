"""skinny_linear (Triton GEMV for decode rows) against the fp32 oracle: every row count up to
MAX_ROWS, ragged K and N, strided rows, an fp32 weight with an fp32 output (the router's form),
the tile candidates, and the contract errors. CPU: interpreter, fp32/fp16; GPU: bf16 at Kimi shapes."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.linear import MAX_ROWS, prefer_skinny, skinny_linear, skinny_linear_ref  # noqa: E402
from k3rt.kernels.linear.triton_gemv import CANDIDATES, GemvTiles, unrolled_tiles  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA, rel_err, run_benchmark_smoke  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")


@pytest.mark.parametrize("M", list(range(1, MAX_ROWS + 1)))
@pytest.mark.parametrize("N,K", [(40, 96), (7, 50), (130, 33)])
def test_matches_ref(M: int, N: int, K: int) -> None:
    g = torch.Generator().manual_seed(M * 100 + N + K)
    x = torch.randn(M, K, generator=g).to(DEV)
    w = torch.randn(N, K, generator=g).to(DEV)
    y = skinny_linear(x, w)
    assert y.shape == (M, N) and y.dtype == x.dtype
    assert rel_err(y, skinny_linear_ref(x, w)) <= 1e-6


def test_fp16_activations_fp32_weight_fp32_output_strided_rows_and_out() -> None:
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 80, generator=g).half().to(DEV)
    x = wide[:, 8:72]  # row stride 80
    w = torch.randn(20, 64, generator=g).to(DEV)
    out = torch.empty(3, 20, device=DEV)
    y = skinny_linear(x, w, out_dtype=torch.float32, out=out)
    assert y.data_ptr() == out.data_ptr()
    # fp16 inputs upcast exactly: the fp32 oracle on the same values
    assert rel_err(y, skinny_linear_ref(x, w, torch.float32)) <= 1e-6


@pytest.mark.parametrize("tiles", [t for t in CANDIDATES if t.unrolled])
def test_unrolled_tiles_one_row_strided_weight_and_the_plain_form_past_it(tiles: GemvTiles) -> None:
    """GemvTiles.unrolled: one row of x through `rows_dot` (K unrolled, ragged N and K, a weight whose rows are
    strided: a column slice); several rows take the plain form with the same tiles."""
    g = torch.Generator().manual_seed(tiles.block_n)
    wide = torch.randn(37, 90, generator=g).to(DEV)
    w = wide[:, 3:78]  # N 37, K 75, row stride 90
    for M in (1, 3):
        x = torch.randn(M, 75, generator=g).to(DEV)
        assert rel_err(skinny_linear(x, w, tiles=tiles), skinny_linear_ref(x, w)) <= 1e-6


def test_wide_tiles_at_many_rows_keep_their_partials_bounded() -> None:
    """A tile whose [M, BLOCK_N, BLOCK_K] partial products would exceed MAX_PARTIALS runs with a shorter K step
    (the same sums, another split of K)."""
    from k3rt.kernels.linear.triton_gemv import MAX_PARTIALS, block_k

    wide = GemvTiles(16, 1024, 4, 1)
    assert block_k(wide, 1, 4096) == 512 and block_k(wide, 16, 4096) * 16 * 16 == MAX_PARTIALS  # 16 rows: K step 32
    assert block_k(GemvTiles(1, 1024, 2, 4), 16, 4096) == 512 and block_k(GemvTiles(1, 1024, 2, 4), 1, 300) == 512
    g = torch.Generator().manual_seed(5)
    x = torch.randn(MAX_ROWS, 300, generator=g).to(DEV)
    w = torch.randn(40, 300, generator=g).to(DEV)
    y = skinny_linear(x, w, tiles=wide)
    assert rel_err(y, skinny_linear_ref(x, w)) <= 1e-6


@pytest.mark.parametrize("M,G,P,tiles", [(1, 4, 8, None), (3, 2, 1, None), (2, 8, 3, GemvTiles(2, 16, 4, 1)),
                                          (1, 4, 2, GemvTiles(4, 64, 4, 1))])
def test_row_rms_scales_each_group(M: int, G: int, P: int, tiles) -> None:
    """row_rms: x's K columns in G groups, each scaled by rsqrt(sum of its P partials / group size + eps) before the
    product (KDA's output norm finished in o_proj's launch), against the oracle; K steps shorter or longer than a
    group are rounded to whole groups."""
    K, N = G * 16, 24
    g = torch.Generator().manual_seed(M * 10 + G + P)
    x = torch.randn(M, K, generator=g).to(DEV)
    w = torch.randn(N, K, generator=g).to(DEV)
    partials = (torch.rand(M, G, P, generator=g) * 16).to(DEV)
    y = skinny_linear(x, w, row_rms=(partials, 1e-5), tiles=tiles)
    ref = skinny_linear_ref(x, w, row_rms=(partials, 1e-5))
    assert rel_err(y, ref) <= 1e-6
    # the oracle itself: a group's columns divided by the rms its partials give
    rms = torch.sqrt(partials.sum(-1) / 16 + 1e-5)  # [M, G]
    assert rel_err(ref, skinny_linear_ref((x.view(M, G, 16) / rms[:, :, None]).view(M, K), w)) <= 1e-6


def test_row_rms_rejects_bad_partials() -> None:
    x, w = torch.randn(1, 64, device=DEV), torch.randn(8, 64, device=DEV)
    for bad in (torch.ones(1, 3, 2, device=DEV), torch.ones(2, 4, 2, device=DEV),  # 64 / 3; M
                torch.ones(1, 4, 2, device=DEV, dtype=torch.float16), torch.ones(1, 8, device=DEV)):
        with pytest.raises(ValueError, match="row_rms partials"):
            skinny_linear(x, w, row_rms=(bad, 1e-5))


def test_rejects_bad_inputs() -> None:
    x, w = torch.randn(2, 16, device=DEV), torch.randn(8, 16, device=DEV)
    with pytest.raises(ValueError, match=rf"rows M must be in \[1, {MAX_ROWS}\]"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 16, device=DEV), w)
    with pytest.raises(ValueError, match="w must have shape"):
        skinny_linear(x, torch.randn(8, 17, device=DEV))
    with pytest.raises(ValueError, match="x must be"):
        skinny_linear(x.t(), w)
    with pytest.raises(ValueError, match="out must have shape"):
        skinny_linear(x, w, out=torch.empty(2, 9, device=DEV))


def test_prefer_skinny_follows_the_measured_split() -> None:
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert prefer_skinny(1, 2304, bf16, bf16) and prefer_skinny(1, 4096, fp16, fp16)  # narrow outputs, one row
    assert not prefer_skinny(1, 12576, bf16, bf16) and not prefer_skinny(1, 163840, bf16, bf16)  # wide: cuBLAS
    assert not prefer_skinny(2, 2304, bf16, bf16)  # several rows: cuBLAS
    assert prefer_skinny(4, 256, bf16, fp32) and not prefer_skinny(MAX_ROWS + 1, 256, bf16, fp32)  # the router
    assert prefer_skinny(16, 256, bf16, fp32)  # batch 16's router (cuBLAS: a 4-block SIMT sgemm)
    assert not prefer_skinny(1, 256, fp32, fp32)  # fp32 activations: torch


def test_compiled_tiles_follow_the_measured_shapes(monkeypatch) -> None:
    """The H200's choices (the interpreter always takes its own small tiles): short rows (K <= 512, k3-tiny) 4
    columns x 512; the narrow 48B router one column x 1024 at 2 warps; wider outputs 2 columns."""
    from k3rt.kernels.linear import triton_gemv as tg

    monkeypatch.setattr(tg, "INTERPRET", False)
    assert tg.pick_tiles(1104, 384) == tg.pick_tiles(384, 256) == tg.DEFAULT_TILES  # k3-tiny's projections
    assert tg.pick_tiles(256, 2304) == GemvTiles(1, 1024, 2, 4) == tg.pick_tiles(8, 384)  # routers
    assert tg.pick_tiles(2304, 4096) == GemvTiles(2, 1024, 4, 4)  # 48B attention output
    assert tg.pick_tiles(4096, 128) == GemvTiles(2, 256, 4, 4)  # 48B KDA gate up-projection


def test_benchmark_smoke(tmp_path) -> None:
    res = run_benchmark_smoke("kernels_linear.py", tmp_path / "k.json")
    assert len(res["gemv"]) == 4 and all("best_us" in r for r in res["gemv"]), res["gemv"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tiles", CANDIDATES)
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N,K", [(12576, 2304), (2304, 4096), (256, 2304), (576, 2304)])
def test_gpu_bf16_kimi_shapes(tiles, M: int, N: int, K: int) -> None:
    x = torch.randn(M, K, device="cuda").bfloat16()
    w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
    y = skinny_linear(x, w, tiles=tiles)
    ref = skinny_linear_ref(x, w, torch.float32)
    assert rel_err(y, ref) <= 8e-3  # one bf16 rounding of the output
    assert rel_err(skinny_linear(x, w.float(), out_dtype=torch.float32, tiles=tiles), ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tiles", [None, *[t for t in CANDIDATES if t.unrolled][:1]])
def test_gpu_trigger_first_changes_nothing_but_the_launch(tiles) -> None:
    """skinny_linear(trigger=True) (the KDA gates' up-projection before the PDL-launched decode step, session 44)
    lets the next PDL launch start at once: the same bits, also with a PDL kernel reading its output right after
    (the decode's wait covers all of the GEMV), in a graph replayed twice."""
    from k3rt.kernels.norm import rms_norm

    x = torch.randn(1, 256, device="cuda").bfloat16()
    w = (torch.randn(8192, 256, device="cuda") * 0.05).bfloat16()
    want = skinny_linear(x, w, tiles=tiles)
    assert torch.equal(skinny_linear(x, w, tiles=tiles, trigger=True), want)
    out = torch.empty_like(want)
    weight = torch.ones(8192, device="cuda", dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    skinny_linear(x, w, tiles=tiles, trigger=True, out=out)
    rms_norm(out, weight, 1e-5, use_pdl=True)  # compiled outside the capture
    with torch.cuda.graph(g):
        skinny_linear(x, w, tiles=tiles, trigger=True, out=out)
        normed = rms_norm(out, weight, 1e-5, use_pdl=True)
    for _ in range(2):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(normed, rms_norm(want, weight, 1e-5))


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N,K", [(40, 96), (7, 50), (130, 33), (9, 16)])
def test_prefetch_gives_the_same_bits(M: int, N: int, K: int) -> None:
    """skinny_linear(prefetch=) (KernelConfig.gemv_prefetch, session 45): "tile" peels the first K step so its
    weight tile can load before the PDL wait, "l2" asks the rows into the L2 first (nothing on the interpreter):
    the same products summed in the same order, so the same bits, whole and ragged K (one step only at K = 16)."""
    g = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randn(M, K, generator=g).to(DEV)
    w = torch.randn(N, K, generator=g).to(DEV)
    want = skinny_linear(x, w)
    for form in ("tile", "l2"):
        assert torch.equal(skinny_linear(x, w, prefetch=form), want), form
        assert torch.equal(skinny_linear(x, w, prefetch=form, use_pdl=True), want), form  # PDL: nothing on the CPU
    if M == 1:  # the unrolled form takes "l2" too
        tiles = unrolled_tiles(2)
        assert torch.equal(skinny_linear(x, w, tiles=tiles, prefetch="l2", use_pdl=True), skinny_linear(x, w, tiles=tiles))
    assert rel_err(want, skinny_linear_ref(x, w)) <= 1e-6


def test_prefetch_refuses_the_forms_it_does_not_take() -> None:
    x = torch.randn(1, 64).to(DEV)
    w = torch.randn(8, 64).to(DEV)
    with pytest.raises(ValueError, match="prefetch='tile'.*plain form only"):
        skinny_linear(x, w, prefetch="tile", tiles=GemvTiles(2, 256, 2, 1, True))
    parts = torch.ones(1, 2, 1).to(DEV)
    with pytest.raises(ValueError, match="prefetch='l2'.*not with row_rms"):
        skinny_linear(x, w, prefetch="l2", row_rms=(parts, 1e-6))
    with pytest.raises(ValueError, match="prefetch must be one of"):
        skinny_linear(x, w, prefetch="dram")
    with pytest.raises(ValueError, match="rows a program must be"):
        unrolled_tiles(3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("form", ["tile", "l2", "l2_unrolled"])
@pytest.mark.parametrize("N,K", [(2304, 4096), (256, 2304), (4096, 2304), (130, 1000)])
def test_gpu_prefetch_after_a_writer_in_a_pdl_graph(form: str, N: int, K: int) -> None:
    """The PDL launch with its first weight tile loaded before the wait reads x only after it: behind a kernel that
    writes x (an early-triggering GEMV, so the prefetching one starts while its input is being written), in a graph
    replayed with new inputs, the same bits as the eager launches without PDL."""
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x0 = torch.randn(1, 512, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(K, 512, device="cuda", generator=g) * 0.05).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.empty(1, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    tiles = unrolled_tiles(2) if form == "l2_unrolled" else None

    def chain() -> None:
        skinny_linear(x0, w0, out=x, trigger=True)
        skinny_linear(x, w, out=y, use_pdl=True, prefetch=form[:2] if form != "tile" else form, tiles=tiles)

    chain()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for seed in range(3):
        x0.copy_(torch.randn(1, 512, device="cuda", generator=g).bfloat16())
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want = skinny_linear(skinny_linear(x0, w0), w, tiles=tiles)
        assert torch.equal(y, want), seed
