"""The Triton MLA kernels (split-context decode over the paged latent cache, varlen causal prefill)
agree with the torch oracles in kernels/mla/ref.py and, through them, with the model's attention.

Without a GPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py
before the kernel modules are imported), at tiny fp32/fp16 shapes. The `gpu` cases run the compiled
kernels at the Kimi-Linear-48B shape (H=32, L=512, R=64, P=V=128, page 1888) in bf16.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.backend.models.mla import mla_absorbed  # noqa: E402
from k3rt.kernels.mla import mla_decode, mla_decode_num_splits, mla_prefill  # noqa: E402
from k3rt.kernels.mla.ref import mla_decode_ref, mla_prefill_ref  # noqa: E402
from k3rt.kernels.mla.triton_decode import MlaDecodeConfig, mla_decode_config  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA, rel_err, run_benchmark_smoke, run_sm90_build  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs and split partials: conftest.py


# --------------------------------------------------------------------------------------------
# decode


def decode_case(lens: list[int], H: int, L: int, R: int, block_size: int, dtype: torch.dtype, seed: int,
                spare_blocks: int = 2, table_pad: int = 0):
    """Random queries and a shuffled page pool, made on DEV (the GPU pools are GBs). Table entries
    past a sequence's pages are valid but wrong page ids; with table_pad > 0 the table is a strided
    view of a wider tensor."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    N = len(lens)
    max_blocks = max(1, max(math.ceil(s / block_size) for s in lens)) + spare_blocks
    num_pages = N * max_blocks + 3
    kv = torch.randn(num_pages, block_size, L + R, generator=gen, device=DEV).to(dtype)
    perm = torch.randperm(num_pages, generator=gen, device=DEV)
    table = perm[:N * max_blocks].view(N, max_blocks).int()
    if table_pad:
        wide = torch.randint(0, num_pages, (N, max_blocks + table_pad), generator=gen, device=DEV,
                             dtype=torch.int32)
        wide[:, :max_blocks] = table
        table = wide[:, :max_blocks]
    # q rows are a strided view (a wider buffer, as when q is sliced out of a fused projection)
    q = torch.randn(N, H, L + R + 8, generator=gen, device=DEV).to(dtype)[..., :L + R]
    return dict(q=q, kv_cache=kv, block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV))


def check_decode(case: dict, L: int, scale: float, tol: float, **kw) -> Tensor:
    want = mla_decode_ref(**case, scale=scale, kv_lora_rank=L)
    got = mla_decode(**case, scale=scale, kv_lora_rank=L, **kw)
    assert got.shape == want.shape and got.dtype == case["q"].dtype
    assert rel_err(got, want) <= tol, rel_err(got, want)
    for n in (case["seq_lens"] == 0).nonzero().flatten().tolist():
        assert torch.equal(got[n], torch.zeros_like(got[n]))  # padding row: exact zero
    return got


@pytest.mark.parametrize("num_splits", [1, 3, 16], ids=["splits1", "splits3", "splits16_past_end"])
@pytest.mark.parametrize("block_size", [16, 48], ids=["bs16", "bs48"])
def test_decode_matches_ref(block_size: int, num_splits: int) -> None:
    """Ragged lengths: 1, within a page, crossing pages, a padding row (0); splits past the end."""
    lens = [1, 17, 0, 2 * block_size + 5]
    case = decode_case(lens, H=4, L=32, R=16, block_size=block_size, dtype=torch.float32,
                       seed=10 * block_size + num_splits, table_pad=3)
    check_decode(case, 32, scale=0.2, tol=1e-5, num_splits=num_splits)


@pytest.mark.parametrize("wide", [False, True], ids=["steps", "wide"])
@pytest.mark.parametrize("num_splits", [40, 300], ids=["one_pass", "two_passes_past_max"])
def test_decode_combine_past_32_splits(num_splits: int, wide: bool) -> None:
    """wide_combine: past 32 splits the combine merges up to MAX_SPLITS in one pass (a second binary, 32-column
    blocks); past MAX_SPLITS (an explicit count) in two. Lengths long enough that most splits hold tiles."""
    lens = [700, 3, 0, 1000]
    case = decode_case(lens, H=4, L=64, R=16, block_size=16, dtype=torch.float32, seed=num_splits)
    check_decode(case, 64, scale=0.2, tol=1e-5, num_splits=num_splits, block_n=16, wide_combine=wide)


@pytest.mark.parametrize("H", [5, 40], ids=["H5_masked", "H40_two_head_blocks"])
def test_decode_odd_head_counts(H: int) -> None:
    case = decode_case([33, 1], H=H, L=16, R=16, block_size=16, dtype=torch.float32, seed=H)
    check_decode(case, 16, scale=0.3, tol=1e-5, num_splits=2)


def test_decode_tuning_overrides() -> None:
    """Wider token tiles (straddling 16-token pages) and a head block wider than H."""
    case = decode_case([70, 2, 33], H=5, L=32, R=16, block_size=16, dtype=torch.float32, seed=12)
    check_decode(case, 32, scale=0.2, tol=1e-5, num_splits=2, block_n=32, block_h=32)


@pytest.mark.parametrize("layout,prefetch", [("tokens", "none"), ("tokens", "after_scores"),
                                             ("tokens", "before_scores"), ("heads", "none")])
@pytest.mark.parametrize("block_n", [16, 32], ids=["n16", "n32_straddles_pages"])
def test_decode_launch_variants(layout: str, prefetch: str, block_n: int) -> None:
    """Every layout / prefetch mode: ragged lengths (a padding row, one token, a length ending inside a
    tile), 48-token pages (32-token tiles straddle them), splits past the end and one split."""
    case = decode_case([1, 0, 130, 37], H=4, L=32, R=16, block_size=48, dtype=torch.float32, seed=block_n, table_pad=2)
    for num_splits in (1, 3, 40):
        check_decode(case, 32, scale=0.2, tol=1e-5, num_splits=num_splits, layout=layout, prefetch=prefetch,
                     block_n=block_n, paged=False)


@pytest.mark.parametrize("layout,block_size,block_n", [("heads", 48, 16), ("heads", 40, 16), ("heads", 16, 32),
                                                       ("tokens", 40, 16)],
                         ids=["tiles_divide_pages", "partial_last_tile", "tile_wider_than_page", "tokens_on_m"])
def test_decode_paged_tiles(layout: str, block_size: int, block_n: int) -> None:
    """The paged kernel (page-aligned tiles, page ids carried one tile ahead): ragged lengths (a padding
    row, one token, a length ending on a page boundary, one ending inside a page's partial last tile),
    one split, splits cutting inside pages, splits past the end; table entries past a sequence's pages
    are wrong page ids, so reading one shows."""
    lens = [1, 0, 3 * block_size, 2 * block_size + 7, 5]
    case = decode_case(lens, H=4, L=32, R=16, block_size=block_size, dtype=torch.float32,
                       seed=block_size + block_n, table_pad=2)
    for num_splits in (1, 4, 40):
        check_decode(case, 32, scale=0.2, tol=1e-5, num_splits=num_splits, layout=layout, prefetch="none",
                     paged=True, block_n=block_n, num_stages=3)


@pytest.mark.parametrize("layout", ["heads", "tokens"])
def test_decode_tma_tiles(layout: str) -> None:
    """KV tiles copied by TMA boxes (no row mask): the rows past each sequence's end in its last page hold
    NaN (never written), so only the masked last tile may read them; ragged lengths (a padding row, one
    token, a length ending on a page boundary, one inside a page), splits cutting inside pages and past the
    end, one split."""
    block_size, block_n = 32, 16
    lens = [1, 0, 3 * block_size, 2 * block_size + 7, 5]
    case = decode_case(lens, H=4, L=32, R=16, block_size=block_size, dtype=torch.float32, seed=21, table_pad=2)
    for n, ln in enumerate(lens):
        if ln % block_size:
            case["kv_cache"][case["block_table"][n, ln // block_size], ln % block_size:] = float("nan")
    for num_splits in (1, 4, 40):
        check_decode(case, 32, scale=0.2, tol=1e-5, num_splits=num_splits, layout=layout, prefetch="none",
                     paged=True, tma=True, block_n=block_n, num_stages=3)
    with pytest.raises(ValueError, match="block_size .48. to be a multiple of block_n .32."):
        mla_decode(**decode_case([5], H=4, L=32, R=16, block_size=48, dtype=torch.float32, seed=22), scale=0.2,
                   kv_lora_rank=32, tma=True, block_n=32)
    with pytest.raises(ValueError, match="tma=True needs paged=True and schedule='split'"):
        MlaDecodeConfig(num_splits=2, paged=True, prefetch="none", schedule="balanced", tma=True)


def test_decode_paged_refuses_register_prefetch() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        MlaDecodeConfig(num_splits=1, paged=True, prefetch="after_scores")


@pytest.mark.parametrize("lens,programs", [([1, 0, 130, 37], 3), ([200, 5, 0, 0, 77], 7), ([0, 0], 4), ([3], 1)],
                         ids=["seqs_share_programs", "padding_inside", "all_padding", "one_program"])
def test_decode_balanced_schedule(lens: list[int], programs: int) -> None:
    """The balanced schedule (work programs over all sequences' tiles end to end, at least 128 tokens
    each): programs that cover several sequences, sequences cut across programs, padding rows between
    and at the end (zero output), programs past the work, and the heuristic's program count."""
    case = decode_case(lens, H=4, L=32, R=16, block_size=48, dtype=torch.float32, seed=len(lens) + programs,
                       table_pad=2)
    check_decode(case, 32, scale=0.2, tol=1e-5, num_splits=programs, schedule="balanced")
    if programs == 3:
        check_decode(case, 32, scale=0.2, tol=1e-5, schedule="balanced")


def test_decode_balanced_schedule_refusals() -> None:
    with pytest.raises(ValueError, match="paged=True"):
        MlaDecodeConfig(num_splits=4, paged=False, schedule="balanced", prefetch="none")
    with pytest.raises(ValueError, match="schedule"):
        MlaDecodeConfig(num_splits=4, paged=True, schedule="even", prefetch="none")
    case = decode_case([1] * 1025, H=4, L=32, R=16, block_size=16, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="at most 1024 sequences, got N=1025"):
        mla_decode(**case, scale=0.1, kv_lora_rank=32, schedule="balanced")


def test_decode_config() -> None:
    """The default launch is a function of (batch, heads, context): all heads (up to 32) in one
    program, the paged kernel with heads on M, 4 warps and a 3-stage pipeline, and the split heuristic's
    count; only the split count follows the batch. Bad overrides are refused."""
    for n, h, ctx in [(1, 32, 32768), (16, 32, 131072), (64, 32, 4096), (3, 16, 100), (8, 64, 8192)]:
        cfg = mla_decode_config(n, h, ctx, num_sms=132)
        assert cfg.num_splits == mla_decode_num_splits(n, h, ctx, num_sms=132)
        assert (cfg.paged, cfg.layout, cfg.prefetch, cfg.num_warps, cfg.num_stages) == (True, "heads", "none", 4, 3)
        assert cfg.block_h == min(32, max(16, h))
        assert cfg.block_n in (16, 32)  # 16 under the interpreter
        assert cfg == replace(mla_decode_config(1, h, ctx, num_sms=132), num_splits=cfg.num_splits)
    case = decode_case([5, 9], H=4, L=32, R=16, block_size=16, dtype=torch.float32, seed=13)
    for bad, match in [(dict(layout="rows"), "layout"), (dict(prefetch="early"), "prefetch"),
                       (dict(block_n=48), "block_n"), (dict(block_h=8), "block_h"),
                       (dict(partial_dtype="bf16"), "partial_dtype")]:
        with pytest.raises(ValueError, match=match):
            mla_decode(**case, scale=0.1, kv_lora_rank=32, **bad)
    with pytest.raises(ValueError, match="num_splits"):
        MlaDecodeConfig(num_splits=0)


_SM90_DECODE = r'''
from dataclasses import replace
from k3rt.kernels.mla import triton_decode as d

I32, C = "i32", "constexpr"
sig = dict(q_ptr="*bf16", stride_q_n=I32, stride_q_h=I32, kv_ptr="*bf16", block_table_ptr="*i32", stride_bt_n=I32,
           seq_lens_ptr="*i32", part_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32", H=I32, block_size=I32,
           num_splits=I32, L=C, R=C, BLOCK_H=C, BLOCK_N=C, DOT_PRECISION=C, USE_PDL=C, PREFETCH=C)
res = {}
for n, ctx in [(64, 32768), (1, 131072)]:
    # the gathered tokens layout at its benchmarked tile (64 tokens, 8 warps; the default launch is the
    # paged kernel, which tests/kernels/test_mla_sm90_build.py builds)
    cfg = replace(d.mla_decode_config(n, 32, ctx, 132), layout="tokens", prefetch="after_scores", num_stages=1,
                  paged=False, block_n=64, num_warps=8)
    consts = dict(L=512, R=64, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DOT_PRECISION="tf32", USE_PDL=True,
                  PREFETCH=d._PREFETCH[cfg.prefetch])
    res[f"{n}x{ctx}"] = sm90_build(d._mla_decode_split_tokens_kernel, sig, consts, cfg.num_warps, cfg.num_stages,
                                   lambda k: k.startswith("stride"))
print(json.dumps(res))
'''


def test_decode_tokens_layout_builds_for_sm90_with_wgmma_and_no_spills() -> None:
    """The tokens layout (64-token tiles, prefetch after the score dot) at the 48B shape (32 heads,
    512 + 64, bf16) compiles for sm_90 without a GPU: both dots lower to wgmma, nothing spills, and
    the shared memory fits one program per SM."""
    res = run_sm90_build(_SM90_DECODE, timeout=240)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)
        assert r["wgmma"] >= 2, (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)


def test_decode_fp16_default_splits_into_out() -> None:
    """fp16 path, num_splits chosen by the heuristic, and a preallocated output; partials in the input's
    dtype (fp16, one more rounding per split) through both schedules' combines stay within the same bound."""
    case = decode_case([80, 3, 64], H=4, L=32, R=16, block_size=32, dtype=torch.float16, seed=7)
    out = torch.full((3, 4, 32), float("nan"), dtype=torch.float16, device=DEV)
    got = check_decode(case, 32, scale=0.2, tol=2e-3, out=out)
    assert got.data_ptr() == out.data_ptr()
    for schedule in ("split", "balanced"):
        check_decode(case, 32, scale=0.2, tol=2e-3, num_splits=3, partial_dtype="input", schedule=schedule)


def test_decode_extreme_scores_stay_finite() -> None:
    """Large logits (one dominant token per split) must not overflow the online softmax or combine."""
    case = decode_case([70, 5], H=4, L=32, R=16, block_size=16, dtype=torch.float32, seed=8)
    case["kv_cache"] *= 8
    check_decode(case, 32, scale=1.0, tol=1e-5, num_splits=4)


def test_decode_lifts_to_model_absorbed() -> None:
    """Kernel output through W_UV equals the model's mla_absorbed for the newest token."""
    gen = torch.Generator().manual_seed(9)
    H, L, R, P, V, S = 4, 32, 16, 16, 16, 45
    scale = (P + R) ** -0.5
    latent = torch.randn(S, L + R, generator=gen)
    kv_b = torch.randn(H * (P + V), L, generator=gen) * L**-0.5
    q = torch.randn(1, H, P + R, generator=gen)
    w = kv_b.view(H, P + V, L)
    q_abs = torch.cat([torch.einsum("thp,hpl->thl", q[..., :P], w[:, :P]), q[..., P:]], dim=-1)
    block_size, pages = 16, [4, 0, 2]
    kv = torch.randn(5, block_size, L + R, generator=gen)
    for p in range(S):
        kv[pages[p // block_size], p % block_size] = latent[p]
    lat = mla_decode(q_abs.to(DEV), kv.to(DEV), torch.tensor([pages], dtype=torch.int32, device=DEV),
                     torch.tensor([S], dtype=torch.int32, device=DEV), scale, kv_lora_rank=L, num_splits=2)
    o = torch.einsum("nhl,hvl->nhv", lat.cpu(), w[:, P:])
    assert rel_err(o, mla_absorbed(q, latent, kv_b, S - 1, P, R, V, scale)) <= 1e-5


def test_num_splits_heuristic() -> None:
    # one sequence, 32 heads (one head block): one full wave of 132 splits, but short contexts are
    # capped at MIN_TOKENS_PER_SPLIT tokens per split
    assert mla_decode_num_splits(1, 32, 32768, num_sms=132) == 132
    assert mla_decode_num_splits(1, 32, 4096, num_sms=132) == 4096 // 128
    assert mla_decode_num_splits(1, 32, 100, num_sms=132) == 1
    # already two full waves without splitting
    assert mla_decode_num_splits(264, 32, 32768, num_sms=132) == 1
    for n in (1, 3, 16, 64, 100):
        s = mla_decode_num_splits(n, 32, 131072, num_sms=132)
        assert n * s <= 2 * 132 or s == 1
        assert n * s >= 0.9 * 132 or n * s > 132
    # one wave (the Gluon kernel: one program an SM): batch 16 at 32K 8 splits, not the two-wave rule's 16
    assert mla_decode_num_splits(16, 32, 32768, num_sms=132) == 16
    assert mla_decode_num_splits(16, 32, 32768, num_sms=132, max_waves=1) == 8
    assert mla_decode_num_splits(64, 32, 8192, num_sms=132, max_waves=1) == 2
    assert mla_decode_num_splits(1, 32, 32768, num_sms=132, max_waves=1) == 132
    assert mla_decode_num_splits(200, 32, 32768, num_sms=132, max_waves=1) == 1
    # heads a program: 64 heads in blocks of 64 are one block, in the default's 32 two
    assert mla_decode_num_splits(16, 64, 32768, num_sms=132, max_waves=1, block_h=64) == 8
    assert mla_decode_num_splits(16, 64, 32768, num_sms=132, max_waves=1) == 4


def test_decode_rejects_bad_inputs() -> None:
    case = decode_case([5, 9], H=4, L=32, R=16, block_size=16, dtype=torch.float32, seed=11)
    run = lambda **kw: mla_decode(**{**case, **kw}, scale=0.1, kv_lora_rank=32)  # noqa: E731
    with pytest.raises(ValueError, match="block_table must be int32"):
        run(block_table=case["block_table"].long())
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        run(kv_cache=case["kv_cache"].half())
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_pages, block_size, L\+R=48\]"):
        run(kv_cache=case["kv_cache"][..., :40])
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        run(seq_lens=case["seq_lens"][:1])
    with pytest.raises(ValueError, match="q must have a contiguous last dim"):
        run(q=case["q"].transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="kv_lora_rank must be a power of 2"):
        mla_decode(**case, scale=0.1, kv_lora_rank=24)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode(**case, scale=0.1, kv_lora_rank=32, num_splits=0)
    with pytest.raises(ValueError, match="out must have shape"):
        mla_decode(**case, scale=0.1, kv_lora_rank=32, out=torch.empty(2, 4, 48, device=DEV))


# --------------------------------------------------------------------------------------------
# prefill


def prefill_case(lens: list[tuple[int, int]], H: int, P: int, R: int, V: int, dtype: torch.dtype, seed: int):
    """Packed varlen inputs for (len_q, len_k) pairs; q and k_nope are strided views."""
    gen = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lq for lq, _ in lens), sum(lk for _, lk in lens)
    cu_q = [0, *torch.tensor([lq for lq, _ in lens]).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor([lk for _, lk in lens]).cumsum(0).tolist()]
    case = dict(
        q=torch.randn(Tq, H, P + R + 16, generator=gen)[..., :P + R],
        k_nope=torch.randn(Tk, H, P + V, generator=gen)[..., :P],
        k_pe=torch.randn(Tk, R, generator=gen),
        v=torch.randn(Tk, H, V, generator=gen),
    )
    case = {k: t.to(DEV, dtype) for k, t in case.items()}
    case.update(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=DEV),
                cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=DEV),
                max_seqlen_q=max(lq for lq, _ in lens), max_seqlen_k=max(lk for _, lk in lens))
    return case


PREFILL_LENS = [(1, 1), (1, 37), (20, 20), (17, 50), (0, 5), (33, 40)]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32)], ids=["m16n16", "m32n16", "m16n32"])
def test_prefill_matches_ref(blocks: tuple[int, int], tma: bool) -> None:
    """Fresh sequences, extends over a cached prefix, one query after a long prefix, an empty query; the key
    tiles through pointers or TMA descriptors (whose tiles past a sequence read the next one's rows)."""
    case = prefill_case(PREFILL_LENS, H=3, P=16, R=16, V=32, dtype=torch.float32, seed=blocks[0] + blocks[1])
    want = mla_prefill_ref(**case, scale=0.2)
    got = mla_prefill(**case, scale=0.2, block_m=blocks[0], block_n=blocks[1], tma=tma)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-5


def test_prefill_tma_falls_back_where_a_base_is_not_16_byte_aligned(monkeypatch) -> None:
    """k_pe a column view one element in: its base is 2 bytes off 16, so `tma=True` takes the pointer loads (the
    same bits) and builds no descriptor."""
    import k3rt.kernels.mla.triton_prefill as tp

    case = prefill_case([(20, 20), (17, 50)], H=2, P=16, R=16, V=16, dtype=torch.float16, seed=23)
    case["k_pe"] = torch.cat([case["k_pe"][:, :1], case["k_pe"]], dim=1)[:, 1:]
    assert case["k_pe"].data_ptr() % 16
    want = mla_prefill(**case, scale=0.25)

    def no_descriptor(*a, **kw):
        raise AssertionError("a TMA descriptor over an unaligned base")
    monkeypatch.setattr(tp, "TensorDescriptor", no_descriptor)
    assert torch.equal(mla_prefill(**case, scale=0.25, tma=True), want)


def test_prefill_fp16_into_strided_out() -> None:
    case = prefill_case([(40, 40), (5, 70)], H=2, P=32, R=16, V=16, dtype=torch.float16, seed=21)
    want = mla_prefill_ref(**case, scale=(48) ** -0.5)
    buf = torch.full((45, 2, 24), float("nan"), dtype=torch.float16, device=DEV)
    got = mla_prefill(**case, scale=(48) ** -0.5, out=buf[..., :16])
    assert rel_err(got, want) <= 2e-3
    assert torch.isnan(buf[..., 16:]).all()  # nothing written outside the view


def test_prefill_rejects_bad_inputs() -> None:
    case = prefill_case([(4, 6)], H=2, P=16, R=16, V=16, dtype=torch.float32, seed=22)
    with pytest.raises(ValueError, match="k_pe must have shape"):
        mla_prefill(**{**case, "k_pe": case["k_pe"][:, :8]}, scale=0.1)
    with pytest.raises(ValueError, match="v must be torch.float32"):
        mla_prefill(**{**case, "v": case["v"].half()}, scale=0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must be torch.int32"):
        mla_prefill(**{**case, "cu_seqlens_q": case["cu_seqlens_q"].long()}, scale=0.1)
    with pytest.raises(ValueError, match="max_seqlen"):
        mla_prefill(**{**case, "max_seqlen_k": 2}, scale=0.1)
    with pytest.raises(ValueError, match="V"):
        mla_prefill(**{**case, "v": case["v"][..., :12]}, scale=0.1)


# --------------------------------------------------------------------------------------------
# benchmark script


# --------------------------------------------------------------------------------------------
# output gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("N,H,V", [(1, 4, 64), (5, 3, 24)], ids=str)
def test_output_gate_matches_ref_bit_for_bit_from_strided_inputs(N: int, H: int, V: int, dtype: torch.dtype) -> None:
    """o as the W_UV product leaves it (heads outermost: [H, N, V] transposed) and the gate as a column slice of a
    wider projection, as the runner passes them. In 16 bits the kernel's y equals the model's rounding order bit for
    bit; in fp32 up to the sigmoid's last bits (Triton's and torch's fp32 sigmoid differ by an ulp)."""
    from k3rt.kernels.mla import mla_output_gate, mla_output_gate_ref

    gen = torch.Generator(device=DEV).manual_seed(N * 100 + V)
    o = (torch.randn(H, N, V, generator=gen, device=DEV) * 3).to(dtype).transpose(0, 1)
    proj = (torch.randn(N, 16 + H * V + 8, generator=gen, device=DEV) * 4).to(dtype)
    gate = proj[:, 16:16 + H * V].view(N, H, V)
    got = mla_output_gate(o, gate)
    assert got.is_contiguous() and got.dtype == dtype
    want = mla_output_gate_ref(o, gate)
    assert torch.equal(got, want) if dtype != torch.float32 else rel_err(got, want) < 1e-6
    out = torch.full((N, H, V), float("nan"), dtype=dtype, device=DEV)
    assert mla_output_gate(o, gate, out=out) is out and torch.equal(out, got)
    with pytest.raises(ValueError, match="gate must have o's shape"):
        mla_output_gate(o, gate[:, :, :-1])
    with pytest.raises(ValueError, match="out must be a contiguous"):
        mla_output_gate(o, gate, out=out.transpose(0, 1))


def test_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/kernels_mla.py --smoke runs end to end on the interpreter and writes its JSON."""
    out = tmp_path / "kernels_mla.json"
    result = run_benchmark_smoke("kernels_mla.py", out)
    assert result["mode"] == "smoke"
    assert result["correctness"] and all(c["ok"] for c in result["correctness"]), result["correctness"]


def test_benchmark_decode_baseline_smoke(tmp_path: Path) -> None:
    """kernels_mla.py --decode-baseline FILE: an earlier triton_decode.py (here the current one, as a file) timed
    beside the default launch at every decode case, twice each, interleaved (the timing itself is the GPU's; here
    the rows must exist and the baseline rows must have run the file's mla_decode)."""
    from tests.kernels.helpers import REPO

    base, calls = tmp_path / "old_mla_decode.py", tmp_path / "baseline_calls"
    base.write_text((REPO / "kernels" / "mla" / "triton_decode.py").read_text() + (
        f"\n_mla_decode = mla_decode\n\n\ndef mla_decode(*a, **kw):\n"
        f"    open({str(calls)!r}, 'a').write('.')\n    return _mla_decode(*a, **kw)\n"))
    result = run_benchmark_smoke("kernels_mla.py", tmp_path / "kernels_mla.json", "--decode-only",
                                 "--decode-baseline", str(base))
    rows = result["decode_baseline"]
    cases = {(r["N"], r["ctx"]) for r in result["decode"]}
    assert cases and sorted(r["impl"] for r in rows) == sorted(
        ["k3rt", "baseline", "k3rt again", "baseline again"] * len(cases))
    assert calls.exists() and len(calls.read_text()) >= 2 * len(cases)


# --------------------------------------------------------------------------------------------
# GPU, Kimi-Linear-48B shape

H48, L48, R48, P48, V48, PAGE48 = 32, 512, 64, 128, 128, 1888
SCALE48 = (P48 + R48) ** -0.5


def _gpu_lens(N: int, max_ctx: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (N,), generator=gen).tolist()
    lens[0] = max_ctx
    if N > 1:
        lens[1] = 1
    if N > 2:
        lens[2] = PAGE48 + 1  # just past a page boundary
    return lens


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("N,max_ctx", [(1, 32768), (16, 32768), (64, 8192), (64, 32768)])
@pytest.mark.parametrize("splits", ["auto", "one"])
@pytest.mark.parametrize("tiles", ["default", "paged", "gathered", "balanced", "wgmma", "wgmma_balanced", "tma"])
def test_gpu_decode_kimi_shape(N: int, max_ctx: int, splits: str, tiles: str) -> None:
    """The default launch, page-aligned 64-token tiles (1888-token pages are not a multiple of them, so
    each page's last tile is cut), rows gathered through the block table (the fallback), the balanced
    schedule (splits="one" there means one work program), the head block padded to 64 rows (wgmma) with
    bf16 partials, in both schedules, and TMA-copied tiles, in bf16 at the 48B shape."""
    case = decode_case(_gpu_lens(N, max_ctx, seed=N + max_ctx), H=H48, L=L48, R=R48, block_size=PAGE48,
                       dtype=torch.bfloat16, seed=N, spare_blocks=1)
    num_splits = None if splits == "auto" else 1
    tune = {"default": {}, "paged": dict(paged=True, layout="heads", prefetch="none", block_n=64, num_stages=3),
            "gathered": dict(paged=False, layout="heads", prefetch="none", num_stages=2),
            "balanced": dict(schedule="balanced"),
            "wgmma": dict(block_h=64, num_warps=8, num_stages=3, partial_dtype="input", use_pdl=True),
            "wgmma_balanced": dict(block_h=64, num_warps=8, num_stages=3, schedule="balanced"),
            "tma": dict(block_h=64, num_warps=8, num_stages=3, tma=True)}[tiles]
    check_decode(case, L48, SCALE48, tol=1e-2, num_splits=num_splits, **tune)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("use_pdl", [False, True], ids=["plain", "pdl"])
def test_gpu_decode_cuda_graph_replay(use_pdl: bool) -> None:
    check_decode_graph_replay(use_pdl=use_pdl)


def check_decode_graph_replay(**tune) -> None:
    """One capture (mla_decode with the `tune` overrides) serves new lengths and block tables written in place
    (no host sync inside)."""
    N = 8
    case = decode_case([4000] * N, H=H48, L=L48, R=R48, block_size=PAGE48, dtype=torch.bfloat16, seed=31,
                       spare_blocks=4)
    num_splits = mla_decode_num_splits(N, H48, case["block_table"].shape[1] * PAGE48)
    out = torch.empty(N, H48, L48, dtype=torch.bfloat16, device=DEV)
    call = lambda: mla_decode(**case, scale=SCALE48, kv_lora_rank=L48, num_splits=num_splits,  # noqa: E731
                              out=out, **tune)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for step, lens in enumerate([[4000, 1, 1889, 0, 7000, 3, 12000, 555], [12000] * N]):
        case["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        case["block_table"].copy_(case["block_table"].flip(0))
        case["q"].normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = mla_decode_ref(**case, scale=SCALE48, kv_lora_rank=L48)
        assert rel_err(out, want) <= 1e-2, step


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_prefill_kimi_shape() -> None:
    lens = [(4096, 4096), (1000, 3000), (1, 2000), (333, 333), (2500, 2600)]
    case = prefill_case(lens, H=H48, P=P48, R=R48, V=V48, dtype=torch.bfloat16, seed=41)
    want = mla_prefill_ref(**case, scale=SCALE48)
    got = mla_prefill(**case, scale=SCALE48)
    torch.cuda.synchronize()
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) <= 1e-2
