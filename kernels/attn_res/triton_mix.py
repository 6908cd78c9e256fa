"""Attention-residual mix (Triton): every source is read once, with an online softmax over depth.

Per row, source j gives a logit l_j = rstd(src_j) * sum_d src_j[d] * w[d] (w = norm_weight *
proj_weight) that needs the whole row before the row can be weighted, so one program holds ROWS whole
rows and walks the J sources, rescaling its running weighted sum whenever the running max logit
grows (flash-attention's online softmax, over depth instead of keys). Oracle: ref.py.

Narrow streams (every slot of a row within _STACK_TILE elements: k3-tiny's 9 x 384) take the stacked form
instead: one program per row loads all J slots as one [J, D] tile at once and takes the softmax in two passes
over registers. The online form is a chain of J dependent steps, each with two row reductions across the
program's warps; at one decode row that chain, not memory, is the launch's time (k3-tiny: ~3.8 us a launch on the
H200, 16 launches per forward, a fifth of its decode graph). Which form a row takes, and the stacked form's
slot tile, depend on the width D only (and whether Jmax fits it), never on the step's rows, so a row's bits do
not depend on what else the step carries. Both forms are one kernel (`STACKED`). Timed in k3-tiny's decode graphs
on the H200 (session 33), the stacked form was no faster (0.285 / 0.351 / 0.414 ms at batch 1 / 4 / 16 against
0.281 / 0.337 / 0.412 online): the runner takes the online form unless KernelConfig.attn_res_stacked says otherwise.
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
# The stacked form's bound on next_pow2(Jmax) * next_pow2(D) (its whole tile lives in registers), and its warps.
_STACK_TILE = 8192
_STACK_WARPS = 4


@triton.jit
def _mix_source(s, w, m, den, acc, eps, D):
    """One source's step of the online softmax over depth: (m, den, acc) after source s [ROWS, BLOCK_D] fp32."""
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / D + eps)
    logit = tl.sum(s * w[None, :], axis=1) * rstd
    m_new = tl.maximum(m, logit)
    alpha = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    return m_new, den * alpha + p, acc * alpha[:, None] + p[:, None] * s


@triton.jit
def _prefix_slot(ptrs, delta_ptrs, mask, DELTA: tl.constexpr):
    """The running prefix, slot J-1, as the mix reads it: with DELTA the sub-layer output that ends it is added
    (or, opening a block, copied) here and the slot written, instead of by a launch of its own before the mix."""
    if DELTA == 0:
        last = tl.load(ptrs, mask=mask, other=0.0)
    else:
        d = tl.load(delta_ptrs, mask=mask, other=0.0)
        if DELTA == 1:
            last = d.to(ptrs.dtype.element_ty)
        else:  # rounded to the stream's dtype, as torch's add of the two is
            last = (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + d.to(tl.float32)).to(ptrs.dtype.element_ty)
        tl.store(ptrs, last, mask=mask)
    return last


@triton.jit
def _store_out(acc, den, out_ptrs, mask, onw_ptr, cols, D, out_eps, OUT_NORM: tl.constexpr):
    """acc / den [ROWS, BLOCK_D] stored, through the next sub-layer's RMSNorm with OUT_NORM (in the norm kernel's
    rounding order, triton_norm.py)."""
    out = (acc / den[:, None]).to(out_ptrs.dtype.element_ty)
    if OUT_NORM:
        xf = out.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + out_eps)
        xn = (xf * rstd[:, None]).to(out_ptrs.dtype.element_ty).to(tl.float32)
        ow = tl.load(onw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        out = (xn * ow[None, :]).to(out_ptrs.dtype.element_ty)
    tl.store(out_ptrs, out, mask=mask)


@triton.jit
def _mix_stacked(s, done, last, w, eps, D):
    """The softmax over depth in two passes: s [BLOCK_J, BLOCK_D] fp32 the completed blocks (rows past `done`
    zero), last [1, BLOCK_D] fp32 the prefix -> (the weighted sum [1, BLOCK_D], its denominator [1])."""
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / D + eps)
    logit = tl.where(done, tl.sum(s * w[None, :], axis=1) * rstd, float("-inf"))
    l_last = tl.sum(last * w[None, :], axis=1) / tl.sqrt(tl.sum(last * last, axis=1) / D + eps)  # [1]
    m = tl.maximum(tl.max(logit, axis=0), l_last)
    p = tl.exp(logit - m)  # 0 past the completed blocks
    p_last = tl.exp(l_last - m)
    return tl.sum(p[:, None] * s, axis=0)[None, :] + p_last[:, None] * last, tl.sum(p, axis=0) + p_last


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
    ROWS: tl.constexpr,  # 1 when STACKED
    BLOCK_J: tl.constexpr,  # STACKED: >= Jmax, stacked_block_j(D)
    STACKED: tl.constexpr,  # the stacked form (module docstring), else the online one
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
    last_ptrs = src_ptr + offs + (J - 1).to(tl.int64) * stride_j  # the running prefix, slot J-1
    delta_ptrs = delta_ptr + rows.to(tl.int64)[:, None] * stride_dn + cols[None, :]
    if STACKED:  # one row: the completed blocks as one [BLOCK_J, BLOCK_D] tile
        js = tl.arange(0, BLOCK_J)
        done = js < J - 1
        s = tl.load(src_ptr + tl.program_id(0).to(tl.int64) * stride_n + js.to(tl.int64)[:, None] * stride_j
                    + cols[None, :], mask=done[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
        last = _prefix_slot(last_ptrs, delta_ptrs, mask, DELTA)
        acc, den = _mix_stacked(s, done, last.to(tl.float32), w, eps, D)
    else:
        m = tl.full([ROWS], float("-inf"), tl.float32)  # running max logit
        den = tl.zeros([ROWS], tl.float32)  # running sum of exp(l_j - m)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)  # running sum of exp(l_j - m) * src_j
        ptrs = src_ptr + offs
        for _ in range(J - 1):
            s = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            ptrs += stride_j  # 64-bit pointer arithmetic: j * stride_j never overflows an int32
            m, den, acc = _mix_source(s, w, m, den, acc, eps, D)
        last = _prefix_slot(last_ptrs, delta_ptrs, mask, DELTA)
        m, den, acc = _mix_source(last.to(tl.float32), w, m, den, acc, eps, D)
    if USE_PDL:
        gdc_launch_dependents()
    _store_out(acc, den, out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask, onw_ptr, cols, D, out_eps,
               OUT_NORM)


def stacked_block_j(D: int) -> int:
    """The stacked form's slot tile at width D: the whole _STACK_TILE, whatever the buffer's Jmax, so that every
    call at one width reduces in one order (a row mixed from a [J, N, D] stack, pieces.py's list form, and from the
    slot buffer, a decode step's, get the same bits) and compiles once."""
    return max(1, _STACK_TILE // triton.next_power_of_2(D))


def stacked_fits(jmax: int, D: int) -> bool:
    """Whether a [jmax, N, D] stream takes the stacked form (module docstring)."""
    return jmax <= stacked_block_j(D)


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
    stacked: bool | None = None,
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
        stacked: the stacked form (module docstring) or the online one; None: stacked where `stacked_fits`.

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
    if stacked is None:
        stacked = stacked_fits(jmax, D)
    if stacked and not stacked_fits(jmax, D):
        raise ValueError(f"stacked: a [{jmax}, N, {D}] stream exceeds the stacked form's {_STACK_TILE}-element tile")
    if N > 0:
        block_d = triton.next_power_of_2(D)
        rows = 1 if stacked else max(1, _TILE // block_d)
        _attn_res_mix_fwd_kernel[(triton.cdiv(N, rows),)](
            sources, sources.stride(0), sources.stride(1), norm_weight, proj_weight, out,
            delta if delta is not None else out, delta.stride(0) if delta is not None else 0,
            out_norm_weight if out_norm_weight is not None else norm_weight, J, N, D, float(eps), float(out_norm_eps),
            BLOCK_D=block_d, ROWS=rows, BLOCK_J=stacked_block_j(D) if stacked else 1, STACKED=stacked,
            DELTA=0 if delta is None else 2 if delta_add else 1, OUT_NORM=out_norm_weight is not None,
            USE_PDL=use_pdl and not INTERPRET,
            num_warps=_STACK_WARPS if stacked else min(16, max(1, rows * block_d // 256)), **pdl_kwargs(use_pdl),
        )
    return out
