"""Expert alignment for the grouped GEMMs (Triton): sort (token, slot) pairs by expert, pad each
expert's run to a multiple of BLOCK_M, and name the expert of every BLOCK_M block.

Pair p = t * k + j is the token t's j-th routing slot. The output layout (oracle: `ref.py::align_ref`):
  sorted_pair_ids [num_blocks_max * BLOCK_M] int32: expert 0's pairs (ascending p), padded with the
      sentinel P = T*k up to a multiple of BLOCK_M, then expert 1's, ...; slots past the last used
      block are left unwritten (no block points at them);
  block_expert [num_blocks_max] int32: the expert whose rows a block holds, -1 past the last one.
Sizes come from T*k, E and BLOCK_M only (no host sync, CUDA-graph safe):
  num_blocks_max = (P + min(E, P) * (BLOCK_M - 1)) // BLOCK_M  (every non-empty expert pads < BLOCK_M).

No atomics: the pairs are cut into chunks of BP; a pair's slot is
  padded_start[e] + (e's pairs in earlier chunks) + (e's pairs before it in its chunk),
so the layout is a pure function of the ids. Two launches: per-chunk histograms; then one program per chunk
that sums the histograms (all of them for the padded starts, the earlier chunks' for its own base), writes a
share of the padding tails and block experts, and scatters its chunk. (Before: one program for the prefix sums,
padding and block experts between the two, ~50 us per 48B layer at 8K tokens, a chain of dependent loads; it
stays as `split=False`.) When all pairs fit one chunk (decode), one launch: its programs each recompute the
chunk's prefix sums and write a share of the outputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, pdl_kwargs

CHUNK = 512  # pairs per chunk: T <= 64 at k = 8 is one chunk, hence one launch
# pairs per program of the split single-chunk form: the one program took 7 us at 128 pairs and 23 us at 512 over
# 256 experts (the Kimi-Linear-48B's decode at batch 16 and 64, session 24-25 on the H200), a chain of loops over
# the blocks, the ranks and the padding tails; G programs each take a G-th of them
SPLIT_PAIRS = 32
_SUB = 32  # columns of the in-chunk rank comparison held at once (64 spills at 512 rows, sm_90)


@triton.jit
def _scatter_chunk(ids_ptr, base_ptr, sorted_ptr, c, P, BP: tl.constexpr, SUB: tl.constexpr):
    """Write chunk c's pair ids to their slots; base_ptr[e] is e's first slot for this chunk."""
    li = tl.arange(0, BP)
    offs = c * BP + li
    ok = offs < P
    e = tl.load(ids_ptr + offs, mask=ok, other=-1)
    # stable rank among the chunk's pairs of the same expert, SUB columns at a time
    rank = tl.zeros([BP], dtype=tl.int32)
    for j0 in tl.static_range(0, BP, SUB):
        lj = j0 + tl.arange(0, SUB)
        ej = tl.load(ids_ptr + c * BP + lj, mask=c * BP + lj < P, other=-2)
        same = (e[:, None] == ej[None, :]) & (lj[None, :] < li[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    slot = tl.load(base_ptr + e, mask=ok, other=0) + rank
    tl.store(sorted_ptr + slot, offs, mask=ok)


# not specialized per step (kernels/common.py, Compiles): P: the step's (token, expert) pairs
@triton.jit(do_not_specialize=["P"])
def _moe_align_count_kernel(ids_ptr, counts_ptr, P, E_P: tl.constexpr, BP: tl.constexpr, USE_PDL: tl.constexpr):
    c = tl.program_id(0)
    offs = c * BP + tl.arange(0, BP)
    if USE_PDL:
        gdc_wait()
    e = tl.load(ids_ptr + offs, mask=offs < P, other=0)
    if USE_PDL:
        gdc_launch_dependents()
    tl.store(counts_ptr + c * E_P + tl.arange(0, E_P), tl.histogram(e, E_P, mask=offs < P))


@triton.jit
def _padded_runs(tot, BLOCK_M: tl.constexpr):
    """Per expert, its pair count padded to BLOCK_M and its padded run [pstart, pend); and the runs' total."""
    padded = (tot + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, axis=0)
    return padded, pend, pend - padded, tl.sum(padded, axis=0)


@triton.jit
def _store_tails(sorted_ptr, pstart, tot, padded, P, mine_e, E_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The sentinel P in the padding tails (fewer than BLOCK_M slots) of the experts mine_e selects."""
    tail = pstart + tot
    for j0 in tl.static_range(0, BLOCK_M, 16):
        pj = j0 + tl.arange(0, 16)
        tl.store(sorted_ptr + tail[:, None] + pj[None, :], tl.zeros([E_P, 16], dtype=tl.int32) + P,
                 mask=(pj[None, :] < (padded - tot)[:, None]) & mine_e[:, None])


@triton.jit
def _store_block_experts(block_expert_ptr, pend, total, first, step, NB, BLOCK_M: tl.constexpr,
                         BLOCK_B: tl.constexpr):
    """Blocks first, first + step, ... (BLOCK_B at a time): block b belongs to the first expert whose padded run
    ends after slot b * BLOCK_M (-1 past the last run)."""
    for b0 in range(first, NB, step):
        b = b0 + tl.arange(0, BLOCK_B)
        owner = tl.sum((pend[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        owner = tl.where(b * BLOCK_M < total, owner, -1)
        tl.store(block_expert_ptr + b, owner, mask=b < NB)


@triton.jit
def _store_group_tables(big_ptr, small_ptr, pstart, padded, first, step, NBIG, NSMALL, E_P: tl.constexpr,
                        BLOCK_M: tl.constexpr, GROUP: tl.constexpr, BLOCK_B: tl.constexpr):
    """The grouped GEMMs' tiles (GROUP > 1): an expert's run of n blocks is n // GROUP tiles of GROUP consecutive
    blocks (big_ptr[t]: the first block of big tile t) and n % GROUP single blocks (small_ptr[s]: the block of small
    tile s), experts in order; -1 past the last. Entries first, first + step, ... (BLOCK_B at a time)."""
    offs_e = tl.arange(0, E_P)
    nblk = padded // BLOCK_M
    nbig = nblk // GROUP
    nsmall = nblk - nbig * GROUP
    big_end = tl.cumsum(nbig, axis=0)
    small_end = tl.cumsum(nsmall, axis=0)
    first_blk = pstart // BLOCK_M
    # big tile t of expert e: block first_blk[e] + (t - big_start[e]) * GROUP; small tile s: the block after e's big
    # tiles, plus (s - small_start[e])
    big_base = first_blk - (big_end - nbig) * GROUP
    small_base = first_blk + nbig * GROUP - (small_end - nsmall)
    total_big = tl.sum(nbig, axis=0)
    total_small = tl.sum(nsmall, axis=0)
    for b0 in range(first, NBIG, step):
        b = b0 + tl.arange(0, BLOCK_B)
        owner = tl.sum((big_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        base = tl.sum(tl.where(offs_e[None, :] == owner[:, None], big_base[None, :], 0), axis=1)
        tl.store(big_ptr + b, tl.where(b < total_big, base + b * GROUP, -1), mask=b < NBIG)
    for s0 in range(first, NSMALL, step):
        t = s0 + tl.arange(0, BLOCK_B)
        owner = tl.sum((small_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
        base = tl.sum(tl.where(offs_e[None, :] == owner[:, None], small_base[None, :], 0), axis=1)
        tl.store(small_ptr + t, tl.where(t < total_small, base + t, -1), mask=t < NSMALL)


@triton.jit
def _store_share(sorted_ptr, block_expert_ptr, big_ptr, small_ptr, tot, P, NB, NBIG, NSMALL, g, G,
                 E_P: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, BLOCK_B: tl.constexpr):
    """From the experts' pair counts `tot`: program g of G's share of the padding tails (experts e % G == g), of
    the blocks' experts (blocks g * BLOCK_B, then every G * BLOCK_B) and of the grouped tables (GROUP > 1).
    Returns the experts' padded starts."""
    padded, pend, pstart, total = _padded_runs(tot, BLOCK_M)
    _store_tails(sorted_ptr, pstart, tot, padded, P, (tl.arange(0, E_P) % G) == g, E_P, BLOCK_M)
    _store_block_experts(block_expert_ptr, pend, total, g * BLOCK_B, G * BLOCK_B, NB, BLOCK_M, BLOCK_B)
    if GROUP > 1:
        _store_group_tables(big_ptr, small_ptr, pstart, padded, g * BLOCK_B, G * BLOCK_B, NBIG, NSMALL, E_P, BLOCK_M,
                            GROUP, BLOCK_B)
    return pstart


# not specialized per step (kernels/common.py, Compiles): P, NC, NB: the step's pairs, chunks and blocks
@triton.jit(do_not_specialize=["P", "NC", "NB", "NBIG", "NSMALL"])
def _moe_align_offsets_kernel(
    ids_ptr,  # [P] int32 expert of each pair
    counts_ptr,  # [NC, E_P] int32: chunk histograms in, each chunk's first slot per expert out
    start_ptr,  # [E_P] int32 scratch: padded_start (single-chunk mode)
    sorted_ptr, block_expert_ptr,
    big_ptr, small_ptr,  # GROUP > 1: the grouped GEMMs' tile tables (_store_group_tables)
    P, NC, NB, NBIG, NSMALL,
    E_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BP: tl.constexpr,
    SUB: tl.constexpr,
    TILE_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    GROUP: tl.constexpr,
):
    offs_e = tl.arange(0, E_P)
    rc = tl.arange(0, TILE_C)
    if USE_PDL:
        gdc_wait()
    if SINGLE_CHUNK:
        offs = tl.arange(0, BP)
        tot = tl.histogram(tl.load(ids_ptr + offs, mask=offs < P, other=0), E_P, mask=offs < P)
    else:
        tot = tl.zeros([E_P], dtype=tl.int32)
        for c0 in range(0, NC, TILE_C):
            m = (c0 + rc < NC)[:, None]
            tot += tl.sum(tl.load(counts_ptr + (c0 + rc)[:, None] * E_P + offs_e[None, :], mask=m, other=0), axis=0)
    if USE_PDL:
        gdc_launch_dependents()
    pstart = _store_share(sorted_ptr, block_expert_ptr, big_ptr, small_ptr, tot, P, NB, NBIG, NSMALL, 0, 1, E_P,
                          BLOCK_M, GROUP, BLOCK_B)  # every expert's tail, every block
    if not SINGLE_CHUNK:
        run = pstart
        for c0 in range(0, NC, TILE_C):
            ptrs = counts_ptr + (c0 + rc)[:, None] * E_P + offs_e[None, :]
            m = (c0 + rc < NC)[:, None]
            cnt = tl.load(ptrs, mask=m, other=0)
            tl.store(ptrs, tl.cumsum(cnt, axis=0) - cnt + run[None, :], mask=m)
            run += tl.sum(cnt, axis=0)
    if SINGLE_CHUNK:
        tl.store(start_ptr + offs_e, pstart)
        tl.debug_barrier()  # the scatter gathers padded_start back from memory
        _scatter_chunk(ids_ptr, start_ptr, sorted_ptr, 0, P, BP, SUB)


# not specialized per step (kernels/common.py, Compiles): P, NB: the step's pairs and blocks
@triton.jit(do_not_specialize=["P", "NB", "NBIG", "NSMALL"])
def _moe_align_split_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, big_ptr, small_ptr, P, NB, NBIG, NSMALL,
    E_P: tl.constexpr, BLOCK_M: tl.constexpr, BP: tl.constexpr, SP: tl.constexpr, G: tl.constexpr,
    BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr, GROUP: tl.constexpr,
):
    """One chunk's alignment over G programs (decode sizes): each reads every id and recomputes the padded
    starts (a histogram of <= BP ids), then writes its share: the pairs [g * SP, (g + 1) * SP) at their
    slots, a G-th of the blocks' experts and of the experts' sentinel tails. No program reads what another
    writes, so nothing orders them."""
    g = tl.program_id(0)
    offs = tl.arange(0, BP)
    offs_e = tl.arange(0, E_P)
    if USE_PDL:
        gdc_wait()
    tot = tl.histogram(tl.load(ids_ptr + offs, mask=offs < P, other=0), E_P, mask=offs < P)
    if USE_PDL:
        gdc_launch_dependents()
    pstart = _store_share(sorted_ptr, block_expert_ptr, big_ptr, small_ptr, tot, P, NB, NBIG, NSMALL, g, G, E_P,
                          BLOCK_M, GROUP, BLOCK_B)
    # this program's pairs: slot = padded start of its expert + the pairs of that expert before it
    li = g * SP + tl.arange(0, SP)
    ok = li < P
    e = tl.load(ids_ptr + li, mask=ok, other=-1)
    rank = tl.sum(tl.where(offs_e[None, :] == e[:, None], pstart[None, :], 0), axis=1)
    for j0 in range(0, (g + 1) * SP, SP):
        lj = j0 + tl.arange(0, SP)
        ej = tl.load(ids_ptr + lj, mask=lj < P, other=-2)
        rank += tl.sum(((e[:, None] == ej[None, :]) & (lj[None, :] < li[:, None])).to(tl.int32), axis=1)
    tl.store(sorted_ptr + rank, li, mask=ok)


# not specialized per step (kernels/common.py, Compiles): P, NC, NB: the step's pairs, chunks and blocks
@triton.jit(do_not_specialize=["P", "NC", "NB", "NBIG", "NSMALL"])
def _moe_align_place_kernel(
    ids_ptr,  # [P] int32 expert of each pair
    counts_ptr,  # [NC, E_P] int32 chunk histograms (read only)
    base_ptr,  # [NC, E_P] int32 scratch: each chunk's first slot per expert
    sorted_ptr, block_expert_ptr,
    big_ptr, small_ptr,  # GROUP > 1: the grouped GEMMs' tile tables (_store_group_tables)
    P, NC, NB, NBIG, NSMALL,
    E_P: tl.constexpr, BLOCK_M: tl.constexpr, BP: tl.constexpr, SUB: tl.constexpr, TILE_C: tl.constexpr,
    BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr, GROUP: tl.constexpr,
):
    """Chunk c's program: the padded starts from every chunk's histogram, its base from the earlier ones', the
    padding tails of experts e % NC == c, blocks c * BLOCK_B, then every NC * BLOCK_B, and chunk c's pairs. Every
    program reads the histograms (NC x E_P ints, from L2) and writes only its own share, so nothing orders them."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, E_P)
    rc = tl.arange(0, TILE_C)
    if USE_PDL:
        gdc_wait()
    tot = tl.zeros([E_P], dtype=tl.int32)
    pre = tl.zeros([E_P], dtype=tl.int32)
    for c0 in range(0, NC, TILE_C):
        rows = c0 + rc
        cnt = tl.load(counts_ptr + rows[:, None] * E_P + offs_e[None, :], mask=(rows < NC)[:, None], other=0)
        tot += tl.sum(cnt, axis=0)
        pre += tl.sum(tl.where((rows < c)[:, None], cnt, 0), axis=0)
    if USE_PDL:
        gdc_launch_dependents()
    pstart = _store_share(sorted_ptr, block_expert_ptr, big_ptr, small_ptr, tot, P, NB, NBIG, NSMALL, c, NC, E_P,
                          BLOCK_M, GROUP, BLOCK_B)
    tl.store(base_ptr + c * E_P + offs_e, pstart + pre)
    tl.debug_barrier()  # the scatter gathers the base back from memory
    _scatter_chunk(ids_ptr, base_ptr + c * E_P, sorted_ptr, c, P, BP, SUB)


# not specialized per step (kernels/common.py, Compiles): P: the step's pairs
@triton.jit(do_not_specialize=["P"])
def _moe_align_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, P, E_P: tl.constexpr, BP: tl.constexpr,
                              SUB: tl.constexpr, USE_PDL: tl.constexpr):
    c = tl.program_id(0)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    _scatter_chunk(ids_ptr, counts_ptr + c * E_P, sorted_ptr, c, P, BP, SUB)


def num_blocks_max(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the padded blocks of any routing of num_pairs pairs over num_experts experts."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def group_table_sizes(num_blocks: int, num_experts: int, group: int) -> tuple[int, int]:
    """Upper bounds on the grouped tables' entries (`moe_align_grouped`): big tiles <= blocks // group; small ones
    <= group - 1 per expert, and <= blocks."""
    return num_blocks // group, min(num_blocks, num_experts * (group - 1))


def moe_align_fwd(topk_ids: Tensor, num_experts: int, block_m: int, *, use_pdl: bool = False,
                  split: bool = True) -> tuple[Tensor, Tensor]:
    """topk_ids [T, k] int32 contiguous, ids in [0, num_experts) -> (sorted_pair_ids, block_expert).

    Layout and sizes: see the module docstring. block_m must be a power of two >= 16. split: the offsets' work
    over several programs (a single chunk's: `_moe_align_split_kernel`; several chunks': `_moe_align_place_kernel`);
    False: in one program (benchmarks, tests).
    """
    return _align(topk_ids, num_experts, block_m, 1, use_pdl, split)[:2]


def moe_align_grouped(topk_ids: Tensor, num_experts: int, block_m: int, group: int, *, use_pdl: bool = False,
                      split: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`moe_align_fwd`'s layout at block_m, plus the tables of GEMM tiles of `group` blocks -> (sorted_pair_ids,
    block_expert, big [nbig], small [nsmall]) (sizes: `group_table_sizes`): each expert's run of n blocks as
    n // group tiles of group consecutive blocks (big: each tile's first block) and n % group single blocks
    (small), experts in order, -1 past the last. So a prefill's grouped GEMMs run in tiles of group * block_m rows
    while each expert pads only to block_m (the tails in a launch of block_m-row tiles)."""
    if group < 2 or group & (group - 1):
        raise ValueError(f"group must be a power of two >= 2, got {group}")
    return _align(topk_ids, num_experts, block_m, group, use_pdl, split)


def _align(topk_ids: Tensor, num_experts: int, block_m: int, group: int, use_pdl: bool, split: bool
           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    assert topk_ids.dim() == 2 and topk_ids.dtype == torch.int32 and topk_ids.is_contiguous()
    assert block_m >= 16 and block_m & (block_m - 1) == 0 and 1 <= num_experts <= 4096
    P = topk_ids.numel()
    dev = topk_ids.device
    NB = num_blocks_max(P, num_experts, block_m)
    sorted_ids = torch.empty(NB * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(NB, dtype=torch.int32, device=dev)
    nbig, nsmall = group_table_sizes(NB, num_experts, group) if group > 1 else (0, 0)
    big = torch.empty(max(1, nbig), dtype=torch.int32, device=dev)
    small = torch.empty(max(1, nsmall), dtype=torch.int32, device=dev)
    out = (sorted_ids, block_expert, big[:nbig], small[:nsmall])
    if P == 0:
        return out
    E_P = max(16, triton.next_power_of_2(num_experts))
    # a single chunk shrinks to the pairs present: decode does not pay for CHUNK^2 rank compares
    bp = max(16, min(CHUNK, triton.next_power_of_2(P)))
    sub = min(_SUB, bp)
    NC = triton.cdiv(P, bp)
    counts = torch.empty(NC, E_P, dtype=torch.int32, device=dev)
    start = torch.empty(E_P, dtype=torch.int32, device=dev)
    single = NC == 1
    pdl = use_pdl and not INTERPRET
    block_b = max(1, min(32, 8192 // E_P))
    if single and split:
        # decode sizes: the single chunk's work over programs of SPLIT_PAIRS pairs each (_moe_align_split_kernel)
        G = triton.cdiv(P, SPLIT_PAIRS)
        _moe_align_split_kernel[(G,)](
            topk_ids, sorted_ids, block_expert, big, small, P, NB, nbig, nsmall, E_P=E_P, BLOCK_M=block_m, BP=bp,
            SP=SPLIT_PAIRS, G=G, BLOCK_B=block_b, USE_PDL=pdl, GROUP=group, num_warps=4, **pdl_kwargs(use_pdl))
        return out
    if not single:
        _moe_align_count_kernel[(NC,)](topk_ids, counts, P, E_P=E_P, BP=bp, USE_PDL=pdl, num_warps=4,
                                       **pdl_kwargs(use_pdl))
    if not single and split:
        base = torch.empty(NC, E_P, dtype=torch.int32, device=dev)
        _moe_align_place_kernel[(NC,)](
            topk_ids, counts, base, sorted_ids, block_expert, big, small, P, NC, NB, nbig, nsmall, E_P=E_P,
            BLOCK_M=block_m, BP=bp, SUB=sub, TILE_C=max(1, min(32, 8192 // E_P)), BLOCK_B=block_b, USE_PDL=pdl,
            GROUP=group, num_warps=8, **pdl_kwargs(use_pdl))
        return out
    _moe_align_offsets_kernel[(1,)](
        topk_ids, counts, start, sorted_ids, block_expert, big, small, P, NC, NB, nbig, nsmall,
        E_P=E_P, BLOCK_M=block_m, BP=bp, SUB=sub, TILE_C=max(1, min(16, 8192 // E_P)),
        BLOCK_B=max(1, min(64, 8192 // E_P)), SINGLE_CHUNK=single, USE_PDL=pdl, GROUP=group, num_warps=8,
        **pdl_kwargs(use_pdl),
    )
    if not single:
        _moe_align_scatter_kernel[(NC,)](topk_ids, counts, sorted_ids, P, E_P=E_P, BP=bp, SUB=sub,
                                         USE_PDL=pdl, num_warps=8, **pdl_kwargs(use_pdl))
    return out
