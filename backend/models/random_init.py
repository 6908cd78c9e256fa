"""A model of any config with random weights, built directly on the target device.

For benchmarks at full size without a checkpoint (`--random-weights`): Kimi-Linear-48B in bf16 is
~98 GB, which is only practical to create where it will run. Each tensor is drawn on the device
with the same rules as the tiny test checkpoints (`tiny.init_parameter`: std-0.02 projections,
fla-style gate parameters, unit-ish norms): the text is noise, but every kernel sees realistic
magnitudes and routing spreads over the experts.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import DTYPES
from k3rt.backend.models.tiny import init_parameter
from k3rt.model_config import ModelConfig


@torch.no_grad()
def random_model(cfg: ModelConfig, *, dtype: str | None = None, device: str | torch.device = "cpu",
                 seed: int = 0, progress: bool = True) -> KimiForCausalLM:
    """An eval-mode KimiForCausalLM for `cfg` on `device`, weights drawn from `seed`."""
    device = torch.device(device)
    with torch.device(device):
        model = KimiForCausalLM(cfg, dtype=DTYPES[dtype or cfg.dtype])
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in tqdm(list(model.named_parameters()), desc="random weights", unit="tensor",
                        disable=not progress, leave=False):
        init_parameter(name, p, gen)
    return model.eval()
