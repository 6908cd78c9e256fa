"""Attention-residual mix (Kimi-K3): a per-token softmax over depth of the residual sources.

`attn_res_mix_ref` (ref.py) is the torch oracle, imported eagerly; the Triton op `attn_res_mix`
(triton_mix.py) is exported lazily, so the reference never imports Triton.
"""
from k3rt.kernels.attn_res.ref import attn_res_mix as attn_res_mix_ref

_TRITON_EXPORTS = {"attn_res_mix": "k3rt.kernels.attn_res.triton_mix"}

__all__ = ["attn_res_mix", "attn_res_mix_ref"]


def __getattr__(name: str):
    if name in _TRITON_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_TRITON_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
