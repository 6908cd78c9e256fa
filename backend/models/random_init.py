"""A model of any config with random weights, built directly on the target device.

For benchmarks at full size without a checkpoint (`--random-weights`): Kimi-Linear-48B in bf16 is
~98 GB, which is only practical to create where it will run. Values are drawn so activations stay
in range through every layer (fan-in scaled projections, unit norms, decays like fla's init); the
output is meaningless text, but every kernel sees realistic magnitudes, routing spreads over the
experts, and nothing overflows in bf16.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm import tqdm

from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import DTYPES
from k3rt.model_config import ModelConfig


def _init_param(name: str, p: nn.Parameter, gen: torch.Generator) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and p.dim() == 1:
        p.fill_(1.0)  # RMSNorm weights (layer, latent, KDA output, LatentMoE norm)
    elif leaf == "A_log":
        p.uniform_(0.0, math.log(16.0), generator=gen)
    elif leaf == "dt_bias":
        p.uniform_(-4.0, -1.0, generator=gen)
    elif leaf == "e_score_correction_bias":
        p.zero_()
    elif leaf == "conv_weight":
        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    elif p.dim() >= 2:
        # fan-in scaling over the last dim keeps each projection's output at unit scale
        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    else:
        p.normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def random_model(cfg: ModelConfig, *, dtype: str | None = None, device: str | torch.device = "cpu",
                 seed: int = 0, progress: bool = True) -> KimiForCausalLM:
    """An eval-mode KimiForCausalLM for `cfg` on `device`, weights drawn from `seed`."""
    device = torch.device(device)
    with torch.device(device):
        model = KimiForCausalLM(cfg, dtype=DTYPES[dtype or cfg.dtype])
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    params = list(model.named_parameters())
    for name, p in tqdm(params, desc="random weights", unit="tensor", disable=not progress, leave=False):
        _init_param(name, p, gen)
    return model.eval()
