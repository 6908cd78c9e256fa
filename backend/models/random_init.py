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


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """The bytes of the model's parameters as k3rt builds them (MXFP4 experts packed), from a build on the meta
    device: no memory, no weights drawn."""
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype=DTYPES[dtype])
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_weights_fit(need_bytes: int, dtype: str, free_bytes: int, total_bytes: int, where: str) -> None:
    """Refuse, naming the sizes, weights that alone exceed the device's free memory: building them would allocate
    tensor after tensor for a minute and end in CUDA's out-of-memory error (the 48B shape in bf16 is 91.5 GiB of
    weights: it fits an H200, not an 80 GB H100; session 35's `decode.py` on an H100 died that way)."""
    if need_bytes > free_bytes:
        gib = 1 << 30
        raise ValueError(f"random weights: this model's weights in {dtype} need {need_bytes / gib:.1f} GiB; {where} "
                         f"has {free_bytes / gib:.1f} GiB free of {total_bytes / gib:.1f} GiB (use a GPU with more "
                         f"memory, or a smaller model)")


@torch.no_grad()
def random_model(cfg: ModelConfig, *, dtype: str | None = None, device: str | torch.device = "cpu",
                 seed: int = 0, progress: bool = True) -> KimiForCausalLM:
    """An eval-mode KimiForCausalLM for `cfg` on `device`, weights drawn from `seed`. On a CUDA device, refused
    up front when the weights alone do not fit its free memory (check_weights_fit)."""
    device = torch.device(device)
    dtype = dtype or cfg.dtype
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        check_weights_fit(weight_bytes(cfg, dtype), dtype, free, total, torch.cuda.get_device_name(device))
    with torch.device(device):
        model = KimiForCausalLM(cfg, dtype=DTYPES[dtype])
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in tqdm(list(model.named_parameters()), desc="random weights", unit="tensor",
                        disable=not progress, leave=False):
        init_parameter(name, p, gen)
    return model.eval()
