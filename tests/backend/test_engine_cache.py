"""The prefix cache with the real model (tiny random checkpoints, fp32, CPU): THE ORACLE TEST.

Randomized rounds of requests (shared prefixes, exact repeats, conversation turns, divergence from
a shared base at offsets covering many residues mod 64 and mod block_size 48) run through the Engine
with a big pool, and with a tiny pool that forces eviction and preemption and fills freed pages with
NaN (poison_freed). Engine.check() runs after every step; after each round:
  (a) Engine.check() passes at rest;
  (b) every snapshot in the tree equals the KDA state recomputed from scratch for its path by the
      reference model over a ContiguousCache (prefixes shared between paths are computed once): the
      conv and recurrent state of every KDA layer, read from the pool through layout.kda_slot, <= 1e-5;
      and the MLA pages a hit there would use hold the reference latent KV of the whole path;
  (c) every output equals the cache-off output (enable_prefix_cache=False, big pool), greedy, token
      for token (so poisoning freed pages changes nothing either).
Both tiny architectures (kimi_linear, k3). Repeats report cached tokens. A regression test pins a
request aborted before its first forward.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from k3rt.backend.models.batch import ContiguousCache, ForwardBatch
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import load_model
from tests.backend.engine_fixtures import (
    assert_at_rest, greedy, make_engine, path_tokens, run, snapshot_nodes, tiny_checkpoint,
)

TOL = 1e-5
# the CUDA runner's fused decode kernels round fp32 differently from the reference: latent KV written by
# 59 decode steps (a conversation end's snapshot) measured 1.14e-5 off on the H200; states stay within TOL
TOL_CUDA_KV = 3e-5
# the GPU runner's torch-op path on the CPU computes the latent from one fused projection GEMM (zero-padded to a
# multiple of 16 columns since session 12: backend/runner/gpu/ops.py fuse_rows), which MKL sums in another order than
# the reference's separate projections: 1.02e-5 off measured in CI (k3, big pool); states stay within TOL
TOL_GPU_RUNNER_KV = 2e-5
VOCAB = 512


@dataclass
class Arch:
    ckpt: Path
    model: KimiForCausalLM
    outputs: dict = field(default_factory=dict)  # (prompt, max_tokens) -> cache-off output
    states: dict = field(default_factory=dict)  # length -> {token path: ContiguousCache after it}


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def arch(request, tmp_path_factory) -> Arch:
    """A tiny checkpoint, its model, and memos of the reference computations (shared by the variants)."""
    ckpt = tiny_checkpoint(tmp_path_factory, request.param)
    return Arch(ckpt, load_model(ckpt, dtype="float32", progress=False))


def reference_outputs(arch: Arch, prompts, params) -> list[list[int]]:
    """(c)'s oracle: cache-off greedy outputs, big pool."""
    todo = [(p, sp) for p, sp in zip(prompts, params) if (tuple(p), sp.max_tokens) not in arch.outputs]
    if todo:
        eng = make_engine(arch.ckpt, runner="model", model=arch.model, enable_prefix_cache=False, num_pages=1024,
                          budget=2048)
        outs = run(eng, [p for p, _ in todo], [sp for _, sp in todo])
        for (p, sp), o in zip(todo, outs):
            arch.outputs[(tuple(p), sp.max_tokens)] = o.output_ids
        assert eng.scheduler.tree.num_snapshots() == 0 and eng.stats.cached_tokens == 0
    return [arch.outputs[(tuple(p), sp.max_tokens)] for p, sp in zip(prompts, params)]


def _clone(cache: ContiguousCache) -> ContiguousCache:
    c = copy.copy(cache)
    c.conv = {k: v.clone() for k, v in cache.conv.items()}
    c.rec = {k: v.clone() for k, v in cache.rec.items()}
    c.kv = {k: v.clone() for k, v in cache.kv.items()}
    return c


def reference_state(arch: Arch, path: list[int]) -> ContiguousCache:
    """The reference model's cache after `path`, computed from the empty cache (continuing the longest
    prefix computed before, so shared prefixes are computed once)."""
    key = tuple(path)
    for k in sorted((k for k in arch.states if k <= len(path)), reverse=True):
        base = arch.states[k].get(key[:k])
        if base is not None:
            break
    else:
        k, base = 0, arch.model.new_cache()
    if k == len(path):
        return base
    cache = _clone(base)
    arch.model(torch.tensor(path[k:]), ForwardBatch([len(path) - k], [k], [cache], logits_indices=torch.tensor([0])))
    assert cache.num_tokens == len(path)
    arch.states.setdefault(len(path), {})[key] = cache
    return cache


def assert_snapshots_exact(engine, arch: Arch) -> int:
    """(b): every snapshot in the tree equals the reference state after its path, every KDA layer's
    conv and recurrent state, read from the pool through layout.kda_slot; and the MLA pages a hit on
    that snapshot would use hold the reference latent KV of every position of the path. Returns the count."""
    tree, pool, L = engine.scheduler.tree, engine.pool, engine.layout
    kda_layers = [layer for group in L.kda_groups for layer in group]
    assert sorted(kda_layers) == [i for i, t in enumerate(arch.model.cfg.layer_types) if t == "kda"]
    salts = {id(root): salt for salt, root in tree.roots.items()}
    nodes = snapshot_nodes(engine)
    for node in nodes:
        path = path_tokens(node)
        ref = reference_state(arch, path)
        where = f"snapshot at {node.end} (path {path[:6]}...)"
        for layer in kda_layers:
            g, t = L.kda_slot(layer)
            page = node.snapshot[g]
            for what, got, want in (("conv", pool.conv[t][page], ref.conv[layer]),
                                    ("recurrent", pool.rec[t][page], ref.rec[layer])):
                err = (got.cpu() - want).abs().max().item()
                assert err <= TOL, f"{where}: layer {layer} {what} state off by {err}"
        root = node
        while root.parent is not None:
            root = root.parent
        m = tree.match(path, salts[id(root)], touch=False)
        assert (m.kv_hit, m.state_hit, m.state_node) == (node.end, node.end, node)
        pos = torch.arange(node.end)
        pages = torch.tensor(m.block_pages)[pos // L.block_size]
        for i, layer in enumerate(L.mla_group):
            err = (pool.mla[i][pages.to(pool.mla[i].device), (pos % L.block_size).to(pool.mla[i].device)].cpu()
                   - ref.kv[layer]).abs().max().item()
            tol = (TOL_CUDA_KV if pool.mla[i].is_cuda else TOL_GPU_RUNNER_KV if engine.cfg.runner == "gpu"
                   else TOL)
            assert err <= tol, f"{where}: layer {layer} latent KV off by {err}"
    return len(nodes)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# divergence from the shared base after L tokens; residues mod 64: {0, 1, 2, 15, 32, 33, 47, 48, 63},
# mod block_size 48: {0, 1, 2, 15, 16, 33, 47}; each later round takes half, in a seeded order
OFFSETS = [1, 2, 47, 48, 63, 64, 96, 97, 129, 143, 191, 192]


class Workload:
    """Three rounds of requests; later rounds repeat and continue (as conversations) earlier ones."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.base = rand_tokens(self.rng, 200)
        offsets = self.rng.sample(OFFSETS, len(OFFSETS))
        self.offsets = [sorted(offsets[:6]), sorted(offsets[6:])]

    def params(self, n: int) -> list:
        return [greedy(self.rng.randrange(1, 5)) for _ in range(n)]

    def round(self, i: int, prev: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        rng = self.rng
        if i == 0:
            return [self.base[:150] + rand_tokens(rng, 10), self.base[:64] + rand_tokens(rng, 30),
                    rand_tokens(rng, 70), self.base[:130] + [7]]
        repeats = [p for p, _ in rng.sample([x for x in prev if len(x[0]) > 64], 2)]
        turns = [p + out + rand_tokens(rng, rng.choice([0, 1, 9, 40])) for p, out in rng.sample(prev, 1)]
        return repeats + turns + [self.base[:k] + rand_tokens(rng, rng.randrange(1, 17)) for k in self.offsets[i - 1]]


VARIANTS = [
    pytest.param(1024, False, id="big-pool"),
    pytest.param(12, True, id="tiny-pool-poisoned"),
]

# the engine's compute paths: the reference runner; the GPU runner's path on the CPU with torch ops
# in place of the kernels (its step packing, state handling and snapshots); the GPU runner on CUDA
# with the Triton kernels and decode graphs
PATHS = [
    pytest.param(("model", {}), id="reference"),
    pytest.param(("gpu", {"kernels": False, "cuda_graphs": False}), id="gpu-path-torch-ops"),
    pytest.param(("gpu", {"device": "cuda"}), id="gpu-runner-cuda", marks=pytest.mark.gpu),
]


def engine_for(arch: Arch, path, **kw):
    runner, over = path
    model = arch.model
    if over.get("device") == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        model = copy.deepcopy(arch.model).cuda()
    return make_engine(arch.ckpt, runner=runner, model=model, engine=over, **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_pages, poison", VARIANTS)
def test_oracle(arch, num_pages, poison, path):
    tiny = num_pages < 1024
    eng = engine_for(arch, path, num_pages=num_pages, poison_freed=poison, budget=256)
    assert eng.layout.block_size == 48 and eng.layout.pages_per_state_set == 3
    evicted = []
    evict = eng.scheduler.tree.evict
    eng.scheduler.tree.evict = lambda n, **kw: evicted.append(evict(n, **kw)) or evicted[-1]
    wl = Workload(seed=11)
    prev: list[tuple[list[int], list[int]]] = []
    checked = 0
    pins: list[int] = []
    for i in range(3):
        # and a long decode submitted first: as it grows it needs pages newer requests hold, so a tiny
        # pool preempts them (they resume from their donated states)
        prompts = [wl.base[:60] + rand_tokens(random.Random(i), 40)] + wl.round(i, prev)
        params = [greedy(60)] + wl.params(len(prompts) - 1)
        want = reference_outputs(arch, prompts, params)
        # beside the round: a DSL program's pinned call cancelled mid-way (aborted: never pinned) and,
        # big pool, one that finishes and keeps its end pinned to the end of the test (a program between
        # calls), so snapshots are checked with pins held
        cancelled = eng.add_request(prompts[-1] + [3, 4, 5], greedy(6), pin=True)
        if not tiny:  # (4 state sets in the tiny pool: a pin there leaves no room for hits)
            pins.append(eng.add_request(prompts[0][:40] + [i + 9], greedy(2), pin=True))
        steps = [0]

        def cancel_at_step_2(e, rid=cancelled, steps=steps):
            steps[0] += 1
            if steps[0] == 2:
                e.abort(rid)

        outs = run(eng, prompts, params, after_step=cancel_at_step_2)  # Engine.check() after every step
        while eng.has_unfinished:
            eng.step()
            eng.check()
        eng.check()  # (a)
        checked += assert_snapshots_exact(eng, arch)  # (b)
        for k, (o, w) in enumerate(zip(outs, want)):  # (c)
            assert o.output_ids == w, f"round {i} request {k}: cache-on {o.output_ids} != cache-off {w}"
        if i and not tiny:
            for p, o in zip(prompts[1:3], outs[1:3]):  # exact repeats hit at least their replay boundary
                assert o.cached_tokens >= (len(p) - 1) // 64 * 64 > 0
        prev += [(p, o.output_ids) for p, o in zip(prompts, outs)]
    assert eng.stats.cached_tokens > 0 and checked >= (3 if tiny else 20)
    if tiny:
        assert eng.stats.preemptions > 0 and sum(evicted) > 0
    else:
        assert eng.stats.preemptions == 0
        assert sorted(eng.scheduler.pins) == pins  # the cancelled calls left no pin
    for rid in pins:
        eng.unpin(rid)
    assert not eng.scheduler.pins
    assert_at_rest(eng)


def test_abort_before_the_first_forward_publishes_no_state(arch):
    """Scheduler._finish: a request aborted after admission but before its first forward (its
    snapshot -> live state copy still pending) donated its uncopied live state set as the snapshot of
    its hit node when that node's snapshot had been evicted meanwhile: a garbage snapshot."""
    eng = make_engine(arch.ckpt, runner="model", model=arch.model, num_pages=200, budget=64, poison_freed=True)
    rng = random.Random(3)
    prompt = rand_tokens(rng, 200)
    run(eng, [prompt], greedy(1))
    assert 128 in {n.end for n in snapshot_nodes(eng)}
    decoding = eng.add_request(rand_tokens(rng, 10), greedy(20))
    eng.step()
    late = eng.add_request(prompt[:128] + rand_tokens(rng, 100), greedy(2))
    # admitted with its hit at 128 but not yet forwarded (its copies pending), as when a step's budget
    # runs out right after admission: drive the admission by hand, since the scheduler now always
    # gives an admitted request a chunk in the same step
    sched = eng.scheduler
    req = sched.waiting[0]
    sched._chunks = {}
    assert sched._admit(req, 64) > 0 and req in sched.running
    for _, dest in sched._chunks.pop(req.rid).snapshots:  # the chunk never runs
        eng.pool.unref(dest)
    assert req.num_computed == 128 and req.pending_state_copies
    eng.scheduler.tree.evict(eng.pool.num_pages)  # memory pressure: every snapshot goes, the locked path stays
    eng.check()
    eng.abort(late)
    eng.abort(decoding)
    eng.step()
    eng.check()
    assert_snapshots_exact(eng, arch)
    assert_at_rest(eng)
