"""k3rt's reference model vs transformers' KimiLinearForCausalLM on tiny random checkpoints (fp32).

Acceptance: greedy 32-token generation and every step's logits agree (max abs diff <= 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.loader import load_model
from tests.backend.hf_oracle import SHAPES, build_hf_checkpoint

pytest.importorskip("transformers")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_generation_matches_transformers(shape: str, tmp_path) -> None:
    from transformers import DynamicCache

    hf = build_hf_checkpoint(tmp_path, shape, seed=1)
    ours = load_model(tmp_path, progress=False)
    prompt = torch.randint(3, 128, (21,), generator=torch.Generator().manual_seed(7))

    # transformers: prefill then cached greedy decode
    hf_cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf_logits = [hf(prompt[None], cache=hf_cache, use_cache=True).logits[0, -1]]
        hf_tokens = []
        for _ in range(32):
            tok = int(hf_logits[-1].argmax())
            hf_tokens.append(tok)
            hf_logits.append(hf(torch.tensor([[tok]]), cache=hf_cache, use_cache=True).logits[0, -1])

    cache = ours.new_cache()
    n = prompt.numel()
    logits = [ours(prompt, ForwardBatch([n], [0], [cache], logits_indices=torch.tensor([n - 1])))[0]]
    tokens = []
    for step in range(32):
        tok = int(logits[-1].argmax())
        tokens.append(tok)
        logits.append(ours(torch.tensor([tok]), ForwardBatch([1], [n + step], [cache]))[0])

    assert tokens == hf_tokens
    for step, (a, b) in enumerate(zip(logits, hf_logits)):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-4, f"step {step}: max abs logit diff {diff:.3g}"


def test_full_forward_matches_transformers(tmp_path) -> None:
    hf = build_hf_checkpoint(tmp_path, "mla_last_qlora_off_dense_first", seed=2)
    ours = load_model(tmp_path, progress=False)
    ids = torch.randint(3, 128, (130,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = ours(ids, ForwardBatch([130]))
    assert (out - ref).abs().max().item() <= 1e-4
