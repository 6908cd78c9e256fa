"""Helpers shared by the engine-core tests (test_scheduler, test_engine_cache): tiny checkpoints,
engine builders, a runner wrapper that records every step, and a driver that runs Engine.check()
after every step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from k3rt.backend.cache.radix import Node
from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.runner.base import Runner
from k3rt.backend.scheduler.scheduler import SchedulerOutput
from k3rt.backend.spec.base import Drafter
from k3rt.config import SchedulerConfig
from k3rt.sampling_params import SamplingParams

MAX_STEPS = 20_000


def tiny_checkpoint(tmp_path_factory, arch: str = "kimi_linear", *, two_layers: bool = False) -> Path:
    """The arch's tiny fp32 checkpoint; two_layers: one KDA and one MLA layer (for the interpreter's cases)."""
    from k3rt.backend.models.tiny import make_tiny, two_layer_overrides

    return make_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, seed=0, dtype="float32",
                     overrides=two_layer_overrides(arch) if two_layers else None)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_engine(ckpt: Path, *, runner: str = "null", budget: int = 256, max_running: int = 256,
                max_waiting: int = 4096, model=None, engine: dict | None = None, **cache) -> Engine:
    """engine: EngineConfig overrides (device, kernels, cuda_graphs, ...); cache: CacheConfig overrides."""
    cfg = engine_config_for_tests(str(ckpt), **cache)
    cfg = replace(cfg, runner=runner, scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                                max_running=max_running, max_waiting=max_waiting),
                  **(engine or {}))
    eng = Engine(cfg, model=model)
    eng.runner = Recorder(eng.runner)
    return eng


@dataclass
class Chunk:
    rid: int
    start: int
    num_tokens: int
    total: int  # len(token_ids) when scheduled
    needs_logits: bool
    snapshots: list[int]


@dataclass
class Step:
    decodes: list[tuple[int, int]] = field(default_factory=list)  # (rid, position fed)
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.chunks)


class Recorder(Runner):
    """Wraps a runner and records what every step scheduled."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.steps: list[Step] = []

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        self._record(out)
        return self.inner.execute(out)

    def launch(self, out: SchedulerOutput, prev):
        self._record(out)
        return self.inner.launch(out, prev)

    def collect(self, step):
        return self.inner.collect(step)

    def _record(self, out: SchedulerOutput) -> None:
        self.steps.append(Step(
            [(r.rid, r.num_computed) for r in out.decodes],
            [Chunk(c.req.rid, c.start, c.num_tokens, len(c.req.token_ids), c.needs_logits, [p for p, _ in c.snapshots])
             for c in out.chunks]))

    def release(self, rid: int) -> None:
        self.inner.release(rid)

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(engine: Engine, prompts, params, *, salts=None, after_step=None) -> list:
    """Add the requests, step to completion with Engine.check() after every step; outputs in order."""
    plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    salts = salts or [None] * len(prompts)
    rids = [engine.add_request(p, sp, cache_salt=s) for p, sp, s in zip(prompts, plist, salts)]
    final: dict = {}
    for _ in range(MAX_STEPS):
        if len(final) == len(rids):
            break
        assert engine.has_unfinished, "engine stalled with unfinished requests"
        for o in engine.step():
            if o.finished and o.rid in rids:
                final[o.rid] = o
        engine.check()
        if after_step is not None:
            after_step(engine)
    else:
        raise AssertionError(f"not finished after {MAX_STEPS} steps")
    return [final[r] for r in rids]


def staggered(engine: Engine, prompts, params: SamplingParams, every: int) -> list[list[int]]:
    """One request added every `every` steps while the earlier ones decode (so most steps mix a new prompt with
    decodes), stepped to completion with Engine.check() after every step; output token ids in prompt order."""
    rids, out, step = [], {}, 0
    while len(rids) < len(prompts) or engine.has_unfinished:
        assert step < MAX_STEPS, f"not finished after {MAX_STEPS} steps"
        if len(rids) < len(prompts) and step % every == 0:
            rids.append(engine.add_request(prompts[len(rids)], params))
        for o in engine.step():
            if o.finished:
                out[o.rid] = o.output_ids
        engine.check()
        step += 1
    return [out[r] for r in rids]


def drain(engine: Engine) -> dict:
    """Step until nothing is unfinished, Engine.check() after every step; -> {rid: final output}."""
    done: dict = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished:
            return done
        for o in engine.step():
            if o.finished:
                done[o.rid] = o
        engine.check()
    raise AssertionError(f"not finished after {MAX_STEPS} steps")


def tree_pages(engine: Engine) -> set[int]:
    return set(engine.scheduler.tree.tree_page_refs())


def assert_at_rest(engine: Engine) -> None:
    """No request holds anything: every page is free or held by the tree only, and reset frees all."""
    sched, pool = engine.scheduler, engine.pool
    assert not sched.running and not sched.waiting
    engine.check()
    refs = sched.tree.tree_page_refs()
    for p in pool.reserved:  # runner scratch pages stay held for good
        refs[p] = refs.get(p, 0) + 1
    assert pool.num_free + len(refs) == pool.num_pages
    assert [refs.get(p, 0) for p in range(pool.num_pages)] == pool.refcount
    engine.flush_cache()  # pins included
    engine.check()
    assert pool.num_free + len(pool.reserved) == pool.num_pages and sched.tree.num_snapshots() == 0
    assert all(not r.children for r in sched.tree.roots.values())


def path_tokens(node: Node) -> list[int]:
    out: list[int] = []
    while node.parent is not None:
        out[:0] = node.key
        node = node.parent
    return out


def snapshot_nodes(engine: Engine) -> list[Node]:
    return [n for n in engine.scheduler.tree._nodes() if n.snapshot is not None]


class NullOracle(Drafter):
    """Drafts the null runner's own next tokens, as many as each query may take: every draft is accepted."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def propose(self, queries):
        out = []
        for q in queries:
            seq = list(q.token_ids)
            for _ in range(q.max_tokens):
                seq.append(self.runner.next_token(seq))
            out.append(seq[len(q.token_ids):])
        return out
