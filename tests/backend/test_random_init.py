"""random_model's up-front memory check: the 48B shape's random bf16 weights (91.5 GiB) are refused on an 80 GB
GPU with the sizes named, before any tensor is allocated (session 35: `benchmarks/decode.py` on an H100 allocated
for a minute and died in CUDA's out-of-memory error)."""
from __future__ import annotations

import pytest
import torch

from k3rt.backend.models import random_init
from k3rt.backend.models.random_init import check_weights_fit
from k3rt.model_config import load_model_config

GIB = 1 << 30


def test_the_48b_shape_is_refused_on_an_h100_and_fits_an_h200() -> None:
    cfg = load_model_config("kimi-linear-48b")
    with pytest.raises(ValueError, match=r"49\.1B parameters in bfloat16 need 91\.5 GiB; NVIDIA H100 80GB HBM3 has "
                                         r"78\.0 GiB free of 79\.2 GiB"):
        check_weights_fit(cfg, "bfloat16", 78 * GIB, int(79.2 * GIB), "NVIDIA H100 80GB HBM3")
    check_weights_fit(cfg, "bfloat16", 138 * GIB, 140 * GIB, "NVIDIA H200")  # fits: no error
    with pytest.raises(ValueError, match=r"need 183\.0 GiB"):  # fp32 does not fit an H200 either
        check_weights_fit(cfg, "float32", 138 * GIB, 140 * GIB, "NVIDIA H200")


def test_random_model_checks_before_it_allocates(monkeypatch) -> None:
    """On a CUDA device random_model asks the free memory first and refuses; nothing is built (here there is no
    GPU at all: reaching the model's construction would fail differently)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append(device) or (40 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a 80 GB GPU")
    monkeypatch.setattr(random_init, "KimiForCausalLM", lambda *a, **k: pytest.fail("built past the check"))
    with pytest.raises(ValueError, match="need 91.5 GiB; a 80 GB GPU has 40.0 GiB free of 80.0 GiB"):
        random_init.random_model(load_model_config("kimi-linear-48b"), dtype="bfloat16", device="cuda")
    assert len(calls) == 1
