"""MLA's output gate in one launch (Triton): y = o * sigmoid(gate), written as the o_proj's contiguous input.

Why: the torch form is a cast of the gate to fp32, the sigmoid, a cast back and the product (four kernels in bf16,
two in fp32) per MLA layer, and at batch 1 a decode forward is launch-bound (issue 16's batch-1 round). o comes
from the W_UV product as [N, H, V] with heads outermost (strided rows), gate as a column slice of the fused
projection; the kernel reads both as they are and writes y contiguous [N, H * V].

Rounding as the model's: the sigmoid in fp32 rounded to o's dtype, then the product rounded once. Oracle:
`ref.mla_output_gate_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import check_same_device


@triton.jit
def _output_gate_kernel(o_ptr, stride_on, stride_oh, g_ptr, stride_gn, stride_gh, y_ptr, H, V,
                        BLOCK_V: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    ok = cols < V
    o = tl.load(o_ptr + n * stride_on + h * stride_oh + cols, mask=ok, other=0.0)
    g = tl.load(g_ptr + n * stride_gn + h * stride_gh + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(g).to(o.dtype).to(tl.float32)
    tl.store(y_ptr + (n * H + h) * V + cols, (o.to(tl.float32) * s).to(y_ptr.dtype.element_ty), mask=ok)


def mla_output_gate(o: Tensor, gate: Tensor, *, out: Tensor | None = None) -> Tensor:
    """o * sigmoid(gate) -> contiguous [N, H, V] in o's dtype (or into `out`).

    Args:
        o: [N, H, V] float, last dim contiguous (rows and heads may be strided: the W_UV product's transpose).
        gate: [N, H, V] float, last dim contiguous (a view of the fused projection's gate columns).
        out: optional contiguous [N, H, V] buffer of o's dtype.
    """
    for name, t in (("o", o), ("gate", gate)):
        if t.dim() != 3 or not t.is_floating_point() or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a float [N, H, V] tensor with a contiguous last dim, got {t.dtype} "
                             f"{list(t.shape)} strides {t.stride()}")
    if gate.shape != o.shape:
        raise ValueError(f"gate must have o's shape {list(o.shape)}, got {list(gate.shape)}")
    N, H, V = o.shape
    if out is None:
        out = torch.empty(N, H, V, dtype=o.dtype, device=o.device)
    elif out.shape != o.shape or out.dtype != o.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {o.dtype} {list(o.shape)} tensor, got {out.dtype} "
                         f"{list(out.shape)} contiguous={out.is_contiguous()}")
    check_same_device(o=o, gate=gate, out=out)
    if N and H:
        _output_gate_kernel[(N, H)](o, o.stride(0), o.stride(1), gate, gate.stride(0), gate.stride(1), out, H, V,
                                    BLOCK_V=triton.next_power_of_2(V), num_warps=1 if V <= 128 else 4)
    return out
