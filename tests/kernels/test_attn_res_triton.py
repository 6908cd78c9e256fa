"""The Triton attention-residual mix agrees with kernels/attn_res/ref.py.

Without a GPU the kernel runs in the Triton interpreter (set by conftest.py, before Triton is
imported): tiny fp32/fp16 shapes. The `gpu` cases run the compiled kernel at Kimi widths in bf16.
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.kernels.attn_res import attn_res_mix, attn_res_mix_ref  # noqa: E402
from k3rt.kernels.attn_res.triton_mix import stacked_fits  # noqa: E402
from k3rt.backend.layers.norm import rms_norm  # noqa: E402
from tests.kernels.helpers import DEV, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py


def case(seed: int, jmax: int, N: int, D: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # sources of very different scales, so the softmax over depth is far from uniform
    scale = torch.exp(torch.randn(jmax, 1, 1, generator=gen))
    buf = (torch.randn(jmax, N, D, generator=gen) * scale).to(dtype).to(DEV)
    nw = (1 + 0.2 * torch.randn(D, generator=gen)).to(DEV)
    pw = (torch.randn(1, D, generator=gen) * 2).to(DEV)
    return buf, nw, pw


@pytest.mark.parametrize("stacked", [False, True], ids=["online", "stacked"])
@pytest.mark.parametrize("J,N,D", [(1, 3, 16), (2, 1, 37), (5, 4, 64), (7, 2, 300), (16, 2, 300)],
                         ids=lambda v: str(v))
def test_mix_matches_ref(J: int, N: int, D: int, stacked: bool) -> None:
    buf, nw, pw = case(J * 7 + N, J + 2, N, D)
    if stacked and not stacked_fits(J + 2, D):
        with pytest.raises(ValueError, match="stacked form"):
            attn_res_mix(buf, nw, pw, 1e-5, num_sources=J, stacked=True)
        return
    got = attn_res_mix(buf, nw, pw, 1e-5, num_sources=J, stacked=stacked)
    assert rel_err(got, attn_res_mix_ref(buf, J, nw, pw, 1e-5)) < 1e-5


def test_the_form_follows_the_buffer_not_the_rows() -> None:
    """The stacked form where the whole [Jmax, D] stack fits its tile (k3-tiny's 9 x 384), else the online one;
    the rows never choose (a row's bits must not depend on the step's other rows: batch-invariant mode, greedy
    identity of speculative and plain decoding). Both agree with each other to fp32 rounding."""
    assert stacked_fits(9, 384) and stacked_fits(16, 512) and not stacked_fits(17, 384)
    assert not stacked_fits(9, 2304) and not stacked_fits(2, 7168)
    buf, nw, pw = case(5, 9, 6, 384)
    rows = [attn_res_mix(buf[:, :n], nw, pw, 1e-5, num_sources=7) for n in (1, 6)]
    assert torch.equal(rows[0][0], rows[1][0])  # the same program per row whatever N
    # the live slots stacked alone (pieces.py's list form) mix to the bits of the slot buffer's (one tile per width)
    assert torch.equal(attn_res_mix(buf[:7].clone(), nw, pw, 1e-5), rows[1])
    assert torch.equal(rows[1], attn_res_mix(buf, nw, pw, 1e-5, num_sources=7, stacked=True))
    assert rel_err(rows[1], attn_res_mix(buf, nw, pw, 1e-5, num_sources=7, stacked=False)) < 1e-6


@pytest.mark.parametrize("stacked", [False, True], ids=["online", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("delta_add", [True, False])
@pytest.mark.parametrize("J", [1, 3])
def test_delta_and_out_norm_fused_equal_the_add_the_mix_and_the_norm(J: int, delta_add: bool,
                                                                    dtype: torch.dtype, stacked: bool) -> None:
    """delta: the sub-layer output added into (or, delta_add=False, copied into) the prefix slot J-1 by the
    kernel, which writes the slot, as the stream's own add did (rounded to the buffer's dtype); out_norm_weight:
    the output through the norm kernel's RMSNorm. Equal to the three launches."""
    from k3rt.kernels.norm import rms_norm as rms_norm_kernel

    buf, nw, pw = case(40 + J, J + 1, 5, 48, dtype)
    gen = torch.Generator().manual_seed(J)
    delta = (torch.randn(5, 48, generator=gen) * 3).to(dtype).to(DEV)
    onw = (1 + 0.1 * torch.randn(48, generator=gen)).to(DEV)
    want = buf.clone()
    want[J - 1] = want[J - 1] + delta if delta_add else delta
    mixed = attn_res_mix(want, nw, pw, 1e-5, num_sources=J)
    got = attn_res_mix(buf, nw, pw, 1e-5, num_sources=J, delta=delta, delta_add=delta_add, out_norm_weight=onw,
                       out_norm_eps=1e-6, stacked=stacked)
    assert torch.equal(buf, want)  # the slot written as the add (copy) wrote it, nothing else touched
    # the norm's sum over the row may reduce in another order than the norm kernel's: fp32 rounding apart, so at
    # most one step of the 16-bit rounding after it
    sep = rms_norm_kernel(mixed, onw, 1e-6)
    assert rel_err(got.float(), sep.float()) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert rel_err(got.float(), rms_norm(attn_res_mix_ref(want, J, nw, pw, 1e-5), onw.to(dtype), 1e-6).float()) < 3e-3
    with pytest.raises(ValueError, match="delta must be"):
        attn_res_mix(buf, nw, pw, 1e-5, num_sources=J, delta=delta[:4])


def test_single_source_is_the_prefix() -> None:
    buf, nw, pw = case(1, 3, 5, 24)
    assert torch.allclose(attn_res_mix(buf, nw, pw, 1e-5, num_sources=1), buf[0], rtol=1e-6, atol=0)


def test_row_slice_of_larger_buffer_fp16_out() -> None:
    """The runner's [Jmax, Nmax, D] buffer sliced to the live N rows: strided slots, no copy."""
    buf, nw, pw = case(9, 6, 10, 48, torch.float16)
    live = buf[:, :7]
    out = torch.empty(7, 48, dtype=torch.float16, device=DEV)
    got = attn_res_mix(live, nw, pw.view(-1), 1e-6, num_sources=4, out=out)
    assert got is out and rel_err(got, attn_res_mix_ref(live, 4, nw, pw, 1e-6)) < 2e-3


def test_contract_errors() -> None:
    buf, nw, pw = case(2, 3, 2, 8)
    with pytest.raises(ValueError, match="num_sources must be in"):
        attn_res_mix(buf, nw, pw, 1e-5, num_sources=4)
    with pytest.raises(ValueError, match="num_sources must be in"):
        attn_res_mix(buf, nw, pw, 1e-5, num_sources=0)
    with pytest.raises(ValueError, match="sources must be"):
        attn_res_mix(buf[0], nw, pw, 1e-5)
    with pytest.raises(ValueError, match="contiguous last dim"):
        attn_res_mix(buf.transpose(1, 2), nw, pw, 1e-5)
    with pytest.raises(ValueError, match="norm_weight"):
        attn_res_mix(buf, nw[:4], pw, 1e-5)
    with pytest.raises(ValueError, match="proj_weight"):
        attn_res_mix(buf, nw, pw[:, :4], 1e-5)
    with pytest.raises(ValueError, match="out must be"):
        attn_res_mix(buf, nw, pw, 1e-5, out=torch.empty(2, 8, dtype=torch.float16, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [False, True], ids=["online", "stacked"])
@pytest.mark.parametrize("N", [1, 8, 8192])
def test_gpu_mix_k3_tiny_width(N: int, stacked: bool) -> None:
    """k3-tiny's stream (9 slots of 384) in both forms, with the prefix's add and the next norm, in bf16."""
    from k3rt.kernels.norm import rms_norm as rms_norm_kernel

    buf, nw, pw = case(N, 9, N, 384, torch.bfloat16)
    delta = torch.randn(N, 384, device=DEV).bfloat16()
    onw = (1 + 0.1 * torch.randn(384, device=DEV)).bfloat16()
    want = buf.clone()
    want[6] += delta
    got = attn_res_mix(buf, nw.bfloat16(), pw.bfloat16(), 1e-5, num_sources=7, delta=delta, out_norm_weight=onw,
                       out_norm_eps=1e-6, stacked=stacked, use_pdl=True)
    assert torch.equal(buf, want)
    ref = rms_norm_kernel(attn_res_mix_ref(want, 7, nw.bfloat16(), pw.bfloat16(), 1e-5), onw, 1e-6)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 64, 8192])
@pytest.mark.parametrize("J", [2, 9, 16])
def test_gpu_mix_kimi_width(N: int, J: int) -> None:
    buf, nw, pw = case(N + J, J, N, 2304, torch.bfloat16)
    got = attn_res_mix(buf, nw.bfloat16(), pw.bfloat16(), 1e-5, num_sources=J, use_pdl=True)
    assert rel_err(got, attn_res_mix_ref(buf, J, nw.bfloat16(), pw.bfloat16(), 1e-5)) < 1e-2


_BUILD = r"""
from k3rt.kernels.attn_res import triton_mix as M

I32, C = "i32", "constexpr"
def build(fn, D, extra, warps):
    ptrs = {"src_ptr": "*bf16", "nw_ptr": "*bf16", "pw_ptr": "*bf16", "out_ptr": "*bf16", "delta_ptr": "*bf16",
            "onw_ptr": "*bf16", "eps": "fp32", "out_eps": "fp32"}
    consts_names = ("BLOCK_D", "BLOCK_J", "ROWS", "STACKED", "DELTA", "OUT_NORM", "USE_PDL")
    sig = {a: ptrs.get(a, C if a in consts_names else I32) for a in fn.arg_names}
    consts = dict(BLOCK_D=triton.next_power_of_2(D), DELTA=2, OUT_NORM=True, USE_PDL=False, **extra)
    return sm90_build(fn, sig, {a: v for a, v in consts.items() if a in fn.arg_names}, warps, 1, lambda a: False)

print(json.dumps({
    "stacked k3-tiny": build(M._attn_res_mix_fwd_kernel, 384,
                             dict(ROWS=1, BLOCK_J=M.stacked_block_j(384), STACKED=True), M._STACK_WARPS),
    "online k3-tiny": build(M._attn_res_mix_fwd_kernel, 384, dict(ROWS=8, BLOCK_J=1, STACKED=False), 16),
    "online 2304": build(M._attn_res_mix_fwd_kernel, 2304, dict(ROWS=1, BLOCK_J=1, STACKED=False), 16),
}))
"""


def test_both_forms_build_for_sm90_without_spills() -> None:
    """The compiled kernels (not the interpreter's) at k3-tiny's width in both forms and the online one at a Kimi
    width: they build for sm_90 with the prefix's add and the next norm, and keep their tiles in registers."""
    from tests.kernels.helpers import run_sm90_build

    res = run_sm90_build(_BUILD, timeout=300)
    for name, r in res.items():
        assert r["stack"] == 0 and r["local"] == 0, (name, r)
    print(res)
