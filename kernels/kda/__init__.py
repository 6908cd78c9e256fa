"""Kimi Delta Attention ops. `ref` holds the plain-torch oracle every KDA kernel is tested against.

The Triton kernels (`kda_decode`, `kda_chunk_fwd`, `kda_verify`/`kda_commit` for speculative
verification, `kda_decode_multi`: up to R tokens per sequence in one launch, for the verify graphs;
`kda_chunk_prep`: the chunked form's conv, gate and beta in one launch; `kda_layer_one_token`: batch 1's whole
layer, projections to the next norm, in one persistent launch)
are exported lazily, so importing the reference ops never imports Triton.
"""
from k3rt.kernels.kda.ref import (
    kda_chunked,
    kda_gate_lower_bound,
    kda_gate_softplus,
    kda_recurrent,
    l2norm,
)
from k3rt.kernels.lazy import lazy_exports

_TRITON_EXPORTS = {
    "kda_decode": "k3rt.kernels.kda.triton_decode",
    "kda_layer_one_token": "k3rt.kernels.kda.triton_layer",
    "kda_layer_fits": "k3rt.kernels.kda.triton_layer",
    "kda_layer_sync_words": "k3rt.kernels.kda.triton_layer",
    "KDA_LAYER_TILES": "k3rt.kernels.kda.triton_layer",
    "kda_decode_workspace": "k3rt.kernels.kda.triton_decode",
    "kda_decode_split_norm": "k3rt.kernels.kda.triton_decode",
    "kda_verify": "k3rt.kernels.kda.triton_verify",
    "kda_commit": "k3rt.kernels.kda.triton_verify",
    "kda_decode_multi": "k3rt.kernels.kda.triton_multi",
    "kda_chunk_fwd": "k3rt.kernels.kda.triton_chunk",
    "kda_chunk_prep": "k3rt.kernels.kda.triton_prep",
}

__all__ = [
    "kda_chunk_fwd",
    "kda_chunk_prep",
    "kda_chunked",
    "kda_commit",
    "kda_decode",
    "kda_layer_one_token",
    "kda_decode_multi",
    "kda_decode_split_norm",
    "kda_decode_workspace",
    "kda_gate_lower_bound",
    "kda_gate_softplus",
    "kda_recurrent",
    "kda_verify",
    "l2norm",
]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
