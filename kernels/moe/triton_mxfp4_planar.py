"""MXFP4 routed experts in a planar in-memory layout: word-wide E2M1 decode, one scale multiply per group.

Why another kernel: `triton_mxfp4.py` measured 23-30% of copy bandwidth at decode sizes (benchmarks/RESULTS.md,
2026-12-01), ALU-bound on a per-element upcast and a per-element scale. Here the weights are repacked once
at load (`PlanarMxfp4.from_packed`; the checkpoint stays compressed-tensors `mxfp4-pack-quantized`) so that:
  - a weight row is read as int32 words, 32 words (128 bytes, 256 K elements = 8 scale groups) per chunk,
    16-byte vector loads;
  - element 2i + l of group g of a chunk (l = 0, 1) is lane l (the low or high 16 bits) of word
    16 (g // 4) + i, in slot g % 4 of that lane (`SLOT_BITS`: which 4 lane bits hold the code's m, e0, e1
    and sign). Shifting and masking a whole word decodes one slot of both lanes at once, i.e. TWO adjacent
    elements of one group, so the decoded word is already the packed pair an MMA operand register holds
    (no repacking), and a chunk's 16-word half decodes into four 32-element groups;
  - the decode is a bit placement, no table and no per-element scale: the slot's bits land on the bf16
    positions of (sign << 15) | (magnitude code << 6), which read as bf16 is the E2M1 value times 2^-126
    (code 1, the E2M1 subnormal 0.5, a bf16 subnormal); one multiply by 2^112 makes it the value times
    2^-14: for bf16 activations a packed bf16 multiply per two lanes (multiplies keep bf16 subnormals), no
    conversion at all; otherwise the same bits as the top half of an fp32, multiplied in fp32. Slots 0-2
    take one shift and one mask, slot 3 three of each;
  - each group's partial dot (K = 32) is multiplied once per output by 2^(s - 127) * 2^14 = 2^(s - 113),
    the E8M0 scale and the decode's bias in one fp32 factor. That factor is a normal fp32 for s <= 240
    (weights below 2^116); `from_packed` refuses larger exponents, naming the tensor and the limit. ("fma",
    where every exponent is <= 128, folds it into the decode's multiply instead: 2^(s - 1) per plane);
  - the activations are read group by group in their natural order.
Counted in the SASS of the compiled loops (sm_90, triton 3.6; tests/kernels/test_moe_mxfp4_sm90_build.py):
3.7-4.5 instructions per weight element for the MMA variants at the default tiles (mma_ws 3.7 gate/up, 3.9
down; 32-row tiles on 2 warps run mma.sync, 64-row ones wgmma at 3.9-4.3; the decode about 1.4 of them), 5.9-6.8
for "fma". `triton_mxfp4`'s gate/up loop at its default tiles, counted the same way: 7.4 with tl.dot_scaled,
12.1 with its explicit dequant. Measured on the H200 (benchmarks/kernels_mxfp4.py, 2026-12-02, K3's expert
shape, bf16 activations): mma_ws at its default tiles 45% of copy bandwidth at M = 1-4 rows per expert, 37% at
M = 16, 58% for a random routing of 16 tokens; dot_scaled 23-31%. The GPU runner serves it
(`PLANAR_SERVE_VARIANT`, backend/runner/gpu/ffn.py).

Three ways to use the decoded planes (`variant`):
  - "mma": tl.dot(plane [BN, 32], A^T [32, BM]) per group, the weight rows on the MMA's M side, BM = 16,
    the group factor on each group's [BN, BM] result;
  - "mma_ws": the same dots chained in one accumulator, the factor applied to the decoded plane (in bf16 for
    bf16 planes: exact, a power of two on a 3-bit significand) so no MMA waits for an epilogue;
  - "fma": CUDA-core dot, one token per pass over the weights (only the block's valid rows): each plane,
    times its group factor, is multiplied into an fp32 [BN, 32] accumulator, reduced over K once at the end.
    For blocks of 1-2 tokens, where an MMA would multiply mostly padding.
The alignment, the activation epilogues and the per-token slot sum are `triton_experts`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import INTERPRET, check, check_same_device, poison_like
# the layout itself (torch only); SLOT_BITS, to_planar and from_planar are re-exported with the kernels
from k3rt.kernels.moe.mxfp4_planar_layout import CHUNK, SLOT_BITS, from_planar, repack_in_place, to_planar  # noqa: F401
from k3rt.kernels.moe.mxfp4_ref import GROUP
from k3rt.kernels.moe.triton_experts import (PER_STEP, SumNorm, _act_mul, align_blocks, check_routing, check_x,
                                            sum_slots)
from k3rt.model_config import ActivationConfig

MAX_SCALE = 240  # the largest E8M0 exponent whose group factor 2^(s - 113) is a normal fp32
# the largest whose 2^(s - 1) is a bf16/fp32 (the decode's multiply carrying the scale: weights below 16)
FUSED_MAX_SCALE = 128
PLANAR_VARIANTS = ("mma", "mma_ws", "fma")
# what the GPU runner serves MXFP4 experts with (its default tiles, PLANAR_CANDIDATES): the fastest variant at
# every decode routing measured (benchmarks/kernels_mxfp4.py on the H200, 2026-12-02)
PLANAR_SERVE_VARIANT = "mma_ws"


@dataclass(frozen=True)
class PlanarMxfp4:
    """One layer's routed experts in the planar layout: w13 (gate rows, then up rows) and w2 as int32 words,
    the E8M0 scales unchanged ([E, N, K/32] uint8)."""

    w13_words: Tensor  # [E, 2I, D/8] int32
    w13_scale: Tensor  # [E, 2I, D/32] uint8
    w2_words: Tensor  # [E, D, I/8] int32
    w2_scale: Tensor  # [E, D, I/32] uint8
    max_scale: int  # the largest E8M0 exponent of both: whether the kernels may fuse the scale (FUSED_MAX_SCALE)

    @staticmethod
    def unfit(w13_packed: Tensor, w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor) -> str | None:
        """Why these stacks cannot take the planar layout (None: they can): K of either weight not a multiple
        of `CHUNK`, or an E8M0 exponent above `MAX_SCALE`."""
        for name, p in (("w13_packed", w13_packed), ("w2_packed", w2_packed)):
            if p.dtype != torch.uint8 or p.dim() != 3:
                return f"{name} must be uint8 [E, N, K/2], got {p.dtype} {list(p.shape)}"
            if (2 * p.shape[2]) % CHUNK:
                return f"{name}: K={2 * p.shape[2]} is not a multiple of {CHUNK} (the planar chunk)"
        for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if s.dtype != torch.uint8:
                return f"{name} must be uint8, got {s.dtype}"
            top = int(s.max()) if s.numel() else 0
            if top > MAX_SCALE:
                return (f"{name} holds E8M0 exponent {top} > {MAX_SCALE}: the planar kernel's group factor "
                        f"2^(s - 113) would overflow fp32 (weights of 2^{top - 127 + 2} and up)")
        return None

    @staticmethod
    def from_packed(w13_packed: Tensor, w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor, *,
                    in_place: bool = False) -> PlanarMxfp4:
        """Repack a layer's compressed-tensors stacks, one expert at a time (the unpacked codes of a whole
        stack would be 2x its size again). in_place: the words overwrite the packed stacks' own storage (the
        GPU runner at load: no second copy; the packed tensors then hold words). Refuses what `unfit` names."""
        why = PlanarMxfp4.unfit(w13_packed, w13_scale, w2_packed, w2_scale)
        if why is not None:
            raise ValueError(why)
        tops = [int(s.max()) if s.numel() else 0 for s in (w13_scale, w2_scale)]

        def stack(p: Tensor) -> Tensor:
            if in_place:
                return repack_in_place(p)
            return torch.stack([to_planar(p[e]) for e in range(p.shape[0])]) if p.shape[0] else \
                torch.empty(*p.shape[:-1], p.shape[-1] // 4, dtype=torch.int32, device=p.device)
        return PlanarMxfp4(stack(w13_packed), w13_scale.contiguous(), stack(w2_packed), w2_scale.contiguous(),
                           max(tops))


@dataclass(frozen=True)
class PlanarTiles:
    """block_m: the alignment's rows per block (>= 16, a power of two); sub_m: rows per pass over the weights
    (1 for "fma", block_m for the MMA variants); block_n1/block_n2: weight rows per program of the
    gate/up and the down GEMM (each gate/up program does a gate and an up tile); chunks: 256-element K
    chunks per loop step (more bytes in flight per step)."""

    block_m: int
    block_n1: int
    block_n2: int
    sub_m: int
    chunks: int
    num_warps1: int
    num_warps2: int
    num_stages: int


# the first of each variant's candidates is its default. MMA variants: 16/32/32/16/1/2/2/3 measured fastest
# for both on the H200 at K3's expert shape (benchmarks/kernels_mxfp4.py, 2026-12-02: mma_ws 153 / 156 / 187 us
# at M = 1 / 4 / 16 rows per expert, 1309 us random T=16, against 163 / 165 / 192 / 1338 us at 16/64/64/16/1/4/4/3:
# more, smaller programs keep more weight loads in flight over the 132 SMs). The last three are not measured
# yet: ways to put more bytes in flight per SM than the default's 2-warp programs, whose gate/up shared memory
# (32 KB at 3 stages, sm_90 build; the activation tile takes as much as the weights) lets ~7 programs, 14 warps,
# reside per SM: 2 stages (16 KB: ~14 programs, and 3.6 / 3.9 SASS instructions per element against 3.7 / 3.9),
# 4 stages (48 KB), two chunks per loop step (64 KB, 3.5 / 3.8). 16/64/64/16/1/8/8/3 measured slowest at every
# routing (376 us at M = 1) and left the grid for them.
_MMA_CANDIDATES = (PlanarTiles(16, 32, 32, 16, 1, 2, 2, 3),
                   PlanarTiles(16, 64, 64, 16, 1, 4, 4, 3),
                   PlanarTiles(16, 128, 128, 16, 1, 8, 8, 3),
                   PlanarTiles(16, 64, 64, 16, 2, 4, 4, 2),
                   PlanarTiles(16, 32, 32, 16, 1, 2, 2, 2),
                   PlanarTiles(16, 32, 32, 16, 1, 2, 2, 4),
                   PlanarTiles(16, 32, 32, 16, 2, 2, 2, 3))
PLANAR_CANDIDATES = {
    "mma": _MMA_CANDIDATES,
    "mma_ws": _MMA_CANDIDATES,
    "fma": (PlanarTiles(16, 32, 32, 1, 1, 4, 4, 3),
            PlanarTiles(16, 64, 64, 1, 1, 4, 4, 3),
            PlanarTiles(16, 16, 16, 1, 1, 2, 2, 3),
            PlanarTiles(16, 64, 64, 1, 1, 8, 8, 3),
            PlanarTiles(16, 32, 32, 1, 2, 4, 4, 2)),
}
# the interpreter's: few programs (its cost is per program and per op)
PLANAR_INTERPRET_TILES = {"mma": (PlanarTiles(16, 64, 64, 16, 1, 4, 4, 1),),
                          "mma_ws": (PlanarTiles(16, 64, 64, 16, 1, 4, 4, 1),),
                          "fma": (PlanarTiles(16, 64, 64, 1, 1, 4, 4, 1),)}


@triton.jit
def _plane(w, p: tl.constexpr, BF16: tl.constexpr):
    """int32 words [R, 16] of a chunk's half -> the group of slot p (p < 4) [R, 32], the E2M1 values times
    2^-126. Both 16-bit lanes of a word at once (elements 2i and 2i + 1: the word is already the packed pair
    an MMA operand register holds): the slot's bits land on the bf16 positions of (sign << 15) | (magnitude
    << 6), read as bf16 (code 1 a bf16 subnormal) or, BF16=False, as the top half of an fp32 (code 1 an fp32
    subnormal). The caller's one multiply brings them to scale: multiplies keep subnormals (no flush-to-zero
    in Triton's float multiplies; in bf16 a packed multiply per two lanes). `SLOT_BITS` has the layout."""
    u = w.to(tl.uint32, bitcast=True)
    if p == 0:
        bits = (u << 6) & 0x81C081C0
    elif p == 1:
        bits = (u << 3) & 0x81C081C0
    elif p == 2:
        bits = u & 0x81C081C0
    else:
        bits = ((u >> 4) & 0x00C000C0) | ((u >> 5) & 0x01000100) | ((u << 1) & 0x80008000)
    if BF16:
        return tl.interleave(bits.to(tl.uint16), (bits >> 16).to(tl.uint16)).to(tl.bfloat16, bitcast=True)
    else:
        return tl.interleave(bits << 16, bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _factor(s):
    """E8M0 exponent s (<= 240) -> the fp32 2^(s - 127) * 2^14: the group scale and the planes' 2^-14."""
    return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fused_factor(s, BF16: tl.constexpr):
    """E8M0 exponent s (<= FUSED_MAX_SCALE) -> 2^(s - 1) = 2^(s - 127) * 2^126, in bf16 or fp32: the group
    scale and the decode's bias in the one multiply that turns `_plane`'s bits into the weights."""
    f = ((s.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True)
    return f.to(tl.bfloat16) if BF16 else f  # exact: a power of two in bf16's range


@triton.jit
def _group(acc, plane, f, a, FMA: tl.constexpr, WSCALE: tl.constexpr, FUSED: tl.constexpr,
           DOT_PRECISION: tl.constexpr):
    """One 32-element group: plane [BN, 32] (fp32 for FMA, else the activations' dtype), the weights if FUSED
    (FMA only), else the weights over f [BN] (its rows' fp32 factors). MMA: a [32, SM] A^T's rows of the group,
    acc [BN, SM] += dot(plane, a) * f; WSCALE: acc = dot(plane * f, a, acc) (the factor on the weights: the
    MMAs chain in one accumulator, none waits for an epilogue); FMA: a [1, 32] one token's activations,
    acc [BN, 32] += (plane * f) * a (reduced over K after the loop)."""
    if FMA:
        if FUSED:
            acc += plane * a.to(tl.float32)
        else:
            acc += (plane * f[:, None]) * a.to(tl.float32)
    elif WSCALE:
        if plane.dtype == tl.bfloat16:
            wt = plane * f.to(tl.bfloat16)[:, None]
        else:  # fp32 planes, or fp16 ones whose range may not hold the factor
            wt = (plane.to(tl.float32) * f[:, None]).to(a.dtype)
        acc = tl.dot(wt, a, acc, input_precision=DOT_PRECISION)
    else:
        acc += tl.dot(plane, a, input_precision=DOT_PRECISION) * f[:, None]
    return acc


@triton.jit
def _chunk(acc, w_ptrs, s_ptrs, a_ptrs, w_mask, a_mask, FMA: tl.constexpr, WSCALE: tl.constexpr,
           FUSED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += one chunk: w_ptrs [BN, 16] its first 16 int32 words per row (groups 0-3; the next 16 hold
    groups 4-7), s_ptrs [BN] its rows' first group scale, a_ptrs A^T's rows of group 0 ([32, SM]; FMA:
    [1, 32]), group g at + 32 g. FUSED: each plane times 2^(s - 1) is the weights (one multiply); else
    times 2^112 (the weights times 2^-14), the group's `_factor` applied by `_group`."""
    DT: tl.constexpr = tl.float32 if FMA else a_ptrs.dtype.element_ty
    BF16: tl.constexpr = DT == tl.bfloat16
    wa = tl.load(w_ptrs, mask=w_mask[:, None], other=0)
    wb = tl.load(w_ptrs + 16, mask=w_mask[:, None], other=0)
    for p in tl.static_range(4):
        for half in tl.static_range(2):
            g = p + 4 * half
            raw = _plane(wb if half else wa, p, BF16)
            s = tl.load(s_ptrs + g, mask=w_mask, other=0)
            f = _factor(s)
            if FUSED:
                plane = (raw * _fused_factor(s, BF16)[:, None]).to(DT)
            elif BF16:
                plane = raw * tl.full([1, 1], 2.0 ** 112, tl.float32).to(tl.bfloat16)
            else:
                plane = (raw * 2.0 ** 112).to(DT)
            a = tl.load(a_ptrs + 32 * g, mask=a_mask, other=0.0)
            acc = _group(acc, plane, f, a, FMA, WSCALE, FUSED, DOT_PRECISION)
    return acc


@triton.jit
def _sub_rows(pid_m, first, n_valid, sorted_ptr, P, T, NB_ROUTED, NB_SHARED,
              TOPK: tl.constexpr, BLOCK_M: tl.constexpr, SUB_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """Rows first .. first + SUB_M of block pid_m: (slot offsets, pair ids, token ids, validity). The valid
    rows of a block are a prefix (the alignment pads each expert's run at its end; shared blocks cover the
    tokens in order), n_valid long; `triton_experts._block_rows` has the layout."""
    r = first + tl.arange(0, SUB_M)
    offs_m = pid_m * BLOCK_M + r
    ok = r < n_valid
    if pid_m < NB_ROUTED:
        if PAIR_BLOCKS:  # routed block b is pair b alone (triton_experts.align_blocks)
            pair = tl.where(ok, pid_m, P)
        else:
            pair = tl.load(sorted_ptr + offs_m, mask=ok, other=P)
        tok = pair // TOPK
    else:
        j = pid_m - NB_ROUTED
        tok = (j % NB_SHARED) * BLOCK_M + r
        pair = P + (j // NB_SHARED) * T + tok
    return offs_m, pair, tl.where(ok, tok, 0).to(tl.int64), ok


@triton.jit
def _n_valid(pid_m, block_expert_ptr, sorted_ptr, P, T, NB_ROUTED, NB_SHARED, E_ROUTED, BLOCK_M: tl.constexpr,
             PAIR_BLOCKS: tl.constexpr):
    """Block pid_m's expert (-1: unused) and its number of valid rows."""
    r = tl.arange(0, BLOCK_M)
    if pid_m < NB_ROUTED:
        e = tl.load(block_expert_ptr + pid_m)
        if PAIR_BLOCKS:
            n = tl.full([], 1, tl.int32)
        else:
            pair = tl.load(sorted_ptr + pid_m * BLOCK_M + r, mask=e >= 0, other=P)
            n = tl.sum((pair < P).to(tl.int32))
    else:
        j = pid_m - NB_ROUTED
        e = E_ROUTED + j // NB_SHARED
        n = tl.sum(((j % NB_SHARED) * BLOCK_M + r < T).to(tl.int32))
    return e, n


@triton.jit
def _finish(acc, FMA: tl.constexpr):
    """The [BN, SM] result: FMA's [BN, 32] partial products summed over K (SM = 1)."""
    return tl.sum(acc, axis=1)[:, None] if FMA else acc


@triton.jit(do_not_specialize=PER_STEP)
def _moe_gate_up_planar_kernel(
    x_ptr, stride_xt,  # [T, D]
    w_ptr, stride_w,  # [E, 2I, D/8] int32 planar words; stride_w = D/8
    s_ptr, stride_s,  # [E, 2I, D/32] uint8; stride_s = D/32
    h_ptr,  # [S, I]
    sorted_ptr, block_expert_ptr,
    P, D, I,
    beta, lin_beta,
    T, NB_ROUTED, NB_SHARED, E_ROUTED,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,  # D % (256 * CHUNKS) == 0 (the launcher picks it)
    FMA: tl.constexpr,
    WSCALE: tl.constexpr,  # the group factor on the decoded weights (one MMA chain), not on each group's dot
    FUSED: tl.constexpr,  # FMA with every scale <= FUSED_MAX_SCALE: the factor in the decode's multiply
    SITU: tl.constexpr,
    LIN_SAT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(I, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    e, n_valid = _n_valid(pid_m, block_expert_ptr, sorted_ptr, P, T, NB_ROUTED, NB_SHARED, E_ROUTED, BLOCK_M,
                          PAIR_BLOCKS)
    if e >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        rows = e.to(tl.int64) * (2 * I) + offs_n.to(tl.int64)  # gate rows; the up rows are + I
        offs_j = tl.arange(0, 32)
        gw_ptrs = w_ptr + rows[:, None] * stride_w + tl.arange(0, 16)[None, :]  # [BN, 16]
        uw_ptrs = gw_ptrs + I * stride_w
        gs_ptrs = s_ptr + rows * stride_s  # [BN]
        us_ptrs = gs_ptrs + I * stride_s
        for first in range(0, n_valid, SUB_M):
            offs_m, _, tok, ok = _sub_rows(pid_m, first, n_valid, sorted_ptr, P, T, NB_ROUTED, NB_SHARED,
                                           TOPK, BLOCK_M, SUB_M, PAIR_BLOCKS)
            if FMA:  # one token: its activations as a row [1, 32], the accumulator [BN, 32]
                xa_ptrs = x_ptr + tok[:, None] * stride_xt + offs_j[None, :]
                a_mask = ok[:, None]
                acc_g = tl.zeros([BLOCK_N, 32], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_N, 32], dtype=tl.float32)
            else:
                xa_ptrs = x_ptr + tok[None, :] * stride_xt + offs_j[:, None]  # [32, SM]: A^T's rows of group 0
                a_mask = ok[None, :]
                acc_g = tl.zeros([BLOCK_N, SUB_M], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_N, SUB_M], dtype=tl.float32)
            for c0 in range(0, D // 256, CHUNKS):
                for ci in tl.static_range(CHUNKS):
                    c = c0 + ci
                    xc_ptrs = xa_ptrs + c * 256
                    acc_g = _chunk(acc_g, gw_ptrs + c * 32, gs_ptrs + c * 8, xc_ptrs, n_ok, a_mask, FMA, WSCALE,
                                   FUSED, DOT_PRECISION)
                    acc_u = _chunk(acc_u, uw_ptrs + c * 32, us_ptrs + c * 8, xc_ptrs, n_ok, a_mask, FMA, WSCALE,
                                   FUSED, DOT_PRECISION)
            g = _finish(acc_g, FMA)
            u = _finish(acc_u, FMA)
            h = _act_mul(g, u, beta, lin_beta, SITU, LIN_SAT)  # [BN, SM]
            h_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + offs_n[:, None]
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[:, None] & ok[None, :])


@triton.jit(do_not_specialize=PER_STEP)
def _moe_down_planar_kernel(
    h_ptr,  # [S, I]
    w_ptr, stride_w,  # [E, D, I/8] int32 planar words; stride_w = I/8
    s_ptr, stride_s,  # [E, D, I/32] uint8
    y_ptr,  # [P + S*T, D]
    topk_w_ptr,
    sorted_ptr, block_expert_ptr,
    P, D, I,
    T, NB_ROUTED, NB_SHARED, E_ROUTED,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,  # I % (256 * CHUNKS) == 0
    FMA: tl.constexpr,
    WSCALE: tl.constexpr,
    FUSED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(D, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    e, n_valid = _n_valid(pid_m, block_expert_ptr, sorted_ptr, P, T, NB_ROUTED, NB_SHARED, E_ROUTED, BLOCK_M,
                          PAIR_BLOCKS)
    if e >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        rows = e.to(tl.int64) * D + offs_n.to(tl.int64)
        offs_j = tl.arange(0, 32)
        w_ptrs = w_ptr + rows[:, None] * stride_w + tl.arange(0, 16)[None, :]  # [BN, 16]
        s_ptrs = s_ptr + rows * stride_s
        for first in range(0, n_valid, SUB_M):
            offs_m, pair, _, ok = _sub_rows(pid_m, first, n_valid, sorted_ptr, P, T, NB_ROUTED, NB_SHARED,
                                            TOPK, BLOCK_M, SUB_M, PAIR_BLOCKS)
            if FMA:
                ha_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * I + offs_j[None, :]  # [1, 32]
                a_mask = ok[:, None]
                acc = tl.zeros([BLOCK_N, 32], dtype=tl.float32)
            else:
                ha_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * I + offs_j[:, None]  # [32, SM]
                a_mask = ok[None, :]
                acc = tl.zeros([BLOCK_N, SUB_M], dtype=tl.float32)
            for c0 in range(0, I // 256, CHUNKS):
                for ci in tl.static_range(CHUNKS):
                    c = c0 + ci
                    acc = _chunk(acc, w_ptrs + c * 32, s_ptrs + c * 8, ha_ptrs + c * 256, n_ok, a_mask, FMA, WSCALE,
                                 FUSED, DOT_PRECISION)
            acc = _finish(acc, FMA)
            rw = tl.load(topk_w_ptr + pair, mask=ok & (pid_m < NB_ROUTED), other=1.0)
            y = acc * rw[None, :]
            y_ptrs = y_ptr + pair[None, :].to(tl.int64) * D + offs_n[:, None]
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=ok[None, :] & n_ok[:, None])


@triton.jit
def _dequant_planar_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                           FUSED: tl.constexpr):
    """out [N, K] fp32 = the planar weight, decoded by `_plane` (bf16 or fp32 bits) and scaled as the GEMMs
    do: FUSED, times `_fused_factor`; else times 2^112 and `_factor`."""
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * (K // 8) + c * 32 + tl.arange(0, 16)[None, :]
    wa = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
    wb = tl.load(w_ptrs + 16, mask=n_ok[:, None], other=0)
    for p in tl.static_range(4):
        for half in tl.static_range(2):
            g = p + 4 * half
            raw = _plane(wb if half else wa, p, BF16)
            s = tl.load(s_ptr + offs_n * (K // 32) + c * 8 + g, mask=n_ok, other=0)
            if FUSED:
                v = (raw * _fused_factor(s, BF16)[:, None]).to(tl.float32)
            elif BF16:
                v = (raw * tl.full([1, 1], 2.0 ** 112, tl.float32).to(tl.bfloat16)).to(tl.float32)
                v = v * _factor(s)[:, None]
            else:
                v = raw * 2.0 ** 112 * _factor(s)[:, None]
            out = out_ptr + offs_n[:, None] * K + c * 256 + 32 * g + tl.arange(0, 32)[None, :]
            tl.store(out, v, mask=n_ok[:, None])


def dequantize_planar(words: Tensor, scale: Tensor, bf16: bool = False, fused: bool = False) -> Tensor:
    """Planar words int32 [N, K/8] + scales uint8 [N, K/32] -> W [N, K] fp32, through the GEMMs' own decode:
    the bits read as bf16 (bf16=True, as the bf16 MMA variants run it) or fp32, scaled by the one fused
    multiply (fused=True: scales <= FUSED_MAX_SCALE) or by 2^112 and the group factor. Equal to
    `mxfp4_ref.dequantize_mxfp4` of the compressed-tensors codes for the scales each path accepts."""
    N, K8 = words.shape
    K = 8 * K8
    check(words, "words", (N, K8), torch.int32)
    check(scale, "scale", (N, K // GROUP), torch.uint8)
    out = poison_like(torch.empty(N, K, dtype=torch.float32, device=words.device))
    bn = 16
    _dequant_planar_kernel[(triton.cdiv(N, bn), K // CHUNK)](words.contiguous(), scale.contiguous(), out, N, K,
                                                             BLOCK_N=bn, BF16=bf16, FUSED=fused)
    return out


def _chunks_per_step(want: int, K: int) -> int:
    c = want
    while c > 1 and (K // CHUNK) % c:
        c //= 2
    return c


def fused_experts_mxfp4_planar(
    x: Tensor,
    w: PlanarMxfp4,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    act: ActivationConfig,
    variant: str = "mma",
    out: Tensor | None = None,
    norm: SumNorm | tuple[Tensor, float] | None = None,
    shared_experts: int = 0,
    use_pdl: bool = False,
    tiles: PlanarTiles | None = None,
) -> Tensor:
    """Routed experts of one MoE layer for T tokens with planar MXFP4 weights (`PlanarMxfp4.from_packed`);
    the contract of `triton_mxfp4.fused_experts_mxfp4` otherwise (oracle: `mxfp4_ref.fused_experts_mxfp4_ref`
    on the compressed-tensors stacks). D and I must be multiples of 256.

    variant: "mma" (tl.dot per group, the factor on its result), "mma_ws" (the factor on the decoded weights,
        one chained MMA accumulator) or "fma" (CUDA-core dot, one token per pass); module doc.
    use_pdl: the alignment and the slot sum only (these two GEMMs do not wait on their predecessor).
    """
    if variant not in PLANAR_VARIANTS:
        raise ValueError(f"variant must be one of {PLANAR_VARIANTS}, got {variant!r}")
    T, D = check_x(x)
    if w.w13_words.dim() != 3 or w.w13_words.shape[2] * 8 != D or w.w13_words.shape[1] % 2:
        raise ValueError(f"w13_words must be [E, 2I, D/8={D // 8}] int32, got {list(w.w13_words.shape)}")
    E, I = w.w13_words.shape[0], w.w13_words.shape[1] // 2
    if D % CHUNK or I % CHUNK:
        raise ValueError(f"planar MXFP4 experts need D and I to be multiples of {CHUNK}, got D={D}, I={I}")
    check(w.w13_words, "w13_words", (E, 2 * I, D // 8), torch.int32)
    check(w.w13_scale, "w13_scale", (E, 2 * I, D // GROUP), torch.uint8)
    check(w.w2_words, "w2_words", (E, D, I // 8), torch.int32)
    check(w.w2_scale, "w2_scale", (E, D, I // GROUP), torch.uint8)
    for name in ("w13_words", "w13_scale", "w2_words", "w2_scale"):
        if not getattr(w, name).is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    k = check_routing(x, topk_weights, topk_ids, act, shared_experts, E, out, norm)
    check_same_device(x=x, w13_words=w.w13_words, w13_scale=w.w13_scale, w2_words=w.w2_words,
                      w2_scale=w.w2_scale, topk_weights=topk_weights, topk_ids=topk_ids, out=out)
    cfg = tiles or (PLANAR_INTERPRET_TILES if INTERPRET else PLANAR_CANDIDATES)[variant][0]
    fma = variant == "fma"
    if cfg.sub_m != (1 if fma else cfg.block_m):
        raise ValueError(f"variant {variant!r} needs tiles.sub_m = {1 if fma else cfg.block_m} "
                         f"({'one token per pass' if fma else 'the block in one pass'}), got {cfg.sub_m}")
    if out is None:
        out = poison_like(torch.empty(T, D, dtype=x.dtype, device=x.device))
    P = T * k
    if P == 0:
        return out
    S = shared_experts
    b = align_blocks(x, topk_ids, E, I, S, cfg.block_m, use_pdl)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # "fma": the scale in the decode's one multiply where every factor 2^(s - 1) fits fp32 (weights below
    # 16). Not for "mma_ws": there the per-row bf16 factor on the plane took a round trip through shared
    # memory in the sm_90 build (5.0 SASS instructions per element against 3.9 with the separate multiplies);
    # at the 32-row mma.sync default no round trip, but still more: 4.1 / 4.4 (gate/up, down) against 3.7 / 3.9
    fused = variant == "fma" and w.max_scale <= FUSED_MAX_SCALE
    situ = act.name == "situ"
    bn1 = min(cfg.block_n1, triton.next_power_of_2(I))
    _moe_gate_up_planar_kernel[(b.num_blocks * triton.cdiv(I, bn1),)](
        x, x.stride(0), w.w13_words, D // 8, w.w13_scale, D // GROUP, b.h, b.sorted_ids, b.block_expert, P, D, I,
        float(act.situ_beta or 1.0), float(act.situ_linear_beta or 1.0), *b.args,
        TOPK=k, BLOCK_M=cfg.block_m, SUB_M=cfg.sub_m, BLOCK_N=bn1, CHUNKS=_chunks_per_step(cfg.chunks, D),
        FMA=fma, WSCALE=variant == "mma_ws", FUSED=fused, SITU=situ, LIN_SAT=situ and act.situ_linear_beta is not None,
        DOT_PRECISION=precision, PAIR_BLOCKS=b.pair_blocks,
        num_warps=cfg.num_warps1, num_stages=cfg.num_stages,
    )
    bn2 = min(cfg.block_n2, triton.next_power_of_2(D))
    _moe_down_planar_kernel[(b.num_blocks * triton.cdiv(D, bn2),)](
        b.h, w.w2_words, I // 8, w.w2_scale, I // GROUP, b.y, topk_weights, b.sorted_ids, b.block_expert,
        P, D, I, *b.args,
        TOPK=k, BLOCK_M=cfg.block_m, SUB_M=cfg.sub_m, BLOCK_N=bn2, CHUNKS=_chunks_per_step(cfg.chunks, I),
        FMA=fma, WSCALE=variant == "mma_ws", FUSED=fused, DOT_PRECISION=precision, PAIR_BLOCKS=b.pair_blocks,
        num_warps=cfg.num_warps2,
        num_stages=cfg.num_stages,
    )
    return sum_slots(b.y, out, k, S, use_pdl, norm)
