"""Request streams for cache replays: the public Mooncake trace format and two synthetic workloads.

A workload yields *sessions*; each session is a list of turns issued one after another (turn k+1
is built from turn k's prompt and output, as a chat client would). Token ids are synthetic but
deterministic, so two replays of the same workload see identical prompts.
"""

from __future__ import annotations

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


def mooncake(path: str | Path, vocab: int) -> Iterator[Session]:
    """One single-turn session per trace line: {timestamp, input_length, output_length, hash_ids}."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
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


def system_prompt(vocab: int, *, users: int = 32, turns: int = 4, num_system_prompts: int = 4,
                  seed: int = 0) -> Iterator[Session]:
    """N users x M turns; each user shares one of a few system prompts (300-5000 tokens)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(300, 5000), vocab) for _ in range(num_system_prompts)]
    for u in range(users):
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


WORKLOADS = {"system-prompt": system_prompt, "multi-turn": multi_turn_agent}
