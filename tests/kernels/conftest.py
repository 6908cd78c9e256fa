"""Kernel tests: without a GPU the Triton kernels run in the Triton interpreter.

TRITON_INTERPRET decides what @triton.jit returns when a kernel module is imported (and
kernels/common.py reads it once, at import), so it must be set before anything imports one. pytest
imports this conftest before any test module of this folder, so it is set here, once, for all of them.
"""
from __future__ import annotations

import os

import pytest

# helpers' asserts (the subprocess runners) report like the tests' own
pytest.register_assert_rewrite("tests.kernels.helpers")

from tests.kernels.helpers import HAS_CUDA  # noqa: E402

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def poison_outputs():
    """NaN-fill kernel outputs and scratch, so anything left unwritten fails the comparison.

    Not autouse: the Triton test modules ask for it (pytestmark), and the ref-only ones must not import
    Triton, which kernels/common.py does; hence the import in here.
    """
    from k3rt.kernels import common

    common.set_poison(True)
    yield
    common.set_poison(False)
