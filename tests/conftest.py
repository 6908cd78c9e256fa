"""Without a GPU, every Triton kernel in the test session runs in the Triton interpreter.

TRITON_INTERPRET decides what @triton.jit returns when a kernel module is first imported (and
kernels/common.py reads it once), so it must be set before anything imports one, in any test folder:
the backend tests run the GPU runner's kernels too. The root conftest is imported first.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
