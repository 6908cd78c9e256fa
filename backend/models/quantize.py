"""`k3rt quantize --mxfp4-experts`: rewrite a dense checkpoint with its routed experts in the compressed-tensors
`mxfp4-pack-quantized` format Kimi-K3 is published in (kernels/moe/mxfp4_ref.py has the format and the
quantizer), so tests and benchmarks have such checkpoints without downloading K3.

Only the routed experts' w1/w2/w3 change: each `...experts.{e}.wN.weight` [N, K] becomes
`weight_packed` uint8 [N, K/2] + `weight_scale` uint8 [N, K/32]. Every other tensor, the tokenizer files and
the rest of config.json are copied as they are; config.json gains the `quantization_config` that
`model_config.parse_model_config` reads back (at the top level, where multimodal configs keep it too).
Tensors are streamed one at a time, one output file per input file, so memory stays at one tensor.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from k3rt.backend.models.loader import CheckpointError, checkpoint_files
from k3rt.kernels.moe.mxfp4_ref import GROUP, quantize_mxfp4
from k3rt.model_config import load_model_config
from k3rt.presets import MXFP4_EXPERTS_QUANTIZATION
from k3rt.models import resolve_model_dir

# a routed expert's dense projection, under any of the prefixes the loader accepts
_ROUTED = re.compile(r"^(.*\.(?:mlp|block_sparse_moe)\.experts\.\d+\.w[123])\.weight$")

# config.json's quantization_config for what this writes (the format as Kimi-K3 publishes it)
QUANTIZATION_CONFIG = MXFP4_EXPERTS_QUANTIZATION


def quantize_checkpoint(src: str | Path, dst: str | Path, *, progress: bool = True) -> Path:
    """Write `dst` (created; must not exist or be empty): `src` with MXFP4 routed experts. Returns dst."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    src, dst = resolve_model_dir(src), Path(dst)
    cfg = load_model_config(src)
    if cfg.moe is None:
        raise ValueError(f"--mxfp4-experts: {src} has no routed experts to quantize")
    if cfg.moe.expert_format == "mxfp4":
        raise ValueError(f"--mxfp4-experts: the routed experts of {src} are already MXFP4")
    width = cfg.moe.latent_size or cfg.hidden_size
    for name, v in (("moe_intermediate_size", cfg.moe.intermediate_size), ("expert width", width)):
        if v % GROUP:
            raise ValueError(f"--mxfp4-experts: {name} {v} is not a multiple of {GROUP}, the MXFP4 group size")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"--out: {dst} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    weight_map: dict[str, str] = {}
    quantized = 0
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += len(h.keys())
    bar = tqdm(total=total, desc="Quantizing experts", unit="tensor", disable=not progress)
    for f in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt") as h:
            metadata = h.metadata()
            for name in h.keys():
                bar.update(1)
                t = h.get_tensor(name)
                m = _ROUTED.match(name)
                if m is None:
                    out[name] = t
                    continue
                if t.dim() != 2 or t.shape[1] % GROUP:
                    raise CheckpointError(f"{name}: shape {tuple(t.shape)} cannot be MXFP4-quantized "
                                          f"(need [N, K] with K a multiple of {GROUP}; in {f.name})")
                packed, scale = quantize_mxfp4(t)
                out[m.group(1) + ".weight_packed"], out[m.group(1) + ".weight_scale"] = packed, scale
                quantized += 1
        save_file(out, str(dst / f.name), metadata=metadata or {"format": "pt"})
        weight_map.update({k: f.name for k in out})
    bar.close()
    if quantized == 0:
        raise CheckpointError(f"no routed expert tensors (...experts.N.w1/w2/w3.weight) found in {src}")
    if (src / "model.safetensors.index.json").is_file():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    for p in src.iterdir():  # tokenizer, generation config, chat template, ...
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, dst / p.name)
    return dst
