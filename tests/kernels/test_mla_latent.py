"""mla_store_latent (norm + rope append + scatter into the cache rows, one launch) against its oracle:
within one rounding in fp32/fp16/bf16 (same rounding order, the fp32 sum order may differ), strided input rows, only the named slots written,
the contract errors. CPU: interpreter (fp32, and bf16 storage with fp32 math)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.mla import mla_store_latent, mla_store_latent_ref  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA  # noqa: E402


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.float16, torch.float32)]
                         + ([(torch.bfloat16, torch.bfloat16)] if HAS_CUDA else []))
@pytest.mark.parametrize("L,R", [(32, 16), (48, 8), (512, 64)])
def test_matches_ref_and_writes_only_its_slots(dtype, wdtype, L: int, R: int) -> None:
    g = torch.Generator().manual_seed(L + R)
    T, S = 5, 40
    wide = torch.randn(T, L + R + 24, generator=g).to(dtype).to(DEV)
    ckv = wide[:, 10:10 + L + R]  # a slice of a fused projection: strided rows
    w = (1 + 0.1 * torch.randn(L, generator=g)).to(wdtype).to(DEV)
    slots = torch.tensor([3, 17, 0, 39, 8], device=DEV)
    got = torch.full((S, L + R), -7.0, dtype=dtype, device=DEV)
    want = got.clone()
    mla_store_latent(ckv, w, 1e-6, got, slots, kv_lora_rank=L)
    mla_store_latent_ref(ckv, w, 1e-6, want, slots, L)
    # the same rounding steps; the rstd's fp32 sum order may differ, so one ulp of slack
    torch.testing.assert_close(got, want)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (got[untouched.to(DEV)] == -7.0).all()


def test_rejects_bad_inputs() -> None:
    ckv, w = torch.randn(2, 48, device=DEV), torch.ones(32, device=DEV)
    kv, slots = torch.zeros(10, 48, device=DEV), torch.tensor([1, 2], device=DEV)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_store_latent(ckv, w, 1e-6, kv, slots, kv_lora_rank=49)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        mla_store_latent(ckv, torch.ones(31, device=DEV), 1e-6, kv, slots, kv_lora_rank=32)
    with pytest.raises(ValueError, match="kv_flat must be"):
        mla_store_latent(ckv, w, 1e-6, torch.zeros(10, 47, device=DEV), slots, kv_lora_rank=32)
    with pytest.raises(ValueError, match="slots must be"):
        mla_store_latent(ckv, w, 1e-6, kv, slots.int(), kv_lora_rank=32)
