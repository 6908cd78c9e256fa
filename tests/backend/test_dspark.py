"""DSpark drafting (issue 16 §1): the block drafter's model, heads, checkpoint folder and the shipped
k3-tiny drafter. CPU, seeded; the shipped-drafter tests decode a few held-out prompts with k3-tiny."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3rt.backend.models.loader import CheckpointError, load_model
from k3rt.backend.spec.base import DraftQuery
from k3rt.backend.spec.dspark.checkpoint import load_config, load_drafter, save_drafter
from k3rt.backend.spec.dspark.drafter import DSparkDrafter
from k3rt.backend.spec.dspark.model import DSparkConfig, DSparkModel, verify_length
from k3rt.backend.spec.dspark.target import dense_states
from k3rt.backend.tokenizer import load_tokenizer
from k3rt.models import MODELS_DIR

SHIPPED = MODELS_DIR / "k3-tiny-dspark"
SMALL = DSparkConfig(vocab_size=50, hidden_size=32, target_hidden_size=24, target_layers=(0, 2), context_len=3,
                     block_size=5, num_layers=2, num_heads=2, head_dim=8, intermediate_size=48, markov_rank=4,
                     confidence_hidden=8, confidence_threshold=0.4, min_verify=1)


def _small(seed: int = 0, **changes) -> tuple[DSparkModel, torch.Tensor, torch.Tensor]:
    cfg = DSparkConfig(**{**SMALL.to_json(), "target_layers": SMALL.target_layers, **changes})
    model = DSparkModel(cfg)
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        if cfg.markov_rank:  # init leaves it at zero; a random one makes the Markov tests able to fail
            model.markov_out.weight.copy_(torch.randn(model.markov_out.weight.shape, generator=g))
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    return model.eval(), embed, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)


def _ctx(cfg: DSparkConfig, b: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, cfg.context_len, len(cfg.target_layers) * cfg.target_hidden_size, generator=g)


def test_one_pass_gives_k_logits():
    model, embed, head = _small()
    calls = []
    for layer in model.layers:
        layer.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape)))
    anchors = torch.tensor([1, 7, 9])
    tokens, logits, conf = model.draft(_ctx(model.cfg, 3), anchors, embed, head)
    k = model.cfg.block_size
    assert tokens.shape == (3, k) and logits.shape == (3, k, 50) and conf.shape == (3, k)
    # every block layer ran once, on all k + 1 slots of all 3 requests at once
    assert calls == [(3, k + 1, 32)] * model.cfg.num_layers
    assert ((conf > 0) & (conf < 1)).all()
    assert torch.equal(tokens, logits.argmax(-1))
    with pytest.raises(ValueError, match="ctx_states"):
        model.block_hidden(_ctx(model.cfg, 3)[:, 1:], anchors, embed)


def test_markov_bias_depends_on_the_previous_token_only():
    model, embed, head = _small()
    ctx, anchors = _ctx(model.cfg, 2), torch.tensor([4, 11])
    tokens, logits, _ = model.draft(ctx, anchors, embed, head)
    base = model.base_logits(model.block_hidden(ctx, anchors, embed), head)
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
    for j in range(model.cfg.block_size):
        torch.testing.assert_close(logits[:, j] - base[:, j], model.markov_bias(prev[:, j]))
    # the bias is a row of a table: the same previous token gives the same bias at any position
    with torch.no_grad():
        torch.testing.assert_close(model.markov_bias(torch.tensor([4, 4])), model.markov_bias(torch.tensor([4])).expand(2, -1))
    assert not torch.allclose(model.markov_bias(torch.tensor(4)), model.markov_bias(torch.tensor(5)))
    # without the head the drafts are the block's own argmax
    plain, e2, h2 = _small(markov_rank=0)
    t2, l2, _ = plain.draft(ctx, anchors, e2, h2)
    torch.testing.assert_close(l2, plain.base_logits(plain.block_hidden(ctx, anchors, e2), h2))


def test_confidence_threshold_picks_the_verify_length():
    conf = torch.tensor([0.9, 0.8, 0.5, 0.9])  # cumulative 0.9, 0.72, 0.36, 0.324
    assert verify_length(conf, 0.5, 1, 4) == 2
    assert verify_length(conf, 0.35, 1, 4) == 3
    assert verify_length(conf, 0.95, 1, 4) == 1  # min_verify
    assert verify_length(conf, 0.95, 0, 4) == 0
    assert verify_length(conf, 0.5, 3, 4) == 3
    assert verify_length(conf, 0.0, 1, 4) == 4
    assert verify_length(conf, 0.0, 1, 2) == 2  # max_tokens
    # the drafter applies it per request
    model, embed, head = _small()
    drafter = DSparkDrafter(model, embed, head)
    ctx = _ctx(model.cfg, 2)
    _, _, est = model.draft(ctx, torch.tensor([3, 8]), embed, head)
    queries = [DraftQuery(0, [5, 3], 1, 5, ctx[0]), DraftQuery(1, [8], 1, 2, ctx[1])]
    got = drafter.propose(queries)
    want = [verify_length(est[0], 0.4, 1, 5), verify_length(est[1], 0.4, 1, 2)]
    assert [len(x) for x in got] == want
    everything = DSparkDrafter(model, embed, head, confidence_threshold=0.0).propose(queries)
    assert [len(x) for x in everything] == [5, 2]
    assert got[0] == everything[0][: len(got[0])]


def test_drafter_query_errors_and_short_windows():
    model, embed, head = _small()
    drafter = DSparkDrafter(model, embed, head, confidence_threshold=0.0)
    # a request whose states were not recorded drafts nothing this step; the others in the batch still do
    ctx0 = _ctx(model.cfg, 1)[0]
    got = drafter.propose([DraftQuery(7, [1, 2], 2, 3), DraftQuery(9, [2], 1, 3, ctx0)])
    assert got[0] == [] and len(got[1]) == 3
    with pytest.raises(ValueError, match=r"request 8 hidden is \[3, 5\]"):
        drafter.propose([DraftQuery(8, [1, 2], 2, 3, torch.zeros(3, 5))])
    ctx = _ctx(model.cfg, 1)[0]
    # a window shorter than context_len is padded with its oldest row
    short = drafter.propose([DraftQuery(1, [2], 1, 5, ctx[-1:])])
    padded = drafter.propose([DraftQuery(1, [2], 1, 5, ctx[-1:].expand(3, -1))])
    assert short == padded and len(short[0]) == 5
    with pytest.raises(CheckpointError, match="embed"):
        DSparkDrafter(model, embed[:, :8], head)


def test_checkpoint_round_trip_and_named_errors(tmp_path: Path):
    model, _, _ = _small(seed=5)
    folder = save_drafter(model, tmp_path / "d", dtype=torch.float32)
    loaded = load_drafter(folder)
    assert loaded.cfg == model.cfg
    for name, p in model.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name
    bf16 = load_drafter(save_drafter(model, tmp_path / "b"))  # the shipping dtype
    assert torch.equal(bf16.fc.weight, model.fc.weight.bfloat16().float())

    cfg_path = folder / "config.json"
    raw = json.loads(cfg_path.read_text())

    def with_config(**changes) -> Path:
        out = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**raw, **changes}))
        (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        return out

    with pytest.raises(CheckpointError, match="missing field.*markov_rank"):
        load_config(_drop(with_config(), "markov_rank"))
    with pytest.raises(CheckpointError, match="unknown field.*block_sise"):
        load_config(with_config(block_sise=7))
    with pytest.raises(CheckpointError, match="target_layers"):
        load_config(with_config(target_layers=[]))
    with pytest.raises(CheckpointError, match="confidence_threshold"):
        load_config(with_config(confidence_threshold=1.5))
    with pytest.raises(CheckpointError, match="model_type"):
        load_config(with_config(model_type="eagle"))
    with pytest.raises(CheckpointError, match=r"tensor markov_in.weight has shape \[50, 4\].*\[50, 6\]"):
        load_drafter(with_config(markov_rank=6))

    tensors = load_file(str(folder / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(raw))
    save_file({**tensors, "embed_tokens.weight": torch.zeros(50, 32)}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor.*embed_tokens.weight"):
        load_drafter(bad)
    save_file({n: t for n, t in tensors.items() if n != "layers.1.down.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor layers.1.down.weight \[32, 48\]"):
        load_drafter(bad)
    with pytest.raises(CheckpointError, match="no such file"):
        load_drafter(tmp_path / "nowhere")


def test_copy_head_copies_known_next_tokens_only():
    model, embed, head = _small(context_tokens=True, copy_dim=8, context_len=4)
    with torch.no_grad():
        model.copy_gate.bias.fill_(30.0)  # gate open: the draft distribution is the copy distribution
    w, k = 4, model.cfg.block_size
    ctx = _ctx(model.cfg, 2)
    ids = torch.tensor([[40, 11, 12, 13, 14], [41, 21, 22, 23, 24]])  # positions t-4..t-1, then the anchor
    valid = torch.tensor([[True] * 4, [False, False, True, True]])  # request 1 has run only 2 positions
    with torch.no_grad():
        slots, pctx = model._block(ctx, ids[:, -1], embed, ids, valid)
        copy, gate = model.copy_probs(slots, pctx, ids, valid)
    assert copy.shape == (2, k, 50) and (gate > 0.99).all()
    for b in range(2):
        for j in range(1, k + 1):
            # draft j copies x_{p+j}: window index i + j, only for valid i with i + j <= w (a known token)
            allowed = {int(ids[b, i + j]) for i in range(w) if valid[b, i] and i + j <= w}
            mass = copy[b, j - 1]
            assert set(mass.nonzero().flatten().tolist()) <= allowed, (b, j)
            assert abs(float(mass.sum()) - (1.0 if allowed else 0.0)) < 1e-5, (b, j)
    assert copy[1, :, 40].sum() == 0 and copy[1, :, 21].sum() == 0  # padding rows hold no token to copy
    with pytest.raises(ValueError, match="ctx_tokens"):
        model.draft(ctx, ids[:, -1], embed, head)
    # the drafter takes the window's ids from the query's tokens: an edit inside the window moves the
    # drafts, one before it does not; a short window is masked, not copied from its padding
    drafter = DSparkDrafter(model, embed, head, confidence_threshold=0.0)
    toks = [7, 8, 9, 40, 11, 12, 13, 14]
    base = drafter.propose([DraftQuery(0, toks, 3, k, ctx[0])])[0]
    assert base == model.draft(ctx[:1], ids[:1, -1], embed, head, ctx_tokens=ids[:1])[0][0].tolist()
    assert drafter.propose([DraftQuery(0, [1, 2, 3] + toks[3:], 3, k, ctx[0])])[0] == base
    assert drafter.propose([DraftQuery(0, toks[:6] + [30] + toks[7:], 3, k, ctx[0])])[0] != base
    short = drafter.propose([DraftQuery(1, [5, 22, 23, 24], 2, k, ctx[1, 2:])])[0]
    assert short == model.draft(ctx[1:], ids[1:, -1], embed, head, ctx_tokens=ids[1:], ctx_valid=valid[1:])[0][0].tolist()
    assert 21 not in short and 40 not in short


@pytest.mark.parametrize("changes", [pytest.param({}, id="markov"), pytest.param({"markov_rank": 0}, id="plain"),
                                     pytest.param({"context_tokens": True, "copy_dim": 8, "context_len": 4},
                                                  id="markov-copy")])
def test_fused_steps_draft_what_the_torch_path_drafts(changes):
    """The serving pass with its left-to-right steps in the Triton kernel (kernels/spec, interpreter here) gives
    the torch loop's tokens and confidences, through greedy_pass and through the drafter on a batch of windows
    of different lengths (one gather builds them); a batch drafts what each request drafts alone."""
    model, embed, head = _small(seed=2, **changes)
    cfg = model.cfg
    with torch.no_grad():
        if cfg.copy_dim:
            model.copy_gate.bias.fill_(0.5)  # gate half open: both parts of the mix matter
    b, w = 4, cfg.context_len
    ctx = _ctx(cfg, b, seed=9)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (b, 6 + w), generator=g)
    extra = dict(ctx_tokens=ids[:, -w - 1:], ctx_valid=torch.ones(b, w, dtype=torch.bool)) if model.needs_tokens else {}
    fused = model.greedy_pass(ctx, ids[:, -1], embed, head, fused=True, **extra)
    want = model.greedy_pass(ctx, ids[:, -1], embed, head, fused=False, **extra)
    assert torch.equal(fused[0], want[0])
    torch.testing.assert_close(fused[1], want[1], rtol=1e-5, atol=1e-6)
    plain = DSparkDrafter(model, embed, head, confidence_threshold=0.0)
    kernel = DSparkDrafter(model, embed, head, confidence_threshold=0.0, fused=True)
    assert not plain.fused and kernel.fused  # the kernel is the default on CUDA only
    held = [w, 1, 2, w]  # rows each request has run: short windows are left-padded (and masked with tokens)
    queries = [DraftQuery(i, ids[i].tolist(), 3, cfg.block_size, ctx[i, w - n:]) for i, n in enumerate(held)]
    got = kernel.propose(queries)
    assert got == plain.propose(queries) and got[0] == want[0][0].tolist()
    assert got == [plain.propose([q])[0] for q in queries]


def test_fused_pass_launches_do_not_grow_with_k():
    """The count issue 16 asked to cut: the torch loop launches ~25 ops per draft (its count grows with k); the
    fused pass launches one Triton kernel for all k steps, and its op count does not depend on k (profiler,
    backend/bench/op_count.py; benchmarks/dspark_pass.py reports the shipped drafter's numbers)."""
    from k3rt.backend.bench.op_count import count_ops
    counts = {}
    for k in (1, 5):
        model, embed, head = _small(block_size=k, context_tokens=True, copy_dim=8, context_len=4)
        ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(k))
        ctx, valid = _ctx(model.cfg, 2), torch.ones(2, 4, dtype=torch.bool)
        for fused in (False, True):
            counts[k, fused] = count_ops(lambda: model.greedy_pass(ctx, ids[:, -1], embed, head, ctx_tokens=ids,
                                                                   ctx_valid=valid, fused=fused))
    L = model.cfg.num_layers  # the fused pass's layers: norms (the context's, then 2 per layer) and the SiLU product
    assert counts[1, True]["triton"] == counts[5, True]["triton"] == 1 + (2 + 2 * L) + L
    assert counts[5, False]["triton"] == 0
    assert counts[5, True]["launching"] == counts[1, True]["launching"]
    assert counts[5, False]["launching"] - counts[1, False]["launching"] >= 4 * 20  # >= 20 ops per extra draft
    assert counts[5, False]["launching"] - counts[5, True]["launching"] >= 5 * 20


def test_the_fused_pass_adds_residuals_inside_its_norm_launches():
    """Issue 16 (the drafter's pass is launch-bound at batch 1): the serving pass's layers run each residual add
    inside the next norm's launch and SiLU-and-product as one (DSparkModel._layers_kernels): per layer 3 launches
    fewer than the torch layers'; the block's slots equal theirs to fp32 rounding."""
    from k3rt.backend.bench.op_count import count_ops

    model, embed, _ = _small(block_size=3, context_tokens=True, copy_dim=8, context_len=4)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    ctx, valid = _ctx(model.cfg, 2), torch.ones(2, 4, dtype=torch.bool)
    counts, slots = {}, {}
    for kernels in (False, True):
        def block():
            slots[kernels] = model._block(ctx, ids[:, -1], embed, ids, valid, kernels=kernels)[0]
        counts[kernels] = count_ops(block, names=True)
    L = model.cfg.num_layers
    assert counts[True]["triton"] == 2 + 3 * L and counts[False]["triton"] == 0
    for c in counts.values():  # the by-name breakdown adds up to the totals
        assert sum(c["names"].values()) == c["launching"] + c["triton"]
    assert counts[True]["names"]["triton::_act_and_mul_kernel"] == L
    # torch: per layer 2 norms, 2 adds, silu and the product, then the final norm; kernels: the first layer's norm,
    # then per layer those six in 3 launches (the final norm inside the last layer's); the context's norm 1 in both
    assert counts[False]["launching"] - (counts[True]["launching"] + counts[True]["triton"]) == 3 * L
    assert (slots[True] - slots[False]).abs().max() < 1e-5


def test_folded_block_ops_keep_the_spelled_out_results():
    """The pass's folds (issue 16: fewer launches) change nothing past fp32 rounding: the one-op RMSNorm against
    x * rsqrt(mean(x^2) + eps) * w, and inference's one q|k|v matmul against the three projections (what a
    grad-enabled pass, training's, runs); the stacked weights follow an in-place edit of one of them."""
    from k3rt.backend.spec.dspark.model import _RMSNorm
    norm = _RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(3, 5, 32) * 4
        torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight,
                                   rtol=1e-6, atol=1e-6)
    model, embed, head = _small(context_tokens=True, copy_dim=8, context_len=4)
    ctx, ids = _ctx(model.cfg, 2), torch.randint(0, 50, (2, 5))
    valid = torch.tensor([[True] * 4, [False, True, True, True]])

    def hidden(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return model.block_hidden(ctx, ids[:, -1], embed, ctx_tokens=ids, ctx_valid=valid).detach()

    torch.testing.assert_close(hidden(False), hidden(True), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.layers[0].k_proj.weight.mul_(3.0)
    torch.testing.assert_close(hidden(False), hidden(True), rtol=1e-5, atol=1e-5)


def test_new_config_keys_are_checked(tmp_path: Path):
    model, _, _ = _small(context_tokens=True, copy_dim=8)
    folder = save_drafter(model, tmp_path / "d", dtype=torch.float32)
    assert load_drafter(folder).cfg == model.cfg
    raw = json.loads((folder / "config.json").read_text())
    for key, bad in (("copy_dim", -1), ("context_tokens", "yes"), ("context_len", 2000)):
        (folder / "config.json").write_text(json.dumps({**raw, key: bad}))
        with pytest.raises(CheckpointError, match=key):
            load_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "copy_dim": 4}))
    with pytest.raises(CheckpointError, match=r"copy_q.weight has shape \[8, 32\].*\[4, 32\]"):
        load_drafter(folder)
    # a first-format folder (no context_tokens, no copy_dim) loads with both off
    old = {n: v for n, v in raw.items() if n not in ("context_tokens", "copy_dim")}
    assert load_config(with_json(tmp_path / "old", old)).copy_dim == 0


def with_json(folder: Path, raw: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _drop(folder: Path, key: str) -> Path:
    raw = json.loads((folder / "config.json").read_text())
    del raw[key]
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.fixture(scope="module")
def k3_tiny():
    torch.manual_seed(0)
    return load_model("k3-tiny", dtype="float32", progress=False)


def test_cached_states_match_the_dense_forward(k3_tiny):
    from k3rt.training.dspark import greedy_with_states
    layers = (2, 5, 8)
    prompts = [[1, 50, 60, 70, 80, 90], [1, 300, 301, 302, 303, 304]]
    tokens, states, nxt = greedy_with_states(k3_tiny, prompts, 6, layers)
    dense_next, dense = dense_states(k3_tiny, tokens, layers)
    torch.testing.assert_close(states.float(), dense[:, :-1], atol=2e-2, rtol=2e-2)
    assert torch.equal(nxt[:, 5:], tokens[:, 6:])  # decode emitted its argmax
    assert (nxt == dense_next[:, :-1]).float().mean() > 0.95
    # gen's dense greedy path (the GPU one) continues the same way and keeps the same states
    from k3rt.training.dspark import greedy_dense
    d_tokens, d_states, d_next = greedy_dense(k3_tiny, prompts, 6, layers)
    assert torch.equal(d_tokens, tokens) and torch.equal(d_next, dense_next[:, :-1])
    torch.testing.assert_close(d_states.float(), dense[:, :-1], atol=2e-2, rtol=2e-2)
    assert greedy_dense(k3_tiny, prompts, 6, layers, deadline=0.0) is None  # past its deadline: no batch
    # gen's engine path (k3rt's engine, reference runner here) emits the same tokens, and the one dense
    # forward after it gives the dense path's states and labels
    from k3rt.training.dspark import greedy_engine, states_and_next
    e_tokens, finished = greedy_engine(k3_tiny, "k3-tiny", prompts, 6, batch=1, device="cpu", dtype="float32")
    assert torch.equal(e_tokens, tokens) and finished == [0, 1]  # batch 1: the second prompt waits its turn
    e_states, e_next = states_and_next(k3_tiny, e_tokens, layers, batch=2)  # greedy_dense's batch shape
    assert torch.equal(e_next, d_next) and torch.equal(e_states, d_states)
    late, finished = greedy_engine(k3_tiny, "k3-tiny", prompts, 6, batch=2, device="cpu", dtype="float32", deadline=0.0)
    assert late.shape == (0, 12) and finished == []
    with pytest.raises(ValueError, match="prompts"):
        greedy_engine(k3_tiny, "k3-tiny", [[1, 2, 3], [1, 2]], 4, batch=2, device="cpu", dtype="float32")


def test_holdout_split_and_best_weights():
    from k3rt.training.dspark import BestWeights, split_holdout
    pairs = torch.stack(torch.meshgrid(torch.arange(10), torch.arange(8, 20), indexing="ij"), -1).reshape(-1, 2)
    train, out = split_holdout(pairs, 10, 0.2, seed=0)
    held = set(out[:, 0].tolist())
    assert len(held) == 2 and not held & set(train[:, 0].tolist())  # whole sequences, disjoint
    assert train.shape[0] + out.shape[0] == pairs.shape[0]
    assert torch.equal(split_holdout(pairs, 10, 0.2, seed=0)[1], out)  # the same split every time
    assert split_holdout(pairs, 10, 0.0, seed=0)[1].shape[0] == 0
    assert len(set(split_holdout(pairs, 10, 0.01, seed=0)[1][:, 0].tolist())) == 1  # at least one sequence
    net = torch.nn.Linear(2, 2)
    best = BestWeights()
    assert best.update(1.5, 10, net)
    first = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    assert not best.update(1.4, 20, net) and not best.update(1.5, 30, net)  # worse, then a tie
    assert best.stale == 2 and best.step == 10
    best.restore(net)
    assert torch.equal(net.weight, first)


def test_gen_holds_out_whole_documents(monkeypatch):
    from k3rt.training import dspark
    from k3rt.training.corpus import Document
    docs = [Document("code", "train", f"m{i}.py", "\n".join(f"x{i}_{j} = {j}" for j in range(40))) for i in range(40)]
    docs.append(Document("code", "valid", "v.py", "y = 1\n" * 40))
    monkeypatch.setattr(dspark, "code_documents", lambda root: docs)
    prompts, held = dspark.training_prompts("train", 60, 12, seed=0, model="k3-tiny", holdout_frac=0.1)
    tok = load_tokenizer("k3-tiny")
    names = {i: f"m{i}.py" for i in range(40)}
    doc_of = [int(re.search(r"x(\d+)_", tok.decode(p)).group(1)) for p in prompts]
    held_docs = {names[d] for d, h in zip(doc_of, held) if h}
    assert held_docs and not held_docs & {names[d] for d, h in zip(doc_of, held) if not h}  # whole documents
    assert held == sorted(held, reverse=True) and 0 < sum(held) <= 6  # held-out prompts first, about 10%
    assert len({tuple(p) for p in prompts}) == len(prompts)  # no repeated window
    assert (prompts, held) == dspark.training_prompts("train", 60, 12, seed=0, model="k3-tiny", holdout_frac=0.1)
    with pytest.raises(ValueError, match="--holdout-docs"):
        dspark.training_prompts("valid", 4, 12, seed=0, model="k3-tiny", holdout_frac=0.1)  # one document


def test_train_captures_states_and_reports_holdout(k3_tiny, tmp_path: Path):
    from k3rt.training.dspark import main, states_and_next
    prompts = [[1] + [40 + 7 * i + j for j in range(9)] for i in range(6)]
    tokens = torch.tensor([p + p[1:7] for p in prompts])  # 16 tokens each; labels come from the target
    data = tmp_path / "tokens.pt"
    held = torch.tensor([False, True, False, False, True, False])  # gen --holdout-docs' marks
    torch.save({"tokens": tokens, "states": None, "next": None, "source": "greedy", "target_layers": [2, 5, 8],
                "target": "k3-tiny", "split": "train", "holdout": held}, data)
    out = tmp_path / "drafter"
    main(["train", "--data", str(data), "--out", str(out), "--max-steps", "3", "--batch", "8", "--eval-every", "0",
          "--context-len", "16", "--minutes", "5"])
    notes = json.loads((out / "training.json").read_text())
    h = notes["holdout"]
    assert notes["steps"] == 3 and [c["step"] for c in h["curve"]] == [1, 2, 3]
    assert h["anchors"] == 2 * (15 - 8) and h["by"].startswith("documents")  # the two marked, anchors 8..14 each
    assert all(c["tau_in"] >= 1 and c["tau_out"] >= 1 for c in h["curve"])
    assert h["best_tau_out"] == max(c["tau_out"] for c in h["curve"])
    assert notes["anchors"] == [4 * 7]  # the training anchors: the other four sequences
    assert load_drafter(out).cfg.context_len == 16
    for flag, value in (("--holdout-frac", "1"), ("--holdout-anchors", "0"), ("--eval-every", "-1")):
        with pytest.raises(ValueError, match=flag):
            main(["train", "--data", str(data), "--out", str(out), flag, value])


def test_shipped_drafter_proposes_and_beats_nothing(k3_tiny):
    from k3rt.training.dspark import code_prompts, greedy_with_states, replay_tau
    drafter = DSparkDrafter.from_folder(SHIPPED, k3_tiny)
    assert drafter.target_layers == (2, 5, 8) and drafter.model.cfg.block_size == 7
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) <= 10 * 2**20
    prompts = code_prompts("heldout", 4, 48, seed=0)
    tokens, states, _ = greedy_with_states(k3_tiny, prompts, 40, drafter.target_layers)
    w = drafter.context_len
    # the anchor is token 48 (not run yet): the states end at position 47
    queries = [DraftQuery(i, tokens[i, :49].tolist(), 48, 7, states[i, max(0, 48 - w): 48].float()) for i in range(4)]
    drafts = drafter.propose(queries)
    assert all(1 <= len(d) <= 7 and all(0 <= t < 8192 for t in d) for d in drafts)
    res = replay_tau(drafter.model, tokens, states, 48, drafter.embed, drafter.lm_head, 7)
    assert res["rounds"] >= 20
    # 1.63 when shipped (1.44 over 24 prompts); an untrained drafter of the same shape gets 1.0 here
    assert res["tau"] > 1.3, res
    fresh = DSparkModel(drafter.model.cfg)
    fresh.init_weights(0)
    assert replay_tau(fresh.eval(), tokens, states, 48, drafter.embed, drafter.lm_head, 7)["tau"] < res["tau"] - 0.2
    # the confidence schedule verifies fewer than k drafts on average and keeps most accepted tokens
    assert res["mean_verified_scheduled"] < 7 and res["tau_scheduled"] > 1.2, res


def test_genbench_checks_then_times_every_path(capsys):
    from k3rt.training.dspark import main
    main(["genbench", "--budget-s", "60", "--prompts", "2", "--batch", "2", "--dense-batch", "2", "--gen-len", "4",
          "--check-prompts", "2", "--check-len", "4", "--prompt-len", "16"])
    res = json.loads(capsys.readouterr().out.splitlines()[0])
    assert res["check"]["identical_to_cached"] == {"engine": 2, "dense": 2}
    rows = {r["path"]: r for r in res["paths"]}
    assert set(rows) == {"engine", "dense", "cached"} and all(r["sequences"] == 2 for r in rows.values())
    assert rows["dense"]["vs_dense"] == 1.0 and rows["engine"]["seq_per_min"] > 0
