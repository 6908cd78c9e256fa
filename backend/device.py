"""Host-to-device copies that never wait for the device.

A pageable host-to-device copy (`torch.tensor(..., device=cuda)`, `.to(cuda)` of an ordinary host tensor) waits for
every step queued on the stream, which undoes overlap scheduling without changing any output (backend/overlap.py;
tests/backend/test_launch_sync.py). A pinned, non-blocking one is queued behind them instead.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: pinned and non-blocking on CUDA, a plain copy elsewhere."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
