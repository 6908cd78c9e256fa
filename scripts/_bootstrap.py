"""Make `k3rt.*` importable from this checkout whether or not k3rt is installed.

The device machine has no install and no package registry (and lacks orjson, which `k3rt/__init__`
needs for the DSL). There `k3rt` becomes a bare namespace over k3rt/, and `k3rt.backend`,
`k3rt.kernels`, `k3rt.training` map onto backend/, kernels/, training/, as setup.py maps them when
installing.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_k3rt() -> None:
    try:
        import k3rt.backend.models.kimi  # noqa: F401
        return
    except ModuleNotFoundError:
        for name in [n for n in sys.modules if n == "k3rt" or n.startswith("k3rt.")]:
            del sys.modules[name]
    pkg = types.ModuleType("k3rt")
    pkg.__path__ = [str(ROOT / "k3rt")]  # namespace only: k3rt/__init__ (the DSL client) is not needed
    sys.modules["k3rt"] = pkg
    for sub in ("backend", "kernels", "training"):
        spec = importlib.util.spec_from_file_location(
            f"k3rt.{sub}", ROOT / sub / "__init__.py", submodule_search_locations=[str(ROOT / sub)])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"k3rt.{sub}"] = mod
        spec.loader.exec_module(mod)
        setattr(pkg, sub, mod)
