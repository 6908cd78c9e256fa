"""One `k3rt serve` for the client-compatibility tests, on the tiny K3 checkpoint with `add_bos_token` set (so
that a text prompt starts with [BOS], as k3-tiny's do), started with vLLM's spellings of the serving flags."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME, ServeProcess, log_dir, serving, tiny_model  # noqa: F401 (fixtures)

CONTEXT = 4096  # --max-model-len
MAX_SEQS = 32  # --max-num-seqs


@pytest.fixture(scope="session")
def bos_model(tiny_model: Path, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("tiny-k3-bos") / "tiny-k3"
    shutil.copytree(tiny_model, out)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["add_bos_token"] = True
    path.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="session")
def compat_server(bos_model: Path, log_dir: Path) -> Iterator[ServeProcess]:  # noqa: F811
    # --device auto (the default, overriding the test servers' cpu): the start-up line says what it chose
    with serving(bos_model, log_dir, "--max-model-len", str(CONTEXT), "--max-num-seqs", str(MAX_SEQS),
                 "--max-num-batched-tokens", "1024", "--device", "auto") as s:
        yield s


@pytest.fixture(scope="session")
def oai(compat_server: ServeProcess):
    import openai

    return openai.OpenAI(base_url=compat_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


__all__ = ["MODEL_NAME"]
