"""Skinny linear layers: y = x W^T for a handful of rows (decode), bandwidth-bound.

`skinny_linear_ref` (ref.py) is the torch oracle, imported eagerly; the Triton op `skinny_linear`
(triton_gemv.py) is exported lazily, so the reference never imports Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.linear.ref import skinny_linear_ref

_TRITON_EXPORTS = {
    "skinny_linear": "k3rt.kernels.linear.triton_gemv",
    "GemvTiles": "k3rt.kernels.linear.triton_gemv",
    "MAX_ROWS": "k3rt.kernels.linear.triton_gemv",
    "prefer_skinny": "k3rt.kernels.linear.triton_gemv",
}

__all__ = ["GemvTiles", "MAX_ROWS", "prefer_skinny", "skinny_linear", "skinny_linear_ref"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
