#!/usr/bin/env python3
"""Host cost of one decode step at R running requests (CPU only; no model, no device).

    python3 benchmarks/host_cost.py                      # R = 100 and 1,000, table to stdout
    python3 benchmarks/host_cost.py --running 1000 --json

Each figure is the median of --reps timed calls (the cyclic GC off while timing, as timeit does), on the
Kimi-Linear-48B cache layout (1,888-token pages, 3 KDA state groups, conv width 4), every request decoding at a
context of 100-8,000 tokens:
  schedule    `Engine.step()` with the null runner: schedule + the null runner's fake tokens + update + the
              step's RequestOutputs (the scheduler's own per-step host cost);
  seqs        the GPU runner's per-step StepSeq list from the scheduled work (`step_chunks`, then
              `GpuModelRunner._seq` per chunk);
  pack        `pack_step` of those sequences as an eager step (block table as wide as the longest) and
              padded to the CUDA-graph size with the runner's full-context table width (what a replay packs);
  updates     the engine process turning the step's outputs into the wire message (`RequestMap.step_batch`
              minus the engine step);
  encode / decode / route
              the UpdateBatch's encode in the engine process, its decode in the gateway, and the gateway's
              routing of each request's update onto its asyncio queue (`EngineClient._route`: the batch's
              columns expanded into RequestUpdates, each put on its request's queue).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
from dataclasses import replace
from itertools import repeat
from k3rt.backend.bench.codec_bench import median_ms


def _engine(running: int, model: str, seed: int):
    """A null-runner engine with `running` requests all decoding, and the RequestMap the engine process uses."""
    from k3rt.backend.engine import Engine
    from k3rt.backend.request_map import RequestMap
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig
    from k3rt.protocol import GenerateRequest, params_to_dict
    from k3rt.sampling_params import SamplingParams

    cfg = EngineConfig(model=model, runner="null", cache=CacheConfig(num_pages=16384),
                       scheduler=SchedulerConfig(max_num_batched_tokens=65536, max_running=max(1024, running)))
    eng = Engine(cfg)
    rm = RequestMap(eng)
    rng = random.Random(seed)
    params = params_to_dict(SamplingParams(temperature=0.0, max_tokens=1_000_000, ignore_eos=True))
    for i in range(running):
        n = rng.randint(100, 8000)
        err = rm.add(GenerateRequest(f"req-{i:08x}", [3 + (i * 7 + j) % 1000 for j in range(n)], params))
        assert err is None, err
    for _ in range(64):  # every prompt prefilled
        rm.step()
        if len(eng.scheduler.running) == running and not eng.scheduler.waiting and all(
                r.num_computed >= r.prompt_len for r in eng.scheduler.running):
            break
    rm.step()
    assert len(eng.scheduler.running) == running, "not every request is running: raise num_pages"
    return eng, rm


def bench(running: int, *, model: str = "kimi-linear-48b", reps: int = 50, seed: int = 0) -> dict[str, float]:
    from k3rt.backend.runner.gpu.runner import DEFAULT_GRAPH_SIZES, GpuModelRunner
    from k3rt.backend.runner.gpu.step import StepSeq, pack_step
    from k3rt.backend.runner.step_plan import step_chunks
    from k3rt.protocol import decode, encode

    eng, rm = _engine(running, model, seed)
    row: dict[str, float] = {"running": running}
    row["schedule_ms"] = median_ms(eng.step, reps)

    # the runner's view of one step: capture a SchedulerOutput as the runner receives it
    captured = []
    execute = eng.runner.execute
    eng.runner.execute = lambda out: captured.append(out) or execute(out)
    outputs = eng.step()
    eng.runner.execute = execute
    out = captured[0]
    assert not out.chunks and len(out.decodes) == running, "the captured step is not all decodes"
    L = eng.layout
    groups, conv_width = max(1, len(L.kda_groups)), 4
    pad = StepSeq([0], 0, [0], [0] * groups, True)

    def seqs() -> list[StepSeq]:
        return list(map(GpuModelRunner._seq, repeat(None), step_chunks(out)))

    row["seqs_ms"] = median_ms(seqs, reps)
    ss = seqs()
    row["pack_eager_ms"] = median_ms(lambda: pack_step(ss, block_size=L.block_size, conv_width=conv_width,
                                                       num_groups=groups), reps)
    size = next((s for s in DEFAULT_GRAPH_SIZES if s >= running), None)
    if size is not None:
        max_blocks = -(-eng.model_cfg.max_position_embeddings // L.block_size)
        padded = ss + [pad] * (size - running)
        row["pack_graph_ms"] = median_ms(lambda: pack_step(padded, block_size=L.block_size, conv_width=conv_width,
                                                           num_groups=groups, max_blocks=max_blocks), reps)
    else:
        row["pack_graph_ms"] = float("nan")  # wider than the largest graph: the step runs eagerly

    # the wire: the engine process's updates, encode, the gateway's decode and routing
    replay = _Replay(rm, outputs)
    row["updates_ms"] = median_ms(lambda: type(rm).step_batch(replay), reps)
    msg = replace(type(rm).step_batch(replay), stats=eng.stats_dict())
    data = encode(msg)
    row["encode_ms"] = median_ms(lambda: encode(msg), reps)
    row["decode_ms"] = median_ms(lambda: decode(data, trusted=True), reps)
    row["wire_bytes"] = len(data)
    decoded = decode(data, trusted=True)
    row["route_ms"] = asyncio.run(_route_ms(decoded, reps))
    row["codec_total_ms"] = row["updates_ms"] + row["encode_ms"] + row["decode_ms"] + row["route_ms"]
    return row


class _Replay:
    """A RequestMap stand-in whose engine step returns one fixed list of outputs, names never deleted."""

    def __init__(self, rm, outputs) -> None:
        self.engine = _FixedEngine(rm.engine, outputs)
        self.names, self.rids, self.pinned = dict(rm.names), dict(rm.rids), {}


class _FixedEngine:
    def __init__(self, engine, outputs) -> None:
        self._engine, self._outputs = engine, outputs
        self.num_pins = 0

    def step(self):
        return self._outputs

    def is_pinned(self, rid: int) -> bool:
        return False


async def _route_ms(msg, reps: int) -> float:
    """The gateway's per-batch work once decoded: every update onto its request's queue (then drained, as the
    request handlers would)."""
    from k3rt.backend.engine_client import EngineClient

    client = EngineClient.__new__(EngineClient)
    client.queues = {u.rid: asyncio.Queue() for u in msg.updates}
    client._finished = set()
    client.stats = {}

    def route() -> None:
        client._route(msg)
        for q in client.queues.values():
            q.get_nowait()

    return median_ms(route, reps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--model", default="kimi-linear-48b", help="preset name or checkpoint folder (config only)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = p.parse_args()
    gc.freeze()
    rows = []
    for r in a.running:
        rows.append(bench(r, model=a.model, reps=a.reps))
        gc.freeze()
    if a.json:
        print(json.dumps(rows))
        return 0
    cols = ["running", "schedule_ms", "seqs_ms", "pack_eager_ms", "pack_graph_ms", "updates_ms", "encode_ms",
            "decode_ms", "route_ms", "codec_total_ms"]
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
