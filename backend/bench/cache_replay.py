"""`k3rt bench cache`: replay a workload through the real scheduler and prefix cache with the null
runner, for k3rt's mode and the full-block baseline, and compare tokens computed with an ideal
unbounded per-token cache.

The ideal: a request computes `n - min(lcp, n - 1)` prompt tokens, where lcp is its longest common
prefix with any sequence (prompt + output) issued before it, found exactly among the sorted earlier
sequences.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import asdict, dataclass, replace

from k3rt.backend.bench.workloads import Session
from k3rt.backend.cache.radix import common_prefix
from k3rt.backend.engine import Engine
from k3rt.config import EngineConfig
from k3rt.sampling_params import SamplingParams

class IdealCache:
    """Every sequence issued so far, sorted: the longest common prefix of a new sequence with any of
    them is its LCP with one of its two neighbours in lexicographic order (exact, list compares in C)."""

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []

    def lcp(self, tokens: list[int]) -> int:
        i = bisect.bisect_left(self.seqs, tokens)
        best = 0
        for j in (i - 1, i):
            if 0 <= j < len(self.seqs):
                other = self.seqs[j]
                best = max(best, common_prefix(other, tokens, min(len(other), len(tokens))))
        return best

    def add(self, tokens: list[int]) -> None:
        bisect.insort(self.seqs, tokens)


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
    cache_gb: float = 0.0
    snapshot_share: float = 0.0  # snapshot pages / pool pages, averaged over the steps
    step_ms_median: float = 0.0  # host time of one engine step (schedule + null run + update)
    step_ms_p99: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def vs_ideal(self) -> float:
        return self.computed_prompt_tokens / max(1, self.ideal_tokens)

    def as_dict(self) -> dict:
        return asdict(self) | {"hit_rate": self.hit_rate, "computed_over_ideal": self.vs_ideal}


def replay(cfg: EngineConfig, sessions: list[Session], *, concurrency: int = 16, open_sessions: int | None = None,
           mode: str = "k3rt", progress: bool = False) -> ReplayResult:
    """Run the sessions: at most `concurrency` requests in flight, turns of a session in order, and
    `open_sessions` sessions open at once (default: as many as `concurrency`). A session whose turn
    finished queues behind the other open sessions' next turns, as users and agents that think or
    run tools between turns do: the cache must keep a session's prefix across the others' turns."""
    from tqdm import tqdm

    eng = Engine(replace(cfg, runner="null"))
    tree = eng.scheduler.tree
    snap_bytes = eng.layout.pages_per_state_set * eng.layout.bytes_per_page_all_tensors
    ideal = IdealCache()
    total_turns = sum(len(s) for s in sessions)
    bar = tqdm(total=total_turns, desc=f"replay ({mode}, {cfg.cache.memory_gb or 0:g} GiB)", unit="req",
               disable=not progress)
    pending = list(reversed(range(len(sessions))))  # session indices not started
    active: dict[int, tuple[int, int, list[int]]] = {}  # rid -> (session, turn, prompt)
    ready: deque[tuple[int, int, list[int]]] = deque()  # open sessions' next turns, in arrival order
    open_cap = max(open_sessions or concurrency, concurrency)
    while pending and len(ready) < open_cap:
        ready.append((pending.pop(), 0, []))
    ideal_tokens = peak = requests = steps = 0
    share = 0.0
    step_s: list[float] = []
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

    while active or ready:
        while ready and len(active) < concurrency:
            issue(*ready.popleft())
        t = time.perf_counter()
        outs = eng.step()
        step_s.append(time.perf_counter() - t)
        for o in outs:
            if not o.finished:
                continue
            si, ti, prompt = active.pop(o.rid)
            full = prompt + o.output_ids
            ideal.add(full)
            bar.update(1)
            if ti + 1 < len(sessions[si]):
                ready.append((si, ti + 1, full))  # behind the other open sessions' turns
            elif pending:
                ready.append((pending.pop(), 0, []))  # a session ended: the next one opens
        peak = max(peak, tree.snapshot_count * snap_bytes)
        share += tree.snapshot_count * tree.state_pages / eng.pool.num_pages
        steps += 1
    bar.close()
    eng.check()
    s = eng.stats
    step_s.sort()
    return ReplayResult(mode, requests, s.prompt_tokens, s.computed_prompt_tokens, ideal_tokens, s.cached_tokens,
                        peak, s.preemptions, time.perf_counter() - t0, cfg.cache.memory_gb or 0.0,
                        share / max(1, steps), 1e3 * step_s[len(step_s) // 2] if step_s else 0.0,
                        1e3 * step_s[int(0.99 * (len(step_s) - 1))] if step_s else 0.0)


MODES = (("k3rt", False), ("full-block", True))


def sweep(cfg: EngineConfig, sessions: list[Session], sizes_gb: list[float], *, concurrency: int = 16,
          open_sessions: int | None = None, progress: bool = False) -> list[ReplayResult]:
    """Both modes at every cache size (cfg.cache's other fields apply to k3rt mode)."""
    out = []
    for gb in sizes_gb:
        for mode, full in MODES:
            cache = replace(cfg.cache, memory_gb=gb, num_pages=None, full_block_mode=full)
            out.append(replay(replace(cfg, cache=cache), sessions, concurrency=concurrency,
                              open_sessions=open_sessions, mode=mode, progress=progress))
    return out


def format_table(results: list[ReplayResult]) -> str:
    head = ("cache GiB", "mode", "requests", "prompt tok", "computed tok", "ideal tok", "computed/ideal", "hit rate",
            "snapshot share", "peak snapshot GiB", "preemptions", "step ms p50/p99")
    rows = [(f"{r.cache_gb:g}", r.mode, r.requests, r.prompt_tokens, r.computed_prompt_tokens, r.ideal_tokens,
             f"{r.vs_ideal:.3f}", f"{r.hit_rate:.3f}", f"{r.snapshot_share:.2f}", f"{r.peak_snapshot_bytes / 2**30:.1f}",
             r.preemptions, f"{r.step_ms_median:.2f}/{r.step_ms_p99:.2f}") for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda xs: "  ".join(str(x).rjust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def plot_sweep(results: list[ReplayResult], path: str, title: str) -> None:
    """computed/ideal against cache size, one line per mode (PNG; needs matplotlib: k3rt[bench])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot: needs matplotlib (pip install 'k3rt[bench]')") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for mode, _ in MODES:
        rs = sorted((r for r in results if r.mode == mode), key=lambda r: r.cache_gb)
        ax.plot([r.cache_gb for r in rs], [r.vs_ideal for r in rs], marker="o", label=mode)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    sizes = sorted({r.cache_gb for r in results})
    ax.set_xticks(sizes, [f"{g:g}" for g in sizes])
    ax.minorticks_off()
    ax.set_xlabel("cache size (GiB)")
    ax.set_ylabel("computed / ideal prompt tokens")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
