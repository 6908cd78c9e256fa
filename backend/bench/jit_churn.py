"""Triton compile churn under a serving-like workload: requests of many prompt lengths arriving while others
decode, after a warm-up of a few shapes, with the binaries each kernel compiled in each phase.

A compile is seconds of host work inside whatever step first launches a new specialization (kernels/common.py,
"Compiles"); in serving it lands in some request's TTFT, in a benchmark in the measured run. The goal: after
the warm-up, nothing compiles. Per phase: the binaries compiled (CUDA: the JITFunction caches; none under the
interpreter) and the launch keys first seen (kernels/jit_probe.py LaunchKeys: what the GPU would compile, on any
device); for the measured phase also which arguments made the new keys. The engine is the caller's (the GPU
runner, with CUDA graphs on CUDA); this module only drives it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChurnConfig:
    # warm-up: one prompt per length, arriving one per step while the earlier ones decode
    warmup_lens: tuple[int, ...] = tuple(2 ** i for i in range(9))
    num_prompts: int = 40  # measured: prompts of random lengths 1..max_len
    max_len: int = 300
    wave: int = 8  # measured prompts come in waves of this many, each wave at a random arrival spacing (1..3 steps)
    max_tokens: tuple[int, int] = (2, 8)  # each wave's generated tokens per request, drawn in this range
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.warmup_lens or min(self.warmup_lens) < 1:
            raise ValueError(f"warmup_lens: need lengths >= 1, got {self.warmup_lens}")
        if self.num_prompts < 1 or self.max_len < 1 or self.wave < 1:
            raise ValueError("num_prompts, max_len, wave: must be >= 1")
        if not 1 <= self.max_tokens[0] <= self.max_tokens[1]:
            raise ValueError(f"max_tokens: need 1 <= low <= high, got {self.max_tokens}")


@dataclass
class Phase:
    steps: int = 0
    wall_s: float = 0.0
    binaries: dict[str, int] = field(default_factory=dict)  # compiled in the phase, per kernel (CUDA)
    keys: dict[str, int] = field(default_factory=dict)  # launch keys first seen in the phase, per kernel


def stream(eng, prompts: list[list[int]], *, every: int, max_tokens: int) -> int:
    """Greedy requests for `prompts`, one arriving every `every` engine steps while the earlier ones decode
    (mixed steps: decodes beside a prefill), then every request run to its end. -> the engine steps taken."""
    from k3rt.sampling_params import SamplingParams

    queue = list(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps = 0
    while queue or eng.has_unfinished:
        if queue and steps % every == 0:
            eng.add_request(queue.pop(0), params)
        eng.step()
        steps += 1
    return steps


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_churn(eng, cfg: ChurnConfig) -> dict:
    """The warm-up phase, then the measured one, on `eng`. -> {"warmup": Phase, "measured": Phase,
    "runtime_churn": per kernel the non-constexpr arguments whose specialization varied (kernels/jit_probe.py:
    what the do_not_specialize lists miss; empty is the goal), "measured_churn": per kernel with new keys in
    the measured phase, the arguments and options whose specialization varied}."""
    from k3rt.kernels.jit_probe import LaunchKeys, compiled_counts

    rng = random.Random(cfg.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    def phase(work) -> Phase:
        b0, k0 = compiled_counts(), rec.counts()
        t0 = time.perf_counter()
        steps = work()
        _sync()
        b1, k1 = compiled_counts(), rec.counts()
        return Phase(steps, time.perf_counter() - t0, _delta(b0, b1), _delta(k0, k1))

    def measured() -> int:
        lens = [rng.randrange(1, cfg.max_len + 1) for _ in range(cfg.num_prompts)]
        steps = 0
        for i in range(0, len(lens), cfg.wave):
            steps += stream(eng, [prompt(n) for n in lens[i:i + cfg.wave]], every=rng.randrange(1, 4),
                            max_tokens=rng.randrange(cfg.max_tokens[0], cfg.max_tokens[1] + 1))
        return steps

    with LaunchKeys() as rec:
        warm = phase(lambda: stream(eng, [prompt(n) for n in cfg.warmup_lens], every=1,
                                    max_tokens=cfg.max_tokens[1]))
        meas = phase(measured)
    return {"warmup": warm, "measured": meas, "runtime_churn": rec.runtime_churn(),
            "measured_churn": {k: rec.churn(k) for k in meas.keys}}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in sorted(after.items()) if n > before.get(k, 0)}
