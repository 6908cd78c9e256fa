"""Every message that crosses a process boundary, as typed dataclasses, and their one codec (orjson).

Direction: gateway -> engine process: GenerateRequest, AbortRequest, Unpin, FlushCache, Shutdown.
           engine process -> gateway: Ready, UpdateBatch (of RequestUpdate), ShutdownAck, EngineError.
           DSL client -> gateway (ZMQ DEALER -> ROUTER): ProgramRun, ProgramClose.
           gateway -> DSL client: ProgramEvent (streamed text), ProgramResult.
Token ids travel as lists of ints, never as text. No pickle anywhere on the wire. No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson

from k3rt.sampling_params import SamplingParams


def params_to_dict(p: SamplingParams) -> dict[str, Any]:
    """JSON-shaped (tuples become lists), so a decoded message compares equal to the sent one."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(p).items()}


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    """Inverse of params_to_dict; JSON lists become the tuples SamplingParams stores."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"sampling params: unknown fields {sorted(unknown)}")
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True)
class GenerateRequest:
    rid: str  # unique per request, chosen by the gateway
    prompt_ids: list[int]
    params: dict[str, Any]  # params_to_dict(SamplingParams)
    cache_salt: str | None = None  # namespaces the prefix cache
    grammar: dict[str, Any] | None = None  # GrammarSpec.to_dict() for constrained decoding
    eos_token_ids: list[int] | None = None  # None: the model's
    prompt_logprobs_from: int | None = None  # score prompt tokens from this position (DSL select)
    pin: bool = False  # keep the end-of-request cache snapshot until Unpin(rid) (a DSL program's prefix)


@dataclass(frozen=True)
class Unpin:
    rid: str  # a finished pin=True request: its end-of-request snapshot may be evicted again


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class FlushCache:
    pass


@dataclass(frozen=True)
class Shutdown:
    """Stop: abort what is running, reply ShutdownAck, exit. The ack is the drain handshake (ZMQ ipc can
    drop in-flight messages of a sender that exits before its reader drained)."""


@dataclass(frozen=True)
class Ready:
    info: dict[str, Any]  # model and cache layout summary


@dataclass(frozen=True)
class RequestUpdate:
    rid: str
    token_ids: list[int]  # new tokens since the last update
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[float] | None = None  # one per new token when requested
    top_logprobs: list[list[list[float]]] | None = None  # per new token: [[token_id, logprob], ...]
    error: str | None = None  # a message naming the field when the engine rejected the request
    prompt_logprobs: dict[str, float] | None = None  # position (str, JSON keys) -> logprob; with `finished`


@dataclass(frozen=True)
class UpdateBatch:
    updates: list[RequestUpdate]
    stats: dict[str, Any] = field(default_factory=dict)  # running, waiting, pages, snapshots, ...


@dataclass(frozen=True)
class ShutdownAck:
    pass


@dataclass(frozen=True)
class EngineError:
    message: str  # a fatal engine-process error; the gateway fails every waiting request


@dataclass(frozen=True)
class ProgramRun:
    """Run these ops of program session `pid` (created on first use). final: drop the session after."""

    pid: str
    program: dict[str, Any]  # frontend.ir.Program.to_dict()
    final: bool = True
    stream: bool = False  # send ProgramEvent messages as text is generated


@dataclass(frozen=True)
class ProgramClose:
    pid: str  # the client is done (or gone): cancel what runs, drop the session's states


@dataclass(frozen=True)
class ProgramEvent:
    pid: str
    state: int
    name: str | None  # the variable being generated
    delta: str
    done: bool = False  # the variable is complete


@dataclass(frozen=True)
class ProgramResult:
    pid: str
    variables: dict[str, dict[str, Any]]  # state id (str) -> name -> value (str, or list after join)
    texts: dict[str, str]  # state id -> full text
    messages: dict[str, list[dict[str, str]]]  # state id -> chat messages
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)  # state id -> name -> token counts, scores
    error: str | None = None
    error_line: int | None = None  # the program's source line of the failing op


MESSAGES: dict[str, type] = {c.__name__: c for c in (
    GenerateRequest, AbortRequest, Unpin, FlushCache, Shutdown, Ready, RequestUpdate, UpdateBatch, ShutdownAck, EngineError,
    ProgramRun, ProgramClose, ProgramEvent, ProgramResult)}


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGES:
        raise TypeError(f"not a protocol message: {name}")
    return orjson.dumps({"type": name, "body": dataclasses.asdict(msg)})


def decode(data: bytes) -> Any:
    d = orjson.loads(data)
    cls = MESSAGES[d["type"]]
    body = d["body"]
    if cls is UpdateBatch:
        return UpdateBatch([RequestUpdate(**u) for u in body["updates"]], body.get("stats", {}))
    return cls(**body)
