"""Models with MXFP4 routed experts (issue 17 part 5): `k3rt quantize --mxfp4-experts` writes the
compressed-tensors format, the loader reads it, and the model computes exactly what the dense model with
the dequantized expert weights computes (MXFP4 values are exact in every float dtype), on the reference
path and on the GPU runner with the Triton kernels (interpreter here; the `gpu` case on the device).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.loader import CheckpointError, load_model
from k3rt.backend.models.quantize import quantize_checkpoint
from k3rt.backend.models.tiny import make_tiny, two_layer_overrides
from k3rt.kernels.moe.mxfp4_ref import dequantize_mxfp4
from k3rt.model_config import ConfigError, load_model_config
from k3rt.sampling_params import SamplingParams

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def pair(request, tmp_path_factory) -> tuple[Path, Path]:
    """(dense tiny checkpoint, its MXFP4-expert copy written by the CLI)."""
    d = tmp_path_factory.mktemp(request.param)
    dense = make_tiny(d / "dense", arch=request.param, dtype="float32", seed=3)
    out = subprocess.run([sys.executable, "-m", "k3rt.cli", "quantize", "--model", str(dense), "--out", str(d / "mx"),
                          "--mxfp4-experts"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return dense, d / "mx"


@pytest.fixture(scope="module")
def planar_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(dense, MXFP4) tiny K3 checkpoints whose experts fit the planar layout (latent width and expert
    intermediate 256: K of both weights a multiple of the planar chunk), so the GPU runner repacks them. Two
    layers (one MoE layer): the interpreter pays per program."""
    d = tmp_path_factory.mktemp("k3_planar")
    dense = make_tiny(d / "dense", arch="k3", dtype="float32", seed=4,
                      overrides={**two_layer_overrides("k3"), "routed_expert_hidden_size": 256,
                                 "moe_intermediate_size": 256})
    quantize_checkpoint(dense, d / "mx", progress=False)
    return dense, d / "mx"


@pytest.fixture(scope="module")
def two_layer_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(dense, MXFP4) tiny K3 checkpoints cut to two layers (KDA with a dense MLP, then MLA with the LatentMoE
    MXFP4 experts): the interpreter pays per layer, and the one MoE layer runs the same grouped GEMM as three."""
    d = tmp_path_factory.mktemp("k3_two_layers")
    dense = make_tiny(d / "dense", arch="k3", dtype="float32", seed=3, overrides=two_layer_overrides("k3"))
    quantize_checkpoint(dense, d / "mx", progress=False)
    return dense, d / "mx"


def dequantized_twin(mx_dir: Path, dense_dir: Path) -> torch.nn.Module:
    """The dense model with every routed expert replaced by the MXFP4 model's dequantized weights."""
    mx, dense = load_model(mx_dir, progress=False), load_model(dense_dir, progress=False)
    for a, b in zip(mx.modules(), dense.modules()):
        if getattr(a, "mxfp4", False):
            b.w13.data = dequantize_mxfp4(a.w13_packed, a.w13_scale, b.w13.dtype)
            b.w2.data = dequantize_mxfp4(a.w2_packed, a.w2_scale, b.w2.dtype)
    return mx, dense


def test_the_checkpoint_is_compressed_tensors_mxfp4(pair) -> None:
    from safetensors import safe_open

    dense, mx = pair
    cfg = load_model_config(mx)
    assert cfg.moe.expert_format == "mxfp4" and load_model_config(dense).moe.expert_format == "dense"
    qc = json.loads((mx / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mxfp4-pack-quantized"
    with safe_open(str(next(mx.glob("*.safetensors"))), framework="pt") as h:
        names = set(h.keys())
        i = cfg.mlp_types.index("moe")
        p = f"model.layers.{i}.block_sparse_moe.experts.0.w1."
        assert {p + "weight_packed", p + "weight_scale"} <= names and p + "weight" not in names
        width = cfg.moe.latent_size or cfg.hidden_size
        assert tuple(h.get_tensor(p + "weight_packed").shape) == (cfg.moe.intermediate_size, width // 2)
        assert h.get_tensor(p + "weight_scale").dtype == torch.uint8
        # everything that is not a routed expert is copied bit for bit
        with safe_open(str(next(dense.glob("*.safetensors"))), framework="pt") as d:
            for n in d.keys():
                if ".experts." not in n:
                    assert torch.equal(d.get_tensor(n), h.get_tensor(n)), n
    assert (mx / "tokenizer.json").is_file()


def test_mxfp4_model_equals_dense_model_with_dequantized_experts(pair) -> None:
    mx, dense = dequantized_twin(pair[1], pair[0])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (37,), generator=g)
    with torch.no_grad():
        a, b = mx(ids, ForwardBatch.single(37)), dense(ids, ForwardBatch.single(37))
        # and the quantization is not a no-op: the original dense experts give other logits
        orig = load_model(pair[0], progress=False)(ids, ForwardBatch.single(37))
    assert torch.equal(a, b)
    assert not torch.equal(orig, a)


@pytest.mark.parametrize("runner", ["model", "gpu"])
def test_engine_greedy_equals_dequantized_dense(pair, runner, request) -> None:
    """Through the engine (prefix cache on, a shared prefix hit), reference runner and the GPU runner with the
    Triton kernels (the MXFP4 grouped GEMM in the interpreter)."""
    if runner == "gpu" and HAS_CUDA:
        pytest.skip("on a GPU: test_gpu_mxfp4_model_equals_cpu_reference")
    dense_dir, mx_dir = pair
    if runner == "gpu" and load_model_config(mx_dir).moe.latent_size is None:
        pytest.skip("the interpreter run is kept to the LatentMoE arch; the kernel is the same")
    if runner == "gpu":  # the interpreter's cost is per layer: two layers (36 s with four)
        dense_dir, mx_dir = request.getfixturevalue("two_layer_pair")
    _, twin = dequantized_twin(mx_dir, dense_dir)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 70)]
    prompts.append(prompts[1] + [7, 8])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(model_dir, model=None, **over) -> list[list[int]]:
        eng = Engine(replace(engine_config_for_tests(str(model_dir), num_pages=64), **over), model=model)
        outs = [o.output_ids for o in eng.generate(prompts, params)]
        eng.check()
        return outs

    want = run(dense_dir, model=twin, runner="model")
    over = dict(runner="gpu", kernels=True, cuda_graphs=False) if runner == "gpu" else dict(runner="model")
    assert run(mx_dir, **over) == want


def test_engine_greedy_through_the_planar_experts_equals_the_reference(planar_pair) -> None:
    """The GPU runner's default MXFP4 path (experts repacked in place into planar words, the planar kernel;
    the interpreter here) against the reference runner on the same checkpoint. Kept short: the interpreter
    pays per program, and the planar widths (256) give 8 programs per expert block and GEMM."""
    if HAS_CUDA:
        pytest.skip("on a GPU: test_gpu_mxfp4_model_equals_cpu_reference")
    _, mx_dir = planar_pair
    prompts = [torch.randint(3, 500, (6,), generator=torch.Generator().manual_seed(6)).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = {}
    for name, over in (("ref", dict(runner="model")), ("gpu", dict(runner="gpu", kernels=True, cuda_graphs=False))):
        eng = Engine(replace(engine_config_for_tests(str(mx_dir), num_pages=64), **over))
        outs[name] = [o.output_ids for o in eng.generate(prompts, params)]
        if name == "gpu":
            moes = [m for m in eng.runner.model.modules() if getattr(m, "mxfp4", False)]
            assert moes and all(m.expert_layout == "planar" for m in moes)
    assert outs["gpu"] == outs["ref"]


def test_quantized_tensors_without_a_quantization_config_are_named(pair, tmp_path) -> None:
    _, mx = pair
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in mx.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    raw = json.loads((mx / "config.json").read_text())
    del raw["quantization_config"]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight_packed: unexpected tensor"):
        load_model(bad, progress=False)
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="quantization_config: quant_method 'compressed-tensors' with format "
                                          r"\['nvfp4-pack-quantized'\] is not supported"):
        load_model_config(bad)
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                  "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "group_size": 32}}}}
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config_groups\.g\.weights: expected num_bits 4"):
        load_model_config(bad)


def test_quantize_refuses_what_it_cannot_do(pair, tmp_path) -> None:
    dense, mx = pair
    with pytest.raises(ValueError, match="already MXFP4"):
        quantize_checkpoint(mx, tmp_path / "again", progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="--out: .* exists and is not empty"):
        quantize_checkpoint(dense, tmp_path / "full", progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", ["tiny", "planar"])
def test_gpu_mxfp4_model_equals_cpu_reference(pair, planar_pair, ckpt) -> None:
    """The compiled MXFP4 kernels in the GPU runner: on the tiny checkpoints (widths under the planar chunk)
    the dot_scaled kernel (fp32 model: its explicit dequant), on `planar_pair` the default planar kernel."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    dense_dir, mx_dir = pair if ckpt == "tiny" else planar_pair
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for name, over in (("ref", dict(runner="model")), ("gpu", dict(runner="gpu", device="cuda"))):
        eng = Engine(replace(engine_config_for_tests(str(mx_dir), num_pages=64), **over))
        outs[name] = [o.output_ids for o in eng.generate(prompts, params)]
    assert outs["gpu"] == outs["ref"]


def _ep_rank(rank: int, port: int, ckpt: str, ids: list[int], out: str) -> None:
    import torch.distributed as dist

    from k3rt.backend.distributed import TPContext

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        model = load_model(ckpt, tp=TPContext(rank, 2, dist.group.WORLD), ep=True, progress=False)
        with torch.no_grad():
            logits = model(torch.tensor(ids), ForwardBatch.single(len(ids)))
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_mxfp4_experts_under_expert_parallelism_equal_tp1(pair, tmp_path) -> None:
    """TP2 with --ep: each rank loads half the experts whole (packed codes and scales), same logits as TP 1.
    Width-split TP of these tiny experts (I = 32) would leave 16 per rank, under the MXFP4 group: refused."""
    import torch.multiprocessing as mp

    from k3rt.backend.distributed import TPContext
    from tests.ports import free_port

    _, mx = pair
    ids = torch.randint(3, 500, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = load_model(mx, progress=False)(torch.tensor(ids), ForwardBatch.single(len(ids)))
    out = tmp_path / "ep.pt"
    mp.spawn(_ep_rank, args=(free_port(), str(mx), ids, str(out)), nprocs=2, join=True)
    assert torch.allclose(torch.load(out), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of 32 .the MXFP4 group."):
        load_model(mx, tp=TPContext(0, 2), progress=False)
