"""Without a GPU, every Triton kernel in the test session runs in the Triton interpreter.

TRITON_INTERPRET decides what @triton.jit returns when a kernel module is first imported (and
kernels/common.py reads it once), so it must be set before anything imports one, in any test folder:
the backend tests run the GPU runner's kernels too. The root conftest is imported first.

The interpreter computes `tl.dot` with numpy's matmul, i.e. OpenBLAS, which picks its sgemm kernel by CPU. On
an AMD EPYC it picks the "Haswell" kernel, whose result for a row depends on the row's position in the
matrix (rows 6.. of a 16-row block are summed in another order), so a kernel tile's rows are not independent
and the batch-invariant tests (tests/backend/test_deterministic.py) fail there while passing on Intel hosts
(the "SkylakeX" kernel). The "Sandybridge" kernel (AVX, on every x86-64 host CI can get) is position-
invariant (measured: 0 of 84 row placements differ, against 84 with "Haswell"); it must be chosen before
numpy loads OpenBLAS, so here, before torch imports numpy. On a GPU
machine the kernels compile and tl.dot runs on tensor cores: nothing to pin.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

# an AVX host: unset, or named as one (this sandbox's environment sets OPENBLAS_CORETYPE=Haswell itself)
if platform.machine() in ("x86_64", "AMD64") and os.environ.get("OPENBLAS_CORETYPE", "Haswell") in (
        "Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids", "Sandybridge"):
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import torch  # noqa: E402

# under pytest-xdist (make test) the workers share the cores: each gets its share for torch's intra-op threads,
# and so do the processes a test starts (benchmark --smoke scripts, `k3rt serve`, CLI runs), through the
# environment they inherit: with their default of one thread per core, spinning OpenMP workers on cores the
# other worker is using made benchmarks/overlap.py --smoke take 121 s instead of 7 s
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))


def _skip_dead_overflow_checks() -> None:
    """The interpreter's integer add/sub/mul build an overflow check (both operands cast to int64, the op
    again, two comparisons, an and) that only `device_assert` consumes, and device_assert drops it unless the
    options say debug, which the interpreter's never do (InterpreterOptions() with its defaults). Skipping the
    dead work changes no result and no raised error; it was a third of the slowest interpreter test's time.
    Only the interpreter's builder: a compile (the sm_90 build tests) keeps Triton's own path."""
    from triton.language.semantic import TritonSemantic
    from triton.runtime.interpreter import InterpreterBuilder

    sanitize = getattr(TritonSemantic, "binary_op_sanitize_overflow_impl", None)
    if sanitize is None:  # another Triton: its own path, slower but the same results
        return

    def sanitize_unless_dead(self: TritonSemantic, lhs: Any, rhs: Any, binary_op: Callable) -> None:
        if isinstance(self.builder, InterpreterBuilder) and not self.builder.options.debug:
            return None
        return sanitize(self, lhs, rhs, binary_op)

    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_unless_dead


if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _skip_dead_overflow_checks()
