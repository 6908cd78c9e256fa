"""Tensor parallelism on CPU (gloo): TP2 and TP4 engines against the TP1 engine, token for token.

The engines run rank 0 in this process and spawn their workers (`python -m
k3rt.backend.distributed.worker`), so every test also proves the workers stop: `no_new_processes`
checks this process's descendants after each engine closes. Tiny fp32 checkpoints of both
architectures (kimi_linear; k3: LatentMoE, gated MLA, full-rank gate, attention residuals), each
with 4 KDA heads, 4 MLA heads, vocab 512, so TP4 leaves one head per rank.

  * plan codec and the pool's fill log (no processes);
  * each rank's checkpoint shard is its slice (TP and expert-parallel, per-expert and stacked experts);
  * greedy outputs at TP2, TP4 and TP2 with expert parallelism equal TP1's for both archs through the Engine with the prefix
    cache on, including repeats and a conversation turn that hit the cache, and a seeded sampled
    request (sampling happens on rank 0 from the gathered logits, so the seed means the same);
  * the cache oracle at TP2: a tiny, poisoned pool (eviction; NaN-filled freed pages, which the
    workers replay from the step plan's fill log) gives the cache-off TP1 outputs, and every snapshot on rank 0 holds rank 0's shard of the
    reference KDA state after exactly its path (and the whole replicated MLA latent);
  * a SIGKILLed worker fails the in-process engine, and `k3rt serve --tp 2` (503 to the running
    request, exit 1), within 10 s with an error naming the worker, and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from k3rt.backend.cache.pool import PagePool
from k3rt.backend.distributed.group import TPFailure
from k3rt.backend.distributed.plan import PlanKind, PlanSeq, StepPlan
from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.loader import load_model
from k3rt.cache_layout import compute_layout
from k3rt.sampling_params import SamplingParams
from tests.backend.engine_fixtures import greedy, make_engine, path_tokens, run, snapshot_nodes, tiny_checkpoint
from tests.backend.threads import single_thread  # noqa: F401  (autouse: rank 0 runs in this process)
from tests.procs import alive, descendants

KILL_DEADLINE_S = 10.0


def test_plan_roundtrip():
    plan = StepPlan(
        fills=((0, (3, 4, 5)), (0xFF, (9,)), (0, ())),
        page_copies=((1, 2), (7, 8)),
        state_copies=(((10, 11, 12), (13, 14, 15)),),
        seqs=(PlanSeq(0, 5, (1,), (20, 21, 22), ((4, (30, 31, 32)),)),
              PlanSeq(96, 1, (1, 2, 3, 4), None, ()),
              PlanSeq(64, 0, (), (), ())),
        token_ids=(1, 2, 3, 4, 5, 6),
        logits_rows=(4, 5, 0))
    packed = plan.pack()
    assert packed.dtype == torch.int64 and packed.dim() == 1
    assert StepPlan.unpack(packed) == plan
    for kind in PlanKind:
        assert StepPlan.unpack(StepPlan(kind).pack()) == StepPlan(kind)
    with pytest.raises(ValueError, match="trailing"):
        StepPlan.unpack(torch.cat([packed, torch.tensor([0])]))


def test_pool_fill_log(tmp_path_factory):
    from k3rt.model_config import load_model_config

    ckpt = tiny_checkpoint(tmp_path_factory)
    pool = PagePool(compute_layout(load_model_config(ckpt)), 8, poison_freed=True)
    pool.allocate(2)  # not recording yet
    pool.record_fills()
    a = pool.allocate(2)
    b = pool.allocate(1, zero=False)  # a copy destination: never zeroed
    pool.unref(a)
    c = pool.allocate(1)
    assert pool.take_fills() == [(0, a), (0xFF, a), (0, c)] and b == [4] and c == [a[0]]
    assert pool.take_fills() == []
    assert (pool.tensors[0][a[1]] == 0xFF).all() and (pool.tensors[0][c[0]] == 0).all()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_layout_padding_per_rank(tp):
    """Each rank's page holds its shard of one KDA state; block size follows the shard, the padding
    stays <= 2% (Kimi-Linear-48B), and the MLA entry per token is the whole replicated latent."""
    from k3rt.model_config import parse_model_config
    from k3rt.presets import KIMI_LINEAR_48B

    cfg = parse_model_config(KIMI_LINEAR_48B)
    one, lay = compute_layout(cfg, tp=1), compute_layout(cfg, tp=tp)
    assert lay.kda_state_bytes == one.kda_state_bytes // tp
    assert lay.mla_bytes_per_token == one.mla_bytes_per_token == 576 * 2
    assert lay.padding_fraction <= 0.02, (tp, lay.as_dict())


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "transformers5-stacked"])
@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 1), (2, 2), (4, 4), (4, 2)],
                         ids=["tp2", "tp4", "tp2-ep", "tp4-ep", "tp4-ep2"])
def test_loader_shards(tp, ep, stacked, tmp_path):
    """Every rank's shard is its slice of the full weights: column-parallel rows, row-parallel columns,
    merged parts split part by part, vocabulary rows; routed experts in ep groups of E/ep whole experts, each
    split by width over the tp/ep ranks of its group (ep 1: every expert over all ranks; ep = tp: whole
    experts), from per-expert tensors and from one stacked tensor alike."""
    from safetensors.torch import save_file

    from k3rt.backend.distributed import TPContext
    from k3rt.backend.models.tiny import TINY_CONFIGS, export_checkpoint, make_tiny
    from tests.backend.test_loader import to_transformers_names

    ckpt = make_tiny(tmp_path / "ckpt", arch="k3", dtype="float32")
    full = load_model(ckpt, progress=False)
    if stacked:
        (ckpt / "model.safetensors").unlink()
        save_file(to_transformers_names(export_checkpoint(full)), str(ckpt / "model.safetensors"))
    E, I = full.cfg.moe.num_experts, full.cfg.moe.intermediate_size

    def rows(t: torch.Tensor, r: int, dim: int = 0) -> torch.Tensor:
        n = t.shape[dim] // tp
        return t.narrow(dim, r * n, n)

    for r in range(tp):
        shard = load_model(ckpt, tp=TPContext(r, tp), ep=ep, progress=False)
        fl, sl = full.model.layers, shard.model.layers
        assert torch.equal(shard.model.embed_tokens.weight, rows(full.model.embed_tokens.weight, r))
        assert torch.equal(shard.lm_head.weight, rows(full.lm_head.weight, r))
        assert torch.equal(sl[0].self_attn.q_proj.weight, rows(fl[0].self_attn.q_proj.weight, r))
        assert torch.equal(sl[0].self_attn.o_proj.weight, rows(fl[0].self_attn.o_proj.weight, r, 1))
        assert torch.equal(sl[0].self_attn.conv_weight,
                           torch.cat([rows(p, r) for p in fl[0].self_attn.conv_weight.chunk(3)]))
        assert torch.equal(sl[3].self_attn.kv_b_proj.weight, rows(fl[3].self_attn.kv_b_proj.weight, r))
        assert torch.equal(sl[3].self_attn.kv_a_proj_with_mqa.weight, fl[3].self_attn.kv_a_proj_with_mqa.weight)
        moe, fmoe = sl[1].mlp, fl[1].mlp
        per, g, sub = tp // ep, r // (tp // ep), r % (tp // ep)  # ranks per expert group, this rank's group, slice
        mine = slice(g * E // ep, (g + 1) * E // ep)
        assert moe.w13.shape[0] == E // ep and moe.expert_offset == mine.start

        def part(t: torch.Tensor, dim: int) -> torch.Tensor:
            n = t.shape[dim] // per
            return t.narrow(dim, sub * n, n)
        gate, up = fmoe.w13[mine].split(I, dim=1)
        assert torch.equal(moe.w13, torch.cat([part(gate, 1), part(up, 1)], dim=1))
        assert torch.equal(moe.w2, part(fmoe.w2[mine], 2))
        gate, up = fmoe.shared_experts.gate_up_proj.weight.chunk(2)
        assert torch.equal(moe.shared_experts.gate_up_proj.weight, torch.cat([rows(gate, r), rows(up, r)]))
    assert TINY_CONFIGS["k3"]["num_experts"] == E


@pytest.fixture
def no_new_processes():
    before = descendants(os.getpid())

    def new() -> list[int]:
        # multiprocessing's resource tracker (started by the first spawn) lives as long as pytest does
        return [p for p in descendants(os.getpid()) - before
                if alive(p) and "multiprocessing.resource_tracker" not in _cmdline(p)]

    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and new():
        time.sleep(0.1)
    left = new()
    assert not left, f"processes left behind: {[(p, _cmdline(p)) for p in left]}"


def tp_engine(ckpt, tp: int, *, ep: int = 1, **cache):
    return make_engine(ckpt, runner="model", budget=256, engine={"tp": tp, "ep": ep}, **cache)


def _sampled() -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=4, ignore_eos=True)


def workload(engine) -> tuple[list[list[int]], list[int]]:
    """Two rounds: 4 concurrent requests (one seeded-sampled), then two exact repeats and a conversation
    turn, which hit the prefix cache. -> (every output, cached_tokens of round 2)."""
    base = [(i * 37 + 11) % 512 for i in range(140)]
    first = [base[:130], base[:70] + [5, 9, 2], [(i * 7) % 512 for i in range(20)], base[:90]]
    outs = run(engine, first, [greedy(5), greedy(3), greedy(4), _sampled()])
    second = [first[0], first[1], first[2] + outs[2].output_ids + [3, 1, 4]]
    outs2 = run(engine, second, [greedy(4), greedy(3), greedy(4)])
    return [o.output_ids for o in outs + outs2], [o.cached_tokens for o in outs2]


@pytest.fixture(scope="module", params=["kimi_linear", "k3"])
def arch(request, tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory, request.param)
    eng = tp_engine(ckpt, 1)
    outputs, cached = workload(eng)
    assert all(c > 0 for c in cached[:2]) and cached[2] >= 20, cached  # the turn resumes past its first prompt
    return ckpt, outputs, cached


@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 1), (2, 2), (4, 2)], ids=["tp2", "tp4", "tp2-ep", "tp4-ep2"])
def test_tp_matches_tp1(arch, tp, ep, no_new_processes):
    ckpt, want, want_cached = arch
    eng = tp_engine(ckpt, tp, ep=ep)
    try:
        assert len(eng.runner.sender.workers.procs) == tp - 1  # really N processes, each with its shard
        assert eng.model_cfg.kda.num_heads // tp == eng.runner.model.model.layers[0].self_attn.num_heads
        got, cached = workload(eng)
        assert got == want
        assert cached == want_cached
    finally:
        eng.close()


def _rank0_shard(ref_conv: torch.Tensor, ref_rec: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's part of one layer's reference KDA state: conv channels are [q | k | v], each split
    across ranks; the recurrent state is split by heads."""
    w, c = ref_conv.shape
    conv = ref_conv.view(w, 3, c // 3)[:, :, : c // 3 // tp].reshape(w, -1)
    return conv, ref_rec[: ref_rec.shape[0] // tp]


def test_tp2_cache_oracle(arch, no_new_processes):
    """Cache-on TP2 with a tiny poisoned pool == cache-off TP1 (big pool), and rank 0's snapshots hold its
    shard of the reference state after exactly their path."""
    ckpt, _, _ = arch
    base = [(i * 13 + 5) % 512 for i in range(200)]
    rounds = [
        [base[:150] + [1, 2, 3], base[:64] + [9] * 30, base[:130] + [7]],
        [base[:150] + [1, 2, 3], base[:97] + [4, 4], base[:48] + [8], base[:191] + [6, 5]],
    ]
    params = [greedy(4), greedy(3), greedy(5), greedy(2)]
    ref_eng = make_engine(ckpt, runner="model", enable_prefix_cache=False, num_pages=1024, budget=2048)
    want = [[o.output_ids for o in run(ref_eng, r, params[:len(r)])] for r in rounds]

    eng = tp_engine(ckpt, 2, num_pages=14, poison_freed=True)
    ref_model = load_model(ckpt, dtype="float32", progress=False)
    try:
        got, hits, checked = [], 0, 0
        for r in rounds:
            outs = run(eng, r, params[:len(r)])
            got.append([o.output_ids for o in outs])
            hits += sum(o.cached_tokens for o in outs)
            checked += _check_rank0_snapshots(eng, ref_model)
        assert got == want
        assert hits > 0 and checked > 0
        assert eng.scheduler.tree.stats.evicted_pages > 0  # the pool was too small to keep everything
    finally:
        eng.close()


def _check_rank0_snapshots(eng: Engine, model) -> int:
    pool, L = eng.pool, eng.layout
    nodes = snapshot_nodes(eng)
    for node in nodes:
        path = path_tokens(node)
        ref = model.new_cache()
        model(torch.tensor(path), ForwardBatch([len(path)], [0], [ref], logits_indices=torch.tensor([0])))
        for group in L.kda_groups:
            for layer in group:
                g, t = L.kda_slot(layer)
                conv, rec = _rank0_shard(ref.conv[layer], ref.rec[layer], eng.cfg.tp)
                page = node.snapshot[g]
                assert (pool.conv[t][page] - conv).abs().max() <= 1e-5, f"snapshot at {node.end}: layer {layer} conv"
                assert (pool.rec[t][page] - rec).abs().max() <= 1e-5, f"snapshot at {node.end}: layer {layer} state"
    return len(nodes)


def _kill_worker(eng_pid: int) -> int:
    workers = [p for p in descendants(eng_pid) if "k3rt.backend.distributed.worker" in _cmdline(p)]
    assert workers, "no tensor-parallel worker found"
    os.kill(workers[0], signal.SIGKILL)
    return workers[0]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def assert_killed_worker_fails(eng) -> None:
    """Kill rank 1 of a running TP-2 engine: check_runner names it within the deadline, and the next step is
    fatal (a TPFailure, not one request's failure). Closes the engine."""
    try:
        run(eng, [[1, 2, 3]], greedy(2))
        pid = _kill_worker(os.getpid())
        t0 = time.monotonic()
        with pytest.raises(TPFailure, match=f"worker rank 1 \\(pid {pid}\\) was killed by signal 9"):
            while time.monotonic() - t0 < KILL_DEADLINE_S:
                eng.check_runner()
                time.sleep(0.05)
        eng.add_request([4, 5, 6], greedy(2))
        with pytest.raises(TPFailure):
            eng.step()
    finally:
        eng.close()


def test_killed_worker_fails_engine(tmp_path_factory, no_new_processes):
    ckpt = tiny_checkpoint(tmp_path_factory, "kimi_linear")
    assert_killed_worker_fails(Engine(replace(engine_config_for_tests(str(ckpt)), runner="model", tp=2)))


def test_worker_error_reaches_rank0(tmp_path, no_new_processes):
    """A worker that fails on its own (here: its host lacks the checkpoint, as a misconfigured second node
    would) exits non-zero, and rank 0's error quotes the worker's own error."""
    from k3rt.backend.distributed.group import create_store, destroy_groups, init_groups
    from k3rt.backend.distributed.launch import WorkerSet
    from k3rt.config import EngineConfig

    cfg = EngineConfig(model=str(tmp_path / "missing"), runner="model", tp=2)
    store, rdv = create_store(cfg)
    workers = WorkerSet(cfg, range(1, 2), rdv, store=store)
    try:
        init_groups(cfg, 0, rdv, store)  # this test plays rank 0
        deadline = time.monotonic() + 60
        while (lost := workers.poll()) is None:
            assert time.monotonic() < deadline, "the worker did not fail"
            time.sleep(0.05)
        assert "worker rank 1" in lost and "exited with code 1" in lost and "missing" in lost, lost
    finally:
        workers.kill()
        destroy_groups()


def test_hung_worker_times_out(tmp_path_factory, no_new_processes):
    """A worker that stops answering (SIGSTOP: alive, silent) fails the next step after the collective
    timeout instead of hanging the engine."""
    from k3rt.config import DistConfig

    ckpt = tiny_checkpoint(tmp_path_factory, "kimi_linear")
    eng = Engine(replace(engine_config_for_tests(str(ckpt)), runner="model", tp=2, dist=DistConfig(timeout_s=3.0)))
    try:
        run(eng, [[1, 2, 3]], greedy(2))
        workers = [p for p in descendants(os.getpid()) if "k3rt.backend.distributed.worker" in _cmdline(p)]
        os.kill(workers[0], signal.SIGSTOP)
        eng.add_request([4, 5, 6], greedy(3))
        t0 = time.monotonic()
        with pytest.raises(TPFailure, match="(?i)timed? ?out"):
            while time.monotonic() - t0 < KILL_DEADLINE_S:
                eng.step()
        assert time.monotonic() - t0 < KILL_DEADLINE_S
    finally:
        eng.close()  # kills the stopped worker (SIGKILL reaches a stopped process)


def test_killed_worker_fails_server(tmp_path_factory):
    """The whole server: `k3rt serve --tp 2`; SIGKILL its worker mid-request. The request is answered 503
    naming the worker within 10 s, the server exits 1, and nothing it started (engine process, the
    other worker) is left (ServeProcess.stop asserts that)."""
    import threading

    import httpx

    from tests.server.conftest import MODEL_NAME, start_server

    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    s = start_server(ckpt, tmp_path_factory.mktemp("serve-logs"), "--tp", "2", "--dsl-addr", "off",
                     "--drain-timeout", "2")
    try:
        result: dict = {}

        def request() -> None:
            body = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 4000, "temperature": 0,
                    "ignore_eos": True}
            result["response"] = httpx.post(s.url + "/v1/completions", json=body, timeout=120)

        waiter = threading.Thread(target=request, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 60
        while s.stats()["stats"]["in_flight"] < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        s.track()
        pid = _kill_worker(s.proc.pid)
        waiter.join(KILL_DEADLINE_S)
        assert "response" in result, f"no answer within {KILL_DEADLINE_S} s of the worker's death"
        r = result["response"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        assert f"worker rank 1 (pid {pid}) was killed by signal 9" in r.json()["error"]["message"], r.text
        assert s.proc.wait(60) == 1, s.log()  # the drain (2 s) and uvicorn's shutdown, on a loaded machine
        assert s.stop() == 1  # already exited: checks that nothing it started is left
    finally:
        if s.proc.poll() is None:
            s.kill()


def test_launch_env_and_dist_config():
    from k3rt.config import DistConfig, EngineConfig
    from k3rt.launch_env import LaunchEnv

    env = LaunchEnv.read({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                          "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert env == LaunchEnv(1, 4, "10.0.0.1", 29500, True) and env.launched
    assert not LaunchEnv.read({}).launched
    with pytest.raises(ValueError, match="RANK"):
        LaunchEnv.read({"RANK": "x"})
    with pytest.raises(ValueError, match="master_port"):
        DistConfig(nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        DistConfig(nnodes=2, node_rank=2, master_port=1)
    with pytest.raises(ValueError, match="nnodes"):
        EngineConfig(model="m", tp=3, dist=DistConfig(nnodes=2, master_port=1))
    cfg = EngineConfig(model="m", tp=8, dist=DistConfig(nnodes=2, node_rank=1, master_port=1))
    assert cfg.ranks_per_node == 4 and cfg.node_ranks == range(4, 8) and cfg.runner == "model"
    assert EngineConfig(model="m", device="cuda", tp=2).runner == "gpu"  # the fused runner runs under TP too
    with pytest.raises(ValueError, match="random_weights"):
        EngineConfig(model="m", tp=2, random_weights=True)


def test_cli_roles(monkeypatch):
    """Who does what: under torchrun every process is its RANK (0 serves, others are workers) and the
    launcher's store is reused; with --nnodes, node 0 is the engine and the other nodes only run ranks."""
    from k3rt.cli import _dist_from_args, build_parser

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(var, raising=False)
    parse = build_parser().parse_args
    tp, d, role = _dist_from_args(parse(["serve", "--tp", "4", "--nnodes", "2", "--node-rank", "1",
                                         "--master-addr", "10.0.0.1", "--master-port", "29500", "--ep"]))
    assert (tp, role, d.nnodes, d.node_rank, d.master_addr, d.master_port, d.external_ranks) == (
        4, -1, 2, 1, "10.0.0.1", 29500, False)
    assert _dist_from_args(parse(["generate", "--prompt", "x"]))[::2] == (1, 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    tp, d, role = _dist_from_args(parse(["generate", "--prompt", "x"]))
    assert (tp, role, d.master_port, d.external_ranks, d.agent_store) == (2, 1, 29400, True, True)
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        _dist_from_args(parse(["generate", "--prompt", "x", "--tp", "4"]))


def test_cli_generate_two_nodes_matches_tp1(tmp_path_factory, capsys, no_new_processes):
    """`k3rt generate --tp 2` as two "hosts" on localhost: node 0 (this process: the engine, rank 0) and
    node 1 (a `--node-rank 1` process that only runs rank 1 and exits 0 after STOP) give TP1's tokens."""
    import json
    import subprocess
    import sys

    from k3rt.cli import main
    from tests.server.conftest import free_port

    ckpt = tiny_checkpoint(tmp_path_factory, "k3")
    args = ["generate", "--model", str(ckpt), "--prompt", "def add(a, b):", "--max-tokens", "6", "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    dist = ["--tp", "2", "--nnodes", "2", "--master-port", str(free_port())]
    node1 = subprocess.Popen([sys.executable, "-m", "k3rt.cli", *args, *dist, "--node-rank", "1"])
    try:
        assert main([*args, *dist, "--node-rank", "0"]) == 0
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert got == want and len(want["token_ids"]) == 6
    assert main(["generate", "--model", str(ckpt), "--prompt", "x", "--tp", "3"]) == 2
    assert "num_heads=4 is not divisible by tensor-parallel size 3" in capsys.readouterr().err


def test_ep_degree_from_the_cli_and_its_errors():
    """`--ep M` is the expert-parallel degree (M groups of whole experts); `--ep` alone is M = --tp (the old flag),
    and True/False in an EngineConfig read as tp/1. A degree that does not divide tp, or a model dimension that
    does not split, is refused naming it."""
    from k3rt.cli import build_parser
    from k3rt.config import EngineConfig
    from k3rt.model_config import ConfigError, parse_model_config
    from k3rt.backend.models.tiny import TINY_CONFIGS

    parse = build_parser().parse_args
    assert parse(["serve", "--tp", "4", "--ep", "2"]).ep == 2
    assert parse(["serve", "--tp", "4", "--expert-parallel-size", "4"]).ep == 4
    assert parse(["serve", "--tp", "4", "--ep"]).ep is True and parse(["serve", "--tp", "4"]).ep == 1
    assert [EngineConfig(model="m", tp=4, ep=e).ep for e in (True, False, 1, 2, 4)] == [4, 1, 1, 2, 4]
    for bad in (3, 0, 8):
        with pytest.raises(ValueError, match=f"ep: the expert-parallel size must be >= 1 and divide tp=4, got {bad}"):
            EngineConfig(model="m", tp=4, ep=bad)
    parse_model_config(dict(TINY_CONFIGS["k3"])).check_tp_model(4, 2)  # 8 experts of width 32
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by expert-parallel size 4"):
        parse_model_config(dict(TINY_CONFIGS["k3"], num_experts=6)).check_tp_model(4, 4)
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=42 is not divisible by the 4 ranks that split "
                                          r"each expert \(tp 4 / ep 1\)"):
        parse_model_config(dict(TINY_CONFIGS["k3"], moe_intermediate_size=42)).check_tp_model(4, 1)
