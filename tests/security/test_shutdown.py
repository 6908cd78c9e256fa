"""Stopping a real `k3rt serve`: SIGTERM to the process group (systemd, Kubernetes) or to the gateway alone
drains; requests still running at `--drain-timeout` get an OpenAI error (a JSON 503, or a final SSE error
event then [DONE]) and the exit status says requests were lost; an engine's death shows on /health at
once; a pool too small for one request stops the server with the minimum named, no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.procs import alive
from tests.server.conftest import MODEL_NAME, ServeProcess, log_dir, start_server, tiny_model  # noqa: F401

pytestmark = pytest.mark.serial  # drain timeouts of a few seconds: run alone (Makefile)

# the tiny model on 2 CPU cores makes ~150 tokens/s for one request: SHORT finishes in a second or two
# after its first token, LONG cannot finish in a few seconds
SHORT, LONG = 120, 4000


class _Call(threading.Thread):
    """One chat completion run in the background: status, content type, and the JSON body (whole
    responses) or the SSE events and whether `data: [DONE]` ended them (streams)."""

    def __init__(self, url: str, max_tokens: int, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Keep going."}],
                     "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
        if stream:
            self.body["stream_options"] = {"include_usage": True}
        self.status: int | None = None
        self.content_type = ""
        self.json: dict | None = None
        self.events: list[dict] = []
        self.done = False
        self.failure: Exception | None = None
        self.first = threading.Event()  # a stream's first content (or its end)

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body, timeout=120) as r:
                self.status, self.content_type = r.status_code, r.headers.get("content-type", "")
                if not self.stream or not self.content_type.startswith("text/event-stream"):
                    r.read()
                    self.json = r.json() if self.content_type.startswith("application/json") else {"text": r.text}
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.first.set()
        except Exception as e:  # noqa: BLE001 - a cut connection is an outcome the test reports
            self.failure = e
        finally:
            self.first.set()

    def completion_tokens(self) -> int | None:
        usage = self.json.get("usage") if self.json else next(
            (e["usage"] for e in self.events if e.get("usage")), None)
        return usage["completion_tokens"] if usage else None

    def describe(self) -> str:
        return (f"stream={self.stream} status={self.status} type={self.content_type!r} failure={self.failure!r} "
                f"json={str(self.json)[:300]} events={self.events[-2:]} done={self.done}")


@contextmanager
def _killed_at_end(s: ServeProcess) -> Iterator[ServeProcess]:
    """A server these tests stop themselves (by signals, expecting non-zero exits); killed if still alive."""
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.kill()


def _start(calls: list[_Call], s: ServeProcess) -> None:
    for c in calls:
        c.start()
    for c in calls:
        if c.stream:
            assert c.first.wait(120) and c.status == 200, c.describe()
    deadline = time.monotonic() + 60
    while s.stats()["stats"]["in_flight"] < len(calls):
        assert time.monotonic() < deadline, s.stats()
        time.sleep(0.02)


def _assert_finished(c: _Call, max_tokens: int) -> None:
    assert c.failure is None and c.status == 200, c.describe()
    assert c.completion_tokens() == max_tokens, c.describe()
    if c.stream:
        assert c.done and not any("error" in e for e in c.events), c.describe()
        finishes = [ch["finish_reason"] for e in c.events for ch in e.get("choices", []) if ch.get("finish_reason")]
        assert finishes == ["length"], c.describe()
    else:
        assert c.json["choices"][0]["finish_reason"] == "length", c.describe()


def _assert_cut(c: _Call) -> None:
    """The answer of a request still running at the drain timeout: OpenAI's error object, never a bare 500
    or a stream cut mid-chunk."""
    assert c.failure is None, c.describe()
    if c.stream:
        assert c.status == 200 and c.events and c.done, c.describe()
        error = c.events[-1].get("error")
    else:
        assert c.status == 503 and c.content_type.startswith("application/json"), c.describe()
        error = c.json.get("error")
    assert error and error["code"] == "server_shutdown" and "shutting down" in error["message"], c.describe()


def _wait_exit(s: ServeProcess, signalled_at: float, within: float) -> int:
    try:
        code = s.proc.wait(max(0.1, signalled_at + within - time.monotonic()))
    except subprocess.TimeoutExpired:
        log = s.log_path.read_text(errors="replace")[-12000:]
        raise AssertionError(f"k3rt serve still running {within}s after the signal:\n{log}") from None
    assert s.stop() == code  # already exited: checks that nothing it started is left
    return code


def test_group_sigterm_drains_running_requests(tiny_model, log_dir) -> None:  # noqa: F811
    with _killed_at_end(start_server(tiny_model, log_dir, "--drain-timeout", "60")) as s:
        calls = [_Call(s.url, SHORT, stream) for stream in (True, True, False, False)]
        _start(calls, s)
        os.killpg(s.proc.pid, signal.SIGTERM)  # what systemd and Kubernetes send: the gateway and the engine
        signalled = time.monotonic()
        for c in calls:
            c.join(60)
        code = _wait_exit(s, signalled, 60)
        for c in calls:
            _assert_finished(c, SHORT)
        assert code == 0, s.log()
        assert "exited unexpectedly" not in s.log(), s.log()


def test_group_sigterm_cuts_late_requests_with_errors(tiny_model, log_dir) -> None:  # noqa: F811
    with _killed_at_end(start_server(tiny_model, log_dir, "--drain-timeout", "1")) as s:
        calls = [_Call(s.url, LONG, stream) for stream in (True, False)]
        _start(calls, s)
        os.killpg(s.proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        code = _wait_exit(s, signalled, 1 + 5)
        for c in calls:
            c.join(10)
            _assert_cut(c)
        assert code != 0, s.log()


def test_leader_sigterm_drains_then_cuts(tiny_model, log_dir) -> None:  # noqa: F811
    drain = 5
    with _killed_at_end(start_server(tiny_model, log_dir, "--drain-timeout", str(drain))) as s:
        short, long = _Call(s.url, SHORT // 2, False), _Call(s.url, LONG, True)
        _start([long, short], s)
        s.proc.send_signal(signal.SIGTERM)  # the gateway alone
        signalled = time.monotonic()
        code = _wait_exit(s, signalled, drain + 5)
        for c in (short, long):
            c.join(10)
        _assert_finished(short, SHORT // 2)
        _assert_cut(long)
        assert code != 0, s.log()


def _exited(pid: int) -> bool:
    """The process is gone, or a zombie whose threads have all exited: its parent's waitpid reports it (a
    multi-threaded process shows state Z while its other threads still tear down)."""
    if not alive(pid):
        try:
            return len(os.listdir(f"/proc/{pid}/task")) <= 1
        except OSError:
            return True
    return False


def test_engine_death_shows_on_health_at_once(tiny_model, log_dir) -> None:  # noqa: F811
    with _killed_at_end(start_server(tiny_model, log_dir)) as s:
        engine_pid = s.stats()["stats"]["engine_pid"]
        with httpx.Client(base_url=s.url, timeout=5) as http:
            assert http.get("/health").status_code == 200
            os.kill(engine_pid, signal.SIGKILL)
            killed = time.monotonic()
            while not _exited(engine_pid):
                assert time.monotonic() - killed < 5, "the engine did not die"
            try:
                r = http.get("/health")
                assert r.status_code == 503, (r.status_code, r.text)
            except httpx.TransportError:
                pass  # the gateway already stopped listening: not healthy either
        code = _wait_exit(s, killed, 30)
        assert code not in (0, None), s.log()


def test_pool_too_small_for_one_request_says_the_minimum(tiny_model, log_dir) -> None:  # noqa: F811
    s = ServeProcess(tiny_model, log_dir, "--cache-pages", "1")  # after the default --cache-pages: wins
    try:
        code = s.proc.wait(120)
        out = s.log_path.read_text(errors="replace")
        assert code not in (0, None), out
        assert "num_pages: the pool holds 1 pages; one request needs at least 5" in out, out
        assert "Traceback" not in out, out
        assert s.stop() == code
    finally:
        if s.proc.poll() is None:
            s.kill()


def test_second_signal_ends_the_drain_at_once(tiny_model, log_dir) -> None:  # noqa: F811
    with _killed_at_end(start_server(tiny_model, log_dir, "--drain-timeout", "600")) as s:
        calls = [_Call(s.url, LONG, stream) for stream in (True, False)]
        _start(calls, s)
        os.killpg(s.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.killpg(s.proc.pid, signal.SIGINT)  # a second signal (Ctrl-C in a terminal: the whole group)
        signalled = time.monotonic()
        code = _wait_exit(s, signalled, 5)
        for c in calls:
            c.join(10)
            _assert_cut(c)
        assert code != 0, s.log()


def test_failed_start_leaves_no_engine(tiny_model, log_dir) -> None:  # noqa: F811
    """The engine ignores SIGTERM, so a gateway that fails after spawning it (here: the DSL port is taken)
    must stop it itself; multiprocessing's exit-time terminate() would not, and would wait on it forever."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        s = ServeProcess(tiny_model, log_dir, "--dsl-addr", f"tcp://127.0.0.1:{busy.getsockname()[1]}")
        try:
            deadline = time.monotonic() + 120
            while s.proc.poll() is None and time.monotonic() < deadline:
                s.track()  # the engine, once spawned
                time.sleep(0.05)
            code = _wait_exit(s, time.monotonic(), 30)
            assert code == 1 and "Address already in use" in s.log(), s.log()
        finally:
            if s.proc.poll() is None:
                s.kill()


def _dsl_run(addr: str, max_tokens: int, out: dict) -> None:
    """Run a one-gen program on the DSL port; out gets its text, or the error it raised."""
    import k3rt

    @k3rt.function
    def prog(s):
        s += "Keep going: " + k3rt.gen("x", max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    backend = k3rt.connect(addr, timeout=60)
    try:
        out["x"] = prog.run(backend=backend)["x"]
    except Exception as e:  # noqa: BLE001 - the test reads what the program got
        out["error"] = str(e)
    finally:
        backend.shutdown()


def test_group_sigterm_drains_dsl_programs(tiny_model, log_dir) -> None:  # noqa: F811
    """DSL programs in flight get the drain HTTP requests get: the finishable one finishes, the late one
    gets a shutdown error (it was cancelled outright before: uvicorn's drain only saw HTTP)."""
    with _killed_at_end(start_server(tiny_model, log_dir, "--drain-timeout", "3")) as s:
        addr = f"tcp://127.0.0.1:{s.port + 1}"
        short, long_ = {}, {}
        threads = [threading.Thread(target=_dsl_run, args=(addr, SHORT, short)),
                   threading.Thread(target=_dsl_run, args=(addr, LONG, long_))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and s.stats()["stats"].get("running", 0) < 2:
            time.sleep(0.05)
        os.killpg(s.proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(60)
        code = _wait_exit(s, signalled, 3 + 5)
        assert "x" in short and len(short["x"]) > 0, short
        assert "shutting down" in long_.get("error", "") or "server_shutdown" in long_.get("error", ""), long_
        assert code == 1, s.log()  # a program's request was cut
