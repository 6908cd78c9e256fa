"""Depthwise causal short convolution (the width-4 conv before KDA's q/k/v). `ref` is the oracle.

The Triton store of a packed step's conv windows (`conv_windows_store_fwd`, triton_rows.py; the conv itself runs
fused with KDA's gate in `kda.kda_chunk_prep`) is exported lazily, so importing the reference never imports Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.short_conv.ref import causal_conv1d, causal_conv1d_rows, conv_windows_store

_TRITON_EXPORTS = {
    "conv_windows_store_fwd": "k3rt.kernels.short_conv.triton_rows",
}

__all__ = ["causal_conv1d", "causal_conv1d_rows", "conv_windows_store", "conv_windows_store_fwd"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
