"""Maps the top-level directories onto the `k3rt.*` import packages (DESIGN.md §2, plus training/: the
default model's training, kept out of backend/).

pyproject's static `packages.find` cannot remap directories, so the package list is computed here:
every directory holding an `__init__.py` under k3rt/, frontend/, backend/, kernels/ and training/.
"""
from pathlib import Path

from setuptools import setup

ROOTS = {"k3rt": "k3rt", "k3rt.frontend": "frontend", "k3rt.backend": "backend", "k3rt.kernels": "kernels",
         "k3rt.training": "training"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, root in ROOTS.items():
        package_dir[name] = root
        for init in sorted(Path(root).rglob("__init__.py")):
            rel = init.parent.relative_to(root).parts
            packages.append(".".join((name, *rel)))
    return packages, package_dir


packages, package_dir = _packages()
# the models shipped inside the package (k3rt/models/<name>/: config, weights, tokenizer, model card)
MODEL_FILES = ["*/*.json", "*/*.safetensors", "*/*.md", "*/*.jinja", "*/*.model"]
setup(packages=packages, package_dir=package_dir,
      package_data={"k3rt.backend": ["py.typed"], "k3rt.models": MODEL_FILES})
