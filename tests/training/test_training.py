"""Training the default model (k3-tiny): the training-only forms equal the reference layers, the loss
falls, a smoke run of scripts/train_default_model.py exports a checkpoint that the runtime's loader
reloads to the same logits and resumes exactly, the corpus is deterministic, and `k3-tiny` resolves
to the package folder wherever a model folder is accepted.

The corpus tests run on a miniature stdlib folder written here (a few real stdlib files plus planted
cases), so they do not depend on which CPython runs them.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.loader import build_model, load_model
from k3rt.backend.models.tiny import write_checkpoint
from k3rt.backend.tokenizer import load_tokenizer, write_trained_tokenizer
from k3rt.kernels.kda.ref import kda_chunked, kda_gate_lower_bound
from k3rt.model_config import load_model_config, param_count, parse_model_config
from k3rt.models import DEFAULT_MODEL, MODELS_DIR, resolve_model_dir
from k3rt.training import train as T
from k3rt.training.corpus import build_corpus, is_test_path, read_corpus, rename_locals, stdlib_dir, write_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def smoke_model(vocab: int = 512, seed: int = 0):
    cfg = parse_model_config({**T.SMOKE_CONFIG, "vocab_size": vocab})
    model = build_model(cfg)
    T.init_for_training(model, seed)
    with torch.no_grad():  # move off the init's zeros so mixing and routing are exercised
        for name, p in model.named_parameters():
            if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- training forms equal the reference -----------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 200, 3, 16), (1, 64, 2, 8), (2, 1, 2, 8), (1, 63, 2, 16), (1, 130, 1, 32)],
                         ids=lambda s: "B{}-T{}-H{}-D{}".format(*s))
def test_kda_chunked_fresh_matches_reference_and_gradients(shape) -> None:
    b, t, h, d = shape
    g_ = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(b, t, h, d, generator=g_, requires_grad=True) for _ in range(3))
    g = kda_gate_lower_bound(3 * torch.randn(b, t, h, d, generator=g_), torch.zeros(h), torch.zeros(h, d), -5.0)
    g.requires_grad_()
    beta = torch.rand(b, t, h, generator=g_, requires_grad=True)
    want, _, _ = kda_chunked(q, k, v, g, beta)
    got = T.kda_chunked_fresh(q, k, v, g, beta)
    assert rel(got, want) < 1e-5
    w = torch.randn(want.shape, generator=g_)
    grads_want = torch.autograd.grad((want * w).sum(), [q, k, v, g, beta])
    grads_got = torch.autograd.grad((got * w).sum(), [q, k, v, g, beta])
    for gw, gg in zip(grads_want, grads_got):
        assert torch.isfinite(gg).all()
        assert (gg - gw).abs().max() <= 1e-5 * max(1.0, gw.abs().max().item())


def test_kda_chunked_fresh_is_finite_at_the_gate_bound() -> None:
    q, k, v = (torch.randn(1, 256, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    beta = torch.full((1, 256, 2), 0.5)
    for fill in (-4.999, -1e-6):
        g = torch.full((1, 256, 2, 16), fill)
        got = T.kda_chunked_fresh(q, k, v, g, beta)
        assert torch.isfinite(got).all()
        assert rel(got, kda_chunked(q, k, v, g, beta)[0]) < 1e-5


def test_dense_path_matches_per_sequence_cached_path() -> None:
    model = smoke_model()
    ids = torch.randint(0, 512, (3, 70), generator=torch.Generator().manual_seed(1))
    dense = model(ids.reshape(-1), ForwardBatch([70] * 3))
    per_seq = torch.cat([model(ids[i], ForwardBatch.single(70, cache=model.new_cache())) for i in range(3)])
    assert ForwardBatch([70] * 3).dense_shape == (3, 70) and ForwardBatch([70, 69]).dense_shape is None
    assert rel(dense, per_seq) < 1e-5


def test_training_forms_match_reference_logits_and_count_routes() -> None:
    ref = smoke_model()
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(2))
    want = ref(ids.reshape(-1), ForwardBatch([100, 100]))
    trained = copy.deepcopy(ref)
    moes = T.use_training_moe(trained)
    assert T.use_fast_kda(trained) == 3
    got = T.window_logits(trained, ids)
    assert rel(got, want) < 1e-5
    k = trained.cfg.moe.num_experts_per_token
    assert [m.routed_counts.sum().item() for m in moes] == [200 * k] * len(moes)
    bias_before = [m.e_score_correction_bias.clone() for m in moes]
    T.balance_routers(moes, 0.01)
    for m, before in zip(moes, bias_before):
        assert m.routed_counts.sum() == 0
        assert ((m.e_score_correction_bias - before).abs() <= 0.01 + 1e-7).all()


def test_loss_decreases_on_a_repeated_batch() -> None:
    torch.manual_seed(0)
    model = smoke_model()
    T.make_trainable(model)
    moes = T.use_training_moe(model)
    T.use_fast_kda(model)
    assert not model.model.layers[1].mlp.e_score_correction_bias.requires_grad
    opt = torch.optim.AdamW(T.param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    ids = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    for step in range(25):
        nll, count = T.lm_loss(model, ids[:, :-1], ids[:, 1:])
        loss = nll / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        T.balance_routers(moes, 1e-3)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 2.0, losses


def test_dropout_hooks_drop_only_in_training_mode() -> None:
    ref = smoke_model()
    model = copy.deepcopy(ref)
    T.use_training_moe(model)
    handles = T.add_dropout(model, 0.5, 0.5)
    assert len(handles) == 1 + 2 * model.cfg.num_hidden_layers
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    want = T.window_logits(ref.eval(), ids)
    assert torch.equal(T.window_logits(model.eval(), ids), want)  # eval mode: the inference model exactly
    model.train()
    torch.manual_seed(7)
    a = T.window_logits(model, ids)
    torch.manual_seed(7)
    assert torch.equal(T.window_logits(model, ids), a)  # masks follow the global generator
    assert rel(a, want) > 0.05
    # the embedding hook zeroes about half of the embedding entries and scales the rest by 1 / (1 - p)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    T.window_logits(model, ids)
    emb = model.model.embed_tokens.weight[ids.reshape(-1)]
    kept = seen[0] != 0
    assert 0.4 < kept.float().mean().item() < 0.6
    assert torch.allclose(seen[0][kept], 2 * emb[kept])
    for h in handles:
        h.remove()
    assert torch.equal(T.window_logits(model, ids), T.window_logits(ref.train(), ids))


def test_weight_average_follows_its_rule_and_restores_the_model() -> None:
    model = smoke_model()
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # tied: averaged once, through the embedding
    ema = T.WeightAverage(model, decay=0.9)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = dict(start)
    for k in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ema.update(model)
        d = min(0.9, (1 + k) / (10 + k))  # 0.1, 0.1818..., 0.25: the warm-up, then capped at 0.9
        want = {n: d * want[n] + (1 - d) * p.detach() for n, p in model.named_parameters()}
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.applied(model):
        for n, p in model.named_parameters():
            assert torch.allclose(p, want[n], atol=1e-6), n
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    for n, p in model.named_parameters():
        assert torch.equal(p, trained[n]), n
    again = T.WeightAverage(smoke_model(seed=1), decay=0.5)
    again.load_state_dict(ema.state_dict())
    assert again.decay == 0.9 and again.num_updates == 3
    assert all(torch.equal(a, b) for a, b in zip(again.shadow, ema.shadow))
    with pytest.raises(ValueError):
        T.WeightAverage(model, decay=1.0)


def test_k3_tiny_config_fits_the_shipping_budget(tmp_path: Path) -> None:
    """The shipped model must stay <= 40 MB of bf16 weights in shards <= 15 MB (the repository travels to
    the training GPU with a size cap), whatever the training run does."""
    raw = {**T.K3_TINY_CONFIG, "bos_token_id": 8160, "eos_token_id": 8161, "pad_token_id": 8191}
    cfg = parse_model_config(raw)
    model = build_model(cfg, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)["total"]
    write_checkpoint(model, tmp_path, raw, dtype="bfloat16", max_shard_bytes=15_000_000)
    shards = list(tmp_path.glob("*.safetensors"))
    assert sum(p.stat().st_size for p in shards) <= 40_000_000
    assert len(shards) > 1 and all(p.stat().st_size <= 15_000_000 for p in shards)


def test_cosine_schedule() -> None:
    lrs = [T.cosine_lr(s, 100, 10, 1.0, 0.1) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_token_stream_is_deterministic_and_covers_each_epoch() -> None:
    docs = [list(range(i * 100, i * 100 + 90)) for i in range(10)]
    a, b = T.TokenStream(docs, 16, 4, seed=5), T.TokenStream(docs, 16, 4, seed=5)
    for step in (0, 3, a.steps_per_epoch + 1):
        assert torch.equal(a.batch(step)[0], b.batch(step)[0])
    starts = torch.cat([a.batch(s)[0][:, 0] for s in range(a.steps_per_epoch)])
    assert len(set(starts.tolist())) == a.steps_per_epoch * 4
    inputs, targets = a.batch(0)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_eval_windows_score_every_token_once() -> None:
    docs, texts = [[5, 6, 7, 8, 9], [1, 2]], ["abcdefg", "xy"]
    w = T.EvalWindows.build(docs, texts, seq_len=3, start_id=0)
    assert w.inputs.tolist() == [[0, 5, 6], [7, 8, 0], [0, 1, 0]]
    assert w.targets[w.mask].tolist() == [5, 6, 7, 8, 9, 1, 2] and w.num_bytes == 9


# ---- corpus ---------------------------------------------------------------------------------------

def mini_stdlib(root: Path) -> Path:
    """A stdlib-shaped folder: real modules for text, plus the cases the corpus rules must handle."""
    lib = root / "lib"
    real = stdlib_dir()
    for name in ("textwrap.py", "bisect.py", "abc.py", "copy.py", "dataclasses.py", "keyword.py"):
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(real / name, lib / name)
    (lib / "json").mkdir()
    shutil.copy(real / "json" / "decoder.py", lib / "json" / "decoder.py")
    files = {
        "test/test_textwrap.py": "import textwrap\n\ndef test_wrap():\n    assert textwrap.wrap('a b', 1)\n",
        "test/test_abc.py": "import abc\n\ndef test_abc():\n    assert abc.ABC\n    assert abc.ABCMeta\n",
        "bad_syntax.py": "def broken(:\n    pass\n",
        "encodings/cp9999.py": '""" Python Character Mapping Codec cp9999 generated from \'X.TXT\' with gencodec.py.\n"""\nx = 1\n',
        "site-packages/pkg.py": "x = 1\n",
        "_sysconfigdata__linux.py": "build_time_vars = {}\n",
        "dup_of_keyword.py": (real / "keyword.py").read_text(),
        "crlf.py": "def f():\r\n    return 1\r\n",
        "pydoc_data/topics.py": "topics = {'assert': 'The \"assert\" statement\\n*****\\n\\nAssert statements check.\\n',"
                                " 'if': 'The \"if\" statement\\n****\\n\\nIf selects.\\n'}\n",
    }
    for name, text in files.items():
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_bytes(text.encode())
    return lib


def test_corpus_is_deterministic_and_splits_by_module(tmp_path: Path) -> None:
    lib = mini_stdlib(tmp_path)
    a = build_corpus(lib, heldout=("textwrap", "json"), valid=("bisect",))
    b = build_corpus(lib, heldout=("textwrap", "json"), valid=("bisect",))
    assert a.meta["content_hash"] == b.meta["content_hash"] and a.documents == b.documents
    by_name = {d.name: d for d in a.documents}
    assert by_name["textwrap.py"].split == "heldout" and by_name["json/decoder.py"].split == "heldout"
    assert by_name["bisect.py"].split == "valid" and by_name["test/test_abc.py"].split == "train"
    for dropped in ("test/test_textwrap.py", "bad_syntax.py", "encodings/cp9999.py", "site-packages/pkg.py",
                    "_sysconfigdata__linux.py", "pydoc_data/topics.py"):
        assert dropped not in by_name, dropped
    assert "dup_of_keyword.py" in by_name and "keyword.py" not in by_name  # the first of identical files stays
    assert by_name["crlf.py"].text == "def f():\n    return 1\n"
    assert by_name["topics/assert"].kind == "doc" and by_name["topics/assert"].split == "train"
    chats = [d for d in a.documents if d.kind == "chat"]
    assert chats and all(d.split == "train" for d in chats)
    said = " ".join(m["content"] for d in chats for m in d.messages)
    assert "textwrap" not in said and "bisect" not in said  # nothing derived from held-out code
    assert a.meta["missing_modules"] == []

    # stand-alone functions: training split only, library and tests, each from its def line, dedented
    funcs = {d.name: d for d in a.documents if d.kind == "function"}
    assert funcs and all(d.split == "train" for d in funcs.values())
    assert not any(n.startswith(("textwrap.py", "json/", "bisect.py")) for n in funcs)
    assert funcs["test/test_abc.py:3"].text == "def test_abc():\n    assert abc.ABC\n    assert abc.ABCMeta"
    assert is_test_path("test/test_abc.py:3")
    source = by_name["dataclasses.py"].text.split("\n")
    line, method = next((int(n.split(":")[1]), d) for n, d in funcs.items()
                        if n.startswith("dataclasses.py:") and source[int(n.split(":")[1]) - 1].startswith("    def "))
    rows = method.text.split("\n")
    assert rows[0] == source[line - 1].strip() and not is_test_path(f"dataclasses.py:{line}")
    assert all(r == "" or source[line - 1 + i].endswith(r) for i, r in enumerate(rows))  # columns dropped, text kept
    assert all(3 <= d.text.count("\n") + 1 <= 40 for d in funcs.values())

    written = write_corpus(a, tmp_path / "corpus")
    assert read_corpus(written.parent).documents == a.documents
    meta = json.loads((tmp_path / "corpus" / "corpus.meta.json").read_text())
    assert meta["content_hash"] == a.meta["content_hash"]


RENAME_SOURCE = '''def split_words(self, text, sep=None, *, limit=-1):
    """Split text into words."""  # text stays in strings and comments
    words = [w for w in text.split(sep=sep) if w]
    if limit >= 0:
        words = words[:limit]
    try:
        self.count = len(words)
    except ValueError as err:
        raise err
    return {"n": len(words), "msg": f"{len(words)} from {text!r}"}'''


def test_rename_locals_renames_names_only_consistently_and_safely() -> None:
    a, b = rename_locals(RENAME_SOURCE, 0), rename_locals(RENAME_SOURCE, 1)
    assert a is not None and b is not None and a != b and a == rename_locals(RENAME_SOURCE, 0)
    new = ast.parse(a).body[0]
    params = [x.arg for x in new.args.args] + [x.arg for x in new.args.kwonlyargs]
    assert params[0] == "self" and "text" not in params and "limit" not in params and len(set(params)) == 4
    text_new, sep_new = params[1], params[2]
    # text, comments and string literals are untouched; only the Name / arg tokens changed
    assert '"""Split text into words."""  # text stays in strings and comments' in a
    assert f"{text_new}.split(sep={sep_new})" in a  # the keyword `sep=` names the callee's parameter: kept
    assert "self.count = len(" in a and "except ValueError as err:" in a and "raise err" in a  # attr, except-as
    assert f"{{{text_new}!r}}" in a  # inside the f-string too
    assert "words" not in a.split('"""')[2]  # every use of the local renamed
    assert rename_locals("def f(x):\n    return locals()[\"x\"]\n", 0) is None  # locals() sees names
    assert rename_locals("x = 1\n", 0) is None  # not a function
    match = "def f(p):\n    match p:\n        case [q]:\n            return q\n"
    assert rename_locals(match, 0) is None  # capture patterns bind names without Name nodes


# ---- the training script end to end ---------------------------------------------------------------

def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke_inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("smoke")
    corpus = build_corpus(mini_stdlib(root), heldout=("textwrap",), valid=("bisect",))
    write_corpus(corpus, root / "corpus")
    write_trained_tokenizer(root / "tok", [d.text for d in corpus.split("train", ("code", "doc"))], vocab_size=1024)
    return root / "corpus", root / "tok"


def _train(smoke_inputs, out: Path, work: Path, *extra: str) -> None:
    corpus, tok = smoke_inputs
    train = _load_script("train_default_model")
    # the regularizers are off by default (the shipped recipe); the smoke runs exercise them
    assert train.main(["--smoke", "--corpus", str(corpus), "--tokenizer", str(tok), "--out", str(out),
                       "--work-dir", str(work), "--export-dtype", "float32", "--max-steps", "8",
                       "--dropout", "0.1", "--embed-dropout", "0.1", "--ema-decay", "0.998", *extra]) == 0


def test_smoke_run_exports_what_the_loader_reloads(smoke_inputs, tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    _train(smoke_inputs, out, work, "--function-renames", "1", "--select-by", "bpb")
    report = json.loads((out / "training.json").read_text())
    # 8 steps of the schedule, then the default unlikelihood round: 2 steps in --smoke
    assert report["steps"] == 10 and report["cosine_horizon"] == 8 and report["stop_reason"] == "max steps"
    hp = report["hyperparameters"]
    assert hp["dropout"] > 0 and hp["embed_dropout"] > 0 and hp["ema_decay"] > 0  # the smoke run uses them
    assert (hp["ul_rounds"], hp["ul_steps"], hp["ul_prompts"], hp["ul_batch"], hp["ul_ngram"]) == (1, 2, 6, 2, 8)
    assert hp["ul_lr"] == pytest.approx(hp["lr"] * hp["min_lr_ratio"]) and report["selected_by"] == "bpb"
    # completions are capped at 6 tokens in --smoke, too short to repeat an 8-gram: nothing to push down, so
    # the round's 2 steps train on the corpus alone and report a zero unlikelihood loss
    [ul] = report["unlikelihood_rounds"]
    assert ul["round"] == 1 and ul["step"] == 8 and ul["prompts"] == 6
    assert (ul["runaways"], ul["marked_tokens"], ul["trained_on"], ul["ul_loss_first_last"]) == (0, 0, 0, [0.0, 0.0])
    assert 0 <= ul["capped"] <= 6 and 0.0 <= ul["train_complete_rate"] <= 1.0
    assert [e["step"] for e in report["evals"]] == [8, 10]  # the end of the schedule, then after the round
    for e in report["evals"]:
        assert set(e) == {"step", "valid_bpb", "valid_bpb_ema", "valid_complete", "valid_parse", "valid_eos_top1",
                          "valid_complete_ema", "valid_parse_ema", "valid_eos_top1_ema"}
    candidates = [(e[f"valid_bpb{x}"], e["step"], w)
                  for e in report["evals"] for w, x in (("raw", ""), ("ema", "_ema"))]
    chosen = min(candidates, key=lambda c: c[0])  # the lowest bits/byte, the first seen on a tie
    assert (report["valid_bits_per_byte_exported"], report["exported_step"], report["exported_weights"]) == chosen
    assert report["heldout_bits_per_byte"] == pytest.approx(report["heldout_bits_per_byte_shipped_weights"], abs=1e-3)
    assert report["loss_curve"][-1]["loss"] < report["loss_curve"][0]["loss"]
    assert (out / "tokenizer.json").read_bytes() == (smoke_inputs[1] / "tokenizer.json").read_bytes()
    exported_tok = load_tokenizer(out)  # trained with BOS first (--add-bos, the default), so it says so
    assert exported_tok.sequence_prefix == (exported_tok.bos_token_id,) and hp["add_bos"] is True
    assert all(p.stat().st_size <= 15_000_000 for p in out.glob("*.safetensors"))

    ck = torch.load(work / "ckpt.pt", weights_only=False)
    trained = build_model(load_model_config(out))
    trained.load_state_dict(ck["best"]["state"])  # the exported weights: raw or EMA, the better on validation
    shipped = load_model(out, progress=False)
    ids = torch.randint(0, trained.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    batch = ForwardBatch([40, 40])
    assert torch.equal(shipped(ids.reshape(-1), batch), trained.eval()(ids.reshape(-1), batch))


def test_smoke_run_selects_by_the_function_test(smoke_inputs, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _train(smoke_inputs, out, tmp_path / "work", "--select-by", "function", "--eval-every", "3", "--ul-rounds", "0")
    report = json.loads((out / "training.json").read_text())
    assert [e["step"] for e in report["evals"]] == [3, 6, 8] and report["selected_by"] == "function"
    assert report["steps"] == 8 and report["unlikelihood_rounds"] == []
    candidates = {(e["step"], w): (e[f"valid_complete{x}"], e[f"valid_parse{x}"], -e[f"valid_bpb{x}"])
                  for e in report["evals"] for w, x in (("raw", ""), ("ema", "_ema"))}
    best = max(candidates.values())
    # the first candidate of the best rank, in the order they were seen
    chosen = next(k for k, v in candidates.items() if v == best)
    assert (report["exported_step"], report["exported_weights"]) == chosen
    fn = report["valid_function_test_exported"]
    assert (fn["valid_complete"], fn["valid_parse"], -report["valid_bits_per_byte_exported"]) == best
    with pytest.raises(SystemExit):
        _train(smoke_inputs, out, tmp_path / "work", "--select-by", "function", "--function-cases", "0")


def test_smoke_run_calibrates_its_horizon_with_a_validation(smoke_inputs, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _train(smoke_inputs, out, tmp_path / "work", "--max-steps", "0", "--time-budget-s", "12",
           "--calibrate-steps", "2", "--max-epochs", "1", "--ul-rounds", "0")
    report = json.loads((out / "training.json").read_text())
    assert report["evals"][0]["step"] == 7  # 5 warm-up steps + 2 timed, then the timed validation
    assert report["cosine_horizon"] > 7 and report["steps"] <= report["cosine_horizon"]
    assert report["stop_reason"] in ("max steps", "time budget")


def test_smoke_run_resumes_exactly(smoke_inputs, tmp_path: Path) -> None:
    # the main schedule only (--ul-rounds 0); the rounds: test_smoke_run_unlikelihood_rounds_and_resuming_a_finished_run
    _train(smoke_inputs, tmp_path / "a", tmp_path / "wa", "--ul-rounds", "0")
    _train(smoke_inputs, tmp_path / "b", tmp_path / "wb", "--ul-rounds", "0", "--stop-after-steps", "5")
    assert torch.load(tmp_path / "wb" / "ckpt.pt", weights_only=False)["step"] == 5
    _train(smoke_inputs, tmp_path / "b", tmp_path / "wb", "--ul-rounds", "0", "--resume")
    a = torch.load(tmp_path / "wa" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "wb" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["ema"]["num_updates"] == b["ema"]["num_updates"] == 8
    for k in a["ema"]["shadow"]:
        assert torch.equal(a["ema"]["shadow"][k], b["ema"]["shadow"][k]), k


def test_smoke_run_unlikelihood_rounds_and_resuming_a_finished_run(smoke_inputs, tmp_path: Path) -> None:
    """Two unlikelihood rounds on 1-gram repeats (any token the capped completion already produced), the
    second replaying the first's runaways; then --resume with the same arguments changes nothing."""
    from k3rt.training.function_test import select_functions
    from k3rt.training.unlikelihood import repeated_ngram_mask

    out, work = tmp_path / "out", tmp_path / "work"
    args = ("--ul-rounds", "2", "--ul-ngram", "1", "--ul-replay", "4", "--select-by", "function")
    _train(smoke_inputs, out, work, *args)
    report = json.loads((out / "training.json").read_text())
    r1, r2 = report["unlikelihood_rounds"]
    assert report["steps"] == 12 and report["cosine_horizon"] == 8 and report["stop_reason"] == "max steps"
    assert (r1["round"], r1["step"], r2["round"], r2["step"]) == (1, 8, 2, 10)  # each round: ul_steps = 2 steps
    for r in (r1, r2):
        assert r["prompts"] == 6 and r["runaways"] <= r["capped"] <= 6 and 0.0 <= r["train_complete_rate"] <= 1.0
        # the seeded smoke model does loop: this run exercises the loss, not only the corpus steps
        assert r["runaways"] > 0 and r["marked_tokens"] >= r["runaways"]
        assert len(r["ul_loss_first_last"]) == 2 and all(x > 0 for x in r["ul_loss_first_last"])
        assert r["generate_s"] <= r["round_s"]
    assert r1["trained_on"] == r1["runaways"]  # nothing to replay yet
    assert r2["trained_on"] == r2["runaways"] + min(4, r1["trained_on"])
    # the validation after each round is part of the selection
    assert [e["step"] for e in report["evals"]] == [8, 10, 12]
    candidates = {(e["step"], w): (e[f"valid_complete{x}"], e[f"valid_parse{x}"], -e[f"valid_bpb{x}"])
                  for e in report["evals"] for w, x in (("raw", ""), ("ema", "_ema"))}
    best = max(candidates.values())
    assert (report["exported_step"], report["exported_weights"]) == next(k for k, v in candidates.items() if v == best)
    # the loss curve's row at step 10 is the last step of round 1, on the first round's 10-step lr ramp (2 / 10)
    [row] = [h for h in report["loss_curve"] if h["step"] == 10]
    assert row["ul_loss"] == r1["ul_loss_first_last"][1]
    assert row["lr"] == pytest.approx(report["hyperparameters"]["ul_lr"] * 2 / 10)

    ck = torch.load(work / "ckpt.pt", weights_only=False)
    assert ck["ul_rounds_done"] == 2 and ck["ul_log"] == report["unlikelihood_rounds"] and ck["step"] == 12
    # the replay pool after round 2: its own runaways first, then round 1's
    replay = ck["ul_replay"]
    assert len(replay) == r2["trained_on"]
    assert sum(map(sum, (m for _, m in replay[:r2["runaways"]]))) == r2["marked_tokens"]
    if r1["trained_on"] <= 4:  # all of round 1's were kept
        assert sum(map(sum, (m for _, m in replay[r2["runaways"]:]))) == r1["marked_tokens"]
    # each is a training function's header + a completion cut at the cap (6 tokens in --smoke), its mask the
    # 1-gram repeats of the completion
    tok = load_tokenizer(out)
    headers = [tok.encode_prompt(c.header) for c in select_functions(read_corpus(smoke_inputs[0]).split(
        "train", ("code",)), 20_000)]
    for ids, mask in replay:
        prompt = max((h for h in headers if ids[:len(h)] == h), key=len)
        assert len(ids) == len(prompt) + 6 and mask == repeated_ngram_mask(ids, len(prompt), 1) and any(mask)

    # resuming the finished run: no more steps or rounds, the same log, replay and weights
    _train(smoke_inputs, out, work, *args, "--resume")
    again = json.loads((out / "training.json").read_text())
    assert again["unlikelihood_rounds"] == report["unlikelihood_rounds"] and again["steps"] == 12
    assert again["evals"] == report["evals"] and again["exported_step"] == report["exported_step"]
    ck2 = torch.load(work / "ckpt.pt", weights_only=False)
    assert (ck2["step"], ck2["ul_rounds_done"], ck2["ul_log"]) == (12, 2, ck["ul_log"])
    assert ck2["ul_replay"] == ck["ul_replay"]  # restored from the checkpoint, saved again
    for k in ck["model"]:
        assert torch.equal(ck["model"][k], ck2["model"][k]), k


def test_smoke_run_stopped_early_leaves_the_rounds_to_the_resume(smoke_inputs, tmp_path: Path) -> None:
    # a call stopped mid-schedule runs no round; its resume finishes the schedule, then the round, exactly
    # as the uninterrupted run does
    _train(smoke_inputs, tmp_path / "b", tmp_path / "wb", "--stop-after-steps", "5")  # the default round
    report = json.loads((tmp_path / "b" / "training.json").read_text())
    assert report["stop_reason"] == "--stop-after-steps"
    assert report["steps"] == 5 and report["unlikelihood_rounds"] == []
    _train(smoke_inputs, tmp_path / "b", tmp_path / "wb", "--resume")
    _train(smoke_inputs, tmp_path / "a", tmp_path / "wa")
    a = torch.load(tmp_path / "wa" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "wb" / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 10 and [r["step"] for r in b["ul_log"]] == [8]
    assert [{k: v for k, v in r.items() if not k.endswith("_s")} for r in a["ul_log"]] == \
        [{k: v for k, v in r.items() if not k.endswith("_s")} for r in b["ul_log"]]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


# ---- name resolution ------------------------------------------------------------------------------

def test_k3_tiny_resolves_to_the_package_folder(tmp_path: Path) -> None:
    shipped = MODELS_DIR / "k3-tiny"
    assert DEFAULT_MODEL == "k3-tiny" and shipped.is_dir()
    assert resolve_model_dir("k3-tiny") == shipped and resolve_model_dir(None) == shipped
    assert resolve_model_dir(tmp_path) == tmp_path  # an existing folder wins
    assert resolve_model_dir("no-such-model") == Path("no-such-model")
    from k3rt.cli import build_parser

    for cmd in (["generate", "--prompt", "x"], ["serve"]):
        assert build_parser().parse_args(cmd).model == "k3-tiny"
    assert load_tokenizer("k3-tiny").vocab_size == T.K3_TINY_CONFIG["vocab_size"]


@pytest.mark.skipif(not (MODELS_DIR / "k3-tiny" / "config.json").is_file(), reason="k3-tiny weights not shipped yet")
def test_shipped_k3_tiny_loads_by_name() -> None:
    cfg = load_model_config("k3-tiny")
    assert cfg.arch == "kimi_k3" and cfg.vocab_size == load_tokenizer("k3-tiny").vocab_size
    model = load_model("k3-tiny", dtype="float32", progress=False)
    ids = torch.tensor(load_tokenizer("k3-tiny").encode("def add(a, b):\n    return"))
    logits = model(ids, ForwardBatch.single(len(ids)))
    assert torch.isfinite(logits).all()
    weights = sum(p.stat().st_size for p in (MODELS_DIR / "k3-tiny").glob("*.safetensors"))
    assert weights <= 40_000_000 and all(p.stat().st_size <= 15_000_000 for p in (MODELS_DIR / "k3-tiny").glob("*.safetensors"))


def test_encode_documents_equals_tokenizer_encode(smoke_inputs, tmp_path: Path) -> None:
    corpus_dir, tok_dir = smoke_inputs
    tok = load_tokenizer(tok_dir)
    docs = read_corpus(corpus_dir).documents
    docs = [d for d in docs if d.kind == "chat"][:5] + [d for d in docs if d.kind != "chat"][:5]
    want = [[*(tok.encode(tok.apply_chat_template(list(d.messages), add_generation_prompt=False))
               if d.kind == "chat" else tok.encode(d.text, allow_special=False)), tok.eos_token_ids[0]] for d in docs]
    assert T.encode_documents(docs, tok) == want
    assert T.eval_documents(docs, tok) == [w[:-1] for w in want] and T.sequence_start(tok) == tok.eos_token_ids[0]

    # an add_bos_token tokenizer: every document starts with BOS, which evaluation gives as the start token
    shutil.copytree(tok_dir, tmp_path / "bos")
    config = json.loads((tmp_path / "bos" / "tokenizer_config.json").read_text())
    (tmp_path / "bos" / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    bos_tok = load_tokenizer(tmp_path / "bos")
    bos = bos_tok.bos_token_id
    assert bos is not None and bos_tok.sequence_prefix == (bos,)
    assert T.encode_documents(docs, bos_tok) == [[bos, *w] for w in want]
    assert T.eval_documents(docs, bos_tok) == [w[:-1] for w in want] and T.sequence_start(bos_tok) == bos


def test_training_documents_choose_functions_and_add_renamed_copies(smoke_inputs) -> None:
    corpus = read_corpus(smoke_inputs[0])
    train = _load_script("train_default_model")
    plain = train.training_documents(corpus, "all")
    assert plain == corpus.split("train")
    library = train.training_documents(corpus, "library")
    assert {d.name for d in plain} - {d.name for d in library} == {d.name for d in plain
                                                                   if d.kind == "function" and is_test_path(d.name)}
    assert not [d for d in train.training_documents(corpus, "none") if d.kind == "function"]
    renamed = train.training_documents(corpus, "all", renames=2, seed=3)
    extra = renamed[len(plain):]
    assert renamed[:len(plain)] == plain and extra and all(d.kind == "function" for d in extra)
    originals = {d.name: d.text for d in plain}
    for d in extra:
        name, copy_ = d.name.rsplit("#renamed", 1)
        assert copy_ in ("0", "1") and d.text != originals[name]
    assert extra == train.training_documents(corpus, "all", renames=2, seed=3)[len(plain):]  # seeded


def test_function_test_counts_only_completions_that_end_and_parse() -> None:
    from k3rt.training import function_test as ev
    header = 'def f(x):\n    """Double x."""\n'
    assert ev.function_end("    return 2 * x\n\ndef g():\n") == len("    return 2 * x\n\n")
    assert ev.function_end("    return 2 * x\n") is None
    ended = ev.score_completion(header, "    return 2 * x\n", "dedent")
    assert ended == {"parses": True, "ended": True, "complete": True}
    # a repetition loop cut at the token cap on a line boundary parses, but never reached the function's end
    loop = ev.score_completion(header, "    y = x\n" * 40, "length")
    assert loop == {"parses": True, "ended": False, "complete": False}
    assert ev.score_completion(header, "    return (x\n", "stop") == {"parses": False, "ended": True, "complete": False}
    assert ev.score_completion(header, "\n  \n", "stop")["complete"] is False  # the docstring alone parses
    rows = [{"stop": "dedent", "completion": "    return 2 * x\n", "header": header,
             "reference": header + "    y = 2 * x\n    return y\n", **ended},
            {"stop": "length", "completion": "    y = x\n" * 40, **loop},
            {"stop": "stop", "completion": "    return (x\n", "parses": False, "ended": True, "complete": False}]
    fc = ev.summarize(rows, "heldout", 256)
    assert (fc["complete_rate"], fc["parse_rate"]) == (0.333, 0.667)
    assert fc["stops"] == {"dedent": 1, "length": 1, "stop": 1} and fc["num_functions"] == 3
    # the shape of the one complete completion (the loop that parses does not count)
    assert {k: fc[k] for k in ("complete_mean_lines", "reference_mean_lines", "complete_docstring_only",
                               "complete_with_repeated_line")} == {
        "complete_mean_lines": 1.0, "reference_mean_lines": 2.0, "complete_docstring_only": 0,
        "complete_with_repeated_line": 0}
    assert fc["max_tokens"] == 256 and fc["cases"] is rows and fc["split"] == "heldout"


@pytest.mark.skipif(not (MODELS_DIR / "k3-tiny" / "config.json").is_file(), reason="k3-tiny weights not shipped yet")
def test_training_function_test_matches_the_engine_on_the_shipped_model(smoke_inputs, tmp_path: Path) -> None:
    """The training run's function test (a copy of its weights in an Engine) completes exactly as
    scripts/eval_default_model.py does from the export."""
    from k3rt.training.function_test import score_rows, select_functions

    corpus = read_corpus(smoke_inputs[0])
    cases = select_functions(corpus.split("heldout", ("code",)) + corpus.split("valid", ("code",)), 4)
    assert len(cases) == 4
    tok = load_tokenizer("k3-tiny")
    raw = json.loads((MODELS_DIR / "k3-tiny" / "config.json").read_text())
    model = load_model("k3-tiny", dtype="float32", device="cpu", progress=False).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = _load_script("train_default_model").engine_completions(
        model, raw, tok, [tok.encode_prompt(c.header) for c in cases], max_tokens=12, folder=tmp_path / "engine")
    training = score_rows(cases, [r for r, _ in done])
    engine = _load_script("eval_default_model").complete_functions(MODELS_DIR / "k3-tiny", cases, device="cpu",
                                                                   dtype="float32", max_tokens=12)
    assert training == engine
    assert [r["qualname"] for r in training] == [c.qualname for c in cases]
    assert all(r["tokens"] <= 12 and (r["stop"] == "length") == (not r["ended"]) for r in training)
    eos = set(tok.eos_token_ids)
    for r, gen in done:  # the ids are the completion's: one per step up to the one that ended it
        assert len(gen) == r["tokens"]
        assert tok.decode([t for t in gen if t not in eos], skip_special_tokens=True).startswith(r["completion"])
    assert json.loads((tmp_path / "engine" / "config.json").read_text())["torch_dtype"] == "float32"
    after = model.state_dict()  # the training model itself is untouched: the Engine ran a copy
    assert all(torch.equal(before[k], after[k]) for k in before) and not model.training


@pytest.mark.skipif(not (MODELS_DIR / "k3-tiny" / "config.json").is_file(), reason="k3-tiny weights not shipped yet")
def test_end_probe_reads_eos_after_each_true_function(smoke_inputs) -> None:
    from k3rt.training.function_test import select_functions

    corpus = read_corpus(smoke_inputs[0])
    cases = select_functions(corpus.split("heldout", ("code",)) + corpus.split("valid", ("code",)), 5)
    tok = load_tokenizer("k3-tiny")
    model = load_model("k3-tiny", dtype="float32", progress=False).eval()
    eos, p, top = tok.eos_token_ids[0], [], []
    for c in cases:  # one sequence at a time, in the training documents' form: no newline after the last line
        ids = torch.tensor(tok.encode_prompt(c.reference.rstrip("\n")))
        probs = torch.softmax(model(ids, ForwardBatch.single(len(ids)))[-1].float(), dim=-1)
        p.append(probs[eos].item())
        top.append(int(probs.argmax()) == eos)
    got = T.end_probe(model, tok, cases, batch_size=2)
    assert got["eos_top1_rate"] == round(sum(top) / len(top), 3)
    assert got["eos_p_median"] == pytest.approx(float(torch.tensor(p).median()), abs=1.5e-3)
    assert T.end_probe(model, tok, []) == {"eos_top1_rate": 0.0, "eos_p_median": 0.0}
