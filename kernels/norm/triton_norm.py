"""RMSNorm kernels (Triton): the plain norm with an optional fused residual add, and KDA's gated norm.

Both are bandwidth-bound: each program holds ROWS whole rows in registers, reads every input element
once and writes every output once. Rounding follows ref.py (and backend/layers/norm.py) exactly:
the residual sum is rounded to x.dtype before it is normalized, the normalized row is rounded to
x.dtype before the weight multiplies it; the gated norm stays in fp32 until the store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check_same_device, pdl_kwargs, poison_like

# Elements one program keeps live per input; past this rows get their own program.
_TILE = 4096


# not specialized per step (kernels/common.py, Compiles): N: the step's rows
@triton.jit(do_not_specialize=["N"])
def _rms_norm_fwd_kernel(
    x_ptr, stride_x,  # [N, D]
    r_ptr, stride_r,  # [N, D] residual (unused without HAS_RESIDUAL)
    w_ptr,  # [D]
    y_ptr, stride_y,  # [N, D]
    h_ptr,  # [N, D] contiguous residual_out (unused without HAS_RESIDUAL)
    N, D, eps,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if USE_PDL:
        gdc_wait()
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64 * stride_r + cols[None, :], mask=mask, other=0.0)
        # the new residual stream is rounded to x.dtype first, and that rounded value is normalized
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    if HAS_RESIDUAL:
        tl.store(h_ptr + rows64 * D + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [ROWS]
    xn = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows64 * stride_y + cols[None, :], (xn * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


# not specialized per step (kernels/common.py, Compiles): R: the step's rows times heads
@triton.jit(do_not_specialize=["R"])
def _rms_norm_gated_fwd_kernel(
    x_ptr, stride_xn, stride_xh,  # [N, H, D]
    g_ptr, stride_gn, stride_gh,  # [N, H, D]
    w_ptr,  # [D]
    y_ptr,  # [N, H, D] contiguous
    R, H, D, eps,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    # a "row" is one (token, head) pair: rows = N * H
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    tok = (rows // H).to(tl.int64)[:, None]
    head = (rows % H).to(tl.int64)[:, None]
    x = tl.load(x_ptr + tok * stride_xn + head * stride_xh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + tok * stride_gn + head * stride_gh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = w[None, :] * (x * rstd[:, None]) * tl.sigmoid(g)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _tiling(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) for rows of D elements."""
    block_d = triton.next_power_of_2(D)
    rows = max(1, _TILE // block_d)
    num_warps = min(16, max(1, rows * block_d // 256))
    return block_d, rows, num_warps


def _check_rows(t: Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
                contiguous: bool = False) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    *,
    residual: Tensor | None = None,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    use_pdl: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim, optionally fused with the residual add before it (one pass).

    Args:
        x: [N, D] activations; rows may be strided, the last dim must be contiguous.
        weight: [D] contiguous, x.dtype or fp32.
        eps: added to mean(h^2) inside the rsqrt.
        residual: optional [N, D] in x.dtype (last dim contiguous); h = x + residual is normalized.
        out: optional [N, D] output in promote(weight.dtype, x.dtype), last dim contiguous (rows may be strided:
            a column slice of a wider buffer, e.g. the LatentMoE tail's [shared h | latent] input); may be x itself.
        residual_out: optional contiguous [N, D] x.dtype buffer for h; may be residual itself.
        use_pdl: programmatic dependent launch (GPU only).

    Returns:
        y without residual; (y, h) with it. Matches ref.rms_norm's rounding order.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got {list(x.shape)}")
    N, D = x.shape
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    _check_rows(x, "x", (N, D))
    _check_rows(weight, "weight", (D,), contiguous=True)
    if weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"weight must be {x.dtype} or torch.float32, got {weight.dtype}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if residual is not None:
        _check_rows(residual, "residual", (N, D), x.dtype)
        if residual_out is None:
            residual_out = poison_like(torch.empty(N, D, dtype=x.dtype, device=x.device))
        _check_rows(residual_out, "residual_out", (N, D), x.dtype, contiguous=True)
    elif residual_out is not None:
        raise ValueError("residual_out must be None when residual is None")
    if out is None:
        out = poison_like(torch.empty(N, D, dtype=out_dtype, device=x.device))
    _check_rows(out, "out", (N, D), out_dtype)
    check_same_device(x=x, weight=weight, residual=residual, out=out, residual_out=residual_out)
    if N > 0:
        block_d, rows, num_warps = _tiling(D)
        has_res = residual is not None
        _rms_norm_fwd_kernel[(triton.cdiv(N, rows),)](
            x, x.stride(0), residual if has_res else x, residual.stride(0) if has_res else 0, weight,
            out, out.stride(0), residual_out if has_res else out, N, D, float(eps),
            BLOCK_D=block_d, ROWS=rows, HAS_RESIDUAL=has_res, USE_PDL=use_pdl and not INTERPRET,
            num_warps=num_warps, **pdl_kwargs(use_pdl),
        )
    return out if residual is None else (out, residual_out)


def rms_norm_gated(x: Tensor, gate: Tensor, weight: Tensor, eps: float, *, out: Tensor | None = None) -> Tensor:
    """KDA output norm in one pass: weight * rmsnorm(x) * sigmoid(gate), fp32 math.

    Args:
        x: [N, H, D]; the last two dims must be laid out as a contiguous [H, D] (stride(1) == D),
            the token stride is free.
        gate: [N, H, D], same layout rule (e.g. a view of the gate projection's [N, H*D] output).
        weight: [D] contiguous, any float dtype.
        eps: added to mean(x^2) inside the rsqrt.
        out: optional contiguous [N, H, D] in x.dtype.

    Returns:
        [N, H, D] in x.dtype.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [N, H, D], got {list(x.shape)}")
    N, H, D = x.shape
    for name, t in (("x", x), ("gate", gate)):
        _check_rows(t, name, (N, H, D))
        if H > 1 and t.stride(1) != D:
            raise ValueError(f"{name} must have stride(1) == D={D} (heads packed), got strides {t.stride()}")
    _check_rows(weight, "weight", (D,), contiguous=True)
    if out is None:
        out = poison_like(torch.empty(N, H, D, dtype=x.dtype, device=x.device))
    _check_rows(out, "out", (N, H, D), x.dtype, contiguous=True)
    check_same_device(x=x, gate=gate, weight=weight, out=out)
    R = N * H
    if R > 0:
        block_d, rows, num_warps = _tiling(D)
        _rms_norm_gated_fwd_kernel[(triton.cdiv(R, rows),)](
            x, x.stride(0), D, gate, gate.stride(0), D, weight, out, R, H, D, float(eps),
            BLOCK_D=block_d, ROWS=rows, num_warps=num_warps,
        )
    return out
