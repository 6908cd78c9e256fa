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


# `make test` hands whole files to its xdist workers (--dist loadfile), by default those with the most tests first, so
# the slow files of one or two tests (the fuzzers, lm-eval, the pin rounds) came last and one worker ran them while
# the other idled (simulated on one run's durations: 1474 s against 1423 s with this order). Here the slowest files
# go first, slowest first (per-file seconds of one `make test` run on 2 cores; a file not listed, or renamed, just
# runs after them), and xdist keeps that order. Whole files move, so each file's tests stay together and in order.
SLOW_FILES_FIRST = [
    "backend/test_deterministic.py",  # 178 s
    "backend/test_tp_gpu_runner.py",  # 163
    "backend/test_tp.py",  # 148
    "compat/test_sglang_programs.py",  # 124
    "training/test_training.py",  # 120
    "backend/test_spec_bench.py",  # 114
    "backend/test_spec.py",  # 105
    "backend/test_dspark_engine.py",  # 104
    "backend/test_spec_rounds.py",  # 103
    "backend/test_gpu_runner.py",  # 99
    "kernels/test_kda_triton.py",  # 96
    "backend/test_engine_cache.py",  # 93
    "backend/test_mxfp4_model.py",  # 86
    "frontend/test_examples.py",  # 86
    "backend/test_overlap.py",  # 64
    "k3rt/test_cli.py",  # 64
    "kernels/test_mla_triton.py",  # 64
    "security/test_fuzz_http.py",  # 61
    "backend/test_mixed_graphs.py",  # 50
    "backend/test_spec_deterministic.py",  # 48
    "kernels/test_moe_mxfp4.py",  # 44
    "server/test_lifecycle.py",  # 43
    "server/test_pins.py",  # 43
    "kernels/test_kda_multi.py",  # 38
    "security/test_fuzz_dsl.py",  # 37
    "compat/test_sglang_endpoint_programs.py",  # 35
    "backend/test_dspark.py",  # 33
    "backend/test_bench_cache.py",  # 27
    "compat/test_lm_eval.py",  # 26
    "security/test_isolation.py",  # 24
    "backend/test_engine_pressure.py",  # 23
    "kernels/test_kda_verify.py",  # 20
    "kernels/test_moe_triton.py",  # 19
    "backend/test_jit_churn.py",  # 19
    "kernels/test_mla_sm90_build.py",  # 19
    "backend/test_latent_tail.py",  # 17
    "frontend/test_benchmark.py",  # 16
    "server/test_default_model.py",  # 16
]


def pytest_configure(config: Any) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's by-test-count order, off: ours below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if not hasattr(config, "workerinput"):  # only an xdist worker's collection feeds the scheduler
        return
    rank = {f"tests/{name}": i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: files stay whole
