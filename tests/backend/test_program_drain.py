"""ProgramServer.drain at shutdown: a program still running past the drain gets a `server_shutdown` error result
before the endpoint closes (under load the engine's cut had not ended it yet, the socket closed with linger 0
and the client saw only a dropped connection), and a program that finishes in time sends its own result."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from k3rt.backend.program.server import ProgramServer, _Entry
from k3rt.backend.tokenizer import load_tokenizer
from k3rt.protocol import ProgramResult, decode


class _Client:
    info = {"max_model_len": 512}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from k3rt.backend.models.tiny import make_tiny

    return load_tokenizer(make_tiny(Path(tmp_path_factory.mktemp("tk")), arch="k3", dtype="float32"))


def _results(server: ProgramServer) -> dict[str, tuple[bytes, ProgramResult]]:
    out = {}
    while not server.outq.empty():
        ident, data = server.outq.get_nowait()
        msg = decode(data)
        out[msg.pid] = (ident, msg)
    return out


def test_a_program_past_the_drain_gets_its_shutdown_error(tokenizer, monkeypatch) -> None:
    import k3rt.backend.program.server as srv

    monkeypatch.setattr(srv, "_FLUSH_S", 0.1, raising=False)  # nobody reads the queue here: do not wait for it to empty
    async def main() -> None:
        server = ProgramServer(_Client(), tokenizer, "tcp://127.0.0.1:0")
        stuck = _Entry(None, b"peer-stuck")
        quick = _Entry(None, b"peer-quick")
        never = asyncio.Event()
        stuck_task = asyncio.create_task(never.wait())  # a run the engine's cut did not end
        stuck.runs.add(stuck_task)

        async def finishes() -> None:
            await asyncio.sleep(0.01)
            server.outq.put_nowait((b"peer-quick", b'["ProgramResult", {"pid": "q", "variables": {}, '
                                    b'"texts": {}, "messages": {}, "meta": {}, "error": null, "error_line": null}]'))
        quick_task = asyncio.create_task(finishes())
        quick.runs.add(quick_task)
        quick_task.add_done_callback(quick.runs.discard)
        server.sessions.update({"s": stuck, "q": quick})
        t0 = time.monotonic()
        drained = await server.drain(0.2)
        assert time.monotonic() - t0 < 2
        assert not drained  # a program was still running: the caller reports it (exit code 1)
        await asyncio.sleep(0)
        assert stuck_task.cancelled()
        got = {pid: (ident, msg) for pid, (ident, msg) in _results(server).items()}
        assert got["s"][0] == b"peer-stuck" and got["s"][1].error.startswith("server_shutdown:"), got
        assert got["q"][0] == b"peer-quick" and got["q"][1].error is None

    asyncio.run(main())


def test_results_queued_at_shutdown_still_leave_the_socket(tokenizer) -> None:
    """serve() closed its socket with linger 0 once the drain had handed the last results to it: libzmq
    dropped what it had not written yet, and the client saw only the connection close (CI: a drained
    program's shutdown error never arrived). A 32 MB result queued just before the endpoint stops arrives."""
    import zmq
    import zmq.asyncio

    from k3rt.protocol import encode

    big = encode(ProgramResult("p", {}, {"0": "x" * (32 << 20)}, {}, {}, "server_shutdown: test", None))

    async def main() -> bytes | None:
        server = ProgramServer(_Client(), tokenizer, "tcp://127.0.0.1:0")
        serving = asyncio.create_task(server.serve())
        await server.bound.wait()
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"peer-1")
        dealer.connect(server.endpoint)
        await dealer.send(b"")  # the ROUTER learns the peer (an empty frame reads as a disconnect notice: no-op)
        await asyncio.sleep(0.3)
        server.outq.put_nowait((b"peer-1", big))
        while not server.outq.empty():  # the drain's flush: the send loop has taken it
            await asyncio.sleep(0)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        try:
            return await asyncio.wait_for(dealer.recv(), 10)
        except asyncio.TimeoutError:
            return None
        finally:
            dealer.close(linger=0)
            ctx.term()

    got = asyncio.run(main())
    assert got is not None and decode(got).error == "server_shutdown: test"
