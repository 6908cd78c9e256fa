"""GPU numerics under the Triton interpreter: bf16 arithmetic and casts as an NVIDIA GPU does them, tf32 dots.

Triton 3.6's interpreter keeps bf16 values as their raw uint16 bits and runs numpy on those bits: bf16 sums,
products and dots give garbage (about 1e38), and fp32 -> bf16 casts truncate. Its fp32 dots are exact fp32 whatever
`input_precision` says, where a GPU's "tf32" keeps 10 mantissa bits of each operand. So the launchers take fp32/ieee
paths under the interpreter (kernels/common.py INTERPRET), and a bf16 form's own roundings never run on the CPU: a
kernel path that loses precision in bf16 on the H200 (session 33: the GPU runner's bf16 prefill logits of k3 past
their bar) looked exact here.

`install()` (once per process, before any launch; `K3RT_GPU_NUMERICS=1` makes kernels/common.py call it) patches the
interpreter's builder so that
  - a bf16 operand of any float arithmetic, comparison, math function, fma, clamp, sum/min/max reduction or dot is
    decoded to fp32 exactly, the op runs in fp32, and a bf16 result is rounded to nearest even (the hardware's
    cvt.rn.bf16.f32, which `.to(tl.bfloat16)` lowers to);
  - casts into bf16 round to nearest even (or toward zero where the kernel asks for "rtz");
  - a dot of fp32 operands at input_precision "tf32" first cuts each operand to tf32 (the mma reads the top 19
    bits of each register: truncation); "tf32x3" and "ieee" stay exact fp32;
and kernels/common.py then sets EXACT_DOTS off, so the launchers take their GPU dot paths (16-bit operands, tf32).
Accumulation order inside a dot and the GPU's fast exp/rsqrt differ from numpy's: that is rounding of fp32, orders
of magnitude below bf16's, which is what this module is for. One bf16 difference remains: a tl.sum of a bf16 tensor
rounds once here, after an fp32 sum, where the GPU rounds at every step of its tree (Triton keeps a bf16 sum in
bf16); the kernels upcast before their sums. Used by benchmarks/bf16_paths.py --cpu-bf16 and its
test; never on a GPU (there is no interpreter to patch).
"""
from __future__ import annotations

import os

import numpy as np

ENV = "K3RT_GPU_NUMERICS"
_STATE = {"installed": False}


def wanted() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> their exact fp32 values."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray, rtz: bool = False) -> np.ndarray:
    """fp32 values -> bf16 bit patterns, rounded to nearest even (or toward zero); NaN stays a quiet NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    if rtz:
        out = (bits >> 16).astype(np.uint16)
    else:
        out = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if np.any(nan):
        out = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), out)
    return out


def tf32(x: np.ndarray) -> np.ndarray:
    """fp32 values cut to tf32 (10 mantissa bits), as a tf32 mma reads its fp32 registers."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def install() -> bool:
    """Patch the interpreter's builder for GPU numerics; False when this Triton's interpreter lacks the hooks."""
    if _STATE["installed"]:
        return True
    try:
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime import interpreter as itp
    except ImportError:
        return False
    builder_cls, reduce_cls, handle = itp.InterpreterBuilder, itp.ReduceOps, itp.TensorHandle
    bf16 = tl.bfloat16

    def is_bf16(h) -> bool:
        return h.dtype.scalar == bf16

    def val(h) -> np.ndarray:
        return bf16_to_f32(h.data) if is_bf16(h) else h.data

    def out(data: np.ndarray, dtype):
        """A result in `dtype`: bf16 results rounded from fp32; comparisons keep their bools."""
        if dtype == bf16 and data.dtype != np.bool_:
            return handle(f32_to_bf16(data), bf16)
        return handle(data, dtype)

    orig_binary, orig_unary, orig_ternary = builder_cls.binary_op, builder_cls.unary_op, builder_cls.ternary_op
    orig_cast, orig_fp_to_fp, orig_dot, orig_fma = (builder_cls.cast_impl, builder_cls.create_fp_to_fp,
                                                    builder_cls.create_dot, builder_cls.create_fma)

    def binary_op(self, lhs, rhs, op):
        if not (is_bf16(lhs) or is_bf16(rhs)):
            return orig_binary(self, lhs, rhs, op)
        res = op(val(lhs), val(rhs))
        return out(res, bf16) if res.dtype != np.bool_ else handle(res, lhs.dtype.scalar)

    def unary_op(self, arg, op):
        if not is_bf16(arg):
            return orig_unary(self, arg, op)
        return out(op(val(arg)).astype(np.float32), bf16)

    def ternary_op(self, lhs, rhs, other, op):
        if op is np.where or not any(is_bf16(h) for h in (lhs, rhs, other)):  # a select moves bits: exact as is
            return orig_ternary(self, lhs, rhs, other, op)
        return out(op(val(lhs), val(rhs), val(other)), bf16)

    def create_fma(self, x, y, z):
        if not any(is_bf16(h) for h in (x, y, z)):
            return orig_fma(self, x, y, z)
        return out(val(x) * val(y) + val(z), z.dtype.scalar)

    def cast_impl(self, src, dst_type):
        src_t, dst_t = src.dtype.scalar, dst_type.scalar
        if src_t == bf16 and dst_t != bf16:
            return orig_cast(self, handle(bf16_to_f32(src.data), tl.float32), dst_type)
        if dst_t == bf16 and src_t != bf16:
            return handle(f32_to_bf16(src.data.astype(np.float32)), bf16)
        return orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_t, dst_t = src.dtype.scalar, dst_type.scalar
        if dst_t == bf16 and src_t != bf16:
            return handle(f32_to_bf16(val(src).astype(np.float32), rtz=rounding_mode == ir.ROUNDING_MODE.RTZ), bf16)
        if src_t == bf16 and dst_t != bf16:
            return orig_fp_to_fp(self, handle(bf16_to_f32(src.data), tl.float32), dst_type, rounding_mode)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if is_bf16(a) or is_bf16(b):
            a, b = handle(val(a).astype(np.float32), tl.float32), handle(val(b).astype(np.float32), tl.float32)
        elif a.data.dtype == np.float32 and input_precision == ir.INPUT_PRECISION.TF32:
            a, b = handle(tf32(a.data), tl.float32), handle(tf32(b.data), tl.float32)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    orig_rsqrt = builder_cls.create_rsqrt

    def create_rsqrt(self, arg):
        if not is_bf16(arg):
            return orig_rsqrt(self, arg)
        return out((1 / np.sqrt(val(arg))).astype(np.float32), bf16)

    orig_sum, orig_min_max = reduce_cls.sum, reduce_cls.min_max

    def rsum(self, input):
        if input.dtype.scalar != bf16:
            return orig_sum(self, input)
        acc = np.sum(bf16_to_f32(input.handle.data), axis=self.axis, keepdims=self.keep_dims, dtype=np.float32)
        return self.to_tensor(f32_to_bf16(np.asarray(acc)), input.dtype)

    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        x = input[0] if isinstance(input, tuple) else input
        if x.dtype.scalar != bf16:
            return orig_min_max(self, input, val_reduce_op, idx_reduce_op)
        as_f32 = self.to_tensor(bf16_to_f32(x.handle.data), tl.float32)
        res = orig_min_max(self, as_f32, val_reduce_op, idx_reduce_op)
        vals = res[0] if isinstance(res, tuple) else (res if val_reduce_op else None)
        if vals is None:
            return res
        back = self.to_tensor(f32_to_bf16(np.asarray(vals.handle.data)), x.dtype)
        return (back, res[1]) if isinstance(res, tuple) else back

    builder_cls.binary_op, builder_cls.unary_op, builder_cls.ternary_op = binary_op, unary_op, ternary_op
    builder_cls.create_fma, builder_cls.cast_impl, builder_cls.create_fp_to_fp = create_fma, cast_impl, create_fp_to_fp
    builder_cls.create_dot, builder_cls.create_rsqrt = create_dot, create_rsqrt
    # the builder binds these as class-level lambdas calling self.cast_impl: they pick up the patch by name
    reduce_cls.sum, reduce_cls.min_max = rsum, min_max
    _STATE["installed"] = True
    return True
