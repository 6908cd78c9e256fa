"""One tile of a DSpark draft's logits (Triton), shared by the one-program (triton_draft.py) and the split
(triton_draft_split.py) forms of the greedy left-to-right steps, so both compute every element alike."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _step_tile(base_ptr, row, mout_ptr, code, offs, valid, rs, rmask, R, HAS_MARKOV: tl.constexpr):
    """One tile of a draft's logits before the copy mix: base + Markov bias, -inf past the vocabulary."""
    x = tl.load(base_ptr + row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if HAS_MARKOV:
        w = tl.load(mout_ptr + offs[:, None] * R + rs[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
        # rounded to the table's dtype, as the torch path's linear output is
        x = x + tl.sum(w.to(tl.float32) * code[None, :], axis=1).to(mout_ptr.dtype.element_ty).to(tl.float32)
    return x
