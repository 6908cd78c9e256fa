"""Gated activations for MLPs and experts: SiLU (Kimi-Linear) and SiTU (Kimi-K3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3rt.model_config import ActivationConfig


def situ(gate: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU: beta * tanh(gate / beta) * sigmoid(gate) — a SiLU whose linear branch saturates at beta."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate)


def act_and_mul(gate_up: torch.Tensor, act: ActivationConfig) -> torch.Tensor:
    """gate_up: [..., 2*I] = [gate | up] -> [..., I] = act(gate) * up'."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act.name == "silu":
        return F.silu(gate) * up
    assert act.situ_beta is not None
    if act.situ_linear_beta is not None:
        up = act.situ_linear_beta * torch.tanh(up / act.situ_linear_beta)
    return situ(gate, act.situ_beta) * up
