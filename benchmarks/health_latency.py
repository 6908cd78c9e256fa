#!/usr/bin/env python3
"""/health latency of a real `k3rt serve` while it refuses big bodies (CPU; the gateway's event loop, not the model).

    python3 benchmarks/health_latency.py                 # tiny K3 checkpoint, 5 rounds, table to stdout
    python3 benchmarks/health_latency.py --rounds 10 --hog 1 --out /tmp/health.json

Per round, one body per kind is sent while another thread polls /health every 20 ms: a 20 MB completions prompt
and a 5 MB chat message (both refused with a 413 before tokenizing), and chat bodies of 100K and 300K small
messages (refused by the context check after parsing; 300K is past what the gateway keeps under the bound). The figure per body is the slowest /health answer while it was in
flight, polled from a process of its own; the bound the server is held to is 100 ms
(tests/security/test_big_bodies.py). --hog N runs N busy processes beside the server (a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

WORDS = "the quick brown fox jumps over the lazy dog "


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="bodies of each kind sent (default 5)")
    p.add_argument("--hog", type=int, default=0, help="busy processes to run beside the server (default 0)")
    p.add_argument("--port", type=int, default=18231)
    p.add_argument("--out", type=Path, default=None, help="JSON results here too")
    return p.parse_args()


def _bodies() -> dict[str, tuple[str, bytes]]:
    def text(n: int) -> str:
        return (WORDS * (n // len(WORDS) + 1))[:n]

    def many(n: int) -> bytes:
        return orjson.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}] * n})

    return {
        "completions 20 MB": ("/v1/completions", orjson.dumps({"model": "m", "prompt": text(20 << 20), "max_tokens": 2})),
        "chat 5 MB": ("/v1/chat/completions", orjson.dumps({"model": "m", "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": text(5 << 20)}]})),
        "chat 100K messages": ("/v1/chat/completions", many(100_000)),
        # past the bound: the JSON parser builds the 300K-item array in one GIL hold (docs/architecture.md)
        "chat 300K messages": ("/v1/chat/completions", many(300_000)),
    }


def _poll(url: str, stop, worst) -> None:
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(url + "/health")
            worst.value = max(worst.value, time.perf_counter() - t0)
            time.sleep(0.02)


def _worst_health_ms(url: str, path: str, body: bytes) -> tuple[float, int]:
    """(slowest /health answer in ms while `body` was in flight, the POST's status). The poller is its own
    process: in this one, the client sending 20 MB holds the GIL now and then, which is not the server's doing."""
    ctx = multiprocessing.get_context("spawn")
    stop, worst = ctx.Event(), ctx.Value("d", 0.0)
    poller = ctx.Process(target=_poll, args=(url, stop, worst), daemon=True)
    poller.start()
    time.sleep(1.0)  # the spawned interpreter's start-up
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=120)
    time.sleep(0.3)  # the request's clean-up (freeing the body, one collection) runs after its answer
    stop.set()
    poller.join(30)
    return worst.value * 1e3, r.status_code


def main() -> int:
    a = _args()
    from k3rt.backend.models.tiny import make_tiny

    tmp = Path(tempfile.mkdtemp())
    model = make_tiny(tmp / "tiny", arch="k3", dtype="float32")
    url = f"http://127.0.0.1:{a.port}"
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "k3rt.cli", "serve", "--model", str(model), "--port", str(a.port),
                             "--served-model-name", "m", "--device", "cpu", "--dsl-addr", "off"],
                            stdout=log, stderr=subprocess.STDOUT)
    hogs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"k3rt serve did not start; see {tmp / 'serve.log'}")
            time.sleep(0.2)
        httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "warm", "max_tokens": 2}, timeout=120)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hog)]
        bodies = _bodies()
        res: dict[str, list[float]] = {k: [] for k in bodies}
        for _ in range(a.rounds):
            for name, (path, body) in bodies.items():
                ms, status = _worst_health_ms(url, path, body)
                if status not in (400, 413):
                    raise SystemExit(f"{name}: expected a 4xx refusal, got {status}")
                res[name].append(round(ms, 1))
    finally:
        for h in hogs:
            h.kill()
        proc.terminate()
        proc.wait(60)
    print(f"| body | worst /health ms per body ({a.rounds} rounds, {a.hog} busy processes) | median | max |")
    print("|---|---|---:|---:|")
    for name, ms in res.items():
        print(f"| {name} | {', '.join(f'{x:.0f}' for x in ms)} | {statistics.median(ms):.0f} | {max(ms):.0f} |")
    if a.out:
        a.out.write_text(json.dumps({"rounds": a.rounds, "hog": a.hog, "worst_health_ms": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
