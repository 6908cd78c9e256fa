"""The typed, frozen model configuration and its parser for three `config.json` dialects.

Dialects (see ../shared/reference/model-facts.md §4, §7):
  (a) Kimi-Linear as published on the Hub: `linear_attn_config` with 1-indexed `kda_layers` /
      `full_attn_layers`, `first_k_dense_replace`, `moe_layer_freq`, `num_experts`, ...
  (b) Kimi-Linear as written by transformers >= 5 `save_pretrained`: `layer_types`,
      `mlp_layer_types`, `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`, and the
      attribute-mapped names (`num_local_experts`, `n_shared_experts`, ...).
  (c) the Kimi-K3 text backbone: (a) plus `use_full_rank_gate`, `gate_lower_bound`,
      `mla_use_output_gate`, `q_lora_rank`, `routed_expert_hidden_size` + `latent_moe_use_norm`,
      `hidden_act: situ` with its betas, `attn_res_block_size`; possibly nested under `text_config`.

The parser never silently ignores a field that changes the math: an unsupported value raises
`ConfigError` naming the field. Fields that are pure metadata are ignored. This module knows
nothing of torch, so `k3rt inspect` works from `config.json` alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

LayerType = Literal["kda", "mla"]
MlpType = Literal["dense", "moe"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ConfigError(ValueError):
    """A config.json that k3rt cannot serve exactly; the message names the field."""


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int  # K == V == head_dim for the Kimi family
    conv_kernel_size: int
    gate_lower_bound: float | None  # None: softplus gate; else lb * sigmoid(...) in (lb, 0)
    use_full_rank_gate: bool  # output gate g_proj hidden->H*D (K3) vs low-rank g_a/g_b (Kimi-Linear)

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim

    def conv_state_numel(self, tp: int = 1) -> int:
        """Elements of one sequence's conv state for one layer: last K-1 inputs of q|k|v."""
        return (self.conv_kernel_size - 1) * 3 * self.proj_dim // tp

    def recurrent_state_numel(self, tp: int = 1) -> int:
        return self.num_heads // tp * self.head_dim * self.head_dim


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # NoPE: the "rope" slice is projected, cached and dotted, never rotated
    v_head_dim: int
    use_output_gate: bool  # K3: o_h *= sigmoid(g_proj(x))_h before o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def cache_dim(self) -> int:
        """Width of one cached latent entry: [c (kv_lora_rank) ; k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_token: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int
    routed_scaling_factor: float
    renormalize: bool
    num_expert_group: int
    topk_group: int
    latent_size: int | None = None  # LatentMoE (K3): routed experts run in this width
    latent_norm: bool = False  # RMSNorm on the latent routed output before the up-projection
    # "mxfp4": the routed experts are stored as compressed-tensors mxfp4-pack-quantized (E2M1 + E8M0
    # group-32 scales; kernels/moe/mxfp4_ref.py) and run weight-only; everything else stays dense
    expert_format: Literal["dense", "mxfp4"] = "dense"

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.num_shared_experts

    @property
    def expert_hidden_size(self) -> int | None:
        return self.latent_size


@dataclass(frozen=True)
class ActivationConfig:
    name: Literal["silu", "situ"] = "silu"
    situ_beta: float | None = None  # gate' = b*tanh(gate/b)*sigmoid(gate)
    situ_linear_beta: float | None = None  # up' = bl*tanh(up/bl) when set


@dataclass(frozen=True)
class ModelConfig:
    arch: Literal["kimi_linear", "kimi_k3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: tuple[LayerType, ...]
    mlp_types: tuple[MlpType, ...]
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig | None
    act: ActivationConfig
    attn_res_block_size: int | None = None  # attention residuals (K3) when set
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    dtype: str = "bfloat16"  # the checkpoint's dtype
    # Names of config fields whose effect k3rt ignores on purpose (logged by the loader).
    ignored_fields: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise ConfigError(f"layer_types: has {len(self.layer_types)} entries, num_hidden_layers={n}")
        if len(self.mlp_types) != n:
            raise ConfigError(f"mlp_layer_types: has {len(self.mlp_types)} entries, num_hidden_layers={n}")
        if "moe" in self.mlp_types and self.moe is None:
            raise ConfigError("num_experts: MoE layers requested but no experts configured")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    # ---- memory arithmetic (used by `k3rt inspect` and the page pool) ----

    def kda_state_bytes(self, tp: int = 1, conv_dtype: str = "bfloat16", state_dtype: str = "float32") -> dict[str, int]:
        """Bytes of one sequence's KDA state for ONE layer at tensor-parallel degree `tp`."""
        self.check_tp(tp)
        conv = self.kda.conv_state_numel(tp) * _DTYPE_BYTES[conv_dtype]
        rec = self.kda.recurrent_state_numel(tp) * _DTYPE_BYTES[state_dtype]
        return {"conv": conv, "recurrent": rec, "total": conv + rec}

    def mla_bytes_per_token(self, kv_dtype: str = "bfloat16") -> int:
        """Bytes of latent KV per token for ONE MLA layer (replicated across TP ranks)."""
        return self.mla.cache_dim * _DTYPE_BYTES[kv_dtype]

    def check_tp(self, tp: int) -> None:
        """The attention heads (what the cache layout depends on) split over `tp` ranks."""
        for name, count in (("linear_attn_config.num_heads", self.kda.num_heads), ("num_attention_heads", self.mla.num_heads)):
            if tp < 1 or count % tp:
                raise ConfigError(f"{name}={count} is not divisible by tensor-parallel size {tp}")

    def check_tp_model(self, tp: int, ep: int | bool = 1) -> None:
        """Every dimension the model's layers split over `tp` ranks: heads, vocabulary, MLP widths, and the
        routed experts: split into `ep` groups of whole experts (expert parallelism, `ep_degree`), each
        expert's width over the tp / ep ranks of its group."""
        self.check_tp(tp)
        ep = ep_degree(ep, tp)
        dims = [("vocab_size", self.vocab_size, tp, "tensor-parallel size")]
        if "dense" in self.mlp_types:
            dims.append(("intermediate_size", self.intermediate_size, tp, "tensor-parallel size"))
        if self.moe is not None:
            dims.append(("num_experts", self.moe.num_experts, ep, "expert-parallel size"))
            dims.append(("moe_intermediate_size", self.moe.intermediate_size, tp // ep,
                         f"the {tp // ep} ranks that split each expert (tp {tp} / ep {ep})"))
            if self.moe.num_shared_experts:
                dims.append(("shared expert intermediate size", self.moe.shared_intermediate_size, tp,
                             "tensor-parallel size"))
        for name, count, parts, what in dims:
            if count % parts:
                raise ConfigError(f"{name}={count} is not divisible by {what} {parts}")


def ep_degree(ep: int | bool, tp: int) -> int:
    """The expert-parallel degree: how many groups of whole routed experts the tp ranks hold (1: none, each rank a
    1/tp slice of every expert's width; tp: each rank num_experts/tp whole experts; between: each group's experts
    split by width over its tp/ep ranks). True/False (the old flag) mean tp/1. Raises naming `ep`."""
    if isinstance(ep, bool):
        return tp if ep else 1
    if not isinstance(ep, int) or ep < 1 or tp % ep:
        raise ConfigError(f"ep: the expert-parallel size must be >= 1 and divide tp={tp}, got {ep!r}")
    return ep


# --------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------

# Fields that carry no math for k3rt (metadata, training-only, or handled elsewhere).
_METADATA_FIELDS = frozenset(
    {
        "architectures", "auto_map", "model_type", "transformers_version", "initializer_range", "use_cache",
        "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "pretraining_tp",
        "attention_dropout", "torch_dtype", "dtype", "model_max_length", "max_position_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id", "name_or_path", "_name_or_path", "qk_head_dim",
        "head_dim", "num_key_value_heads", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
        "use_grouped_topk", "topk_method", "mla_use_nope", "moe_router_activation_func", "num_nextn_predict_layers",
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
        "hidden_act", "layer_types", "mlp_layer_types", "linear_attn_config", "linear_num_heads", "linear_head_dim",
        "linear_conv_kernel_dim", "first_k_dense_replace", "moe_layer_freq", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_output_gate", "attention_bias",
        "num_experts", "num_local_experts", "num_experts_per_token", "num_experts_per_tok", "moe_intermediate_size",
        "num_shared_experts", "n_shared_experts", "routed_scaling_factor", "moe_renormalize", "norm_topk_prob",
        "num_expert_group", "n_group", "topk_group", "routed_expert_hidden_size", "latent_moe_use_norm",
        "activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size", "is_decoder",
        "quantization_config", "text_config", "vision_config", "tokenizer_class", "return_dict", "chunk_size_feed_forward",
        "output_hidden_states", "output_attentions", "torchscript", "problem_type", "id2label", "label2id",
        "use_return_dict", "mla_use_rope", "ignore_keys_at_rope_validation",
    }
)

_KDA_KEYS = frozenset(
    {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound",
     "use_full_rank_gate", "num_kv_heads", "head_k_dim"}
)


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    """First present (non-None) value among aliases; transformers renames several fields."""
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _require(cfg: dict[str, Any], *names: str) -> Any:
    v = _get(cfg, *names)
    if v is None:
        raise ConfigError(f"{names[0]}: required field is missing from config.json")
    return v


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[LayerType, ...]:
    lac = cfg.get("linear_attn_config") or {}
    from_lists: tuple[LayerType, ...] | None = None
    if "kda_layers" in lac or "full_attn_layers" in lac:
        kda = list(lac.get("kda_layers") or [])
        full = list(lac.get("full_attn_layers") or [])
        types: list[LayerType | None] = [None] * n
        for name, idxs, t in (("kda_layers", kda, "kda"), ("full_attn_layers", full, "mla")):
            for i in idxs:  # 1-indexed in the published config
                if not isinstance(i, int) or not 1 <= i <= n:
                    raise ConfigError(f"linear_attn_config.{name}: index {i!r} outside 1..num_hidden_layers={n}")
                if types[i - 1] is not None:
                    raise ConfigError(f"linear_attn_config.{name}: layer {i} listed twice")
                types[i - 1] = t  # type: ignore[assignment]
        missing = [i + 1 for i, t in enumerate(types) if t is None]
        if missing:
            raise ConfigError(f"linear_attn_config: layers {missing} are in neither kda_layers nor full_attn_layers")
        from_lists = tuple(types)  # type: ignore[arg-type]
    from_types: tuple[LayerType, ...] | None = None
    if cfg.get("layer_types") is not None:
        names = {"linear_attention": "kda", "full_attention": "mla", "kda": "kda", "mla": "mla"}
        try:
            from_types = tuple(names[t] for t in cfg["layer_types"])  # type: ignore[misc]
        except KeyError as e:
            raise ConfigError(f"layer_types: unsupported layer type {e.args[0]!r} (expected linear_attention|full_attention)")
    if from_lists and from_types and from_lists != from_types:
        raise ConfigError("layer_types: disagrees with linear_attn_config.kda_layers/full_attn_layers")
    if from_lists or from_types:
        return from_lists or from_types  # type: ignore[return-value]
    # transformers' own fallback pattern differs from the published one; never guess.
    raise ConfigError("linear_attn_config.kda_layers: no layer pattern (need kda_layers/full_attn_layers or layer_types)")


def _mlp_types(cfg: dict[str, Any], n: int, has_experts: bool) -> tuple[MlpType, ...]:
    if cfg.get("mlp_layer_types") is not None:
        names = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        try:
            return tuple(names[t] for t in cfg["mlp_layer_types"])  # type: ignore[misc]
        except KeyError as e:
            raise ConfigError(f"mlp_layer_types: unsupported MLP type {e.args[0]!r} (expected dense|sparse)")
    if not has_experts:
        return ("dense",) * n
    first_dense = int(_get(cfg, "first_k_dense_replace", default=0))
    freq = int(_get(cfg, "moe_layer_freq", default=1))
    if freq < 1:
        raise ConfigError(f"moe_layer_freq: must be >= 1, got {freq}")
    return tuple("moe" if i >= first_dense and i % freq == 0 else "dense" for i in range(n))


def _eos(cfg: dict[str, Any]) -> tuple[int, ...]:
    e = cfg.get("eos_token_id")
    if e is None:
        return ()
    return tuple(e) if isinstance(e, list) else (int(e),)


def _expert_format(quant: Any, unsupported: list[str]) -> Literal["dense", "mxfp4"]:
    """The routed experts' storage from `quantization_config`: none -> dense; compressed-tensors
    `mxfp4-pack-quantized` 4-bit float weights in groups of 32 (K3's published format) -> mxfp4, run
    weight-only (activations stay bf16, as vLLM runs it on Hopper). Anything else is refused, named."""
    if quant is None:
        return "dense"
    if not isinstance(quant, dict):
        unsupported.append("quantization_config: expected an object")
        return "dense"
    method = quant.get("quant_method")
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    formats.discard(None)
    if method != "compressed-tensors" or formats != {"mxfp4-pack-quantized"}:
        unsupported.append(f"quantization_config: quant_method {method!r} with format {sorted(formats)} is not "
                           "supported; k3rt loads dense checkpoints and compressed-tensors 'mxfp4-pack-quantized' "
                           "routed experts")
        return "dense"
    for name, g in groups.items():
        w = (g or {}).get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 32):
            unsupported.append(f"quantization_config.config_groups.{name}.weights: expected num_bits 4, type "
                               f"'float', group_size 32 (MXFP4), got {w.get('num_bits')}, {w.get('type')!r}, "
                               f"{w.get('group_size')}")
    return "mxfp4"


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Parse a config.json dict (any of the three dialects) into a ModelConfig."""
    outer = raw
    if raw.get("text_config") is not None:
        # multimodal K3 wrapper: the text backbone lives under text_config
        raw = {**raw["text_config"]}
        for k in ("tie_word_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id"):
            if k in outer and k not in raw:
                raw[k] = outer[k]
    names = [str(outer.get("model_type", "")), str(raw.get("model_type", ""))]
    names += [str(a) for a in (outer.get("architectures") or []) + (raw.get("architectures") or [])]
    if not any(n in ("kimi_linear", "KimiLinearForCausalLM") or "kimi_k3" in n.lower() or "KimiK3" in n for n in names):
        raise ConfigError(
            f"architectures: unknown architecture {[n for n in names if n]!r}; "
            "supported: KimiLinearForCausalLM (model_type kimi_linear) and the Kimi-K3 text backbone"
        )
    lac = raw.get("linear_attn_config") or {}
    # K3 configs may say model_type "kimi_linear" in text_config: detect K3 by its features.
    is_k3 = any(n for n in names if "k3" in n.lower()) or any(
        raw.get(k) for k in ("attn_res_block_size", "routed_expert_hidden_size", "mla_use_output_gate")
    ) or bool(lac.get("use_full_rank_gate")) or raw.get("hidden_act") == "situ"

    unsupported: list[str] = []
    quant = raw.get("quantization_config", outer.get("quantization_config"))
    expert_format = _expert_format(quant, unsupported)
    if raw.get("mla_use_nope") is False:
        unsupported.append("mla_use_nope: false (RoPE MLA) is not supported; Kimi MLA is NoPE")
    act_fn = raw.get("moe_router_activation_func", "sigmoid")
    if act_fn != "sigmoid":
        unsupported.append(f"moe_router_activation_func: {act_fn!r} not supported (only 'sigmoid')")
    topk_method = raw.get("topk_method", "noaux_tc")
    if topk_method not in ("noaux_tc", None):
        unsupported.append(f"topk_method: {topk_method!r} not supported (only 'noaux_tc')")
    if raw.get("attention_bias"):
        unsupported.append("attention_bias: true is not supported (Kimi projections have no bias)")
    for k in lac:
        if k not in _KDA_KEYS:
            unsupported.append(f"linear_attn_config.{k}: unknown KDA field")
    if lac.get("num_kv_heads") not in (None, lac.get("num_heads")) or lac.get("head_k_dim") not in (None, lac.get("head_dim")):
        unsupported.append("linear_attn_config.num_kv_heads: KDA with separate key heads/dims is not supported")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act not in ("silu", "situ"):
        unsupported.append(f"hidden_act: {hidden_act!r} not supported (silu or situ)")
    # Fields k3rt does not know are reported (ModelConfig.ignored_fields, logged at load), not fatal:
    # real configs carry assorted bookkeeping keys. Known math fields are validated above and below.
    unknown = sorted(k for k in raw if k not in _METADATA_FIELDS and not k.startswith("_"))
    if unsupported:
        raise ConfigError("; ".join(unsupported))

    n = int(_require(raw, "num_hidden_layers"))
    num_experts = _get(raw, "num_experts", "num_local_experts", "n_routed_experts")
    has_experts = bool(num_experts)
    layer_types = _layer_types(raw, n)
    mlp_types = _mlp_types(raw, n, has_experts)

    kda = KDAConfig(
        num_heads=int(_get(lac, "num_heads", default=_get(raw, "linear_num_heads", default=0)) or 0),
        head_dim=int(_get(lac, "head_dim", default=_get(raw, "linear_head_dim", default=0)) or 0),
        conv_kernel_size=int(_get(lac, "short_conv_kernel_size", default=_get(raw, "linear_conv_kernel_dim", default=4))),
        gate_lower_bound=None if lac.get("gate_lower_bound") is None else float(lac["gate_lower_bound"]),
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
    )
    if "kda" in layer_types and (kda.num_heads <= 0 or kda.head_dim <= 0):
        raise ConfigError("linear_attn_config.num_heads: KDA layers need num_heads and head_dim")
    if kda.gate_lower_bound is not None and not -5.0 <= kda.gate_lower_bound < 0.0:
        raise ConfigError(f"linear_attn_config.gate_lower_bound: {kda.gate_lower_bound} outside [-5, 0)")
    if kda.conv_kernel_size < 1:
        raise ConfigError(f"linear_attn_config.short_conv_kernel_size: must be >= 1, got {kda.conv_kernel_size}")

    mla = MLAConfig(
        num_heads=int(_require(raw, "num_attention_heads")),
        q_lora_rank=_get(raw, "q_lora_rank"),
        kv_lora_rank=int(_get(raw, "kv_lora_rank", default=512)),
        qk_nope_head_dim=int(_get(raw, "qk_nope_head_dim", default=128)),
        qk_rope_head_dim=int(_get(raw, "qk_rope_head_dim", default=64)),
        v_head_dim=int(_get(raw, "v_head_dim", default=128)),
        use_output_gate=bool(raw.get("mla_use_output_gate", False)),
    )

    moe = None
    if has_experts:
        latent = _get(raw, "routed_expert_hidden_size")
        moe = MoEConfig(
            num_experts=int(num_experts),
            num_experts_per_token=int(_require(raw, "num_experts_per_token", "num_experts_per_tok")),
            intermediate_size=int(_require(raw, "moe_intermediate_size")),
            num_shared_experts=int(_get(raw, "num_shared_experts", "n_shared_experts", default=0)),
            routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
            renormalize=bool(_get(raw, "moe_renormalize", "norm_topk_prob", default=True)),
            num_expert_group=int(_get(raw, "num_expert_group", "n_group", default=1)),
            topk_group=int(_get(raw, "topk_group", default=1)),
            latent_size=None if latent is None else int(latent),
            latent_norm=bool(raw.get("latent_moe_use_norm", False)),
            expert_format=expert_format,
        )
        if expert_format == "mxfp4":
            width = moe.latent_size or int(_require(raw, "hidden_size"))
            for name, v in (("moe_intermediate_size", moe.intermediate_size),
                            ("routed_expert_hidden_size" if moe.latent_size else "hidden_size", width)):
                if v % 32:
                    raise ConfigError(f"{name}: {v} is not a multiple of 32, the MXFP4 group size of the routed experts")
        if moe.num_experts % moe.num_expert_group:
            raise ConfigError(f"num_expert_group: {moe.num_expert_group} does not divide num_experts={moe.num_experts}")
        if not 1 <= moe.topk_group <= moe.num_expert_group:
            raise ConfigError(f"topk_group: {moe.topk_group} outside 1..num_expert_group={moe.num_expert_group}")
        if not 1 <= moe.num_experts_per_token <= moe.num_experts:
            raise ConfigError(f"num_experts_per_token: {moe.num_experts_per_token} outside 1..num_experts={moe.num_experts}")
        per_group = moe.num_experts // moe.num_expert_group
        if moe.num_expert_group > 1 and per_group < 2:
            raise ConfigError("num_expert_group: grouped top-k scores groups by their top-2 experts; need >= 2 per group")
        if moe.latent_norm and moe.latent_size is None:
            raise ConfigError("latent_moe_use_norm: set without routed_expert_hidden_size")

    if hidden_act == "situ":
        beta = raw.get("activation_situ_beta")
        if beta is None or float(beta) <= 0:
            raise ConfigError("activation_situ_beta: hidden_act 'situ' needs a positive beta")
        lin = raw.get("activation_situ_linear_beta")
        act = ActivationConfig("situ", float(beta), None if lin is None else float(lin))
    else:
        for k in ("activation_situ_beta", "activation_situ_linear_beta"):
            if raw.get(k) is not None:
                raise ConfigError(f"{k}: set but hidden_act is {hidden_act!r}")
        act = ActivationConfig("silu")

    block = raw.get("attn_res_block_size")
    if block is not None and int(block) < 1:
        raise ConfigError(f"attn_res_block_size: must be >= 1, got {block}")

    dtype = str(_get(raw, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
    if dtype not in _DTYPE_BYTES:
        raise ConfigError(f"torch_dtype: {dtype!r} not supported (bfloat16, float16, float32)")
    ignored = tuple(k for k in ("num_nextn_predict_layers", "rope_theta", "rope_scaling") if raw.get(k)) + tuple(unknown)
    return ModelConfig(
        arch="kimi_k3" if is_k3 else "kimi_linear",
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=int(_require(raw, "hidden_size")),
        intermediate_size=int(_get(raw, "intermediate_size", default=0)),
        num_hidden_layers=n,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(_get(raw, "tie_word_embeddings", default=False)),
        layer_types=layer_types,
        mlp_types=mlp_types,
        kda=kda,
        mla=mla,
        moe=moe,
        act=act,
        attn_res_block_size=None if block is None else int(block),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos(raw),
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=int(_get(raw, "model_max_length", "max_position_embeddings", default=1 << 20)),
        dtype=dtype,
        ignored_fields=ignored,
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """config.json of a checkpoint folder, a shipped model's name (k3rt/models/), or a config-only
    preset name (k3rt/presets.py)."""
    from k3rt.models import resolve_model_dir
    from k3rt.presets import PRESETS

    if str(model_dir) in PRESETS and not Path(model_dir).is_dir():
        return parse_model_config(PRESETS[str(model_dir)])
    model_dir = resolve_model_dir(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"config.json: not found in {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.json: invalid JSON in {path}: {e}") from e
    return parse_model_config(raw)


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by kind, from the config alone (matches the modules k3rt builds)."""
    h, kda, mla = cfg.hidden_size, cfg.kda, cfg.mla
    p = kda.proj_dim
    kda_params = (
        3 * h * p + 3 * p * kda.conv_kernel_size + h * kda.head_dim + kda.head_dim * p + kda.num_heads + p
        + h * kda.num_heads + (h * p if kda.use_full_rank_gate else h * kda.head_dim + kda.head_dim * p)
        + kda.head_dim + p * h
    )
    q = h * mla.num_heads * mla.qk_head_dim if mla.q_lora_rank is None else (
        h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * mla.num_heads * mla.qk_head_dim
    )
    mla_params = (
        q + h * mla.cache_dim + mla.kv_lora_rank + mla.kv_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        + mla.num_heads * mla.v_head_dim * h + (h * mla.num_heads * mla.v_head_dim if mla.use_output_gate else 0)
    )
    dense = 3 * h * cfg.intermediate_size
    moe_total = moe_active = 0
    if cfg.moe is not None:
        m = cfg.moe
        eh = m.latent_size or h
        expert = 3 * eh * m.intermediate_size
        shared = 3 * h * m.shared_intermediate_size
        extra = (2 * h * m.latent_size + (m.latent_size if m.latent_norm else 0)) if m.latent_size else 0
        router = m.num_experts * h + m.num_experts
        moe_total = m.num_experts * expert + shared + extra + router
        moe_active = m.num_experts_per_token * expert + shared + extra + router
    res = 2 * 2 * h if cfg.attn_res_block_size else 0  # res_norm + res_proj, for attn and mlp
    norms = 2 * h + res
    total = active = 0
    for lt, mt in zip(cfg.layer_types, cfg.mlp_types):
        mixer = kda_params if lt == "kda" else mla_params
        ffn_t, ffn_a = (dense, dense) if mt == "dense" else (moe_total, moe_active)
        total += mixer + ffn_t + norms
        active += mixer + ffn_a + norms
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else embed
    final = h + (2 * h if cfg.attn_res_block_size else 0)
    return {"total": total + embed + head + final, "active_per_token": active + embed + head + final, "embedding": embed}


def align_up(x: int, a: int) -> int:
    return a * math.ceil(x / a)
