"""Issue 17's K3-width check: a slice of Kimi-K3 (the `kimi-k3-slice` preset: K3's widths, four layers, random
MXFP4 routed experts) written as a checkpoint, then greedy decoding through the engine under tensor parallelism
against the fp32 reference path on the CPU.

Steps (`run_slice`):
  1. the checkpoint: random weights drawn on `init_device` (bf16; MXFP4 experts as random E2M1 codes and E8M0 scales
     near 2^-7), written with a tiny tokenizer of `vocab` tokens (the preset's 163,840-token vocabulary is cut to keep
     the embedding and LM head small; it changes no layer);
  2. the reference: `runner="model"` on the CPU in fp32 (the experts dequantized from the same bytes), a random prompt,
     `tokens` greedy tokens with their logprobs and each position's top-2 margin;
  3. the engine under test: `tp` ranks on `device` in `dtype`, the same prompt: its free-running greedy tokens, and
     (teacher forced) the log-probabilities it gives the reference's tokens, so a bf16 tie flip at one position does
     not hide how close the rest is.

A free-running token that differs where the reference's top-2 margin is below `tie_margin` is reported as a tie
flip, not a failure of the engine. `smoke`: the tiny k3 shape (MXFP4 experts), CPU, gloo, torch ops, in seconds.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SliceConfig:
    out_dir: str  # the checkpoint folder (created; reused when it holds a checkpoint of the same config)
    tp: int = 2
    ep: int | bool = 1  # expert-parallel degree (EngineConfig.ep)
    device: str = "cuda"
    dtype: str = "bfloat16"  # the engine under test's compute dtype (the reference is fp32)
    experts: int | None = None  # None: the preset's (64)
    vocab: int = 8192
    prompt_len: int = 32
    tokens: int = 16
    seed: int = 0
    init_device: str = "cpu"  # where the random weights are drawn (the GPU is faster at K3 width)
    tie_margin: float = 0.05  # nats: a reference top-2 margin below this makes a differing token a tie flip
    cuda_graphs: bool = True  # the engine under test on CUDA: decode steps replayed from graphs (off: all eager)
    smoke: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "vocab", "prompt_len", "tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype: one of bfloat16, float16, float32, got {self.dtype!r}")
        if self.experts is not None and self.experts < 16:
            raise ValueError(f"experts: must be >= 16 (K3 routes to 16 per token), got {self.experts}")


def slice_raw_config(cfg: SliceConfig) -> dict:
    """The slice's config.json: the preset (or, smoke, the tiny k3 shape) with MXFP4 experts and `vocab`."""
    from k3rt.backend.models.tiny import TINY_CONFIGS
    from k3rt.presets import KIMI_K3_SLICE, MXFP4_EXPERTS_QUANTIZATION

    if cfg.smoke:
        # expert width 64: a multiple of the MXFP4 group (32) on each of up to two ranks
        raw = dict(TINY_CONFIGS["k3"], quantization_config=MXFP4_EXPERTS_QUANTIZATION, vocab_size=min(cfg.vocab, 512),
                   moe_intermediate_size=64)
    else:
        raw = dict(KIMI_K3_SLICE, vocab_size=cfg.vocab)
    if cfg.experts is not None:
        raw["num_experts"] = cfg.experts
    return raw


def write_slice(cfg: SliceConfig) -> Path:
    """Write (or reuse) the random slice checkpoint; returns its folder."""
    import torch

    from k3rt.backend.models.tiny import write_random_checkpoint

    out = Path(cfg.out_dir)
    stamp = out / "k3_slice.json"
    key = json.loads(json.dumps({"raw": slice_raw_config(cfg), "seed": cfg.seed}))  # as read back from the stamp
    if stamp.exists() and json.loads(stamp.read_text()) == key:
        log.info("reusing the slice checkpoint in %s", out)
        return out
    t0 = time.perf_counter()
    write_random_checkpoint(out, key["raw"], seed=cfg.seed, dtype="bfloat16", init_dtype="bfloat16",
                            device=cfg.init_device, max_shard_bytes=4 << 30, progress=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    stamp.write_text(json.dumps(key))
    log.info("wrote the slice checkpoint to %s in %.1f s", out, time.perf_counter() - t0)
    return out


def _greedy(engine, prompt: list[int], tokens: int) -> tuple[list[int], list[float], list[float]]:
    """Free-running greedy tokens, their logprobs, and each position's top-2 margin (nats)."""
    from k3rt.sampling_params import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2))
    ids, lps, margins = [], [], []
    while engine.has_unfinished:
        for o in engine.step():
            if o.rid != rid:
                continue
            ids += o.new_token_ids
            lps += o.logprobs or []
            margins += [top[0][1] - top[1][1] for top in (o.top_logprobs or [])]
    return ids, lps, margins


def _scored(engine, prompt: list[int], continuation: list[int]) -> list[float]:
    """Teacher forced: log p(continuation[i] | prompt + continuation[:i]) for each i."""
    from k3rt.sampling_params import SamplingParams

    seq = prompt + continuation
    rid = engine.add_request(seq, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                             prompt_logprobs_from=len(prompt))
    scores = None
    while engine.has_unfinished:
        for o in engine.step():
            if o.rid == rid and o.finished:
                scores = o.prompt_logprobs
    return [scores[p] for p in range(len(prompt), len(seq))]


def _engine(cfg: SliceConfig, folder: Path, *, reference: bool):
    from k3rt.backend.engine import Engine
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig

    if reference:
        ec = EngineConfig(model=str(folder), dtype="float32", device="cpu", runner="model",
                          cache=CacheConfig(kv_dtype="float32", conv_dtype="float32", num_pages=64))
    else:
        ec = EngineConfig(model=str(folder), dtype=cfg.dtype, device=cfg.device, tp=cfg.tp, ep=cfg.ep,
                          runner="gpu", kernels=cfg.device == "cuda", cuda_graphs=cfg.device == "cuda" and cfg.cuda_graphs,
                          cache=CacheConfig(num_pages=64, **({} if cfg.device == "cuda" else
                                                            dict(kv_dtype="float32", conv_dtype="float32"))))
    return Engine(replace(ec, scheduler=SchedulerConfig(max_num_batched_tokens=max(256, cfg.prompt_len + cfg.tokens))))


def _run(cfg: SliceConfig, folder: Path, prompt: list[int], *, reference: bool, score: list[int] | None = None):
    """One engine's greedy run (and, given `score`, its teacher-forced logprobs of those tokens); the engine is
    closed and dropped before returning, so the fp32 reference's memory is free for the engine under test."""
    import gc

    eng = _engine(cfg, folder, reference=reference)
    try:
        out = _greedy(eng, prompt, cfg.tokens)
        if score is not None:
            out = (*out, _scored(eng, prompt, score))
    finally:
        eng.close()
        del eng
        gc.collect()
    return out


def run_slice(cfg: SliceConfig) -> dict:
    """Write the slice, run the reference and the engine under test; the comparison as a dict."""
    folder = write_slice(cfg)
    raw = slice_raw_config(cfg)
    rng = random.Random(cfg.seed + 1)
    prompt = [rng.randrange(3, min(raw["vocab_size"], 512) - 3) for _ in range(cfg.prompt_len)]
    t0 = time.perf_counter()
    want, want_lp, margins = _run(cfg, folder, prompt, reference=True)
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    got, _, _, forced = _run(cfg, folder, prompt, reference=False, score=want)
    t_eng = time.perf_counter() - t0
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    diffs = [abs(a - b) for a, b in zip(forced, want_lp)]
    return {
        "config": asdict(cfg), "prompt": prompt, "reference": want, "engine": got,
        "identical": got == want, "first_difference": first,
        "tie_flip": first is not None and margins[first] < cfg.tie_margin,
        "reference_margins": margins, "reference_logprobs": want_lp, "engine_forced_logprobs": forced,
        "max_forced_logprob_diff": max(diffs), "mean_forced_logprob_diff": sum(diffs) / len(diffs),
        "reference_s": t_ref, "engine_s": t_eng,
    }


def table(res: dict) -> str:
    c = res["config"]
    ep = " EP" if c["ep"] is True else "" if c["ep"] in (1, False) else f" EP{c['ep']}"
    verdict = ("identical" if res["identical"] else
               f"differs from token {res['first_difference']}" + (" (a tie flip)" if res["tie_flip"] else ""))
    return "\n".join([
        f"| slice | engine | tokens | greedy | max / mean forced logprob diff | min ref margin |",
        "|---|---|---:|---|---:|---:|",
        f"| {'tiny k3 (smoke)' if c['smoke'] else 'kimi-k3-slice'} | TP{c['tp']}{ep} "
        f"{c['device']} {c['dtype']} | {c['tokens']} | {verdict} | "
        f"{res['max_forced_logprob_diff']:.4f} / {res['mean_forced_logprob_diff']:.4f} | "
        f"{min(res['reference_margins']):.4f} |",
    ])
