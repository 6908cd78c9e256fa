"""k3rt.Runtime with the spawned engine process (the default), and process hygiene: nothing is left after
shutdown() / the `with` block / the client process being killed; a client that goes away has its programs
cancelled on the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import k3rt
from tests.procs import alive, descendants

pytestmark = pytest.mark.timeout(240)

# The spawned engine inherits the environment. One intra-op thread: on a small, busy CPU machine torch's
# thread-pool hand-offs make each step of the tiny model ~10-50x slower (the in-process engine's worker
# thread does not see this).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@k3rt.function
def multi_turn(s, q1, q2):
    s += k3rt.system("You are a helpful assistant.")
    s += k3rt.user(q1)
    s += k3rt.assistant(k3rt.gen("a1", max_tokens=12))
    s += k3rt.user(q2)
    s += k3rt.assistant(k3rt.select("a2", ["yes", "no"]))
    s += k3rt.user("Why?")
    s += k3rt.assistant(k3rt.gen("a3", max_tokens=12, stop="\n"))


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if alive(p)}


def test_spawned_engine_matches_in_process_and_leaves_nothing(tiny_model, rt, monkeypatch) -> None:
    for k, v in ONE_THREAD.items():
        monkeypatch.setenv(k, v)
    want = multi_turn.run(q1="Hi", q2="Is it raining?", backend=rt, temperature=0)
    existing = descendants(os.getpid())
    with k3rt.Runtime(model=str(tiny_model), dtype="float32") as spawned:
        # multiprocessing's resource tracker is one per client process, shared by every spawn and gone
        # with the process (test_killed_client_process_leaves_nothing checks that): not the Runtime's
        started = {p for p in descendants(os.getpid()) - existing if not _is_resource_tracker(p)}
        assert spawned.client.proc.pid in started  # the engine is a process of its own
        before = spawned.backend.round_trips
        got = multi_turn.run(q1="Hi", q2="Is it raining?", backend=spawned, temperature=0)
        assert spawned.backend.round_trips - before == 1
        assert {v: got[v] for v in ("a1", "a2", "a3")} == {v: want[v] for v in ("a1", "a2", "a3")}
        assert got.text() == want.text()
        stats = spawned.engine_stats
        assert stats["prompt_tokens"] >= got.meta("a3")["prompt_tokens"]
        assert 0 < stats["computed_prompt_tokens"] <= stats["prompt_tokens"]
    assert not _wait_gone(started, 10), "processes left after the with block"
    spawned.shutdown()  # idempotent


CLIENT = """
import json, sys, time
import k3rt

@k3rt.function
def hello(s):
    s += k3rt.user("Hi")
    s += k3rt.assistant(k3rt.gen("a", max_tokens=4))

if __name__ == "__main__":  # the engine process is spawned: the main module must be importable
    rt = k3rt.Runtime(model=sys.argv[1], dtype="float32")
    state = hello.run(backend=rt, temperature=0)
    print(json.dumps({"engine": rt.client.proc.pid, "a": state["a"]}), flush=True)
    time.sleep(600)
"""


def test_killed_client_process_leaves_nothing(tiny_model, tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, **ONE_THREAD})
    tracked: set[int] = set()
    try:
        line = proc.stdout.readline()
        assert line, "the client exited before its Runtime started"
        out = json.loads(line)
        tracked = descendants(proc.pid)
        assert out["engine"] in tracked and isinstance(out["a"], str)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        left = _wait_gone(tracked, 15)
        assert not left, f"processes left after the client was killed: {left}"
    finally:
        for p in tracked | {proc.pid}:
            if alive(p):
                os.kill(p, signal.SIGKILL)


REMOTE_CLIENT = """
import sys
import k3rt

@k3rt.function
def long_story(s):
    s += "Once upon a time" + k3rt.gen("story", max_tokens=4000, ignore_eos=True)

print("started", flush=True)
long_story.run(backend=k3rt.connect(sys.argv[1]), temperature=0)
"""


def test_programs_of_a_client_that_goes_away_are_cancelled(rt, tmp_path: Path) -> None:
    script = tmp_path / "remote.py"
    script.write_text(REMOTE_CLIENT)
    engine = rt.client.engine
    proc = subprocess.Popen([sys.executable, str(script), rt.address], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while not engine.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.has_unfinished, "the remote program never reached the engine"
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while (engine.has_unfinished or rt.server.sessions) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished, "the gone client's request still runs"
        assert not rt.server.sessions
    finally:
        if proc.poll() is None:
            proc.kill()


def test_connect_over_tcp(tiny_model, rt) -> None:
    from tests.ports import free_port

    port = free_port()
    want = multi_turn.run(q1="Hi", q2="Is it raining?", backend=rt, temperature=0)
    with k3rt.Runtime(model=str(tiny_model), in_process=True, dtype="float32",
                      endpoint=f"tcp://127.0.0.1:{port}"):
        be = k3rt.connect(f"tcp://127.0.0.1:{port}")
        try:
            k3rt.set_default_backend(be)
            got = multi_turn.run(q1="Hi", q2="Is it raining?", temperature=0)
            assert be.round_trips == 1 and got.text() == want.text()
        finally:
            k3rt.set_default_backend(None)
            be.shutdown()
    with pytest.raises(ValueError, match="tcp:// or ipc://"):
        k3rt.connect("localhost:1234")
