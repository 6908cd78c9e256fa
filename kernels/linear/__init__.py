"""Skinny linear layers: y = x W^T for a handful of rows (decode), bandwidth-bound.

`skinny_linear_ref` (ref.py) is the torch oracle, imported eagerly; the Triton op `skinny_linear`
(triton_gemv.py) is exported lazily, so the reference never imports Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.linear.ref import skinny_linear_ref

# skinny_linear(prefetch=): what a PDL-launched program reads of its weight rows before its wait: its first K step
# into registers ("tile"), or every line of its rows into the L2 ("l2"). Here, Triton-free: KernelConfig checks it
PREFETCH_FORMS = ("tile", "l2")
# unrolled_tiles: rows a program of the unrolled form (a warp each)
UNROLLED_ROWS = (1, 2, 4, 8)

_TRITON_EXPORTS = {
    "skinny_linear": "k3rt.kernels.linear.triton_gemv",
    "GemvTiles": "k3rt.kernels.linear.triton_gemv",
    "MAX_ROWS": "k3rt.kernels.linear.triton_gemv",
    "prefer_skinny": "k3rt.kernels.linear.triton_gemv",
    "unrolled_tiles": "k3rt.kernels.linear.triton_gemv",
    "pick_unrolled": "k3rt.kernels.linear.triton_gemv",
}

__all__ = ["GemvTiles", "MAX_ROWS", "PREFETCH_FORMS", "UNROLLED_ROWS", "pick_unrolled", "prefer_skinny", "skinny_linear",
           "skinny_linear_ref", "unrolled_tiles"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
