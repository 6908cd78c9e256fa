"""Depthwise causal short convolution (the width-4 conv before KDA's q/k/v). `ref` is the oracle."""
from k3rt.kernels.short_conv.ref import causal_conv1d

__all__ = ["causal_conv1d"]
