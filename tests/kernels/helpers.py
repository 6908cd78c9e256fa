"""What the kernel tests share: the device the Triton cases run on, their error measure, and the runners
for the benchmark smoke runs and the sm_90 builds (both in subprocesses).

Imports torch only, never triton: conftest.py imports this module before it settles TRITON_INTERPRET.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import Tensor

HAS_CUDA = torch.cuda.is_available()
# without CUDA the kernels run in the Triton interpreter (conftest.py), on CPU tensors
DEV = "cuda" if HAS_CUDA else "cpu"
REPO = Path(__file__).resolve().parents[2]


def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in fp64; NaN anywhere gives inf."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# `python benchmarks/<script>` as the tests' own process runs it: tests/conftest.py first (the interpreter patch that
# skips its dead overflow checks, the OpenBLAS pin), then the script as __main__ with its folder first on sys.path.
# The patch changes no result; without it the kernels.py smoke took 24 s instead of 15.
_AS_IN_TESTS = ("import runpy, sys; sys.path[0] = {repo!r}; import tests.conftest; "
                "sys.argv = sys.argv[1:]; sys.path[0] = {bench!r}; runpy.run_path(sys.argv[0], run_name='__main__')")


def run_benchmark_smoke(script: str, out: Path, *args: str) -> dict:
    """Run benchmarks/<script> --smoke [args] under the Triton interpreter, writing its JSON to `out`; that JSON."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    launch = _AS_IN_TESTS.format(repo=str(REPO), bench=str(REPO / "benchmarks"))
    proc = subprocess.run([sys.executable, "-c", launch, str(REPO / "benchmarks" / script), "--smoke", "--out", str(out),
                           *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


# The head of every sm_90 build script: `sm90_build` compiles one kernel for an H100/H200 target with
# Triton's own frontend, ptxas and cuobjdump (all in the triton wheel), so it needs no GPU, and reports
# its registers and spills (regs; stack, local), cp.async and wgmma counts from the TTGIR, and shared memory.
SM90_BUILD_PRELUDE = r'''
import json, os, re, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def sm90_kernel(fn, sig, consts, num_warps, num_stages, divisible):
    # pointers, and the integer arguments `divisible` names, are marked divisible by 16, as the runtime
    # marks them at the 48B shapes
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
             if v.startswith("*") or divisible(k)}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})

def cuobjdump(k, flag):
    # the wheel's own cuobjdump over the kernel's cubin: "-res-usage" (registers, stack) or "-sass"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return out

def sm90_build(fn, sig, consts, num_warps, num_stages, divisible):
    k = sm90_kernel(fn, sig, consts, num_warps, num_stages, divisible)
    usage = cuobjdump(k, "-res-usage")
    ttgir = k.asm["ttgir"]
    return {"regs": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "local": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "async_copies": ttgir.count("async_copy_global_to_local"), "wgmma": ttgir.count("warp_group_dot"),
            "shared": k.metadata.shared}
'''


def run_sm90_build(script: str, timeout: float) -> dict:
    """Run SM90_BUILD_PRELUDE + `script` (which prints one JSON line last) in a fresh interpreter; that JSON.

    A subprocess, with TRITON_INTERPRET dropped, because the interpreter (set by conftest.py without a
    GPU) changes what @triton.jit returns, and this process's kernels are decorated already.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SM90_BUILD_PRELUDE + script], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
