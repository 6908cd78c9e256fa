"""benchmarks/bandwidth_probe.py (issue 18: what the memory system gives at the decode shapes, beside the kernels):
its no-math kernels do what their rows claim, and every row is timed, on the CPU interpreter at tiny shapes."""
from __future__ import annotations

from pathlib import Path

from tests.kernels.helpers import run_benchmark_smoke


def test_bandwidth_probe_smoke(tmp_path: Path) -> None:
    res = run_benchmark_smoke("bandwidth_probe.py", tmp_path / "bw.json")
    assert [c["ok"] for c in res["check"]] == [True, True], res["check"]  # the RMW shapes' results, the paged sums
    names = [r["name"] for r in res["kda"]] + [r["name"] for r in res["mla"]]
    # KDA: torch's scale and copy, the decode's and fla's tiles with and without the reductions, one value-major
    # tiling with and without them, kda_decode
    assert len(res["kda"]) == 9 and len(res["mla"]) == 4, names
    assert [r["value_major"] for r in res["kda"] if "value_major" in r] == [False] * 4 + [True] * 2, names
    assert all("us" in r for r in res["kda"] + res["mla"]), [r for r in res["kda"] + res["mla"] if "us" not in r]
