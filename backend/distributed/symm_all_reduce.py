"""An opt-in all-reduce for decode-sized messages through torch's symmetric memory (CUDA, one host).

At decode a step makes two all-reduces per layer of a few hundred KiB at most ([batch, hidden] activations),
where NCCL's per-call latency, not bandwidth, sets the time: at 27 layers and batch 1 that latency is a
large part of a TP2 step. `torch.ops.symm_mem.one_shot_all_reduce_copy` copies this rank's tensor into a
buffer every rank of the group has mapped (P2P over NVLink), and each rank sums every peer's copy itself:
one kernel, no NCCL. It runs inside CUDA graphs (fixed buffer, no host work). Messages larger than the
buffer take NCCL as before; every rank decides by the same size, so ranks never disagree on the path.

Selected by `--tp-symm-allreduce` (DistConfig.symm_all_reduce; `k3rt bench tp --symm-allreduce` to compare).
Not yet run on GPUs: no multi-GPU machine was lent while it was written; CPU runs refuse it.
"""

from __future__ import annotations

from typing import Any

import torch

# every rank reads every peer's whole message, so past some size NCCL's ring is faster: 1 MiB is a guess (it covers
# decode activations up to batch 64 at K3's width) to be set from `k3rt bench tp --symm-allreduce`
DEFAULT_MAX_BYTES = 1 << 20


class SymmAllReduce:
    def __init__(self, group: Any, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """A collective: every rank of `group` must build it at the same point (it maps the peers' buffers)."""
        import torch.distributed._symmetric_memory as symm_mem

        if device.type != "cuda":
            raise ValueError(f"symm_all_reduce: symmetric memory needs CUDA devices, got {device}")
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            raise ValueError(f"symm_all_reduce: torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy")
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before the rendezvous by older torch
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buf, group)

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place and return True, or False (nothing done) when x does not fit."""
        n = x.numel() * x.element_size()
        if n > self.buf.numel() or not x.is_contiguous():
            return False
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buf[:n].view(x.dtype), x.view(-1), "sum",
                                                          self.group_name)
        x.copy_(out.view_as(x))
        return True
