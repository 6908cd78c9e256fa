"""MLA cache write (Triton): one program per new token normalizes its latent c (kv_a_layernorm),
appends the rope part k_pe and stores the row at its cache slot, in one launch (the torch form is a
norm of several elementwise kernels, a concatenation and an index copy). Oracle:
`ref.mla_store_latent_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import check, check_same_device


# not specialized per step (kernels/common.py, Compiles): slot_ptr: the step's kv_slot, a view of the packed step
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_latent_kernel(
    ckv_ptr, stride_ct,
    w_ptr,
    kv_ptr, stride_ks,
    slot_ptr,
    eps,
    L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
    PROD_FP32: tl.constexpr,  # promote(weight, ckv) is fp32: the weighted product is not rounded to ckv's dtype
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = ckv_ptr + t.to(tl.int64) * stride_ct
    offs = tl.arange(0, BL)
    ok = offs < L
    c = tl.load(row + offs, mask=ok, other=0.0)
    cf = c.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / L + eps)
    normed = (cf * rstd).to(c.dtype)  # the model's order: normalized in fp32, rounded, then the weight
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)  # exact in fp32 for 16-bit operands
    if not PROD_FP32:
        y = y.to(c.dtype)
    dst = kv_ptr + slot * stride_ks
    tl.store(dst + offs, y.to(kv_ptr.dtype.element_ty), mask=ok)
    offs_r = tl.arange(0, BR)
    ok_r = offs_r < R
    pe = tl.load(row + L + offs_r, mask=ok_r, other=0.0)
    tl.store(dst + L + offs_r, pe.to(kv_ptr.dtype.element_ty), mask=ok_r)


def mla_store_latent(ckv: Tensor, norm_weight: Tensor, eps: float, kv_flat: Tensor, slots: Tensor, *,
                     kv_lora_rank: int) -> None:
    """kv_flat[slots[t]] = [rmsnorm(ckv[t, :L]) * norm_weight ; ckv[t, L:]] for every token t, in place.

    Args:
        ckv: [T, L+R] float, last dim contiguous (rows may be strided: a slice of a fused projection).
        norm_weight: [L] contiguous float (kv_a_layernorm.weight).
        eps: the norm's epsilon.
        kv_flat: [S, L+R] the cache pages viewed as rows, last dim contiguous.
        slots: [T] int64 contiguous cache rows, distinct, in [0, S) (not checked: that would sync).
        kv_lora_rank: L.
    """
    if ckv.dim() != 2 or not ckv.is_floating_point() or ckv.stride(-1) != 1:
        raise ValueError(f"ckv must be a float [T, L+R] tensor with a contiguous last dim, got {ckv.dtype} "
                         f"{list(ckv.shape)} strides {ckv.stride()}")
    T, width = ckv.shape
    L = kv_lora_rank
    if not 0 < L <= width:
        raise ValueError(f"kv_lora_rank must be in (0, {width}], got {L}")
    check(norm_weight, "norm_weight", (L,))
    if not norm_weight.is_contiguous() or not norm_weight.is_floating_point():
        raise ValueError("norm_weight must be a contiguous float tensor")
    if kv_flat.dim() != 2 or kv_flat.shape[1] != width or kv_flat.stride(-1) != 1:
        raise ValueError(f"kv_flat must be [S, {width}] with a contiguous last dim, got {list(kv_flat.shape)} "
                         f"strides {kv_flat.stride()}")
    check(slots, "slots", (T,), torch.int64)
    if not slots.is_contiguous():
        raise ValueError("slots must be contiguous")
    check_same_device(ckv=ckv, norm_weight=norm_weight, kv_flat=kv_flat, slots=slots)
    if T == 0:
        return
    prod_fp32 = torch.promote_types(norm_weight.dtype, ckv.dtype) == torch.float32
    _store_latent_kernel[(T,)](
        ckv, ckv.stride(0), norm_weight, kv_flat, kv_flat.stride(0), slots, float(eps),
        L=L, R=width - L, BL=triton.next_power_of_2(L), BR=max(1, triton.next_power_of_2(width - L)),
        PROD_FP32=prod_fp32, num_warps=4,
    )
