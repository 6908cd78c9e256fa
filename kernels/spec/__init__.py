"""Speculative decoding ops: the DSpark drafter's left-to-right greedy steps in one launch.

`greedy_draft_ref` and `DraftHeads` (ref.py) are the torch oracle and the heads' weights it reads, imported
eagerly; the Triton op `greedy_draft` (triton_draft.py) is exported lazily, so the reference never imports
Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.spec.ref import DraftHeads
from k3rt.kernels.spec.ref import greedy_draft as greedy_draft_ref

_TRITON_EXPORTS = {
    "greedy_draft": "k3rt.kernels.spec.triton_draft",
}

__all__ = ["DraftHeads", "greedy_draft", "greedy_draft_ref"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
