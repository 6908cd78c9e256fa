"""Fixtures for the DSL tests: a tiny float32 K3 checkpoint (random weights: the text is noise, but greedy
output is deterministic) and a module-scoped in-process `k3rt.Runtime` on it.

The Runtime runs the same gateway (ProgramServer over ZMQ) either way; in_process=True only puts the engine
on a thread instead of a spawned process, which saves the engine's torch import per module.
test_runtime.py covers the spawned engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import k3rt

CACHE_PAGES = 768  # room for 64 programs sharing a 1,000-token prompt plus the other tests' prefixes


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from k3rt.backend.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("dsl-tiny-k3"), arch="k3", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):
    from k3rt.backend.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def rt(tiny_model: Path) -> Iterator["k3rt.Runtime"]:
    runtime = k3rt.Runtime(model=str(tiny_model), in_process=True, dtype="float32", cache_pages=CACHE_PAGES)
    try:
        yield runtime
    finally:
        runtime.shutdown()


def stats_delta(rt: "k3rt.Runtime", before: dict) -> dict[str, int]:
    after = rt.engine_stats
    return {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens", "computed_prompt_tokens")}


def words(n: int, seed: int) -> str:
    """n pseudo-random words: a prompt no other test shares, so its tokens are computed exactly here."""
    import random

    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "river", "stone", "cloud", "paper", "lamp",
             "seven", "orange", "quiet", "north", "table"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a DSL bug tends to show as a hang (a lost message, a deadlock): fail the test instead of the whole run
    for item in items:
        if item.get_closest_marker("timeout") is None and "tests/frontend/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.timeout(180))
