"""Config-only presets of published shapes, usable wherever only config.json is read
(`k3rt inspect`, `k3rt bench cache|scheduler`, `--random-weights` benchmarks). No weights ship here.

Values: Kimi-Linear-48B-A3B-Instruct's config.json (../shared/reference/model-facts.md §4). The K3 slice: Kimi-K3's
published widths as third-party configs state them (model-facts.md §7.4: hints, not verified against the release),
cut to four layers and 64 of its 896 routed experts so that it fits one host (issue 17's "K3-width slice").
"""

from __future__ import annotations

from typing import Any

# compressed-tensors `mxfp4-pack-quantized` routed experts (E2M1 values, E8M0 scales per group of 32), as Kimi-K3
# ships them; `k3rt quantize --mxfp4-experts` writes it too (backend/models/quantize.py)
MXFP4_EXPERTS_QUANTIZATION: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": [r"re:.*experts\.\d+\.w[123]$"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": True, "dynamic": False, "scale_dtype": "e8m0"},
            "input_activations": None,
            "format": "mxfp4-pack-quantized",
        }
    },
    "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|gate_proj|up_proj|down_proj)$",
               r"re:.*routed_expert_(down|up)_proj$"],
}

KIMI_LINEAR_48B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "rms_norm_eps": 1e-5,
    "model_max_length": 1048576, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "moe_intermediate_size": 1024, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}

# Kimi-K3 widths, four layers (KDA + dense MLP, KDA + LatentMoE, KDA + LatentMoE, MLA + LatentMoE), routed experts
# in the published MXFP4 format; 64 experts instead of 896 (each 17.5 MB packed: 896 would be 47 GB for three MoE
# layers). moe_intermediate_size 3072 is the expert width benchmarks/kernels_mxfp4.py uses for K3 (not among the
# model-facts hints).
KIMI_K3_SLICE: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792, "num_hidden_layers": 4,
    "num_attention_heads": 96, "num_key_value_heads": 96, "rms_norm_eps": 1e-5,
    "model_max_length": 262144, "tie_word_embeddings": False, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": 64, "num_experts_per_token": 16,
    "num_shared_experts": 2, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    "attn_res_block_size": 12,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 96, "head_dim": 128,
        "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True,
    },
    "quantization_config": MXFP4_EXPERTS_QUANTIZATION,
}

PRESETS: dict[str, dict[str, Any]] = {"kimi-linear-48b": KIMI_LINEAR_48B, "kimi-k3-slice": KIMI_K3_SLICE}


def cut_layers(raw: dict[str, Any], n: int) -> dict[str, Any]:
    """A copy of config dict `raw` with only its first n layers: num_hidden_layers, and the linear-attention config's
    1-based KDA and full-attention layer lists cut to them (benchmarks/decode.py --layers: the 48B's per-layer
    behaviour on a GPU its 27 layers do not fit)."""
    import copy

    if not 1 <= n <= raw["num_hidden_layers"]:
        raise ValueError(f"layers: 1 to {raw['num_hidden_layers']}, got {n}")
    out = copy.deepcopy(raw)
    out["num_hidden_layers"] = n
    lac = out.get("linear_attn_config")
    if lac:
        for key in ("kda_layers", "full_attn_layers"):
            lac[key] = [i for i in lac[key] if i <= n]
    return out
