"""Skinny linear (Triton): y [M, N] = x [M, K] @ w [N, K]^T for M <= MAX_ROWS rows, fp32 accumulation.

At decode batch 1 every projection is a matrix-vector product that reads the weight once: the time
is bytes / bandwidth plus a launch, and a library GEMM picks tiles made for matrices. Here one
program owns BLOCK_N output columns and walks the whole K: it streams its [BLOCK_N, BLOCK_K] weight
tiles once, multiplies them elementwise with the M input rows and keeps [M, BLOCK_N, BLOCK_K] fp32
partial products in registers, reducing over K only at the end (no shuffles in the loop). No split
over K, so no atomics and no second pass: the result is a pure function of the inputs (the router's
expert choice must not depend on timing).

The weight may be 16-bit or fp32 and the output any float dtype: the MoE router is the same kernel
with its fp32 weight and an fp32 output (bf16 x is upcast in registers, so no separate cast kernel).
Oracle: `ref.skinny_linear_ref`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import CTA_FENCE, INTERPRET, check, check_same_device, fence_cta, pdl_kwargs, poison_like
from k3rt.kernels.linear import PREFETCH_FORMS, UNROLLED_ROWS

MAX_ROWS = 16
# the [BLOCK_M, BLOCK_N, BLOCK_K] fp32 partial products a program keeps in registers: BLOCK_K shrinks to keep
# them at most this many (64 per thread at 4 warps) when more rows or columns would spill
MAX_PARTIALS = 8192


@dataclass(frozen=True)
class GemvTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # one row of x: K unrolled (a compile per K), block_n rows a program, a warp per row (`rows_dot`); more rows use
    # the plain form
    unrolled: bool = False


# per-program bytes in flight ~ block_n * block_k * 2 B * stages; enough programs to cover the SMs
DEFAULT_TILES = GemvTiles(4, 512, 4, 4)
CANDIDATES = (DEFAULT_TILES, GemvTiles(8, 256, 4, 4), GemvTiles(2, 1024, 4, 4), GemvTiles(2, 256, 4, 4),
              GemvTiles(4, 256, 4, 6), GemvTiles(8, 512, 8, 3), GemvTiles(16, 256, 8, 3), GemvTiles(1, 1024, 2, 4),
              # the unrolled form (session 40, not timed yet): a 16-byte load per lane a K step (bf16: 256)
              GemvTiles(2, 256, 2, 1, True), GemvTiles(4, 256, 4, 1, True), GemvTiles(1, 256, 1, 1, True),
              GemvTiles(4, 512, 4, 1, True))
INTERPRET_TILES = GemvTiles(4, 32, 4, 1)


def pick_tiles(n: int, k: int) -> GemvTiles:
    """H200, M=1 (benchmarks/kernels_linear.py, RESULTS.md): 2 columns x 1024 per program for
    outputs up to 4096 wide (attention output, dense down: 1.2x faster than cuBLAS), one column per
    program (2 warps) for the narrow router; for short rows (K <= 512: k3-tiny's projections, 64 to 2048
    outputs) 4 columns x 512, 0.3-0.6 us faster per call there (session 24, `--model k3-tiny`)."""
    if INTERPRET:
        return INTERPRET_TILES
    if k <= 512 and 64 <= n <= 2048:
        return DEFAULT_TILES
    if n < 1024:
        return GemvTiles(1, 1024, 2, 4)
    return GemvTiles(2, 1024 if k >= 1024 else 256, 4, 4)


def unrolled_tiles(rows: int) -> GemvTiles:
    """The unrolled form at `rows` weight rows a program, a warp each, one 16-byte load a lane a K step."""
    if rows not in UNROLLED_ROWS:
        raise ValueError(f"unrolled GEMV rows a program must be one of {UNROLLED_ROWS}, got {rows}")
    return GemvTiles(rows, 256, rows, 1, True)


def pick_unrolled(n: int, k: int) -> GemvTiles | None:
    """One row of x by the unrolled form where it led on the H100 (session 45, kernels_linear.py --rows 1, every
    candidate; us): one row a program for K up to 3072 (the 48B's K = 2304: KDA input 21.8 against cuBLAS 24.7 and
    the looped default 27.4, MLA input 12.6 / 13.9 / 16.1, dense gate/up 30.7 / 34.3 / 37.8, LM head 241 / 265 /
    290, fp32 router 3.2 / 6.7 / 3.9), four for K up to 512 (the gates' up-projections: 2.2 / 3.2 / 3.1, block-diag
    3.3 / 4.2); None past 3072 (o_proj, K = 4096: the looped 2 x 1024 tiles 9.0 against 9.7; dense down 17.4 / 19.5),
    where pick_tiles' choice stays (KernelConfig.gemv_unrolled)."""
    if k <= 512:
        return unrolled_tiles(4)
    if k <= 3072:
        return unrolled_tiles(1)
    return None


def block_k(tiles: GemvTiles, block_m: int, k: int) -> int:
    """The K step a launch uses: the tile's, no longer than K (rounded up to a power of two, >= 16), and short
    enough that the [block_m, block_n, K step] fp32 partial products stay within MAX_PARTIALS."""
    return min(tiles.block_k, max(16, triton.next_power_of_2(k)), max(16, MAX_PARTIALS // (block_m * tiles.block_n)))


def prefer_skinny(m: int, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, wide: bool = False) -> bool:
    """Where the kernel beat torch's matmul on the H200 (benchmarks/kernels_linear.py), for 16-bit
    activations: one row and outputs up to 4096 wide, and the fp32-weight router at any M <= MAX_ROWS
    (torch needs a cast kernel there, and at M = 16 cuBLAS ran a SIMT sgemm of 4 thread blocks: 11.5 us for
    a 2.4 MB weight, session 24's 48B batch-16 profile). For wide outputs at M=1 and for M > 1, cuBLAS's tiles are as
    fast or faster. fp32 activations (the test checkpoints) stay on torch: nothing was measured there,
    and their reference numerics are cuBLAS's. wide (KernelConfig.gemv_wide, with the unrolled tiles): one row at
    any output width."""
    if not 1 <= m <= MAX_ROWS or x_dtype not in (torch.bfloat16, torch.float16):
        return False
    return w_dtype == torch.float32 or (m == 1 and (n <= 4096 or wide))


@triton.jit
def rows_dot(w_ptr, rows, row_ok, x_ptr, stride, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[R] fp32: the weight rows at w_ptr + rows * stride (rows: int64 row numbers; K columns each) dotted with
    x[0:K]; masked rows give 0. K is unrolled (the model's D or I): one basic block, so the compiler issues the
    loads of later steps (and later calls) ahead of the math. BLOCK_K is one 16-byte load per lane, so with at least
    num_warps rows each warp holds whole rows and the sum over K never crosses warps (no CTA barrier)."""
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    # x read in the weights' [R, BLOCK_K] shape (each warp its own copy, from the L1): a [BLOCK_K] vector broadcast
    # over the rows would take a layout conversion through shared memory, two CTA barriers a step
    x_rows = tl.zeros_like(rows)[:, None]
    acc = tl.zeros([rows.shape[0], BLOCK_K], dtype=tl.float32)
    for c in tl.static_range((K + BLOCK_K - 1) // BLOCK_K):
        k = c * BLOCK_K + offs_k
        if (c + 1) * BLOCK_K <= K:
            w = tl.load(w_ptr + rows[:, None] * stride + k, mask=row_ok[:, None], other=0.0)
            x = tl.load(x_ptr + x_rows + k)
        else:
            w = tl.load(w_ptr + rows[:, None] * stride + k, mask=row_ok[:, None] & (k < K), other=0.0)
            x = tl.load(x_ptr + x_rows + k, mask=(x_rows == 0) & (k < K), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)
    return tl.sum(acc, axis=1)


def rows_dot_step(w: Tensor, k: int, loads: int = 1) -> int:
    """`rows_dot`'s K step for weight w: `loads` 16-byte loads a lane across a warp (bf16: 256 columns a load), no
    wider than K needs; 16 under the interpreter (several masked steps on the tests' small shapes)."""
    if INTERPRET:
        return 16
    return min(32 * loads * 16 // w.element_size(), max(16, triton.next_power_of_2(k)))


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, stride_wn, y_ptr, N, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                      TRIGGER: tl.constexpr = False, USE_PDL: tl.constexpr = False, L2_LINES: tl.constexpr = 0):
    """The unrolled form (GemvTiles.unrolled, one row of x): ROWS weight rows a program through `rows_dot`. USE_PDL:
    gdc_wait before x is read; L2_LINES > 0 (skinny_linear prefetch="l2"): the rows asked into the L2 before it."""
    if TRIGGER:
        gdc_launch_dependents()
    if L2_LINES > 0:
        _prefetch_rows_l2(w_ptr, tl.program_id(0) * ROWS, N, stride_wn, K, L2_LINES, ROWS)
    _wait_after_prefetch(tl.program_id(0), L2_LINES > 0, USE_PDL)
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    y = rows_dot(w_ptr, n.to(tl.int64), n < N, x_ptr, stride_wn, K, BLOCK_K)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _wait_after_prefetch(pid, PREFETCHED: tl.constexpr, USE_PDL: tl.constexpr):
    """The PDL wait (USE_PDL), after a CTA fence where loads or prefetches were issued before it (PREFETCHED): the
    fence keeps ptxas from sinking them past the wait."""
    if PREFETCHED and CTA_FENCE:
        fence_cta(pid)
    if USE_PDL:
        gdc_wait()


@triton.jit
def _row_tile(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """A [rows, BLOCK_K] tile at ptrs: rows past row_ok and (unless EVEN_K) columns past k_ok read as 0."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _prefetch_rows_l2(w_ptr, row0, N, stride_wn, K, LINES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Ask every 128-byte line of weight rows [row0, row0 + BLOCK_N) (K elements each, rows past N skipped) into the
    L2 (`prefetch.global.L2`: no register held, nothing waited for), LINES (a power of two, at least the rows' line
    count) spread over the program's threads; the spare ones ask for row0's first line again. Inline PTX: nothing
    under the interpreter."""
    if CTA_FENCE:
        PER_LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth
        idx = tl.arange(0, LINES)
        row = row0 + idx % BLOCK_N
        col = (idx // BLOCK_N) * PER_LINE
        ok = (row < N) & (col < K)
        ptrs = w_ptr + tl.where(ok, row, row0).to(tl.int64) * stride_wn + tl.where(ok, col, 0)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


# not specialized per step (kernels/common.py, Compiles): M: the step's rows (BLOCK_M keeps one compile per power of
# two)
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, stride_xm,
    w_ptr, stride_wn,
    y_ptr, stride_ym,
    M, N, K,
    rms_ptr,  # ROW_RMS: [M, K // GS, P] fp32 partial sums of squares (skinny_linear row_rms)
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROW_RMS: tl.constexpr = False,
    GS: tl.constexpr = 1,  # ROW_RMS: columns a group (BLOCK_K a multiple of it)
    P: tl.constexpr = 1,  # ROW_RMS: partial sums a group
    PP: tl.constexpr = 1,  # P's next power of two
    TRIGGER: tl.constexpr = False,  # skinny_linear(trigger=)
    USE_PDL: tl.constexpr = False,  # skinny_linear(use_pdl=): gdc_wait before x is read
    PREFETCH: tl.constexpr = 0,  # skinny_linear(prefetch=): 1 "tile", 2 "l2" (PREFETCH_FORMS), before that wait
    L2_LINES: tl.constexpr = 1,  # "l2": 128-byte lines of a program's weight rows, a power of two
):
    if TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_first = 0
    if PREFETCH == 2:
        # "l2": every 128-byte line of this program's BLOCK_N weight rows asked into the L2 (`prefetch.global.L2`,
        # no register held), before the wait; the loop below then reads them from there
        _prefetch_rows_l2(w_ptr, pid * BLOCK_N, N, stride_wn, K, L2_LINES, BLOCK_N)
    elif PREFETCH == 1:
        # "tile": the weight does not depend on the kernel before us, so its first tile loads before the PDL wait, in
        # that kernel's shadow, and the first step runs on it after the wait. Not with ROW_RMS (skinny_linear
        # refuses the pair).
        w = _row_tile(w_ptrs, n_ok, offs_k < K, EVEN_K)
    _wait_after_prefetch(pid, PREFETCH > 0, USE_PDL)
    if PREFETCH == 1:
        x = _row_tile(x_ptrs, m_ok, offs_k < K, EVEN_K)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        w = _row_tile(w_ptrs, n_ok, k_ok, EVEN_K)
        x = _row_tile(x_ptrs, m_ok, k_ok, EVEN_K)
        xf = x.to(tl.float32)
        if ROW_RMS:
            # the block's BLOCK_K // GS groups, each scaled by its rsqrt(mean of squares + eps) (EVEN_K here)
            NG: tl.constexpr = BLOCK_K // GS
            offs_g = k0 // GS + tl.arange(0, NG)
            offs_p = tl.arange(0, PP)
            part = tl.load(rms_ptr + ((offs_m[:, None, None] * (K // GS) + offs_g[None, :, None]) * P
                                      + offs_p[None, None, :]),
                           mask=m_ok[:, None, None] & (offs_p < P)[None, None, :], other=0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(part, axis=2) / GS + eps)  # [BLOCK_M, NG]
            xf = tl.reshape(tl.reshape(xf, [BLOCK_M, NG, GS]) * rstd[:, :, None], [BLOCK_M, BLOCK_K])
        acc += xf[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_linear(x: Tensor, w: Tensor, *, out_dtype: torch.dtype | None = None, out: Tensor | None = None,
                  tiles: GemvTiles | None = None, row_rms: tuple[Tensor, float] | None = None,
                  trigger: bool = False, use_pdl: bool = False, prefetch: str | None = None) -> Tensor:
    """y = x @ w^T for M <= MAX_ROWS rows.

    Args:
        x: [M, K] bf16/fp16/fp32, last dim contiguous (rows may be strided).
        w: [N, K] bf16/fp16/fp32, last dim contiguous (a row slice of a larger weight is fine).
        out_dtype: output dtype (default x.dtype); out: optional [M, N] buffer of that dtype, last
            dim contiguous.
        tiles: tile override (benchmarks); default `pick_tiles(N, K)`. Its block_k is capped so that a
            program's partial products stay within MAX_PARTIALS (more rows: shorter K steps). An unrolled one
            (`GemvTiles.unrolled`) runs `rows_dot` at M = 1 without row_rms.
        row_rms: (partials [M, G, P] fp32, eps): an RMS norm whose sums of squares were taken in P parts
            elsewhere (kernels/kda `kda_decode_split_norm`): x's K columns in G groups of K/G (a power of two),
            each group scaled by rsqrt(partials.sum(-1) / (K/G) + eps) before the product, in fp32.
        trigger: let a PDL launch after this one start at once (`gdc_launch_dependents` first thing; GPU only):
            it runs what it does before its PDL wait beside this kernel, and its wait still waits for all of it
            (the KDA decode step's late wait, KernelConfig.kda_decode_pdl).
        use_pdl: launch with programmatic dependent launch (GPU only): the kernel may start while the one before
            it finishes, and waits for it (`gdc_wait`) before reading x.
        prefetch: what each program reads of its weight rows before that wait (KernelConfig.gemv_prefetch; with
            use_pdl it runs in the shadow of the kernel before): "tile", its first K step into registers; "l2", every
            line of its rows into the L2 (no registers held; the loop then reads them there). Not with row_rms;
            "tile" not with unrolled tiles. The sums are the same, in the same order.

    Returns:
        [M, N]: fp32 sums of fp32 products, rounded once to the output dtype.
    """
    floats = (torch.bfloat16, torch.float16, torch.float32)
    for name, t in (("x", x), ("w", w)):
        if t.dim() != 2 or t.dtype not in floats or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a 2-D bf16/fp16/fp32 tensor with a contiguous last dim, got "
                             f"{t.dtype} {list(t.shape)} strides {t.stride()}")
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x: rows M must be in [1, {MAX_ROWS}], got {M}")
    N = w.shape[0]
    check(w, "w", (N, K))
    dt = out_dtype or x.dtype
    if out is None:
        out = poison_like(torch.empty(M, N, dtype=dt, device=x.device))
    else:
        check(out, "out", (M, N), dt)
        if out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    check_same_device(x=x, w=w, out=out)
    cfg = tiles or pick_tiles(N, K)
    if prefetch is not None and prefetch not in PREFETCH_FORMS:
        raise ValueError(f"skinny_linear: prefetch must be one of {PREFETCH_FORMS} or None, got {prefetch!r}")
    unrolled = cfg.unrolled and M == 1 and row_rms is None
    if (prefetch and row_rms is not None) or (prefetch == "tile" and unrolled):
        raise ValueError(f"skinny_linear(prefetch={prefetch!r}): not with row_rms; 'tile' takes the plain form only "
                         "(not unrolled tiles)")
    lines = triton.next_power_of_2(cfg.block_n * triton.cdiv(K * w.element_size(), 128))
    if unrolled:
        bk = 16 if INTERPRET else min(cfg.block_k, max(16, triton.next_power_of_2(K)))  # the tile's own step
        _gemv_rows_kernel[(triton.cdiv(N, cfg.block_n),)](x, w, w.stride(0), out, N, K=K, ROWS=cfg.block_n,
                                                          BLOCK_K=bk, TRIGGER=trigger and not INTERPRET,
                                                          USE_PDL=use_pdl and not INTERPRET,
                                                          L2_LINES=lines if prefetch == "l2" else 0,
                                                          num_warps=cfg.num_warps, num_stages=1, **pdl_kwargs(use_pdl))
        return out
    bm = max(1, triton.next_power_of_2(M))
    bk = block_k(cfg, bm, K)
    partials, eps, gs, parts = out, 0.0, 1, 1
    if row_rms is not None:
        partials, eps = row_rms
        G = partials.shape[1] if partials.dim() == 3 else 0
        gs = K // G if G and K % G == 0 else 0
        if (partials.dim() != 3 or partials.shape[0] != M or gs == 0 or gs & (gs - 1)
                or partials.dtype != torch.float32 or not partials.is_contiguous()):
            raise ValueError(f"row_rms partials must be contiguous fp32 [M, G, P] with M={M} and K={K} in G groups "
                             f"of a power of two, got {partials.dtype} {list(partials.shape)}")
        check_same_device(x=x, partials=partials)
        parts = partials.shape[2]
        bk = max(bk, gs)
        while (K // gs) % (bk // gs):  # whole groups a K step, and whole K steps
            bk //= 2
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, x.stride(0), w, w.stride(0), out, out.stride(0), M, N, K, partials, float(eps),
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=bk, EVEN_K=K % bk == 0,
        ROW_RMS=row_rms is not None, GS=gs, P=parts, PP=triton.next_power_of_2(parts),
        TRIGGER=trigger and not INTERPRET, USE_PDL=use_pdl and not INTERPRET,
        PREFETCH=PREFETCH_FORMS.index(prefetch) + 1 if prefetch else 0,
        L2_LINES=lines,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(use_pdl),
    )
    return out
