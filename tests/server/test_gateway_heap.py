"""The gateway's heap and the event loop (issue 19): what a request would otherwise pay on the loop is paid
when the server starts, and a big body's clean-up does not walk the start-up heap.

CI once saw /health take 116 ms (limit 100) beside a 5 MB chat body: the last big request unfroze the whole
heap and one full collection over FastAPI's ~50K start-up objects held the GIL 35-60 ms. And a server's first
chat or completion held /health ~0.7 s while `k3rt.backend.grammar` was first imported on the loop.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import importlib
import subprocess
import sys
import weakref
from pathlib import Path

import k3rt.server
from k3rt.server.limits import BigBodies, freeze_startup_heap

SERVER = Path(k3rt.server.__file__).parent
# start-up and tooling code, not request handling: their function-level imports run once, off the loop
NOT_REQUEST_PATHS = {"launch.py", "bench.py", "config.py"}


def _function_level_imports(path: Path) -> set[str]:
    out = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    out.add(node.module)
                elif isinstance(node, ast.Import):
                    out.update(a.name for a in node.names)
    return out


def test_request_handling_imports_nothing_on_first_use():
    wanted = set()
    for path in sorted(SERVER.glob("*.py")):
        if path.name not in NOT_REQUEST_PATHS:
            wanted |= _function_level_imports(path)
    assert "k3rt.backend.grammar" in wanted  # the scan sees the import that held the first request
    # a fresh interpreter: what importing the app and making it (its FIRST_USE_IMPORTS) loads
    code = ("import importlib, sys\nfrom k3rt.server import app\n"
            "for m in app.FIRST_USE_IMPORTS: importlib.import_module(m)\n"
            f"print([m for m in {sorted(wanted)!r} if m not in sys.modules])")
    missing = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert missing.strip() == "[]", f"imported on a request's first use, on the event loop: {missing}"


def test_create_app_imports_the_first_use_modules():
    src = (SERVER / "app.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "create_app")
    assert "FIRST_USE_IMPORTS" in ast.unparse(fn.body[0])
    from k3rt.server.app import FIRST_USE_IMPORTS

    for name in FIRST_USE_IMPORTS:
        importlib.import_module(name)  # each names a real module


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_big_requests_run_with_the_collector_off_and_their_end_keeps_the_start_up_heap_frozen():
    was_enabled = gc.isenabled()
    gc.enable()
    freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the pytest process heap: an unfreeze would show far below the slack below
    bigs = BigBodies()

    async def scenario() -> None:
        bigs.begin()
        bigs.begin()
        assert not gc.isenabled()  # no collection walks the requests' objects while they are in flight
        held = [await bigs.run(lambda: [str(i) for i in range(1000)])]
        cycle = _Cycle()
        ref = weakref.ref(cycle)
        del cycle
        await bigs.end(held)
        assert not gc.isenabled() and ref() is not None  # one big request is still in flight
        await bigs.end([])
        assert held == [] and gc.isenabled()
        assert ref() is None  # the last one's collection freed the cycle
        # ... without unfreezing the start-up heap to do it (an unfreeze empties the permanent generation). Not
        # `== frozen`: a frozen object freed by its reference count leaves it too, and under xdist the frozen heap
        # holds earlier tests' objects, some of which asyncio's loop close releases (CI saw frozen - 1).
        assert frozen - 1000 <= gc.get_freeze_count() <= frozen

    try:
        asyncio.run(scenario())
    finally:
        gc.unfreeze()
        if not was_enabled:
            gc.disable()
