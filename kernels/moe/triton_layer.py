"""One token's whole MoE layer in one persistent launch: the router, the top-k, the experts, their sum, and the
decoder layer's residual add and next norm (`moe_layer_one_token`; batch-1 decode).

Why: at batch 1 the 48B's MoE layer is five launches (the fp32 router GEMV, the top-k, gate/up, down, the sum with
the add and the norm). Session 39's profile (H200): gate/up 24.8 us and down 13.5 us a layer, 81% and 75% of copy
bandwidth, the top-k 2.8 us and the sum 3.1 us, plus the router's GEMV (one of the step's 54 skinny GEMVs, ~3 us):
about 47 us against 30.7 us for the layer's 129.7 MB (the 2.4 MB fp32 router and nine experts of 14.2 MB). Each
launch ramps up and drains, and the down GEMM cannot start before the last gate/up program ends.

Here G programs, all resident at once (G is at most what the SMs hold: `resident_programs`), take small items in
grid-stride order. Each program:
  1. computes its router items (fp32 logits of ROUTER_ROWS experts into a scratch) and arrives at ROUTER_DONE;
  2. computes its items of the shared experts' gate/up (they need no routing; h[slot, columns] = act(gate) * up),
     arrives at SHARED_DONE, then waits for ROUTER_DONE;
  3. picks the top-k from the E logits itself (the same selection in every program: no broadcast, no further
     wait), computes its items of the routed experts' gate/up, arrives at ROUTED_DONE;
  4. computes its down items (DOWN_ROWS output rows over every slot): the shared slot first (after SHARED_DONE), so
     HBM stays busy while the last routed items finish, then the routed slots (after ROUTED_DONE); with PREFETCH
     it first asks the L2 for its first item's routed rows (`prefetch.global.L2`), streamed during the wait;
  5. arrives at ALL_DONE; the last program applies the epilogue over the whole row (the residual add's row is then
     complete) and zeroes the counters for the next launch.
Arrivals come as early as their data allows and waits as late, so programs drift apart instead of idling together
at grid-wide barriers. An arrival is a CTA barrier and thread 0's release at GPU scope; a wait spins on an acquire
load (CUTLASS's semaphore pattern; the acquire invalidates the L1, so plain loads after it see the stores).

Every item is a GEMV of a few weight rows against one vector (`rows_dot`: [R, BLOCK_K] fp32 partial products in
registers, reduced over K at the end; kernels/linear); items are small (a few KB a K step) so every SM gets nearly
the same bytes, and several programs share an SM for the loads in flight.

Roundings: the grouped path's (`fused_experts` with a SumNorm): h in x.dtype; per slot the fp32 dot times the routing
weight (1 for a shared expert) rounded to x.dtype; their fp32 sum in slot order, rounded; with a residual, that plus
the residual rounded (the new residual stream), then RMSNorm as kernels/norm rounds it. The logits are fp32. The
GEMVs sum over K in another order than the grouped GEMMs (BLOCK_K partials, then a tree). No atomics touch data:
bit-reproducible. Oracle: `ref.py::moe_layer_ref`.

The interpreter runs programs one after another, so a spin would never end: there (and in tests) `phased=True` runs
steps 1-2, 3 and 4-5 as three launches (PHASE 0, 1, 2), the launch boundaries standing for the waits, with the same
item code. The grid form (PHASE 3) is GPU-only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3rt.kernels.common import INTERPRET, check, check_same_device, pdl_kwargs, poison_like
from k3rt.kernels.linear.triton_gemv import rows_dot, rows_dot_step
from k3rt.kernels.persistent import arrive, last_arrival, launch_persistent, prefetch_l2, row_rms_norm, wait
from k3rt.kernels.moe.triton_experts import NORM_MAX_D, SumNorm, _act_mul, check_routing, check_stacks, check_x
from k3rt.kernels.moe.triton_router import MAX_EXPERTS, _select_topk, check_gate_weight
from k3rt.model_config import ActivationConfig

# The launch's counters: int32 words, zero between launches (constexpr globals: the kernels read them, host code
# their .value)
SYNC_WORDS = tl.constexpr(8)
ROUTER_DONE = tl.constexpr(0)  # arrivals: every program after its router items,
SHARED_DONE = tl.constexpr(1)  # after its shared experts' gate/up items,
ROUTED_DONE = tl.constexpr(2)  # after its routed gate/up items,
ALL_DONE = tl.constexpr(3)  # after its down items (the last one applies the epilogue and zeroes words 0-3)
STALLED = tl.constexpr(4)  # sticky: waits that gave up at SPIN_LIMIT (a grid the SMs cannot hold at once: a bug)
LAYER_SYNC_WORDS = SYNC_WORDS.value  # the caller's buffer (exported as kernels.moe.LAYER_SYNC_WORDS)
ALL_PHASES = tl.constexpr(3)


@dataclass(frozen=True)
class LayerTiles:
    """Item sizes and the launch shape. An item's K step is one 16-byte load per lane of each of its rows (bf16: 256
    columns), so with rows a multiple of num_warps each warp owns whole rows (`rows_dot`)."""

    router_rows: int = 2  # phase A: router rows an item
    cols: int = 1  # phases A, B: columns of I an item (its gate and up rows: 2 * cols)
    down_rows: int = 2  # phase C: output rows an item, over every slot
    num_warps: int = 2
    per_sm: int = 8  # programs an SM holds (capped by `resident_programs`)
    # the grid form: a program's first down item's routed rows asked of the L2 before it waits for the routed h, so
    # HBM streams them while the last gate/up items finish
    prefetch: bool = True
    # the K step in 16-byte loads a lane (1: BLOCK_K = 32 lanes x 16 B); more puts more bytes in flight an item
    loads: int = 1


DEFAULT_TILES = LayerTiles()
# Alternatives the benchmark times (benchmarks/kernels_moe.py --layer); none timed yet
CANDIDATES = (
    DEFAULT_TILES,
    LayerTiles(prefetch=False),
    LayerTiles(per_sm=4),
    LayerTiles(per_sm=16),
    LayerTiles(router_rows=4, cols=2, down_rows=4, num_warps=4, per_sm=4),
    LayerTiles(router_rows=4, cols=2, down_rows=4, num_warps=4, per_sm=8),
    LayerTiles(loads=2),
    LayerTiles(router_rows=1, cols=1, down_rows=1, num_warps=1, per_sm=16),
)
INTERPRET_TILES = LayerTiles(per_sm=1)


@triton.jit
def _gate_up_item(x_ptr, w13_ptr, h_ptr, e, slot, n0, D: tl.constexpr, I: tl.constexpr, beta, lin_beta,
                  COLS: tl.constexpr, BLOCK_K: tl.constexpr, SITU: tl.constexpr, LIN_SAT: tl.constexpr):
    """h[slot, n0:n0 + COLS] = act(gate) * up of expert e's columns (its gate rows n, up rows I + n, interleaved in
    one GEMV), rounded to h's dtype."""
    c = tl.arange(0, 2 * COLS)
    n = n0 + c // 2
    rows = e.to(tl.int64) * (2 * I) + n + (c % 2) * I
    g, u = tl.split(tl.reshape(rows_dot(w13_ptr, rows, n < I, x_ptr, D, D, BLOCK_K), [COLS, 2]))
    h = _act_mul(g, u, beta, lin_beta, SITU, LIN_SAT)
    offs = n0 + tl.arange(0, COLS)
    tl.store(h_ptr + slot * I + offs, h.to(h_ptr.dtype.element_ty), mask=offs < I)


@triton.jit
def _pick(v, j):
    """v[j] of a vector in registers (j may be a runtime scalar)."""
    return tl.sum(tl.where(tl.arange(0, v.shape[0]) == j, v, 0), axis=0)


@triton.jit
def _slot_expert(j: tl.constexpr, ids, tw, E_ROUTED, K: tl.constexpr):
    """Slot j's expert (int64) and weight: the routing's j-th for j < K, else shared expert j - K (weight 1)."""
    if j < K:
        e = _pick(ids, j).to(tl.int64)
        w = _pick(tw, j)
    else:
        e = (E_ROUTED + (j - K)).to(tl.int64)
        w = 1.0
    return e, w


@triton.jit
def _prefetch_l2_rows(w2_ptr, ids, d, ok, K: tl.constexpr, D: tl.constexpr, I: tl.constexpr, LINES: tl.constexpr):
    """Ask the L2 for the down rows d of the k routed experts ids (`prefetch.global.L2`, one a 128-byte line of a
    row: LINES >= the row's lines). GPU only (inline PTX)."""
    offs = tl.arange(0, LINES) * (128 * 8 // w2_ptr.dtype.element_ty.primitive_bitwidth)
    j = tl.arange(0, ids.shape[0])
    rows = ids.to(tl.int64)[:, None] * D + d.to(tl.int64)[None, :]  # [BLOCK_KS, DOWN_ROWS]
    ptrs = w2_ptr + rows[:, :, None] * I + offs[None, None, :]
    live = ((j < K)[:, None] & ok[None, :])[:, :, None] & (offs < I)[None, None, :]
    prefetch_l2(ptrs, live)


@triton.jit
def _routing(logits_ptr, bias_ptr, scaling, E, BLOCK_E: tl.constexpr, K: tl.constexpr, BLOCK_KS: tl.constexpr,
             RENORMALIZE: tl.constexpr):
    """(weights, ids) [BLOCK_KS] of the top-k over the launch's fp32 logits."""
    offs_e = tl.arange(0, BLOCK_E)
    ok = offs_e < E
    s = tl.sigmoid(tl.load(logits_ptr + offs_e, mask=ok, other=0.0))
    sel = tl.where(ok, s + tl.load(bias_ptr + offs_e, mask=ok, other=0.0), float("-inf"))
    return _select_topk(s, sel, scaling, K, BLOCK_KS, RENORMALIZE)


@triton.jit
def _down_slots(w2_ptr, h_ptr, ids, tw, d, ok, acc, E, FIRST: tl.constexpr, LAST: tl.constexpr, K: tl.constexpr,
                D: tl.constexpr, I: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """acc + the down rows d of slots FIRST..LAST-1 in slot order: each slot's fp32 dot with h[slot] times its
    weight, rounded to DTYPE (the grouped path's per-pair output), added in fp32."""
    for j in tl.static_range(FIRST, LAST):
        e, wj = _slot_expert(j, ids, tw, E, K)
        y = rows_dot(w2_ptr, e * D + d.to(tl.int64), ok, h_ptr + j * I, I, I, BLOCK_K)
        acc += (y * wj).to(DTYPE).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["G"])  # one binary for grid_for's sizing and the launch (persistent.py)
def _moe_layer_kernel(
    x_ptr,  # [D] x.dtype: the layer's (normed) input row
    gate_ptr,  # [E, D] float router weight, contiguous
    bias_ptr,  # [E] fp32 correction bias (selection only)
    w13_ptr,  # [E + S, 2I, D] contiguous
    w2_ptr,  # [E + S, D, I] contiguous
    logits_ptr,  # [E] fp32 scratch
    h_ptr,  # [K + S, I] x.dtype scratch
    sync_ptr,  # [SYNC_WORDS] int32, zero on entry, zero again on exit
    tw_ptr, ids_ptr,  # [K] fp32 / int32 out: the routing (program 0 writes it)
    out_ptr,  # [D] x.dtype: the sum, or the normed row (NORM)
    row_ptr,  # NORM: [D] x.dtype the rounded sum (or the new residual stream, RESIDUAL): the epilogue's input
    res_ptr, norm_w_ptr, eps,
    scaling, beta, lin_beta,
    E, G,
    D: tl.constexpr,
    I: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    S: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SITU: tl.constexpr,
    LIN_SAT: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,  # NORM: the row's next power of two
    ROUTER_ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DOWN_ROWS: tl.constexpr,
    BLOCK_KR: tl.constexpr,  # the K steps: one 16-byte load per lane of the router's weight, of the experts'
    BLOCK_KW: tl.constexpr,
    LINES_I: tl.constexpr,  # PREFETCH: 128-byte lines a down row spans, to a power of two
    PREFETCH: tl.constexpr,  # the grid form: L2 prefetch of the first down item's routed rows before its wait
    PHASE: tl.constexpr,  # 0, 1, 2: that phase alone (phased launches); ALL_PHASES: all, with the waits
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    GRID: tl.constexpr = PHASE == ALL_PHASES
    nps = tl.cdiv(I, COLS)  # gate/up items an expert
    n_router = tl.cdiv(E, ROUTER_ROWS)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if USE_PDL:
        gdc_wait()
    if PHASE == 0 or GRID:
        for i in range(pid, n_router, G):
            e = i * ROUTER_ROWS + tl.arange(0, ROUTER_ROWS)
            tl.store(logits_ptr + e, rows_dot(gate_ptr, e.to(tl.int64), e < E, x_ptr, D, D, BLOCK_KR), mask=e < E)
        if GRID:
            arrive(sync_ptr + ROUTER_DONE)
        for j in range(pid, S * nps, G):  # the shared experts' gate/up: no routing needed
            _gate_up_item(x_ptr, w13_ptr, h_ptr, E + j // nps, K + j // nps, (j % nps) * COLS, D, I, beta, lin_beta,
                          COLS, BLOCK_KW, SITU, LIN_SAT)
        if GRID:
            arrive(sync_ptr + SHARED_DONE)
            wait(sync_ptr + ROUTER_DONE, sync_ptr + STALLED, G)
    if PHASE >= 1:
        tw, ids = _routing(logits_ptr, bias_ptr, scaling, E, BLOCK_E, K, BLOCK_KS, RENORMALIZE)
        if PHASE != 2:
            if pid == 0:
                offs_k = tl.arange(0, BLOCK_KS)
                tl.store(tw_ptr + offs_k, tw, mask=offs_k < K)
                tl.store(ids_ptr + offs_k, ids, mask=offs_k < K)
            for i in range(pid, K * nps, G):
                _gate_up_item(x_ptr, w13_ptr, h_ptr, _pick(ids, i // nps), i // nps, (i % nps) * COLS, D, I, beta,
                              lin_beta, COLS, BLOCK_KW, SITU, LIN_SAT)
            if GRID:
                arrive(sync_ptr + ROUTED_DONE)
        if PHASE >= 2:
            if USE_PDL:
                gdc_launch_dependents()
            for i in range(pid, tl.cdiv(D, DOWN_ROWS), G):
                d = i * DOWN_ROWS + tl.arange(0, DOWN_ROWS)
                ok = d < D
                zero = tl.zeros([DOWN_ROWS], dtype=tl.float32)
                if GRID and i == pid:
                    if PREFETCH:  # the routed slots' rows of this item into the L2 while the last routed h is written
                        _prefetch_l2_rows(w2_ptr, ids, d, ok, K, D, I, LINES_I)
                    wait(sync_ptr + SHARED_DONE, sync_ptr + STALLED, G)
                # one shared expert: its slot first, while other programs still write the routed h (added last, so
                # the sum keeps slot order); several: in order after the routed slots
                if S == 1:
                    shared = _down_slots(w2_ptr, h_ptr, ids, tw, d, ok, zero, E, K, K + 1, K, D, I, BLOCK_KW, DTYPE)
                if GRID and i == pid:
                    wait(sync_ptr + ROUTED_DONE, sync_ptr + STALLED, G)
                acc = _down_slots(w2_ptr, h_ptr, ids, tw, d, ok, zero, E, 0, K, K, D, I, BLOCK_KW, DTYPE)
                if S == 1:
                    acc += shared
                else:
                    acc = _down_slots(w2_ptr, h_ptr, ids, tw, d, ok, acc, E, K, K + S, K, D, I, BLOCK_KW, DTYPE)
                total = acc.to(DTYPE)
                if RESIDUAL:
                    total = (total.to(tl.float32) + tl.load(res_ptr + d, mask=ok).to(tl.float32)).to(DTYPE)
                if NORM:
                    tl.store(row_ptr + d, total, mask=ok)
                else:
                    tl.store(out_ptr + d, total, mask=ok)
            # the last program to get here has every row: the epilogue, then the counters back to zero
            if last_arrival(sync_ptr + ALL_DONE, G):
                if NORM:
                    row_rms_norm(row_ptr, norm_w_ptr, out_ptr, eps, D, BLOCK_D)
                words = tl.arange(0, SYNC_WORDS)
                tl.store(sync_ptr + words, tl.zeros([SYNC_WORDS], dtype=tl.int32), mask=words < STALLED)


def layer_fits(rows: int, num_experts: int, hidden: int, num_expert_group: int, norm: bool) -> bool:
    """Whether `moe_layer_one_token` takes this layer: one token, ungrouped selection over at most MAX_EXPERTS
    experts, and (with a norm) a row the epilogue's one program holds."""
    return rows == 1 and num_expert_group == 1 and 1 <= num_experts <= MAX_EXPERTS and (
        not norm or hidden <= NORM_MAX_D)


def moe_layer_one_token(
    x: Tensor,
    gate_weight: Tensor,
    bias: Tensor,
    w13: Tensor,
    w2: Tensor,
    sync: Tensor,
    *,
    top_k: int,
    act: ActivationConfig,
    renormalize: bool = True,
    scaling: float = 1.0,
    shared_experts: int = 0,
    norm: SumNorm | tuple[Tensor, float] | None = None,
    out: Tensor | None = None,
    tiles: LayerTiles | None = None,
    programs: int | None = None,
    phased: bool | None = None,
    use_pdl: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """One token's MoE layer in one launch (module docstring): (out [1, D], weights [1, k] fp32, ids [1, k] int32).

    Args:
        x: [1, D] bf16/fp16/fp32 input row (last dim contiguous).
        gate_weight: [E, D] contiguous float router weight; bias: [E] fp32 correction bias.
        w13, w2: [E + S, 2I, D] and [E + S, D, I] contiguous stacks in x.dtype, the S shared experts last.
        sync: [LAYER_SYNC_WORDS] int32 zeros on the same device, owned by the caller (one per stream that launches this
            kernel: two launches in flight at once must not share it); the launch leaves it zero.
        top_k, renormalize, scaling: the router (`moe_route`), ungrouped.
        act: silu, or situ (`fused_experts`).
        shared_experts: S.
        norm: as `fused_experts`' (a SumNorm with a residual: the decoder layer's add and next norm; the new residual
            stream goes to its residual_out). D <= NORM_MAX_D then.
        out: optional [1, D] x.dtype output.
        tiles: item sizes (default DEFAULT_TILES; the interpreter's are small).
        programs: the grid (default: `resident_programs` for tiles.per_sm); the grid form needs all of them resident.
        phased: one launch per phase instead of the grid barriers (default: under the interpreter only).
        use_pdl: programmatic dependent launch (grid form, GPU only).
    """
    T, D = check_x(x)
    if T != 1:
        raise ValueError(f"moe_layer_one_token: x must be one row [1, D], got {list(x.shape)}")
    E = check_gate_weight(gate_weight, D)
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"gate_weight: E must be in [1, {MAX_EXPERTS}] experts, got {E}")
    check(bias, "bias", (E,), torch.float32)
    E_all, I = check_stacks(x, w13, w2)
    if E_all != E + shared_experts:
        raise ValueError(f"w13/w2 must stack E={E} routed + shared_experts={shared_experts} experts, got {E_all}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    tw = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    check_routing(x, tw, ids, act, shared_experts, E_all, out, norm)
    n = None if norm is None else SumNorm(*norm)
    if n is not None and D > NORM_MAX_D:
        raise ValueError(f"moe_layer_one_token: a norm needs D <= {NORM_MAX_D}, got D={D}")
    check(sync, "sync", (LAYER_SYNC_WORDS,), torch.int32)
    check_same_device(x=x, gate_weight=gate_weight, bias=bias, w13=w13, sync=sync, out=out)
    if out is None:
        out = poison_like(torch.empty(1, D, dtype=x.dtype, device=x.device))
    res = n is not None and n.residual is not None
    row = (n.residual_out if res else poison_like(torch.empty(1, D, dtype=x.dtype, device=x.device))) if n else out
    t = tiles or (INTERPRET_TILES if INTERPRET else DEFAULT_TILES)
    logits = poison_like(torch.empty(E, dtype=torch.float32, device=x.device))
    h = poison_like(torch.empty(top_k + shared_experts, I, dtype=x.dtype, device=x.device))
    args = (x, gate_weight, bias, w13, w2, logits, h, sync, tw, ids, out, row, n.residual if res else x,
            n.weight if n else x, float(n.eps) if n else 0.0, float(scaling), float(act.situ_beta or 1.0),
            float(act.situ_linear_beta or 1.0), E)
    consts = dict(D=D, I=I, BLOCK_E=triton.next_power_of_2(E), K=top_k, BLOCK_KS=triton.next_power_of_2(top_k),
                  S=shared_experts, RENORMALIZE=bool(renormalize), SITU=act.name == "situ",
                  LIN_SAT=act.name == "situ" and act.situ_linear_beta is not None, NORM=n is not None, RESIDUAL=res,
                  BLOCK_D=triton.next_power_of_2(D), ROUTER_ROWS=t.router_rows, COLS=t.cols, DOWN_ROWS=t.down_rows,
                  BLOCK_KR=rows_dot_step(gate_weight, D, t.loads), BLOCK_KW=rows_dot_step(w13, max(D, I), t.loads),
                  LINES_I=triton.next_power_of_2(triton.cdiv(I * w2.element_size(), 128)))
    launch_persistent(_moe_layer_kernel, args, consts, phases=ALL_PHASES.value, device=x.device,
                      num_warps=t.num_warps, per_sm=t.per_sm, phased=phased, programs=programs,
                      grid_consts=dict(PREFETCH=t.prefetch, USE_PDL=use_pdl and not INTERPRET),
                      phased_consts=dict(PREFETCH=False, USE_PDL=False), launch_kw=pdl_kwargs(use_pdl))
    return out, tw, ids
