"""lm-eval's `local-completions` model against a real `k3rt serve`, offline: two small local tasks
(loglikelihood via multiple_choice, and loglikelihood_rolling), the tokenizer read from the server
(/tokenizer_info, /tokenize: lm-eval picks its `remote` backend by itself), no tokenizer from the hub.
Every score lm-eval logs is recomputed here from /v1/completions echo logprobs."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.compat.conftest import MODEL_NAME

pytestmark = pytest.mark.timeout(170)

QUESTIONS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "label": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "label": 1},
    {"question": "Cats say", "choices": ["meow", "woof", "moo"], "label": 2},
]
TEXTS = [{"text": "hello world, this is a small text."}, {"text": "another line of words to score"}]


def _write_tasks(root: Path) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (root / "text.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    (root / "k3rt_mc.yaml").write_text(f"""task: k3rt_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    (root / "k3rt_rolling.yaml").write_text(f"""task: k3rt_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "text.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")


def _score(url: str, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log p(continuation | context) and whether it is the greedy continuation, from echo logprobs."""
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": context + continuation, "echo": True,
                                                  "logprobs": 1, "max_tokens": 0}, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    values = lp["token_logprobs"][len(context):]
    greedy = all(v == max(top.values()) for v, top in zip(values, lp["top_logprobs"][len(context):]))
    return sum(values), greedy


def _encode(url: str, text: str) -> list[int]:
    return httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()["tokens"]


def test_lm_eval_local_completions(compat_server, tmp_path):
    lm_eval = shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    if lm_eval is None:
        pytest.skip("lm-eval is not installed (it is in the test extra: pip install -e '.[test]')")
    _write_tasks(tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "out"
    cmd = [lm_eval, "--model", "local-completions",
           "--model_args", f"base_url={compat_server.url}/v1/completions,model={MODEL_NAME},num_concurrent=1,"
                           f"max_retries=1,timeout=60",
           "--tasks", "k3rt_mc,k3rt_rolling", "--include_path", str(tmp_path), "--output_path", str(out),
           "--log_samples"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "remote tokenizer" in proc.stderr.lower() or "Using remote tokenizer" in proc.stdout

    samples = {p.name.split("_20")[0]: [json.loads(ln) for ln in p.read_text().splitlines()]
               for p in out.rglob("samples_*.jsonl")}
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    url = compat_server.url
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    bos = _encode(url, info["bos_token"])

    # multiple choice: lm-eval's (loglikelihood, is_greedy) per choice, and its accuracy
    mc = sorted(samples["samples_k3rt_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == len(QUESTIONS)
    correct = 0
    for s, q in zip(mc, QUESTIONS):
        pairs = [(a["arg_0"], a["arg_1"]) for _, a in sorted(s["arguments"].items(), key=lambda kv: int(kv[0][9:]))]
        assert [p[1].strip() for p in pairs] == [c.strip() for c in q["choices"]]
        # lm-eval's split: the whole text encoded, the continuation is what follows the context's tokens
        ours = []
        for ctx_text, cont_text in pairs:
            context = _encode(url, ctx_text)
            ours.append(_score(url, context, _encode(url, ctx_text + cont_text)[len(context):]))
        theirs = [(float(r[0][0]), r[0][1] in (True, "True")) for r in s["resps"]]
        for (ll, greedy), (their_ll, their_greedy) in zip(ours, theirs):
            assert their_ll == pytest.approx(ll, abs=1e-4) and their_greedy == greedy
        correct += max(range(len(ours)), key=lambda i: ours[i][0]) == q["label"]
    assert results["k3rt_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))

    # rolling: the whole text scored after the prefix token (BOS, from /tokenizer_info)
    total_ll = words = 0.0
    for t in TEXTS:
        ll, _ = _score(url, bos, _encode(url, t["text"]))
        total_ll += ll
        words += len(t["text"].split())
    rolling = sorted(samples["samples_k3rt_rolling"], key=lambda s: s["doc_id"])
    assert sum(float(r["resps"][0][0]) for r in rolling) == pytest.approx(total_ll, abs=1e-3)
    assert results["k3rt_rolling"]["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / words), rel=1e-4)
