"""The gated activation of a dense MLP in one launch (Triton): [T, 2I] = [gate | up] -> act(gate) * up' [T, I].

Why: the torch expression of SiTU (ref.act_and_mul_ref) is nine elementwise kernels (two divides, two tanh,
three products, a sigmoid, the scale), SiLU two. k3-tiny's forward runs it once per layer (the LatentMoE shared
expert, the dense first layer): 72 of its ~310 launches per decode forward, at batch 1 each a few microseconds
of a launch-bound graph (benchmarks/RESULTS.md, session 23's round profile). The routed experts fuse the same
activation into their GEMM (triton_experts.py); this is the dense MLP's and the unfused shared expert's.

Math in fp32 from the inputs' values, one rounding to the output dtype (the torch expression rounds after every
op in bf16: equal in fp32 up to fp32 rounding, closer to the exact value in bf16). tanh goes through sigmoid, as
in the expert kernels (libdevice's tanh does not run under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.moe.triton_experts import _tanh
from k3rt.model_config import ActivationConfig

BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(x_ptr, stride_x, o_ptr, stride_o, I, beta, lin_beta,
                        SITU: tl.constexpr, LIN_SAT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = x_ptr + t.to(tl.int64) * stride_x
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    if SITU:
        if LIN_SAT:
            u = lin_beta * _tanh(u / lin_beta)
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
    else:
        a = g * tl.sigmoid(g)
    tl.store(o_ptr + t.to(tl.int64) * stride_o + cols, (a * u).to(o_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: Tensor, act: ActivationConfig, out: Tensor | None = None) -> Tensor:
    """gate_up [T, 2I] (last dim contiguous) -> [T, I] in its dtype: silu(gate) * up, or SiTU (ref.act_and_mul_ref).
    out: an optional [T, I] buffer (last dim contiguous) to write into."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up: expected [T, 2I] with a contiguous last dim, got shape {tuple(gate_up.shape)} "
                         f"stride {gate_up.stride()}")
    situ = act.name == "situ"
    if not situ and act.name != "silu":
        raise ValueError(f"act must be silu or situ, got {act.name!r}")
    if situ and (act.situ_beta is None or act.situ_beta <= 0):
        raise ValueError(f"act.situ_beta must be > 0 for situ, got {act.situ_beta}")
    if situ and act.situ_linear_beta is not None and act.situ_linear_beta <= 0:
        raise ValueError(f"act.situ_linear_beta must be > 0 or None, got {act.situ_linear_beta}")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (T, I) or out.stride(1) != 1:
        raise ValueError(f"out: expected [{T}, {I}] with a contiguous last dim, got {tuple(out.shape)}")
    if T == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(I))
    _act_and_mul_kernel[(T, triton.cdiv(I, block))](
        gate_up, gate_up.stride(0), out, out.stride(0), I, float(act.situ_beta or 1.0),
        float(act.situ_linear_beta or 1.0), SITU=situ, LIN_SAT=situ and act.situ_linear_beta is not None,
        BLOCK=block, num_warps=4)
    return out
