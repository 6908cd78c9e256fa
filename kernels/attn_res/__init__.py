"""Attention-residual mix (Kimi-K3): a per-token softmax over depth of the residual sources.

`attn_res_mix_ref` (ref.py) is the torch oracle, imported eagerly; the Triton op `attn_res_mix`
(triton_mix.py) is exported lazily, so the reference never imports Triton.
"""
from k3rt.kernels.attn_res.ref import attn_res_mix as attn_res_mix_ref
from k3rt.kernels.lazy import lazy_exports

_TRITON_EXPORTS = {"attn_res_mix": "k3rt.kernels.attn_res.triton_mix"}

__all__ = ["attn_res_mix", "attn_res_mix_ref"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
