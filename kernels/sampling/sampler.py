"""GPU batch sampling with every input on the device: no host synchronization, CUDA-graph safe.

Pipeline (semantics: ref.py, which restates backend/sampling over tensors):
  1. `_sample_fwd_kernel` pass 1: bitmask, penalties, temperature -> processed logits x (and the
     per-slice log-sum-exp partials when logprobs are asked for).
  2. with filters on: the per-row keep threshold from one descending sort of x (torch.sort is
     graph-safe); the kept set is {x >= threshold}.
  3. pass 2: Gumbel-max draw above the threshold (argmax for greedy rows) into per-slice partials.
     Without filters, passes 1 and 3 are one kernel and x is never written unless logprobs need it.
  4. combine the partials with torch ops: token = the best slice's index (lowest on ties).
Every size comes from tensor shapes or Python arguments, so a runner can capture one graph per
(apply_filters, num_logprobs, has_mask, has_penalties) combination it uses.

Per-request state the runner keeps on the device:
  prompt_mask [S, V] bool, set once at admission (prompt ids scattered to True);
  output_counts [S, V] int32, updated after each step with one
      output_counts.index_put_((rows, token_ids), ones, accumulate=True)   (or scatter_add_ on row views);
  seeds [B] int64 (random ones drawn by the runner for unseeded requests) and offsets [B] int64
      (e.g. the number of tokens the request has generated): same seed and offset -> same token.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from k3rt.kernels.common import check_same_device, poison_like
from k3rt.kernels.sampling.triton_sample import launch_sample_fwd


class SampleResult(NamedTuple):
    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] fp32 log_softmax(x)[token]; None unless num_logprobs is set
    top_logprobs: Tensor | None  # [B, n] fp32, most likely first; None unless num_logprobs is set
    top_ids: Tensor | None  # [B, n] int64 token ids of top_logprobs


def filter_thresholds(x: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, greedy: Tensor) -> Tensor:
    """x [B, V] processed logits -> [B] fp32 threshold: top-k, then min-p, then top-p keep x >= it.

    Each filter keeps a prefix of the descending order, so the three together keep a prefix, and its
    last value is the threshold. Greedy rows get -inf (they take the argmax of x unfiltered).
    """
    V = x.shape[1]
    neg_inf = float("-inf")
    xs = x.sort(-1, descending=True).values  # [B, V]
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k).long()
    xs = xs.masked_fill(xs < xs.gather(1, (k - 1)[:, None]), neg_inf)
    probs = xs.softmax(-1)
    xs = xs.masked_fill(probs < min_p[:, None] * probs[:, :1], neg_inf)
    probs = xs.softmax(-1)
    # top_p = 1 becomes inf so that cumsum rounding past 1.0 can never cut an unfiltered row's tail
    cut = torch.where(top_p >= 1.0, float("inf"), top_p)[:, None]
    xs = xs.masked_fill(probs.cumsum(-1) - probs >= cut, neg_inf)
    kept = (xs > neg_inf).sum(-1)  # [B]; 0 only when the whole row is -inf
    thr = xs.gather(1, (kept - 1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(greedy, neg_inf, thr)


def _vec(t: Tensor, name: str, B: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != (B,) or t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous [{B}] {' or '.join(map(str, dtypes))}, "
                         f"got {t.dtype} {list(t.shape)}")


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
    *,
    allowed_mask: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    penalty_rows: Tensor | None = None,
    apply_filters: bool = True,
    num_logprobs: int | None = None,
    out: Tensor | None = None,
    block_v: int | None = None,
    use_pdl: bool = False,
) -> SampleResult:
    """Pick one token per row on the device.

    Args:
        logits: [B, V] fp32 (rows may be strided; last dim contiguous). Not modified.
        temperature: [B] fp32, 0 = greedy.  top_k: [B] int32, 0 = off (1 = greedy).
        top_p: [B] fp32 in (0, 1], 1 = off.  min_p: [B] fp32 in [0, 1], 0 = off.
        seeds, offsets: [B] int64 per-row philox seed and counter offset.
        allowed_mask: optional [B, ceil(V/32)] int32 grammar bitmask, bit set = allowed. A row with
            no allowed token returns token 0 (the CPU sampler raises; nothing here can).
        repetition_penalty, frequency_penalty, presence_penalty: [B] fp32 (1, 0, 0 = off), all
            five penalty arguments together or none: prompt_mask [S, V] bool, output_counts [S, V]
            int32, both contiguous, S >= B.
        penalty_rows: optional [B] int32/int64 state row of each batch row (None: row i -> row i).
        apply_filters: False skips top-k/top-p/min-p (the sort) entirely: pass it when the host knows
            no row filters. top_k == 1 rows are greedy either way.
        num_logprobs: None for no logprobs; else n >= 0 top alternatives per row (plus the chosen
            token's logprob), from log_softmax of the processed logits.
        out: optional [B] int64 buffer for the token ids.
        block_v: vocabulary slice per program (power of 2); None picks one from B.
        use_pdl: programmatic dependent launch for the first kernel (GPU only).

    Returns:
        SampleResult.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [B, V], got {logits.dtype} {list(logits.shape)}")
    B, V = logits.shape
    if V > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must have a contiguous last dim, got strides {logits.stride()}")
    if V >= 2**31:
        raise ValueError(f"logits: V must be < 2^31, got {V}")
    _vec(temperature, "temperature", B, (torch.float32,))
    _vec(top_k, "top_k", B, (torch.int32,))
    _vec(top_p, "top_p", B, (torch.float32,))
    _vec(min_p, "min_p", B, (torch.float32,))
    _vec(seeds, "seeds", B, (torch.int64,))
    _vec(offsets, "offsets", B, (torch.int64,))
    if allowed_mask is not None:
        words = (V + 31) // 32
        if tuple(allowed_mask.shape) != (B, words) or allowed_mask.dtype != torch.int32 \
                or not allowed_mask.is_contiguous():
            raise ValueError(f"allowed_mask must be contiguous int32 [{B}, {words}], "
                             f"got {allowed_mask.dtype} {list(allowed_mask.shape)}")
    pen = (repetition_penalty, frequency_penalty, presence_penalty, prompt_mask, output_counts)
    penalties = None
    if any(t is not None for t in pen):
        if any(t is None for t in pen):
            raise ValueError("repetition_penalty, frequency_penalty, presence_penalty, prompt_mask and "
                             "output_counts must be given together")
        for name, t in zip(("repetition_penalty", "frequency_penalty", "presence_penalty"), pen[:3]):
            _vec(t, name, B, (torch.float32,))
        S = prompt_mask.shape[0] if prompt_mask.dim() == 2 else -1
        for name, t, dt in (("prompt_mask", prompt_mask, torch.bool), ("output_counts", output_counts, torch.int32)):
            if t.dim() != 2 or t.shape[1] != V or t.shape[0] != S or t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous {dt} [S, {V}] (S shared), got {t.dtype} {list(t.shape)}")
        if penalty_rows is None and S < B:
            raise ValueError(f"prompt_mask/output_counts need S >= B={B} rows without penalty_rows, got S={S}")
        penalties = pen
    if penalty_rows is not None:
        if penalties is None:
            raise ValueError("penalty_rows needs the penalty tensors")
        _vec(penalty_rows, "penalty_rows", B, (torch.int32, torch.int64))
    if num_logprobs is not None and not 0 <= num_logprobs <= V:
        raise ValueError(f"num_logprobs must be None or in [0, {V}], got {num_logprobs}")
    if out is not None:
        _vec(out, "out", B, (torch.int64,))
    if block_v is None:
        block_v = 1024 if B < 16 else 4096
    if block_v & (block_v - 1) or not 32 <= block_v <= 16384:
        raise ValueError(f"block_v must be a power of 2 in [32, 16384], got {block_v}")
    check_same_device(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      seeds=seeds, offsets=offsets, allowed_mask=allowed_mask, prompt_mask=prompt_mask,
                      output_counts=output_counts, penalty_rows=penalty_rows, out=out,
                      **{n: t for n, t in zip(("repetition_penalty", "frequency_penalty", "presence_penalty"),
                                              pen[:3]) if t is not None})

    dev = logits.device
    nb = -(-V // block_v)
    need_x = apply_filters or num_logprobs is not None
    x = poison_like(torch.empty(B, V, dtype=torch.float32, device=dev)) if need_x else None
    best = (poison_like(torch.empty(B, nb, dtype=torch.float32, device=dev)),
            torch.empty(B, nb, dtype=torch.int64, device=dev))
    lse = None
    if num_logprobs is not None:
        lse = tuple(poison_like(torch.empty(B, nb, dtype=torch.float32, device=dev)) for _ in range(2))
    common = dict(seeds=seeds, offsets=offsets, penalty_rows=penalty_rows, block_v=block_v)
    if apply_filters:
        launch_sample_fwd(logits, x, temperature, top_k, allowed_mask=allowed_mask, penalties=penalties,
                          threshold=None, best=None, lse=lse, process=True, use_pdl=use_pdl, **common)
        greedy = (temperature == 0) | (top_k == 1)
        thr = filter_thresholds(x, top_k, top_p, min_p, greedy)
        launch_sample_fwd(x, None, temperature, top_k, allowed_mask=None, penalties=None, threshold=thr,
                          best=best, lse=None, process=False, use_pdl=False, **common)
    else:
        launch_sample_fwd(logits, x, temperature, top_k, allowed_mask=allowed_mask, penalties=penalties,
                          threshold=None, best=best, lse=lse, process=True, use_pdl=use_pdl, **common)
    block = best[0].argmax(1, keepdim=True)  # [B, 1]; first maximal slice = lowest token index on ties
    token_ids = out if out is not None else torch.empty(B, dtype=torch.int64, device=dev)
    torch.gather(best[1], 1, block, out=token_ids.view(B, 1))
    if num_logprobs is None:
        return SampleResult(token_ids, None, None, None)
    m, s = lse
    top = m.max(1, keepdim=True).values  # [B, 1]
    logz = top + (s * torch.exp(m - top)).sum(1, keepdim=True).log()  # [B, 1]
    chosen = x.gather(1, token_ids[:, None]) - logz
    values, ids = x.topk(num_logprobs, -1)
    return SampleResult(token_ids, chosen.squeeze(1), values - logz, ids)
