"""Overlap scheduling (backend/overlap.py): with the one-step-late protocol the engine's outputs equal the
synchronous engine's token for token (greedy), and nothing of the cache is corrupted by a step's work that
the host drops (a request that a stop token ended a step earlier) or by a copy whose source is reused.

The reference runner computes eagerly; `DeferredDevice` stands in for an asynchronous device: a launched
step (its copies, forward and sampling) and every page fill run only when the host reads the step's
tokens, in launch order, one queue like one CUDA stream. It checks, when a copy runs, that its source and
destination pages still belong to whoever they belonged to when the copy was queued (the "zeroing races
the copy" hazard: a copy source freed and zeroed for a new owner before the copy ran)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.runner.base import LaunchedStep, Runner
from k3rt.backend.scheduler.request import PENDING
from k3rt.config import SchedulerConfig
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import assert_at_rest, tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


class DeferredDevice(Runner):
    """Runs the inner ModelRunner's steps and the pool's fills lazily, in order, when tokens are read."""

    def __init__(self, inner, pool) -> None:
        self.inner, self.pool = inner, pool
        self.queue: list = []
        self.owner = [0] * pool.num_pages  # bumped whenever a page is handed out again
        self.copies_checked = 0
        fill, allocate = pool.fill, pool.allocate

        def queued_fill(pages, value):
            self.queue.append(lambda: fill(pages, value))

        def counted_allocate(n, *, zero=True):
            pages = allocate(n, zero=zero)
            for p in pages:
                self.owner[p] += 1
            return pages

        pool.fill, pool.allocate = queued_fill, counted_allocate

    def execute(self, out):
        return self.collect(self.launch(out, None))

    def launch(self, out, prev: LaunchedStep | None) -> LaunchedStep:
        step = LaunchedStep()
        pages = [p for pair in out.page_copies for p in pair] + [p for s, d in out.state_copies for p in s + d]
        owners = [(p, self.owner[p]) for p in pages]
        prepared = self.inner._prepare(out, prev) if out.decodes or out.chunks else None  # packed at launch

        def run():
            for p, o in owners:
                assert self.pool.refcount[p] > 0 and self.owner[p] == o, (
                    f"page {p} was freed and handed out again before the copy that reads/writes it ran")
            self.copies_checked += len(owners)
            step.sampled = self.inner._run(*prepared, prev) if prepared is not None else {}

        self.queue.append(run)
        return step

    def collect(self, step: LaunchedStep):
        while step.sampled is None:
            self.queue.pop(0)()
        return step.sampled

    def release(self, rid: int) -> None:
        self.inner.release(rid)


def _engine(ckpt, overlap: bool, *, deferred: bool = False, budget: int = 128, num_pages: int = 96,
            **cache) -> Engine:
    cfg = engine_config_for_tests(str(ckpt), num_pages=num_pages, **cache)
    cfg = replace(cfg, runner="model", overlap=overlap,
                  scheduler=SchedulerConfig(max_num_batched_tokens=budget, min_prefill_tokens=64))
    eng = Engine(cfg)
    if deferred:
        eng.runner = DeferredDevice(eng.runner, eng.pool)
    return eng


def _run(eng: Engine, reqs: list[tuple[list[int], SamplingParams]], *, abort_after: dict[int, int] | None = None,
         max_steps: int = 3000) -> dict[int, object]:
    """Add the requests, step to the end (Engine.check() after every step); abort_after: request index ->
    abort it once that many of its tokens came out. -> request index -> final output."""
    rids = [eng.add_request(p, sp) for p, sp in reqs]
    index = {rid: i for i, rid in enumerate(rids)}
    seen = {i: [] for i in range(len(reqs))}
    final = {}
    for _ in range(max_steps):
        if not eng.has_unfinished:
            break
        for o in eng.step():
            i = index[o.rid]
            seen[i] += o.new_token_ids
            assert PENDING not in o.new_token_ids and (o.output_ids is None or PENDING not in o.output_ids)
            if o.finished:
                assert o.output_ids == seen[i]  # the stream and the final output agree
                final[i] = o
            elif abort_after and len(seen[i]) >= abort_after.get(i, 1 << 30):
                eng.abort(o.rid)
        eng.check()
    assert len(final) == len(reqs), "engine did not finish"
    return final


def _mixed(seed: int, n: int = 6) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.choice([5, 70, 200, 300]))],
             SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 24), ignore_eos=True)) for _ in range(n)]


def _tokens(final: dict[int, object]) -> dict[int, tuple[list[int], str]]:
    return {i: (o.output_ids, o.finish_reason) for i, o in final.items()}


def _overlap_equals_sync(ckpt, reqs, *, deferred: bool = True, **cache):
    """Run `reqs` on a synchronous engine and on an overlapping one (same cache config); assert the same
    tokens and finish reasons and that the overlapping engine ends at rest. -> (sync engine, overlap engine)."""
    sync_eng = _engine(ckpt, False, **cache)
    sync = _tokens(_run(sync_eng, reqs))
    eng = _engine(ckpt, True, deferred=deferred, **cache)
    assert _tokens(_run(eng, reqs)) == sync
    assert_at_rest(eng)
    return sync_eng, eng


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred-device"])
def test_overlap_equals_sync_mixed_prefill_decode_and_stop_tokens(ckpt, deferred):
    reqs = _mixed(0)
    sync = _tokens(_run(_engine(ckpt, False), reqs))
    # stop tokens taken from the sync outputs, so some requests end early on a stop token mid-output
    stops = [replace(sp, stop_token_ids=(sync[i][0][len(sync[i][0]) // 2],), ignore_eos=False) if i % 2 else sp
             for i, (_, sp) in enumerate(reqs)]
    reqs = [(p, sp) for (p, _), sp in zip(reqs, stops)]
    sync = _tokens(_run(_engine(ckpt, False), reqs))
    assert any(reason == "stop" for _, reason in sync.values())
    eng = _engine(ckpt, True, deferred=deferred)
    assert _tokens(_run(eng, reqs)) == sync
    assert_at_rest(eng)


def test_stopped_request_state_is_donated_whole_and_hits_correctly(ckpt):
    """A stop token ends a request that the next launched step already fed: its live state then holds the
    stop token too and is published at len(token_ids); a follow-up turn that resumes from it decodes what a
    cache-less engine decodes."""
    rng = random.Random(1)
    prompt = [rng.randrange(3, VOCAB) for _ in range(150)]
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = _run(_engine(ckpt, False), [(prompt, base)])[0].output_ids
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(first[5],), ignore_eos=True)
    assert first[5] not in first[:5]
    eng = _engine(ckpt, True, deferred=True)
    out = _run(eng, [(prompt, stop)])[0]
    assert out.finish_reason == "stop" and out.output_ids == first[:6]
    follow = prompt + out.output_ids + [7, 8, 9]
    hit = _run(eng, [(follow, base)])[0]
    assert hit.cached_tokens == len(prompt) + len(out.output_ids)  # resumed from the whole-turn snapshot
    cold = _run(_engine(ckpt, False, enable_prefix_cache=False), [(follow, base)])[0]
    assert hit.output_ids == cold.output_ids
    assert_at_rest(eng)


def test_overlap_equals_sync_with_prefix_cache_hits_and_copy_on_write(ckpt):
    """Requests sharing prefixes that end mid-page (copy-on-write of the partial page, snapshot copies) in a
    pool small enough that copy sources are evicted and their pages reused right away: every copy ran on the
    pages it was queued with (DeferredDevice checks), and the tokens equal the synchronous engine's."""
    rng = random.Random(2)
    shared = [rng.randrange(3, VOCAB) for _ in range(200)]
    reqs = []
    for k in range(8):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))]
        reqs.append((shared[:rng.choice([70, 135, 200])] + tail,
                     SamplingParams(temperature=0.0, max_tokens=rng.randrange(3, 12), ignore_eos=True)))
    _, eng = _overlap_equals_sync(ckpt, reqs, num_pages=40)
    assert eng.runner.copies_checked > 0 and eng.stats.cached_tokens > 0


def test_overlap_equals_sync_under_preemption(ckpt):
    reqs = _mixed(3, n=8)
    sync_eng, eng = _overlap_equals_sync(ckpt, reqs, num_pages=24)
    assert sync_eng.stats.preemptions > 0 and eng.stats.preemptions > 0


def test_abort_mid_flight_drops_the_token_in_flight(ckpt):
    reqs = _mixed(4, n=4)
    reqs = [(p, replace(sp, max_tokens=20)) for p, sp in reqs]
    sync = _tokens(_run(_engine(ckpt, False), reqs))
    eng = _engine(ckpt, True, deferred=True)
    got = _tokens(_run(eng, reqs, abort_after={1: 5, 2: 1}))
    for i in (0, 3):
        assert got[i] == sync[i]
    for i in (1, 2):
        ids, reason = got[i]
        assert reason == "abort" and ids == sync[i][0][:len(ids)] and len(ids) < 20
    assert_at_rest(eng)


def test_max_tokens_ends_without_a_wasted_step(ckpt):
    """A request whose in-flight token is its last (max_tokens) is not scheduled again: one step per token."""
    eng = _engine(ckpt, True)
    out = _run(eng, [([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))])[0]
    assert len(out.output_ids) == 6 and out.finish_reason == "length"
    assert eng.stats.computed_tokens == 3 + 5  # the prompt, then each sampled token but the last


@pytest.mark.parametrize("arch", ["kimi_linear", "k3"])
def test_gpu_runner_overlap_equals_sync_on_cpu(arch, tmp_path):
    """The GPU runner's launch/collect with torch ops on the CPU: tokens stay in a tensor, the next step's
    decodes take them by a gather by row; equal to the synchronous engine; no GPU-idle metric on the CPU."""
    from k3rt.backend.models.tiny import make_tiny

    ckpt = make_tiny(tmp_path / arch, arch=arch, dtype="float32", seed=9)
    reqs = _mixed(5, n=5)
    outs = {}
    for overlap in (False, True):
        cfg = engine_config_for_tests(str(ckpt), num_pages=96)
        eng = Engine(replace(cfg, runner="gpu", kernels=False, cuda_graphs=False, overlap=overlap,
                             scheduler=SchedulerConfig(max_num_batched_tokens=128, min_prefill_tokens=64)))
        outs[overlap] = _tokens(_run(eng, reqs))
        assert eng.runner.gpu_time() is None and "gpu_idle_seconds" not in eng.stats_dict()
        assert_at_rest(eng)
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_gpu_runner_overlap_equals_sync_on_cuda_with_graphs(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from k3rt.backend.models.tiny import make_tiny

    ckpt = make_tiny(tmp_path / "k3", arch="k3", dtype="float32", seed=9)
    reqs = _mixed(6, n=12)
    outs = {}
    for overlap in (False, True):
        cfg = engine_config_for_tests(str(ckpt), num_pages=256)
        eng = Engine(replace(cfg, device="cuda", runner="gpu", overlap=overlap))
        outs[overlap] = _tokens(_run(eng, reqs))
        idle, span = eng.runner.gpu_time()
        assert span > 0 and 0 <= idle <= span
        assert eng.stats_dict()["gpu_step_seconds"] == span
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_collecting_a_step_does_not_wait_for_the_step_launched_after_it(tmp_path):
    """Overlap on CUDA: collect(N) runs after launch(N+1) and must wait for step N's tokens only. Reading the
    device tokens (`tokens.tolist()`) queued behind N+1 and waited for it too, so host and device took turns (a
    k3-tiny step at batch 64 on the H200: 1.8 ms of wall for 0.53 ms of kernels). Here every launch is followed
    by 200 ms of device sleep standing in for a long next step: a collect that waits for it takes >= 200 ms."""
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from k3rt.backend.models.tiny import make_tiny

    ckpt = make_tiny(tmp_path / "k3", arch="k3", dtype="float32", seed=9)
    cfg = engine_config_for_tests(str(ckpt), num_pages=64)
    eng = Engine(replace(cfg, device="cuda", runner="gpu", overlap=True))
    eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for _ in range(3):  # prefill, then decodes in flight
        eng.step()
    props = torch.cuda.get_device_properties(0)
    cycles = int(0.2 * getattr(props, "clock_rate", 1_980_000) * 1e3)  # ~200 ms at the SM clock (kHz)
    launch, collect, waits = eng.runner.launch, eng.runner.collect, []

    def slow_launch(*a, **kw):
        out = launch(*a, **kw)
        torch.cuda._sleep(cycles)  # queued after this step's work: the "next step" of the previous one
        return out

    def timed_collect(step):
        t0 = time.perf_counter()
        try:
            return collect(step)
        finally:
            waits.append(time.perf_counter() - t0)

    eng.runner.launch, eng.runner.collect = slow_launch, timed_collect
    torch.cuda.synchronize()
    eng.step()  # launches step N+1 (and its sleep), then collects step N
    torch.cuda.synchronize()
    assert waits and waits[0] < 0.1, f"collecting step N waited {waits[0] * 1e3:.0f} ms: it waited for step N+1"


@pytest.mark.gpu
def test_gpu_idle_counts_the_hosts_packing_as_the_device_waiting(tmp_path):
    """Without overlap the device waits while the host reads a step back, schedules and packs the next one. The
    metric's start mark was recorded where `launch` begins, before packing, so the packing counted as device
    time: here decode steps whose packing takes 30 ms (against ~1 ms of device work) read ~0% idle."""
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from k3rt.backend.models.tiny import make_tiny

    ckpt = make_tiny(tmp_path / "k3", arch="k3", dtype="float32", seed=9)
    eng = Engine(replace(engine_config_for_tests(str(ckpt), num_pages=64), device="cuda", runner="gpu",
                         overlap=False))
    eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for _ in range(3):  # prefill, then decodes
        eng.step()
    runner = eng.runner

    def slow(fn):
        def wrapped(*a, **kw):
            time.sleep(0.03)
            return fn(*a, **kw)
        return wrapped

    runner._pack, runner._build = slow(runner._pack), slow(runner._build)  # replayed and eager steps alike
    idle0, span0 = runner.gpu_time()
    for _ in range(5):
        eng.step()
    idle1, span1 = runner.gpu_time()
    frac = (idle1 - idle0) / (span1 - span0)
    assert frac > 0.8, f"GPU idle {frac:.1%} of the step time while the host packed for 30 ms a step"


def test_requests_that_need_their_token_take_the_synchronous_path(tmp_path):
    """Grammar, logprobs and penalties in a batch with plain requests, and speculative decoding: outputs
    (logprobs included) equal overlap off, and a step holding such a request is collected before the
    next one is scheduled (no PENDING token is ever scheduled for it)."""
    from k3rt.backend.models.tiny import make_tiny
    from k3rt.config import SpecConfig

    ckpt = make_tiny(tmp_path / "k3", arch="k3", dtype="float32", seed=2)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    cases = [([5, 6, 7], plain, None), ([8, 9, 10, 11], replace(plain, logprobs=2), None),
             ([12, 13], replace(plain, repetition_penalty=1.3), None),
             ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20),
              {"kind": "regex", "payload": "[0-9]{3}-[a-z]{2}", "strict": True})]
    for spec in (SpecConfig(), SpecConfig(method="ngram", num_tokens=3, ngram_min=1, adaptive=False)):
        got = {}
        for overlap in (False, True):
            cfg = engine_config_for_tests(str(ckpt), num_pages=64)
            eng = Engine(replace(cfg, runner="model", overlap=overlap, spec=spec))
            rids = [eng.add_request(p, sp, grammar=g) for p, sp, g in cases]
            done, scheduled_pending = {}, []
            while eng.has_unfinished:
                for o in eng.step():
                    if o.finished:
                        done[o.rid] = (o.output_ids, o.finish_reason, o.logprobs, o.top_logprobs)
                inflight = eng.overlap.inflight if eng.overlap is not None else None
                if inflight is not None:
                    reqs = inflight.out.decodes + [c.req for c in inflight.out.chunks]
                    scheduled_pending += [r.rid for r in reqs if r.rid != rids[0]]
                eng.check()
            got[overlap] = [done[r] for r in rids]
            assert not scheduled_pending  # only the plain request's steps stay in flight
        assert got[True] == got[False]
        assert got[True][3][1] == "stop"  # the grammar ended it


def test_overlap_benchmark_smoke(tmp_path):
    """benchmarks/overlap.py --smoke (tiny config, CPU, torch ops) runs both modes and writes its JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "overlap.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "overlap.py"), "--smoke", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["batch"], r["overlap"]) for r in runs] == [(2, True), (2, False), (4, True), (4, False)]
    assert all(r["tokens"] == 4 * r["batch"] and r["tokens_per_s"] > 0 and "gpu_idle" not in r for r in runs)


def test_null_runner_overlap_equals_sync_under_cache_pressure(ckpt):
    """The null runner (fake tokens from the token prefix) with overlap, on many requests sharing prefixes in a
    small pool (hits, copy-on-write, eviction, preemption): the same outputs as without overlap."""
    rng = random.Random(7)
    bases = [[rng.randrange(3, VOCAB) for _ in range(300)] for _ in range(2)]
    reqs = []
    for _ in range(30):
        k = rng.choice([0, 47, 64, 65, 128, 200])
        reqs.append((rng.choice(bases)[:k] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 80))],
                     SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30), ignore_eos=True,
                                    stop_token_ids=(rng.randrange(3, VOCAB),))))
    got = {}
    for overlap in (False, True):
        cfg = engine_config_for_tests(str(ckpt), num_pages=40)
        eng = Engine(replace(cfg, runner="null", overlap=overlap,
                             scheduler=SchedulerConfig(max_num_batched_tokens=256, min_prefill_tokens=64)))
        got[overlap] = _tokens(_run(eng, reqs))
        assert_at_rest(eng)
        assert eng.stats.cached_tokens > 0 and eng.stats.preemptions > 0
    assert got[True] == got[False]


def test_overlap_needs_a_runner_with_launch_and_collect(ckpt, monkeypatch):
    class ExecuteOnly(Runner):
        def execute(self, out):
            return {}

    monkeypatch.setattr(Engine, "_make_runner", lambda self, model, torch: ExecuteOnly())
    with pytest.raises(ValueError, match="overlap: the ExecuteOnly has no launch/collect"):
        _engine(ckpt, True)
    _engine(ckpt, False)  # fine without overlap
    with pytest.raises(RuntimeError, match="overlap: ExecuteOnly has no launch/collect"):
        ExecuteOnly().launch(None, None)  # reached only by a caller that skipped the engine's check


def test_gpu_runner_overlap_with_seeded_sampling_on_cpu(tmp_path):
    """Sampling the host does (seeded temperature sampling on the CPU): the next step is fed those host
    tokens; each request's seeded draws do not depend on the batch, so the outputs equal overlap off."""
    from k3rt.backend.models.tiny import make_tiny

    ckpt = make_tiny(tmp_path / "k3", arch="k3", dtype="float32", seed=9)
    reqs = [(p, replace(sp, temperature=0.8, seed=100 + i)) for i, (p, sp) in enumerate(_mixed(8, n=4))]
    outs = {}
    for overlap in (False, True):
        cfg = engine_config_for_tests(str(ckpt), num_pages=96)
        eng = Engine(replace(cfg, runner="gpu", kernels=False, cuda_graphs=False, overlap=overlap,
                             scheduler=SchedulerConfig(max_num_batched_tokens=128, min_prefill_tokens=64)))
        outs[overlap] = _tokens(_run(eng, reqs))
    assert outs[True] == outs[False]


def test_idle_timer_sums_waits_between_collected_steps():
    """idle = previous end -> this start, span = previous end -> this end; not across a timing break."""
    from k3rt.backend.runner.gpu.idle import IdleTimer, StepEvents

    class Ev:  # a completed CUDA event at time t (ms)
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):
            return other.t - self.t

        def synchronize(self):
            pass

    timer = IdleTimer()
    for start, end in ((0, 10), (12, 20), (20, 31)):  # waits of 2 ms, then 0
        timer.collected(StepEvents(Ev(start), Ev(end)))
    assert (round(timer.idle_s * 1e3, 6), round(timer.span_s * 1e3, 6), timer.steps) == (2.0, 21.0, 2)
    timer.reset()  # the engine went idle: the wait until the next step is not counted
    timer.collected(StepEvents(Ev(500), Ev(510)))
    timer.collected(StepEvents(Ev(515), Ev(520)))
    assert (round(timer.idle_s * 1e3, 6), round(timer.span_s * 1e3, 6), timer.steps) == (7.0, 31.0, 3)
