"""Kimi Delta Attention ops. `ref` holds the plain-torch oracle every KDA kernel is tested against."""
from k3rt.kernels.kda.ref import (
    kda_chunked,
    kda_gate_lower_bound,
    kda_gate_softplus,
    kda_recurrent,
    l2norm,
)

__all__ = ["kda_chunked", "kda_gate_lower_bound", "kda_gate_softplus", "kda_recurrent", "l2norm"]
