"""Tenant isolation of the prefix cache (issue 19, part 5), and /metrics behind the key (part 6).

Without it, another client's 1,211-token prompt showed `cached_tokens` 1,152 (and a half of it 640): any
client could probe what others had sent, by usage or by timing. With keys, each key's requests (HTTP and
DSL programs) share cached prefixes only with that key's (`--cache-isolation api-key`, the default when keys
are set); `--api-key` may be given several times or as a file; `--cache-isolation none` shares one cache."""

from __future__ import annotations

import random

import httpx
import pytest

import k3rt
from tests.server.conftest import MODEL_NAME, log_dir, serving, tiny_model  # noqa: F401

K1, K2, K3 = "key-one", "key-two", "key-three"


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["river", "stone", "lamp", "north", "quiet", "paper", "cloud", "seven"])
                    for _ in range(n))


PROMPT = _words(900, 1)  # ~1,200 tokens


def _cached(srv, key: str | None, prompt: str = PROMPT) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(srv.url + "/v1/completions", headers=headers, timeout=120,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def isolated(tiny_model, log_dir, tmp_path_factory):  # noqa: F811
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text(f"# tenants\n{K3}\n\n")
    with serving(tiny_model, log_dir, "--api-key", K1, "--api-key", K2, "--api-key-file", str(keyfile)) as s:
        yield s


@pytest.mark.timeout(180)
def test_one_keys_prompts_are_invisible_to_another_key(isolated):
    assert _cached(isolated, K1) == 0
    assert _cached(isolated, K2) == 0  # before: ~1,152 of K1's tokens showed as cached
    assert _cached(isolated, K3, PROMPT[: len(PROMPT) // 2]) == 0  # nor half of it (K3 from the key file)
    assert _cached(isolated, K1) > 1000  # K1 still hits its own prefix
    assert _cached(isolated, K2) > 1000


@pytest.mark.timeout(180)
def test_dsl_programs_are_namespaced_by_their_key(isolated):
    text = _words(600, 2)

    @k3rt.function
    def ask(s):
        s += text + k3rt.gen("x", max_tokens=1, temperature=0.0)

    def cached(key: str) -> int:
        backend = k3rt.connect(f"tcp://127.0.0.1:{isolated.port + 1}", api_key=key, timeout=60)
        try:
            return ask.run(backend=backend).meta("x")["cached_tokens"]
        finally:
            backend.shutdown()

    assert cached(K1) == 0
    assert cached(K2) == 0  # K1's program prefix is not K2's
    assert cached(K1) > 0
    assert _cached(isolated, K2, text) > 0  # one key's programs and HTTP requests share its namespace


@pytest.mark.timeout(60)
def test_metrics_need_a_key_when_keys_are_set(isolated):
    assert httpx.get(isolated.url + "/metrics", timeout=10).status_code == 401
    r = httpx.get(isolated.url + "/metrics", headers={"Authorization": f"Bearer {K2}"}, timeout=10)
    assert r.status_code == 200 and "k3rt_requests" in r.text
    assert httpx.get(isolated.url + "/health", timeout=10).status_code == 200  # probes need no key


@pytest.mark.timeout(180)
def test_isolation_off_shares_one_cache_and_public_metrics(tiny_model, log_dir):  # noqa: F811
    with serving(tiny_model, log_dir, "--api-key", K1, "--api-key", K2, "--cache-isolation", "none",
                 "--metrics-public") as s:
        assert _cached(s, K1) == 0 and _cached(s, K2) > 1000
        assert httpx.get(s.url + "/metrics", timeout=10).status_code == 200
