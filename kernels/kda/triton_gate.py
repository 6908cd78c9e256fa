"""KDA's decay gate and update strength for the chunked (general) form, in one launch.

g = -exp(A_log[h]) * softplus(f + dt_bias) (or the bounded form lower_bound * sigmoid(exp(A_log[h]) * (f +
dt_bias))) and beta = sigmoid(b), fp32, over a step's rows: the same per-element math as the decode kernel's
`_gate_beta` (softplus as log(1 + exp(x)) below its threshold 20), where the torch reference (`ref.kda_gate_*`
and a sigmoid) takes about a dozen launches. The oracle is `ref.kda_gate_softplus` / `ref.kda_gate_lower_bound`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import poison_like

_BLOCK = 1024  # gate values per program


@triton.jit
def _kda_gate_fwd_kernel(
    f_ptr, stride_f,  # [T, H*D] raw f_b_proj output (row stride free)
    b_ptr, stride_b,  # [T, H] raw b_proj output
    a_log_ptr, dt_ptr,  # [H], [H*D] fp32
    g_ptr, beta_ptr,  # out [T, H*D], [T, H] fp32
    lower_bound,
    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BH: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    offs = pb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H * D
    x = tl.load(f_ptr + t * stride_f + offs, mask=mask, other=0.0).to(tl.float32)
    x = x + tl.load(dt_ptr + offs, mask=mask, other=0.0)
    a = tl.exp(tl.load(a_log_ptr + offs // D, mask=mask, other=0.0))
    if USE_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(g_ptr + t * (H * D) + offs, g, mask=mask)
    if pb == 0:
        oh = tl.arange(0, BH)
        bb = tl.load(b_ptr + t * stride_b + oh, mask=oh < H, other=0.0).to(tl.float32)
        tl.store(beta_ptr + t * H + oh, tl.sigmoid(bb), mask=oh < H)


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, b: Tensor,
             lower_bound: float | None = None) -> tuple[Tensor, Tensor]:
    """The gate and beta of T rows in one launch.

    Args:
        f: [T, H*D] raw f_b_proj output, any float dtype, last dim contiguous (a column view is fine).
        A_log: [H] fp32 contiguous (the checkpoint's [1, 1, H, 1] is accepted).
        dt_bias: [H*D] fp32 contiguous (an [H, D] view is accepted).
        b: [T, H] raw b_proj output, last dim contiguous.
        lower_bound: None for the softplus gate, else the bounded gate's lower bound (-5 <= lb < 0).

    Returns:
        g: [T, H, D] fp32 log decay; beta: [T, H] fp32.
    """
    H = A_log.numel()
    if f.dim() != 2 or H == 0 or f.shape[1] % H:
        raise ValueError(f"f must be [T, H*D] with H={H} (A_log's size), got {list(f.shape)}")
    T, P = f.shape
    D = P // H
    if b.shape != (T, H):
        raise ValueError(f"b must be [T, H]=[{T}, {H}], got {list(b.shape)}")
    if dt_bias.numel() != P:
        raise ValueError(f"dt_bias must hold H*D={P} values, got {list(dt_bias.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32, got {t.dtype} (contiguous: {t.is_contiguous()})")
    for name, t in (("f", f), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if lower_bound is not None and not (-5.0 <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must satisfy -5 <= lower_bound < 0, got {lower_bound}")
    g = poison_like(torch.empty(T, H, D, dtype=torch.float32, device=f.device))
    beta = poison_like(torch.empty(T, H, dtype=torch.float32, device=f.device))
    if T:
        _kda_gate_fwd_kernel[(T, triton.cdiv(P, _BLOCK))](
            f, f.stride(0), b, b.stride(0), A_log, dt_bias, g, beta,
            0.0 if lower_bound is None else float(lower_bound),
            H=H, D=D, BLOCK=_BLOCK, BH=triton.next_power_of_2(H), USE_LOWER_BOUND=lower_bound is not None,
        )
    return g, beta
