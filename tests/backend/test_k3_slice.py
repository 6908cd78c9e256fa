"""Issue 17's K3-width slice (backend/bench/k3_slice.py, benchmarks/k3_slice.py): the preset's shapes, the random
MXFP4 checkpoint it writes, and the TP2 comparison against the fp32 reference (smoke: the tiny k3 shape, CPU, gloo)."""

from __future__ import annotations

import pytest

from k3rt.model_config import parse_model_config
from k3rt.presets import PRESETS
from tests.backend.test_tp import no_new_processes  # noqa: F401  (fixture)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_k3_slice_preset_splits_over_tensor_parallel_ranks(tp) -> None:
    """K3's widths at TP 1-8: every per-rank width divides (KDA/MLA heads, the MXFP4 experts' groups of 32), and
    the page that holds one rank's KDA state shard wastes at most 2%."""
    cfg = parse_model_config(PRESETS["kimi-k3-slice"])
    assert (cfg.hidden_size, cfg.kda.num_heads, cfg.moe.latent_size, cfg.moe.expert_format) == (7168, 96, 3584, "mxfp4")
    assert cfg.mlp_types == ("dense", "moe", "moe", "moe")
    cfg.check_tp(tp)
    cfg.check_tp_model(tp)
    assert (cfg.moe.intermediate_size // tp) % 32 == 0
    from k3rt.cache_layout import compute_layout

    lay = compute_layout(cfg, tp=tp)  # issue 17: page padding <= 2% at TP 1-8 (K3: 0.19 / 0.19 / 0.75 / 1.85%)
    assert lay.padding_fraction <= 0.02, lay.as_dict()


def test_random_mxfp4_model_checkpoint_keeps_its_codes(tmp_path) -> None:
    """write_checkpoint cast every tensor to the checkpoint dtype, so a random MXFP4 model's packed codes and scales
    were written as bf16 and the loader refused them; integer tensors now keep their dtype and load back."""
    import torch

    from k3rt.backend.models.loader import load_model
    from k3rt.backend.models.random_init import random_model
    from k3rt.backend.models.tiny import TINY_CONFIGS, write_checkpoint
    from k3rt.backend.tokenizer import write_tiny_tokenizer

    raw = dict(TINY_CONFIGS["k3"], quantization_config=PRESETS["kimi-k3-slice"]["quantization_config"])
    model = random_model(parse_model_config(raw), dtype="bfloat16", seed=1, progress=False)
    write_tiny_tokenizer(tmp_path, vocab_size=raw["vocab_size"])
    write_checkpoint(model, tmp_path, raw, dtype="bfloat16")
    back = load_model(tmp_path, dtype="bfloat16", progress=False)
    packed = {n: p for n, p in back.named_parameters() if n.endswith(("_packed", "_scale")) and p.dtype == torch.uint8}
    assert packed
    want = dict(model.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in packed.items())


def test_k3_slice_smoke_tp2_equals_the_fp32_reference(tmp_path, no_new_processes) -> None:  # noqa: F811
    from k3rt.backend.bench.k3_slice import SliceConfig, run_slice, table, write_slice

    cfg = SliceConfig(out_dir=str(tmp_path / "slice"), tp=2, device="cpu", dtype="float32", smoke=True,
                      prompt_len=20, tokens=8)
    res = run_slice(cfg)
    weights = tmp_path / "slice" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert write_slice(cfg) == tmp_path / "slice" and weights.stat().st_mtime_ns == written  # reused, not rewritten
    assert res["identical"] and res["first_difference"] is None and len(res["engine"]) == 8
    assert res["max_forced_logprob_diff"] < 1e-4
    assert "TP2 cpu float32" in table(res) and "identical" in table(res)
    with pytest.raises(ValueError, match="experts: must be >= 16"):
        SliceConfig(out_dir=str(tmp_path), experts=8)
