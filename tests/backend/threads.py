"""`single_thread`: an autouse, module-scoped fixture for modules of tiny-tensor torch tests. Import it
into a test module (`from tests.backend.threads import single_thread  # noqa: F401`) to use it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors gain nothing from intra-op threads, and spinning OpenMP workers make the run
    many times slower when the CPUs are shared; restore the setting for the other modules."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
