"""Build a model from a checkpoint folder: config.json + safetensors (one file or a sharded index).

Accepts the published Kimi tensor names and the transformers >= 5 names (stacked experts, merged
convs, `forget_gate.` prefix), and the `language_model.` prefix of multimodal K3 checkpoints.
Every parameter must be written exactly once: missing, unexpected, duplicate or wrong-shape tensors
and unreadable files raise `CheckpointError` naming the tensor or the file. Never a silent random init.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from k3rt.backend.distributed import SINGLE, TPContext
from k3rt.backend.layers.linear import ShardSpec
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.model_config import ModelConfig, load_model_config
from k3rt.models import resolve_model_dir

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the tensor or file."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, optionally one expert row and/or one merged part."""

    param: str
    expert: int | None = None
    part: int | None = None


_NOT_TEXT_MODEL = ("vision_tower.", "mm_projector.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3)\.(weight|weight_packed|weight_scale|weight_shape)$")
# an expert tensor's suffix -> the suffix of k3rt's stack (compressed-tensors MXFP4: packed codes + scales)
_EXPERT_STACK = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}
# per-layer renames: checkpoint suffix -> (k3rt suffix, part)
_RENAMES: dict[str, tuple[str, int | None]] = {
    "self_attn.q_conv1d.weight": ("self_attn.conv_weight", 0),
    "self_attn.k_conv1d.weight": ("self_attn.conv_weight", 1),
    "self_attn.v_conv1d.weight": ("self_attn.conv_weight", 2),
    "self_attn.conv1d.weight": ("self_attn.conv_weight", None),
    "self_attn.o_norm.weight": ("self_attn.o_norm_weight", None),
    "mlp.gate.weight": ("mlp.gate_weight", None),
    "mlp.gate.e_score_correction_bias": ("mlp.e_score_correction_bias", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 0),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 1),
    "mlp.experts.gate_up_proj": ("mlp.w13", None),  # transformers >= 5: [E, 2I, H]
    "mlp.experts.down_proj": ("mlp.w2", None),  # transformers >= 5: [E, H, I]
    "mlp.routed_expert_norm.weight": ("mlp.routed_expert_norm", None),
}


def resolve(name: str, cfg: ModelConfig) -> Target | None:
    """Map a checkpoint tensor name to its k3rt target; None for tensors k3rt deliberately skips."""
    if name.startswith(_NOT_TEXT_MODEL) or "rotary_emb." in name:
        return None  # multimodal K3: the vision tower and projector; rotary buffers (Kimi MLA is NoPE)
    for prefix in ("language_model.", "model.language_model."):
        if name.startswith(prefix):
            name = name[len(prefix):] if prefix == "language_model." else "model." + name[len(prefix):]
            if name.startswith("layers."):  # `language_model.layers.N` spelling (vLLM/SGLang accept it)
                name = "model." + name
    m = _LAYER.match(name)
    if not m:
        return Target(name)
    idx, rest = int(m.group(1)), m.group(2)
    if idx >= cfg.num_hidden_layers:
        return None  # multi-token-prediction (nextn) layers: a draft head, not part of the main model
    if rest.startswith("block_sparse_moe."):
        rest = "mlp." + rest[len("block_sparse_moe."):]
    rest = rest.replace("self_attn.forget_gate.", "self_attn.")
    pre = f"model.layers.{idx}."
    e = _EXPERT.match(rest)
    if e:
        which, kind = e.group(2), e.group(3)
        if kind == "weight_shape":
            return None  # compressed-tensors bookkeeping: the unpacked shape, implied by the config
        stack = ("mlp.w2" if which == "w2" else "mlp.w13") + _EXPERT_STACK[kind]
        return Target(pre + stack, int(e.group(1)), {"w1": 0, "w3": 1}.get(which))
    if rest in _RENAMES:
        new, part = _RENAMES[rest]
        return Target(pre + new, None, part)
    return Target(pre + rest)


def _full_slot_shape(param: nn.Parameter, t: Target, tp: TPContext) -> tuple[int, ...]:
    """The checkpoint (unsharded) shape expected for target t of this parameter."""
    spec: ShardSpec = getattr(param, "shard_spec", ShardSpec())
    shape = list(param.shape)
    if spec.split_dim is not None:
        if spec.parts:
            shape[spec.split_dim] = spec.parts[t.part] if t.part is not None else sum(spec.parts)
        else:
            shape[spec.split_dim] *= tp.size
    if t.expert is not None:
        shape = shape[1:]
    return tuple(shape)


def _copy_into(param: nn.Parameter, t: Target, src: torch.Tensor, tp: TPContext) -> None:
    spec: ShardSpec = getattr(param, "shard_spec", ShardSpec())
    dst = param.data if t.expert is None else param.data[t.expert]
    d = spec.split_dim if spec.split_dim is None or t.expert is None else spec.split_dim - 1
    if d is None:
        dst.copy_(src)
        return
    if not spec.parts:
        local = dst.shape[d]
        dst.copy_(src.narrow(d, tp.rank * local, local))
        return
    parts = range(len(spec.parts)) if t.part is None else [t.part]
    for p in parts:
        full_off = 0 if t.part is not None else sum(spec.parts[:p])
        local = spec.parts[p] // tp.size
        local_off = sum(q // tp.size for q in spec.parts[:p])
        dst.narrow(d, local_off, local).copy_(src.narrow(d, full_off + tp.rank * local, local))


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index.name}: unreadable index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f.name}: listed in {index.name} but missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"*.safetensors: no weights in {model_dir}")
    return files


def load_weights(model: KimiForCausalLM, model_dir: Path, *, tp: TPContext = SINGLE, progress: bool = True) -> None:
    from safetensors import safe_open
    from tqdm import tqdm

    cfg = model.cfg
    params = dict(model.named_parameters(remove_duplicate=True))
    tied = cfg.tie_word_embeddings
    # coverage[param] = set of (expert, part) slots written; None entries mean "all"
    coverage: dict[str, set[tuple[int | None, int | None]]] = {k: set() for k in params}
    handles = []
    for f in checkpoint_files(model_dir):
        try:
            handles.append((f, safe_open(str(f), framework="pt")))
        except Exception as e:  # safetensors raises its own error types for truncated headers
            raise CheckpointError(f"{f.name}: cannot read safetensors file ({e})") from e
    total = sum(len(h.keys()) for _, h in handles)
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    for f, h in handles:
        for name in h.keys():
            bar.update(1)
            t = resolve(name, cfg)
            if t is None:
                continue
            if tied and t.param == "lm_head.weight":
                continue  # tied head: the embedding is the source of truth
            if t.param not in params:
                raise CheckpointError(f"{name}: unexpected tensor (no such parameter {t.param!r}) in {f.name}")
            param = params[t.param]
            # expert parallelism: this rank's stack holds experts offset..offset+local-1, each split by width over
            # the ranks of its group (expert_tp; one rank when the experts are whole)
            offset, local, total = getattr(param, "expert_range", (0, 0, 0))
            by_expert = local != total
            if by_expert and t.expert is not None:
                if not offset <= t.expert < offset + local:
                    continue  # another rank's expert (not even read)
                t = replace(t, expert=t.expert - offset)
            ptp = getattr(param, "expert_tp", tp)
            try:
                src = h.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{name}: cannot read from {f.name}, file truncated or corrupt ({e})") from e
            if by_expert and t.expert is None:  # all experts stacked in one tensor
                if src.shape[0] != total:
                    raise CheckpointError(f"{name}: {src.shape[0]} experts but the model has {total} (in {f.name})")
                src = src.narrow(0, offset, local)
            want = _full_slot_shape(param, t, ptp)
            if t.param.endswith(".A_log") and src.dim() == 1 and src.numel() == cfg.kda.head_dim > math.prod(want):
                # K3 stores A_log zero-padded to head_dim entries, heads first; a non-zero tail means
                # some other layout (e.g. per-channel), which must not be silently truncated
                if src[math.prod(want):].any():
                    raise CheckpointError(f"{name}: A_log of shape {tuple(src.shape)} has non-zero entries past "
                                          f"num_heads={math.prod(want)} (expected zero padding, in {f.name})")
                src = src[: math.prod(want)]
            if tuple(src.shape) != want:
                # checkpoints store some tensors with singleton dims (A_log [1,1,H,1], conv [C,1,W])
                squeezed = tuple(s for s in src.shape if s != 1)
                if squeezed != tuple(s for s in want if s != 1) or math.prod(src.shape) != math.prod(want):
                    raise CheckpointError(f"{name}: shape {tuple(src.shape)} but the model expects {want} (in {f.name})")
                src = src.reshape(want)
            slots = _slots(param, t)
            seen = coverage[t.param]
            if seen & slots:
                raise CheckpointError(f"{name}: duplicate tensor, {t.param} already loaded (in {f.name})")
            seen |= slots
            if (src.dtype == torch.uint8) != (param.dtype == torch.uint8):
                raise CheckpointError(f"{name}: dtype {src.dtype} cannot load into {t.param} ({param.dtype}); "
                                      f"quantized tensors go with a quantization_config (in {f.name})")
            _copy_into(param, t, src.to(param.dtype), ptp)
    bar.close()
    missing = [k for k, v in coverage.items() if v != _slots(params[k], Target(k))]
    if missing:
        raise CheckpointError(f"missing tensors for parameters: {', '.join(sorted(missing)[:8])}"
                              + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))


def _slots(param: nn.Parameter, t: Target) -> set[tuple[int | None, int | None]]:
    spec: ShardSpec = getattr(param, "shard_spec", ShardSpec())
    experts = [t.expert] if t.expert is not None else (range(param.shape[0]) if _is_expert_stack(param) else [None])
    parts = [t.part] if t.part is not None else (range(len(spec.parts)) if spec.parts else [None])
    return {(e, p) for e in experts for p in parts}


def _is_expert_stack(param: nn.Parameter) -> bool:
    return getattr(param, "expert_stack", False)  # set by MoE on w13/w2: dim 0 indexes experts


def load_model(model_dir: str | Path, *, dtype: str | None = None, tp: TPContext = SINGLE, ep: int | bool = 1,
               device: str = "cpu", progress: bool = True) -> KimiForCausalLM:
    """config.json + weights -> an eval-mode KimiForCausalLM on `device` (this rank's shard under tp; ep: the
    expert-parallel degree, model_config.ep_degree). `model_dir` may also name a model shipped with k3rt (`k3-tiny`)."""
    model_dir = resolve_model_dir(model_dir)
    cfg = load_model_config(model_dir)
    if cfg.ignored_fields:
        log.warning("config.json fields k3rt does not use: %s", ", ".join(cfg.ignored_fields))
    torch_dtype = DTYPES[dtype or cfg.dtype]
    model = build_model(cfg, dtype=torch_dtype, tp=tp, ep=ep)
    load_weights(model, model_dir, tp=tp, progress=progress)
    return model.to(device).eval()


def build_model(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, tp: TPContext = SINGLE,
                ep: int | bool = 1) -> KimiForCausalLM:
    return KimiForCausalLM(cfg, tp=tp, ep=ep, dtype=dtype)
