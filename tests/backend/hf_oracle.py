"""Builds tiny random KimiLinearForCausalLM checkpoints with transformers (the independent oracle).

transformers' pure-torch path is only used when flash-linear-attention is NOT importable; the
fixture refuses to run otherwise (fla would route KDA to Triton kernels that fail on CPU).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    routed_scaling_factor=2.446,
)

# id -> overrides; covers q-LoRA on/off, dense-first on/off, MLA first / last layer, grouped top-k
SHAPES = {
    "mla_last_qlora_off_dense_first": dict(num_hidden_layers=4, q_lora_rank=None, first_k_dense_replace=1,
                                           kda=[1, 2, 3], mla=[4]),
    "mla_first_qlora_on_no_dense": dict(num_hidden_layers=4, q_lora_rank=24, first_k_dense_replace=0,
                                        kda=[2, 3, 4], mla=[1]),
    "mixed_grouped_topk": dict(num_hidden_layers=5, q_lora_rank=None, first_k_dense_replace=2, kda=[1, 3, 4],
                               mla=[2, 5], n_group=4, topk_group=2),
}


def build_hf_checkpoint(out: Path, shape: str, seed: int = 0) -> "torch.nn.Module":
    assert importlib.util.find_spec("fla") is None, "flash-linear-attention must not be importable for the CPU oracle"
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    o = dict(SHAPES[shape])
    kda, mla = o.pop("kda"), o.pop("mla")
    cfg = KimiLinearConfig(**BASE, **o, linear_attn_config={
        "kda_layers": kda, "full_attn_layers": mla, "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4})
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        # make the router bias and dt_bias matter (they init to zeros / a narrow range)
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
            elif "dt_bias" in name:
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return model
