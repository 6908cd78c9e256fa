"""Lazy exports for the kernel packages' `__init__` files.

Each kernel package imports its torch oracle eagerly and its Triton ops only when first asked for, so
importing the references never imports Triton. This module is what makes that work, so it must import
nothing heavy itself (not torch, not triton, not kernels/common.py, which imports triton).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `exports` maps a name to the module that defines it, which
    is imported on the first access to that name (PEP 562); any other name raises AttributeError."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
