"""Kimi MLA attention ops. `ref` holds the plain-torch oracles every MLA kernel is tested against.

The Triton kernels (`mla_decode`, `mla_decode_num_splits`, `mla_prefill`, `mla_store_latent`,
`mla_output_gate`; `mla_pre_one_token` / `mla_post_one_token`: batch 1's layer around `mla_decode` in two
persistent launches) are exported lazily, so
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
    "mla_pre_one_token": "k3rt.kernels.mla.triton_layer",
    "mla_post_one_token": "k3rt.kernels.mla.triton_layer",
    "mla_layer_fits": "k3rt.kernels.mla.triton_layer",
    "MLA_LAYER_SYNC_WORDS": "k3rt.kernels.mla.triton_layer",
}

__all__ = [
    "gather_latents",
    "mla_decode",
    "mla_decode_num_splits",
    "mla_decode_ref",
    "mla_output_gate",
    "mla_output_gate_ref",
    "mla_post_one_token",
    "mla_pre_one_token",
    "mla_prefill",
    "mla_prefill_ref",
    "mla_store_latent",
    "mla_store_latent_ref",
]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
