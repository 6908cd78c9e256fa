"""Issue 19 part 2: the DSL port of `k3rt serve` (ZMQ ROUTER) with `--api-key`.

One real server (tests/server/conftest.py's `serving`) with a key and a 12 MiB message cap serves every
test here, through raw ZMQ DEALER sockets (what an attacker has) and through `k3rt.connect`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import zmq

import k3rt
from k3rt.frontend.client import apply_api_key
from k3rt.protocol import ProgramResult, ProgramRun, decode, encode
from tests.server.conftest import ServeProcess, free_port, log_dir, serving, tiny_model  # noqa: F401 (fixtures)
from tests.timing import paused_gc

KEY = "dsl-test-key"
MAX_MB = 12

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]  # a /health latency bound: run alone (Makefile)


@pytest.fixture(scope="module")
def dsl_server(tiny_model: Path, log_dir: Path) -> Iterator[ServeProcess]:  # noqa: F811
    addr = f"tcp://127.0.0.1:{free_port()}"
    with serving(tiny_model, log_dir, "--api-key", KEY, "--dsl-addr", addr, "--dsl-max-message-mb", str(MAX_MB)) as s:
        s.dsl = addr
        yield s


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _dealer(ctx: zmq.Context, addr: str, api_key: str | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    # a DEALER's send blocks while it has no pipe to a peer; a client the server rejects loses its pipe
    # after the failed handshake and reconnects, so an unbounded send could wait forever
    s.setsockopt(zmq.SNDTIMEO, 5000)
    if api_key is not None:
        apply_api_key(s, api_key)
    s.connect(addr)
    return s


def _program(text: str = "Hello", max_tokens: int = 2) -> dict:
    return {"ops": [{"kind": "text", "value": text},
                    {"kind": "gen", "name": "x", "params": {"max_tokens": max_tokens, "temperature": 0}}],
            "num_states": 1}


def _run_bytes(pid: str, program: dict | None = None) -> bytes:
    return encode(ProgramRun(pid, program or _program(), True, False))


def _results(sock: zmq.Socket, timeout_s: float) -> list[ProgramResult]:
    """Every ProgramResult the socket receives within timeout_s (probes skipped)."""
    out, deadline = [], time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            data = sock.recv_multipart()[-1]
            if data:
                msg = decode(data)
                if isinstance(msg, ProgramResult):
                    out.append(msg)
    return out


def _result_for(sock: zmq.Socket, pid: str, timeout_s: float) -> ProgramResult | None:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000)):
            break
        data = sock.recv_multipart()[-1]
        if data:
            msg = decode(data)
            if isinstance(msg, ProgramResult) and msg.pid == pid:
                return msg
    return None


def _try_send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send if the socket has a pipe; a rejected client may have none (its handshake failed) and then the
    message is not delivered at all, which is what the test wants to see too."""
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        pass


def test_key_required_on_raw_socket(dsl_server: ServeProcess, ctx: zmq.Context) -> None:
    plain = _dealer(ctx, dsl_server.dsl)  # no key at all: plain ZMTP
    wrong = _dealer(ctx, dsl_server.dsl, "not-the-key")  # CURVE with a key the server does not hold
    pids = [uuid.uuid4().hex for _ in range(4)]
    _try_send(plain, [_run_bytes(pids[0])])
    _try_send(plain, [KEY.encode(), _run_bytes(pids[1])])  # the key in a frame proves nothing
    _try_send(wrong, [_run_bytes(pids[2])])
    _try_send(wrong, [KEY.encode(), _run_bytes(pids[3])])
    assert not _results(plain, 2.0) and not _results(wrong, 1.0), "a client without the key got an answer"
    log = dsl_server.log()  # both rejections are logged: the wrong key (by ZAP) and the plain client's handshake
    assert "DSL port: rejected a connection from 127.0.0.1: its CURVE key is not one of" in log, log
    assert "the handshake failed" in log, log
    # the right key runs the program
    right = _dealer(ctx, dsl_server.dsl, KEY)
    ok = uuid.uuid4().hex
    right.send(_run_bytes(ok))
    r = _result_for(right, ok, 60)
    assert r is not None and r.error is None and "x" in r.variables["0"], r


def test_connect_with_key(dsl_server: ServeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    @k3rt.function
    def hello(s):
        s += "Hello"
        s += k3rt.gen("x", max_tokens=2, temperature=0)

    monkeypatch.delenv("K3RT_API_KEY", raising=False)
    for key in ("wrong", None):  # a wrong key, and none at all: a clear error, fast, not a hang
        backend = k3rt.connect(dsl_server.dsl, api_key=key, timeout=60)
        try:
            t0 = time.monotonic()
            with pytest.raises(PermissionError, match="api_key|K3RT_API_KEY"):
                hello.run(backend=backend)
            assert time.monotonic() - t0 < 10
            with pytest.raises(PermissionError):  # and every later program too
                hello.run(backend=backend)
        finally:
            backend.shutdown()
    backend = k3rt.connect(dsl_server.dsl, api_key=KEY, timeout=60)
    try:
        assert isinstance(hello.run(backend=backend)["x"], str)
    finally:
        backend.shutdown()
    monkeypatch.setenv("K3RT_API_KEY", KEY)  # the key from the environment when not given
    backend = k3rt.connect(dsl_server.dsl, timeout=60)
    try:
        assert isinstance(hello.run(backend=backend)["x"], str)
    finally:
        backend.shutdown()


def test_oversized_frame_dropped(dsl_server: ServeProcess, ctx: zmq.Context) -> None:
    big = "a" * ((MAX_MB << 20) + 1024)
    # through k3rt.connect: libzmq drops the connection; the client says so instead of hanging, and reconnects
    backend = k3rt.connect(dsl_server.dsl, api_key=KEY, timeout=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="dsl-max-message-mb"):
            backend.run(uuid.uuid4().hex, _program(big), final=True, stream=False, on_event=None)
        assert time.monotonic() - t0 < 10
        r = backend.run(uuid.uuid4().hex, _program(), final=True, stream=False, on_event=None)
        assert r["error"] is None and "x" in r["variables"]["0"], r
    finally:
        backend.shutdown()
    # a raw socket: dropped too, and the endpoint keeps serving a new connection
    sock = _dealer(ctx, dsl_server.dsl, KEY)
    pid = uuid.uuid4().hex
    sock.send(_run_bytes(pid, _program(big)))
    assert _result_for(sock, pid, 3.0) is None
    sock2 = _dealer(ctx, dsl_server.dsl, KEY)
    ok = uuid.uuid4().hex
    sock2.send(_run_bytes(ok))
    r = _result_for(sock2, ok, 60)
    assert r is not None and r.error is None, r


def test_bad_messages_never_end_the_loop(dsl_server: ServeProcess, ctx: zmq.Context) -> None:
    sock = _dealer(ctx, dsl_server.dsl, KEY)
    bad_pid = orjson.dumps(["ProgramRun", {"pid": ["x"], "program": _program(), "final": True, "stream": False}])
    sock.send(bad_pid)  # an unhashable pid (once ended the receive loop for good)
    sock.send(b"\xff not json")
    sock.send_multipart([b"two", b"frames"])
    sock.send(orjson.dumps(["Shutdown", {}]))  # a message the DSL port does not take
    # programs that are well-typed messages but bad programs get an error result naming the problem
    bad_programs = {
        "ops": {"ops": "x"},
        "ops[0].value": {"ops": [{"kind": "text", "value": 5}]},
        "ops[0].state": {"ops": [{"kind": "text", "value": "a", "state": 3}], "num_states": 4},  # never forked
        "ops[0].children": {"ops": [{"kind": "fork", "children": [0]}], "num_states": 2},  # forks into itself
        "num_states": {"ops": [], "num_states": 10 ** 9},
        "ops[0]": {"ops": [{"kind": "text", "value": "a", "color": "red"}]},
    }
    pids = {}
    for field, prog in bad_programs.items():
        pids[field] = uuid.uuid4().hex
        sock.send(_run_bytes(pids[field], prog))
    for field, pid in pids.items():
        r = _result_for(sock, pid, 30)
        assert r is not None, f"no answer to a program with a bad {field}"
        assert r.error and field in r.error, (field, r.error)
    ok = uuid.uuid4().hex
    sock.send(_run_bytes(ok))
    r = _result_for(sock, ok, 60)
    assert r is not None and r.error is None and "x" in r.variables["0"], r
    log = dsl_server.log()
    assert "ProgramRun.pid" in log, log  # what was rejected is logged


@pytest.mark.parametrize("size", [8 << 20, 400_000], ids=["8MiB", "400K"])
def test_big_text_op_keeps_health_answering(dsl_server: ServeProcess, size: int) -> None:
    # 8 MiB can never fit the tiny model's context (8192 tokens of at most 28 bytes): refused before it is
    # tokenized; 400K characters might as far as its length tells, so it is tokenized (off the event loop)
    # and the engine refuses the 220K-token prompt
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "north", "table"]
    text = " ".join(words[i * 7 % 10] for i in range(size // 5))[:size]
    backend = k3rt.connect(dsl_server.dsl, api_key=KEY, timeout=60)
    done: dict = {}

    def run() -> None:
        try:
            done["result"] = backend.run(uuid.uuid4().hex, _program(text, 1), final=True, stream=False,
                                         on_event=None)
        except BaseException as e:  # noqa: BLE001 (reported below)
            done["error"] = e

    with httpx.Client(base_url=dsl_server.url, timeout=30) as http, paused_gc():
        assert http.get("/health").status_code == 200
        worst = 0.0
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while t.is_alive() and time.monotonic() < deadline:
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
        t.join(1)
    backend.shutdown()
    assert not t.is_alive(), "the program did not finish within 30 s"
    assert "error" not in done, done
    error = done["result"]["error"]
    assert error and "context length" in error, error
    if size == 400_000:
        assert error.startswith("prompt:"), error  # the engine's check: the text was tokenized
    assert worst < 0.1, f"/health took {worst * 1000:.0f} ms while a text op of {size} characters was processed"


def test_runtime_key_and_keyless_server(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # a Runtime on tcp with api_key: its own backend holds the key; other clients need it
    monkeypatch.setenv("K3RT_API_KEY", "from-the-environment")  # neither Runtime's backend nor server reads it
    addr = f"tcp://127.0.0.1:{free_port()}"
    with k3rt.Runtime(model=str(tiny_model), in_process=True, dtype="float32", cache_pages=64, endpoint=addr,
                      api_key="rt-key") as rt:
        r = rt.backend.run(uuid.uuid4().hex, _program(), final=True, stream=False, on_event=None)
        assert r["error"] is None, r
        for key, ok in ((None, False), ("rt-key", True)):
            backend = k3rt.connect(addr, api_key=key, timeout=60)  # None: the environment's (wrong) key
            try:
                if ok:
                    assert backend.run(uuid.uuid4().hex, _program(), final=True, stream=False,
                                       on_event=None)["error"] is None
                else:
                    with pytest.raises(PermissionError, match="rejected the api_key"):
                        backend.run(uuid.uuid4().hex, _program(), final=True, stream=False, on_event=None)
            finally:
                backend.shutdown()
    # a server without a key: a client that brings one is told so, and one without runs
    addr = f"tcp://127.0.0.1:{free_port()}"
    with k3rt.Runtime(model=str(tiny_model), in_process=True, dtype="float32", cache_pages=64, endpoint=addr):
        backend = k3rt.connect(addr, api_key="some-key", timeout=60)
        try:
            with pytest.raises(PermissionError, match="takes no api_key"):
                backend.run(uuid.uuid4().hex, _program(), final=True, stream=False, on_event=None)
        finally:
            backend.shutdown()
        monkeypatch.delenv("K3RT_API_KEY")
        backend = k3rt.connect(addr, timeout=60)
        try:
            assert backend.run(uuid.uuid4().hex, _program(), final=True, stream=False, on_event=None)["error"] is None
        finally:
            backend.shutdown()
