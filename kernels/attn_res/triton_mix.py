"""Attention-residual mix (Triton): every source is read once, with an online softmax over depth.

Per row, source j gives a logit l_j = rstd(src_j) * sum_d src_j[d] * w[d] (w = norm_weight *
proj_weight) that needs the whole row before the row can be weighted, so one program holds ROWS whole
rows and walks the J sources, rescaling its running weighted sum whenever the running max logit
grows (flash-attention's online softmax, over depth instead of keys). Oracle: ref.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check_same_device, pdl_kwargs, poison_like

# Elements of one source tile a program keeps live (the running sum doubles it).
_TILE = 4096


@triton.jit
def _mix_source(s, w, m, den, acc, eps, D):
    """One source's step of the online softmax over depth: (m, den, acc) after source s [ROWS, BLOCK_D] fp32."""
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / D + eps)
    logit = tl.sum(s * w[None, :], axis=1) * rstd
    m_new = tl.maximum(m, logit)
    alpha = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, den * alpha + p, acc * alpha[:, None] + p[:, None] * s


# not specialized per step (kernels/common.py, Compiles): N: the step's rows
@triton.jit(do_not_specialize=["N"])
def _attn_res_mix_fwd_kernel(
    src_ptr, stride_j, stride_n,  # [Jmax, N, D], last dim contiguous
    nw_ptr, pw_ptr,  # [D], [D]
    out_ptr,  # [N, D] contiguous
    delta_ptr, stride_dn,  # [N, D] (DELTA only)
    onw_ptr,  # [D] the output's RMSNorm weight (OUT_NORM only)
    J, N, D, eps, out_eps,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    DELTA: tl.constexpr,  # 0: slot J-1 as it is; 1: slot J-1 := delta; 2: slot J-1 := slot J-1 + delta (rounded)
    OUT_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_n + cols[None, :]
    w = tl.load(nw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    w = w * tl.load(pw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max logit
    den = tl.zeros([ROWS], tl.float32)  # running sum of exp(l_j - m)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)  # running sum of exp(l_j - m) * src_j
    ptrs = src_ptr + offs
    for _ in range(J - 1):
        s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += stride_j  # 64-bit pointer arithmetic: j * stride_j never overflows an int32
        m, den, acc = _mix_source(s, w, m, den, acc, eps, D)
    # the running prefix, slot J-1: with DELTA the sub-layer output that ends it is added (or, opening a block,
    # copied) here and the slot written, instead of by a launch of its own before the mix
    if DELTA == 0:
        last = tl.load(ptrs, mask=mask, other=0.0)
    else:
        d = tl.load(delta_ptr + rows.to(tl.int64)[:, None] * stride_dn + cols[None, :], mask=mask, other=0.0)
        if DELTA == 1:
            last = d.to(src_ptr.dtype.element_ty)
        else:  # rounded to the stream's dtype, as torch's add of the two is
            last = (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + d.to(tl.float32)).to(src_ptr.dtype.element_ty)
        tl.store(ptrs, last, mask=mask)
    m, den, acc = _mix_source(last.to(tl.float32), w, m, den, acc, eps, D)
    if USE_PDL:
        gdc_launch_dependents()
    out = (acc / den[:, None]).to(out_ptr.dtype.element_ty)
    if OUT_NORM:  # the next sub-layer's RMSNorm, in the norm kernel's rounding order (triton_norm.py)
        xf = out.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + out_eps)
        xn = (xf * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
        ow = tl.load(onw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        out = (xn * ow[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], out, mask=mask)


def attn_res_mix(
    sources: Tensor,
    norm_weight: Tensor,
    proj_weight: Tensor,
    eps: float,
    *,
    num_sources: int | None = None,
    out: Tensor | None = None,
    use_pdl: bool = False,
    delta: Tensor | None = None,
    delta_add: bool = True,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float = 0.0,
) -> Tensor:
    """Softmax-over-depth mix of the first J slots of a stacked source buffer, in one pass.

    Args:
        sources: [Jmax, N, D]; slots 0..J-2 are the completed blocks in order, slot J-1 the running
            prefix. Slot and row strides are free (e.g. a [Jmax, Nmax, D] buffer sliced to N rows);
            the last dim must be contiguous.
        norm_weight: [D] contiguous.
        proj_weight: [D] or [1, D] contiguous.
        eps: RMSNorm eps used for each source's rstd.
        num_sources: J (a Python int, 1 <= J <= Jmax); None means Jmax.
        out: optional contiguous [N, D] in sources.dtype.
        use_pdl: programmatic dependent launch (GPU only).
        delta: optional [N, D] (last dim contiguous): the sub-layer output that ends the running prefix, applied
            first: slot J-1 becomes slot J-1 + delta (delta_add, rounded to sources.dtype as torch's add) or delta
            itself (not delta_add: the first output of a new block), written into the slot, then mixed. The
            stream's add and the mix in one launch.
        out_norm_weight, out_norm_eps: optional [D]: the output goes through RMSNorm with this weight (the next
            sub-layer's input norm, in triton_norm's rounding order) before it is stored. The mix and the norm in
            one launch.

    Returns:
        [N, D] in sources.dtype, equal to ref.attn_res_mix(sources, J, ...) up to fp32 rounding (then
        rms_norm(., out_norm_weight, out_norm_eps) with a norm weight).
    """
    if sources.dim() != 3:
        raise ValueError(f"sources must be [Jmax, N, D], got {list(sources.shape)}")
    jmax, N, D = sources.shape
    J = jmax if num_sources is None else int(num_sources)
    if not 1 <= J <= jmax:
        raise ValueError(f"num_sources must be in [1, {jmax}], got {num_sources}")
    if D > 1 and sources.stride(2) != 1:
        raise ValueError(f"sources must have a contiguous last dim, got strides {sources.stride()}")
    if tuple(norm_weight.shape) != (D,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be contiguous [{D}], got {list(norm_weight.shape)}")
    if proj_weight.numel() != D or proj_weight.dim() > 2 or not proj_weight.is_contiguous():
        raise ValueError(f"proj_weight must be contiguous [{D}] or [1, {D}], got {list(proj_weight.shape)}")
    if out is None:
        out = poison_like(torch.empty(N, D, dtype=sources.dtype, device=sources.device))
    if tuple(out.shape) != (N, D) or out.dtype != sources.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {sources.dtype} [{N}, {D}], got {out.dtype} {list(out.shape)}")
    if delta is not None and (tuple(delta.shape) != (N, D) or (D > 1 and delta.stride(1) != 1)):
        raise ValueError(f"delta must be [{N}, {D}] with a contiguous last dim, got {list(delta.shape)} strides "
                         f"{delta.stride()}")
    if out_norm_weight is not None and (tuple(out_norm_weight.shape) != (D,) or not out_norm_weight.is_contiguous()):
        raise ValueError(f"out_norm_weight must be contiguous [{D}], got {list(out_norm_weight.shape)}")
    check_same_device(sources=sources, norm_weight=norm_weight, proj_weight=proj_weight, out=out, delta=delta,
                      out_norm_weight=out_norm_weight)
    if N > 0:
        block_d = triton.next_power_of_2(D)
        rows = max(1, _TILE // block_d)
        num_warps = min(16, max(1, rows * block_d // 256))
        _attn_res_mix_fwd_kernel[(triton.cdiv(N, rows),)](
            sources, sources.stride(0), sources.stride(1), norm_weight, proj_weight, out,
            delta if delta is not None else out, delta.stride(0) if delta is not None else 0,
            out_norm_weight if out_norm_weight is not None else norm_weight, J, N, D, float(eps), float(out_norm_eps),
            BLOCK_D=block_d, ROWS=rows, DELTA=0 if delta is None else 2 if delta_add else 1,
            OUT_NORM=out_norm_weight is not None, USE_PDL=use_pdl and not INTERPRET, num_warps=num_warps,
            **pdl_kwargs(use_pdl),
        )
    return out
