"""Helpers every Triton launcher shares: contract checks, NaN poisoning for tests, interpreter flag.

Import this module only after TRITON_INTERPRET is settled (tests set it before importing kernels):
`INTERPRET` is read once, at import.

Compiles: Triton 3.6 compiles one binary per specialization of a kernel's arguments. Every int argument
is keyed on (== 1: then a constant, % 16 == 0, other) and every pointer on 16-byte alignment. An argument
that varies per step (row, sequence and pair counts, split counts, the block table's width) would make each
new batch or prompt length a candidate for a compile in the middle of serving, so each kernel lists those in
`@triton.jit(do_not_specialize=...)`; so are pointers into the runner's packed step buffers (index arrays
at offsets that move with the step's sizes) in `do_not_specialize_on_alignment`. Model-shape sizes and
strides (which feed vectorized address arithmetic) stay specialized. kernels/jit_probe.py counts the
binaries; tests/backend/test_jit_churn.py checks that varied steps stop producing new ones.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

# Under TRITON_INTERPRET=1 (CPU) PDL intrinsics cannot run and 16-bit dots are wrong: launchers
# force USE_PDL off and use fp32/ieee paths when this is set.
INTERPRET = bool(triton.knobs.runtime.interpret)
# K3RT_GPU_NUMERICS=1 under the interpreter: bf16 math, casts and tf32 dots as the GPU does them
# (kernels/interp_numerics.py), and EXACT_DOTS off, so launchers keep their GPU dot paths on the CPU.
GPU_NUMERICS = False
if INTERPRET:
    from k3rt.kernels import interp_numerics
    from k3rt.kernels.interpreter_speed import install as _install_interpreter_speed

    _install_interpreter_speed()
    GPU_NUMERICS = interp_numerics.wanted() and interp_numerics.install()
# launchers run fp32/ieee dots instead of 16-bit or tf32 ones: the plain interpreter gets those wrong or exact
EXACT_DOTS = INTERPRET and not GPU_NUMERICS

_POISON = False


def set_poison(flag: bool) -> None:
    """Tests: fill freshly allocated outputs and scratch with NaN so unwritten elements fail."""
    global _POISON
    _POISON = bool(flag)


def poison_like(t: Tensor) -> Tensor:
    """NaN-fill a freshly allocated float tensor when poisoning is on (tests); else return it as is."""
    if _POISON and t.is_floating_point():
        t.fill_(float("nan"))
    return t


def check(t: Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    """Raise ValueError naming expected vs actual shape (and dtype when given)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def check_same_device(**tensors: Tensor) -> None:
    """Raise ValueError if the named tensors are not all on one device."""
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError("tensors on different devices: " + ", ".join(f"{n}={d}" for n, d in devs.items()))


def pdl_kwargs(use_pdl: bool) -> dict:
    """Launch kwargs for programmatic dependent launch (never under the interpreter)."""
    return {"launch_pdl": True} if use_pdl and not INTERPRET else {}


# whether fence_cta may be emitted: it is inline PTX, not for the interpreter
CTA_FENCE = tl.constexpr(not INTERPRET)


@triton.jit
def fence_cta(x):
    """A CTA-scope fence (`fence.acq_rel.cta`, SASS MEMBAR.ALL.CTA), returning x: no load moves past it, so the loads
    before it are issued before the loads after it (ptxas otherwise sinks loads past a PDL wait). Not for the
    interpreter (inline PTX)."""
    return tl.inline_asm_elementwise("fence.acq_rel.cta; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


def has_tma(device: torch.device) -> bool:
    """Whether launches on `device` may take TMA tensor descriptors: the interpreter emulates them; a CUDA GPU needs
    compute capability 9 or newer (Hopper's tensor memory accelerator)."""
    if INTERPRET or device.type != "cuda":
        return INTERPRET
    return _cc_major(torch.cuda.current_device() if device.index is None else device.index) >= 9


def tma_ok(*tensors: Tensor) -> bool:
    """Whether TMA descriptors can take every tensor: a device with TMA (`has_tma`), 16-byte aligned bases and
    strides (all but the last, which must be 1: the callers check that already)."""
    return has_tma(tensors[0].device) and all(
        t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


@functools.cache
def _cc_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
