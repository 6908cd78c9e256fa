"""`k3rt bench tp --smoke`: the tensor-parallel decode benchmark runs end to end on CPU (TP 1 and 2 as real
rank processes over gloo, the GPU runner's torch-op path, the plan broadcast, the latent tail), prints its
tables and writes its JSON; and bad sizes are refused naming the field. The times mean nothing on CPU."""

from __future__ import annotations

import json

import pytest

from k3rt.backend.bench.tp_bench import TpBenchConfig
from k3rt.cli import main


def test_bench_tp_smoke(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "tp", "--smoke", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| TP | batch | step ms" in text and "reduce-scatter tail" in text
    res = json.loads(out.read_text())
    assert {(r["tp"], r["batch"]) for r in res["decode"]} == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in res["decode"])
    assert all(r["step_vs_tp1"] > 0 for r in res["decode"])
    # the tail's two variants give the one-process sums (fp32 on CPU)
    assert [r["M"] for r in res["tail"]] == [1, 3]
    assert all(r["all_reduce_rel_err"] < 1e-5 and r["reduce_scatter_rel_err"] < 1e-5 for r in res["tail"])


def test_bench_tp_config_refuses_bad_sizes():
    from k3rt.backend.bench.tp_bench import run

    with pytest.raises(ValueError, match="batches"):
        TpBenchConfig(batches=())
    with pytest.raises(ValueError, match="context"):
        TpBenchConfig(context=0)
    # refused before any process starts (and before looking for GPUs), naming the dimension
    with pytest.raises(ValueError, match="divisible by tensor-parallel size 3"):
        run(TpBenchConfig(model="kimi-linear-48b", tps=(1, 3)))


@pytest.mark.gpu
@pytest.mark.parametrize("symm", [False, True], ids=["nccl", "symm-mem"])
def test_bench_tp_on_two_gpus(symm, tmp_path_factory, tmp_path):
    """Two GPUs, a tiny checkpoint's shape (bf16, random weights): TP 1 and 2 run with decode graphs (NCCL, or
    the symmetric-memory all-reduce), and the tail's two variants equal the one-device sums in bf16."""
    import torch

    from tests.backend.engine_fixtures import tiny_checkpoint

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    out = tmp_path / "tp.json"
    args = ["bench", "tp", "--model", str(ckpt), "--tp", "1", "2", "--batch", "1", "4", "--context", "200",
            "--tail-m", "1", "16", "--reps", "5", "--out", str(out)] + (["--symm-allreduce"] if symm else [])
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert {(r["tp"], r["batch"]) for r in res["decode"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(r["graph"] for r in res["decode"])
    assert all(r["all_reduce_rel_err"] < 2e-2 and r["reduce_scatter_rel_err"] < 2e-2 for r in res["tail"])
