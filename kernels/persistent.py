"""Persistent launches (Triton): every program of the grid resident at once, ordered by arrival counters in global
memory instead of launch boundaries (kernels/moe/triton_layer.py, kernels/kda/triton_layer.py,
kernels/mla/triton_layer.py: a decode layer's chain of GEMVs and small steps in one launch, batch 1).

An arrival is a CTA barrier, then thread 0's release at GPU scope (the CTA's stores happen-before what a waiter
reads); a wait spins on an acquire load (which invalidates the L1, so plain loads after it see those stores): CUTLASS's
semaphore pattern. A spin gives up after SPIN_LIMIT polls and counts itself in a sticky word, so a grid the SMs cannot
hold at once (a bug) shows instead of hanging. `last_arrival` picks the program that arrives last at a counter (the
epilogue's, which sees every other program's stores). `resident_programs` sizes the grid from the compiled binary's
registers and shared memory; `grid_for` memoizes it per compiled form.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from k3rt.kernels.common import INTERPRET

# polls of a counter before a wait gives up (each an L2 round trip, ~1 us: seconds, never in a run)
SPIN_LIMIT = tl.constexpr(1 << 22)


@triton.jit
def arrive(ctr_ptr):
    """This program's arrival at a counter: its stores so far happen-before what a program reads after waiting for
    the counter (CTA barrier, then thread 0's release at GPU scope)."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait(ctr_ptr, stall_ptr, G):
    """Spin until all G programs arrived at the counter (an acquire at GPU scope: the L1 is invalidated, so plain
    loads after it see the other programs' stores)."""
    polls = 0
    while (tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu") < G) & (polls < SPIN_LIMIT):
        polls += 1
    if polls >= SPIN_LIMIT:
        tl.atomic_add(stall_ptr, 1, scope="gpu")
    tl.debug_barrier()


@triton.jit
def last_arrival(ctr_ptr, G):
    """This program's arrival at a counter, true in the one that arrives last (G programs): it sees every other
    program's stores made before their arrival (acquire-release at GPU scope)."""
    tl.debug_barrier()
    return tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu") == G - 1


@triton.jit
def row_rms_norm(row_ptr, norm_w_ptr, out_ptr, eps, D, BLOCK_D: tl.constexpr):
    """out = RMSNorm(row) * weight over one row of D (<= BLOCK_D) values in out's dtype, kernels/norm's rounding:
    the normalized row rounded, then times the weight, rounded (an epilogue after `last_arrival`)."""
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    h = tl.load(row_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    y = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(norm_w_ptr + offs, mask=ok).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask the L2 for the lines at ptrs (`prefetch.global.L2`, one address a 128-byte line). GPU only (inline PTX)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _sm_limits(index: int) -> tuple[int, int, int, int]:
    """(SMs, threads, 32-bit registers, shared memory bytes) an SM of CUDA device `index` has."""
    p = torch.cuda.get_device_properties(index)
    return (p.multi_processor_count, getattr(p, "max_threads_per_multi_processor", 2048),
            getattr(p, "regs_per_multiprocessor", 65536), getattr(p, "shared_memory_per_multiprocessor", 233472))


# the grid of each compiled form on each device (a memo of `resident_programs` over the binary, which Triton caches
# the same way): launchers look it up instead of binding the arguments twice per call
_GRIDS: dict[tuple, int] = {}


def resident_programs(index: int, num_warps: int, regs: int, shared: int, per_sm: int) -> int:
    """The grid: per_sm programs an SM, fewer where the kernel's registers (allocated per warp in 256s), threads or
    shared memory would not let that many share an SM, and never below one an SM (every program must be resident
    while the others spin at a barrier)."""
    sms, threads, regfile, smem = _sm_limits(index)
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    fit = min(per_sm, threads // (32 * num_warps), regfile // (warp_regs * num_warps), 32)
    if shared:
        fit = min(fit, smem // shared)
    return sms * max(1, fit)


def _check_grid_arg(kernel, n_args: int) -> None:
    """The grid-size argument (the last of the n_args) must be marked do_not_specialize (see grid_for)."""
    g = kernel.params[n_args - 1]
    if not g.do_not_specialize:
        raise ValueError(f"{kernel.fn.__qualname__}: its grid-size argument {g.name!r} must be in do_not_specialize, "
                         f"or grid_for would size the grid from another binary than the one launched")


def grid_for(kernel, args: tuple, consts: dict, index: int, num_warps: int, per_sm: int) -> int:
    """The grid of `kernel` compiled for (args, consts) on CUDA device `index`: `resident_programs` over the binary
    (compiled here on the first call, without a launch), memoized. The kernel must not specialize its grid-size
    argument G (`do_not_specialize=["G"]`): this sizing compiles it with G = 1, which Triton otherwise folds in as a
    constant, a different binary with fewer registers than the one launched with the real G. On the H100 (session
    42) that let the MoE layer's per_sm=16 candidate launch more programs than the SMs held: 10,594 stalled waits."""
    key = (kernel.fn.__qualname__ if hasattr(kernel, "fn") else id(kernel), index, per_sm,
           tuple(sorted(consts.items())), tuple(getattr(a, "dtype", type(a)) for a in args))
    if key not in _GRIDS:  # checked once a kernel, before its sizing compile, not on every launch
        _check_grid_arg(kernel, len(args))
        k = kernel.warmup(*args, grid=(1,), **consts)
        k._init_handles()
        _GRIDS[key] = resident_programs(index, num_warps, k.n_regs, k.metadata.shared, per_sm)
    return _GRIDS[key]


def launch_persistent(kernel, args: tuple, consts: dict, *, phases: int, device: torch.device, num_warps: int,
                      per_sm: int, phased: bool | None, programs: int | None, grid_consts: dict | None = None,
                      phased_consts: dict | None = None, launch_kw: dict | None = None) -> None:
    """A persistent kernel's launch. Its PHASE constexpr runs phase 0 .. phases-1 alone, or (PHASE == phases) all of
    them with the waits. phased (default: under the interpreter only, whose programs run one after another, so a wait
    would never end): one launch per phase on a few programs, the launch boundaries standing for the waits; else one
    launch of every resident program (`grid_for`), with grid_consts and launch_kw (PDL)."""
    phased = INTERPRET if phased is None else phased
    if not phased and INTERPRET:
        raise ValueError("the grid form spins at its waits; the interpreter needs phased=True")
    consts = dict(consts, num_warps=num_warps)
    if phased:
        G = programs or 3  # a few programs, so the grid-stride loops run more than one item each
        for phase in range(phases):
            kernel[(G,)](*args, G, PHASE=phase, **(phased_consts or {}), **consts)
        return
    consts.update(PHASE=phases, **(grid_consts or {}))
    if programs is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = grid_for(kernel, (*args, 1), consts, index, num_warps, per_sm)
    kernel[(programs,)](*args, programs, **consts, **(launch_kw or {}))
