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
