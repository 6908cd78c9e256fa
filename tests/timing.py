"""Helpers for tests that bound wall-clock latencies."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """The test process's own cyclic collector paused while it times something else (a server's /health, a
    function's GIL holds). Late in a suite run the test process's heap is large, and one full collection in
    it stalls the timing thread for 100s of ms, which the test would read as the server's latency."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
