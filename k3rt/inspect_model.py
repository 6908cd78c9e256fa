"""`k3rt inspect`: what a model costs, from config.json alone (no torch, no weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3rt.model_config import ModelConfig, load_model_config, param_count


def inspect_config(cfg: ModelConfig, tp: int = 1, *, memory_gb: float | None = None,
                   block_size: int | None = None) -> dict[str, Any]:
    from k3rt.cache_layout import compute_layout

    cfg.check_tp(tp)
    layout = compute_layout(cfg, tp=tp, block_size=block_size)
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    per_layer = {
        "conv_bfloat16": cfg.kda_state_bytes(tp)["conv"],
        "recurrent_float32": cfg.kda_state_bytes(tp)["recurrent"],
        "recurrent_bfloat16": cfg.kda_state_bytes(tp, state_dtype="bfloat16")["recurrent"],
    }
    per_layer["total_default"] = per_layer["conv_bfloat16"] + per_layer["recurrent_float32"]
    return {
        "architecture": cfg.arch,
        "tp": tp,
        "num_layers": cfg.num_hidden_layers,
        "layer_pattern": "".join("K" if t == "kda" else "M" for t in cfg.layer_types),
        "mlp_pattern": "".join("D" if t == "dense" else "E" for t in cfg.mlp_types),
        "kda_layers": list(cfg.kda_layers),
        "mla_layers": list(cfg.mla_layers),
        "parameters": param_count(cfg),
        "kda_state_bytes_per_layer": per_layer,
        "kda_state_bytes_per_sequence": {k: v * n_kda for k, v in per_layer.items()},
        "mla_bytes_per_token_per_layer": {"bfloat16": cfg.mla_bytes_per_token(), "float16": cfg.mla_bytes_per_token("float16")},
        "mla_bytes_per_token": cfg.mla_bytes_per_token() * n_mla,
        "ignored_config_fields": list(cfg.ignored_fields),
        **{k: v for k, v in layout.as_dict().items()},
        **({"num_pages": layout.num_pages(int(memory_gb * 2**30))} if memory_gb else {}),
    }


def inspect_model_dir(model_dir: str | Path, tp: int = 1, **kw: Any) -> dict[str, Any]:
    return inspect_config(load_model_config(model_dir), tp, **kw)
