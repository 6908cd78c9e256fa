"""MXFP4 routed experts: the format (kernels/moe/mxfp4_ref.py) and the Triton grouped GEMMs that dequantize
in registers (kernels/moe/triton_mxfp4.py; the planar layout's kernels/moe/triton_mxfp4_planar.py) against
the reference on the dequantized weights.

Without a GPU the kernel runs in the Triton interpreter at tiny fp32 shapes (D=64, I=32); the `gpu` cases
run K3's expert shape (latent width 3584, intermediate 3072) in bf16.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.kernels.moe.mxfp4_ref import (  # noqa: E402
    E2M1_MAGNITUDES, dequantize_mxfp4, e2m1_values, fused_experts_mxfp4_ref, quantize_mxfp4,
)
from k3rt.kernels.moe.ref import fused_experts_ref  # noqa: E402
from k3rt.kernels.moe.triton_mxfp4 import Mxfp4Tiles  # noqa: E402
from k3rt.kernels.moe.triton_mxfp4 import MXFP4_DECODE_CANDIDATES, fused_experts_mxfp4  # noqa: E402
from k3rt.kernels.moe.triton_mxfp4_planar import (  # noqa: E402
    FUSED_MAX_SCALE, MAX_SCALE, PLANAR_CANDIDATES, PLANAR_VARIANTS, SLOT_BITS, PlanarMxfp4, PlanarTiles,
    dequantize_planar, fused_experts_mxfp4_planar, from_planar, to_planar,
)
from k3rt.model_config import ActivationConfig  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA, rel_err  # noqa: E402

SILU = ActivationConfig("silu")
SITU = ActivationConfig("situ", 4.0, 25.0)

pytestmark = pytest.mark.usefixtures("poison_outputs")


# --------------------------------------------------------------------------------------------
# the format


def test_codes_decode_to_the_e2m1_table_in_the_documented_nibble_order() -> None:
    """Hand-built bytes: low nibble = even element, high nibble = odd; scale 127 = 1, 128 = 2, 125 = 1/4."""
    packed = torch.tensor([[0x21, 0xF7] + [0] * 14], dtype=torch.uint8)  # K = 32
    for s, f in ((127, 1.0), (128, 2.0), (125, 0.25)):
        w = dequantize_mxfp4(packed, torch.tensor([[s]], dtype=torch.uint8))
        assert w[0, :4].tolist() == [0.5 * f, 1.0 * f, 6.0 * f, -6.0 * f]
        assert (w[0, 4:] == 0).all()
    assert e2m1_values().tolist() == list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES]


def test_quantize_is_exact_on_representable_values_and_nearest_otherwise() -> None:
    gen = torch.Generator().manual_seed(0)
    vals = e2m1_values()
    # every group: random codes times a random power of two, with one 6 so the scale is pinned
    codes = torch.randint(0, 16, (4, 3, 64), generator=gen)
    codes[..., ::32] = 7
    exps = torch.randint(-6, 6, (4, 3, 2), generator=gen).float()
    w = vals[codes] * torch.exp2(exps).repeat_interleave(32, dim=-1)
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (4, 3, 32) and scale.shape == (4, 3, 2) and packed.dtype == scale.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(packed, scale), w)
    assert torch.equal(scale.float() - 127, exps)
    # off-grid values land on the nearest representable one (group amax 6 -> scale 1)
    x = torch.tensor([6.0, 0.2, 0.3, 1.2, 1.3, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1, -0.74, -0.76, 7.9] + [0.0] * 18)
    got = dequantize_mxfp4(*quantize_mxfp4(x[None]))[0, :14].tolist()
    assert got == [6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 3.0, 4.0, 4.0, 6.0, -0.5, -1.0, 6.0]
    # ties go to the even code: 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 2.5 -> 2 (code 4), 5 -> 4 (code 6)
    t = torch.tensor([4.0, 0.25, 0.75, 2.5, 5.0] + [0.0] * 27)
    assert dequantize_mxfp4(*quantize_mxfp4(t[None]))[0, :5].tolist() == [4.0, 0.0, 1.0, 2.0, 4.0]


def test_quantize_error_is_bounded_and_zero_groups_stay_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen)
    w[3, 32:64] = 0
    deq = dequantize_mxfp4(*quantize_mxfp4(w))
    assert (deq[3, 32:64] == 0).all()
    # scale = 2^(floor(log2 amax) - 2): below 6 * scale an element is within half a step (<= scale) of its
    # value; above, MX clamps to 6 * scale, at most 2 * scale away (amax < 8 * scale)
    g = w.reshape(64, 8, 32)
    scale = torch.exp2(torch.floor(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(1e-30))) - 2)
    err = (deq.reshape(64, 8, 32) - g).abs()
    assert (err <= torch.where(g.abs() <= 6 * scale, scale, 2 * scale)).all()
    assert rel_err(deq, w) < 0.15


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------
# the Triton kernel against the reference


def mx_case(gen: torch.Generator, T: int, E: int, k: int, D: int, inter: int, dtype: torch.dtype,
            experts: int | None = None) -> dict:
    w13 = torch.randn(E, 2 * inter, D, generator=gen) * D ** -0.5
    w2 = torch.randn(E, D, inter, generator=gen) * inter ** -0.5
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    n = experts or E
    ids = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(T)]).int() if T else \
        torch.empty(0, k, dtype=torch.int32)
    return dict(x=torch.randn(T, D, generator=gen).to(dtype).to(DEV), w13_packed=q13.to(DEV), w13_scale=s13.to(DEV),
                w2_packed=q2.to(DEV), w2_scale=s2.to(DEV),
                topk_weights=torch.rand(T, k, generator=gen).to(DEV), topk_ids=ids.to(DEV))


@pytest.mark.parametrize("act", ["silu", "situ"])
@pytest.mark.parametrize("T", [1, 5, 21])
def test_fused_experts_mxfp4_matches_ref(T: int, act: str) -> None:
    gen = torch.Generator().manual_seed(300 + T)
    case = mx_case(gen, T, E=6, k=2, D=64, inter=32, dtype=torch.float32)
    a = SILU if act == "silu" else SITU
    out = fused_experts_mxfp4(**case, act=a)
    ref = fused_experts_mxfp4_ref(**case, act=a)
    assert out.shape == (T, 64) and out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-4


def test_fused_experts_mxfp4_equals_bf16_path_on_dequantized_weights_with_shared_expert() -> None:
    """The same numbers as the unquantized kernel's oracle on the dequantized weights, shared expert included,
    with K tiles that span several scale groups (BLOCK_K 64 over D=128, I=64)."""
    gen = torch.Generator().manual_seed(5)
    case = mx_case(gen, 18, E=5, k=2, D=128, inter=64, dtype=torch.float32, experts=4)
    w13 = dequantize_mxfp4(case["w13_packed"], case["w13_scale"])
    w2 = dequantize_mxfp4(case["w2_packed"], case["w2_scale"])
    ref = fused_experts_ref(case["x"], w13, w2, case["topk_weights"], case["topk_ids"], act=SITU, shared_experts=1)
    for prefetch in (False, True):  # the software-pipelined loop too (its last step's loads are masked off)
        tiles = Mxfp4Tiles(16, 16, 64, 16, 64, 4, 4, 1, prefetch=prefetch)
        out = fused_experts_mxfp4(**case, act=SITU, shared_experts=1, tiles=tiles)
        assert rel_err(out, ref) <= 1e-4, prefetch


def test_fused_experts_mxfp4_fp16() -> None:
    gen = torch.Generator().manual_seed(6)
    case = mx_case(gen, 5, E=6, k=2, D=64, inter=32, dtype=torch.float16)
    out = fused_experts_mxfp4(**case, act=SILU)
    assert out.dtype == torch.float16
    assert rel_err(out, fused_experts_mxfp4_ref(**case, act=SILU)) <= 2e-3


def test_fused_experts_mxfp4_norm_in_the_sum_equals_the_norm_kernel_after() -> None:
    """K3's LatentMoE with MXFP4 experts: routed_expert_norm in the slot sum's launch (`norm=`, both MXFP4 paths)
    equals the sum and then kernels/norm's rms_norm bit for bit, into a strided out."""
    from k3rt.kernels.norm import rms_norm

    gen = torch.Generator().manual_seed(61)
    case = mx_case(gen, 5, E=6, k=2, D=64, inter=32, dtype=torch.float16)
    weight = (torch.rand(64, generator=gen) + 0.5).half().to(DEV)
    wide = torch.full((5, 80), float("nan"), dtype=torch.float16, device=DEV)
    got = fused_experts_mxfp4(**case, act=SITU, out=wide[:, 16:], norm=(weight, 1e-5))
    assert torch.equal(got, rms_norm(fused_experts_mxfp4(**case, act=SITU), weight, 1e-5))
    pcase, w = planar_case(torch.Generator().manual_seed(9), 3, torch.float16, False)
    weight = (torch.rand(256, generator=gen) + 0.5).half().to(DEV)
    args = (pcase["x"], w, pcase["topk_weights"], pcase["topk_ids"])
    got = fused_experts_mxfp4_planar(*args, act=SITU, norm=(weight, 1e-5))
    assert torch.equal(got, rms_norm(fused_experts_mxfp4_planar(*args, act=SITU), weight, 1e-5))


def test_fused_experts_mxfp4_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(7)
    case = mx_case(gen, 3, E=6, k=2, D=64, inter=32, dtype=torch.float32)

    def bad(match: str, **over) -> None:
        with pytest.raises(ValueError, match=match):
            fused_experts_mxfp4(**{**case, "act": SILU, **over})

    bad("w13_packed must be", w13_packed=case["w13_packed"][:, :, :16])
    bad("w13_scale must have shape", w13_scale=case["w13_scale"][:, :, :1])
    bad("w2_scale must be torch.uint8", w2_scale=case["w2_scale"].float())
    bad("multiples of 32", x=torch.zeros(3, 48, device=DEV), w13_packed=torch.zeros(6, 64, 24, dtype=torch.uint8, device=DEV))
    bad("topk_ids must be torch.int32", topk_ids=case["topk_ids"].long())
    bad("native=True needs", native=True)  # fp32 here (and the interpreter on CPU): no tl.dot_scaled


def test_fused_experts_mxfp4_empty_batch() -> None:
    case = mx_case(torch.Generator().manual_seed(0), 0, E=6, k=2, D=64, inter=32, dtype=torch.float32)
    assert fused_experts_mxfp4(**case, act=SILU).shape == (0, 64)


# --------------------------------------------------------------------------------------------
# the planar layout (word-wide decode)


def test_planar_bit_placement_is_the_e2m1_value_in_torch_integer_ops() -> None:
    """`_plane`'s decode mirrored in torch integer ops, for all 16 codes in both lanes of every slot: the
    masked bits read as bf16 (code 1 a bf16 subnormal), times 2^112 in bf16, are the value times 2^-14."""
    codes = torch.arange(16, dtype=torch.int64)
    decode = (lambda u: (u << 6) & 0x81C081C0, lambda u: (u << 3) & 0x81C081C0, lambda u: u & 0x81C081C0,
              lambda u: ((u >> 4) & 0x00C000C0) | ((u >> 5) & 0x01000100) | ((u << 1) & 0x80008000))
    for slot, positions in enumerate(SLOT_BITS):
        lanes = (codes, codes.flip(0))  # every code in the low lane, their reverse in the high one
        word = sum(((c >> bit) & 1) << (16 * lane + pos) for lane, c in enumerate(lanes)
                   for bit, pos in enumerate(positions))
        # the other slots' bits set too: the masks must drop them
        word = word | (0x5A5A5A5A & ~sum(1 << (16 * lane + pos) for lane in (0, 1) for pos in positions))
        bits = decode[slot](word) & 0xFFFFFFFF
        for lane, c in enumerate(lanes):
            v = ((bits >> (16 * lane)) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)
            got = (v * torch.tensor(2.0 ** 112, dtype=torch.bfloat16)).float() * 2.0 ** 14
            assert torch.equal(got, e2m1_values()[c]), (slot, lane)


def every_code_at_every_scale(device: str = "cpu") -> tuple:
    """(packed, scale): all 16 codes in every nibble position, one row per E8M0 exponent 0..MAX_SCALE."""
    scales = torch.arange(MAX_SCALE + 1, dtype=torch.uint8)
    n = scales.numel()
    codes = (torch.arange(256)[None, :] + torch.arange(n)[:, None]) % 16  # each row shifts the code pattern
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.to(device), scales[:, None].expand(n, 8).contiguous().to(device)


def test_planar_layout_round_trips_and_decodes_every_code_at_every_scale() -> None:
    """to_planar / from_planar are inverse; the kernels' decode (dequantize_planar) equals the reference's
    for all 16 codes in every nibble position, at every E8M0 exponent the layout accepts (0..240)."""
    packed, scale = every_code_at_every_scale()
    n = packed.shape[0]
    words = to_planar(packed)
    assert words.shape == (n, 32) and words.dtype == torch.int32
    assert torch.equal(from_planar(words), packed)
    # the fp32 decode of the bit placement (the interpreter has no bf16 bitcast: bf16's is checked on the GPU),
    # scaled after the decode, or in its multiply where the scale allows
    assert torch.equal(dequantize_planar(words, scale), dequantize_mxfp4(packed, scale))
    low = slice(0, FUSED_MAX_SCALE + 1)
    assert torch.equal(dequantize_planar(words[low], scale[low], fused=True), dequantize_mxfp4(packed[low], scale[low]))
    with pytest.raises(ValueError, match="multiple of 256"):
        to_planar(packed[:, :64])


@pytest.mark.parametrize("step_bytes", [1, 2 * 8 * 256, 1 << 30])
def test_repack_in_place_is_to_planar_in_the_same_storage(step_bytes: int, monkeypatch) -> None:
    """The GPU runner's load-time repack: one, two (of five: a short last step) or all experts per step give
    to_planar's words in the packed stack's own storage; a non-contiguous stack is refused."""
    from k3rt.kernels.moe import mxfp4_planar_layout

    monkeypatch.setattr(mxfp4_planar_layout, "REPACK_BYTES", step_bytes)
    packed = torch.randint(0, 256, (5, 8, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    want = to_planar(packed)
    words = mxfp4_planar_layout.repack_in_place(packed)
    assert torch.equal(words, want) and words.data_ptr() == packed.data_ptr()
    with pytest.raises(ValueError, match="packed must be contiguous"):
        mxfp4_planar_layout.repack_in_place(torch.zeros(4, 8, 256, dtype=torch.uint8).transpose(0, 1))


def planar_case(gen: torch.Generator, T: int, dtype: torch.dtype, big: bool = False,
                K: int = 256) -> tuple[dict, PlanarMxfp4]:
    case = mx_case(gen, T, E=4, k=2, D=K, inter=K, dtype=dtype, experts=3)
    if big:  # one group of each expert's down rows 2^20 larger (E8M0 ~ 137)
        case["w2_scale"][:, :, 0] += 20
    return case, PlanarMxfp4.from_packed(*(case[n] for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")))


@pytest.mark.parametrize("variant, big", [("mma", False), ("mma_ws", False), ("fma", False), ("fma", True)])
def test_fused_experts_mxfp4_planar_matches_ref_with_shared_expert(variant: str, big: bool) -> None:
    """Every planar variant against the reference on the compressed-tensors stacks: routed blocks with 1-3
    valid rows and a shared-expert block of 3 tokens ("fma": one pass per token). big: a scale above
    FUSED_MAX_SCALE in every expert, so "fma" scales after the decode instead of in it."""
    case, w = planar_case(torch.Generator().manual_seed(8), 3, torch.float32, big)
    assert (w.max_scale > FUSED_MAX_SCALE) == big
    ref = fused_experts_mxfp4_ref(**case, act=SITU, shared_experts=1)
    out = fused_experts_mxfp4_planar(case["x"], w, case["topk_weights"], case["topk_ids"], act=SITU,
                                     variant=variant, shared_experts=1)
    assert out.shape == (3, 256) and out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-5


# weight-tile shapes of the device grid the test above (the interpreter's 64/64, one chunk) does not run:
# (block_n1, block_n2, chunks): the runner's default, and two chunks per loop step (at 64 rows: 32 rows with
# two chunks is the same loop at the default's row tile)
@pytest.mark.parametrize("tiles", [(32, 32, 1), (64, 64, 2)], ids=str)
def test_planar_mma_ws_tile_shapes_of_the_device_grid(tiles: tuple[int, int, int]) -> None:
    """The served variant at the GPU candidates' tile shapes (warps and stages do not change what the
    interpreter computes); two chunks per step need K of two chunks (512), else the launcher takes one."""
    bn1, bn2, chunks = tiles
    assert any((t.block_n1, t.block_n2, t.chunks) == tiles for t in PLANAR_CANDIDATES["mma_ws"])
    case, w = planar_case(torch.Generator().manual_seed(9), 2, torch.float32, K=256 * chunks)
    ref = fused_experts_mxfp4_ref(**case, act=SITU, shared_experts=1)
    out = fused_experts_mxfp4_planar(case["x"], w, case["topk_weights"], case["topk_ids"], act=SITU, variant="mma_ws",
                                     shared_experts=1, tiles=PlanarTiles(16, bn1, bn2, 16, chunks, 1, 1, 1))
    assert rel_err(out, ref) <= 1e-5


def test_fused_experts_mxfp4_planar_rejects_bad_inputs() -> None:
    case, w = planar_case(torch.Generator().manual_seed(9), 2, torch.float32)
    args = (case["x"], w, case["topk_weights"], case["topk_ids"])
    with pytest.raises(ValueError, match="variant must be one of"):
        fused_experts_mxfp4_planar(*args, act=SILU, variant="tma")
    with pytest.raises(ValueError, match="'mma' needs tiles.sub_m = 16"):
        fused_experts_mxfp4_planar(*args, act=SILU, variant="mma", tiles=PlanarTiles(16, 64, 64, 4, 1, 4, 4, 1))
    with pytest.raises(ValueError, match="'fma' needs tiles.sub_m = 1"):
        fused_experts_mxfp4_planar(*args, act=SILU, variant="fma", tiles=PlanarTiles(16, 64, 64, 2, 1, 4, 4, 1))
    with pytest.raises(ValueError, match="w13_words must be"):
        fused_experts_mxfp4_planar(torch.zeros(2, 128, device=DEV), *args[1:], act=SILU)
    big = case["w2_scale"].clone()
    big[0, 0, 0] = MAX_SCALE + 1
    with pytest.raises(ValueError, match="w2_scale holds E8M0 exponent 241 > 240"):
        PlanarMxfp4.from_packed(case["w13_packed"], case["w13_scale"], case["w2_packed"], big)


# --------------------------------------------------------------------------------------------
# GPU: K3's expert shape (latent width 3584, intermediate 3072), bf16 activations

EK3, KK3, DK3, IK3 = 32, 16, 3584, 3072  # 32 of the 896 experts: enough for the routing patterns tested


def gpu_mx_case(T: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def quantized(*shape: int) -> tuple:  # one expert at a time: the fp32 weights of all would take 8 GB
        q, s = zip(*(quantize_mxfp4(torch.randn(*shape, device="cuda", generator=gen) * shape[1] ** -0.5)
                     for _ in range(EK3)))
        return torch.stack(q), torch.stack(s)
    q13, s13 = quantized(2 * IK3, DK3)
    q2, s2 = quantized(DK3, IK3)
    ids = torch.stack([torch.randperm(EK3, device="cuda", generator=gen)[:KK3] for _ in range(T)]).int()
    return dict(x=torch.randn(T, DK3, device="cuda", generator=gen).bfloat16(), w13_packed=q13, w13_scale=s13,
                w2_packed=q2, w2_scale=s2, topk_weights=torch.rand(T, KK3, device="cuda", generator=gen),
                topk_ids=ids)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 16, 64, 1024])
def test_gpu_fused_experts_mxfp4_k3(T: int) -> None:
    """tl.dot_scaled (the default on the GPU) and the explicit dequant both match the reference."""
    case = gpu_mx_case(T, seed=T)
    ref = fused_experts_mxfp4_ref(**case, act=SITU)
    for native in (None, False):
        out = fused_experts_mxfp4(**case, act=SITU, native=native)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, ref) <= 1e-2, native
        assert torch.equal(fused_experts_mxfp4(**case, act=SITU, native=native), out)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tiles", MXFP4_DECODE_CANDIDATES, ids=[f"decode{i}" for i in range(len(MXFP4_DECODE_CANDIDATES))])
def test_gpu_fused_experts_mxfp4_tile_candidates(tiles: Mxfp4Tiles) -> None:
    case = gpu_mx_case(16, seed=11)
    ref = fused_experts_mxfp4_ref(**case, act=SILU)
    for native in (True, False):
        out = fused_experts_mxfp4(**case, act=SILU, tiles=tiles, native=native)
        assert rel_err(out, ref) <= 1e-2, native


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_planar_decode_is_exact_in_every_dtype() -> None:
    """The compiled decode, every code at every accepted scale, bits read as fp32 (an fp32 subnormal for
    code 1) and as bf16 (a bf16 subnormal), times 2^112 then the group factor, or times the fused factor
    2^(s - 1): fails if a multiply flushed the subnormal inputs. From exponent 8 up: below, the weights
    themselves are fp32 subnormals, which this does not test (nor do real checkpoints hold them)."""
    packed, scale = every_code_at_every_scale("cuda")
    packed, scale = packed[8:], scale[8:]  # row r holds exponent r
    ref = dequantize_mxfp4(packed, scale)
    words = to_planar(packed)
    low = slice(0, FUSED_MAX_SCALE + 1 - 8)
    for bf16 in (False, True):
        assert torch.equal(dequantize_planar(words, scale, bf16=bf16), ref), bf16
        assert torch.equal(dequantize_planar(words[low], scale[low], bf16=bf16, fused=True), ref[low]), bf16


def gpu_planar(case: dict) -> PlanarMxfp4:
    return PlanarMxfp4.from_packed(*(case[n] for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_fused_experts_mxfp4_planar_k3(T: int) -> None:
    """Every planar variant (default tiles) in bf16 at K3's expert shape, deterministic across calls. (Every
    tile candidate is checked against the reference by benchmarks/kernels_mxfp4.py before it is timed.)"""
    case = gpu_mx_case(T, seed=20 + T)
    ref = fused_experts_mxfp4_ref(**case, act=SITU)
    w = gpu_planar(case)
    for variant in PLANAR_VARIANTS:
        out = fused_experts_mxfp4_planar(case["x"], w, case["topk_weights"], case["topk_ids"], act=SITU,
                                         variant=variant)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, ref) <= 1e-2, variant
        again = fused_experts_mxfp4_planar(case["x"], w, case["topk_weights"], case["topk_ids"], act=SITU,
                                           variant=variant)
        assert torch.equal(again, out), variant
