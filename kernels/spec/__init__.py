"""Speculative decoding ops: the DSpark drafter's left-to-right greedy steps in one launch, and a device round's
acceptance, window shift and step advance (triton_rounds.py).

ref.py holds the torch oracles, imported eagerly: `greedy_draft_ref` with `DraftHeads` (the heads' weights it
reads), and `greedy_accept`, `shift_window`, `advance_step` (what backend/runner/gpu/rounds.py runs without the
kernels). The Triton ops are exported lazily, so the references never import Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.spec.ref import DraftHeads
from k3rt.kernels.spec.ref import greedy_draft as greedy_draft_ref

_TRITON_EXPORTS = {
    "greedy_draft": "k3rt.kernels.spec.triton_draft",
    "round_accept": "k3rt.kernels.spec.triton_rounds",
    "round_advance": "k3rt.kernels.spec.triton_rounds",
    "round_shift": "k3rt.kernels.spec.triton_rounds",
}

__all__ = ["DraftHeads", "greedy_draft", "greedy_draft_ref", "round_accept", "round_advance", "round_shift"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
