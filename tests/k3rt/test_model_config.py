"""config.json parsing for the three dialects, and the errors that name the offending field.

(a) the published Kimi-Linear-48B config (model-facts §4), with the state and cache sizes of
    model-facts §8.4; (b) the same model as transformers 5 writes it; (c) the Kimi-K3 text backbone
    nested under `text_config`. Also: `import k3rt.model_config` does not import torch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3rt.model_config import ConfigError, ModelConfig, load_model_config, parse_model_config

KDA_LAYERS_48B = [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]
FULL_ATTN_LAYERS_48B = [4, 8, 12, 16, 20, 24, 27]

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (model-facts §4)
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                 "AutoModel": "modeling_kimi.KimiLinearModel",
                 "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "model_max_length": 1048576,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "initializer_range": 0.02,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {
        "kda_layers": KDA_LAYERS_48B,
        "full_attn_layers": FULL_ATTN_LAYERS_48B,
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "transformers_version": "4.56.0",
}

MLA_LAYERS_48B = (3, 7, 11, 15, 19, 23, 26)


def test_published_kimi_linear_48b() -> None:
    cfg = parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))
    assert cfg.arch == "kimi_linear"
    assert cfg.num_hidden_layers == 27 and len(cfg.layer_types) == 27
    assert cfg.mla_layers == MLA_LAYERS_48B
    assert cfg.kda_layers == tuple(i - 1 for i in KDA_LAYERS_48B)
    assert cfg.mlp_types == ("dense",) + ("moe",) * 26
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps) == (163840, 2304, 9216, 1e-5)
    assert cfg.kda == dataclasses.replace(cfg.kda, num_heads=32, head_dim=128, conv_kernel_size=4,
                                          gate_lower_bound=None, use_full_rank_gate=False)
    m = cfg.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        32, None, 512, 128, 64, 128)
    assert not m.use_output_gate
    assert m.qk_head_dim == 192 and m.scale == pytest.approx(192**-0.5) and m.cache_dim == 576
    e = cfg.moe
    assert (e.num_experts, e.num_experts_per_token, e.intermediate_size, e.num_shared_experts) == (256, 8, 1024, 1)
    assert (e.routed_scaling_factor, e.renormalize, e.num_expert_group, e.topk_group) == (2.446, True, 1, 1)
    assert e.latent_size is None and not e.latent_norm and e.shared_intermediate_size == 1024
    assert cfg.act.name == "silu" and cfg.attn_res_block_size is None and not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (163584, (163586,), 163839)
    assert cfg.max_position_embeddings == 1048576 and cfg.dtype == "bfloat16"


# (tp, recurrent dtype) -> (conv bytes, recurrent bytes), model-facts §8.4 (conv state in bf16)
STATE_BYTES = {
    (1, "float32"): (73_728, 2_097_152),
    (2, "float32"): (36_864, 1_048_576),
    (4, "float32"): (18_432, 524_288),
    (8, "float32"): (9_216, 262_144),
    (1, "bfloat16"): (73_728, 1_048_576),
    (8, "bfloat16"): (9_216, 131_072),
}


@pytest.mark.parametrize("tp, state_dtype", list(STATE_BYTES), ids=[f"tp{t}-{d}" for t, d in STATE_BYTES])
def test_kda_state_bytes_48b(tp: int, state_dtype: str) -> None:
    cfg = parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))
    conv, rec = STATE_BYTES[tp, state_dtype]
    assert cfg.kda_state_bytes(tp, state_dtype=state_dtype) == {"conv": conv, "recurrent": rec, "total": conv + rec}


def test_mla_bytes_and_tp_divisibility_48b() -> None:
    cfg = parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))
    assert cfg.mla_bytes_per_token() == 1152
    assert cfg.mla_bytes_per_token("float32") == 2304
    assert cfg.kda_state_bytes(1)["total"] == 2_170_880  # the vLLM mamba page of one KDA layer
    with pytest.raises(ConfigError, match="num_heads=32 is not divisible by tensor-parallel size 3"):
        cfg.kda_state_bytes(3)
    with pytest.raises(ConfigError, match="tensor-parallel size 64"):
        cfg.check_tp(64)


# ------------------------------------------------------------------------------------------------
# (b) transformers 5
# ------------------------------------------------------------------------------------------------


def _math(cfg: ModelConfig) -> ModelConfig:
    """The config with pure metadata (token ids, context length, dtype) neutralized."""
    return dataclasses.replace(cfg, bos_token_id=None, eos_token_ids=(), pad_token_id=None,
                               max_position_embeddings=0, dtype="bfloat16")


def _transformers_config():
    transformers = pytest.importorskip("transformers")
    return transformers.KimiLinearConfig(
        linear_attn_config={"kda_layers": KDA_LAYERS_48B, "full_attn_layers": FULL_ATTN_LAYERS_48B,
                            "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
        first_k_dense_replace=1,
    )


def _transformers_dict() -> dict:
    return _transformers_config().to_dict()


def test_transformers5_to_dict_parses_like_published() -> None:
    raw = _transformers_dict()
    assert "layer_types" in raw and "mlp_layer_types" in raw  # the transformers-5 dialect
    assert parse_model_config(raw) == parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))


def test_transformers5_save_pretrained_parses_like_published(tmp_path: Path) -> None:
    _transformers_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["layer_types"][3] == "full_attention" and saved["mlp_layer_types"][0] == "dense"
    assert _math(load_model_config(tmp_path)) == _math(parse_model_config(copy.deepcopy(KIMI_LINEAR_48B)))


def test_transformers5_without_linear_attn_config() -> None:
    raw = _transformers_dict()
    del raw["linear_attn_config"]
    raw.pop("first_k_dense_replace", None)
    assert {"linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"} <= raw.keys()
    cfg = parse_model_config(raw)
    assert cfg == parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))
    assert cfg.mla_layers == MLA_LAYERS_48B and cfg.mlp_types[0] == "dense"
    # the KDA sizes come from linear_* (not from the MLA head count or head_dim)
    raw.update(linear_num_heads=16, linear_head_dim=64, linear_conv_kernel_dim=3)
    want = _with_lac(KIMI_LINEAR_48B, num_heads=16, head_dim=64, short_conv_kernel_size=3)
    assert parse_model_config(raw) == parse_model_config(want)
    assert parse_model_config(raw).kda.num_heads == 16 and parse_model_config(raw).mla.num_heads == 32


def test_transformers5_attribute_mapped_names() -> None:
    """num_local_experts / num_experts_per_tok / n_shared_experts / n_group / norm_topk_prob."""
    raw = _transformers_dict()
    for old, new in (("num_experts", "num_local_experts"), ("num_experts_per_token", "num_experts_per_tok"),
                     ("num_shared_experts", "n_shared_experts"), ("num_expert_group", "n_group"),
                     ("moe_renormalize", "norm_topk_prob")):
        raw[new] = raw.pop(old)
    assert parse_model_config(raw) == parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))


# ------------------------------------------------------------------------------------------------
# (c) Kimi-K3 text backbone under text_config
# ------------------------------------------------------------------------------------------------

K3_FULL_ATTN = list(range(4, 93, 4)) + [93]
K3_TEXT = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792, "num_hidden_layers": 93,
    "num_attention_heads": 96, "num_key_value_heads": 96, "rms_norm_eps": 1e-5, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "max_position_embeddings": 1048576,
    "tie_word_embeddings": False, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1,
    "topk_group": 1, "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0, "attn_res_block_size": 12,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 94) if i not in K3_FULL_ATTN], "full_attn_layers": K3_FULL_ATTN,
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}
K3 = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": K3_TEXT,
    "vision_config": {"model_type": "moonvit3d", "hidden_size": 1152},
    "media_placeholder_token_id": 163605,
    "pad_token_id": 0,
    "ignore_index": -100,
    "torch_dtype": "bfloat16",
    "eos_token_id": 163586,
}


def k3(**text_overrides) -> dict:
    raw = copy.deepcopy(K3)
    raw["text_config"].update(text_overrides)
    return raw


def test_k3_nested_text_config() -> None:
    cfg = parse_model_config(k3())
    assert cfg.arch == "kimi_k3"
    assert cfg.num_hidden_layers == 93
    assert cfg.mla_layers == tuple(range(3, 92, 4)) + (92,) and len(cfg.mla_layers) == 24
    assert len(cfg.kda_layers) == 69 and cfg.layer_types[0] == "kda"
    assert cfg.mlp_types == ("dense",) + ("moe",) * 92
    assert cfg.kda.gate_lower_bound == -5.0 and cfg.kda.use_full_rank_gate
    assert (cfg.kda.num_heads, cfg.kda.head_dim) == (96, 128)
    assert cfg.mla.use_output_gate and cfg.mla.q_lora_rank == 1536 and cfg.mla.num_heads == 96
    m = cfg.moe
    assert (m.num_experts, m.num_experts_per_token, m.num_shared_experts, m.intermediate_size) == (896, 16, 2, 3072)
    assert m.latent_size == 3584 and m.latent_norm and m.shared_intermediate_size == 6144
    assert cfg.act.name == "situ" and (cfg.act.situ_beta, cfg.act.situ_linear_beta) == (4.0, 25.0)
    assert cfg.attn_res_block_size == 12
    # outer keys fill the text config's gaps
    assert cfg.pad_token_id == 0 and cfg.eos_token_ids == (163586,) and cfg.dtype == "bfloat16"
    assert cfg.kda_state_bytes(1) == {"conv": 3 * 3 * 96 * 128 * 2, "recurrent": 96 * 128 * 128 * 4,
                                      "total": 3 * 3 * 96 * 128 * 2 + 96 * 128 * 128 * 4}
    assert cfg.mla_bytes_per_token() == 1152


def test_k3_linear_beta_null_means_identity() -> None:
    cfg = parse_model_config(k3(activation_situ_linear_beta=None))
    assert cfg.act.situ_beta == 4.0 and cfg.act.situ_linear_beta is None


def test_k3_flat_text_config_is_k3() -> None:
    """The text config alone (no wrapper, model_type kimi_linear) is recognized as K3 by its features."""
    flat = parse_model_config(copy.deepcopy(K3_TEXT))
    assert flat.arch == "kimi_k3"
    assert _math(flat) == _math(parse_model_config(k3()))


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


def _with_lac(raw: dict, **lac) -> dict:
    raw = copy.deepcopy(raw)
    raw["linear_attn_config"].update(lac)
    return raw


ERRORS = {
    "lower_bound_below_-5": (_with_lac(K3_TEXT, gate_lower_bound=-5.5), "linear_attn_config.gate_lower_bound"),
    "lower_bound_zero": (_with_lac(K3_TEXT, gate_lower_bound=0.0), "linear_attn_config.gate_lower_bound"),
    "lower_bound_positive": (_with_lac(K3_TEXT, gate_lower_bound=1.0), "linear_attn_config.gate_lower_bound"),
    "layer_listed_twice": (_with_lac(KIMI_LINEAR_48B, full_attn_layers=FULL_ATTN_LAYERS_48B + [5]),
                           "layer 5 listed twice"),
    "layer_in_neither_list": (_with_lac(KIMI_LINEAR_48B, kda_layers=KDA_LAYERS_48B[1:]),
                              r"layers \[1\] are in neither kda_layers nor full_attn_layers"),
    "layer_index_out_of_range": (_with_lac(KIMI_LINEAR_48B, full_attn_layers=FULL_ATTN_LAYERS_48B + [28]),
                                 "linear_attn_config.full_attn_layers: index 28"),
    "zero_based_layer_index": (_with_lac(KIMI_LINEAR_48B, kda_layers=[0] + KDA_LAYERS_48B),
                               "linear_attn_config.kda_layers: index 0"),
    "situ_without_beta": ({**K3_TEXT, "activation_situ_beta": None}, "activation_situ_beta"),
    "situ_beta_zero": ({**K3_TEXT, "activation_situ_beta": 0.0}, "activation_situ_beta"),
    "situ_beta_with_silu": ({**KIMI_LINEAR_48B, "activation_situ_beta": 4.0}, "activation_situ_beta"),
    "topk_above_experts": ({**KIMI_LINEAR_48B, "num_experts_per_token": 257}, "num_experts_per_token"),
    "topk_group_above_groups": ({**KIMI_LINEAR_48B, "num_expert_group": 8, "topk_group": 9}, "topk_group"),
    "groups_not_dividing_experts": ({**KIMI_LINEAR_48B, "num_expert_group": 3}, "num_expert_group"),
    "latent_norm_without_latent": ({**KIMI_LINEAR_48B, "latent_moe_use_norm": True}, "latent_moe_use_norm"),
    "layer_types_disagree": ({**KIMI_LINEAR_48B, "layer_types": ["linear_attention"] * 26 + ["full_attention"]},
                             "layer_types: disagrees"),
    "layer_types_unknown_kind": ({**KIMI_LINEAR_48B, "layer_types": ["sliding_attention"] * 27}, "layer_types"),
    "mlp_layer_types_too_short": ({**KIMI_LINEAR_48B, "mlp_layer_types": ["dense"] + ["sparse"] * 25},
                                  "mlp_layer_types"),
    "no_layer_pattern": ({k: v for k, v in KIMI_LINEAR_48B.items() if k != "linear_attn_config"},
                         "linear_attn_config.kda_layers"),
    "unknown_kda_field": (_with_lac(KIMI_LINEAR_48B, num_v_heads=64), "linear_attn_config.num_v_heads"),
    "separate_kda_key_heads": (_with_lac(KIMI_LINEAR_48B, num_kv_heads=16), "linear_attn_config.num_kv_heads"),
    "missing_num_hidden_layers": ({k: v for k, v in KIMI_LINEAR_48B.items() if k != "num_hidden_layers"},
                                  "num_hidden_layers"),
    "missing_moe_intermediate_size": ({k: v for k, v in KIMI_LINEAR_48B.items() if k != "moe_intermediate_size"},
                                      "moe_intermediate_size"),
    "unknown_dtype": ({**KIMI_LINEAR_48B, "torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
    "unknown_architecture": ({**KIMI_LINEAR_48B, "architectures": ["DeepseekV3ForCausalLM"],
                              "model_type": "deepseek_v3"}, "architectures: unknown architecture"),
    "quantized_k3": (k3(quantization_config={"quant_method": "compressed-tensors"}), "quantization_config"),
    "softmax_router": ({**KIMI_LINEAR_48B, "moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    "rope_mla": ({**KIMI_LINEAR_48B, "mla_use_nope": False}, "mla_use_nope"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_config_error_names_the_field(case: str) -> None:
    raw, pattern = ERRORS[case]
    with pytest.raises(ConfigError, match=pattern):
        parse_model_config(copy.deepcopy(raw))


def test_lower_bound_minus_five_is_accepted() -> None:
    assert parse_model_config(_with_lac(K3_TEXT, gate_lower_bound=-5.0)).kda.gate_lower_bound == -5.0


def test_unknown_metadata_fields_are_reported_not_fatal() -> None:
    cfg = parse_model_config({**KIMI_LINEAR_48B, "some_bookkeeping_key": 1, "rope_theta": 10000.0})
    assert "some_bookkeeping_key" in cfg.ignored_fields and "rope_theta" in cfg.ignored_fields
    assert cfg == parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))  # ignored_fields is not compared


def test_load_model_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json: not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: invalid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LINEAR_48B))
    assert load_model_config(tmp_path) == parse_model_config(copy.deepcopy(KIMI_LINEAR_48B))


def test_import_does_not_pull_in_torch() -> None:
    code = ("import sys, k3rt.model_config; "
            "bad = sorted(m for m in ('torch', 'numpy', 'safetensors', 'transformers') if m in sys.modules); "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"import k3rt.model_config imported: {proc.stdout.strip()} {proc.stderr[-500:]}"
