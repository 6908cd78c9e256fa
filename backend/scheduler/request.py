"""One generation request as the scheduler tracks it.

No "prefill" or "decode" phase is stored: a request has `token_ids` (prompt + generated) and
`num_computed` (tokens whose KV and KDA state are in its cache). Each step feeds some of the
remaining tokens; when the fed tokens reach the end, the step also samples the next token.

Ownership: the scheduler writes every field of `Request` (runners read the cache fields:
`num_computed`, `block_table`, `state_set`); what a runner produces for a request while sampling
lives in `req.sampled` (`SampleState`), and nothing else of the request is written by a runner.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from k3rt.backend.cache.radix import Node
from k3rt.sampling_params import SamplingParams


# a sampled token that is still on the device (overlap scheduling): Scheduler.advance appends it, resolve
# replaces it; runners feed the previous step's device output in its place
PENDING = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop/EOS token was sampled
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller or rejected
    ERROR = "error"  # the request could not be served (Request.error says why)


@dataclass(slots=True)
class SampleState:
    """What the runners write for a request: the logprobs of the token sampled this step, prompt
    scores, and the on-device sampling seed."""

    logprob: float | None = None  # of the token sampled this step, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None = None
    # log p(token[i] | tokens[:i]) for i >= Request.prompt_logprobs_from, filled by the step that computes i - 1
    prompt_logprobs: dict[int, float] = field(default_factory=dict)
    # the params.logprobs most likely tokens at those positions, (token id, logprob) most likely first
    prompt_top_logprobs: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # the philox seed of on-device sampling: params.seed, or one drawn at the first sampled step and kept
    device_seed: int | None = None
    # why this request could not be served this step (its grammar failed): the engine fails it alone
    error: str | None = None
    # a verify step's logprobs: one per emitted token (logprob / top_logprobs above hold the last one's)
    run_logprobs: list[float] | None = None
    run_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(eq=False, slots=True)
class Request:
    rid: int
    token_ids: list[int]  # prompt then generated tokens
    prompt_len: int
    params: SamplingParams
    salt: str | None = None
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # tokens whose KV/state this request's cache holds
    block_table: list[int] = field(default_factory=list)  # one pool ref per entry
    state_set: list[int] | None = None  # live KDA state set (owned)
    lock_node: Node | None = None  # deepest tree node this request holds a lock on
    snapshot_plan: list[int] = field(default_factory=list)  # ascending absolute positions to publish
    plan_kinds: dict[int, str] = field(default_factory=dict)  # planned position -> snapshot kind (cache/policy.py)
    wait_on: tuple[Request, int] | None = None  # in-batch sharing: (sharer, position it will publish)
    fences: list[int] = field(default_factory=list)  # extra refs on copy sources, held until the copies ran
    pending_page_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) MLA page CoW
    pending_state_copies: list[tuple[list[int], list[int]]] = field(default_factory=list)  # snapshot -> live
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at (last) admission
    num_preemptions: int = 0
    spec_drafted: int = 0  # draft tokens verified for this request (speculative decoding)
    spec_accepted: int = 0  # of those, accepted
    admitted: bool = False  # counted in the prompt / cached-token stats (once, at the first admission)
    arrival: float = 0.0  # time.monotonic() when queued (queue-wait metric)
    queued_step: int = 0  # Scheduler.steps when it (re-)entered the waiting queue (admission batching)
    grammar: Any = None  # a GrammarMatcher (backend/grammar) constraining sampling, or None
    grammar_future: Any = None  # a Future of the compiled grammar; the request is not admitted before it resolves
    grammar_deadline: float = 0.0  # monotonic time after which a still-compiling grammar fails the request
    error: str | None = None  # set with FinishReason.ERROR
    pin: bool = False  # keep the end-of-request snapshot unevictable until Scheduler.unpin(rid)
    # score the prompt: log p(token[i] | tokens[:i]) for every i >= prompt_logprobs_from (select/scoring);
    # the prefix-cache hit is capped so that position prompt_logprobs_from - 1 is computed
    prompt_logprobs_from: int | None = None
    sampled: SampleState = field(default_factory=SampleState)  # written by the runners

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
