"""`k3rt bench serve`: load a running OpenAI-compatible server and report throughput, TTFT and
inter-token latency percentiles, the prefix-cache hit rate (from `usage.prompt_tokens_details`) and, from a
k3rt server's /metrics, whether its engine overlaps scheduling with the GPU (`k3rt serve --no-overlap` turns
it off: run the bench against each to compare) and the share of GPU step time spent waiting for the host.

Workloads are synthetic and seeded, so two runs (or two servers) see the same requests:
  sharegpt        independent chats of varied prompt and output length (lengths drawn like ShareGPT's
                  long-tailed ones, text from a fixed word list)
  system-prompt   one long shared system prompt, then a short distinct question per request
  multi-turn      conversations whose every turn resends the history plus the previous reply; a
                  conversation's turns run one after the other, `concurrency` conversations at a time
Outputs have a fixed length (`ignore_eos`, a k3rt/vLLM extension), so token throughput is comparable.
Arrivals: by default every conversation is ready at once and `concurrency` run at a time (a closed loop);
`request_rate` R > 0 starts conversations at the times of a seeded Poisson process of rate R per second
(open loop, as vLLM's `--request-rate`), still at most `concurrency` in flight.
Needs only httpx (and tqdm for the progress bar): no torch, no engine.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

WORKLOADS = ("sharegpt", "system-prompt", "multi-turn")
_WORDS = ("the cache keeps snapshots of every shared prefix so that a second request with the same system "
          "prompt resumes from the stored state instead of recomputing it while the scheduler batches decode "
          "steps and prefill chunks under one token budget per step").split()


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reply: str = ""
    error: str | None = None
    sent_s: float = 0.0  # when the request was sent, seconds since the run's start
    token_times_s: list[float] = field(default_factory=list)  # each streamed content chunk's arrival, likewise


@dataclass
class Report:
    workload: str
    requests: int
    errors: int
    concurrency: int
    request_rate: float | None  # Poisson arrivals per second; None: all at once (closed loop)
    duration_s: float
    request_throughput: float  # requests/s
    output_throughput: float  # generated tokens/s
    input_throughput: float  # prompt tokens/s
    cache_hit_rate: float  # cached / prompt tokens
    ttft_ms: dict[str, float]  # p50 / p90 / p99 / mean
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]  # per request: (latency - TTFT) / (output tokens - 1), requests of >= 2 tokens
    latency_ms: dict[str, float]
    # from the server's /metrics over the run: whether its engine overlaps scheduling with the device (None:
    # not reported), and the share of the GPU's step time it waited for the host (None: no GPU, not 0)
    overlap: bool | None = None
    gpu_idle_fraction: float | None = None
    # output tokens/s while the client held its concurrency (steady_throughput; None: no such window)
    steady_output_throughput: float | None = None
    steady_window_s: float = 0.0


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    s = sorted(values)

    def at(q: float) -> float:
        return 1000 * s[min(len(s) - 1, int(q * len(s)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": 1000 * statistics.fmean(s)}


class _Bench:
    def __init__(self, url: str, model: str | None, api_key: str | None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600,
                                      limits=httpx.Limits(max_connections=None))
        self.model = model

    async def resolve_model(self) -> str:
        if self.model is None:
            r = await self.http.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def engine_timing(self) -> dict[str, float]:
        """The engine's overlap flag and GPU-idle counters from /metrics ({} when the server has none)."""
        try:
            r = await self.http.get("/metrics")
        except httpx.HTTPError:
            return {}
        if r.status_code != 200:
            return {}
        return parse_engine_timing(r.text)

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, t0: float = 0.0) -> Result:
        """One streamed chat request; t0: the run's start (perf_counter), which its timestamps count from."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = last = time.perf_counter()
        res = Result(ok=False, sent_s=start - t0)
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = chunk["error"].get("message")
                        return res
                    now = time.perf_counter()
                    for c in chunk.get("choices", []):
                        content = c.get("delta", {}).get("content")
                        if content:
                            if not res.reply:
                                res.ttft_s = now - start
                            else:
                                res.itl_s.append(now - last)
                            last = now
                            res.reply += content
                            res.token_times_s.append(now - t0)
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = usage["prompt_tokens"]
                        res.completion_tokens = usage["completion_tokens"]
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except httpx.HTTPError as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.latency_s = time.perf_counter() - start
        res.ok = True
        return res


_TIMING_SAMPLES = {"k3rt_engine_overlap": "overlap", "k3rt_gpu_idle_seconds_total": "idle",
                   "k3rt_gpu_step_seconds_total": "span"}


def parse_engine_timing(text: str) -> dict[str, float]:
    """{overlap, idle, span} from a Prometheus text exposition (the keys present there only)."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _TIMING_SAMPLES:
            out[_TIMING_SAMPLES[name]] = float(value)
    return out


def gpu_idle_fraction(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Idle share of the GPU's step time between two scrapes; None without the counters (no GPU)."""
    if "span" not in after or "idle" not in after:
        return None
    span = after["span"] - before.get("span", 0.0)
    return (after["idle"] - before.get("idle", 0.0)) / span if span > 0 else None


def tpot_s(r: Result) -> float | None:
    """Time per output token after the first (vLLM's TPOT); None for a request of fewer than two tokens."""
    if r.completion_tokens < 2:
        return None
    return (r.latency_s - r.ttft_s) / (r.completion_tokens - 1)


def steady_throughput(results: list[Result]) -> tuple[float, float] | None:
    """(output tokens/s, window s) between the first request's finish and the last request's send, or None when
    the last send comes first. Before that window the first wave's prefills ramp the server up; after it no
    request replaces a finished one and the batch drains. Inside it the client keeps its concurrency, so this is
    the rate to compare with a pure decode step at that batch (the whole run's rate mixes in ramp and drain).
    A request's tokens count in proportion to its streamed chunks that arrived inside the window."""
    ok = [r for r in results if r.ok and r.token_times_s]
    if not ok:
        return None
    t0 = min(r.sent_s + r.latency_s for r in ok)
    t1 = max(r.sent_s for r in results)
    if t1 <= t0:
        return None
    tokens = sum(r.completion_tokens * sum(t0 <= t <= t1 for t in r.token_times_s) / len(r.token_times_s) for r in ok)
    return tokens / (t1 - t0), t1 - t0


def arrival_times(num: int, rate: float | None, rng: random.Random) -> list[float]:
    """Start offsets (s) of `num` conversations: all 0 without a rate, else a Poisson process of `rate`/s."""
    if rate is None:
        return [0.0] * num
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _conversations(workload: str, num_requests: int, max_tokens: int, turns: int,
                   rng: random.Random) -> list[list[tuple[list[dict], int]]]:
    """Per conversation, per turn: (the turn's new messages, its output tokens); history is added at run time."""
    if workload == "sharegpt":
        # long-tailed prompt and output lengths, like ShareGPT's (most short, a few long)
        return [[([{"role": "user", "content": _text(rng, min(2000, int(rng.lognormvariate(4.0, 1.0))) + 1)}],
                  max(4, min(max_tokens, int(rng.expovariate(1 / max_tokens)))))]
                for _ in range(num_requests)]
    if workload == "system-prompt":
        system = {"role": "system", "content": _text(random.Random(1234), 600)}
        return [[([system, {"role": "user", "content": f"Question {i}: " + _text(rng, rng.randint(5, 30))}],
                  max_tokens)] for i in range(num_requests)]
    convs, left = [], num_requests
    while left > 0:
        n = min(turns, left)
        convs.append([([{"role": "user", "content": _text(rng, rng.randint(20, 120))}], max_tokens)
                      for _ in range(n)])
        left -= n
    return convs


async def run_bench(url: str, *, workload: str = "sharegpt", concurrency: int = 8, num_requests: int = 64,
                    max_tokens: int = 64, turns: int = 4, model: str | None = None, api_key: str | None = None,
                    seed: int = 0, progress: bool = True, request_rate: float | None = None) -> Report:
    if workload not in WORKLOADS:
        raise ValueError(f"workload: {workload!r} not one of {', '.join(WORKLOADS)}")
    if concurrency < 1 or num_requests < 1:
        raise ValueError("concurrency and requests: must be >= 1")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request_rate: {request_rate} must be > 0 requests/s (leave it out for all at once)")
    rng = random.Random(seed)
    bench = _Bench(url, model, api_key)
    await bench.resolve_model()
    convs = _conversations(workload, num_requests, max_tokens, turns, rng)
    arrivals = arrival_times(len(convs), request_rate, random.Random(seed + 1))
    results: list[Result] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_requests, desc=f"bench serve {workload}", unit="req")
    gate = asyncio.Semaphore(concurrency)

    async def conversation(conv: list[tuple[list[dict], int]], arrival: float) -> None:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        async with gate:
            history: list[dict] = []
            for new, out_len in conv:
                res = await bench.chat(history + new, out_len, start)
                results.append(res)
                if bar is not None:
                    bar.update(1)
                if not res.ok:
                    return
                history += new + [{"role": "assistant", "content": res.reply}]

    timing0 = await bench.engine_timing()
    start = time.perf_counter()
    try:
        await asyncio.gather(*(conversation(c, a) for c, a in zip(convs, arrivals)))
        duration = time.perf_counter() - start
        timing1 = await bench.engine_timing()
    finally:
        await bench.http.aclose()
        if bar is not None:
            bar.close()
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    steady = steady_throughput(results)
    return Report(
        workload=workload, requests=len(results), errors=len(results) - len(ok), concurrency=concurrency,
        request_rate=request_rate, duration_s=duration, request_throughput=len(ok) / duration,
        output_throughput=sum(r.completion_tokens for r in ok) / duration, input_throughput=prompt / duration,
        cache_hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        ttft_ms=_pct([r.ttft_s for r in ok]), itl_ms=_pct([x for r in ok for x in r.itl_s]),
        tpot_ms=_pct([t for t in map(tpot_s, ok) if t is not None]),
        latency_ms=_pct([r.latency_s for r in ok]),
        overlap=bool(timing1["overlap"]) if "overlap" in timing1 else None,
        gpu_idle_fraction=gpu_idle_fraction(timing0, timing1),
        steady_output_throughput=steady[0] if steady else None, steady_window_s=steady[1] if steady else 0.0)


def format_report(r: Report) -> str:
    arrivals = "all at once" if r.request_rate is None else f"Poisson {r.request_rate:g} req/s"
    lines = [f"workload {r.workload}: {r.requests} requests ({r.errors} errors), concurrency {r.concurrency}, "
             f"arrivals {arrivals}, {r.duration_s:.1f} s",
             f"  throughput   {r.request_throughput:.2f} req/s, {r.output_throughput:.1f} output tok/s, "
             f"{r.input_throughput:.1f} prompt tok/s",
             "  steady       " + ("no window (every request was sent before the first finished)"
                                  if r.steady_output_throughput is None else
                                  f"{r.steady_output_throughput:.1f} output tok/s over {r.steady_window_s:.1f} s "
                                  "(first finish to last send)"),
             f"  cache hit    {100 * r.cache_hit_rate:.1f}% of prompt tokens",
             f"  {'':12} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}  (ms)"]
    for name, d in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("latency", r.latency_ms)):
        lines.append(f"  {name:12} {d['p50']:9.1f} {d['p90']:9.1f} {d['p99']:9.1f} {d['mean']:9.1f}")
    overlap = {True: "overlap on", False: "overlap off", None: "overlap not reported"}[r.overlap]
    idle = "absent (no GPU)" if r.gpu_idle_fraction is None else f"{100 * r.gpu_idle_fraction:.1f}% of GPU step time"
    lines.append(f"  GPU idle     {idle} ({overlap})")
    return "\n".join(lines)


def main(args: Any) -> int:
    """`k3rt bench serve` (args from the CLI parser)."""
    report = asyncio.run(run_bench(args.url, workload=args.workload, concurrency=args.concurrency,
                                   num_requests=args.requests, max_tokens=args.max_tokens, turns=args.turns,
                                   model=args.model_name, api_key=args.api_key, seed=args.seed,
                                   progress=not args.json, request_rate=args.request_rate))
    print(json.dumps(asdict(report)) if args.json else format_report(report))
    return 0 if report.errors == 0 else 1
