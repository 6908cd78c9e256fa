"""LatentMoE's tail under tensor parallelism (issue 17 part 4): the reduce-scatter variant (shared partial
reduce-scattered, the up-projection column-striped, one all-gather) and the plain all-reduce variant give
the TP-1 model's logits, through the real loader's sharding, with 2 gloo processes on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3rt.backend.distributed import TPContext
from k3rt.backend.layers.linear import ColumnParallelLinear, ReplicatedLinear
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.loader import load_model
from k3rt.backend.models.tiny import make_tiny
from tests.ports import free_port

TP = 2


def _rank(rank: int, port: int, ckpt: str, ids: list[int], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    torch.set_num_threads(1)
    try:
        got = {}
        for tail in ("reduce_scatter", "all_reduce"):
            tp = TPContext(rank, TP, dist.group.WORLD, latent_tail=tail)
            model = load_model(ckpt, tp=tp, progress=False)
            moe = next(m for m in model.modules() if getattr(m, "m", None) is not None and m.m.latent_size)
            up = moe.routed_expert_up_proj
            # the reduce-scatter tail holds 1/TP of the up-projection's rows; the plain tail all of them
            assert isinstance(up, ColumnParallelLinear if tail == "reduce_scatter" else ReplicatedLinear), tail
            with torch.no_grad():
                got[tail] = model(torch.tensor(ids), ForwardBatch.single(len(ids)))
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_both_latent_tails_equal_tp1(tmp_path: Path) -> None:
    ckpt = make_tiny(tmp_path / "k3", arch="k3", dtype="float32", seed=6)
    ids = torch.randint(3, 500, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = load_model(ckpt, progress=False)(torch.tensor(ids), ForwardBatch.single(len(ids)))
    out = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(free_port(), str(ckpt), ids, str(out)), nprocs=TP, join=True)
    got = torch.load(out)
    for tail, logits in got.items():
        assert logits.shape == want.shape
        assert torch.allclose(logits, want, atol=1e-5, rtol=1e-5), (tail, (logits - want).abs().max().item())


def test_bad_tail_name_is_refused() -> None:
    with pytest.raises(ValueError, match="latent_tail must be"):
        TPContext(latent_tail="ring")


@pytest.mark.timeout(120)
def test_tail_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/latent_tail.py --smoke (torchrun, 2 gloo ranks): both variants equal the one-process sums."""
    import json
    import subprocess
    import sys

    out = tmp_path / "tail.json"
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "latent_tail.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(bench), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["M"] for r in rows] == [1, 3]
    assert all(r["all_reduce_rel_err"] < 1e-6 and r["reduce_scatter_rel_err"] < 1e-6 for r in rows), rows
