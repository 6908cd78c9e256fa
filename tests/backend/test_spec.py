"""Speculative decoding (issue 16) on the reference runner, tiny random checkpoints of both architectures.

- The drafters: prompt lookup (ngram) and the suffix tries, unit by unit.
- Greedy: speculative output equals plain output token for token, for the ngram and suffix drafters and for
  an oracle drafter that proposes the true continuation with seeded corruption (so verifies accept every
  prefix length, reject at every draft position and run through stop tokens); with prefix-cache hits,
  chunked prefill, duplicate requests (n > 1), stop ids and max_tokens inside an accepted run, and a tiny
  poisoned pool that forces preemption mid-speculation. Engine.check() runs after every step and every
  snapshot in the tree equals the state recomputed from scratch (the prefix-cache oracle), with speculation on.
- Temperature > 0: chi-square tests that the verifier's first token follows the target distribution and the
  second token, given the first draft was accepted, follows the next row's; the sampler's own rows
  (top-k, top-p, penalties) and a plain sample_batch baseline are the reference.
- Grammar: drafts the grammar refuses are cut, and constrained output is the same with speculation on.
- A repetitive workload gives tau > 1 for the suffix drafter; /metrics-facing stats count drafted, accepted.
"""

from __future__ import annotations

import gc
import json
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.loader import load_model
from k3rt.backend.runner.gpu.step import StepSeq, pack_step, step_views
from k3rt.backend.runner.gpu.verify_graph import pad_rows, plan_verify
from k3rt.backend.sampling.sampler import Sampler
from k3rt.backend.spec.base import DraftQuery, Drafter
from k3rt.backend.spec.ngram import NgramDrafter
from k3rt.backend.spec.rejection import verify_requests
from k3rt.backend.spec.suffix import SuffixDrafter, SuffixTrie, advance_matches
from tests.backend.suffix_ref import RefSuffixTrie
from k3rt.config import SpecConfig
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import NullOracle, assert_at_rest, drain, make_engine, run, tiny_checkpoint
from tests.backend.test_engine_cache import Arch, assert_snapshots_exact
from tests.backend.threads import single_thread  # noqa: F401  (autouse fixture)

VOCAB = 512



# ---- drafters ----

def test_ngram_proposes_what_followed_the_latest_match_longest_n_first() -> None:
    d = NgramDrafter(2, 3)
    toks = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    # (1, 2, 3) last occurred at 0..2 (followed by 9); the 2-gram (2, 3) more recently at 5..6 (followed by 7)
    assert d.propose([DraftQuery(0, toks, 4, 3)]) == [[9, 5, 2]]
    toks2 = [4, 2, 3, 7, 8, 5, 2, 3]
    assert d.propose([DraftQuery(1, toks2, 4, 2)]) == [[7, 8]]
    assert d.propose([DraftQuery(2, [1, 2, 3, 4], 2, 4)]) == [[]]
    # past the end of the history the match repeats with its period
    assert d.propose([DraftQuery(3, [5, 6, 5, 6], 2, 5)]) == [[5, 6, 5, 6, 5]]
    # incremental: tokens appended to the same request are indexed as they come
    toks2 += [7, 8, 5, 2]
    assert d.propose([DraftQuery(1, toks2, 4, 2)]) == [[3, 7]]
    d.finish(1, toks2, 4)
    assert 1 not in d._reqs


def test_suffix_trie_counts_substrings_and_unindexes_exactly() -> None:
    t = SuffixTrie(3)
    sid = t.add([1, 2, 1, 2, 3])
    n1 = t.step((t.ROOT, 0), 1)
    n12 = t.step(n1, 2)
    assert t.count_at(n1) == 2 and t.count_at(n12) == 2
    assert t.count_at(t.step(n12, 1)) == 1  # depth 3: [1, 2, 1]
    assert t.step(t.step(n12, 1), 2) is None  # no depth 4
    node, off, m = t.matches([7, 1, 2], 2)[-1]
    assert m == 2 and t.children_at((node, off)) == {1: 1, 3: 1}
    t.remove(sid)
    assert not t.children_at((t.ROOT, 0)) and len(t) == 1 and not t._seqs


def _substring_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for m in range(1, min(depth, len(s) - i) + 1):
                out[tuple(s[i:i + m])] = out.get(tuple(s[i:i + m]), 0) + 1
    return out


def _logical_view(t) -> dict[tuple[int, ...], tuple[int, int | None]]:
    """path -> (count, the token its draft follows: the best child's) over the trie's logical view."""
    out, stack = {}, [((t.ROOT, 0), ())]
    while stack:
        pos, path = stack.pop()
        kids = t.children_at(pos)
        if path:
            d = t.draft(pos[0], pos[1], 1, 1, 0.0, 1.0)[0]
            out[path] = (t.count_at(pos), d[0] if d else None)
        stack += [(t.step(pos, k), path + (k,)) for k in kids]
    return out


def test_suffix_trie_matches_brute_force_counts_and_the_uncompressed_trie() -> None:
    """The compressed trie (count-1 chains implicit, freed ids reused) against brute-force substring counts and,
    path by path, against the uncompressed oracle (tests/backend/suffix_ref.py): the same counts and the same
    best child (the most frequent, ties to the earliest created), through interleaved adds and removals, on
    repetitive sequences (small alphabet, repeats) where chains split and re-form."""
    rng = random.Random(3)
    t, ref, live = SuffixTrie(4), RefSuffixTrie(4), []
    for step in range(300):
        if live and rng.random() < 0.4:
            s, sid, rid = live.pop(rng.randrange(len(live)))
            t.remove(sid)
            ref.remove(rid)
        else:
            s = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
            if rng.random() < 0.3 and live:  # a repeat of a live one, maybe extended
                s = live[rng.randrange(len(live))][0] + s[:rng.randrange(3)]
            live.append((s, t.add(s), ref.add(s)))
        view = _logical_view(t)
        assert {k: c for k, (c, _) in view.items()} == _substring_counts([s for s, _, _ in live], 4), step
        assert view == _logical_view(ref), step
        assert t.total[t.ROOT] == ref.total[ref.ROOT]
    assert len(t) < len(ref)  # the point: fewer explicit nodes


def test_suffix_trie_grows_its_own_sequence_like_the_uncompressed_one() -> None:
    """`extend` (a request's own trie, the sequence growing token by token): the same logical view and the same
    active suffixes with a continuation as the oracle at every length."""
    rng = random.Random(5)
    t, ref = SuffixTrie(6, removable=False), RefSuffixTrie(6, removable=False)
    toks = []
    for _ in range(120):
        chunk = [rng.randrange(3)] if rng.random() < 0.7 else toks[-rng.randrange(1, 8):] if toks else [0]
        toks += chunk
        t.extend(chunk)
        ref.extend(chunk)
        assert _logical_view(t) == _logical_view(ref)
        mine = [m for m in range(1, len(t.active)) if t.total[t.active[m]]]
        theirs = [m for m in range(1, len(ref.active)) if ref.total[ref.active[m]]]
        assert mine == theirs


def test_suffix_drafter_drafts_exactly_what_the_uncompressed_tries_draft() -> None:
    """Whole drafter: requests growing, finishing into the global trie, evicted from it, on a repetitive
    workload; every proposal (tokens and probabilities) equals the one from the uncompressed tries."""

    class RefDrafter(SuffixDrafter):
        Trie = RefSuffixTrie

    rng = random.Random(11)
    cfg = SpecConfig(method="suffix", suffix_max_depth=8, suffix_cached_requests=3, suffix_max_spec_factor=2.0)
    d, r = SuffixDrafter(cfg), RefDrafter(cfg)
    phrases = [[rng.randrange(30) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    live: dict[int, list[int]] = {}
    for rid in range(40):
        live[rid] = [t for _ in range(3) for t in rng.choice(phrases)]
        for _ in range(rng.randrange(2, 6)):
            qs = [DraftQuery(q, toks, 3, rng.randrange(1, 8)) for q, toks in live.items()]
            assert d.propose_scored(qs) == r.propose_scored(qs), rid
            for toks in live.values():
                toks += rng.choice(phrases)[:rng.randrange(1, 4)] if rng.random() < 0.8 else [rng.randrange(30)]
        for q in rng.sample(sorted(live), k=min(len(live), rng.randrange(0, 3))):
            d.finish(q, live[q], 3)
            r.finish(q, live.pop(q), 3)


def test_suffix_global_matches_carried_token_by_token_equal_a_fresh_walk() -> None:
    """The drafter carries each request's matches in the global trie forward one token at a time (O(depth) a
    token, where a fresh walk is O(depth^2): 20% of a batch-64 call at context 256+, the whole call 51 -> 41 us a
    request on the CI machine); they must equal `matches` on the grown context, for both tries, on repetitive
    and on random text, up to and past the pattern limit."""
    rng = random.Random(3)
    phrases = [[rng.randrange(12) for _ in range(rng.randrange(2, 7))] for _ in range(5)]
    for Trie in (SuffixTrie, RefSuffixTrie):
        trie = Trie(6)
        for _ in range(8):
            trie.add([t for _ in range(4) for t in rng.choice(phrases)] + [rng.randrange(12)])
        for _ in range(20):
            ctx, found, L = [], [], rng.randrange(1, 6)
            for _ in range(40):
                tok = rng.choice(rng.choice(phrases)) if rng.random() < 0.8 else rng.randrange(14)
                ctx.append(tok)
                found = advance_matches(trie, found, tok, L)
                assert found == trie.matches(ctx[-L:], L), (Trie, ctx, L)


def test_suffix_finish_defers_indexing_to_the_next_proposal() -> None:
    """Regression (session 16): `finish` indexed each output into the global trie at once, in the engine step
    that ended the request, drafting or not (on the H200 at batch 64, 64 outputs ended in one step and their
    indexing, ~0.3 s, was most of a 0.3 s run; with speculation turned off the drafter is never asked, so the
    work was all loss). Now the output waits for the next proposal, and at most suffix_cached_requests wait."""
    d = SuffixDrafter(SpecConfig(method="suffix", suffix_cached_requests=2, suffix_max_spec_factor=4.0))
    empty = len(d.global_trie)
    for rid, base in enumerate((10, 20, 30)):
        d.finish(rid, [1, base, base + 1, base + 2, base + 3], 1)
    assert len(d.global_trie) == empty  # nothing indexed by finish
    # the oldest output would have left the trie before any proposal read it: never indexed
    assert d.propose([DraftQuery(7, [5, 10], 1, 3)]) == [[]]
    assert len(d.global_trie) > empty
    assert d.propose([DraftQuery(8, [5, 20], 1, 3)]) == [[21, 22, 23]]
    assert d.propose([DraftQuery(9, [5, 30], 1, 3)]) == [[31, 32, 33]]


def test_suffix_drain_of_finished_outputs_is_spread_over_proposals() -> None:
    """Regression (session 23): a batch's finished outputs were all indexed into the global trie by the next
    proposal (64 outputs of 128 tokens into the full trie: ~0.5 s on the CI machine, on one call of a drafter priced
    per call). Each proposal now indexes suffix_drain_tokens of them, oldest first, at least one output."""
    d = SuffixDrafter(SpecConfig(method="suffix", suffix_drain_tokens=6, suffix_max_spec_factor=4.0))
    for rid, base in enumerate((10, 20, 30, 40)):
        d.finish(rid, [1, base, base + 1, base + 2, base + 3], 1)  # 4-token outputs
    q = [DraftQuery(7, [5, 10], 1, 3), DraftQuery(8, [5, 20], 1, 3), DraftQuery(9, [5, 30], 1, 3),
         DraftQuery(6, [5, 40], 1, 3)]
    assert d.propose(q) == [[11, 12, 13], [21, 22, 23], [], []]  # two outputs (8 tokens >= 6), the oldest
    assert len(d._finished) == 2
    assert d.propose(q) == [[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]]
    assert not d._finished
    d.finish(5, [1] + list(range(60, 80)), 1)  # one output longer than the budget: indexed whole
    d.propose(q[:1])
    assert not d._finished
    with pytest.raises(ValueError, match="suffix_drain_tokens: must be >= 1, got 0"):
        SpecConfig(method="suffix", suffix_drain_tokens=0)


def test_suffix_drafter_holds_no_gc_tracked_object_per_token() -> None:
    """Regression (session 14): trie nodes were Python objects with a children dict each, ~24 per indexed token,
    all tracked by the cyclic GC, whose full collections then walked them all (120 ms pauses at batch 64 in a CPU
    replay; on the H200 the drafter's calls averaged up to 370 ms, a plain k3-tiny step 1.9 ms). Indexing 20K
    tokens must not add tracked objects in proportion."""
    rng = random.Random(0)
    d = SuffixDrafter(SpecConfig(method="suffix"))
    gc.collect()
    before = len(gc.get_objects())
    for rid in range(10):
        toks = [rng.randrange(50) for _ in range(2000)]
        d.propose([DraftQuery(rid, toks, 1000, 7)])
        if rid % 2:
            d.finish(rid, toks, 1000)
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < 1000, grown  # the object-per-node tries: ~658K


def test_suffix_draft_length_adapts_to_match_length_and_confidence() -> None:
    cfg = SpecConfig(method="suffix", suffix_max_depth=16, suffix_min_prob=0.3)
    d = SuffixDrafter(cfg)
    # own history: after [5, 6] came 7 8 9 once; the pattern is 2 long, so at most 2 tokens (factor 1)
    assert d.propose([DraftQuery(0, [5, 6, 7, 8, 9, 1, 5, 6], 1, 8)]) == [[7, 8]]
    # a longer matched pattern drafts further
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    assert d.propose([DraftQuery(1, seq, 1, 8)]) == [[5, 6, 7, 8]]
    # low confidence stops the draft: after 3 came 4 once and 5 twice and 6 twice -> p(best) = 0.4, then 0.4*1
    amb = [3, 4, 3, 5, 9, 3, 5, 9, 3, 6, 3, 6, 0, 3]
    assert d.propose([DraftQuery(2, amb, 1, 8)]) == [[5]]
    # the global trie holds finished outputs: a new request with the same prompt drafts the old output
    d.finish(3, [40, 41, 42, 43, 44, 45, 46, 47], 2)
    assert d.propose([DraftQuery(4, [40, 41], 2, 8)]) == [[]]  # pattern [41] only: 1 token at factor 1
    d2 = SuffixDrafter(SpecConfig(method="suffix", suffix_max_spec_factor=4.0))
    d2.finish(3, [40, 41, 42, 43, 44, 45, 46, 47], 1)
    assert d2.propose([DraftQuery(4, [40, 41], 2, 3)]) == [[42, 43, 44]]
    # the cache of finished outputs is bounded: the oldest is subtracted out
    d3 = SuffixDrafter(SpecConfig(method="suffix", suffix_cached_requests=1, suffix_max_spec_factor=4.0))
    d3.finish(0, [1, 10, 11, 12], 1)
    d3.finish(1, [1, 20, 21, 22], 1)
    assert d3.propose([DraftQuery(2, [5, 10], 1, 3)]) == [[]]
    assert d3.propose([DraftQuery(3, [5, 20], 1, 3)]) == [[21, 22]]


def test_suffix_drafts_from_a_shorter_pattern_when_the_longest_leaves_no_room() -> None:
    """Regression: in a repetitive context the longest matched pattern sits near the trie's depth, where the
    trie holds one token of its continuation; a shorter pattern drafts the full length (the agent workload's
    tau was capped near 2.4 by this)."""
    d = SuffixDrafter(SpecConfig(method="suffix", suffix_max_depth=8))
    a = list(range(100, 110))
    # the longest match [100..106] (7 tokens) continues with 107 only inside a depth-8 trie
    assert d.propose([DraftQuery(0, a + a[:7], 1, 4)]) == [[107, 108, 109, 100]]
    # the same through the global trie (a finished request's output)
    d.finish(1, [0] + a + a[:7], 1)
    assert d.propose([DraftQuery(2, [7] + a[:7], 1, 4)]) == [[107, 108, 109, 100]]


# ---- the engine, greedy ----

class OracleDrafter(Drafter):
    """Proposes the reference continuation of each prompt, each draft token replaced by a random one with
    probability `noise` (seeded), so verifies accept every prefix length and reject at every position."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], noise: float, seed: int) -> None:
        self.refs, self.noise, self.rng = refs, noise, random.Random(seed)
        self.finished: list[int] = []

    def propose(self, queries):
        out = []
        for q in queries:
            full = self.refs[tuple(q.token_ids[:q.prompt_len])]
            n = len(q.token_ids)
            assert list(q.token_ids) == full[:n], "speculative output diverged from the reference"
            cont = full[n:n + self.rng.randint(1, q.max_tokens)]
            out.append([self.rng.randrange(VOCAB) if self.rng.random() < self.noise else t for t in cont])
        return out

    def finish(self, rid, token_ids, prompt_len):
        self.finished.append(rid)


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def arch(request, tmp_path_factory) -> Arch:
    ckpt = tiny_checkpoint(tmp_path_factory, request.param)
    return Arch(ckpt, load_model(ckpt, dtype="float32", progress=False))


@pytest.fixture(scope="module")
def k3_two_layers(tmp_path_factory) -> Arch:
    """The K3 tiny config cut to two layers (KDA, then MLA): the interpreter cases' cost is per layer."""
    ckpt = tiny_checkpoint(tmp_path_factory, "k3", two_layers=True)
    return Arch(ckpt, load_model(ckpt, dtype="float32", progress=False))


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _workload(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Round 1: a shared 80-token base with different tails (chunked with budget 64), a short prompt, a
    prompt of one repeated 12-gram (ngram drafts, mostly rejected), and a duplicate (n = 2). Round 2: exact
    repeats (prefix-cache hits; the suffix drafter's global trie knows their outputs) and a variant."""
    rng = random.Random(seed)
    base = _rand(rng, 80)
    gram = _rand(rng, 8)
    short = _rand(rng, 9)
    r1 = [base + _rand(rng, 5), base[:66] + _rand(rng, 20), short, gram * 6, short]
    r2 = [r1[0], r1[2], r1[3], base + _rand(rng, 3)]
    return r1, r2


def _params(n: int, max_tokens: int, stop: tuple[int, ...] = ()) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens - (i % 3) * 7, ignore_eos=True,
                           stop_token_ids=stop) for i in range(n)]


def _refs(prompts, outputs) -> dict[tuple[int, ...], list[int]]:
    """prompt -> prompt + its reference output (the longest, for a prompt asked with two max_tokens)."""
    refs: dict[tuple[int, ...], list[int]] = {}
    for p, o in zip(prompts, outputs):
        if len(p + o) > len(refs.get(tuple(p), ())):
            refs[tuple(p)] = p + o
    return refs


def _reference(arch: Arch, prompts, params) -> list[list[int]]:
    """Plain (non-speculative, cache-off) greedy outputs, memoized per architecture."""
    keys = [(tuple(p), sp) for p, sp in zip(prompts, params)]
    todo = list(dict.fromkeys(k for k in keys if k not in arch.outputs))
    if todo:
        eng = make_engine(arch.ckpt, runner="model", model=arch.model, enable_prefix_cache=False, num_pages=1024,
                          budget=2048)
        for k, o in zip(todo, run(eng, [list(p) for p, _ in todo], [sp for _, sp in todo])):
            arch.outputs[k] = o.output_ids
    return [arch.outputs[k] for k in keys]


def _spec_engine(arch: Arch, method: str, k: int = 4, adaptive: bool = False, **cache):
    cache = {"num_pages": 512, **cache}
    # ngram_min 1: a random model rarely repeats a bigram of its prompt, a single token often enough to verify.
    # adaptive False: these tests pin what verify steps do, so every step that can draft does (the controller's
    # choices follow wall time); the identity test also runs with it on
    return make_engine(arch.ckpt, runner="model", model=arch.model, budget=64,
                       engine={"spec": SpecConfig(method=method, num_tokens=k, ngram_min=1, adaptive=adaptive)},
                       **cache)


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle", "gated"])
def test_greedy_speculation_is_token_identical(arch, method) -> None:
    """gated: the oracle under the speculation controller, whose choices follow this machine's step times; the
    output must not depend on them."""
    r1, r2 = _workload(seed=3)
    p1, p2 = _params(len(r1), 24), _params(len(r2), 24)
    ref1, ref2 = _reference(arch, r1, p1), _reference(arch, r2, p2)
    gated = method == "gated"
    method = "oracle" if gated else method
    eng = _spec_engine(arch, "ngram" if method == "oracle" else method, adaptive=gated)
    if method == "oracle":
        eng.scheduler.drafter = OracleDrafter(_refs(r1 + r2, ref1 + ref2), noise=0.25, seed=1)
    mixed: set[str] = set()  # what verify runs shared a forward with
    execute = eng.runner.execute

    def spy(out):
        if any(c.draft_ids for c in out.chunks):
            mixed.update(["prefill"] * any(c.num_tokens > 1 for c in out.chunks) + ["decode"] * bool(out.decodes))
        return execute(out)

    eng.runner.execute = spy
    out1 = run(eng, r1, p1)
    out2 = run(eng, r2, p2)
    assert [o.output_ids for o in out1] == ref1
    assert [o.output_ids for o in out2] == ref2
    s = eng.stats
    if gated:
        # every step in which a request could draft was either speculated, skipped by the controller, or left
        # without drafts by the oracle's lookahead limits; the explorations drafted at least once
        assert s.spec_steps >= s.spec_steps_speculated + s.spec_steps_skipped and s.spec_steps_speculated > 0
        assert s.spec_accepted_tokens == sum(o.spec_accepted_tokens for o in out1 + out2)
        assert_at_rest(eng)
        return
    # the oracle drafts for every decode (so none stay plain); the others draft now and then
    assert ("prefill" in mixed) if method == "oracle" else ("decode" in mixed)
    assert s.spec_verifies > 0 and s.spec_drafted_tokens > 0
    assert s.spec_accepted_tokens == sum(o.spec_accepted_tokens for o in out1 + out2)
    assert sum(o.cached_tokens for o in out2) > 0  # the repeats hit the prefix cache
    if method != "ngram":
        assert s.spec_accepted_tokens > 0 and s.spec_tau > 1.0
    assert assert_snapshots_exact(eng, arch) > 0
    assert_at_rest(eng)


@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_stop_ids_and_max_tokens_inside_an_accepted_run(arch) -> None:
    """Stop ids taken from the middle of the reference outputs end the run there: the oracle drafts past them."""
    r1, _ = _workload(seed=3)
    plain = _params(len(r1), 24)
    ref = _reference(arch, r1, plain)
    stops = (ref[0][6], ref[3][11])
    params = _params(len(r1), 24, stop=stops)
    ref_stop = _reference(arch, r1, params)
    assert len(ref_stop[0]) <= 7 and len(ref_stop[3]) <= 12
    eng = _spec_engine(arch, "ngram", k=6)
    # drafts continue past the stop token
    eng.scheduler.drafter = OracleDrafter(_refs(r1, ref), noise=0.0, seed=2)
    out = run(eng, r1, params)
    assert [o.output_ids for o in out] == ref_stop
    assert [o.finish_reason for o in out][:1] == ["stop"]
    assert all(len(o.output_ids) <= p.max_tokens for o, p in zip(out, params))
    assert eng.stats.spec_accepted_tokens > 0
    assert assert_snapshots_exact(eng, arch) > 0  # end-of-request snapshots sit at the truncated end
    assert_at_rest(eng)


def test_preemption_mid_speculation_on_a_tiny_poisoned_pool(arch) -> None:
    r1, r2 = _workload(seed=3)
    prompts = r1 + r2
    params = _params(len(r1), 24) + _params(len(r2), 24)
    ref = _reference(arch, prompts, params)
    eng = _spec_engine(arch, "ngram", k=5, num_pages=14, poison_freed=True)
    eng.scheduler.drafter = OracleDrafter(_refs(prompts, ref), noise=0.2, seed=3)
    out = run(eng, prompts, params)
    assert [o.output_ids for o in out] == ref
    assert eng.stats.preemptions > 0 and eng.stats.spec_accepted_tokens > 0
    assert_snapshots_exact(eng, arch)
    assert_at_rest(eng)


@pytest.mark.parametrize("arch", ["kimi_linear"], indirect=True)
def test_abort_mid_speculation_releases_everything(arch) -> None:
    prompts = [_rand(random.Random(9), 40), _rand(random.Random(10), 20)]
    params = _params(2, 30)
    ref = _reference(arch, prompts, params)
    eng = _spec_engine(arch, "ngram", k=4)
    drafter = OracleDrafter(_refs(prompts, ref), noise=0.1, seed=4)
    eng.scheduler.drafter = drafter
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        eng.step()
        eng.check()
    assert any(c.draft_ids for c in eng.scheduler._chunks.values())
    eng.abort(rids[0])
    done = drain(eng)
    assert done[rids[0]].finish_reason == "abort" and done[rids[1]].output_ids == ref[1]
    assert sorted(drafter.finished) == sorted(rids)
    assert_at_rest(eng)


@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_opt_out_and_sampling_rows_follow_the_plain_path(arch) -> None:
    """speculative=False requests never get a verify; penalties apply at every verified position."""
    prompts = [_rand(random.Random(11), 30)] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, speculative=False)]
    ref = _reference(arch, prompts, params)
    eng = _spec_engine(arch, "ngram")
    eng.scheduler.drafter = OracleDrafter({tuple(prompts[0]): prompts[0] + ref[0]}, noise=0.0, seed=5)
    out = run(eng, prompts, params)
    assert [o.output_ids for o in out] == ref
    assert out[0].spec_accepted_tokens > 0 and out[1].spec_accepted_tokens == 0


def test_suffix_drafter_tau_on_a_repetitive_workload(arch) -> None:
    """The same requests again (an agent loop re-asking): the suffix drafter's global trie drafts the
    earlier outputs, and tau (tokens per verify) is well above 1."""
    rng = random.Random(13)
    prompts = [_rand(rng, 20) for _ in range(3)]
    params = _params(3, 30)
    eng = _spec_engine(arch, "suffix", k=6)
    first = run(eng, prompts, params)
    before = (eng.stats.spec_verifies, eng.stats.spec_accepted_tokens)
    second = run(eng, prompts, params)
    assert [o.output_ids for o in second] == [o.output_ids for o in first]
    verifies = eng.stats.spec_verifies - before[0]
    tau = (eng.stats.spec_accepted_tokens - before[1] + verifies) / verifies
    assert tau > 3.0, tau
    stats = eng.stats_dict()
    assert stats["spec_accepted_tokens"] == eng.stats.spec_accepted_tokens
    assert stats["spec_drafted_tokens"] >= stats["spec_accepted_tokens"] > 0


# ---- temperature > 0: the verifier is lossless ----

def _chi2_pvalue(observed: list[int], expected: list[float]) -> float:
    """Pearson's chi-square goodness of fit (cells with expected >= 5), -> p-value."""
    cells = [(o, e) for o, e in zip(observed, expected) if e >= 5]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


class _Row:
    """The request fields the verifier reads."""

    def __init__(self, params: SamplingParams, gen: torch.Generator | None, output: list[int]) -> None:
        from k3rt.backend.scheduler.request import SampleState

        self.params, self.generator = params, gen
        self.prompt_len = 2
        self.token_ids = [1, 2] + output
        self.stop_ids, self.grammar, self.sampled = frozenset(), None, SampleState()

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, max_tokens=64),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, max_tokens=64),
    SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2,
                   max_tokens=64),
], ids=["temperature", "top-k-top-p", "penalties"])
def test_rejection_sampling_matches_the_target_distribution(params) -> None:
    V, N = 8, 6000
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(3, V, generator=gen) * 1.5  # rows: after the output, after d1, after d1 d2
    sampler = Sampler(V, "cpu")
    output = [3, 6]  # penalties see these, then the drafts
    # d1: row 0's likeliest token (accepted often enough to test row 1 given it); d2: row 1's raw argmax
    p0 = sampler.target_probs(sampler.process(logits[:1], [params], [[1, 2]], [output]), [params])[0]
    drafts = [int(p0.argmax()), int(logits[1].argmax())]
    reqs = [_Row(params, gen, list(output)) for _ in range(N)]
    res = verify_requests(sampler, logits.repeat(N, 1), reqs, [drafts] * N)
    # the exact per-row distributions a plain decode step would draw from
    hists = [output, output + drafts[:1], output + drafts]
    x = sampler.process(logits, [params] * 3, [[1, 2]] * 3, hists)
    p = sampler.target_probs(x, [params] * 3)
    first = Counter(r.token_ids[0] for r in res)
    assert _chi2_pvalue([first[t] for t in range(V)], (N * p[0]).tolist()) > 1e-4
    # given d1 was accepted, the next token follows row 1
    acc = [r for r in res if r.token_ids[0] == drafts[0]]
    assert len(acc) > 200
    second = Counter(r.token_ids[1] for r in acc)
    assert _chi2_pvalue([second[t] for t in range(V)], (len(acc) * p[1]).tolist()) > 1e-4
    # accepted counts agree with the emitted tokens
    for r in res:
        assert r.num_accepted == next((i for i, (a, b) in enumerate(zip(r.token_ids, drafts)) if a != b),
                                      min(len(r.token_ids), 2))
        assert len(r.token_ids) == min(r.num_accepted + 1, 3)
    # and the plain sampler, drawing row 0 directly, agrees with the same distribution (the baseline)
    plain = sampler.sample_batch(logits[:1].repeat(N, 1), [params] * N, [gen] * N, [[1, 2]] * N, [output] * N)
    base = Counter(plain.token_ids)
    assert _chi2_pvalue([base[t] for t in range(V)], (N * p[0]).tolist()) > 1e-4


def test_a_wrong_distribution_is_detected() -> None:
    """The chi-square check has power: samples of row 1 are rejected as draws of row 0."""
    V, N = 8, 6000
    gen = torch.Generator().manual_seed(99)
    logits = torch.randn(2, V, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(V, "cpu")
    p = sampler.target_probs(logits, [params] * 2)
    draws = sampler.sample_batch(logits[1:].repeat(N, 1), [params] * N, [gen] * N, [()] * N, [()] * N).token_ids
    c = Counter(draws)
    assert _chi2_pvalue([c[t] for t in range(V)], (N * p[0]).tolist()) < 1e-6


def test_greedy_verification_and_logprobs() -> None:
    V = 8
    logits = torch.full((3, V), -2.0)
    logits[0, 3], logits[1, 4], logits[2, 1] = 5.0, 5.0, 5.0
    sampler = Sampler(V, "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)
    r = _Row(params, None, [])
    [res] = verify_requests(sampler, logits, [r], [[3, 6]])
    assert res.token_ids == [3, 4] and res.num_accepted == 1
    assert len(res.logprobs) == 2 and res.top_logprobs[0][0][0] == 3 and res.top_logprobs[1][0][0] == 4
    # all accepted: a bonus token from the last row; max_tokens cuts the run
    [res] = verify_requests(sampler, logits, [_Row(params, None, [])], [[3, 4]])
    assert res.token_ids == [3, 4, 1] and res.num_accepted == 2
    short = SamplingParams(temperature=0.0, max_tokens=2)
    [res] = verify_requests(sampler, logits, [_Row(short, None, [])], [[3, 4]])
    assert res.token_ids == [3, 4] and res.num_accepted == 2


# ---- grammar ----

def test_grammar_constrained_output_is_the_same_with_speculation(tmp_path_factory) -> None:
    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    grammar = {"kind": "regex", "payload": "(ab|cd)[0-9]{4}(xy|zw){2}", "strict": True}
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = {}
    for method in (None, "ngram"):
        eng = Engine(replace(engine_config_for_tests(str(ckpt), num_pages=64), runner="model",
                             spec=SpecConfig(method=method, num_tokens=4, adaptive=False)))
        if method is not None:
            ref = outs[None]
            # drafts: the true continuation with a wrong token in the middle, which the grammar cuts
            eng.scheduler.drafter = _GrammarProbe({tuple(p): p + o for p, o in zip(prompts, ref)})
        rids = [eng.add_request(p, params, grammar=grammar) for p in prompts]
        done = {}
        while eng.has_unfinished:
            for o in eng.step():
                if o.finished:
                    done[o.rid] = o
            eng.check()
        outs[method] = [done[r].output_ids for r in rids]
        assert all(done[r].error is None and done[r].finish_reason == "stop" for r in rids)
        if method is not None:
            assert eng.stats.spec_accepted_tokens > 0
            # the spliced-in token and what follows it were never verified
            assert 0 < eng.stats.spec_drafted_tokens < eng.scheduler.drafter.proposed
    assert outs["ngram"] == outs[None]


class _GrammarProbe(Drafter):
    """The reference continuation with token 0 (never allowed by the regex) spliced in at draft position 2."""

    def __init__(self, refs) -> None:
        self.refs, self.proposed = refs, 0

    def propose(self, queries):
        out = []
        for q in queries:
            full = self.refs[tuple(q.token_ids[:q.prompt_len])]
            cont = full[len(q.token_ids):len(q.token_ids) + q.max_tokens]
            out.append(cont[:2] + [0] + cont[2:] if len(cont) > 2 else cont)
            self.proposed += len(out[-1])
        return out


def test_grammar_prefix_cuts_at_the_first_refused_draft(tmp_path_factory) -> None:
    from k3rt.backend.grammar import GrammarSpec, create_grammar_backend
    from k3rt.backend.scheduler.scheduler import _grammar_prefix
    from k3rt.backend.tokenizer import load_tokenizer

    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    tok = load_tokenizer(ckpt)
    backend = create_grammar_backend("llguidance", tok, vocab_size=VOCAB)
    m = backend.compile(GrammarSpec.regex("abc[0-9]")).matcher()
    ids = [tok.encode(c)[0] for c in "abc7"]
    bad = tok.encode("z")[0]
    assert _grammar_prefix(m, ids[:2] + [bad] + ids[2:]) == ids[:2]
    assert _grammar_prefix(m, ids) == ids
    for t in ids:  # the matcher is back at the start
        assert m.accept(t)
    assert m.is_terminated()


class _TableDrafter(Drafter):
    """Drafts from a table: (output so far) -> next tokens, e.g. the most frequent plain continuations."""

    def __init__(self, table: dict[tuple[int, ...], list[int]]) -> None:
        self.table = table

    def propose(self, queries):
        return [self.table.get(tuple(q.token_ids[q.prompt_len:]), [])[:q.max_tokens] for q in queries]


def _homogeneity_pvalue(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test that two samples come from one distribution (cells with fewer than 20
    observations together are pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] >= 20:
            cells.append((a[key], b[key]))
        else:
            pooled[0] += a[key]
            pooled[1] += b[key]
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_outputs_have_the_plain_distribution_end_to_end(k3_two_layers) -> None:
    """temperature 1, top-k 3: the joint distribution of generated tokens 2 to 4 (token 1 comes from the
    prefill; 2 and 3 are drafted and verified, 4 is a bonus or comes from a later step) is the same with and
    without speculation. Drafts are the most frequent plain continuations, so they are accepted often and
    rejected often. Seeds are fixed per request, so the test is deterministic. The K3 model cut to two layers
    (its cost is per layer, per request: 600 prefills of each engine): verification's sampling does not depend on
    the depth of the model that made the logits, and the sample count, hence the test's power, is unchanged."""
    arch = k3_two_layers
    n = 600
    prompt = _rand(random.Random(17), 6)
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    plain_eng = make_engine(arch.ckpt, runner="model", model=arch.model, num_pages=1024, budget=2048)
    plain = [tuple(o.output_ids) for o in run(plain_eng, [prompt] * n, params)]
    follow: dict[tuple[int, ...], Counter] = {}
    for out in plain:
        for j in (1, 2):
            follow.setdefault(out[:j], Counter())[out[j]] += 1
    table = {}
    for (t1,), c in [(k, v) for k, v in follow.items() if len(k) == 1]:
        t2 = c.most_common(1)[0][0]
        nxt = follow.get((t1, t2))
        table[(t1,)] = [t2] + ([nxt.most_common(1)[0][0]] if nxt else [])
    eng = make_engine(arch.ckpt, runner="model", model=arch.model, num_pages=1024, budget=2048,
                      engine={"spec": SpecConfig(method="ngram", num_tokens=2, adaptive=False)})
    eng.scheduler.drafter = _TableDrafter(table)
    spec = [tuple(o.output_ids) for o in run(eng, [prompt] * n, [replace(p, seed=p.seed + n) for p in params])]
    s = eng.stats
    assert s.spec_verifies > n // 2 and 0.2 * s.spec_drafted_tokens < s.spec_accepted_tokens < s.spec_drafted_tokens
    for part in (slice(1, 3), slice(1, 4), slice(3, 4), slice(0, 1)):
        assert _homogeneity_pvalue(Counter(o[part] for o in plain), Counter(o[part] for o in spec)) > 1e-3, part
    # and the test has power: the plain tokens 2-3 against the spec tokens 1-2 are told apart
    assert _homogeneity_pvalue(Counter(o[1:3] for o in plain), Counter(o[:2] for o in spec)) < 1e-6


# ---- the GPU runner's path (torch ops on the CPU; the Triton kernels in the interpreter; CUDA) ----

GPU_PATHS = [
    pytest.param({"runner": "gpu", "kernels": False, "cuda_graphs": False}, id="gpu-path-torch-ops"),
    # the padded form the verify graphs replay (verify_graph.py), run eagerly with torch ops
    pytest.param({"runner": "gpu", "kernels": False, "cuda_graphs": False, "verify_form": True},
                 id="gpu-path-torch-ops-verify-form"),
    pytest.param({"runner": "gpu", "kernels": True, "cuda_graphs": False}, id="gpu-path-triton-interpreter",
                 marks=pytest.mark.slow),
    # KernelConfig.kda_verify_launch = "multi" (the default): the verify pass and commit in one launch each
    pytest.param({"runner": "gpu", "kernels": True, "cuda_graphs": False, "verify_form": True,
                  "kda_verify_launch": "multi"}, id="gpu-path-triton-interpreter-verify-form-multi"),
    # the same with "decode_loop": R decode launches through scratch states, R more for the commit
    pytest.param({"runner": "gpu", "kernels": True, "cuda_graphs": False, "verify_form": True,
                  "kda_verify_launch": "decode_loop"}, id="gpu-path-triton-interpreter-verify-form-decode-loop",
                 marks=pytest.mark.slow),
    # the verify and commit graphs captured with each kda_verify_launch (fp32 model): the eager tokens
    pytest.param({"runner": "gpu", "device": "cuda", "kda_verify_launch": "multi"}, id="gpu-runner-cuda-multi",
                 marks=pytest.mark.gpu),
    pytest.param({"runner": "gpu", "device": "cuda", "kda_verify_launch": "decode_loop"},
                 id="gpu-runner-cuda-decode-loop", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("over", GPU_PATHS)
def test_gpu_runner_verify_steps_are_token_identical(arch, over, monkeypatch, request) -> None:
    """Verify chunks through the GPU runner (packed logit rows, states left alone, kda_commit replay),
    mixed with plain decodes and prefill chunks: the reference's greedy tokens, and exact snapshots."""
    import copy

    model = arch.model
    if over.get("device") == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        model = copy.deepcopy(arch.model).cuda()
    elif over.get("kernels") and torch.cuda.is_available():
        pytest.skip("on a GPU the compiled kernels are tested (gpu-runner-cuda)")
    elif over.get("kernels") and arch.model.cfg.kda.gate_lower_bound is None:
        # ~1 min per architecture in the interpreter: the K3 one (every kernel the other uses, and more)
        pytest.skip("the interpreter runs the K3 architecture only")
    if over.get("kernels") and over.get("device") != "cuda":
        arch = request.getfixturevalue("k3_two_layers")
        model = arch.model
    r1, r2 = _workload(seed=3)
    prompts, params = r1[:4] + r2[-1:], _params(4, 24) + _params(1, 24)
    if over.get("kernels") and over.get("device") != "cuda":
        prompts, params = [r1[2], r1[3]], [replace(p, max_tokens=8) for p in _params(2, 24)]
        if over.get("verify_form"):  # one request, a few verify steps: the interpreter's time is per step
            prompts, params = prompts[:1], [replace(params[0], max_tokens=5)]
    ref = _reference(arch, prompts, params)
    engine = {k: v for k, v in over.items() if k not in ("runner", "verify_form", "kda_verify_launch")}
    eng = make_engine(arch.ckpt, runner="gpu", model=model, budget=64, num_pages=256,
                      engine=engine | {"spec": SpecConfig(method="ngram", num_tokens=4, adaptive=False)})
    inner = eng.runner.inner
    multi_calls = []  # (commit,) of each kda_decode_multi launch
    if "kda_verify_launch" in over:
        import k3rt.kernels.kda as kda_ops
        from k3rt.kernels.kda.triton_multi import kda_decode_multi

        inner.kernels = inner.fwd.k = replace(inner.fwd.k, kda_verify_launch=over["kda_verify_launch"])
        monkeypatch.setattr(kda_ops, "kda_decode_multi", lambda *a, **kw: (multi_calls.append(kw["commit"])
                                                                            or kda_decode_multi(*a, **kw)))
        if over.get("device") == "cuda":  # the engine captured its graphs with the default: again with this one
            inner.capture()
    padded_form = over.get("verify_form") or over.get("device") == "cuda"
    if over.get("verify_form"):  # what the engine sets up on CUDA (spec_graph_sizes), here without capture
        inner.verify_run_len, inner.verify_sizes = 5, (1, 2, 4)
        inner.fwd.reserve_verify_inputs(4 * 5)  # the buffers the graphs share (the kernels' form copies into them)
    elif padded_form:
        assert sorted(inner.verify_graphs) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    eng.scheduler.drafter = OracleDrafter(_refs(prompts, ref), noise=0.25, seed=6)
    if padded_form and len(prompts) > 1:  # some decodes stay plain, so verify-form steps mix them (each one
        eng.scheduler.drafter = _SomePlain(_refs(prompts, ref), noise=0.25, seed=6)  # committed with one token)
    elif padded_form:  # the interpreter's one request: noisier drafts, so its few verifies reject some
        eng.scheduler.drafter = OracleDrafter(_refs(prompts, ref), noise=0.5, seed=2)
    split_verify = []  # eager kernel steps: split (issue 18) with verify runs among the rest?
    if over.get("kernels") and not padded_form:  # one request plain, so the steps split around the other's runs
        eng.scheduler.drafter = _FirstPlain(_refs(prompts, ref), noise=0.25, seed=6)
        build = inner._build

        def recording_build(seqs, extra):
            step = build(seqs, extra)
            split_verify.append(step.kda_split is not None and bool(step.kda_split.rest.verify_seqs))
            return step
        inner._build = recording_build
    if padded_form:
        forms, run_verify = [], inner._run_verify
        inner._run_verify = lambda seqs, size, *rest: (forms.append([s.verify for s in seqs])
                                                       or run_verify(seqs, size, *rest))
    out = run(eng, prompts, params)
    assert [o.output_ids for o in out] == ref
    assert eng.stats.spec_accepted_tokens > 0 and eng.stats.spec_drafted_tokens > eng.stats.spec_accepted_tokens
    assert any(split_verify) or not over.get("kernels") or padded_form, split_verify
    if padded_form:
        assert forms and all(any(f) for f in forms), forms
        if not (over.get("kernels") and over.get("device") != "cuda"):  # the interpreter's run is too short to mix
            assert any(False in f and True in f for f in forms) and sum(map(len, forms)) > 10, forms
        assert inner.verify_graph_replays == (len(forms) if over.get("device") == "cuda" else 0)
    if over.get("kda_verify_launch") == "multi":  # both the verify pass and the commit took the one launch
        assert True in multi_calls and False in multi_calls, multi_calls
    elif "kda_verify_launch" in over:
        assert not multi_calls, multi_calls
    if over.get("device") != "cuda":
        assert assert_snapshots_exact(eng, arch) > 0


class _FirstPlain(OracleDrafter):
    """The oracle's drafts for every request but the first (the lowest rid), which decodes plainly."""

    def propose(self, queries):
        first = min(q.rid for q in queries)
        return [d if q.rid != first else [] for q, d in zip(queries, super().propose(queries))]


class _SomePlain(OracleDrafter):
    """The oracle's drafts for two requests in three (by rid and length); the others decode plainly."""

    def propose(self, queries):
        return [d if (q.rid + len(q.token_ids)) % 3 else [] for q, d in zip(queries, super().propose(queries))]


def test_spec_graph_buckets_follow_the_config() -> None:
    """Which batch buckets get verify and drafter graphs: the decode graph sizes up to 64, and none whenever a
    switch or the setting rules them out (the engine gives the runner and the drafter this one answer)."""
    from k3rt.backend.runner.gpu.runner import spec_graph_sizes
    from k3rt.config import EngineConfig, SchedulerConfig

    on = EngineConfig(model="k3-tiny", device="cuda", runner="gpu", spec=SpecConfig(method="ngram", num_tokens=7),
                      scheduler=SchedulerConfig(max_running=100))
    assert spec_graph_sizes(on) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert spec_graph_sizes(replace(on, scheduler=SchedulerConfig(max_running=10))) == (1, 2, 4, 8, 16)
    for off in ({"cuda_graphs": False}, {"spec": SpecConfig()}, {"deterministic": True}, {"kernels": False},
                {"spec": SpecConfig(method="ngram", cuda_graphs=False)}, {"device": "cpu", "kernels": False}):
        assert spec_graph_sizes(replace(on, **off)) == (), off


def test_verify_graph_plan_pads_without_leaking() -> None:
    """The verify graphs' padding plan (verify_graph.py), on the host: real rows are packed exactly as the eager
    step packs them; every padding row writes its MLA latent into the pad page (never a page a request owns,
    never past its table) at its request's last real position; pad sequences use only the pad page; the
    sampler reads the real rows in the eager order; and the packed sizes depend on the bucket only."""
    bs, R, pad_page = 4, 4, 99
    seqs = [StepSeq([5], 6, [1, 2], [7, 8], True),  # a plain decode at position 6
            StepSeq([5, 6, 7], 3, [3, 4], [9, 10], True, verify=True),  # 2 drafts, positions 3..5 across pages
            StepSeq([1, 2, 3, 4], 8, [4, 5, 6], [11, 12], True, verify=True)]  # K = 3 drafts: no padding row
    pad = StepSeq([0], 0, [pad_page], [pad_page] * 2, True)
    padded, plan = plan_verify(seqs, 4, R, pad)
    kw = dict(block_size=bs, conv_width=4, num_groups=2, max_blocks=8)
    meta, (h64, h32) = pack_step(padded, row_queries=True, **kw)
    pad_rows(meta, h64, plan, pad_page * bs)
    step = step_views(meta, h64, h32)
    eager_meta, eager_host = pack_step(seqs, **kw)
    eager = step_views(eager_meta, *eager_host)
    fed = torch.tensor(plan.fed_rows)
    for name in ("ids", "pos", "kv_slot"):
        assert getattr(step, name)[fed].tolist() == getattr(eager, name).tolist(), name
    padding = torch.ones(16, dtype=torch.bool)
    padding[fed] = False
    assert padding.sum() == 16 - 8
    assert (step.kv_slot[padding] == pad_page * bs).all()  # padding rows write nothing any request reads
    last = torch.tensor([6, 5, 11, 0])  # each sequence's last real position (pad sequences: 0)
    pos = step.pos.view(4, R)
    assert (pos[padding.view(4, R)] == last[:, None].expand(4, R)[padding.view(4, R)]).all()
    assert (pos // bs < torch.tensor([2, 2, 3, 1])[:, None]).all()  # no query reaches past its own table
    assert step.state_pages.tolist() == [[7, 9, 11, pad_page], [8, 10, 12, pad_page]]
    assert step.block_table[3, 0] == pad_page and step.row_seq.tolist() == [i for i in range(4) for _ in range(R)]
    assert step.verify_seqs == [0, 1, 2, 3] and not step.prefill_seqs and step.logits_every_row
    assert plan.logit_rows == (0, 4, 5, 6, 8, 9, 10, 11)  # the plain decode's row, then the verify rows
    assert len(plan.logit_rows) == eager.logit_rows.numel()
    # what the graph's static buffers need: the same sizes whatever the requests (here: one pad request)
    only_pad, pad_plan = plan_verify([pad], 4, R, pad)
    other, _ = pack_step(only_pad, row_queries=True, **kw)
    assert (other.sizes64, other.sizes32) == (meta.sizes64, meta.sizes32) and pad_plan.real_lens == (1,) * 4
    with pytest.raises(ValueError, match=r"seqs\[0\]: a verify graph row runs 1..4"):
        plan_verify([StepSeq([1] * 5, 0, [1, 2], [7, 8], True, verify=True)], 4, R, pad)
    with pytest.raises(ValueError, match="seqs: a verify graph of batch 2 takes 1..2"):
        plan_verify(seqs, 2, R, pad)


def test_shipped_model_bf16_greedy_identity_and_tau() -> None:
    """The shipped k3-tiny (bf16, trained: its code completions repeat themselves): speculative greedy output
    equals plain output token for token (verify rows compute as decode rows do; bf16 exposes any difference
    in rounding), and prompt lookup accepts well over one token per verify."""
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.config import EngineConfig
    from k3rt.models import resolve_model_dir

    model_dir = resolve_model_dir("k3-tiny")
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode_prompt(p) for p in ("def fibonacci(n):", "def quicksort(xs):", "def is_prime(n):")]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    outs, taus = {}, {}
    for method in (None, "ngram", "suffix"):
        eng = Engine(EngineConfig(model=str(model_dir), spec=SpecConfig(method=method, num_tokens=4, adaptive=False)))
        outs[method] = [o.output_ids for o in eng.generate(prompts, params)]
        taus[method] = eng.stats.spec_tau
        eng.check()
    assert outs["ngram"] == outs[None] and outs["suffix"] == outs[None]
    assert taus["ngram"] > 2.0 and taus["suffix"] > 1.3, taus


@pytest.mark.parametrize("num_pages", [400, 10], ids=["roomy", "tight-preempting"])
def test_lookahead_pages_across_page_boundaries_with_the_null_runner(tmp_path_factory, num_pages) -> None:
    """Null runner (no compute): verify runs cross page boundaries (block 48) at every offset; lookahead
    pages come from free memory only; page accounting (Engine.check) holds after every step, and the tokens
    equal the plain run's. On a tight pool drafts shrink to the pages there are and requests are preempted."""
    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    rng = random.Random(21)
    prompts = [_rand(rng, n) for n in (1, 40, 47, 48, 49, 95, 100)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (60, 9, 50, 2, 49, 30, 57)]
    plain = run(make_engine(ckpt, num_pages=num_pages), prompts, params)
    eng = make_engine(ckpt, num_pages=num_pages,
                      engine={"spec": SpecConfig(method="ngram", num_tokens=7, adaptive=False)})
    eng.scheduler.drafter = NullOracle(eng.runner.inner)
    out = run(eng, prompts, params)
    assert [o.output_ids for o in out] == [o.output_ids for o in plain]
    s = eng.stats
    assert s.spec_accepted_tokens == s.spec_drafted_tokens > 0 and s.spec_tau > 4
    crossed = {(c.start // 48, (c.start + c.num_tokens + 7) // 48) for st in eng.runner.steps for c in st.chunks}
    assert any(a != b for a, b in crossed)
    if num_pages == 10:
        assert s.preemptions > 0
    assert_at_rest(eng)


def test_cli_generate_with_spec(tmp_path_factory, capsys) -> None:
    """`k3rt generate --spec suffix --spec-tokens 3 --json`: the plain greedy tokens, and the spec counters."""
    from k3rt.cli import main

    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    args = ["generate", "--model", str(ckpt), "--prompt", "abc abc abc abc", "--max-tokens", "16",
            "--ignore-eos", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--spec", "suffix", "--spec-tokens", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 16
    assert set(spec["spec"]) == {"drafted_tokens", "accepted_tokens", "verifies", "tau", "steps_speculated",
                                 "steps_skipped"}
    # without the controller no step is skipped
    assert main(args + ["--spec", "suffix", "--spec-tokens", "3", "--no-spec-adaptive"]) == 0
    always = json.loads(capsys.readouterr().out)
    assert always["token_ids"] == plain["token_ids"] and always["spec"]["steps_skipped"] == 0
    with pytest.raises(SystemExit):  # argparse: not one of the drafters
        main(args + ["--spec", "eagle"])


def test_a_failing_drafter_costs_only_speculation(tmp_path_factory) -> None:
    class Broken(Drafter):
        def propose(self, queries):
            raise RuntimeError("drafter bug")

    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    prompts = [_rand(random.Random(5), 12)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    plain = run(make_engine(ckpt), prompts, params)
    eng = make_engine(ckpt, engine={"spec": SpecConfig(method="ngram", adaptive=False)})
    eng.scheduler.drafter = Broken()
    assert [o.output_ids for o in run(eng, prompts, params)] == [o.output_ids for o in plain]
    assert eng.stats.spec_verifies == 0


@pytest.mark.parametrize("kw, field", [({"method": "eagle"}, "spec"), ({"num_tokens": 17}, "spec_tokens"),
                                       ({"num_tokens": 0}, "spec_tokens"), ({"ngram_min": 3, "ngram_max": 2}, "ngram_min")],
                         ids=["method", "too-many", "zero", "ngram-range"])
def test_spec_config_errors_name_the_field(kw, field) -> None:
    with pytest.raises(ValueError, match=field):
        SpecConfig(**kw)


@pytest.mark.parametrize("arch", ["k3"], indirect=True)
def test_min_tokens_requests_speculate_only_after_their_minimum(arch) -> None:
    """min_tokens bans stop tokens per sampled position; a verify run would sample several positions at once,
    so a request under its minimum decodes plainly. With the first output tokens as stop ids and min_tokens
    past them, the speculative output equals the plain one (the oracle would draft right through them)."""
    r1, _ = _workload(seed=3)
    ref = _reference(arch, r1, _params(len(r1), 24))
    stops = (ref[0][2],)
    params = [replace(p, stop_token_ids=stops, min_tokens=8) for p in _params(len(r1), 24)]
    want = _reference(arch, r1, params)
    eng = _spec_engine(arch, "ngram", k=6)
    eng.scheduler.drafter = OracleDrafter(_refs(r1, ref), noise=0.0, seed=2)
    verified_early = []
    execute = eng.runner.execute

    def spy(out):
        verified_early.extend(c.req.num_output < c.req.params.min_tokens for c in out.chunks if c.draft_ids)
        return execute(out)

    eng.runner.execute = spy
    out = run(eng, r1, params)
    assert [o.output_ids for o in out] == want
    assert verified_early and not any(verified_early)  # verify runs happened, none under min_tokens
    assert_at_rest(eng)


def test_speculation_with_tensor_parallelism_is_refused_by_name(tmp_path) -> None:
    from k3rt.config import EngineConfig

    with pytest.raises(ValueError, match="spec: speculative decoding runs at tp=1 only"):
        EngineConfig(model=str(tmp_path), tp=2, spec=SpecConfig(method="ngram"))


def test_spec_verify_benchmark_smoke(tmp_path) -> None:
    """benchmarks/spec_verify.py --smoke (tiny config, CPU, torch ops): its correctness checks pass (the padded
    verify form's logits equal the eager verify step's, neither touches the live states) and every row has its
    times and bytes floors."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "spec_verify.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "spec_verify.py"), "--smoke", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for v in ("decode_loop", "multi") for b in (1, 2)]
    assert all(r["correct"] for r in rows)
    for r in rows:
        assert r["verify_graph_rel_err"] < 1e-5 and r["verify_argmax_agree"] == 1.0 and r["commit_graph_rel_err"] < 1e-5
        assert r["verify_eager_ms"] > 0 and r["commit_ms"] > 0 and r["plain_eager_ms"] > 0
        assert r["verify_bytes"]["total"] > r["plain_bytes"]["total"] > 0 and r["floor_ratio"] > 1


def test_spec_upkeep_benchmark_smoke(tmp_path) -> None:
    """benchmarks/spec_upkeep.py --smoke (CPU, null runner): a row per engine and batch with its decode-step times,
    the host's state and a by-function profile; the governor held off ('-off') speculates in no step."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "spec_upkeep.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "spec_upkeep.py"), "--smoke", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [(e, b) for e in ("plain", "suffix", "suffix-off")
                                                         for b in (1, 8)]
    for r in rows:
        assert r["steps"] > 0 and 0 < r["step_ms_median"] <= r["step_ms_p90"] and r["top"]
        assert len(r["gc_collections"]) == 3 and r["cpu_over_wall"] > 0
    assert all(r["speculated_steps"] == 0 for r in rows if r["engine"] in ("plain", "suffix-off"))
