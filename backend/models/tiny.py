"""Small random checkpoints in the published format (config.json + safetensors + tokenizer),
for tests and demos until a trained default model exists (`k3rt make-tiny`).

`export_checkpoint` is the inverse of the loader's name mapping (published names, TP=1), so a
checkpoint written here exercises exactly the code path a downloaded Kimi checkpoint takes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import DTYPES
from k3rt.backend.tokenizer import load_tokenizer, write_tiny_tokenizer
from k3rt.model_config import parse_model_config

_COMMON = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "v_head_dim": 16, "mla_use_nope": True, "num_experts": 8, "num_experts_per_token": 2,
    "num_shared_experts": 1, "moe_intermediate_size": 32, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "model_max_length": 8192, "num_nextn_predict_layers": 0,
}

TINY_CONFIGS: dict[str, dict] = {
    "kimi_linear": {
        **_COMMON, "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_act": "silu",
        "q_lora_rank": None, "routed_scaling_factor": 2.446,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16,
                               "short_conv_kernel_size": 4},
    },
    "k3": {
        **_COMMON, "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "q_lora_rank": 48,
        "mla_use_output_gate": True, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "routed_scaling_factor": 1.0, "attn_res_block_size": 2,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4, "head_dim": 16,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    },
}


def two_layer_overrides(arch: str) -> dict:
    """make_tiny overrides for a two-layer variant of `arch`'s tiny config: one KDA layer (dense MLP), then one
    MLA layer (MoE), so every kind of layer runs once. For tests whose cost is per layer (the Triton interpreter)."""
    return {"num_hidden_layers": 2, "linear_attn_config": {
        **TINY_CONFIGS[arch]["linear_attn_config"], "kda_layers": [1], "full_attn_layers": [2]}}


def random_init(model: KimiForCausalLM, seed: int) -> None:
    """Deterministic random weights with healthy scales (std 0.02 linears, fla-style gate params)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        init_parameter(name, p, g)


def init_parameter(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    """Draw one parameter in place, on the generator's device (fp32 draws, cast to p's dtype)."""
    shape, dev = p.shape, g.device

    def empty() -> torch.Tensor:
        return torch.empty(shape, device=dev)

    if name.endswith("_packed"):  # MXFP4 experts: random E2M1 codes, two per byte
        p.data.copy_(torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.uint8))
        return
    if name.endswith("_scale") and p.dtype == torch.uint8:
        # E8M0 scales near 2^-7: random codes (std ~2.7) times 2^-7 give the 0.02 std of the dense weights
        p.data.copy_(torch.randint(119, 122, shape, generator=g, device=dev, dtype=torch.uint8))
        return
    if name.endswith("A_log"):
        v = empty().uniform_(1, 16, generator=g).log()
    elif name.endswith("dt_bias"):
        dt = empty().uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp().clamp_min(1e-4)
        v = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    elif "norm" in name.split(".")[-1] or name.endswith("norm.weight") or name.endswith("norm_weight"):
        v = 1.0 + 0.1 * torch.randn(shape, generator=g, device=dev)
    elif name.endswith("e_score_correction_bias"):
        v = 0.01 * torch.randn(shape, generator=g, device=dev)
    elif name.endswith("conv_weight"):
        v = torch.randn(shape, generator=g, device=dev) / math.sqrt(shape[-1])
    elif name.endswith("_res_proj.weight"):
        v = 0.1 * torch.randn(shape, generator=g, device=dev)
    else:
        v = 0.02 * torch.randn(shape, generator=g, device=dev)
    p.data.copy_(v.to(p.dtype))


# k3rt expert stack suffix -> the checkpoint's per-expert tensor name (dense; compressed-tensors MXFP4)
_EXPERT_KIND = {"": "weight", "_packed": "weight_packed", "_scale": "weight_scale"}


def export_checkpoint(model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """k3rt parameters -> tensors under the published Kimi checkpoint names (TP = 1)."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach().contiguous()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if not name.startswith("model.layers."):
            out[name] = t
            continue
        _, _, idx, rest = name.split(".", 3)
        pre = f"model.layers.{idx}."
        moe = cfg.mlp_types[int(idx)] == "moe"
        if moe and rest.startswith("mlp."):
            rest = "block_sparse_moe." + rest[4:]
        if rest == "self_attn.conv_weight":
            for part, x in zip("qkv", t.chunk(3, dim=0)):
                out[pre + f"self_attn.{part}_conv1d.weight"] = x[:, None, :].contiguous()
        elif rest == "self_attn.A_log":
            out[pre + rest] = t.view(1, 1, -1, 1)
        elif rest == "self_attn.o_norm_weight":
            out[pre + "self_attn.o_norm.weight"] = t
        elif rest.endswith("gate_up_proj.weight"):
            base = rest[: -len("gate_up_proj.weight")]
            gate, up = t.chunk(2, dim=0)
            out[pre + base + "gate_proj.weight"], out[pre + base + "up_proj.weight"] = gate.contiguous(), up.contiguous()
        elif rest == "block_sparse_moe.gate_weight":
            out[pre + "block_sparse_moe.gate.weight"] = t
        elif rest == "block_sparse_moe.e_score_correction_bias":
            out[pre + "block_sparse_moe.gate.e_score_correction_bias"] = t
        elif rest.startswith("block_sparse_moe.w13"):
            kind = _EXPERT_KIND[rest[len("block_sparse_moe.w13"):]]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[pre + f"block_sparse_moe.experts.{e}.w1.{kind}"] = gate.contiguous()
                out[pre + f"block_sparse_moe.experts.{e}.w3.{kind}"] = up.contiguous()
        elif rest.startswith("block_sparse_moe.w2"):
            kind = _EXPERT_KIND[rest[len("block_sparse_moe.w2"):]]
            for e in range(t.shape[0]):
                out[pre + f"block_sparse_moe.experts.{e}.w2.{kind}"] = t[e].contiguous()
        elif rest == "block_sparse_moe.routed_expert_norm":
            out[pre + "block_sparse_moe.routed_expert_norm.weight"] = t
        else:
            out[pre + rest] = t
    return out


def write_checkpoint(model: KimiForCausalLM, out_dir: Path, raw_config: dict, *, dtype: str,
                     max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is exceeded)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # integer tensors (MXFP4 codes and scales) keep their dtype; float ones take `dtype` or stay fp32
    tensors = {k: v if not v.is_floating_point() else v.to(DTYPES[dtype]) if _cast_ok(k) else v.float()
               for k, v in export_checkpoint(model).items()}
    (out_dir / "config.json").write_text(json.dumps({**raw_config, "torch_dtype": dtype}, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# published checkpoints keep these in fp32 whatever the model dtype
_FP32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "o_norm.weight")


def _cast_ok(name: str) -> bool:
    return not name.endswith(_FP32_SUFFIXES)


def make_tiny(out_dir: str | Path, *, arch: str = "kimi_linear", seed: int = 0, dtype: str = "bfloat16",
              vocab_size: int | None = None, max_shard_bytes: int | None = None,
              overrides: dict | None = None) -> Path:
    """Write a small random checkpoint (config, safetensors, tokenizer) to out_dir and return it. overrides:
    config.json keys replaced in the arch's tiny config (e.g. expert widths a kernel's layout needs)."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch: {arch!r} not one of {sorted(TINY_CONFIGS)}")
    raw = dict(TINY_CONFIGS[arch])
    if vocab_size is not None:
        raw["vocab_size"] = vocab_size
    raw.update(overrides or {})
    write_random_checkpoint(out_dir, raw, seed=seed, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return Path(out_dir)


def write_random_checkpoint(out_dir: str | Path, raw: dict, *, seed: int, dtype: str, init_dtype: str = "float32",
                            device: str = "cpu", max_shard_bytes: int | None = None, progress: bool = False) -> dict:
    """A checkpoint of `raw`'s shape with random weights: the tiny tokenizer of its vocabulary (whose special ids go
    into config.json), the weights drawn in `init_dtype` on `device` (random_model; fp32 on the CPU gives
    random_init's values) and written in `dtype`. Returns the config.json written."""
    from k3rt.backend.models.random_init import random_model  # imports this module

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(out, vocab_size=raw["vocab_size"], seed=seed)
    tok = load_tokenizer(out)
    raw = {**raw, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids[0],
           "pad_token_id": tok.pad_token_id}
    model = random_model(parse_model_config(raw), dtype=init_dtype, device=device, seed=seed, progress=progress)
    write_checkpoint(model.to("cpu"), out, raw, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return raw
