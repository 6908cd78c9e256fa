"""Models shipped inside the k3rt package, resolved by name. No torch.

`k3rt/models/<name>/` holds a complete checkpoint folder (config.json, safetensors shards, tokenizer
files, README.md model card). Wherever k3rt accepts a checkpoint folder it also accepts the name of
a shipped model, and `DEFAULT_MODEL` is what runs when none is given:

    resolve_model_dir("k3-tiny")        -> <site-packages>/k3rt/models/k3-tiny
    resolve_model_dir(None)             -> the same (the default model)
    resolve_model_dir("/path/to/ckpt")  -> /path/to/ckpt   (an existing folder always wins)
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "k3-tiny"
MODELS_DIR = Path(__file__).resolve().parent


def shipped_models() -> list[str]:
    """Names of the model folders inside the package (present whether or not weights are in them yet)."""
    return sorted(p.name for p in MODELS_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def resolve_model_dir(model: str | Path | None) -> Path:
    """The checkpoint folder for `model`: an existing path as given, else the shipped model of that name,
    else the path unchanged (so the caller's "not found" error names what the user typed)."""
    if model is None:
        model = DEFAULT_MODEL
    path = Path(model)
    if path.is_dir():
        return path
    shipped = MODELS_DIR / str(model)
    if str(model) in shipped_models() and shipped.is_dir():
        return shipped
    return path


DRAFTER_SUFFIX = "-dspark"


def resolve_drafter_dir(spec_model: str | Path | None, target: str | Path | None) -> Path:
    """The DSpark drafter folder for `--spec dspark`: --spec-model as given (a folder, or a shipped drafter's
    name), else the drafter shipped beside a shipped target (k3rt/models/<target>-dspark). Raises ValueError
    naming --spec-model when there is none."""
    if spec_model is not None:
        path = resolve_model_dir(spec_model)
        if not path.is_dir():
            raise ValueError(f"spec_model: {spec_model} is not a folder (a DSpark drafter folder holds config.json "
                             "and model.safetensors)")
        return path
    target_dir = resolve_model_dir(target).resolve()
    if target_dir.parent == MODELS_DIR:
        shipped = MODELS_DIR / (target_dir.name + DRAFTER_SUFFIX)
        if shipped.is_dir():
            return shipped
    raise ValueError(f"spec_model: no DSpark drafter ships with {target}; pass --spec-model DIR (a drafter folder, "
                     "docs/dspark.md)")
