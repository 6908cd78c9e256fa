"""Request streams for cache replays: the public Mooncake trace format and synthetic workloads.

A workload yields *sessions*; each session is a list of turns issued one after another (turn k+1
is built from turn k's prompt and output, as a chat client would). Token ids are synthetic but
deterministic, so two replays of the same workload see identical prompts.
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake trace format


@dataclass
class Turn:
    """`build(history)` returns the prompt given the previous turn's prompt + output (or [] at turn 0)."""

    build: Callable[[list[int]], list[int]]
    output_length: int


Session = list[Turn]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def expand_hash_id(h: int, vocab: int) -> list[int]:
    """The 512 token ids a Mooncake hash id stands for (deterministic in the id)."""
    return _tokens(random.Random(h * 2654435761 % (2**61 - 1)), MOONCAKE_BLOCK, vocab)


def mooncake(path: str | Path, vocab: int, *, limit: int | None = None) -> Iterator[Session]:
    """One single-turn session per trace line: {timestamp, input_length, output_length, hash_ids}.
    limit: only the first `limit` lines."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows.append((float(r.get("timestamp", i)), int(r["input_length"]), int(r["output_length"]),
                             [int(h) for h in r["hash_ids"]]))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{i + 1}: not a Mooncake trace line ({e})") from e
    cache: dict[int, list[int]] = {}
    for _, n_in, n_out, ids in sorted(rows, key=lambda r: r[0]):
        toks: list[int] = []
        for h in ids:
            if h not in cache:
                cache[h] = expand_hash_id(h, vocab)
            toks.extend(cache[h])
        prompt = toks[:n_in]
        if len(prompt) < n_in:
            raise ValueError(f"{path}: input_length {n_in} exceeds {len(ids)} hash ids x {MOONCAKE_BLOCK} tokens")
        yield [Turn(lambda _h, p=prompt: p, max(1, n_out))]


def system_prompt(vocab: int, *, sessions: int = 32, turns: int = 4, num_system_prompts: int = 4,
                  seed: int = 0) -> Iterator[Session]:
    """N users x M turns; each user shares one of a few system prompts (300-5000 tokens)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(300, 5000), vocab) for _ in range(num_system_prompts)]
    for u in range(sessions):
        system = systems[u % num_system_prompts]
        session: Session = []
        for t in range(turns):
            msg = _tokens(rng, rng.randint(20, 200), vocab)
            session.append(Turn(lambda hist, s=system, m=msg: (hist or list(s)) + m, rng.randint(20, 200)))
        yield session


def multi_turn_agent(vocab: int, *, sessions: int = 16, turns: int = 8, seed: int = 0) -> Iterator[Session]:
    """Agent loops: each turn resends the whole history, the model's previous reply and a tool result."""
    rng = random.Random(seed + 1)
    for _ in range(sessions):
        task = _tokens(rng, rng.randint(500, 2000), vocab)
        session: Session = []
        for t in range(turns):
            tool = _tokens(rng, rng.randint(50, 500), vocab)
            session.append(Turn(lambda hist, task=task, tool=tool: (hist or list(task)) + tool, rng.randint(30, 300)))
        yield session


def agents(vocab: int, *, sessions: int = 300, turns: int = 12, seed: int = 0) -> Iterator[Session]:
    """Tool-using agents: a few long shared system prompts (tool definitions, 2-8K tokens), a task per
    session, then turns that each resend the whole history plus the model's reply and a tool result.
    Tool results are mostly short (status lines, 50-400 tokens) and sometimes large (a file read or a
    web page, 2-8K). A third of the sessions end with a retry: the task again from the start with a
    different first tool result (its prefix, system prompt + task, is a junction seen a second time)."""
    rng = random.Random(seed + 2)
    systems = [_tokens(rng, rng.randint(2000, 8000), vocab) for _ in range(3)]
    for _ in range(sessions):
        head = rng.choice(systems) + _tokens(rng, rng.randint(100, 1000), vocab)
        session: Session = []
        for _t in range(rng.randint(max(2, turns // 2), turns)):
            n = rng.randint(2000, 8000) if rng.random() < 0.15 else rng.randint(50, 400)
            tool = _tokens(rng, n, vocab)
            session.append(Turn(lambda hist, h=head, tool=tool: (hist or list(h)) + tool, rng.randint(20, 300)))
        if rng.random() < 0.33:
            retry = _tokens(rng, rng.randint(50, 400), vocab)
            session.append(Turn(lambda _hist, h=head, r=retry: h + r, rng.randint(20, 300)))
        yield session


def documents(vocab: int, *, sessions: int = 1000, seed: int = 0) -> Iterator[Session]:
    """One-off long documents mixed with chat: 40% of sessions ask 1-3 questions about a document of
    8-48K tokens seen nowhere else (RAG, summarization); 10% ask about one of a few popular documents
    (a shared manual); the rest are short chats (a shared 1K system prompt, 2-6 turns of 30-300 tokens)."""
    rng = random.Random(seed + 3)
    popular = [_tokens(rng, rng.randint(8000, 24000), vocab) for _ in range(2)]
    chat_system = _tokens(rng, 1000, vocab)
    for _ in range(sessions):
        r = rng.random()
        session: Session = []
        if r < 0.5:
            doc = rng.choice(popular) if r < 0.1 else _tokens(rng, rng.randint(8000, 48000), vocab)
            for q in range(rng.randint(1, 3)):
                question = _tokens(rng, rng.randint(20, 120), vocab)
                session.append(Turn(lambda hist, d=doc, qq=question: (hist or list(d)) + qq, rng.randint(50, 400)))
        else:
            for t in range(rng.randint(2, 6)):
                msg = _tokens(rng, rng.randint(30, 300), vocab)
                session.append(Turn(lambda hist, m=msg: (hist or list(chat_system)) + m, rng.randint(30, 300)))
        yield session


def build(name: str, vocab: int, *, sessions: int | None = None, turns: int | None = None,
          seed: int = 0) -> list[Session]:
    """A synthetic workload by name; sessions / turns left None take the workload's defaults."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: {name!r} not one of {', '.join(WORKLOADS)}")
    fn = WORKLOADS[name]
    kw: dict[str, int] = {"seed": seed}
    if sessions is not None:
        kw["sessions"] = sessions
    if turns is not None and "turns" in inspect.signature(fn).parameters:
        kw["turns"] = turns
    return list(fn(vocab, **kw))


WORKLOADS = {"system-prompt": system_prompt, "multi-turn": multi_turn_agent, "agents": agents,
             "documents": documents}
