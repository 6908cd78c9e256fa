"""One token's MLA layer around its attention core in two persistent launches (batch-1 decode; kernels/persistent.py):

  `mla_pre_one_token`: the fused input projection (q | kv_a), then, after every program's rows: the new latent
    normalized and written with its k_pe into the cache row (kernels/mla/triton_latent.py's math), and the absorbed
    query [q_nope W_UK ; q_pe] (the decode kernel's input), W_UK read as its transpose [H, L, P] (each output a GEMV
    row over the head's P values);
  `mla_post_one_token`: the attention's latent output lifted through W_UV (rows of kv_b_proj's weight: each output
    a GEMV row over L), then, after every program's rows, o_proj, the residual add and (the last program) the next
    norm.
with `mla_decode` (split along the context, and its combine) between them: four launches where the separate path
takes nine (the input GEMV, the latent store, the absorb product, the concatenation, the decode and its combine, the
W_UV product, o_proj, the add + norm). The Kimi-Linear-48B's MLA layers (7): q_proj without q_lora, no output gate.

Roundings: the separate path's: the projections, the absorbed query, the lifted output and o_proj's rounded to
x.dtype (the GEMMs' outputs), the latent's norm as `mla_store_latent`, the residual add rounded, RMSNorm as
kernels/norm rounds it; the GEMVs sum in another order than cuBLAS. Oracle: those ops in sequence
(tests/kernels/test_mla_layer.py). Under the interpreter each launch runs as two phased launches (the boundary
standing for the wait).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3rt.kernels.common import INTERPRET, check, check_same_device, poison_like
from k3rt.kernels.linear.triton_gemv import rows_dot, rows_dot_step
from k3rt.kernels.persistent import arrive, last_arrival, launch_persistent, row_rms_norm, wait

# counters (int32, zero between launches): every program after its first-phase rows; after its second-phase items
# (the last zeroes words 0-1); sticky: waits that gave up
FIRST_DONE = tl.constexpr(0)
ALL_DONE = tl.constexpr(1)
STALLED = tl.constexpr(2)
MLA_LAYER_SYNC_WORDS = 4
ALL_PHASES = tl.constexpr(2)
ROWS = 4  # GEMV rows an item (a warp per row at 4 warps: kernels/linear rows_dot)
NUM_WARPS = 4
PER_SM = 4
INTERPRET_ROWS, INTERPRET_WARPS = 2, 2


@triton.jit(do_not_specialize=["G"])  # one binary for grid_for's sizing and the launch (persistent.py)
def _mla_pre_kernel(
    x_ptr,  # [HID] the layer's normed input row
    w_in_ptr,  # [R_IN, HID]: q (H * (P + R) rows) | kv_a (L + R) | pad
    proj_ptr,  # [H * (P + R) + L + R] x.dtype scratch
    kvn_w_ptr,  # [L] kv_a_layernorm's weight
    kv_ptr, kv_slot_ptr,  # the cache as rows [S, L + R]; [1] the new token's row
    w_uk_t_ptr,  # [H, L, P] W_UK transposed (contiguous)
    qcat_ptr,  # [H, L + R] x.dtype out: the absorbed query
    sync_ptr,
    kv_eps, G,
    HID: tl.constexpr,
    H: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    L: tl.constexpr,
    BL: tl.constexpr,
    BR: tl.constexpr,
    PROD_FP32: tl.constexpr,  # the latent norm's weighted product stays fp32 (promote(weight, x) is fp32)
    ROWS: tl.constexpr,
    BLOCK_KX: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    PHASE: tl.constexpr,  # 0, 1: that phase alone; ALL_PHASES: both, with the wait
):
    pid = tl.program_id(0)
    GRID: tl.constexpr = PHASE == ALL_PHASES
    NQ: tl.constexpr = H * (P + R)
    NP: tl.constexpr = NQ + L + R
    DTYPE: tl.constexpr = qcat_ptr.dtype.element_ty
    if PHASE == 0 or GRID:
        for i in range(pid, tl.cdiv(NP, ROWS), G):
            r = i * ROWS + tl.arange(0, ROWS)
            ok = r < NP
            tl.store(proj_ptr + r, rows_dot(w_in_ptr, r.to(tl.int64), ok, x_ptr, HID, HID, BLOCK_KX).to(DTYPE),
                     mask=ok)
        if GRID:
            arrive(sync_ptr + FIRST_DONE)
            wait(sync_ptr + FIRST_DONE, sync_ptr + STALLED, G)
    if PHASE == 1 or GRID:
        per_head: tl.constexpr = (L + ROWS - 1) // ROWS
        for i in range(pid, H * per_head + 1, G):
            if i == H * per_head:  # the new latent: normalized, weighted, with its k_pe, into the cache row
                offs = tl.arange(0, BL)
                ok = offs < L
                c = tl.load(proj_ptr + NQ + offs, mask=ok, other=0.0)
                cf = c.to(tl.float32)
                normed = (cf * (1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / L + kv_eps))).to(c.dtype)
                y = tl.load(kvn_w_ptr + offs, mask=ok, other=0.0).to(tl.float32) * normed.to(tl.float32)
                if not PROD_FP32:
                    y = y.to(c.dtype)
                dst = kv_ptr + tl.load(kv_slot_ptr).to(tl.int64) * (L + R)
                tl.store(dst + offs, y.to(kv_ptr.dtype.element_ty), mask=ok)
                offs_r = tl.arange(0, BR)
                pe = tl.load(proj_ptr + NQ + L + offs_r, mask=offs_r < R, other=0.0)
                tl.store(dst + L + offs_r, pe.to(kv_ptr.dtype.element_ty), mask=offs_r < R)
            else:
                h = i // per_head
                l = (i % per_head) * ROWS + tl.arange(0, ROWS)
                q_lat = rows_dot(w_uk_t_ptr + h * (L * P), l.to(tl.int64), l < L, proj_ptr + h * (P + R), P, P,
                                 BLOCK_KP)
                tl.store(qcat_ptr + h * (L + R) + l, q_lat.to(DTYPE), mask=l < L)
                if i % per_head == 0:  # the head's rope part as it is
                    offs_r = tl.arange(0, BR)
                    pe = tl.load(proj_ptr + h * (P + R) + P + offs_r, mask=offs_r < R, other=0.0)
                    tl.store(qcat_ptr + h * (L + R) + L + offs_r, pe, mask=offs_r < R)
        if last_arrival(sync_ptr + ALL_DONE, G):
            words = tl.arange(0, 2)
            tl.store(sync_ptr + words, tl.zeros([2], dtype=tl.int32))


@triton.jit(do_not_specialize=["G"])  # one binary for grid_for's sizing and the launch (persistent.py)
def _mla_post_kernel(
    o_lat_ptr,  # [H, L] the attention's latent output (mla_decode's)
    kvb_ptr,  # [H * (P + V), L] kv_b_proj's weight: head h's W_UV rows are h * (P + V) + P + v
    o_ptr,  # [H * V] x.dtype scratch: the lifted output (o_proj's input)
    wo_ptr,  # [HID, H * V] o_proj
    res_ptr, norm_w_ptr,  # [HID] the residual stream, the next norm's weight
    sync_ptr,
    out_ptr, res_out_ptr,  # [HID] x.dtype: the normed row, the new residual stream
    eps, G,
    HID: tl.constexpr,
    H: tl.constexpr,
    P: tl.constexpr,
    V: tl.constexpr,
    L: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_KL: tl.constexpr,
    BLOCK_KO: tl.constexpr,
    BLOCK_HID: tl.constexpr,
    PHASE: tl.constexpr,
):
    pid = tl.program_id(0)
    GRID: tl.constexpr = PHASE == ALL_PHASES
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if PHASE == 0 or GRID:
        per_head: tl.constexpr = (V + ROWS - 1) // ROWS
        for i in range(pid, H * per_head, G):
            h = i // per_head
            v = (i % per_head) * ROWS + tl.arange(0, ROWS)
            y = rows_dot(kvb_ptr, (h * (P + V) + P + v).to(tl.int64), v < V, o_lat_ptr + h * L, L, L, BLOCK_KL)
            tl.store(o_ptr + h * V + v, y.to(DTYPE), mask=v < V)
        if GRID:
            arrive(sync_ptr + FIRST_DONE)
            wait(sync_ptr + FIRST_DONE, sync_ptr + STALLED, G)
    if PHASE == 1 or GRID:
        for i in range(pid, tl.cdiv(HID, ROWS), G):
            r = i * ROWS + tl.arange(0, ROWS)
            ok = r < HID
            y = rows_dot(wo_ptr, r.to(tl.int64), ok, o_ptr, H * V, H * V, BLOCK_KO).to(DTYPE)
            tl.store(res_out_ptr + r, (y.to(tl.float32) + tl.load(res_ptr + r, mask=ok).to(tl.float32)).to(DTYPE),
                     mask=ok)
        if last_arrival(sync_ptr + ALL_DONE, G):
            row_rms_norm(res_out_ptr, norm_w_ptr, out_ptr, eps, HID, BLOCK_HID)
            words = tl.arange(0, 2)
            tl.store(sync_ptr + words, tl.zeros([2], dtype=tl.int32))


def _launch(kernel, args: tuple, consts: dict, x: Tensor, phased: bool | None, programs: int | None) -> None:
    """Both kernels' launch (kernels/persistent.py launch_persistent: two phased launches under the interpreter)."""
    rows, warps = (INTERPRET_ROWS, INTERPRET_WARPS) if INTERPRET else (ROWS, NUM_WARPS)
    launch_persistent(kernel, args, dict(consts, ROWS=rows), phases=ALL_PHASES.value, device=x.device,
                      num_warps=warps, per_sm=PER_SM, phased=phased, programs=programs)


def mla_layer_fits(rows: int, q_lora: bool, output_gate: bool, hidden: int) -> bool:
    """Whether the two launches take this layer: one token, q_proj without q_lora, no output gate, a row the norm's
    one program holds."""
    from k3rt.kernels.moe.triton_experts import NORM_MAX_D

    return rows == 1 and not q_lora and not output_gate and hidden <= NORM_MAX_D


def _check(name: str, t: Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    check(t, name, shape, dtype)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def mla_pre_one_token(x: Tensor, w_in: Tensor, kv_norm_weight: Tensor, kv_eps: float, kv_flat: Tensor,
                      kv_slot: Tensor, w_uk_t: Tensor, sync: Tensor, *, qk_rope_head_dim: int,
                      phased: bool | None = None, programs: int | None = None) -> Tensor:
    """The absorbed query [1, H, L + R] (x.dtype) of one token, its latent written into the cache (module docstring).

    Args:
        x: [1, HID] contiguous; w_in: [>= H * (P + R) + L + R, HID] contiguous, x.dtype: q rows then kv_a rows.
        kv_norm_weight: [L] kv_a_layernorm's weight; kv_eps its eps.
        kv_flat: [S, L + R] the cache pages as rows (contiguous); kv_slot: [1] int64 the token's row.
        w_uk_t: [H, L, P] contiguous, x.dtype (W_UK transposed: backend/runner/gpu/mla.py MlaWeights.w_uk_t).
        sync: [MLA_LAYER_SYNC_WORDS] int32 zeros (the caller's; left zero).
        qk_rope_head_dim: R.
    """
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, HID], got {list(x.shape)}")
    HID, (H, L, P), R = x.shape[1], w_uk_t.shape, qk_rope_head_dim
    NP = H * (P + R) + L + R
    if w_in.dim() != 2 or w_in.shape[0] < NP or w_in.shape[1] != HID or w_in.dtype != x.dtype:
        raise ValueError(f"w_in must be {x.dtype} [>= {NP}, {HID}], got {w_in.dtype} {list(w_in.shape)}")
    for name, t, shape, dtype in (
            ("w_in", w_in, tuple(w_in.shape), None), ("kv_norm_weight", kv_norm_weight, (L,), None),
            ("kv_flat", kv_flat, (kv_flat.shape[0], L + R), x.dtype), ("kv_slot", kv_slot, (1,), torch.int64),
            ("w_uk_t", w_uk_t, (H, L, P), x.dtype), ("sync", sync, (MLA_LAYER_SYNC_WORDS,), torch.int32)):
        _check(name, t, shape, dtype)
    check_same_device(x=x, w_in=w_in, kv_flat=kv_flat, kv_slot=kv_slot, w_uk_t=w_uk_t, sync=sync)
    qcat = poison_like(torch.empty(1, H, L + R, dtype=x.dtype, device=x.device))
    proj = poison_like(torch.empty(NP, dtype=x.dtype, device=x.device))
    args = (x, w_in, proj, kv_norm_weight, kv_flat, kv_slot, w_uk_t, qcat, sync, float(kv_eps))
    consts = dict(HID=HID, H=H, P=P, R=R, L=L, BL=triton.next_power_of_2(L), BR=max(1, triton.next_power_of_2(R)),
                  PROD_FP32=torch.promote_types(kv_norm_weight.dtype, x.dtype) == torch.float32,
                  BLOCK_KX=rows_dot_step(w_in, HID), BLOCK_KP=rows_dot_step(w_uk_t, P))
    _launch(_mla_pre_kernel, args, consts, x, phased, programs)
    return qcat


def mla_post_one_token(o_lat: Tensor, kv_b_weight: Tensor, o_proj: Tensor, residual: Tensor, norm_weight: Tensor,
                       eps: float, sync: Tensor, *, qk_nope_head_dim: int, phased: bool | None = None,
                       programs: int | None = None) -> tuple[Tensor, Tensor]:
    """(RMSNorm(residual + o_proj(o)) * norm_weight, residual + o_proj(o)), [1, HID] each, o = o_lat lifted through
    W_UV (module docstring).

    Args:
        o_lat: [1, H, L] contiguous: mla_decode's output.
        kv_b_weight: [H * (P + V), L] contiguous kv_b_proj weight (W_UK and W_UV rows per head), o_lat's dtype.
        o_proj: [HID, H * V]; residual: [1, HID]; norm_weight: [HID]; eps the next norm's.
        sync: [MLA_LAYER_SYNC_WORDS] int32 zeros (the caller's; left zero).
        qk_nope_head_dim: P.
    """
    if o_lat.dim() != 3 or o_lat.shape[0] != 1 or not o_lat.is_contiguous():
        raise ValueError(f"o_lat must be one contiguous row [1, H, L], got {list(o_lat.shape)}")
    _, H, L = o_lat.shape
    P = qk_nope_head_dim
    V = kv_b_weight.shape[0] // H - P
    HID = o_proj.shape[0]
    for name, t, shape, dtype in (
            ("kv_b_weight", kv_b_weight, (H * (P + V), L), o_lat.dtype), ("o_proj", o_proj, (HID, H * V), o_lat.dtype),
            ("residual", residual, (1, HID), o_lat.dtype), ("norm_weight", norm_weight, (HID,), None),
            ("sync", sync, (MLA_LAYER_SYNC_WORDS,), torch.int32)):
        _check(name, t, shape, dtype)
    check_same_device(o_lat=o_lat, kv_b_weight=kv_b_weight, o_proj=o_proj, residual=residual, sync=sync)
    new = lambda *shape: poison_like(torch.empty(*shape, dtype=o_lat.dtype, device=o_lat.device))  # noqa: E731
    out, res_out = new(1, HID), new(1, HID)
    args = (o_lat, kv_b_weight, new(H * V), o_proj, residual, norm_weight, sync, out, res_out, float(eps))
    consts = dict(HID=HID, H=H, P=P, V=V, L=L, BLOCK_KL=rows_dot_step(kv_b_weight, L),
                  BLOCK_KO=rows_dot_step(o_proj, H * V),
                  BLOCK_HID=triton.next_power_of_2(HID))
    _launch(_mla_post_kernel, args, consts, o_lat, phased, programs)
    return out, res_out
