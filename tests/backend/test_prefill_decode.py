"""Prefill-then-decode equals one full forward (fp32, max abs diff <= 1e-5).

Per layer type (a single KimiDeltaAttention, a single MultiHeadLatentAttention with q-LoRA off/on
and with the K3 output gate) and for the whole model (both tiny archs), at prompt lengths 1, 63,
64, 65 and 200: a cache-less forward over L+8 tokens must equal a prefill of L tokens through a
ContiguousCache (in one chunk, in 64-token chunks, or in odd-sized chunks) followed by 8
single-token decode steps, and the caches must end up identical. Also: several sequences in one
varlen ForwardBatch equal running them one by one, and the KDA states emitted at
`state_positions` equal the cache state after prefilling exactly that many tokens.
"""

from __future__ import annotations

import pytest
import torch

from k3rt.backend.models.batch import ContiguousCache, ForwardBatch
from k3rt.backend.models.kda import KimiDeltaAttention
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import build_model
from k3rt.backend.models.mla import MultiHeadLatentAttention
from k3rt.backend.models.tiny import TINY_CONFIGS, random_init
from k3rt.model_config import ModelConfig, parse_model_config
from tests.backend.threads import single_thread  # noqa: F401  (autouse fixture)

TOL = 1e-5
DECODE_STEPS = 8
PROMPT_LENS = [1, 63, 64, 65, 200]
ODD_SIZES = [37, 1, 13, 2, 5, 29]  # cycled: chunk boundaries fall at odd offsets, some chunks are single tokens


def config(arch: str, **overrides) -> ModelConfig:
    return parse_model_config({**TINY_CONFIGS[arch], **overrides})


def chunks(total: int, scheme: str) -> list[int]:
    """Prefill chunk sizes summing to `total` under a split scheme."""
    if scheme == "one_chunk":
        return [total]
    if scheme == "chunks64":
        return [64] * (total // 64) + ([total % 64] if total % 64 else [])
    assert scheme == "odd_chunks"
    out, i = [], 0
    while sum(out) < total:
        out.append(min(ODD_SIZES[i % len(ODD_SIZES)], total - sum(out)))
        i += 1
    return out


def _length_split_params() -> list:
    params = []
    for n in PROMPT_LENS:
        seen: list[list[int]] = []
        for scheme in ("one_chunk", "chunks64", "odd_chunks"):
            c = chunks(n, scheme)
            if c not in seen:  # L=1 (and L=63/64 for chunks64) collapse onto one_chunk
                seen.append(c)
                params.append(pytest.param(n, scheme, id=f"L{n}-{scheme}"))
    return params


LENGTH_SPLITS = _length_split_params()

# id -> (layer kind, tiny arch, config overrides)
LAYERS = {
    "kda_softplus_lowrank_gate": ("kda", "kimi_linear", {}),
    "kda_lowerbound_fullrank_gate": ("kda", "k3", {}),
    "mla_qlora_off": ("mla", "kimi_linear", {}),
    "mla_qlora_on": ("mla", "kimi_linear", {"q_lora_rank": 48}),
    "mla_qlora_on_output_gate": ("mla", "k3", {}),
}


def make_layer(name: str, seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    kind, arch, overrides = LAYERS[name]
    cfg = config(arch, **overrides)
    idx = cfg.kda_layers[0] if kind == "kda" else cfg.mla_layers[0]
    layer = (KimiDeltaAttention if kind == "kda" else MultiHeadLatentAttention)(cfg, idx, dtype=torch.float32)
    random_init(layer, seed)
    return layer, cfg


def layer_cache(layer: torch.nn.Module, cfg: ModelConfig) -> ContiguousCache:
    kda = {layer.layer_idx: layer.state_shapes()} if isinstance(layer, KimiDeltaAttention) else {}
    mla = [layer.layer_idx] if isinstance(layer, MultiHeadLatentAttention) else []
    return ContiguousCache(kda, mla, cfg.mla.cache_dim, conv_dtype=torch.float32, kv_dtype=torch.float32)


def run_pieces(fn, inputs: torch.Tensor, cache: ContiguousCache, sizes: list[int], start: int = 0) -> torch.Tensor:
    """Feed `inputs` through fn(x, batch) piece by piece, continuing one sequence's cache."""
    outs, pos = [], start
    for n in sizes:
        outs.append(fn(inputs[pos - start:pos - start + n], ForwardBatch.single(n, pos, cache)))
        pos += n
    return torch.cat(outs)


def assert_caches_equal(a: ContiguousCache, b: ContiguousCache) -> None:
    assert a.conv.keys() == b.conv.keys() and a.kv.keys() == b.kv.keys()
    for i in a.conv:
        assert (a.conv[i] - b.conv[i]).abs().max().item() <= TOL, f"conv state of layer {i}"
        assert (a.rec[i] - b.rec[i]).abs().max().item() <= TOL, f"recurrent state of layer {i}"
    for i in a.kv:
        assert a.kv[i].shape == b.kv[i].shape, f"MLA cache length of layer {i}"
        assert (a.kv[i] - b.kv[i]).abs().max().item() <= TOL, f"MLA latent cache of layer {i}"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------
# single layers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len, scheme", LENGTH_SPLITS)
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_layer_prefill_then_decode_equals_full_forward(layer_name: str, prompt_len: int, scheme: str) -> None:
    layer, cfg = make_layer(layer_name, seed=prompt_len)
    total = prompt_len + DECODE_STEPS
    x = torch.randn(total, cfg.hidden_size, generator=torch.Generator().manual_seed(100 + prompt_len))

    with torch.no_grad():
        full = layer(x, ForwardBatch([total]))
        cache = layer_cache(layer, cfg)
        steps = run_pieces(layer, x, cache, chunks(prompt_len, scheme) + [1] * DECODE_STEPS)
        whole_cache = layer_cache(layer, cfg)
        run_pieces(layer, x, whole_cache, [total])
        # the decode steps must depend on the cached context: a context-free token differs
        alone = layer(x[prompt_len:prompt_len + 1], ForwardBatch([1]))

    assert max_diff(steps, full) <= TOL
    assert_caches_equal(cache, whole_cache)
    assert max_diff(alone[0], full[prompt_len]) > 1e-3


# ------------------------------------------------------------------------------------------------
# whole model
# ------------------------------------------------------------------------------------------------

_MODELS: dict[str, KimiForCausalLM] = {}


def tiny_model(arch: str) -> KimiForCausalLM:
    if arch not in _MODELS:
        model = build_model(config(arch), dtype=torch.float32)
        random_init(model, seed=3)
        _MODELS[arch] = model.eval()
    return _MODELS[arch]


def token_ids(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("prompt_len, scheme", LENGTH_SPLITS)
@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_model_prefill_then_decode_equals_full_forward(arch: str, prompt_len: int, scheme: str) -> None:
    model = tiny_model(arch)
    total = prompt_len + DECODE_STEPS
    ids = token_ids(total, seed=prompt_len)

    full = model(ids, ForwardBatch([total]))
    cache = model.new_cache()
    steps = run_pieces(model, ids, cache, chunks(prompt_len, scheme) + [1] * DECODE_STEPS)
    whole_cache = model.new_cache()
    run_pieces(model, ids, whole_cache, [total])

    assert full.shape == (total, model.cfg.vocab_size) and full.dtype == torch.float32
    assert max_diff(steps, full) <= TOL
    assert_caches_equal(cache, whole_cache)
    assert cache.num_tokens == total


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_logits_indices_select_rows(arch: str) -> None:
    model = tiny_model(arch)
    ids = token_ids(30, seed=5)
    full = model(ids, ForwardBatch([30]))
    rows = torch.tensor([29, 0, 17])
    picked = model(ids, ForwardBatch([30], logits_indices=rows))
    assert picked.shape == (3, model.cfg.vocab_size)
    assert max_diff(picked, full[rows]) <= TOL


# ------------------------------------------------------------------------------------------------
# varlen batches
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_varlen_batch_equals_separate_sequences(arch: str) -> None:
    model = tiny_model(arch)
    a, b, c = token_ids(71, seed=11), token_ids(14, seed=12), token_ids(64, seed=13)

    # separately: A prefills 70 then decodes 1; B prefills 5 then extends 9; C prefills 64 in step 2
    ca, cb, cc = model.new_cache(), model.new_cache(), model.new_cache()
    sep1 = [model(a[:70], ForwardBatch.single(70, 0, ca)), model(b[:5], ForwardBatch.single(5, 0, cb))]
    sep2 = [model(a[70:], ForwardBatch.single(1, 70, ca)), model(b[5:], ForwardBatch.single(9, 5, cb)),
            model(c, ForwardBatch.single(64, 0, cc))]

    # together: step 1 = two prefills; step 2 = a decode, an extend and a fresh prefill in one batch
    ba, bb, bc = model.new_cache(), model.new_cache(), model.new_cache()
    out1 = model(torch.cat([a[:70], b[:5]]), ForwardBatch([70, 5], [0, 0], [ba, bb]))
    out2 = model(torch.cat([a[70:], b[5:], c]), ForwardBatch([1, 9, 64], [70, 5, 0], [ba, bb, bc]))

    assert max_diff(out1, torch.cat(sep1)) <= TOL
    assert max_diff(out2, torch.cat(sep2)) <= TOL
    for together, alone in ((ba, ca), (bb, cb), (bc, cc)):
        assert_caches_equal(together, alone)

    # cache-less: two fresh sequences in one batch equal their separate full forwards
    both = model(torch.cat([a, b]), ForwardBatch([71, 14]))
    assert max_diff(both, torch.cat([model(a, ForwardBatch([71])), model(b, ForwardBatch([14]))])) <= TOL


# ------------------------------------------------------------------------------------------------
# emitted KDA states (prefix-cache snapshots)
# ------------------------------------------------------------------------------------------------


def _cache_after(layer, cfg, x, n: int) -> ContiguousCache:
    cache = layer_cache(layer, cfg)
    with torch.no_grad():
        layer(x[:n], ForwardBatch.single(n, 0, cache))
    return cache


@pytest.mark.parametrize("layer_name", [n for n in LAYERS if LAYERS[n][0] == "kda"])
def test_kda_emitted_states_equal_prefix_cache_states(layer_name: str) -> None:
    layer, cfg = make_layer(layer_name, seed=1)
    x = torch.randn(202, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    i = layer.layer_idx

    def check(emitted: dict, key: tuple[int, int, int], n: int) -> None:
        conv, rec = emitted[key]
        ref = _cache_after(layer, cfg, x, n)
        assert conv.shape == ref.conv[i].shape and rec.shape == ref.rec[i].shape
        assert max_diff(conv, ref.conv[i]) <= TOL, f"conv state at {n}"
        assert max_diff(rec, ref.rec[i]) <= TOL, f"recurrent state at {n}"

    with torch.no_grad():
        # one prefill from 0 emitting at chunk multiples and at its end
        cache = layer_cache(layer, cfg)
        batch = ForwardBatch([200], [0], [cache], state_positions=[(64, 128, 200)])
        layer(x[:200], batch)
        assert set(batch.emitted_states) == {(0, i, 64), (0, i, 128), (0, i, 200)}
        for p in (64, 128, 200):
            check(batch.emitted_states, (0, i, p), p)
        assert_caches_equal(cache, _cache_after(layer, cfg, x, 200))

        # a continuation chunk starting at 70: positions are absolute (70+64 and its end)
        cache = _cache_after(layer, cfg, x, 70)
        batch = ForwardBatch([130], [70], [cache], state_positions=[(134, 200)])
        layer(x[70:200], batch)
        assert set(batch.emitted_states) == {(0, i, 134), (0, i, 200)}
        check(batch.emitted_states, (0, i, 134), 134)
        check(batch.emitted_states, (0, i, 200), 200)

        # a single decode token that must report its state, batched after another sequence
        other = layer_cache(layer, cfg)
        cache = _cache_after(layer, cfg, x, 200)
        batch = ForwardBatch([10, 1], [0, 200], [other, cache], state_positions=[(10,), (201,)])
        layer(torch.cat([x[:10], x[200:201]]), batch)
        assert set(batch.emitted_states) == {(0, i, 10), (1, i, 201)}
        check(batch.emitted_states, (0, i, 10), 10)
        check(batch.emitted_states, (1, i, 201), 201)


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_model_emits_states_for_every_kda_layer(arch: str) -> None:
    model = tiny_model(arch)
    ids = token_ids(130, seed=21)
    batch = ForwardBatch([130], [0], [model.new_cache()], state_positions=[(64, 128, 130)])
    model(ids, batch)
    kda = model.cfg.kda_layers
    assert set(batch.emitted_states) == {(0, layer, p) for layer in kda for p in (64, 128, 130)}
    for p in (64, 128, 130):
        ref = model.new_cache()
        model(ids[:p], ForwardBatch.single(p, 0, ref))
        for layer in kda:
            conv, rec = batch.emitted_states[(0, layer, p)]
            assert max_diff(conv, ref.conv[layer]) <= TOL
            assert max_diff(rec, ref.rec[layer]) <= TOL
