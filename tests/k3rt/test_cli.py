"""The `k3rt` command line end to end: make-tiny -> inspect -> generate, and error exits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3rt.backend.generate import generate
from k3rt.backend.models.loader import load_model
from k3rt.backend.tokenizer import load_tokenizer
from k3rt.model_config import load_model_config, param_count
from k3rt.sampling_params import SamplingParams


def k3rt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3rt.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def tiny(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    r = k3rt("make-tiny", "--arch", request.param, "--out", str(out), "--seed", "3", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    return out


def test_inspect_counts_match_built_model(tiny: Path) -> None:
    r = k3rt("inspect", "--model", str(tiny), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    model = load_model(tiny, progress=False)
    assert info["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    cfg = load_model_config(tiny)
    assert info["layer_pattern"] == "KKKM"
    assert info["mla_bytes_per_token"] == cfg.mla.cache_dim * 2
    conv, rec = model.model.layers[0].self_attn.state_shapes()
    per_layer = info["kda_state_bytes_per_layer"]
    assert per_layer["conv_bfloat16"] == 2 * conv[0] * conv[1]
    assert per_layer["recurrent_float32"] == 4 * rec[0] * rec[1] * rec[2]


def test_generate_json_matches_library_greedy(tiny: Path) -> None:
    r = k3rt("generate", "--model", str(tiny), "--prompt", "def add(a, b):", "--max-tokens", "12",
             "--temperature", "0", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    tok = load_tokenizer(tiny)
    assert got["prompt_token_ids"] == tok.encode("def add(a, b):")
    model = load_model(tiny, progress=False)
    want = list(generate(model, got["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    assert got["token_ids"] == want and len(want) == 12
    assert got["text"] == tok.decode(want, skip_special_tokens=True)


def test_generate_seeded_sampling_is_reproducible(tiny: Path) -> None:
    args = ("generate", "--model", str(tiny), "--prompt", "x = ", "--max-tokens", "8", "--temperature", "1.0",
            "--top-p", "0.9", "--seed", "11", "--ignore-eos", "--json")
    a, b = k3rt(*args), k3rt(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


@pytest.mark.parametrize("flag,value,field", [("--top-p", "1.5", "top_p"), ("--temperature", "-1", "temperature"),
                                              ("--max-tokens", "0", "max_tokens")], ids=["top_p", "temperature", "max_tokens"])
def test_generate_rejects_bad_sampling_values(tiny: Path, flag: str, value: str, field: str) -> None:
    r = k3rt("generate", "--model", str(tiny), "--prompt", "x", flag, value)
    assert r.returncode == 2 and field in r.stderr


@pytest.fixture(scope="module")
def k3_files(tmp_path_factory) -> Path:
    """One tiny checkpoint's files, for checks that fail before any architecture's code runs (config.json's
    architecture, the safetensors header, the folder): one run of them, not one per architecture."""
    from k3rt.backend.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("k3-files"), arch="k3", seed=3, dtype="float32")


def test_generate_errors_name_the_problem(tmp_path: Path, k3_files: Path) -> None:
    tiny = k3_files
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    r = k3rt("generate", "--model", str(bad), "--prompt", "x")
    assert r.returncode == 2 and "architecture" in r.stderr
    data = (tiny / "model.safetensors").read_bytes()
    (bad / "config.json").write_text((tiny / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = k3rt("generate", "--model", str(bad), "--prompt", "x")
    assert r.returncode == 2 and "model.safetensors" in r.stderr
    r = k3rt("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2


def test_param_count_matches_model_for_published_48b_shape_at_small_scale() -> None:
    # param_count is pure arithmetic; check it against a built model with grouped top-k and q-LoRA
    from k3rt.backend.models.loader import build_model
    from k3rt.backend.models.tiny import TINY_CONFIGS
    from k3rt.model_config import parse_model_config

    raw = {**TINY_CONFIGS["kimi_linear"], "q_lora_rank": 24, "num_expert_group": 2, "topk_group": 1,
           "tie_word_embeddings": True}
    cfg = parse_model_config(raw)
    model = build_model(cfg)
    assert param_count(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one tensor, not a copy


def test_generate_spec_builds_its_engine_on_the_device_given(monkeypatch) -> None:
    """`generate --spec` built a CPU reference-runner engine whatever --device said."""
    import k3rt.backend.engine as engine_mod
    from k3rt.cli import main

    seen = []

    class Stop(Exception):
        pass

    def fake_engine(cfg, **kw):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(engine_mod, "Engine", fake_engine)
    with pytest.raises(Stop):
        main(["generate", "--prompt", "x", "--spec", "ngram", "--device", "meta"])
    assert seen[0].device == "meta" and seen[0].spec.method == "ngram"
