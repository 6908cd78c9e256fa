"""backend/runner/gpu/ops.linear's one-row GEMV switches (session 45): KernelConfig.gemv_prefetch launches every
skinny GEMV with PDL and the prefetch form asked, KernelConfig.gemv_unrolled the unrolled form at that many rows a
program (the default since session 46, with gemv_wide); both checked as the config is built. CPU: the interpreter,
fp16 (the skinny kernel's 16-bit path)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.backend.runner.gpu.ops import KernelConfig, linear  # noqa: E402
from k3rt.kernels.linear import skinny_linear_ref  # noqa: E402


def _spy(monkeypatch) -> list[dict]:
    """The kwargs of every skinny_linear call `linear` makes from here on (ops.kernel is cached: patch its lookup)."""
    from k3rt.backend.runner.gpu import ops

    seen, lookup = [], ops.kernel

    def spied(module: str, name: str):
        fn = lookup(module, name)
        if (module, name) != ("linear", "skinny_linear"):
            return fn

        def spy(*a, **kw):
            seen.append(kw)
            return fn(*a, **kw)
        return spy

    monkeypatch.setattr(ops, "kernel", spied)
    return seen


@pytest.mark.parametrize("fields,want", [
    ({}, {}),
    ({"gemv_prefetch": "l2"}, {"use_pdl": True, "prefetch": "l2"}),
    ({"gemv_prefetch": "tile"}, {"use_pdl": True, "prefetch": "tile"}),
])
def test_linear_passes_the_prefetch_form(fields: dict, want: dict, monkeypatch) -> None:
    seen = _spy(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 96, generator=g).half()
    w = (torch.randn(40, 96, generator=g) * 0.1).half()
    y = linear(x, w, KernelConfig(gemv_unrolled=False, **fields))  # the looped form: "tile" is its prefetch
    assert len(seen) == 1 and {k: seen[0][k] for k in want} == want and ("prefetch" in seen[0]) == bool(want)
    assert torch.equal(y, linear(x, w, KernelConfig(gemv_unrolled=False)))  # the same bits as the plain launch


@pytest.mark.parametrize("K,rows", [(96, 4), (600, 1), (3100, None)])
def test_linear_takes_the_unrolled_form_by_shape(K: int, rows: int | None, monkeypatch) -> None:
    """gemv_unrolled: one row of x through the unrolled form at pick_unrolled's rows (four for K <= 512, one to
    3072, the looped tiles past that); two rows (the fp32 router's form) keep the looped form."""
    from k3rt.kernels.linear import unrolled_tiles

    seen = _spy(monkeypatch)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(1, K, generator=g).half()
    w = (torch.randn(40, K, generator=g) * 0.05).half()
    y = linear(x, w, KernelConfig(gemv_unrolled=True))
    assert seen[-1].get("tiles") == (unrolled_tiles(rows) if rows else None)
    ref = skinny_linear_ref(x, w, torch.float32)
    assert (y.float() - ref).abs().max() <= 2e-3 * ref.abs().max()
    linear(torch.randn(2, K).half(), w.float(), KernelConfig(gemv_unrolled=True), out_dtype=torch.float32)
    assert len(seen) == 2 and "tiles" not in seen[-1]


def test_wide_outputs_take_the_gemv_only_with_gemv_wide(monkeypatch) -> None:
    """One row onto 4,100 outputs (past prefer_skinny's 4,096): cuBLAS without gemv_wide, and without gemv_unrolled
    whatever gemv_wide says (the looped tiles lose to cuBLAS there); the unrolled GEMV by default (both on)."""
    from k3rt.kernels.linear import unrolled_tiles

    seen = _spy(monkeypatch)
    x = torch.randn(1, 64).half()
    w = (torch.randn(4100, 64) * 0.1).half()
    linear(x, w, KernelConfig(gemv_wide=False))
    linear(x, w, KernelConfig(gemv_unrolled=False))
    assert not seen
    y = linear(x, w, KernelConfig())
    assert len(seen) == 1 and seen[0]["tiles"] == unrolled_tiles(4)
    ref = skinny_linear_ref(x, w, torch.float32)
    assert (y.float() - ref).abs().max() <= 2e-3 * ref.abs().max()


@pytest.mark.parametrize("form,want", [("l2", {"use_pdl": True, "prefetch": "l2"}), ("tile", {})])
def test_unrolled_takes_the_l2_prefetch_not_the_tile(form: str, want: dict, monkeypatch) -> None:
    from k3rt.kernels.linear import unrolled_tiles

    seen = _spy(monkeypatch)
    x = torch.randn(1, 96).half()
    w = (torch.randn(40, 96) * 0.1).half()
    linear(x, w, KernelConfig(gemv_unrolled=True, gemv_prefetch=form))
    assert seen[-1] == {"out_dtype": None, "tiles": unrolled_tiles(4), **want}


def test_the_switches_are_checked_as_the_config_is_built() -> None:
    with pytest.raises(ValueError, match="gemv_prefetch: must be one of"):
        KernelConfig(gemv_prefetch="dram")
    assert KernelConfig().gemv_unrolled and KernelConfig().gemv_wide and KernelConfig().moe_gemv


@pytest.mark.parametrize("unrolled", [True, False])
def test_the_kda_gates_trigger_launch_takes_linears_tiles(unrolled: bool, monkeypatch) -> None:
    """kda_decode_pdl_trigger's gates' up-projection (backend/runner/gpu/kda.py _gate_linear) runs the skinny GEMV
    with its PDL trigger in the tiles `linear` would pick: the unrolled form's at one row with gemv_unrolled (the
    default since session 46), so the switch changes the trigger only. Before, it always took the looped tiles."""
    from k3rt.backend.runner.gpu import kda, ops
    from k3rt.kernels.linear import pick_unrolled

    seen = _spy(monkeypatch)
    monkeypatch.setattr(kda, "kernel", ops.kernel)  # kda.py's own name for the (spied) lookup
    x = torch.randn(1, 64).half()
    w = (torch.randn(96, 64) * 0.1).half()
    k = KernelConfig(gemv_unrolled=unrolled)
    y = kda._gate_linear(x, w, k, trigger=True)
    assert seen[-1].get("trigger") is True and seen[-1].get("tiles") == (pick_unrolled(96, 64) if unrolled else None)
    assert torch.equal(y, linear(x, w, k))  # the same bits as the launch without the trigger
