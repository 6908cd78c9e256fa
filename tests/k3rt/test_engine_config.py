"""EngineConfig resolves the runner from the device and rejects combinations it cannot run."""

from __future__ import annotations

import pytest

from k3rt.config import EngineConfig


def test_auto_runner_follows_the_device() -> None:
    assert EngineConfig(model="m").runner == "model"
    assert EngineConfig(model="m", device="cuda").runner == "gpu"
    assert EngineConfig(model="m", device="cuda:1").runner == "gpu"
    assert EngineConfig(model="m", device="cuda", runner="model").runner == "model"


@pytest.mark.parametrize("over, field", [
    ({"runner": "fast"}, "runner"),
    ({"runner": "gpu", "device": "cuda", "tp": 2}, "tp"),
    ({"tp": 0}, "tp"),
])
def test_bad_combinations_name_the_field(over, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(model="m", **over)
