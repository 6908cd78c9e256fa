"""Sampling kernels (Triton): the fused logits pass and the Gumbel-max draw, one kernel body.

Each program owns one [BLOCK_V] slice of one row (grid [B, NB]) and, by constexpr flags:
  PROCESS  reads raw logits and applies the grammar bitmask, the penalties and the temperature
           (ref.process_logits, bit-exact: IEEE division, no fused multiply-add); else reads x.
  WRITE_X  stores the processed logits x (needed by the filters and by logprobs).
  LSE      stores the slice's max and sum(exp(x - max)) for the row's log-sum-exp.
  DRAW     stores the slice's best (score, index): score = x for greedy rows, else
           x - log(E), E ~ Exp(1), for tokens with x >= the row's threshold (-inf below it): the
           exponential race (backend/sampling), a draw from softmax(x) over the kept tokens.
The noise of token v in a row comes from philox(seed, counter = (v, offset lo, offset hi, 0)),
so a row's draw depends only on its seed, its offset and its logits: never on the batch around it.
Partials are combined by sampler.py with graph-safe torch ops (ties go to the lowest index).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, pdl_kwargs


# not specialized per step (kernels/common.py, Compiles): the per-row parameter vectors: slices of the sampler's batch
# buffers
@triton.jit(
    do_not_specialize_on_alignment=["temp_ptr", "topk_ptr", "rep_ptr", "freq_ptr", "pres_ptr", "rows_ptr",
                                    "seed_ptr", "off_ptr", "thr_ptr"],
)
def _sample_fwd_kernel(
    in_ptr, stride_in,  # [B, V] fp32: raw logits (PROCESS) or processed x
    x_ptr,  # [B, V] fp32 contiguous, processed logits out (WRITE_X)
    temp_ptr, topk_ptr,  # [B] fp32, [B] int32
    mask_ptr, num_words,  # [B, num_words] int32 grammar bitmask (HAS_MASK)
    rep_ptr, freq_ptr, pres_ptr,  # [B] fp32 penalties (HAS_PENALTY)
    pm_ptr, oc_ptr, rows_ptr,  # [S, V] bool, [S, V] int32, [B] state row (HAS_ROWS)
    seed_ptr, off_ptr, thr_ptr,  # [B] int64, [B] int64, [B] fp32 (HAS_THRESHOLD)
    best_val_ptr, best_idx_ptr,  # [B, NB] fp32 / int64 (DRAW)
    lse_max_ptr, lse_sum_ptr,  # [B, NB] fp32 (LSE)
    V, NB,
    BLOCK_V: tl.constexpr,
    PROCESS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_PENALTY: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    WRITE_X: tl.constexpr,
    LSE: tl.constexpr,
    DRAW: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < V
    b64 = b.to(tl.int64)
    temp = tl.load(temp_ptr + b)
    if USE_PDL:
        gdc_wait()
    x = tl.load(in_ptr + b64 * stride_in + offs, mask=valid, other=float("-inf"))
    if PROCESS:
        if HAS_MASK:
            word = tl.load(mask_ptr + b64 * num_words + offs // 32, mask=valid, other=0)
            x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
        if HAS_PENALTY:
            if HAS_ROWS:
                srow = tl.load(rows_ptr + b).to(tl.int64)
            else:
                srow = b64
            cnt = tl.load(oc_ptr + srow * V + offs, mask=valid, other=0)
            seen = (tl.load(pm_ptr + srow * V + offs, mask=valid, other=0) != 0) | (cnt > 0)
            rep = tl.load(rep_ptr + b)
            x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
            x = x - tl.load(freq_ptr + b) * cnt.to(tl.float32)
            x = x - tl.load(pres_ptr + b) * tl.where(cnt > 0, 1.0, 0.0)
        x = tl.math.div_rn(x, tl.where(temp > 0, temp, 1.0))
        x = tl.where(valid, x, float("-inf"))
    if USE_PDL:
        gdc_launch_dependents()
    if WRITE_X:
        tl.store(x_ptr + b64 * V + offs, x, mask=valid)
    out = b64 * NB + blk
    if LSE:
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(lse_max_ptr + out, m)
        tl.store(lse_sum_ptr + out, tl.sum(tl.exp(x - m_safe), axis=0))
    if DRAW:
        greedy = (temp == 0) | (tl.load(topk_ptr + b) == 1)
        if greedy:
            score = x
        else:
            off = tl.load(off_ptr + b)
            zero = offs.to(tl.uint32) * 0
            r, _, _, _ = tl.philox(tl.load(seed_ptr + b), offs.to(tl.uint32), (off & 0xFFFFFFFF).to(tl.uint32),
                                   ((off >> 32) & 0xFFFFFFFF).to(tl.uint32), zero)
            # E = -log(1 - w) ~ Exp(1), w uniform in (0, 1). The race is won by small E (the Gumbel
            # tail), so w keeps full fp32 resolution near 0 and log1p is formed as
            # log(a) * w / (1 - a), a = 1 - w (exact when a rounds to 1: then E = w).
            w = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10
            a = 1.0 - w
            e = tl.where(a == 1.0, w, -tl.log(a) * (w / (1.0 - a)))
            score = x - tl.log(e)
            if HAS_THRESHOLD:
                score = tl.where(x >= tl.load(thr_ptr + b), score, float("-inf"))
            score = tl.where(valid, score, float("-inf"))
        # lowest index among ties; valid lanes come first, so an all -inf slice still names a real token
        i = tl.argmax(score, axis=0, tie_break_left=True)
        tl.store(best_val_ptr + out, tl.max(score, axis=0))
        tl.store(best_idx_ptr + out, (blk * BLOCK_V + i).to(tl.int64))


def launch_sample_fwd(
    src: Tensor, x: Tensor | None, temperature: Tensor, top_k: Tensor, *, allowed_mask: Tensor | None,
    penalties: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None, penalty_rows: Tensor | None,
    seeds: Tensor, offsets: Tensor, threshold: Tensor | None, best: tuple[Tensor, Tensor] | None,
    lse: tuple[Tensor, Tensor] | None, process: bool, block_v: int, use_pdl: bool,
) -> None:
    """One pass of `_sample_fwd_kernel` over [B, V]; the caller (sampler.py) has checked the contract.

    penalties = (repetition, frequency, presence, prompt_mask, output_counts); best and lse are
    ([B, NB] values, [B, NB] indices or sums) scratch; x is written when given.
    """
    B, V = src.shape
    nb = triton.cdiv(V, block_v)
    assert src.stride(1) == 1 and (x is None or (x.is_contiguous() and x.shape == (B, V)))
    assert best is None or (best[0].shape == (B, nb) and best[1].shape == (B, nb))
    assert lse is None or (lse[0].shape == (B, nb) and lse[1].shape == (B, nb))
    if B == 0:
        return
    dummy = temperature
    rep, freq, pres, pm, oc = penalties if penalties is not None else (dummy,) * 5
    _sample_fwd_kernel[(B, nb)](
        src, src.stride(0), x if x is not None else src, temperature, top_k,
        allowed_mask if allowed_mask is not None else dummy,
        allowed_mask.shape[1] if allowed_mask is not None else 0,
        rep, freq, pres, pm, oc, penalty_rows if penalty_rows is not None else dummy,
        seeds, offsets, threshold if threshold is not None else dummy,
        best[0] if best is not None else dummy, best[1] if best is not None else dummy,
        lse[0] if lse is not None else dummy, lse[1] if lse is not None else dummy,
        V, nb,
        BLOCK_V=block_v, PROCESS=process, HAS_MASK=process and allowed_mask is not None,
        HAS_PENALTY=process and penalties is not None, HAS_ROWS=penalty_rows is not None,
        WRITE_X=x is not None, LSE=lse is not None, DRAW=best is not None,
        HAS_THRESHOLD=threshold is not None, USE_PDL=use_pdl and not INTERPRET,
        num_warps=4 if block_v <= 1024 else 8, enable_fp_fusion=False, **pdl_kwargs(use_pdl),
    )
