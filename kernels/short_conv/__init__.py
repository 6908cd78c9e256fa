"""Depthwise causal short convolution (the width-4 conv before KDA's q/k/v). `ref` is the oracle.

The Triton ops for the GPU runner's packed steps (`causal_conv1d_rows_fwd`, `conv_windows_store`:
triton_rows.py) are exported lazily, so importing the reference never imports Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.short_conv.ref import causal_conv1d, causal_conv1d_rows, conv_windows_store

_TRITON_EXPORTS = {
    "causal_conv1d_rows_fwd": "k3rt.kernels.short_conv.triton_rows",
    "conv_windows_store_fwd": "k3rt.kernels.short_conv.triton_rows",
}

__all__ = ["causal_conv1d", "causal_conv1d_rows", "causal_conv1d_rows_fwd", "conv_windows_store",
           "conv_windows_store_fwd"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
