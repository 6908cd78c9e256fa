"""Under TRITON_INTERPRET: patch triton.language for the interpreter once per kernel launch, not once per call of
a @triton.jit helper inside it.

Triton 3.6's interpreter re-patches the whole language (inspect.getmembers over triton.language, its tensor and
math modules) on every call of a device function, although the launch that runs it has patched the same modules
already and keeps them patched until it ends. Our kernels call small helpers (conv windows, gates, norms) per
tile, so that re-patching was 85 of 330 profiled seconds of the suite's slowest test
(tests/backend/test_deterministic.py, the interpreter case: 67 -> 48 s). Inside a launch the nested patch is a
no-op here; a device function that names a module the launch did not patch (triton's standard library names
`core`) patches it once, and the launch restores it with its own. Nothing changes on a GPU (no interpreter).
"""

from __future__ import annotations

from typing import Any


def install() -> bool:
    """Wrap the interpreter's language patch; False when this Triton has no such hook (left as it is)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch, scope_cls = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_cls is None:
        return False
    if getattr(patch, "_k3rt_once", False):
        return True
    kinds = (tl, tl.core)  # the modules the interpreter patches, found in a function's globals
    langs_of: dict[Any, frozenset[int]] = {}
    launch: dict[str, Any] = {"scope": None, "langs": set(), "nested": []}

    def langs(fn: Any) -> frozenset[int]:
        got = langs_of.get(fn)
        if got is None:
            got = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if any(v is k for k in kinds))
        return got

    def patch_once(fn: Any) -> Any:
        mine = langs(fn)
        if launch["scope"] is not None:  # a device function inside a running launch
            if not mine <= launch["langs"]:  # (e.g. triton's standard library: it names the `core` module)
                launch["nested"].append(patch(fn))
                launch["langs"] |= mine
            return scope_cls()  # nothing of its own to restore: the launch restores all
        scope = patch(fn)
        launch.update(scope=scope, langs=set(mine), nested=[])
        restore = scope.restore

        def restore_launch() -> None:
            try:
                for nested in reversed(launch["nested"]):
                    nested.restore()
                restore()
            finally:
                launch.update(scope=None, langs=set(), nested=[])

        scope.restore = restore_launch
        return scope

    patch_once._k3rt_once = True
    interpreter._patch_lang = patch_once
    return True
