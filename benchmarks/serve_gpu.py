"""Issue 18 §4: a real `k3rt serve --device cuda` at the Kimi-Linear-48B shape (random bf16 weights, k3-tiny's
8K-vocabulary tokenizer) under `k3rt bench serve`'s sharegpt workload, with and without overlap scheduling.

Per mode (overlap on = the default, off = `--no-overlap`) one server is started, warmed with a few requests,
then loaded at each concurrency (and, with --request-rate, Poisson arrivals); each row reports output tokens/s,
TTFT / TPOT / ITL percentiles and the GPU-idle share the server's /metrics reports. The pure batch-64 decode
rate to compare against comes from `benchmarks/decode.py --batch 64` in the same device call
(benchmarks/device_session.sh stage `serve`).

    python3 benchmarks/serve_gpu.py --concurrency 1 64 --requests 256 --max-tokens 128 --out serve.json

Needs a CUDA GPU, fastapi/uvicorn/pydantic (carry their cp312 wheels in .whl/ on the device machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from k3rt.presets import KIMI_LINEAR_48B
from k3rt.server.bench import run_bench

TINY = Path(__file__).resolve().parents[1] / "k3rt" / "models" / "k3-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_folder(out: Path) -> Path:
    """The 48B preset's config with k3-tiny's vocabulary (size and special ids) and tokenizer."""
    tiny = json.loads((TINY / "config.json").read_text())
    cfg = dict(KIMI_LINEAR_48B)
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[key] = tiny[key]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, out / name)
    return out


def scrape(url: str) -> dict[str, float]:
    """The unlabelled samples of the server's /metrics, plus step-time histogram buckets as 'bucket<=le'."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("k3rt_engine_step_time_seconds_bucket{le="):
            out["bucket<=" + name.split('"')[1]] = float(value)
        elif "{" not in name:
            out[name] = float(value)
    return out


class Sampler(threading.Thread):
    """Samples the engine's running / waiting gauges every `period` s while a run goes on."""

    def __init__(self, url: str, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.url, self.period, self.samples = url, period, []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.period):
            try:
                m = scrape(self.url)
            except httpx.HTTPError:
                continue
            self.samples.append((m.get("k3rt_num_requests_running", 0.0), m.get("k3rt_num_requests_waiting", 0.0)))


def engine_view(before: dict, after: dict, samples: list, duration: float, out_tokens: int) -> dict:
    """Where the engine's time went over one run: steps, their mean time, tokens per step, the mean batch."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("k3rt_engine_step_time_seconds_count", 0.0)
    slow = steps - d.get("bucket<=0.05", 0.0)
    return {"steps": int(steps), "step_ms_mean": 1e3 * d.get("k3rt_engine_step_time_seconds_sum", 0.0) / max(steps, 1),
            "engine_busy": d.get("k3rt_engine_step_time_seconds_sum", 0.0) / duration,
            "out_tokens_per_step": out_tokens / max(steps, 1), "steps_over_50ms": slow / max(steps, 1),
            "prompt_tokens": int(d.get("k3rt_engine_prompt_tokens_total", 0.0)),
            "cached_tokens": int(d.get("k3rt_engine_cached_tokens_total", 0.0)),
            "preemptions": int(d.get("k3rt_engine_preemptions_total", 0.0)),
            "queue_wait_ms_mean": 1e3 * d.get("k3rt_engine_queue_wait_seconds_sum", 0.0)
            / max(d.get("k3rt_engine_queue_wait_seconds_count", 0.0), 1),
            "running_mean": sum(r for r, _ in samples) / max(len(samples), 1),
            "waiting_mean": sum(w for _, w in samples) / max(len(samples), 1)}


def start(model: Path, port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k3rt.cli", "--log-level", "INFO", "serve", "--model", str(model), "--port", str(port),
           *extra]
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def split_mode(mode: str) -> tuple[str, str]:
    """--modes entry MODE[:DELAY] -> (overlap | no-overlap, DELAY or "" for the server's default)."""
    base, _, delay = mode.partition(":")
    return base, delay


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["no-overlap", "overlap"], metavar="MODE[:DELAY]",
                   help="servers to run, in this order (the first pays kernel compiles its warm-up missed): overlap "
                        "or no-overlap, optionally with the server's --prefill-delay-steps after a colon "
                        "(no-overlap:0 admits at once; without it the server's default)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--requests", type=int, default=256, help="requests per concurrency (at least 4x it is best)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=None, help="also a Poisson-arrival run at this rate")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--no-mixed-graphs", action="store_true",
                   help="servers run steps with prefill rows eagerly (`k3rt serve --no-mixed-graphs`; default: "
                        "replayed from the piecewise graphs), to compare against the default")
    p.add_argument("--smoke", action="store_true", help="the shipped k3-tiny on the CPU (checks the plumbing only)")
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--budget-s", type=float, default=500, help="skip the remaining runs after this many seconds")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    for m in args.modes:
        base, delay = split_mode(m)
        if base not in ("overlap", "no-overlap") or (delay and not delay.isdigit()):
            p.error(f"--modes: {m!r} is not overlap or no-overlap, optionally followed by :STEPS")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="k3rt-serve-gpu-"))
    model = TINY if args.smoke else model_folder(tmp / "kimi-linear-48b-8k")
    device = ["--device", "cpu"] if args.smoke else ["--device", "cuda", "--random-weights"]
    log_dir = args.log_dir or tmp
    log_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    rows: list[dict] = []
    for mode in args.modes:
        if time.time() - t0 > args.budget_s:
            print(f"budget: skipping mode {mode}")
            continue
        base, delay = split_mode(mode)
        extra = ([*device, "--max-running", str(args.max_running)] + (["--no-overlap"] if base == "no-overlap" else [])
                 + (["--prefill-delay-steps", delay] if delay else [])
                 + (["--no-mixed-graphs"] if args.no_mixed_graphs else []))
        proc = start(model, args.port, log_dir / f"serve_{mode.replace(':', '_delay')}.log", extra)
        try:
            ready = wait_ready(proc, url, args.ready_timeout)
            print(f"[{mode}] ready in {ready:.0f} s", flush=True)
            # warm-up: the shapes the timed runs hit (batch sizes up to the largest concurrency, prefill chunks of
            # every size) compile here, not in a timed run; each run has its own seed, so no run's prompts are
            # cached by an earlier one
            top = max(args.concurrency)
            asyncio.run(run_bench(url, concurrency=top, num_requests=2 * top, max_tokens=args.max_tokens, seed=99,
                                  progress=False))
            runs = [(c, None) for c in args.concurrency]
            if args.request_rate:
                runs.append((max(args.concurrency), args.request_rate))
            for i, (conc, rate) in enumerate(runs):
                if time.time() - t0 > args.budget_s:
                    print(f"budget: skipping {mode} concurrency {conc}")
                    continue
                n = max(args.requests if conc > 1 else 16, 4 * conc)
                before, sampler = scrape(url), Sampler(url)
                sampler.start()
                rep = asyncio.run(run_bench(url, concurrency=conc, num_requests=n, max_tokens=args.max_tokens,
                                            seed=i + 1, progress=False, request_rate=rate))
                sampler.halt.set()
                sampler.join()
                out_tokens = round(rep.output_throughput * rep.duration_s)
                row = {"mode": mode, **asdict(rep),
                       "engine": engine_view(before, scrape(url), sampler.samples, rep.duration_s, out_tokens)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop(proc)
    print("\n| mode | concurrency | arrivals | out tok/s | steady tok/s | TTFT p50/p90 ms | TPOT p50/p90 ms "
          "| ITL p50/p90 ms | GPU idle | errors |")
    print("|---|---:|---|---:|---:|---|---|---|---:|---:|")
    for r in rows:
        arr = "at once" if r["request_rate"] is None else f"Poisson {r['request_rate']:g}/s"
        idle = "—" if r["gpu_idle_fraction"] is None else f"{100 * r['gpu_idle_fraction']:.1f}%"
        steady = "—" if r["steady_output_throughput"] is None else f"{r['steady_output_throughput']:.0f}"
        print(f"| {r['mode']} | {r['concurrency']} | {arr} | {r['output_throughput']:.0f} | {steady} "
              f"| {r['ttft_ms']['p50']:.1f} / {r['ttft_ms']['p90']:.1f} | {r['tpot_ms']['p50']:.2f} / "
              f"{r['tpot_ms']['p90']:.2f} | {r['itl_ms']['p50']:.2f} / {r['itl_ms']['p90']:.2f} | {idle} "
              f"| {r['errors']} |")
    print("\n| mode | concurrency | arrivals | steps | step ms | engine busy | out tok/step | steps > 50 ms "
          "| running | waiting | prompt tok | cached | preempted | queue wait ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        e = r["engine"]
        arr = "at once" if r["request_rate"] is None else f"Poisson {r['request_rate']:g}/s"
        print(f"| {r['mode']} | {r['concurrency']} | {arr} | {e['steps']} | {e['step_ms_mean']:.1f} "
              f"| {100 * e['engine_busy']:.0f}% | {e['out_tokens_per_step']:.1f} | {100 * e['steps_over_50ms']:.0f}% "
              f"| {e['running_mean']:.1f} | {e['waiting_mean']:.1f} | {e['prompt_tokens']} | {e['cached_tokens']} "
              f"| {e['preemptions']} | {e['queue_wait_ms_mean']:.1f} |")
    by = {(r["mode"], r["concurrency"], r["request_rate"]): r for r in rows}
    for (mode, conc, rate), r in by.items():
        base, delay = split_mode(mode)
        off = by.get(("no-overlap" + (":" + delay if delay else ""), conc, rate))
        if base == "overlap" and off and off["output_throughput"] > 0:
            print(f"overlap / no-overlap at concurrency {conc}: "
                  f"{r['output_throughput'] / off['output_throughput']:.2f}x output tokens/s")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if rows and all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
