"""Compile churn of the Triton kernels: how many binaries each one holds, and which ones its launches ask for.

Triton 3.6 keys a kernel's binaries on the specialization of its arguments (kernels/common.py, "Compiles") and
the launch options; a launch whose key is new compiles first, seconds of work that land in whatever step made
it. Two views:

  compiled_counts()  the binaries each @triton.jit kernel holds now (JITFunction.device_caches: what the GPU
                     really compiled); {} under the interpreter, which compiles nothing.
  LaunchKeys         a context manager that records, per kernel, the compile key of every launch inside it:
                     the key JITFunction.run computes from the same arguments (the CUDA backend's
                     specialization of each argument, with the kernel's do_not_specialize lists, plus the
                     launch options). It runs the same way on the GPU and under the interpreter, so a CPU test
                     sees which launches would compile on the GPU, and `churn` names the arguments responsible.

  specialize_all     comparison runs only: every argument specialized again, as before the kernels' lists.

This module knows nothing of the runner: callers drive the work and read the counts.
"""
from __future__ import annotations

import importlib
import pkgutil
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from triton.runtime.jit import JITFunction, create_function_from_signature

try:  # the backend whose specialization serving sees (the same rules as the base backend in Triton 3.6)
    from triton.backends.nvidia.compiler import CUDABackend as _SpecBackend
except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
    from triton.backends.compiler import BaseBackend as _SpecBackend


def triton_kernels() -> dict[str, Any]:
    """Every @triton.jit function of the k3rt.kernels packages' triton_* modules, by "package.module.name"
    (helpers called from kernels are listed too; they are never launched, so they hold no binary)."""
    import k3rt.kernels as root

    out: dict[str, Any] = {}
    for pkg in pkgutil.iter_modules(root.__path__):
        if not pkg.ispkg:
            continue
        sub = importlib.import_module(f"k3rt.kernels.{pkg.name}")
        for mod in pkgutil.iter_modules(sub.__path__):
            if not mod.name.startswith("triton_"):
                continue
            m = importlib.import_module(f"k3rt.kernels.{pkg.name}.{mod.name}")
            for name, obj in vars(m).items():
                if _is_kernel(obj) and obj.fn.__module__ == m.__name__:
                    out[f"{pkg.name}.{mod.name}.{name}"] = obj
    return out


def _is_kernel(obj: Any) -> bool:
    if isinstance(obj, JITFunction):
        return True
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, InterpretedFunction)


def compiled_counts(kernels: dict[str, Any] | None = None) -> dict[str, int]:
    """Binaries held per kernel (every device summed), kernels holding none left out; {} under the interpreter."""
    counts = {}
    for name, fn in (kernels if kernels is not None else triton_kernels()).items():
        caches = getattr(fn, "device_caches", None)
        if caches is None:  # the interpreter's functions compile nothing
            continue
        n = sum(len(entry[0]) for entry in caches.values())  # (kernel_cache, key_cache, target, backend, binder)
        if n:
            counts[name] = n
    return counts


def _binder(fn: Any) -> tuple[Callable, list[str], set[str]]:
    """The argument binder JITFunction.run uses for `fn` (built for the interpreter's functions from the same
    source and do_not_specialize lists), the parameter names and those declared tl.constexpr."""
    if not isinstance(fn, JITFunction):
        kw = getattr(fn, "kwargs", {})
        fn = JITFunction(fn.fn, do_not_specialize=kw.get("do_not_specialize"),
                         do_not_specialize_on_alignment=kw.get("do_not_specialize_on_alignment"))
    binder = create_function_from_signature(fn.signature, fn.params, _SpecBackend)
    return binder, [p.name for p in fn.params], {p.name for p in fn.params if p.is_constexpr}


class LaunchKeys:
    """Records the compile key of every launch of the given kernels (default: all of `triton_kernels()`)
    while the context is open; the launches themselves run unchanged. Not for use inside CUDA graph capture
    timing (it adds host work per launch), nor from two threads at once."""

    def __init__(self, kernels: dict[str, Any] | None = None) -> None:
        self.kernels = kernels if kernels is not None else triton_kernels()
        self.keys: dict[str, list[tuple]] = {}  # kernel -> its distinct keys, in first-seen order
        self.params: dict[str, list[str]] = {}
        self.constexprs: dict[str, set[str]] = {}

    def __enter__(self) -> "LaunchKeys":
        for name, fn in self.kernels.items():
            binder, self.params[name], self.constexprs[name] = _binder(fn)
            fn.run = self._wrap(name, fn.run, binder)  # the instance attribute shadows the class's method
        return self

    def __exit__(self, *exc: object) -> None:
        for fn in self.kernels.values():
            vars(fn).pop("run", None)

    def _wrap(self, name: str, run: Callable, binder: Callable) -> Callable:
        def recorded(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            _, spec, options = binder(*args, **kwargs)
            key = (tuple(repr(s) for s in spec), tuple(sorted((k, repr(v)) for k, v in options.items())))
            seen = self.keys.setdefault(name, [])
            if key not in seen:
                seen.append(key)
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        return recorded

    def counts(self) -> dict[str, int]:
        """Distinct keys (binaries a GPU would hold) per launched kernel."""
        return {name: len(keys) for name, keys in self.keys.items()}

    def new_since(self, before: dict[str, int]) -> dict[str, int]:
        """Kernels with keys first seen after `before` (an earlier `counts()`), and how many."""
        now = self.counts()
        return {name: n - before.get(name, 0) for name, n in now.items() if n > before.get(name, 0)}

    def churn(self, name: str) -> dict[str, list[str]]:
        """The arguments (and launch options) whose specialization differs between `name`'s keys: what made
        its binaries more than one."""
        keys = self.keys.get(name, [])
        if len(keys) < 2:
            return {}
        out: dict[str, list[str]] = {}
        for i, pname in enumerate(self.params[name]):
            vals = sorted({k[0][i] for k in keys})
            if len(vals) > 1:
                out[pname] = vals
        for opt in sorted({o for k in keys for o, _ in k[1]}):
            vals = sorted({dict(k[1]).get(opt, "-") for k in keys})
            if len(vals) > 1:
                out[f"option {opt}"] = vals
        return out


    def runtime_churn(self) -> dict[str, dict[str, list[str]]]:
        """Per kernel, the churn (`churn`) in arguments not declared tl.constexpr: binaries that a per-step value
        or pointer made, where the kernel's do_not_specialize lists miss it. Choices the launcher makes on
        purpose (tile constexprs, launch options) are left out."""
        out = {}
        for name in self.keys:
            c = {p: v for p, v in self.churn(name).items()
                 if not p.startswith("option ") and p not in self.constexprs[name]}
            if c:
                out[name] = c
        return out


@contextmanager
def specialize_all(kernels: dict[str, Any] | None = None) -> Iterator[None]:
    """Comparison runs only (benchmarks/jit_churn.py --specialize-all): inside, the kernels' do_not_specialize
    lists are ignored, so every argument is specialized the way Triton does by default (what the kernels did
    before the lists); the lists are restored on exit. A JITFunction builds its argument binder at its first
    launch on a device and keeps it, so this must wrap the process's first launch of each kernel (else
    ValueError), and a kernel first launched inside keeps the default specialization for the rest of the process
    (a comparison run's process does nothing else)."""
    kernels = kernels if kernels is not None else triton_kernels()
    saved = []
    for name, fn in kernels.items():
        if isinstance(fn, JITFunction):
            if len(fn.device_caches):
                raise ValueError(f"specialize_all: {name} was launched already (its binder is built)")
            saved.append((fn, [(p.do_not_specialize, p.do_not_specialize_on_alignment) for p in fn.params]))
            for p in fn.params:
                p.do_not_specialize = p.do_not_specialize_on_alignment = False
        else:  # the interpreter's function: LaunchKeys reads the lists from its kwargs
            saved.append((fn, dict(fn.kwargs)))
            fn.kwargs.update(do_not_specialize=None, do_not_specialize_on_alignment=None)
    try:
        yield
    finally:
        for fn, old in saved:
            if isinstance(fn, JITFunction):
                for p, (dns, dns_oa) in zip(fn.params, old):
                    p.do_not_specialize, p.do_not_specialize_on_alignment = dns, dns_oa
            else:
                fn.kwargs.clear()
                fn.kwargs.update(old)
