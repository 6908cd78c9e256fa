"""The engine on a CUDA device (reference torch path, paged pool on the GPU): greedy tokens equal the CPU
engine's for 32 steps on a tiny fp32 checkpoint, with the prefix cache on."""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.tiny import make_tiny
from k3rt.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_cuda_engine_greedy_equals_cpu(arch, tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ckpt = make_tiny(tmp_path / arch, arch=arch, dtype="float32", seed=9)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 70, 130)]
    prompts.append(prompts[1] + [7, 8, 9])  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        cfg = engine_config_for_tests(str(ckpt), num_pages=256)
        from dataclasses import replace

        eng = Engine(replace(cfg, device=device))
        outs[device] = [o.output_ids for o in eng.generate(prompts, params)]
        eng.check()
    assert outs["cuda"] == outs["cpu"]
