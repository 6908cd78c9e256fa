"""Kimi MoE ops: the sigmoid router's top-k and the fused routed experts. `ref` holds the plain-torch
oracles every MoE kernel is tested against.

MXFP4 experts: `mxfp4_ref` (the format, quantizer, oracle), `fused_experts_mxfp4` and, on the planar
in-memory layout (`PlanarMxfp4.from_packed`, `mxfp4_planar_layout`), `fused_experts_mxfp4_planar`
(the GPU runner's default, its `PLANAR_SERVE_VARIANT`).
The Triton ops (`act_and_mul`, `moe_route` (and `moe_route_from_x`: small routers' logits in the same launch),
`fused_experts` (its one-token form: triton_one_token.py),
`fused_experts_mxfp4`, `moe_align_fwd`, `moe_layer_one_token`: batch 1's whole layer in one persistent launch)
are exported lazily, so importing the
reference ops never imports Triton. `fused_experts_grouped` (grouped.py): the same contract through CUTLASS's
grouped GEMMs, for prefill-sized batches on sm90+.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.moe.ref import act_and_mul_ref, align_ref, fused_experts_ref, route_ref

_TRITON_EXPORTS = {
    "act_and_mul": "k3rt.kernels.moe.triton_act",
    "moe_route": "k3rt.kernels.moe.triton_router",
    "moe_route_from_x": "k3rt.kernels.moe.triton_router",
    "fused_router_fits": "k3rt.kernels.moe.triton_router",
    "fused_experts": "k3rt.kernels.moe.triton_experts",
    "fused_experts_grouped": "k3rt.kernels.moe.grouped",
    "grouped_mm_available": "k3rt.kernels.moe.grouped",
    "ExpertTiles": "k3rt.kernels.moe.triton_experts",
    "SumNorm": "k3rt.kernels.moe.triton_experts",
    "moe_align_fwd": "k3rt.kernels.moe.triton_align",
    "fused_experts_mxfp4": "k3rt.kernels.moe.triton_mxfp4",
    "fused_experts_mxfp4_planar": "k3rt.kernels.moe.triton_mxfp4_planar",
    "PlanarMxfp4": "k3rt.kernels.moe.triton_mxfp4_planar",
    "PLANAR_SERVE_VARIANT": "k3rt.kernels.moe.triton_mxfp4_planar",
    "moe_layer_one_token": "k3rt.kernels.moe.triton_layer",
    "layer_fits": "k3rt.kernels.moe.triton_layer",
    "LAYER_SYNC_WORDS": "k3rt.kernels.moe.triton_layer",
}

__all__ = [
    "ExpertTiles",
    "PLANAR_SERVE_VARIANT",
    "PlanarMxfp4",
    "SumNorm",
    "act_and_mul",
    "act_and_mul_ref",
    "align_ref",
    "fused_experts",
    "fused_experts_grouped",
    "fused_experts_mxfp4",
    "fused_experts_mxfp4_planar",
    "fused_experts_ref",
    "fused_router_fits",
    "grouped_mm_available",
    "moe_align_fwd",
    "moe_layer_one_token",
    "moe_route",
    "moe_route_from_x",
    "route_ref",
]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
