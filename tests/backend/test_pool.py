"""Cache layout numbers and the page pool (DESIGN.md §4).

Layout, for Kimi-Linear-48B's config (model-facts §4/§8.4) at TP 1, 2, 4, 8 with an fp32 recurrent
state: the exact KDA state bytes, block_size = the smallest multiple of 16 tokens whose MLA page holds
one KDA state, page bytes = block_size * 1152, padding <= 2%, the layer grouping. Pool: the MLA and KDA
views of a page cover exactly the bytes the layout says and never overlap another page or each other;
`allocate` hands out zeroed pages (after garbage was written and freed) unless zero=False; refcounts
and the LIFO free list; poison_freed fills exactly the freed pages with NaN; copy_state_set copies
exactly the KDA bytes of the layers each group has and nothing else.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3rt.backend.cache.pool import OutOfPages, PagePool
from k3rt.cache_layout import MLA_ALIGNMENT, CacheLayout, compute_layout
from k3rt.model_config import parse_model_config

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json, the fields that matter (model-facts §4)
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-05,
    "model_max_length": 1048576, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
    },
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
}
MLA_BYTES_PER_TOKEN = 1152  # (kv_lora_rank 512 + qk_rope 64) * 2 B bf16
MLA_LAYERS_0BASED = (3, 7, 11, 15, 19, 23, 26)
# tp -> (conv bytes (3, 12288/tp) bf16, recurrent bytes (32/tp, 128, 128) fp32, block_size)
EXPECTED = {
    1: (73_728, 2_097_152, 1888),
    2: (36_864, 1_048_576, 944),
    4: (18_432, 524_288, 480),
    8: (9_216, 262_144, 240),
}


@pytest.fixture(scope="module")
def cfg48b():
    return parse_model_config(KIMI_LINEAR_48B)


def layout48b(cfg, tp: int) -> CacheLayout:
    return compute_layout(cfg, tp=tp, kv_dtype="bfloat16", conv_dtype="bfloat16", state_dtype="float32")


@pytest.mark.parametrize("tp", [1, 2, 4, 8], ids=lambda t: f"tp{t}")
def test_kimi_linear_48b_layout(cfg48b, tp):
    L = layout48b(cfg48b, tp)
    conv, rec, block = EXPECTED[tp]
    assert (L.kda_conv_bytes, L.kda_state_bytes) == (conv, conv + rec)
    assert L.mla_bytes_per_token == MLA_BYTES_PER_TOKEN
    assert L.block_size == block
    assert L.block_size % MLA_ALIGNMENT == 0 and MLA_ALIGNMENT == 16
    # holds one KDA state, and is the smallest multiple of 16 that does
    assert L.block_size * MLA_BYTES_PER_TOKEN >= L.kda_state_bytes
    assert (L.block_size - 16) * MLA_BYTES_PER_TOKEN < L.kda_state_bytes
    assert L.page_size_bytes == L.block_size * MLA_BYTES_PER_TOKEN
    assert L.padding_fraction == pytest.approx((L.page_size_bytes - L.kda_state_bytes) / L.page_size_bytes)
    assert L.padding_fraction <= 0.02
    # 7 MLA layers form one group; 20 KDA layers fill ceil(20/7) = 3 groups of 7, 7, 6
    assert L.mla_group == MLA_LAYERS_0BASED and L.group_size == 7
    kda = [i for i in range(27) if i not in MLA_LAYERS_0BASED]
    assert L.kda_groups == (tuple(kda[:7]), tuple(kda[7:14]), tuple(kda[14:]))
    assert L.pages_per_state_set == 3
    assert [L.kda_slot(layer) for layer in (0, 6, 8, 9, 25)] == [(0, 0), (0, 5), (0, 6), (1, 0), (2, 5)]
    with pytest.raises(KeyError):
        L.kda_slot(3)  # an MLA layer
    assert L.as_dict()["block_size"] == block and L.as_dict()["pages_per_state_set"] == 3


def test_kimi_linear_48b_tp1_numbers_from_model_facts(cfg48b):
    """model-facts §8.4: 2,170,880 B of KDA state per layer at TP 1 = 1884.4 tokens of one MLA layer."""
    L = layout48b(cfg48b, 1)
    assert L.kda_state_bytes == 2_170_880
    assert math.ceil(2_170_880 / 1152) == 1885 and L.block_size == 1888  # 1885 rounded up to 16
    assert L.page_size_bytes == 2_174_976
    assert round(100 * L.padding_fraction, 2) == 0.19


@pytest.mark.parametrize("block_size, ok", [(1888, True), (1904, True), (1872, False), (1890, False)],
                         ids=["smallest", "larger_multiple", "too_small", "not_multiple_of_16"])
def test_explicit_block_size_is_validated(cfg48b, block_size, ok):
    if ok:
        assert compute_layout(cfg48b, block_size=block_size).block_size == block_size
    else:
        with pytest.raises(ValueError, match="block_size: .*smallest valid is 1888"):
            compute_layout(cfg48b, block_size=block_size)


@pytest.mark.parametrize("field", ["kv_dtype", "conv_dtype", "state_dtype"])
def test_unknown_dtype_names_the_field(cfg48b, field):
    with pytest.raises(ValueError, match=f"^{field}: 'fp8'"):
        compute_layout(cfg48b, **{field: "fp8"})


# ---- the pool ----

def pool48b(cfg, num_pages: int = 3, **kw) -> PagePool:
    pool = PagePool(layout48b(cfg, 8), num_pages, **kw)
    pool.set_kda_shapes((3, 12288 // 8), (32 // 8, 128, 128))
    return pool


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, end byte) a contiguous tensor occupies."""
    assert t.is_contiguous()
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_views_match_layout_and_do_not_overlap(cfg48b):
    pool = pool48b(cfg48b)
    L = pool.layout
    P, conv_b, state_b = L.page_size_bytes, L.kda_conv_bytes, L.kda_state_bytes
    assert len(pool.tensors) == L.group_size
    for i, t in enumerate(pool.tensors):
        assert t.shape == (3, P) and t.dtype == torch.uint8
        assert pool.mla[i].shape == (3, L.block_size, 576) and pool.mla[i].dtype == torch.bfloat16
        assert pool.conv[i].shape == (3, 3, 1536) and pool.conv[i].dtype == torch.bfloat16
        assert pool.rec[i].shape == (3, 4, 128, 128) and pool.rec[i].dtype == torch.float32
        base = t.data_ptr()
        spans = []
        for p in range(3):
            page = (base + p * P, base + (p + 1) * P)
            assert _span(pool.mla[i][p]) == page  # the MLA view is the whole page
            c, r = _span(pool.conv[i][p]), _span(pool.rec[i][p])
            assert c == (page[0], page[0] + conv_b)  # conv first,
            assert r == (c[1], page[0] + state_b)  # then the recurrent state right after it,
            assert r[1] <= page[1] and page[1] - r[1] == P - state_b  # then padding
            spans += [c, r]
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "KDA views overlap"
    # writing one view of one page touches exactly that view's bytes
    pool.rec[2][1].fill_(1.5)
    changed = (pool.tensors[2] != 0).nonzero()
    assert set(changed[:, 0].tolist()) == {1}
    assert changed[:, 1].min().item() >= conv_b and changed[:, 1].max().item() < state_b
    assert all(not t.any() for i, t in enumerate(pool.tensors) if i != 2)


def test_kda_view_shape_mismatch_is_rejected(cfg48b):
    pool = PagePool(layout48b(cfg48b, 8), 2)
    with pytest.raises(AssertionError, match="KDA view mismatch"):
        pool.set_kda_shapes((3, 12288 // 4), (4, 128, 128))  # TP 4 conv width on a TP 8 layout


@pytest.fixture
def small_pool():
    """A tiny layout (block 16, fp32 KV of 8 floats per token, KDA state 2*4 + 2*4*4 floats = 160 B) x 2 tensors."""
    layout = CacheLayout(block_size=16, page_size_bytes=16 * 32, kda_conv_bytes=32, kda_state_bytes=160,
                         mla_bytes_per_token=32, group_size=2, mla_group=(1, 3), kda_groups=((0, 2), (4,)),
                         kv_dtype="float32", conv_dtype="float32", state_dtype="float32")
    pool = PagePool(layout, 6)
    pool.set_kda_shapes((2, 4), (2, 4, 4))
    return pool


def _garbage(pool: PagePool, pages: list[int]) -> None:
    for t in pool.tensors:
        t[pages] = torch.randint(1, 256, (len(pages), t.shape[1]), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("zero", [True, False], ids=["zero", "no_zero"])
def test_reallocated_page_is_zeroed_unless_zero_false(small_pool, zero):
    pool = small_pool
    pages = pool.allocate(2)
    assert pages == [0, 1]  # low ids first
    assert all(not t[pages].any() for t in pool.tensors)
    _garbage(pool, [1])
    before = [t[1].clone() for t in pool.tensors]
    pool.unref([1])
    again = pool.allocate(1, zero=zero)
    assert again == [1]  # LIFO: the page just freed comes back first
    for t, b in zip(pool.tensors, before):
        if zero:
            assert not t[1].any()
        else:
            assert torch.equal(t[1], b)
            assert (t[1] != 0).all()


def test_refcounts_and_free_list(small_pool):
    pool = small_pool
    assert pool.num_free == 6 and pool.refcount == [0] * 6
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.refcount == [1, 1, 1, 0, 0, 0] and pool.num_free == 3
    pool.ref([1, 1, 2])
    assert pool.refcount[:3] == [1, 3, 2]
    pool.unref([1, 2])
    assert pool.refcount[:3] == [1, 2, 1] and pool.num_free == 3
    pool.unref([2, 0])
    assert pool.refcount[:3] == [0, 2, 0] and pool.num_free == 5
    assert pool.allocate(2) == [2, 0]  # pages freed together come back in the order they were released
    with pytest.raises(OutOfPages, match="need 4 pages, 3 free"):
        pool.allocate(4)
    assert pool.num_free == 3  # a failed allocation takes nothing
    pool.unref([1, 1])
    with pytest.raises(AssertionError, match="unref of free page 1"):
        pool.unref([1])
    with pytest.raises(AssertionError, match="ref of free page 1"):
        pool.ref([1])
    assert sorted(pool.free_list) == [p for p in range(6) if pool.refcount[p] == 0]


def test_poison_freed_fills_only_freed_pages_with_nan(small_pool):
    layout = small_pool.layout
    pool = PagePool(layout, 4, poison_freed=True)
    pool.set_kda_shapes((2, 4), (2, 4, 4))
    pages = pool.allocate(3)
    pool.ref([2])
    _garbage(pool, pages)
    kept = [t.clone() for t in pool.tensors]
    pool.unref([0, 2])  # 0 is freed, 2 keeps one reference
    for t, k in zip(pool.tensors, kept):
        assert (t[0] == 0xFF).all()
        assert torch.equal(t[1:3], k[1:3])
    for i in range(2):
        assert pool.mla[i][0].isnan().all() and pool.conv[i][0].isnan().all() and pool.rec[i][0].isnan().all()
    assert pool.allocate(1) == [0]
    assert all(not t[0].any() for t in pool.tensors)  # zeroing on reuse clears the poison
    # without poison_freed a freed page keeps its bytes
    plain = small_pool
    pg = plain.allocate(1)
    _garbage(plain, pg)
    kept = [t[pg].clone() for t in plain.tensors]
    plain.unref(pg)
    assert all(torch.equal(t[pg], k) for t, k in zip(plain.tensors, kept))


def test_copy_state_set_copies_exactly_the_kda_bytes(small_pool):
    pool = small_pool
    L = pool.layout  # group 0 has two KDA layers (tensors 0, 1), group 1 one (tensor 0 only)
    src, dst, other = pool.allocate(2), pool.allocate(2), pool.allocate(1)
    for t in pool.tensors:
        t[src] = torch.randint(0, 256, (2, t.shape[1]), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        t[dst + other] = 0xAB
    before = [t.clone() for t in pool.tensors]
    pool.copy_state_set(src, dst)
    S = L.kda_state_bytes
    for g, (s, d) in enumerate(zip(src, dst)):
        for i, t in enumerate(pool.tensors):
            if i < len(L.kda_groups[g]):
                assert torch.equal(t[d, :S], before[i][s, :S])  # the state bytes
            else:
                assert torch.equal(t[d, :S], before[i][d, :S])  # a tensor this group has no layer in
            assert torch.equal(t[d, S:], before[i][d, S:])  # the padding is not copied
    for i, t in enumerate(pool.tensors):
        assert torch.equal(t[src + other], before[i][src + other])
    assert torch.equal(pool.rec[0][dst[0]], pool.rec[0][src[0]]) and torch.equal(pool.conv[1][dst[0]], pool.conv[1][src[0]])


def test_copy_pages_copies_whole_pages_of_the_first_tensors(small_pool):
    pool = small_pool
    a, b = pool.allocate(2), pool.allocate(2)
    _garbage(pool, a)
    before = [t.clone() for t in pool.tensors]
    pool.copy_pages(a, b, tensors=1)
    assert torch.equal(pool.tensors[0][b], before[0][a])
    assert torch.equal(pool.tensors[1], before[1])
    pool.copy_pages(a[:1], b[1:])
    assert all(torch.equal(t[b[1]], k[a[0]]) for t, k in zip(pool.tensors, before))


def test_accounting_only_pool():
    """materialize=False (null runner): the same ids and counts, no memory."""
    layout = CacheLayout(block_size=16, page_size_bytes=512, kda_conv_bytes=32, kda_state_bytes=160,
                         mla_bytes_per_token=32, group_size=1, mla_group=(1,), kda_groups=((0,),),
                         kv_dtype="float32", conv_dtype="float32", state_dtype="float32")
    pool = PagePool(layout, 5, materialize=False, poison_freed=True)
    assert all(t.numel() == 0 for t in pool.tensors)
    assert pool.allocate(3) == [0, 1, 2]
    pool.unref([1])
    assert pool.allocate(1) == [1] and pool.num_free == 2


def test_pool_needs_a_page():
    layout = CacheLayout(16, 512, 32, 160, 32, 1, (1,), ((0,),), "float32", "float32", "float32")
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(layout, 0)
