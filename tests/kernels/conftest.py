"""Kernel tests: the NaN-poison fixture. (Without a GPU the Triton kernels run in the interpreter:
tests/conftest.py sets TRITON_INTERPRET for the whole session, before any kernel module is imported.)
"""
from __future__ import annotations


import pytest

# helpers' asserts (the subprocess runners) report like the tests' own
pytest.register_assert_rewrite("tests.kernels.helpers")


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
