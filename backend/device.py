"""Host-to-device copies that never wait for the device, and device-to-host copies that wait only for themselves.

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


def read_back(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """Queue the copies of CUDA tensors into pinned host memory on the current stream and record an event after them:
    (host tensors, event). Waiting on the event waits for the work queued before it only; a later step's work, queued
    on the same stream after it, is not waited for (a `.tolist()` of the device tensors would wait for that too)."""
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(hosts, tensors):
        h.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return hosts, ready
