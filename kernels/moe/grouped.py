"""Routed experts through grouped GEMMs (`torch._grouped_mm`: CUTLASS's grouped kernel on sm90): the public
library kernel that `benchmarks/kernels_moe.py` times beside the Triton grouped kernels (`triton_experts.py`).
Same contract as `fused_experts`. Not used by the runner: on the H200 at the Kimi-Linear-48B's expert shape it
measured slower than the Triton kernels at every prefill size (T = 1K-16K tokens: 1.46 against 0.89 ms at 1K,
3.35 against 2.37 ms at 8K, 4.53 against 4.09 ms at 16K; benchmarks/RESULTS.md, session 28), even though its
expert runs are padded to 16 rows, not 128.

Steps, every size from T, k, E and BLOCK_M (no host sync, CUDA-graph safe):
  1. `moe_align_fwd` at BLOCK_M = 16: the pairs sorted by expert, each expert's run padded to 16 rows;
  2. the group ends: routed expert e's rows end where its last block does; the S shared experts' groups (every
     token in order, T rows each) follow the routed rows in use, so no rows fall between two groups;
  3. A = the x rows in group order (one gather; rows past the groups are never read back);
  4. gate/up = grouped_mm(A, w13^T), h = act_and_mul(gate/up), y = grouped_mm(h, w2^T);
  5. out[t] = sum_j w[t, j] * y[row of pair t*k+j] + sum_s y[shared row s, t], in fp32 (`_moe_sum_rows_kernel`,
     through the inverse of the sort).
Rounding differs from `fused_experts`: gate/up and y are rounded to x.dtype before the activation and before the
routing weight (as transformers' per-expert loop rounds them), not kept in fp32 across the epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.moe.triton_act import act_and_mul
from k3rt.kernels.moe.triton_align import moe_align_fwd
from k3rt.kernels.moe.triton_experts import check_call
from k3rt.model_config import ActivationConfig

GROUP_ALIGN = 16  # rows each expert's run is padded to (the alignment's smallest block)


def grouped_mm_available(x: Tensor) -> bool:
    """torch._grouped_mm's fast path: bf16 on an sm90+ GPU (elsewhere torch loops over the groups)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


@triton.jit(do_not_specialize=["T"])
def _moe_sum_rows_kernel(y_ptr, rows_ptr, w_ptr, used_ptr, out_ptr, stride_ot, D, T,
                         TOPK: tl.constexpr, SHARED: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[rows[t*k + j]] + sum_s y[used + s*T + t] in fp32, one rounding."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(rows_ptr + t * TOPK + j).to(tl.int64)
        wt = tl.load(w_ptr + t * TOPK + j)
        acc += wt * tl.load(y_ptr + r * D + offs, mask=mask, other=0.0).to(tl.float32)
    if SHARED > 0:
        used = tl.load(used_ptr).to(tl.int64)
        for s in tl.static_range(SHARED):
            acc += tl.load(y_ptr + (used + s * T + t) * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def group_layout(topk_ids: Tensor, num_routed: int, shared_experts: int, num_tokens: int,
                 block_m: int = GROUP_ALIGN) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The grouped GEMMs' row layout: (offs [E + S] int32 group ends, gather [R] token of each row, rows [P] the row
    of each pair, used [1] int32 the routed rows in use); R = the alignment's padded rows + S * T."""
    T, k = num_tokens, topk_ids.shape[1]
    P, S, dev = T * k, shared_experts, topk_ids.device
    sorted_ids, block_expert = moe_align_fwd(topk_ids, num_routed, block_m)
    nr = sorted_ids.numel()
    # block_expert is ascending, then -1 past the last used block: count each expert's blocks by a search
    be = torch.where(block_expert < 0, num_routed, block_expert)
    ends = torch.searchsorted(be, torch.arange(num_routed, device=dev, dtype=be.dtype), right=True)
    offs_routed = (ends * block_m).to(torch.int32)
    used = offs_routed[-1:]
    r = torch.arange(nr + S * T, device=dev, dtype=torch.int32)
    pair = torch.where(r < used, sorted_ids[r.clamp(max=nr - 1)], P)  # the sentinel P past the rows in use
    tok = torch.where(r < used, (pair // k).clamp(max=T - 1),
                      torch.where(r < used + S * T, (r - used) % T, 0))
    rows = torch.empty(P + 1, dtype=torch.int32, device=dev)
    rows.scatter_(0, pair[:nr].long(), r[:nr])  # padding and unused rows all land on the sentinel slot P
    offs = torch.cat([offs_routed, used + T * torch.arange(1, S + 1, device=dev, dtype=torch.int32)])
    return offs, tok.long(), rows[:P], used


def fused_experts_grouped(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    act: ActivationConfig,
    out: Tensor | None = None,
    shared_experts: int = 0,
) -> Tensor:
    """`fused_experts`'s contract (triton_experts.py) through two grouped GEMMs; see the module docstring.

    x [T, D] bf16 (any dtype `torch._grouped_mm` takes on this device), w13 [E, 2I, D], w2 [E, D, I] contiguous,
    topk_weights [T, k] fp32, topk_ids [T, k] int32 in [0, E - shared_experts). Returns [T, D] in x.dtype.
    """
    T, D, E, _, k, out = check_call(x, w13, w2, topk_weights, topk_ids, act, shared_experts, out)
    if T == 0:
        return out
    S = shared_experts
    offs, tok, rows, used = group_layout(topk_ids, E - S, S, T)
    a = x.index_select(0, tok)
    gate_up = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)
    h = act_and_mul(gate_up, act)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    block_d = min(1024, triton.next_power_of_2(D))
    _moe_sum_rows_kernel[(T, triton.cdiv(D, block_d))](
        y, rows, topk_weights, used, out, out.stride(0), D, T, TOPK=k, SHARED=S, BLOCK_D=block_d, num_warps=4)
    return out
