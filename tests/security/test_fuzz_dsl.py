"""An adversarial fuzzer over the DSL wire protocol of a real `k3rt serve` (issue 19): 2,000 hypothesis-made
frames sent to the DSL port from a raw ZMQ DEALER — ProgramRun / ProgramClose messages with ops, states,
params, grammars and choices mostly wrong in one way or another, other message types, arbitrary JSON and
arbitrary bytes. Afterwards the server must be up, /health must answer, and a real program must still run
with its usual output. Derandomized: the same 2,000 frames every run."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3rt
from tests.server.conftest import log_dir, serving, tiny_model  # noqa: F401

FRAMES = 2000

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=30))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                        max_leaves=10)
small_params = st.one_of(st.fixed_dictionaries({"max_tokens": st.integers(1, 2)},
                                               optional={"temperature": st.floats(0, 2), "top_k": anything,
                                                         "stop_token_ids": anything}),
                         anything)
op = st.fixed_dictionaries(
    {"kind": st.one_of(st.sampled_from(["text", "gen", "select", "role_begin", "role_end", "fork", "join"]),
                       anything)},
    optional={"state": st.one_of(st.integers(-2, 6), anything), "value": st.one_of(st.text(max_size=40), anything),
              "name": st.one_of(st.text(max_size=8), anything), "params": small_params,
              "stop": st.one_of(st.lists(st.text(max_size=4), max_size=3), anything),
              "grammar": st.one_of(st.none(), st.just({"kind": "regex", "payload": "a{1000000}"}),
                                   st.just({"kind": "choice", "payload": ["yes", "no"]}), anything),
              "choices": st.one_of(st.lists(st.text(max_size=6), max_size=4), anything),
              "method": anything, "children": st.one_of(st.lists(st.integers(-1, 8), max_size=4), anything),
              "line": anything})
program = st.fixed_dictionaries({"ops": st.one_of(st.lists(op, max_size=6), anything)},
                                optional={"num_states": st.one_of(st.integers(-1, 8), anything),
                                          "default_params": st.one_of(st.just({"max_tokens": 1}), anything),
                                          "name": anything})
run_body = st.fixed_dictionaries({"pid": st.one_of(st.text(max_size=8), anything), "program": st.one_of(program, anything)},
                                 optional={"final": anything, "stream": anything})
message = st.one_of(
    st.tuples(st.just("ProgramRun"), run_body),
    st.tuples(st.sampled_from(["ProgramClose", "ProgramResult", "GenerateRequest", "Shutdown", "FlushCache", "nope"]),
              st.one_of(st.fixed_dictionaries({"pid": anything}), anything)),
)
frames = st.one_of(message.map(lambda m: json.dumps(list(m)).encode()),
                   anything.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=300))


@pytest.fixture(scope="module")
def srv(tiny_model, log_dir):  # noqa: F811
    with serving(tiny_model, log_dir, "--cache-pages", "512") as s:
        yield s


@pytest.mark.timeout(900)
def test_dsl_fuzz_never_kills_the_endpoint(srv):
    addr = f"tcp://127.0.0.1:{srv.port + 1}"

    @k3rt.function
    def probe(s):
        s += "The river " + k3rt.gen("x", max_tokens=4, temperature=0.0, ignore_eos=True)

    backend = k3rt.connect(addr, timeout=120)
    want = probe.run(backend=backend)["x"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    sent = [0]

    @settings(max_examples=FRAMES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames)
    def one(data):
        sock.send(data)
        sent[0] += 1
        while sock.poll(0):  # drain whatever the server answered, so nothing piles up
            sock.recv()
        if sent[0] % 250 == 0:  # and the gateway keeps serving HTTP meanwhile
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200

    try:
        one()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sock.poll(200):
            sock.recv()
    finally:
        sock.close()
        ctx.term()
    assert sent[0] >= FRAMES
    assert srv.proc.poll() is None and httpx.get(srv.url + "/health", timeout=10).status_code == 200
    try:
        assert probe.run(backend=backend)["x"] == want  # the endpoint still runs programs, unchanged
    finally:
        backend.shutdown()
