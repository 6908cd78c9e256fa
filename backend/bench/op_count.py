"""How many ops a call launches: top-level aten ops and Triton launches under the torch profiler (issue 16:
what the DSpark drafter's fused kernel removed; benchmarks/dspark_pass.py and its tests count with this).

"Top-level" is an aten op called from Python, not one that another aten op runs inside it; `launching` leaves
out views, aliases and allocations (which launch nothing), and `.to` / `reshape` unless they copied (a cast of
another dtype, a reshape that cannot be a view). Triton launches, compiled or under the
interpreter, are wrapped in a profiler range for the call, so each counts once and the interpreter's own
tensor copies inside it are not counted. On CUDA the device kernels the profiler saw are counted too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

NO_LAUNCH = frozenset({
    "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::slice", "aten::select", "aten::transpose",
    "aten::t", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::permute",
    "aten::detach", "aten::alias", "aten::empty", "aten::empty_strided", "aten::chunk", "aten::split",
    "aten::narrow", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::to",
    "aten::new_empty", "aten::empty_like", "aten::split_with_sizes", "aten::unbind",
    "aten::promote_types"})  # a dtype computed on the host (the Triton wrappers' output dtype)


@contextmanager
def triton_ranges() -> Iterator[None]:
    """Every Triton launch inside a profiler range `triton::<kernel>` while the context is open."""
    import triton.runtime.jit as jit
    from triton.runtime.interpreter import InterpretedFunction

    saved = []
    for cls in (jit.JITFunction, InterpretedFunction):
        def run(self, *args, _orig=cls.run, **kwargs):
            with torch.profiler.record_function(f"triton::{getattr(self.fn, '__name__', 'kernel')}"):
                return _orig(self, *args, **kwargs)
        saved.append((cls, cls.run))
        cls.run = run
    try:
        yield
    finally:
        for cls, orig in saved:
            cls.run = orig


# what an op of NO_LAUNCH runs inside it when it does launch: `.to` of another dtype or device (a cast kernel),
# `reshape`/`contiguous` of a tensor whose strides do not allow a view (a copy)
_COPIES = frozenset({"aten::_to_copy", "aten::clone", "aten::copy_"})


def _copies(e) -> bool:
    """Whether op event e ran a copy inside it (a NO_LAUNCH op that launched after all)."""
    return any(c.name in _COPIES or _copies(c) for c in e.cpu_children)


def count_ops(fn: Callable[[], object], names: bool = False) -> dict:
    """Ops of one call of fn, after one warm-up call (compiles, allocator): {"aten_ops", "launching", "triton"}
    and on CUDA "device_kernels"; names=True adds "names": {op or `triton::<kernel>`: launches} (where the
    launches of a form come from)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with triton_ranges(), profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    out = {"aten_ops": 0, "launching": 0, "triton": 0}
    by_name: dict[str, int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "triton::")):
            parent = parent.cpu_parent
        if parent is not None or e.device_type != DeviceType.CPU:
            continue
        launched = False
        if e.name.startswith("triton::"):
            out["triton"] += 1
            launched = True
        elif e.name.startswith("aten::"):
            out["aten_ops"] += 1
            launched = e.name not in NO_LAUNCH or _copies(e)
            out["launching"] += launched
        if launched:
            by_name[e.name] = by_name.get(e.name, 0) + 1
    if cuda:
        out["device_kernels"] = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    if names:
        out["names"] = dict(sorted(by_name.items(), key=lambda kv: (-kv[1], kv[0])))
    return out
