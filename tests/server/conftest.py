"""Real `k3rt serve` processes on a tiny float32 K3 checkpoint, for the server tests.

`ServeProcess` starts `python -m k3rt.cli serve` in its own session on a free localhost port, waits for
GET /health == 200, records the gateway's descendant processes (engine, resource tracker) while they
run, and on `stop` sends a signal, waits for the exit status and asserts that none of those processes
outlived the gateway. The main server is session-scoped (one start for every test module); tests that
kill or reconfigure a server start their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port
from tests.procs import alive, descendants

MODEL_NAME = "tiny-k3"
READY_TIMEOUT_S = 240  # the first start imports torch and loads the checkpoint on a loaded 2-core machine


def free_port_pair() -> int:
    """A free port p whose p + 1 is free too: the server's HTTP port and its DSL port (HTTP + 1 by
    default). A taken DSL port makes the server exit at start, so both are checked."""
    return free_port(span=2)


class ServeProcess:
    def __init__(self, model: Path, log_dir: Path, *args: str) -> None:
        self.port = free_port_pair()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        self._log = open(self.log_path, "w")
        # --device cpu: `serve` takes a GPU by default where there is one; these tests pin the reference path
        # (a later --device in `args` wins)
        cmd = [sys.executable, "-m", "k3rt.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--served-model-name", MODEL_NAME, "--cache-pages", "2048", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.known: set[int] = set()  # every descendant seen while running

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        saw_503 = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"k3rt serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    self.track()
                    self.saw_503_before_ready = saw_503
                    return
                saw_503 |= r.status_code == 503
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"k3rt serve not ready after {timeout}s:\n{self.log()}")

    def track(self) -> set[int]:
        self.known |= descendants(self.proc.pid)
        return self.known

    def stats(self, headers: dict[str, str] | None = None) -> dict:
        r = httpx.get(self.url + "/v1/k3rt/stats", headers=headers, timeout=10)
        r.raise_for_status()
        return r.json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        """Signal the gateway, wait for it, assert nothing it started is left; returns the exit status."""
        if self.proc.poll() is None:
            self.track()
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"k3rt serve did not exit within {timeout}s of signal {sig}:\n{self.log()}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in self.known):
            time.sleep(0.1)
        left = [p for p in self.known if alive(p)]
        self._log.close()
        assert not left, f"processes left after k3rt serve exited: {left}\n{self.log()}"
        return code

    def kill(self) -> None:
        """Last resort for a failed test: the whole session, so nothing is left behind."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.known:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from k3rt.backend.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-k3"), arch="k3", dtype="float32")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


PORT_TAKEN = "Address already in use"
START_TRIES = 3


def start_server(model: Path, log_dir: Path, *args: str) -> ServeProcess:
    """A ready server. A start that lost its port to another process between `free_port` and the server's
    bind (the server exits naming the taken address) is retried on other ports; any other failure raises."""
    for attempt in range(1, START_TRIES + 1):
        s = ServeProcess(model, log_dir, *args)
        try:
            s.wait_ready()
            return s
        except Exception:
            s.kill()
            if attempt == START_TRIES or PORT_TAKEN not in s.log():
                raise


@contextmanager
def serving(model: Path, log_dir: Path, *args: str) -> Iterator[ServeProcess]:
    """A started server for a fixture's lifetime: it must still be alive at the end and stop cleanly (rc 0)."""
    s = start_server(model, log_dir, *args)
    try:
        yield s
        assert s.proc.poll() is None, f"the server died during the tests:\n{s.log()}"
        assert s.stop() == 0, s.log()
    finally:
        if s.proc.poll() is None:
            s.kill()


@pytest.fixture(scope="session")
def server(tiny_model: Path, log_dir: Path) -> Iterator[ServeProcess]:
    with serving(tiny_model, log_dir) as s:
        yield s


@pytest.fixture(scope="session")
def client(server: ServeProcess):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path):
    from k3rt.backend.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


# the smallest pool the tiny model starts with: one state set (3 pages) + two pages of KV (block 48)
SMALL_POOL_PAGES = 5
SMALL_POOL_ARGS = ("--cache-pages", str(SMALL_POOL_PAGES), "--max-running", "2", "--max-waiting", "6",
                   "--stall-timeout", "2")


@pytest.fixture(scope="session")
def small_server(tiny_model: Path, log_dir: Path) -> Iterator[ServeProcess]:
    """A server on the smallest pool that starts, admitting 8 engine requests, with a 2 s stall timeout."""
    with serving(tiny_model, log_dir, *SMALL_POOL_ARGS) as s:
        yield s
