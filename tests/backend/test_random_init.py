"""random_model's up-front memory check: the 48B shape's random bf16 weights (91.5 GiB) are refused on an 80 GB
GPU with the sizes named, before any tensor is allocated (session 35: `benchmarks/decode.py` on an H100 allocated
for a minute and died in CUDA's out-of-memory error)."""
from __future__ import annotations

import pytest
import torch

from k3rt.backend.models import random_init
from k3rt.backend.models.random_init import check_weights_fit, weight_bytes
from k3rt.model_config import load_model_config

GIB = 1 << 30


def test_the_48b_shape_is_refused_on_an_h100_and_fits_an_h200() -> None:
    cfg = load_model_config("kimi-linear-48b")
    need = weight_bytes(cfg, "bfloat16")
    with pytest.raises(ValueError, match=r"weights in bfloat16 need 91\.5 GiB; NVIDIA H100 80GB HBM3 has "
                                         r"78\.0 GiB free of 79\.2 GiB"):
        check_weights_fit(need, "bfloat16", 78 * GIB, int(79.2 * GIB), "NVIDIA H100 80GB HBM3")
    check_weights_fit(need, "bfloat16", 138 * GIB, 140 * GIB, "NVIDIA H200")  # fits: no error
    with pytest.raises(ValueError, match=r"need 183\.0 GiB"):  # fp32 does not fit an H200 either
        check_weights_fit(weight_bytes(cfg, "float32"), "float32", 138 * GIB, 140 * GIB, "NVIDIA H200")


def test_weight_bytes_count_what_is_built() -> None:
    """The K3 slice's MXFP4 experts are packed (4 bits and a scale per 32): its bf16 build is 12.8 GiB, where
    counting every parameter at 2 bytes (model_config.param_count) says 21.5 and would refuse it on a 16 GB card."""
    assert abs(weight_bytes(load_model_config("kimi-k3-slice"), "bfloat16") / GIB - 12.81) < 0.01


def test_random_model_checks_before_it_allocates(monkeypatch) -> None:
    """On a CUDA device random_model asks the free memory first and refuses; nothing is built (here there is no
    GPU at all: reaching the model's construction would fail differently)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append(device) or (40 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a 80 GB GPU")
    monkeypatch.setattr(random_init, "KimiForCausalLM", lambda *a, **k: pytest.fail("built past the check"))
    monkeypatch.setattr(random_init, "weight_bytes", lambda cfg, dtype: 91 * GIB)
    with pytest.raises(ValueError, match="need 91.0 GiB; a 80 GB GPU has 40.0 GiB free of 80.0 GiB"):
        random_init.random_model(load_model_config("kimi-linear-48b"), dtype="bfloat16", device="cuda")
    assert len(calls) == 1
