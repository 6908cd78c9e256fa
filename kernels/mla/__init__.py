"""Kimi MLA attention ops. `ref` holds the plain-torch oracles every MLA kernel is tested against.

The Triton kernels (`mla_decode`, `mla_decode_num_splits`, `mla_prefill`, `mla_store_latent`,
`mla_output_gate`) are exported lazily, so
importing the reference ops never imports Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.mla.ref import (gather_latents, mla_decode_ref, mla_output_gate_ref, mla_prefill_ref,
                                  mla_store_latent_ref)

_TRITON_EXPORTS = {
    "mla_decode": "k3rt.kernels.mla.triton_decode",
    "mla_decode_num_splits": "k3rt.kernels.mla.triton_decode",
    "mla_prefill": "k3rt.kernels.mla.triton_prefill",
    "mla_store_latent": "k3rt.kernels.mla.triton_latent",
    "mla_output_gate": "k3rt.kernels.mla.triton_gate",
}

__all__ = [
    "gather_latents",
    "mla_decode",
    "mla_decode_num_splits",
    "mla_decode_ref",
    "mla_output_gate",
    "mla_output_gate_ref",
    "mla_prefill",
    "mla_prefill_ref",
    "mla_store_latent",
    "mla_store_latent_ref",
]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
