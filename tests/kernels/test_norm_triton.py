"""The Triton RMSNorm kernels agree with kernels/norm/ref.py.

Without a GPU the kernels run in the Triton interpreter (set by conftest.py, before Triton is
imported): tiny fp32/fp16 shapes. The `gpu` cases run the compiled kernels at Kimi shapes in bf16.
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.kernels.norm import rms_norm, rms_norm_gated, rms_norm_gated_ref, rms_norm_ref  # noqa: E402
from tests.kernels.helpers import DEV, rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


@pytest.mark.parametrize("N,D", [(1, 16), (3, 37), (7, 300), (2, 2304)], ids=lambda v: str(v))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_ref(N: int, D: int, residual: bool) -> None:
    gen = torch.Generator().manual_seed(N * 1000 + D)
    x, r = randn(gen, N, D, scale=3.0), randn(gen, N, D)
    w = 1 + randn(gen, D, scale=0.2)
    if residual:
        y, h = rms_norm(x, w, 1e-5, residual=r)
        y_ref, h_ref = rms_norm_ref(x, w, 1e-5, residual=r)
        assert torch.equal(h, h_ref)
    else:
        y, y_ref = rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    assert rel_err(y, y_ref) < 1e-5


def test_rms_norm_fp16_strided_rows_in_place() -> None:
    """fp16 rows with a row stride; h written over residual and y over x (the in-place decode form)."""
    gen = torch.Generator().manual_seed(5)
    big = randn(gen, 6, 64, dtype=torch.float16)
    x = big[:, :40]  # row stride 64
    r = randn(gen, 6, 40, dtype=torch.float16).contiguous()
    w = randn(gen, 40).to(torch.float16)
    y_ref, h_ref = rms_norm_ref(x.clone(), w, 1e-6, residual=r.clone())
    y, h = rms_norm(x, w, 1e-6, residual=r, residual_out=r)
    assert h.data_ptr() == r.data_ptr() and torch.equal(h, h_ref)
    assert rel_err(y, y_ref) < 2e-3
    xc = x.contiguous()
    y2 = rms_norm(xc, w, 1e-6, out=xc)
    assert y2.data_ptr() == xc.data_ptr() and rel_err(y2, rms_norm_ref(x, w, 1e-6)) < 2e-3


def test_rms_norm_fp32_weight_on_fp16_gives_fp32() -> None:
    gen = torch.Generator().manual_seed(6)
    x = randn(gen, 4, 24, dtype=torch.float16)
    w = randn(gen, 24)
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32 and rel_err(y, rms_norm_ref(x, w, 1e-5)) < 1e-6


@pytest.mark.parametrize("N,H,D", [(1, 1, 8), (5, 3, 20), (9, 4, 128)], ids=lambda v: str(v))
def test_rms_norm_gated_matches_ref(N: int, H: int, D: int) -> None:
    gen = torch.Generator().manual_seed(N * 100 + H * 10 + D)
    x = randn(gen, N, H, D, scale=2.0)
    g_flat = randn(gen, N, H * D + 3, scale=2.0)
    gate = g_flat[:, : H * D].view(N, H, D)  # a strided view, as the layer passes its projection
    w = randn(gen, D)
    y = rms_norm_gated(x, gate, w, 1e-5)
    assert rel_err(y, rms_norm_gated_ref(x, gate, w, 1e-5)) < 1e-5


def test_rms_norm_gated_fp16() -> None:
    gen = torch.Generator().manual_seed(8)
    x, gate = randn(gen, 3, 2, 32, dtype=torch.float16), randn(gen, 3, 2, 32, dtype=torch.float16)
    w = randn(gen, 32)
    out = torch.empty(3, 2, 32, dtype=torch.float16, device=DEV)
    y = rms_norm_gated(x, gate, w, 1e-5, out=out)
    assert y is out and rel_err(y, rms_norm_gated_ref(x, gate, w, 1e-5)) < 2e-3


def test_contract_errors() -> None:
    x = torch.randn(4, 8, device=DEV)
    w = torch.randn(8, device=DEV)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(x[None], w, 1e-5)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.randn(9, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x.half(), w.double(), 1e-5)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(x, w, 1e-5, residual=x.half())
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(torch.randn(8, 4, device=DEV).t(), w, 1e-5)
    with pytest.raises(ValueError, match="out must have shape"):
        rms_norm(x, w, 1e-5, out=torch.empty(4, 9, device=DEV))
    with pytest.raises(ValueError, match="residual_out must be None"):
        rms_norm(x, w, 1e-5, residual_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="gate must have shape"):
        rms_norm_gated(x.view(4, 2, 4), x.view(2, 4, 4), w[:4], 1e-5)
    with pytest.raises(ValueError, match="stride"):
        rms_norm_gated(x.view(4, 2, 4), torch.randn(4, 4, 2, device=DEV).transpose(1, 2), w[:4], 1e-5)


def test_empty_batch() -> None:
    x = torch.empty(0, 8, device=DEV)
    assert rms_norm(x, torch.ones(8, device=DEV), 1e-5).shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 64, 8192])
def test_gpu_rms_norm_kimi_shape(N: int) -> None:
    gen = torch.Generator().manual_seed(N)
    D = 2304
    x, r = randn(gen, N, D, dtype=torch.bfloat16), randn(gen, N, D, dtype=torch.bfloat16)
    w = (1 + randn(gen, D, scale=0.1)).to(torch.bfloat16)
    y, h = rms_norm(x, w, 1e-5, residual=r, use_pdl=True)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-5, residual=r)
    assert torch.equal(h, h_ref)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)) < 1e-2
    lat = randn(gen, N, 512, dtype=torch.bfloat16)
    wl = randn(gen, 512, dtype=torch.bfloat16)
    assert rel_err(rms_norm(lat, wl, 1e-6), rms_norm_ref(lat, wl, 1e-6)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 64, 8192])
def test_gpu_rms_norm_gated_kimi_shape(N: int) -> None:
    gen = torch.Generator().manual_seed(N + 1)
    x, gate = randn(gen, N, 32, 128, dtype=torch.bfloat16), randn(gen, N, 32, 128, dtype=torch.bfloat16)
    w = randn(gen, 128)
    assert rel_err(rms_norm_gated(x, gate, w, 1e-5), rms_norm_gated_ref(x, gate, w, 1e-5)) < 1e-2


def test_benchmark_smoke(tmp_path) -> None:
    """benchmarks/kernels_misc.py --smoke runs every item (norms, mix in both forms, sampling) without an error."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_misc.py"
    out = tmp_path / "misc.json"
    subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], check=True, capture_output=True,
                   timeout=120)
    res = json.loads(out.read_text())
    items = [r for k in ("rms_norm", "rms_norm_residual", "rms_norm_gated", "attn_res_mix", "sampling")
             for r in res[k]]
    # 4 ops x 2 rows, the mix at k3-tiny's width x 2 rows x its 2 forms, 8 sampling rows
    assert len(items) == 4 * 2 + 2 * 2 + 4 * 2 and all("us" in r for r in items), [r for r in items if "us" not in r]
