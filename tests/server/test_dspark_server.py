"""`k3rt serve --spec dspark --spec-model DIR`: a DSpark drafter (random weights, verifying every draft) on the
tiny K3 checkpoint: greedy completions equal the in-process engine without speculation, /metrics and usage
count drafted and accepted tokens, and a DSL program runs unchanged."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import k3rt
from tests.server.conftest import MODEL_NAME, ServeProcess, serving
from tests.server.test_spec_server import _engine_reference, _two_turns


@pytest.fixture(scope="module")
def dspark_server(tiny_model: Path, log_dir: Path, tmp_path_factory):
    import torch

    from k3rt.backend.spec.dspark.checkpoint import save_drafter
    from k3rt.backend.spec.dspark.model import DSparkConfig, DSparkModel
    from k3rt.model_config import load_model_config

    cfg = load_model_config(tiny_model)
    d = DSparkModel(DSparkConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                 target_hidden_size=cfg.hidden_size, target_layers=(1, cfg.num_hidden_layers),
                                 context_len=3, block_size=4, num_layers=1, num_heads=2, head_dim=16,
                                 intermediate_size=64, markov_rank=4, confidence_hidden=8, confidence_threshold=0.0))
    d.init_weights(0)
    folder = save_drafter(d, tmp_path_factory.mktemp("drafter"), dtype=torch.float32)
    with serving(tiny_model, log_dir, "--spec", "dspark", "--spec-model", str(folder)) as s:
        yield s


@pytest.mark.timeout(240)
def test_dspark_server_greedy_metrics_and_dsl(dspark_server: ServeProcess, tiny_model: Path) -> None:
    r = httpx.post(dspark_server.url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": "The drafting server says", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["token_ids"] == _engine_reference(tiny_model, body["prompt_token_ids"])
    stats = dspark_server.stats()["stats"]
    assert stats["spec_drafted_tokens"] >= 4 and stats["spec_drafted_tokens"] >= stats["spec_accepted_tokens"]
    # the controller's plans by reason reach the stats and /metrics (k3rt_spec_plans_total{why})
    assert sum(stats["spec_plan_whys"].values()) >= 1
    metrics = httpx.get(dspark_server.url + "/metrics", timeout=30).text
    assert 'k3rt_spec_plans_total{why="' in metrics
    backend = k3rt.connect(f"tcp://127.0.0.1:{dspark_server.port + 1}", timeout=60)
    try:
        run = _two_turns.run(topic="drafts", backend=backend)
    finally:
        backend.shutdown()
    assert run.error() is None and run["a"] and run["b"]
