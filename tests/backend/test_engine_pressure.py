"""The engine under pressure (issue 15): each bug that was observed, pinned as a regression test.

1. pins: an Unpin that arrives before the engine applied the abort (a stop string ends a pinned gen:
   the abort and, when the program ends, the Unpin land in the same drain) left a pin forever; an
   aborted pinned request was pinned; pins filling the pool stalled every later request (waiting=1,
   running=0, the engine spinning) and flush_cache left them; a program cancelled mid-gen never sent
   Unpin (its rid was recorded after `generate` returned).
2. self-preemption: admission checked only the first block's pages, then the first chunk preempted the
   request just admitted, every step, even when a smaller chunk fitted; a request of exactly the pool's
   size was let in when some pages can never be freed (the GPU runner's reserved page).
3. in-batch prefix sharing: the junction a waiter asked for was added to the sharer's plan after the
   sharer's chunk of this step was built, popped unpublished, and the waiter recomputed the prefix.
4. full-block mode: snapshot positions on a grid of block_size (48, 1888, ...) fell inside KDA chunks
   and `kda_chunk_fwd` raised.
5. preemption threw the live state away: a preempted decoding request recomputed all of its output.
6. cache_salt roots were never deleted; every eviction walked every root.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from k3rt.protocol import GenerateRequest, params_to_dict
from k3rt.sampling_params import SamplingParams
from k3rt.backend.request_map import RequestMap
from tests.backend.engine_fixtures import assert_at_rest, greedy, make_engine, run, snapshot_nodes, tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def gen_msg(name: str, prompt: list[int], max_tokens: int, *, pin: bool = False) -> GenerateRequest:
    return GenerateRequest(name, prompt, params_to_dict(greedy(max_tokens)), pin=pin)


def drive(rm: RequestMap, limit: int = 2000) -> list:
    updates = []
    for _ in range(limit):
        if not rm.engine.has_unfinished:
            return updates
        updates += rm.step()
        rm.engine.check()
    raise AssertionError(f"engine did not finish within {limit} steps")


# ---- 1. pins ----

def test_regression_unpin_before_the_abort_is_applied_leaves_no_pin(ckpt):
    eng = make_engine(ckpt, num_pages=64)
    rm = RequestMap(eng)
    rng = random.Random(1)
    assert rm.add(gen_msg("a", rand_tokens(rng, 40), 50, pin=True)) is None
    rm.step()
    rm.step()
    # a stop string ended the gen: the gateway aborts it, and the program's end unpins it, in one drain
    rm.abort("a")
    rm.unpin("a")
    drive(rm)
    assert eng.num_pins == 0 and not rm.pinned
    assert_at_rest(eng)


def test_regression_an_aborted_pinned_request_is_not_pinned(ckpt):
    eng = make_engine(ckpt, num_pages=64)
    rm = RequestMap(eng)
    assert rm.add(gen_msg("a", list(range(3, 60)), 50, pin=True)) is None
    rm.step()
    rm.abort("a")  # a program cancelled mid-gen
    drive(rm)
    assert eng.num_pins == 0 and not rm.pinned  # nobody will ever unpin it: it must not be pinned
    # a pinned request that finished normally keeps its pin until Unpin, and Unpin releases it
    assert rm.add(gen_msg("b", list(range(3, 60)), 3, pin=True)) is None
    drive(rm)
    assert eng.num_pins == 1 and set(rm.pinned) == {"b"}
    rm.unpin("b")
    assert eng.num_pins == 0 and not rm.pinned
    assert_at_rest(eng)


def test_regression_pins_filling_the_pool_never_stall_the_engine(ckpt):
    """Pins used to hold every page: a plain 1-token request then waited forever while the engine spun."""
    eng = make_engine(ckpt, num_pages=40, max_pinned_fraction=1.0)  # no cap: only the progress rule helps
    rm = RequestMap(eng)
    rng = random.Random(2)
    for i in range(9):  # 9 finished programs that never unpin: 36 of 40 pages (3 state + 1 KV each)
        assert rm.add(gen_msg(f"p{i}", rand_tokens(rng, 30), 2, pin=True)) is None
        drive(rm)
    assert eng.num_pins == 9 and eng.pool.num_free == 4
    assert rm.add(gen_msg("plain", rand_tokens(rng, 200), 1)) is None  # 5 KV pages + 3 state pages
    updates = drive(rm, limit=50)
    done = [u for u in updates if u.rid == "plain" and u.finished]
    assert done and done[0].finish_reason == "length" and done[0].error is None
    assert eng.stats.pins_dropped > 0  # the oldest pins gave way
    assert_at_rest(eng)


def test_pins_are_capped_and_flush_drops_them(ckpt):
    eng = make_engine(ckpt, num_pages=40)  # default cap: half the pool = 20 pages = 6 state sets
    rm = RequestMap(eng)
    rng = random.Random(3)
    for i in range(10):
        assert rm.add(gen_msg(f"p{i}", rand_tokens(rng, 30), 2, pin=True)) is None
        drive(rm)
    assert eng.num_pins == 6 and eng.scheduler.tree.pinned_pages <= 20
    assert eng.stats.pins_dropped == 4 and list(eng.scheduler.pins) == list(range(4, 10))  # oldest went first
    assert len(rm.pinned) <= 10
    rm.flush()
    assert eng.num_pins == 0 and eng.scheduler.tree.num_snapshots() == 0 and not rm.pinned
    assert eng.pool.num_free == eng.pool.num_pages
    assert_at_rest(eng)


def test_regression_program_cancelled_mid_gen_leaves_no_pin(ckpt):
    """ProgramSession._gen recorded the pinned rid only after generate returned: a session cancelled
    mid-gen never sent Unpin (and the abort pinned it)."""
    from k3rt.backend.engine_inproc import InProcEngineClient
    from k3rt.backend.program.executor import ProgramSession
    from k3rt.backend.program.generator import Generator
    from k3rt.backend.program.roles import role_text
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.frontend.ir import Op, Program
    from tests.backend.engine_fixtures import engine_config_for_tests

    async def scenario() -> int:
        client = InProcEngineClient(engine_config_for_tests(str(ckpt), num_pages=128))
        await client.start()
        tok = load_tokenizer(ckpt)
        session = ProgramSession("p", Generator(client, tok), role_text(tok))
        prog = Program([Op("text", value="hello there"), Op("gen", name="x", params={"max_tokens": 400,
                                                                                     "ignore_eos": True})])
        run = asyncio.create_task(session.run(prog))
        eng = client.engine
        while not any(r.pin for r in eng.scheduler.running):
            await asyncio.sleep(0.01)
        session.cancel()
        run.cancel()
        for _ in range(500):
            await asyncio.sleep(0.01)
            if not eng.has_unfinished:
                break
        await asyncio.sleep(0.1)
        pins = eng.num_pins
        await client.shutdown()
        return pins

    assert asyncio.run(scenario()) == 0


# ---- 2. self-preemption ----

def test_regression_admission_shrinks_the_first_chunk_instead_of_preempting_itself(ckpt):
    """6 free pages, a 300-token prompt (7 KV + 3 state pages): the request was admitted, its 256-token
    first chunk needed 6 KV pages, and it preempted itself every step until the decode finished."""
    eng = make_engine(ckpt, num_pages=20, enable_prefix_cache=False, budget=256)
    rng = random.Random(4)
    a = eng.add_request(rand_tokens(rng, 500), greedy(25))  # 11 KV + 3 state pages, decoding in its last page
    while eng.requests[a].num_computed < 500:
        eng.step()
    assert eng.pool.num_free == 6
    b = eng.add_request(rand_tokens(rng, 300), greedy(2))
    progress = []
    for _ in range(60):
        eng.step()
        eng.check()
        req = eng.requests.get(b)
        progress.append(req.num_computed if req is not None else None)
        if req is None:
            break
    assert eng.stats.preemptions == 0
    # its first chunk took the 3 pages there were (144 tokens, on the grid: 128), then it waited for a's end
    assert progress[0] == 128 and progress[-1] is None
    assert_at_rest(eng)


def test_regression_request_of_the_whole_pool_with_a_reserved_page_is_rejected(ckpt):
    """The GPU runner reserves a page for good: a request needing every page was admitted and preempted
    itself forever. The size check counts only usable pages, and one of exactly that size runs."""
    eng = make_engine(ckpt, num_pages=9)
    eng.pool.reserve()  # as the GPU runner does: 8 usable pages = 3 state + 5 x 48 tokens
    with pytest.raises(ValueError, match=r"need 9 cache pages .* the pool has 8 \(9 less 1 reserved by the runner\)"):
        eng.add_request(list(range(230)), greedy(12))
    out = run(eng, [list(range(229))], greedy(12))[0]  # 229 + 11 fed = 240 tokens: exactly 5 pages
    assert len(out.output_ids) == 12 and eng.stats.preemptions == 0
    assert_at_rest(eng)


# ---- 3. in-batch sharing ----

def test_regression_in_batch_junction_is_published_in_the_chunk_already_built(ckpt):
    """A waiter arrives in the step the sharer's whole prompt is scheduled in one chunk: the junction
    position goes into that chunk, and the waiter resumes from it instead of computing it again."""
    # 320 shared tokens: on no block boundary (256 tokens a page) and on no tail rung of a's 1020 tokens
    eng = make_engine(ckpt, num_pages=200, budget=1024, block_size=256)
    rng = random.Random(5)
    system = rand_tokens(rng, 320)
    a = eng.add_request(system + rand_tokens(rng, 700), greedy(2))
    b = eng.add_request(system + rand_tokens(rng, 50), greedy(2))
    outs = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                outs[o.rid] = o
        eng.check()
    first = eng.runner.steps[0]
    assert [(c.rid, c.start, c.num_tokens) for c in first.chunks] == [(a, 0, 1020)]
    assert 320 in first.chunks[0].snapshots
    assert outs[a].cached_tokens == 0 and outs[b].cached_tokens == 320
    assert_at_rest(eng)


# ---- 4. full-block mode and the KDA kernel's snapshot lattice ----

@pytest.mark.parametrize("block", [48, 96], ids=["B48", "B96"])
def test_regression_full_block_chunks_keep_snapshots_on_the_kernel_lattice(ckpt, block):
    eng = make_engine(ckpt, full_block_mode=True, block_size=block, num_pages=200, budget=1000)
    rng = random.Random(block)
    prompts = [rand_tokens(rng, n) for n in (300, 130, 97)]
    run(eng, prompts, greedy(3))
    outs = run(eng, [p + rand_tokens(rng, 20) for p in prompts], greedy(3))
    n = 0
    for step in eng.runner.steps:
        for c in step.chunks:
            for p in c.snapshots:
                n += 1
                assert p % block == 0
                assert (p - c.start) % 64 == 0 or p == c.start + c.num_tokens, (c.start, c.num_tokens, p)
    assert n > 3 and all(o.cached_tokens % block == 0 for o in outs) and any(o.cached_tokens for o in outs)
    assert_at_rest(eng)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set by conftest without CUDA)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
def test_regression_full_block_mode_runs_with_the_triton_kda_kernel(tmp_path, device):
    """kda_chunk_fwd raised on snapshot position 48 of a 130-token chunk; the engine process exited."""
    from dataclasses import replace

    import torch

    from k3rt.backend.engine import Engine, engine_config_for_tests
    from k3rt.backend.models.tiny import make_tiny, two_layer_overrides

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ck = make_tiny(tmp_path / "m", arch="kimi_linear", dtype="float32", seed=3,
                   overrides=two_layer_overrides("kimi_linear"))  # one KDA layer shows it
    prompts = [list(range(3, 133)), list(range(3, 133)) + [9, 10]]
    ref = Engine(engine_config_for_tests(str(ck), num_pages=64))
    want = [ref.generate([p], greedy(2))[0] for p in prompts]
    cfg = replace(engine_config_for_tests(str(ck), num_pages=64, full_block_mode=True), runner="gpu",
                  kernels=True, cuda_graphs=False, device=device)
    eng = Engine(cfg)
    got = [eng.generate([p], greedy(2))[0] for p in prompts]  # one chunk of 130 holds snapshots at 48 and 96
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert got[1].cached_tokens == 96
    eng.check()


# ---- 5. preemption keeps the live state ----

def test_regression_preempted_request_resumes_from_its_donated_state(ckpt):
    """A decoding request preempted (here by hand, as _make_room does under pressure) used to lose its
    live state: readmitted, it recomputed its prompt's tail and every output token it had. Now the
    state is donated to the cache, and while the memory allows it stays there: one token recomputed."""
    rng = random.Random(6)
    prompts = [rand_tokens(rng, 140), rand_tokens(rng, 100)]
    want = [o.output_ids for o in run(make_engine(ckpt, num_pages=400), prompts, greedy(60))]
    eng = make_engine(ckpt, num_pages=400)
    a, b = (eng.add_request(p, greedy(60)) for p in prompts)
    for _ in range(30):
        eng.step()
    req = eng.requests[b]
    assert req.num_output == 30 - 1 + 1 and eng.stats.computed_tokens == 140 + 100 + 2 * 29
    eng.scheduler._preempt(req)
    eng.check()
    assert eng.scheduler.tree.match(req.token_ids, touch=False).state_hit == len(req.token_ids) - 1
    outs = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                outs[o.rid] = o.output_ids
        eng.check()
    assert [outs[a], outs[b]] == want and eng.stats.preemptions == 1
    # nothing computed twice (before: b's prompt after its replay boundary, 100 - 64, and its 29 outputs)
    assert eng.stats.computed_tokens == (140 + 59) + (100 + 59)
    assert_at_rest(eng)


# ---- 6. namespaces ----

def test_regression_salt_roots_are_deleted_when_empty(ckpt):
    eng = make_engine(ckpt, num_pages=300)
    rng = random.Random(7)
    prompts = [rand_tokens(rng, 70) for _ in range(20)]
    run(eng, prompts, greedy(2), salts=[f"user-{i}" for i in range(20)])
    assert len(eng.scheduler.tree.roots) >= 20
    eng.scheduler.tree.evict(eng.pool.num_pages)
    assert list(eng.scheduler.tree.roots) == [None]
    assert_at_rest(eng)
