"""A DSpark drafter folder: `config.json` (DSparkConfig fields, docs/dspark.md) + `model.safetensors`.

The folder holds the drafter's own tensors only: the embedding and LM head are the target's, passed in
at propose time, so one drafter file never drifts from its target's vocabulary table. Errors name the
field or tensor (as backend/models/loader.py's CheckpointError does).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3rt.backend.models.loader import CheckpointError
from k3rt.backend.spec.dspark.model import DSparkConfig, DSparkModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "dspark"


def load_config(folder: str | Path) -> DSparkConfig:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (a DSpark folder needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    raw = json.loads(path.read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{path}: model_type must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
    fields = {f.name: f for f in dataclasses.fields(DSparkConfig)}
    unknown = sorted(set(raw) - set(fields) - {"model_type", "dtype"})
    if unknown:
        raise CheckpointError(f"{path}: unknown field(s) {', '.join(unknown)}")
    missing = [n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING]
    if missing:
        raise CheckpointError(f"{path}: missing field(s) {', '.join(missing)}")
    kwargs = {n: raw[n] for n in fields if n in raw}
    if isinstance(kwargs["target_layers"], list):
        kwargs["target_layers"] = tuple(kwargs["target_layers"])
    try:
        return DSparkConfig(**kwargs)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def save_drafter(model: DSparkModel, folder: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                 extra: dict | None = None) -> Path:
    """Write config.json (+ `extra` keys such as training notes, into a separate training.json) and the
    weights in `dtype`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": MODEL_TYPE, "dtype": str(dtype).removeprefix("torch."), **model.cfg.to_json()}
    (folder / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {n: p.detach().to(dtype).contiguous() for n, p in model.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE))
    if extra is not None:
        (folder / "training.json").write_text(json.dumps(extra, indent=1) + "\n")
    return folder


def load_drafter(folder: str | Path, *, device: str = "cpu") -> DSparkModel:
    """config.json + model.safetensors -> an eval-mode fp32 DSparkModel. Every expected tensor must be
    present with its exact shape, and nothing else."""
    folder = Path(folder)
    cfg = load_config(folder)
    model = DSparkModel(cfg)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    tensors = load_file(str(path))
    expected = model.state_dict()
    for name, want in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name} {list(want.shape)}")
        if tuple(tensors[name].shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {list(want.shape)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) {', '.join(unexpected)} (a drafter stores no "
                              "embedding or LM head: those are the target's)")
    model.load_state_dict({n: t.float() for n, t in tensors.items()})
    return model.to(device).eval()
