"""EngineConfig resolves the runner from the device and rejects combinations it cannot run."""

from __future__ import annotations

import pytest

from k3rt.config import DistConfig, EngineConfig


def test_auto_runner_follows_the_device() -> None:
    assert EngineConfig(model="m").runner == "model"
    assert EngineConfig(model="m", device="cuda").runner == "gpu"
    assert EngineConfig(model="m", device="cuda:1").runner == "gpu"
    assert EngineConfig(model="m", device="cuda", runner="model").runner == "model"
    assert EngineConfig(model="m", device="cuda", tp=2).runner == "gpu"  # the fused runner runs under TP too
    assert EngineConfig(model="m", device="cuda", tp=2, runner="gpu").tp == 2


def test_overlap_is_on_for_the_single_gpu_runner_only() -> None:
    assert EngineConfig(model="m", device="cuda").overlap
    assert not EngineConfig(model="m").overlap  # the reference runner computes eagerly
    # under TP the workers' plans carry host token ids, which overlap would only learn a step later
    assert not EngineConfig(model="m", device="cuda", tp=2).overlap
    assert EngineConfig(model="m", device="cuda", tp=2, runner="model", overlap=True).overlap  # eager: allowed


def test_gpu_runner_kernels_need_cuda_or_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^device:.*CUDA"):
        EngineConfig(model="m", runner="gpu")
    assert EngineConfig(model="m", runner="gpu", kernels=False).runner == "gpu"  # torch-op path
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(model="m", runner="gpu").kernels


@pytest.mark.parametrize("over, field", [
    ({"runner": "fast"}, "runner"),
    ({"runner": "gpu", "device": "cuda:1", "tp": 2}, "device"),
    ({"device": "cpu", "tp": 2, "dist": DistConfig(symm_all_reduce=True)}, "symm_all_reduce"),
    ({"tp": 0}, "tp"),
    ({"device": "cuda", "tp": 2, "overlap": True}, "overlap"),
])
def test_bad_combinations_name_the_field(over, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(model="m", **over)
