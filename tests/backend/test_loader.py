"""The checkpoint loader: every malformed checkpoint raises a typed error whose message names the
problem, and every accepted spelling of a checkpoint loads to exactly the same weights.

Checkpoints are tiny random models (backend/models/tiny.py) written in the published Kimi format,
then edited here: tensors removed, added, reshaped, renamed to transformers-5 names, cast, sharded,
prefixed, or the file bytes truncated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import CheckpointError, build_model, load_model
from k3rt.backend.models.tiny import TINY_CONFIGS, export_checkpoint, random_init, write_checkpoint
from k3rt.model_config import ConfigError, parse_model_config
from tests.backend.threads import single_thread  # noqa: F401  (autouse fixture)

ARCHS = list(TINY_CONFIGS)


def tiny(arch: str = "kimi_linear", seed: int = 0, **overrides) -> tuple[KimiForCausalLM, dict]:
    raw = {**TINY_CONFIGS[arch], **overrides}
    model = build_model(parse_model_config(raw), dtype=torch.float32)
    random_init(model, seed)
    return model, raw


def save(out: Path, tensors: dict[str, torch.Tensor], raw: dict, dtype: str = "float32") -> Path:
    """A single-file checkpoint holding exactly `tensors` (no renaming, no casting)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**raw, "torch_dtype": dtype}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load(path: Path, **kw) -> KimiForCausalLM:
    return load_model(path, progress=False, **kw)


def assert_same_weights(loaded: KimiForCausalLM, model: KimiForCausalLM) -> None:
    got = dict(loaded.named_parameters())
    want = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert got[name].dtype == p.dtype, name
        assert torch.equal(got[name], p), name


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

MISSING = {
    # removed checkpoint tensor -> the k3rt parameter the message must name
    "q_proj": ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    "one_conv_of_three": ("model.layers.0.self_attn.k_conv1d.weight", "model.layers.0.self_attn.conv_weight"),
    "one_expert_w3": ("model.layers.2.block_sparse_moe.experts.5.w3.weight", "model.layers.2.mlp.w13"),
    "router_bias": ("model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                    "model.layers.1.mlp.e_score_correction_bias"),
    "final_norm": ("model.norm.weight", "model.norm.weight"),
    "lm_head": ("lm_head.weight", "lm_head.weight"),
}


@pytest.mark.parametrize("case", list(MISSING))
def test_missing_tensor(case: str, tmp_path: Path) -> None:
    model, raw = tiny()
    tensors = export_checkpoint(model)
    removed, param = MISSING[case]
    del tensors[removed]
    save(tmp_path, tensors, raw)
    with pytest.raises(CheckpointError, match="missing") as e:
        load(tmp_path)
    assert param in str(e.value)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.bogus.weight", "model.extra_head.weight",
                                   "model.layers.3.self_attn.q_conv1d.weight"],
                         ids=["unknown_in_layer", "unknown_top_level", "kda_tensor_on_mla_layer"])
def test_unexpected_tensor(extra: str, tmp_path: Path) -> None:
    model, raw = tiny()
    tensors = export_checkpoint(model)
    tensors[extra] = torch.zeros(16, 1, 4)
    save(tmp_path, tensors, raw)
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load(tmp_path)
    assert extra in str(e.value)


WRONG_SHAPE = {
    "transposed_o_proj": ("model.layers.0.self_attn.o_proj.weight", lambda t: torch.zeros(64, 65)),
    "short_embedding": ("model.embed_tokens.weight", lambda t: t[:-1]),
    "expert_w2": ("model.layers.1.block_sparse_moe.experts.0.w2.weight", lambda t: t.t()),
    "conv_width_3": ("model.layers.0.self_attn.q_conv1d.weight", lambda t: t[..., :3]),
    "A_log_extra_head": ("model.layers.0.self_attn.A_log", lambda t: torch.zeros(5)),
}


@pytest.mark.parametrize("case", list(WRONG_SHAPE))
def test_wrong_shape(case: str, tmp_path: Path) -> None:
    model, raw = tiny()
    tensors = export_checkpoint(model)
    name, edit = WRONG_SHAPE[case]
    tensors[name] = edit(tensors[name]).contiguous()
    save(tmp_path, tensors, raw)
    with pytest.raises(CheckpointError, match="shape") as e:
        load(tmp_path)
    assert name in str(e.value)
    assert str(tuple(tensors[name].shape)) in str(e.value)


@pytest.mark.parametrize("keep", ["4_bytes", "100_bytes", "half", "all_but_last_byte"])
def test_truncated_file(keep: str, tmp_path: Path) -> None:
    model, raw = tiny()
    write_checkpoint(model, tmp_path, raw, dtype="float32")
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    size = {"4_bytes": 4, "100_bytes": 100, "half": len(data) // 2, "all_but_last_byte": len(data) - 1}[keep]
    f.write_bytes(data[:size])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(tmp_path)


def test_truncated_shard_is_named(tmp_path: Path) -> None:
    model, raw = tiny()
    write_checkpoint(model, tmp_path, raw, dtype="float32", max_shard_bytes=200_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3
    victim = shards[1]
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as e:
        load(tmp_path)
    assert victim.name in str(e.value)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    model, raw = tiny()
    write_checkpoint(model, tmp_path, raw, dtype="float32", max_shard_bytes=200_000)
    gone = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=re.escape(gone.name)):
        load(tmp_path)


def test_no_weights_and_no_config(tmp_path: Path) -> None:
    _, raw = tiny()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="safetensors"):
        load(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load(tmp_path)


def test_unknown_architecture(tmp_path: Path) -> None:
    model, raw = tiny()
    raw = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    save(tmp_path, export_checkpoint(model), raw)
    with pytest.raises(ConfigError, match="architectures") as e:
        load(tmp_path)
    assert "LlamaForCausalLM" in str(e.value)


UNSUPPORTED = {
    "softmax_router": ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    "rope_mla": ({"mla_use_nope": False}, "mla_use_nope"),
    # MXFP4 experts load since issue 17 (tests/backend/test_mxfp4_model.py); other schemes stay refused
    "quantized": ({"quantization_config": {"quant_method": "fp8", "format": "float-quantized"}}, "quantization_config"),
    "greedy_topk": ({"topk_method": "greedy"}, "topk_method"),
    "attention_bias": ({"attention_bias": True}, "attention_bias"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_config_field(case: str, tmp_path: Path) -> None:
    model, raw = tiny()
    overrides, field = UNSUPPORTED[case]
    save(tmp_path, export_checkpoint(model), {**raw, **overrides})
    with pytest.raises(ConfigError, match=field):
        load(tmp_path)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    model, raw = tiny()
    write_checkpoint(model, tmp_path, raw, dtype="float32", max_shard_bytes=200_000)
    first, last = sorted(tmp_path.glob("model-*.safetensors"))[0], sorted(tmp_path.glob("model-*.safetensors"))[-1]
    a, b = read_all(first), read_all(last)
    dup = sorted(b)[0]
    assert dup not in a
    save_file({**a, dup: b[dup]}, str(first), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="duplicate") as e:
        load(tmp_path)
    assert dup in str(e.value)


def test_duplicate_via_two_spellings(tmp_path: Path) -> None:
    """The published per-expert tensors and the transformers-5 stacked tensor both fill layer 1's experts."""
    model, raw = tiny()
    tensors = export_checkpoint(model)
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = model.model.layers[1].mlp.w13.detach().clone()
    save(tmp_path, tensors, raw)
    with pytest.raises(CheckpointError, match="duplicate") as e:
        load(tmp_path)
    assert "model.layers.1" in str(e.value)


def test_k3_a_log_padding_must_be_zero(tmp_path: Path) -> None:
    model, raw = tiny("k3")
    tensors = export_checkpoint(model)
    name = "model.layers.0.self_attn.A_log"
    tensors[name] = torch.cat([tensors[name].flatten(), torch.full((12,), 0.5)])  # [head_dim], non-zero tail
    save(tmp_path, tensors, raw)
    with pytest.raises(CheckpointError, match="A_log"):
        load(tmp_path)


# ------------------------------------------------------------------------------------------------
# accepted forms
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_single_file_round_trip(arch: str, tmp_path: Path) -> None:
    model, raw = tiny(arch)
    write_checkpoint(model, tmp_path, raw, dtype="float32")
    loaded = load(tmp_path)
    assert_same_weights(loaded, model)
    ids = torch.arange(0, 300, 7)
    assert torch.equal(loaded(ids, ForwardBatch([ids.numel()])), model(ids, ForwardBatch([ids.numel()])))


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint_with_index(arch: str, tmp_path: Path) -> None:
    model, raw = tiny(arch)
    write_checkpoint(model, tmp_path, raw, dtype="float32", max_shard_bytes=150_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert_same_weights(load(tmp_path), model)


def to_transformers_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published names -> the names transformers >= 5 uses in memory (stacked experts, merged conv,
    `forget_gate.`, `mlp.` for the MoE block), as in its kimi_linear conversion mapping."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if not m:
            out[name] = t
            continue
        i, rest = m.groups()
        rest = rest.replace("block_sparse_moe.", "mlp.")
        if e := re.match(r"mlp\.experts\.(\d+)\.(w[123])\.weight$", rest):
            experts.setdefault(i, {}).setdefault(int(e[1]), {})[e[2]] = t
        elif c := re.match(r"self_attn\.([qkv])_conv1d\.weight$", rest):
            convs.setdefault(i, {})[c[1]] = t
        else:
            for p in ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log"):
                rest = rest.replace(f"self_attn.{p}", f"self_attn.forget_gate.{p}")
            out[f"model.layers.{i}.{rest}"] = t
    for i, ex in experts.items():
        order = range(len(ex))
        gate_up = [torch.cat([ex[e]["w1"], ex[e]["w3"]]) for e in order]  # [2I, H] = [gate ; up]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([ex[e]["w2"] for e in order])
    for i, c in convs.items():
        out[f"model.layers.{i}.self_attn.conv1d.weight"] = torch.cat([c["q"], c["k"], c["v"]])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers5_names_load_identically(arch: str, tmp_path: Path) -> None:
    model, raw = tiny(arch)
    hf = to_transformers_names(export_checkpoint(model))
    cfg = model.cfg
    E, I, H = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.moe.latent_size or cfg.hidden_size
    assert hf["model.layers.1.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    assert hf["model.layers.1.mlp.experts.down_proj"].shape == (E, H, I)
    assert hf["model.layers.0.self_attn.conv1d.weight"].shape == (3 * cfg.kda.proj_dim, 1, 4)
    assert "model.layers.0.self_attn.forget_gate.dt_bias" in hf
    assert not any(re.search(r"block_sparse_moe|\.w[123]\.|_conv1d|self_attn\.f_a_proj", k) for k in hf)
    assert_same_weights(load(save(tmp_path, hf, raw)), model)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_casts(dtype: str, tmp_path: Path) -> None:
    model, raw = tiny("k3")
    write_checkpoint(model, tmp_path, raw, dtype=dtype)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    stored = read_all(tmp_path / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == tdt
    assert stored["model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32  # published fp32 tensors
    assert stored["model.layers.0.self_attn.A_log"].dtype == torch.float32

    # parameters that the published checkpoints keep in fp32 (and k3rt keeps in fp32 or the model dtype)
    fp32_in_file = ("A_log", "dt_bias", "conv_weight", "e_score_correction_bias", "o_norm_weight")
    for as_dtype, want_model in ((None, tdt), ("float32", torch.float32)):
        loaded = load(tmp_path, dtype=as_dtype)
        got = dict(loaded.named_parameters())
        assert got["model.embed_tokens.weight"].dtype == want_model
        assert got["model.layers.0.self_attn.conv_weight"].dtype == torch.float32
        assert got["model.layers.1.mlp.gate_weight"].dtype == torch.float32
        for name, p in model.named_parameters():
            file_dtype = torch.float32 if name.endswith(fp32_in_file) else tdt
            want = p.detach().to(file_dtype).to(got[name].dtype)
            assert torch.equal(got[name], want), name
        # the cast really happened: bf16/fp16 rounding changed the weights
        assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"].float(),
                               model.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("short_layers", [False, True], ids=["language_model.model.layers", "language_model.layers"])
def test_multimodal_k3_wrapper_with_language_model_prefix(short_layers: bool, tmp_path: Path) -> None:
    model, text = tiny("k3")
    raw = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
           "vision_config": {"model_type": "moonvit"}, "media_placeholder_token_id": 163605}
    tensors = {f"language_model.{k}": v for k, v in export_checkpoint(model).items()}
    if short_layers:  # vLLM and SGLang also accept `language_model.layers.N` for the decoder layers
        tensors = {k.replace("language_model.model.layers.", "language_model.layers."): v for k, v in tensors.items()}
        assert "language_model.layers.0.input_layernorm.weight" in tensors
    # vision tower, projector, rotary buffers and an MTP layer are not part of the text model
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(8, 4)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
    tensors["language_model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    tensors["language_model.model.layers.4.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    loaded = load(save(tmp_path, tensors, raw))
    assert loaded.cfg.arch == "kimi_k3"
    assert_same_weights(loaded, model)


def test_k3_a_log_zero_padded_to_head_dim(tmp_path: Path) -> None:
    model, raw = tiny("k3")
    H, D = model.cfg.kda.num_heads, model.cfg.kda.head_dim
    assert H < D
    tensors = export_checkpoint(model)
    for i in model.cfg.kda_layers:
        name = f"model.layers.{i}.self_attn.A_log"
        tensors[name] = torch.cat([tensors[name].flatten(), torch.zeros(D - H)])
        assert tensors[name].shape == (D,)
    assert_same_weights(load(save(tmp_path, tensors, raw)), model)


def test_a_log_as_flat_heads(tmp_path: Path) -> None:
    model, raw = tiny("kimi_linear")
    tensors = export_checkpoint(model)
    assert tensors["model.layers.0.self_attn.A_log"].shape == (1, 1, 4, 1)  # the original checkpoint layout
    for i in model.cfg.kda_layers:
        tensors[f"model.layers.{i}.self_attn.A_log"] = tensors[f"model.layers.{i}.self_attn.A_log"].flatten()
    assert_same_weights(load(save(tmp_path, tensors, raw)), model)


@pytest.mark.parametrize("with_head", [False, True], ids=["no_lm_head", "stray_lm_head"])
def test_tied_embeddings(with_head: bool, tmp_path: Path) -> None:
    model, raw = tiny("kimi_linear", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tensors = export_checkpoint(model)
    assert "lm_head.weight" not in tensors
    if with_head:  # some tied checkpoints still ship a head; the embedding is the source of truth
        tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    loaded = load(save(tmp_path, tensors, raw))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(loaded(ids, ForwardBatch([5])), model(ids, ForwardBatch([5])))
