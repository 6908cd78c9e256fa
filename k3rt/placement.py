"""Where `k3rt serve` runs and how big its cache is, decided once at start and printed with the reason.

Device: `--device auto` (the default) takes the first CUDA GPU when there is one that torch can use, else
the CPU. Cache: `--cache-pages` or `--cache-gb` when given; otherwise on a GPU the pool gets
`--gpu-memory-utilization` of the GPU's total memory, less what other processes already use, the
model's weights and a fixed headroom for activations and CUDA graphs (as vLLM sizes its KV cache); on
the CPU the default page count.

The GPU is probed with `nvidia-smi`, or where it is missing by torch in a child process (either way no
CUDA context stays in the serving process, whose engine runs in another process). Everything else is plain arithmetic over a `DeviceProbe`, so tests drive it with fake probes.
No torch at import.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from k3rt.config import CacheConfig

GIB = 1 << 30
ACTIVATION_HEADROOM_BYTES = 2 * GIB  # activations, CUDA graphs, allocator slack beside weights and cache
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DeviceProbe:
    """What was found: `gpus` (name, total bytes, free bytes) per visible CUDA GPU, or why there is none."""

    gpus: tuple[tuple[str, int, int], ...] = ()
    why_none: str = ""


@dataclass(frozen=True)
class Placement:
    device: str
    cache: CacheConfig
    reason: str  # one line: what was chosen and why


# run in a child process, so that the CUDA context torch creates to read free memory is not kept here
_TORCH_PROBE = """import json, torch
gpus = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append([torch.cuda.get_device_name(i), total, free])
print(json.dumps(gpus))"""


def probe_gpus() -> DeviceProbe:
    """The machine's CUDA GPUs via nvidia-smi, if torch here is a CUDA build (otherwise the engine could
    not use them); without nvidia-smi, torch itself is asked in a child process."""
    if shutil.which("nvidia-smi") is None:
        return _probe_with_torch()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return DeviceProbe(why_none=f"nvidia-smi failed: {e}")
    gpus = parse_nvidia_smi(out.stdout) if out.returncode == 0 else ()
    if not gpus:
        return DeviceProbe(why_none=f"nvidia-smi lists no GPU (exit {out.returncode})")
    import torch

    if torch.version.cuda is None:
        return DeviceProbe(why_none=f"torch {torch.__version__} is a CPU-only build")
    return DeviceProbe(gpus=gpus)


def _probe_with_torch() -> DeviceProbe:
    import json
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=120)
        gpus = tuple((str(n), int(t), int(f)) for n, t, f in json.loads(out.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return DeviceProbe(why_none=f"no nvidia-smi on PATH, and asking torch failed: {type(e).__name__}")
    return DeviceProbe(gpus=gpus) if gpus else DeviceProbe(why_none="no nvidia-smi on PATH; torch sees no CUDA GPU")


def parse_nvidia_smi(text: str) -> tuple[tuple[str, int, int], ...]:
    """Lines of `name, total MiB, free MiB` -> (name, total bytes, free bytes) per GPU."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            gpus.append((parts[0], int(parts[1]) << 20, int(parts[2]) << 20))
    return tuple(gpus)


def choose_device(requested: str, probe: DeviceProbe) -> tuple[str, str]:
    """-> (device, why). `requested`: "auto", "cpu", "cuda" or "cuda:N"."""
    if requested == "auto":
        if probe.gpus:
            return "cuda:0", f"--device auto: found {len(probe.gpus)} GPU(s)"
        return "cpu", f"--device auto: no usable GPU ({probe.why_none})"
    if requested.startswith("cuda"):
        number = requested[len("cuda:"):]
        index = 0 if requested == "cuda" else int(number) if requested.startswith("cuda:") and number.isdigit() \
            else None
        if index is None:
            raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {requested!r}")
        if index >= len(probe.gpus):
            found = f"{len(probe.gpus)} GPU(s)" if probe.gpus else f"no GPU ({probe.why_none})"
            raise ValueError(f"device: {requested} asked for, but this machine has {found}")
        return f"cuda:{index}", f"--device {requested}"
    return requested, f"--device {requested}"


def choose_cache(*, device: str, probe: DeviceProbe, cache_pages: int | None, cache_gb: float | None,
                 gpu_memory_utilization: float, weights_bytes: int) -> tuple[CacheConfig, str]:
    """-> (CacheConfig, why). Explicit sizes win; a GPU is sized from its memory; the CPU gets the default."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    if cache_pages is not None:
        return CacheConfig(num_pages=cache_pages), f"{cache_pages} pages (--cache-pages)"
    if cache_gb is not None:
        return CacheConfig(memory_gb=cache_gb, num_pages=None), f"{cache_gb:g} GiB (--cache-gb)"
    if not device.startswith("cuda"):
        pages = CacheConfig().num_pages
        return CacheConfig(), f"{pages} pages (the default off a GPU; --cache-pages or --cache-gb to change)"
    name, total, free = probe.gpus[int(device.partition(":")[2] or 0)]
    in_use = total - free
    budget = int(total * gpu_memory_utilization) - in_use - weights_bytes - ACTIVATION_HEADROOM_BYTES
    arithmetic = (f"--gpu-memory-utilization {gpu_memory_utilization:g} x {total / GIB:.1f} GiB ({name}) "
                  f"- {in_use / GIB:.1f} GiB in use - {weights_bytes / GIB:.1f} GiB weights - "
                  f"{ACTIVATION_HEADROOM_BYTES / GIB:.0f} GiB headroom")
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: nothing is left for the cache: {arithmetic} = "
                         f"{budget / GIB:.1f} GiB; raise --gpu-memory-utilization or give --cache-gb")
    return CacheConfig(memory_gb=budget / GIB, num_pages=None), f"{budget / GIB:.1f} GiB = {arithmetic}"


def place(requested_device: str, *, cache_pages: int | None, cache_gb: float | None,
          gpu_memory_utilization: float, weights_bytes: int, probe: DeviceProbe | None = None) -> Placement:
    """The device and cache for `k3rt serve`. The probe runs only when the device is not given explicitly
    as cpu (no nvidia-smi call, no torch import for `--device cpu`)."""
    if probe is None:
        probe = DeviceProbe(why_none="not probed") if requested_device == "cpu" else probe_gpus()
    device, device_why = choose_device(requested_device, probe)
    cache, cache_why = choose_cache(device=device, probe=probe, cache_pages=cache_pages, cache_gb=cache_gb,
                                    gpu_memory_utilization=gpu_memory_utilization, weights_bytes=weights_bytes)
    return Placement(device, cache, f"device {device} ({device_why}); cache {cache_why}")


def weights_bytes(model_dir: str, dtype: str | None) -> int:
    """The model's weights in bytes at its compute dtype, from config.json alone."""
    from k3rt.model_config import load_model_config, param_count

    cfg = load_model_config(model_dir)
    return param_count(cfg)["total"] * DTYPE_BYTES.get(dtype or cfg.dtype, 2)
