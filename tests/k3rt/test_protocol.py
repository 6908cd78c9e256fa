"""Every wire message survives encode -> decode unchanged; the codec rejects what it doesn't know."""

from __future__ import annotations

import pytest

from k3rt.protocol import (
    AbortRequest, EngineError, FlushCache, GenerateRequest, Ready, RequestUpdate, Shutdown, ShutdownAck,
    UpdateBatch, decode, encode, params_from_dict, params_to_dict,
)
from k3rt.sampling_params import SamplingParams

MESSAGES = [
    GenerateRequest("r1", [1, 2, 3], params_to_dict(SamplingParams(temperature=0.5, stop_token_ids=(7, 9))),
                    cache_salt="s", grammar={"kind": "regex", "payload": "a+", "strict": True}, eos_token_ids=[2]),
    GenerateRequest("r2", [5], params_to_dict(SamplingParams())),
    AbortRequest("r1"),
    FlushCache(),
    Shutdown(),
    Ready({"block_size": 64, "num_pages": 10}),
    RequestUpdate("r1", [4, 5], True, "stop", 3, 2, [-0.5, -1.25], [[[4.0, -0.5]], [[5.0, -1.25]]]),
    UpdateBatch([RequestUpdate("a", [1]), RequestUpdate("b", [], True, "error", error="prompt: empty")],
                {"running": 1}),
    ShutdownAck(),
    EngineError("boom"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg) -> None:
    assert decode(encode(msg)) == msg


def test_sampling_params_round_trip_restores_tuples() -> None:
    p = SamplingParams(temperature=0.7, top_k=5, seed=3, stop_token_ids=(1, 2), max_tokens=9)
    assert params_from_dict(decode(encode(GenerateRequest("x", [1], params_to_dict(p)))).params) == p


def test_unknown_sampling_field_is_named() -> None:
    with pytest.raises(ValueError, match="bogus"):
        params_from_dict({"bogus": 1})


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        encode({"type": "GenerateRequest"})
