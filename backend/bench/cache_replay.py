"""`k3rt bench cache`: replay a workload through the real scheduler and prefix cache with the null
runner, for k3rt's mode and the full-block baseline, and compare tokens computed with an ideal
unbounded per-token cache.

The ideal: a request computes `n - min(lcp, n - 1)` prompt tokens, where lcp is its longest common
prefix with any sequence (prompt + output) issued before it. It is tracked with a set of rolling
prefix hashes and a binary search (exact up to 64-bit hash collisions).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from k3rt.backend.bench.workloads import Session
from k3rt.backend.engine import Engine
from k3rt.config import EngineConfig
from k3rt.sampling_params import SamplingParams

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def _prefix_hashes(tokens: list[int]) -> list[int]:
    h, out = 0, [0]
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
        out.append(h)
    return out


class IdealCache:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def lcp(self, tokens: list[int]) -> int:
        hs = _prefix_hashes(tokens)
        lo, hi = 0, len(tokens)  # prefixes are downward closed: binary search the longest seen one
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hs[mid] in self.seen:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, tokens: list[int]) -> None:
        self.seen.update(_prefix_hashes(tokens)[1:])


@dataclass
class ReplayResult:
    mode: str
    requests: int
    prompt_tokens: int
    computed_prompt_tokens: int
    ideal_tokens: int
    cached_tokens: int
    peak_snapshot_bytes: int
    preemptions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def vs_ideal(self) -> float:
        return self.computed_prompt_tokens / max(1, self.ideal_tokens)


def replay(cfg: EngineConfig, sessions: list[Session], *, concurrency: int = 16, mode: str = "k3rt",
           progress: bool = False) -> ReplayResult:
    """Run the sessions (at most `concurrency` in flight; turns of a session in order)."""
    from tqdm import tqdm

    eng = Engine(replace(cfg, runner="null"))
    snap_bytes = eng.layout.pages_per_state_set * eng.layout.bytes_per_page_all_tensors
    ideal = IdealCache()
    total_turns = sum(len(s) for s in sessions)
    bar = tqdm(total=total_turns, desc=f"replay ({mode})", unit="req", disable=not progress)
    pending = list(reversed(range(len(sessions))))  # session indices not started
    active: dict[int, tuple[int, int, list[int]]] = {}  # rid -> (session, turn, prompt)
    ideal_tokens = peak = requests = 0
    t0 = time.perf_counter()

    def issue(si: int, ti: int, history: list[int]) -> None:
        nonlocal ideal_tokens, requests
        turn = sessions[si][ti]
        prompt = turn.build(history)
        ideal_tokens += len(prompt) - min(ideal.lcp(prompt), len(prompt) - 1)
        sp = SamplingParams(temperature=0.0, max_tokens=turn.output_length, ignore_eos=True)
        rid = eng.add_request(prompt, sp)
        active[rid] = (si, ti, prompt)
        requests += 1

    while pending or active:
        while pending and len(active) < concurrency:
            issue(pending.pop(), 0, [])
        for o in eng.step():
            if not o.finished:
                continue
            si, ti, prompt = active.pop(o.rid)
            full = prompt + o.output_ids
            ideal.add(full)
            bar.update(1)
            if ti + 1 < len(sessions[si]):
                issue(si, ti + 1, full)
        peak = max(peak, eng.scheduler.tree.snapshot_count * snap_bytes)
    bar.close()
    eng.check()
    s = eng.stats
    return ReplayResult(mode, requests, s.prompt_tokens, s.computed_prompt_tokens, ideal_tokens, s.cached_tokens,
                        peak, s.preemptions, time.perf_counter() - t0)


def format_table(results: list[ReplayResult]) -> str:
    head = ("mode", "requests", "prompt tok", "computed tok", "ideal tok", "computed/ideal", "hit rate",
            "peak snapshot MB", "preemptions")
    rows = [(r.mode, r.requests, r.prompt_tokens, r.computed_prompt_tokens, r.ideal_tokens, f"{r.vs_ideal:.3f}",
             f"{r.hit_rate:.3f}", f"{r.peak_snapshot_bytes / 2**20:.1f}", r.preemptions) for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda xs: "  ".join(str(x).rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])
