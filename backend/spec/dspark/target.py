"""The target states DSpark reads, captured from an unchanged KimiForCausalLM with forward hooks.

Target layer index i means:
  i < num_hidden_layers   the normalized input of layer i (its `input_layernorm` output): what the first i
                          layers made of the sequence. With attention residuals (K3) there is no single
                          residual stream; this mix is the state layer i itself reads.
  i = num_hidden_layers   the final normalized hidden state (the LM head's input).
Each is [N, hidden] per forward row, so the same capture serves the dense training path, the cached
reference path and (later) the runner.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kimi import KimiForCausalLM


def check_layers(model: KimiForCausalLM, layers: Sequence[int]) -> None:
    n = model.cfg.num_hidden_layers
    bad = [i for i in layers if not 0 <= i <= n]
    if bad:
        raise ValueError(f"target_layers: {bad} outside [0, {n}] for a {n}-layer target")


@contextmanager
def capture_states(model: KimiForCausalLM, layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward of `model` stores each chosen layer's state in the yielded dict
    (layer -> [N, hidden], the latest forward's rows). The hooks are removed on exit."""
    check_layers(model, layers)
    got: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            got[i] = out.detach()
        return hook

    n = model.cfg.num_hidden_layers
    handles = [(model.model if i == n else model.model.layers[i].input_layernorm).register_forward_hook(keep(i))
               for i in layers]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def stack_states(got: dict[int, torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """The captured states in config order, concatenated per row: [N, len(layers) * hidden] fp32."""
    missing = [i for i in layers if i not in got]
    if missing:
        raise RuntimeError(f"target states of layers {missing} were not captured (no forward ran?)")
    return torch.cat([got[i].float() for i in layers], dim=-1)


@torch.no_grad()
def dense_states(model: KimiForCausalLM, ids: torch.Tensor, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] fresh sequences -> (argmax next tokens [B, T], states [B, T, len(layers) * hidden]), from
    one dense forward (the training path's [B, T] layout)."""
    b, t = ids.shape
    with capture_states(model, layers) as got:
        logits = model(ids.reshape(-1), ForwardBatch([t] * b))
    return logits.argmax(-1).view(b, t), stack_states(got, layers).view(b, t, -1)
