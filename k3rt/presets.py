"""Config-only presets of published shapes, usable wherever only config.json is read
(`k3rt inspect`, `k3rt bench cache|scheduler`, `--random-weights` benchmarks). No weights ship here.

Values: Kimi-Linear-48B-A3B-Instruct's config.json (../shared/reference/model-facts.md §4).
"""

from __future__ import annotations

from typing import Any

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

PRESETS: dict[str, dict[str, Any]] = {"kimi-linear-48b": KIMI_LINEAR_48B}
