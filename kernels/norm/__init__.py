"""RMSNorm ops: the plain norm (optionally fused with the residual add) and KDA's gated output norm.

`rms_norm_ref` / `rms_norm_gated_ref` (ref.py) are the torch oracles, imported eagerly. The Triton ops
`rms_norm` / `rms_norm_gated` (triton_norm.py) are exported lazily, so the references never import Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.norm.ref import rms_norm as rms_norm_ref
from k3rt.kernels.norm.ref import rms_norm_gated as rms_norm_gated_ref

_TRITON_EXPORTS = {
    "rms_norm": "k3rt.kernels.norm.triton_norm",
    "rms_norm_gated": "k3rt.kernels.norm.triton_norm",
}

__all__ = ["rms_norm", "rms_norm_gated", "rms_norm_gated_ref", "rms_norm_ref"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
