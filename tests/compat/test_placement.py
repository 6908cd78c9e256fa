"""`k3rt serve`'s device and cache decisions (k3rt/placement.py) with fake GPU probes, and its vLLM-style
flags. The CUDA branches cannot run on a CPU machine; the decisions they feed are plain arithmetic."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3rt.cli import build_parser
from k3rt.placement import (
    ACTIVATION_HEADROOM_BYTES, GIB, DeviceProbe, choose_cache, choose_device, parse_nvidia_smi, place,
)

H200 = DeviceProbe(gpus=(("NVIDIA H200", 140 * GIB, 138 * GIB), ("NVIDIA H200", 140 * GIB, 140 * GIB)))
NONE = DeviceProbe(why_none="no nvidia-smi on PATH")


def test_parse_nvidia_smi():
    text = "NVIDIA H200, 143771, 143000\nNVIDIA A100-SXM4-80GB, 81920, 1024\n"
    assert parse_nvidia_smi(text) == (("NVIDIA H200", 143771 << 20, 143000 << 20),
                                      ("NVIDIA A100-SXM4-80GB", 81920 << 20, 1024 << 20))
    assert parse_nvidia_smi("No devices were found") == ()


@pytest.mark.parametrize("requested, probe, device", [
    ("auto", H200, "cuda:0"), ("auto", NONE, "cpu"), ("cpu", H200, "cpu"), ("cuda", H200, "cuda:0"),
    ("cuda:1", H200, "cuda:1")], ids=["auto-gpu", "auto-cpu", "cpu-forced", "cuda", "cuda-1"])
def test_choose_device(requested, probe, device):
    assert choose_device(requested, probe)[0] == device


def test_choose_device_errors_name_the_field():
    with pytest.raises(ValueError, match=r"device: cuda asked for, but this machine has no GPU \(no nvidia-smi"):
        choose_device("cuda", NONE)
    with pytest.raises(ValueError, match="device: cuda:2 asked for, but this machine has 2 GPU"):
        choose_device("cuda:2", H200)


def test_cache_from_gpu_memory():
    weights = 10 * GIB
    cache, why = choose_cache(device="cuda:0", probe=H200, cache_pages=None, cache_gb=None,
                              gpu_memory_utilization=0.9, weights_bytes=weights)
    # 0.9 x 140 GiB - 2 GiB already in use - 10 GiB weights - the headroom
    expected = int(140 * GIB * 0.9) - 2 * GIB - weights - ACTIVATION_HEADROOM_BYTES
    assert cache.memory_gb == pytest.approx(expected / GIB) and cache.num_pages is None
    assert "--gpu-memory-utilization 0.9 x 140.0 GiB (NVIDIA H200) - 2.0 GiB in use - 10.0 GiB weights" in why
    smaller, _ = choose_cache(device="cuda:0", probe=H200, cache_pages=None, cache_gb=None,
                              gpu_memory_utilization=0.5, weights_bytes=weights)
    assert smaller.memory_gb < cache.memory_gb
    with pytest.raises(ValueError, match="gpu_memory_utilization: nothing is left for the cache"):
        choose_cache(device="cuda:0", probe=H200, cache_pages=None, cache_gb=None, gpu_memory_utilization=0.1,
                     weights_bytes=weights)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
        choose_cache(device="cuda:0", probe=H200, cache_pages=None, cache_gb=None, gpu_memory_utilization=1.5,
                     weights_bytes=weights)


def test_explicit_sizes_and_cpu_default_win():
    p = place("auto", cache_pages=100, cache_gb=None, gpu_memory_utilization=0.9, weights_bytes=0, probe=H200)
    assert (p.device, p.cache.num_pages, p.cache.memory_gb) == ("cuda:0", 100, None)
    assert p.reason == "device cuda:0 (--device auto: found 2 GPU(s)); cache 100 pages (--cache-pages)"
    p = place("auto", cache_pages=None, cache_gb=3.5, gpu_memory_utilization=0.9, weights_bytes=0, probe=H200)
    assert p.cache.memory_gb == 3.5
    p = place("auto", cache_pages=None, cache_gb=None, gpu_memory_utilization=0.9, weights_bytes=0, probe=NONE)
    assert p.device == "cpu" and p.cache.num_pages == 256 and p.cache.memory_gb is None
    assert "no usable GPU (no nvidia-smi on PATH)" in p.reason


def test_vllm_flag_spellings():
    a = build_parser().parse_args(["serve", "--max-model-len", "100", "--max-num-seqs", "7",
                                   "--max-num-batched-tokens", "512", "--served-model-name", "m",
                                   "--gpu-memory-utilization", "0.8"])
    assert (a.context_length, a.max_running, a.max_batched_tokens, a.served_model_name, a.gpu_memory_utilization,
            a.device) == (100, 7, 512, "m", 0.8, "auto")
    assert build_parser().parse_args(["inspect", "--model", "x", "--tensor-parallel-size", "4"]).tp == 4


def test_trust_remote_code_is_refused():
    proc = subprocess.run([sys.executable, "-m", "k3rt.cli", "serve", "--trust-remote-code"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "trust_remote_code: k3rt never runs code shipped with a checkpoint" in proc.stderr
    assert "Remove --trust-remote-code" in proc.stderr


def test_probe_with_a_fake_nvidia_smi(tmp_path, monkeypatch):
    """The nvidia-smi branch end to end: a GPU listed, but torch here must be a CUDA build to use it."""
    import torch

    from k3rt.placement import probe_gpus

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771, 140000'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    probe = probe_gpus()
    if torch.version.cuda is None:
        assert probe.gpus == () and probe.why_none == f"torch {torch.__version__} is a CPU-only build"
    else:
        assert probe.gpus == (("NVIDIA H200", 143771 << 20, 140000 << 20),)
