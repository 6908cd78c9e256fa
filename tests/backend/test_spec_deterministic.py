"""Speculative decoding under `--deterministic` (issue 16's greedy-identity goal in bf16).

Without the mode a verify run computes its 1+k positions in other shapes than the decode steps plain
decoding runs (chunked KDA, the MLA prefill form, matmuls over more rows), and in bf16 greedy near-ties
flip. In the batch-invariant mode every row computes as a decode row does, verify rows included, and the
KDA commit replays the accepted tokens through the decode recurrence: speculative output is byte-identical
to plain deterministic output.

- Reference runner, the shipped k3-tiny in bf16, each drafter (ngram, suffix, the shipped dspark drafter):
  a batch of five (a prompt longer than the 64-token budget prefills in chunks beside verify runs), a
  second round of repeats (prefix-cache hits), and one request alone, against plain output.
- GPU runner under TRITON_INTERPRET (fp32, tiny K3 checkpoint): every generated token's logprob bit for bit
  against plain deterministic decoding, with an oracle drafter that accepts and rejects at every position.
- On the device (gpu): the GPU runner in bf16, each drafter, against plain deterministic output.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.tiny import make_tiny, two_layer_overrides
from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from k3rt.models import MODELS_DIR
from k3rt.sampling_params import SamplingParams
from tests.backend.test_spec import OracleDrafter, _refs
from tests.backend.threads import single_thread  # noqa: F401  (autouse fixture)

DRAFTERS = {"ngram": SpecConfig(method="ngram", num_tokens=4, adaptive=False),
            "suffix": SpecConfig(method="suffix", num_tokens=4, adaptive=False),
            "dspark": SpecConfig(method="dspark", num_tokens=7, adaptive=False)}

# code completions the trained k3-tiny repeats itself on (so every drafter gets drafts accepted); the
# last is longer than the 64-token budget, so it prefills in two chunks while the others verify
CODE = ["def fibonacci(n):", "def is_prime(n):", "class Stack:\n    def __init__(self):", "def quicksort(xs):",
        "import os\n\n\ndef list_files(path):\n    \"\"\"Return the names of the regular files under path, sorted, "
        "skipping hidden ones and following no symlinks.\"\"\"\n    out = []\n    for root, dirs, files in "
        "os.walk(path):\n        dirs[:] = [d for d in dirs if not d.startswith('.')]\n"]
MAX_TOKENS = 32



def _k3_tiny(**kw) -> EngineConfig:
    return EngineConfig(model=str(MODELS_DIR / "k3-tiny"), deterministic=True,
                        scheduler=SchedulerConfig(max_num_batched_tokens=64), **kw)


@pytest.fixture(scope="module")
def code_prompts() -> list[list[int]]:
    from k3rt.backend.tokenizer import load_tokenizer

    tok = load_tokenizer(MODELS_DIR / "k3-tiny")
    prompts = [tok.encode_prompt(p) for p in CODE]
    assert len(prompts[-1]) > 64 and all(len(p) < 64 for p in prompts[:-1])
    return prompts


@pytest.fixture(scope="module")
def plain_outputs(code_prompts) -> list[list[int]]:
    """Plain deterministic greedy output, all five in one batch (the mode makes it each request's own)."""
    eng = Engine(_k3_tiny(cache=CacheConfig(enable_prefix_cache=False)))
    return [o.output_ids for o in eng.generate(code_prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]


def test_deterministic_with_spec_is_accepted_at_tp1_and_refused_at_tp2() -> None:
    cfg = EngineConfig(model="k3-tiny", deterministic=True, spec=SpecConfig(method="ngram"))
    assert cfg.deterministic and cfg.spec.enabled
    with pytest.raises(ValueError, match="deterministic: runs at tp=1 only, got tp=2"):
        EngineConfig(model="k3-tiny", deterministic=True, tp=2)


def _staggered(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The short prompts first; the long one arrives once they decode (and draft), so its prefill chunks
    share steps with their verify runs."""
    rids = [eng.add_request(p, params) for p in prompts[:-1]]
    got: dict[int, list[int]] = {}
    for _ in range(3):
        for o in eng.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
    rids.append(eng.add_request(prompts[-1], params))
    while eng.has_unfinished:
        for o in eng.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
    return [got[r] for r in rids]


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_reference_runner_bf16_speculative_output_equals_plain(drafter, code_prompts, plain_outputs) -> None:
    eng = Engine(_k3_tiny(spec=DRAFTERS[drafter]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    beside_prefill = []  # verify steps that also prefilled a chunk of another request
    execute = eng.runner.execute

    def spy(out):
        if any(c.draft_ids for c in out.chunks):
            beside_prefill.append(any(c.num_tokens > 1 and not c.draft_ids for c in out.chunks))
        return execute(out)

    eng.runner.execute = spy
    assert _staggered(eng, code_prompts, params) == plain_outputs
    again = eng.generate(code_prompts[::-1], params)  # repeats: prefix-cache hits
    alone = eng.generate(code_prompts[-1:], params)
    assert [o.output_ids for o in again] == plain_outputs[::-1]
    assert alone[0].output_ids == plain_outputs[-1]
    assert any(beside_prefill) and sum(o.cached_tokens for o in again + alone) > 0
    assert eng.stats.spec_accepted_tokens > 0 and eng.stats.spec_tau > 1.0, eng.stats
    eng.check()


def _interp_engine(ckpt, spec: SpecConfig) -> Engine:
    cfg = engine_config_for_tests(str(ckpt), num_pages=128, enable_prefix_cache=False)
    return Engine(replace(cfg, runner="gpu", device="cpu", kernels=True, cuda_graphs=False, deterministic=True,
                          spec=spec, scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def _staggered_logprobs(eng: Engine, prompts: list[list[int]], params: list[SamplingParams],
                        late: int) -> list[list[tuple[int, float]]]:
    """(token, logprob) of every generated token; the last prompt arrives after `late` steps, so its
    prefill shares a step with the others' verify runs (or decodes)."""
    rids: list[int] = []
    got: dict[int, list[tuple[int, float]]] = {}

    def add(p, sp):
        rids.append(eng.add_request(p, replace(sp, logprobs=0)))
        got[rids[-1]] = []

    for p, sp in zip(prompts[:-1], params[:-1]):
        add(p, sp)
    steps = 0
    while eng.has_unfinished or len(rids) < len(prompts):
        if steps == late:
            add(prompts[-1], params[-1])
        for o in eng.step():
            got[o.rid] += list(zip(o.new_token_ids, o.logprobs or []))
        steps += 1
    return [got[r] for r in rids]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case; the gpu-marked case runs on the device")
def test_gpu_runner_interpreter_verify_logprobs_equal_plain(tmp_path) -> None:
    """The GPU runner's batch-invariant mode under TRITON_INTERPRET, tiny fp32 K3 checkpoint: verify runs
    (scratch KDA states, decode-form MLA rows) beside a prefill and a plain decode, then the commit's replay;
    every generated (token, logprob) equals plain deterministic decoding bit for bit (the tiny fp32 model's
    greedy tokens alone agree even with the default numerics; its logprobs do not: with deterministic=False
    the first request's first and third logprobs differ). Before the mode covered verify runs, the
    token-by-token KDA path advanced the live states during the verify and the commit advanced them again.
    Kept small (two layers, short prompts): every KDA token is a kernel launch in the interpreter."""
    ckpt = make_tiny(tmp_path / "k3", arch="k3", seed=7, dtype="float32", overrides=two_layer_overrides("k3"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 3, 5)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in (5, 4, 2)]
    plain = _staggered_logprobs(_interp_engine(ckpt, SpecConfig()), prompts, params, late=2)
    eng = _interp_engine(ckpt, SpecConfig(method="ngram", num_tokens=3, adaptive=False))
    eng.scheduler.drafter = OracleDrafter(_refs(prompts, [[t for t, _ in o] for o in plain]), noise=0.3, seed=1)
    beside_prefill = []
    execute = eng.runner.execute

    def spy(out):
        if any(c.draft_ids for c in out.chunks):
            beside_prefill.append(any(c.num_tokens > 1 and not c.draft_ids for c in out.chunks))
        return execute(out)

    eng.runner.execute = spy
    assert _staggered_logprobs(eng, prompts, params, late=2) == plain
    assert any(beside_prefill)
    assert 0 < eng.stats.spec_accepted_tokens < eng.stats.spec_drafted_tokens, eng.stats
    eng.check()


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_gpu_runner_bf16_speculative_output_equals_plain(drafter, code_prompts) -> None:
    """On the device: the GPU runner (Triton kernels, decode graphs) with k3-tiny in bf16, plain deterministic
    output one request at a time against speculative output in a batch, then repeated (prefix-cache hits)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain_eng = Engine(_k3_tiny(device="cuda", runner="gpu"))
    plain = [plain_eng.generate([p], params)[0].output_ids for p in code_prompts]
    eng = Engine(_k3_tiny(device="cuda", runner="gpu", spec=DRAFTERS[drafter]))
    for r in range(2):
        outs = [o.output_ids for o in eng.generate(code_prompts, params)]
        assert outs == plain, f"round {r}: {[i for i in range(len(outs)) if outs[i] != plain[i]]} differ"
    assert eng.stats.spec_accepted_tokens > 0


def test_cli_generate_deterministic_with_spec(capsys, monkeypatch) -> None:
    """`k3rt generate --deterministic --spec ngram`: the engine it builds is in the mode (the flag was
    dropped on this path), and its tokens are `k3rt generate --deterministic`'s (the model path)."""
    import k3rt.backend.engine as engine_mod
    from k3rt.cli import main

    built: list[EngineConfig] = []

    class Spy(engine_mod.Engine):
        def __init__(self, cfg, *args, **kw):
            built.append(cfg)
            super().__init__(cfg, *args, **kw)

    monkeypatch.setattr(engine_mod, "Engine", Spy)
    args = ["generate", "--prompt", CODE[0], "--max-tokens", "24", "--ignore-eos", "--json", "--deterministic"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--spec", "ngram", "--spec-tokens", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert [c.deterministic for c in built] == [True]
    assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 24
