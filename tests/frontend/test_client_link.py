"""The DSL client's I/O thread against a bare ZMQ ROUTER standing in for the server: what the server sent
before it closed the connection reaches the program before the disconnect fails it."""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")

from frontend.client import RemoteBackend  # noqa: E402
from k3rt.protocol import ProgramResult, ProgramRun, decode, encode  # noqa: E402

SHUTDOWN = "server_shutdown: the server shut down before the program finished"


class _LatePoller(zmq.Poller):
    """Each poll starts 0.3 s late, so a reply and the close after it are both waiting when it looks."""

    def poll(self, timeout=None):
        time.sleep(0.3)
        return super().poll(timeout)


@pytest.mark.timeout(30)
def test_a_result_sent_just_before_the_server_closes_reaches_the_program(monkeypatch):
    """CI: a drained server sent a program's shutdown error and closed; the client handled the disconnect
    first (its socket monitor before its socket) and the program failed with 'the DSL server closed the
    connection with programs in flight' instead of the server's error."""
    monkeypatch.setattr(zmq, "Poller", _LatePoller)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve_once() -> None:
        ident, data = router.recv_multipart()
        run = decode(data)
        assert isinstance(run, ProgramRun)
        router.send_multipart([ident, encode(ProgramResult(run.pid, {}, {}, {}, {}, SHUTDOWN, None))])
        router.close(linger=2000)  # the result goes out, then the connection closes

    server = threading.Thread(target=serve_once, daemon=True)
    server.start()
    backend = RemoteBackend(f"tcp://127.0.0.1:{port}", timeout=20)
    try:
        out = backend.run("p1", {"ops": []}, final=True, stream=False, on_event=None)
        assert out["error"] == SHUTDOWN, out
    finally:
        server.join(5)
        backend.shutdown()
        ctx.term()
