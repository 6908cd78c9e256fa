#!/usr/bin/env python3
"""Train k3-tiny, the default model shipped with k3rt, with k3rt's own model modules.

    # once, on the machine whose stdlib is the corpus (writes .cache/corpus and the tokenizer):
    python scripts/prepare_corpus.py
    # one GPU call (the corpus folder travels; see k3rt/models/k3-tiny/README.md):
    python scripts/train_default_model.py --device cuda --out $OUT/k3-tiny --seed 1   # the shipped k3-tiny

Steps: read the corpus (content hash printed), load the tokenizer (--tokenizer, trained on the
training split by prepare_corpus.py), tokenize, build KimiForCausalLM from K3_TINY_CONFIG, train
(AdamW, warmup + cosine, clipping, bf16 autocast on GPU, dropout, an EMA of the weights, seeded),
then --ul-rounds unlikelihood rounds (training/unlikelihood.py: the Engine completes training
function headers greedily with the current weights; the completions that ran into the cap have their
repeated n-grams made unlikely for --ul-steps steps beside the corpus loss); at every validation score
bits/byte and the function test (training/function_test.py through the Engine: --function-cases
validation functions) on the validation modules (corpus.VALIDATION_MODULES), keep the best checkpoint
among the raw and the averaged weights by --select-by (the function test, or bits/byte), evaluate
held-out bits/byte beside a unigram baseline, export config.json + bf16 safetensors shards (<= 15 MB)
+ tokenizer + training.json into --out, then reload the export through the runtime's loader and
evaluate it again.

Recipe (the corpus is small and cannot grow, so the run is data-limited). The defaults are recipe 5
(2026-11-30, commit 000c947); the shipped k3-tiny is its seed 1 (`--seed 1`, the better of seeds 0 and
1 on the validation function test). 12.1M parameters (K3_TINY_CONFIG), no dropout, every document
starts with [BOS] (--add-bos; the export's tokenizer says `add_bos_token`, so every prompt starts so
too), the corpus's stand-alone function documents (library and tests, --function-docs all) plus one
copy of each with its parameters and locals renamed (--function-renames 1: 16.1M training tokens), a
fixed 1,000-step cosine schedule to 10 % of the peak (--max-steps 1000: about one pass, 185 s on an
H200), then one unlikelihood round of 50 steps on 8-gram repeats at the final lr (--ul-rounds 1
--ul-ngram 8), validation every 500 steps and after the round, export by the validation function
test (--select-by function): 261 s in all. Function test on the held-out modules (completions that end
and parse, scripts/eval_default_model.py): recipe 4 39 % -> 74 %; held-out bits/byte 1.2148 -> 1.2475.
Without the round, longer training lowers bits/byte but the function test with it: the model learns to
continue (and loop) rather than to end. Later unlikelihood rounds swing the model between ending at once
and looping again, with or without --ul-replay; see the model card. Tried and not shipped, all on the
H200 (function test on the validation modules, which is what recipes are chosen by; see the model card):
- recipe 1 (the first k3-tiny): no BOS, no function documents.
- recipe 2 (commit 4ff9901): hidden 512 / 19.0M parameters, dropout 0.1 on the embeddings and every
  sub-layer output, `--ema-decay 0.998`, cosine to 2 %, at most 5 epochs.
- recipe 3 (commit 5c3f630): no renamed copies, the horizon calibrated from a 480 s budget (2,884
  steps, best validation bits/byte at step 2200): held-out 1.1483, validation function test 25 %.
- recipe 4 (commit 26151b5, shipped before recipe 5): recipe 5 without the unlikelihood round:
  held-out 1.2148, function test 39 % held-out, 34 % validation; with 1,600 steps 27 %; with the horizon
  calibrated from the budget (3,011 steps, exported at 1800) 19 % (GPU run).
- --function-renames 2, or batch 64 at lr 3e-3, for ~1 pass on a GPU shared by four runs: validation 24 %
  and 26 % (GPU runs).
The regularizers stay available as flags (`--dropout`, `--embed-dropout`, `--ema-decay`; 0 = off).

Time: --time-budget-s bounds the whole run (default 480 s). With --max-steps 0, the cosine horizon is
calibrated from the measured step time after --calibrate-steps steps plus the time of one validation
(run then) spread over --eval-every steps, leaving the reserve
for the final evaluation and export, and capped at --max-epochs passes over the training tokens (the
corpus is small: more passes overfit). The horizon is stored in the checkpoint so --resume continues
the same schedule. The loop also stops early when the budget is reached, and always saves and exports.

Resume: a checkpoint (model, optimizer, EMA, step, horizon, log, best state) goes to --work-dir every
--ckpt-every steps and at the end; --resume continues from it. Batches and dropout masks depend only on
(seed, step): the global torch generator is reseeded before every step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bootstrap import ROOT, import_k3rt  # noqa: E402

import_k3rt()

from k3rt.backend.models.loader import build_model, load_model  # noqa: E402
from k3rt.backend.models.tiny import write_checkpoint  # noqa: E402
from k3rt.backend.tokenizer import load_tokenizer, write_trained_tokenizer  # noqa: E402
from k3rt.model_config import param_count, parse_model_config  # noqa: E402
from k3rt.training import train as T  # noqa: E402
from k3rt.training.corpus import Document, is_test_path, read_corpus, rename_locals  # noqa: E402
from k3rt.training.function_test import score_rows, select_functions, summarize  # noqa: E402
from k3rt.training.unlikelihood import (RunawaySequence, UnlikelihoodBatch, runaway_sequences,  # noqa: E402
                                        unlikelihood_loss)

MAX_SHARD_BYTES = 15_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=ROOT / ".cache" / "corpus", help="corpus folder (prepare_corpus.py)")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "k3rt" / "models" / "k3-tiny",
                   help="folder with tokenizer.json (trained into --work-dir from the corpus if absent)")
    p.add_argument("--out", type=Path, default=ROOT / "k3rt" / "models" / "k3-tiny", help="export folder")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "train", help="checkpoints, token cache, logs")
    p.add_argument("--resume", action="store_true", help="continue from --work-dir/ckpt.pt")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="toy model and sizes on CPU, a few steps (tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--function-docs", choices=["none", "library", "all"], default="all",
                   help="stand-alone function documents trained on: none, library code's, or tests' too")
    p.add_argument("--function-renames", type=int, default=1,
                   help="extra copies of each function document with its parameters and locals renamed")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=True,
                   help="start every document with [BOS] and export add_bos_token, so every prompt starts so too")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32, help="windows per step (tokens/step = this * seq-len)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0, help="dropout on every mixer and FFN output (training only)")
    p.add_argument("--embed-dropout", type=float, default=0.0, help="dropout on the token embeddings (training only)")
    p.add_argument("--ema-decay", type=float, default=0.0,
                   help="EMA of the weights, evaluated beside the raw ones at each validation; 0: off")
    p.add_argument("--router-bias-rate", type=float, default=1e-3, help="aux-loss-free balancing step per update")
    p.add_argument("--max-steps", type=int, default=1000, help="cosine horizon; 0: calibrate from the time budget")
    p.add_argument("--max-epochs", type=float, default=6.0, help="cap on the calibrated horizon, in passes")
    p.add_argument("--stop-after-steps", type=int, default=0,
                   help="end this call after that many steps, keeping the schedule (resume later with --resume)")
    p.add_argument("--calibrate-steps", type=int, default=30, help="steps timed before fixing the horizon")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="wall clock for the whole run, export included")
    p.add_argument("--reserve-s", type=float, default=None, help="kept for final eval + export (default max(20, 5%%))")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=500, help="validation eval (and best-checkpoint) interval")
    p.add_argument("--valid-windows", type=int, default=0, help="validation windows scored per eval (0: all)")
    p.add_argument("--function-cases", type=int, default=100,
                   help="validation functions completed greedily at each eval (training/function_test.py; about "
                        "30 s for 100 on an H200); 0: off")
    p.add_argument("--function-max-tokens", type=int, default=256, help="completion cap of that test")
    p.add_argument("--select-by", choices=["bpb", "function"], default="function",
                   help="checkpoint exported: best validation bits/byte, or best validation function test "
                        "(completions that end and parse, then those that parse, then bits/byte)")
    p.add_argument("--final-eval-windows", type=int, default=0, help="held-out windows scored at the end (0: all)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this export's weights (a k3rt model folder) as if its --max-steps of maximum "
                        "likelihood were done: only the unlikelihood rounds run (fine-tuning experiments)")
    p.add_argument("--ul-rounds", type=int, default=1,
                   help="unlikelihood rounds after the main schedule (training/unlikelihood.py): each "
                        "completes --ul-prompts training-function headers greedily through the Engine, then "
                        "trains --ul-steps steps on the corpus plus the runaway completions' repeats; 0: off")
    p.add_argument("--ul-steps", type=int, default=50, help="optimizer steps per unlikelihood round")
    p.add_argument("--ul-prompts", type=int, default=512, help="training-function headers completed per round")
    p.add_argument("--ul-batch", type=int, default=16, help="runaway completions per unlikelihood step")
    p.add_argument("--ul-replay", type=int, default=0,
                   help="runaway completions of earlier rounds kept beside the new ones (newest first); tried "
                        "against later rounds' swings and measured no better (model card)")
    p.add_argument("--ul-weight", type=float, default=1.0, help="weight of the unlikelihood loss beside the LM loss")
    p.add_argument("--ul-ngram", type=int, default=8, help="a completion token is penalized when it completes a "
                                                            "repeat of an n-gram of this many tokens")
    p.add_argument("--ul-lr", type=float, default=None, help="learning rate of the rounds (default: the schedule's "
                                                             "final lr, --lr * --min-lr-ratio)")
    p.add_argument("--kda", choices=["fast", "ref"], default="fast",
                   help="KDA core while training: fast (train.kda_chunked_fresh) or ref (kernels/kda/ref.py)")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--export-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--commit", default=None, help="source commit recorded in training.json (default: git HEAD)")
    a = p.parse_args(argv)
    if a.smoke:
        a.device = "cpu"
        for k, v in {"seq_len": 64, "batch_size": 8, "warmup_steps": 5, "log_every": 5, "eval_every": 10,
                     "valid_windows": 16, "final_eval_windows": 16, "calibrate_steps": 5, "ckpt_every": 10,
                     "function_cases": 3, "function_max_tokens": 6, "ul_steps": 2, "ul_prompts": 6,
                     "ul_batch": 2}.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
        if a.max_steps == p.get_default("max_steps"):
            a.max_steps = 20
    if a.select_by == "function" and a.function_cases <= 0:
        p.error("--select-by function needs --function-cases > 0")
    if a.init_from is not None and a.max_steps <= 0:
        p.error("--init-from needs --max-steps > 0: the schedule the exported weights are taken to have finished")
    if a.ul_lr is None:
        a.ul_lr = a.lr * a.min_lr_ratio
    if a.reserve_s is None:
        a.reserve_s = max(20.0, 0.05 * a.time_budget_s) if not a.smoke else 0.0
    return a


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def file_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def load_or_train_tokenizer(a: argparse.Namespace, corpus) -> Path:
    """The tokenizer folder to train with and export: --tokenizer, or one trained on the training split; with
    --add-bos a copy whose tokenizer_config.json says `add_bos_token` (every sequence starts with BOS)."""
    src = a.tokenizer
    if not (src / "tokenizer.json").is_file():
        src = a.work_dir / "tokenizer"
        if not (src / "tokenizer.json").is_file():
            log(f"no tokenizer in {a.tokenizer}: training one on the training split into {src}")
            write_trained_tokenizer(src, [d.text for d in corpus.split("train", ("code", "doc"))],
                                    vocab_size=T.K3_TINY_CONFIG["vocab_size"])
    config = json.loads((src / "tokenizer_config.json").read_text())
    if bool(config.get("add_bos_token", False)) == a.add_bos:
        return src
    out = a.work_dir / ("tokenizer-bos" if a.add_bos else "tokenizer-nobos")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": a.add_bos}, indent=2,
                                                          ensure_ascii=False) + "\n")
    return out


def training_documents(corpus, function_docs: str, renames: int = 0, seed: int = 0) -> list:
    """The training split, with the corpus's stand-alone function documents as --function-docs says:
    none, library (not from test files) or all; plus, per chosen function, `renames` copies with its
    parameters and locals renamed (`corpus.rename_locals`, seeded by seed, name and copy; functions where
    renaming is not provably safe get none)."""
    docs = [d for d in corpus.split("train") if d.kind != "function" or function_docs == "all"
            or (function_docs == "library" and not is_test_path(d.name))]
    jobs = [(d.name, d.text, k, seed) for d in docs if d.kind == "function" for k in range(renames)]
    if not jobs:
        return docs
    # ~1 ms of ast work per copy: spread over the CPUs (each copy depends only on its job, so the order is fixed)
    workers = min(16, os.cpu_count() or 1)
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        texts = list(pool.map(_renamed_copy, jobs, chunksize=max(1, len(jobs) // (8 * workers))))
    return docs + [Document("function", "train", f"{name}#renamed{k}", text)
                   for (name, _, k, _), text in zip(jobs, texts) if text is not None]


def _renamed_copy(job: tuple[str, str, int, int]) -> str | None:
    name, text, k, seed = job
    digest = hashlib.sha256(f"{seed}/{name}/{k}".encode()).digest()
    return rename_locals(text, int.from_bytes(digest[:8], "big"))


def encode(a: argparse.Namespace, corpus, tok, tok_dir: Path) -> dict[str, list[list[int]]]:
    """Token ids of the train / valid / heldout documents, cached in --work-dir by corpus + tokenizer hash.
    Evaluation documents lose their sequence prefix and trailing EOS (`train.eval_documents`)."""
    key = hashlib.sha256((corpus.meta["content_hash"] + f"{a.function_docs}/{a.function_renames}/{a.seed}"
                          + file_hash([tok_dir / f for f in TOKENIZER_FILES])).encode())
    cache = a.work_dir / f"tokens-{key.hexdigest()[:16]}.pt"
    if cache.is_file():
        return {split: [d.tolist() for d in docs] for split, docs in torch.load(cache).items()}
    ids = {"train": T.encode_documents(training_documents(corpus, a.function_docs, a.function_renames, a.seed), tok),
           **{split: T.eval_documents(corpus.split(split), tok) for split in ("valid", "heldout")}}
    a.work_dir.mkdir(parents=True, exist_ok=True)
    torch.save({split: [torch.tensor(d, dtype=torch.int32) for d in docs] for split, docs in ids.items()}, cache)
    return ids


def model_config(a: argparse.Namespace, tok) -> dict:
    raw = dict(T.SMOKE_CONFIG if a.smoke else T.K3_TINY_CONFIG)
    raw.update(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_ids[0],
               pad_token_id=tok.pad_token_id)
    return raw


def write_report(a: argparse.Namespace, report: dict) -> None:
    for folder in (a.out, a.work_dir):
        (folder / "training.json").write_text(json.dumps(report, indent=1) + "\n")


def save_checkpoint(path: Path, model, opt, ema: T.WeightAverage | None, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "ema": None if ema is None else ema.state_dict(), **state}, tmp)
    tmp.replace(path)


def engine_completions(model, raw_config: dict, tok, prompts: list[list[int]], *, max_tokens: int,
                       folder: Path) -> list[tuple[dict, list[int]]]:
    """Greedy completions of `prompts` by the current weights through the k3rt Engine (the GPU runner on a
    GPU, in bf16 as shipped; the reference runner in fp32 on a CPU): a copy of the model as the loader
    would build it from an export, so the training model and its optimizer are untouched."""
    from k3rt.backend.engine import Engine
    from k3rt.training.function_test import engine_completions as drive
    from k3rt.config import CacheConfig, EngineConfig

    device = model.lm_head.weight.device
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**raw_config, "torch_dtype": dtype}, indent=2) + "\n")
    copy = build_model(parse_model_config({**raw_config, "torch_dtype": dtype}), dtype=getattr(torch, dtype))
    copy.load_state_dict(model.state_dict())
    engine = Engine(EngineConfig(model=str(folder), dtype=dtype, device=str(device),
                                 cache=CacheConfig(memory_gb=2.0 if device.type == "cuda" else 0.25, num_pages=None)),
                    model=copy.to(device).eval())
    try:
        return drive(engine, tok, prompts, max_tokens)
    finally:
        del engine, copy
        if device.type == "cuda":
            torch.cuda.empty_cache()


def step_seed(seed: int, step: int) -> int:
    """Seed of the global torch generator (dropout masks) for one step: a function of (seed, step) only,
    so a resumed run draws the masks the uninterrupted run would."""
    return (seed * 1_000_003 + step) % 2**63


def main(argv: list[str] | None = None) -> int:
    global T0
    T0 = time.monotonic()
    a = parse_args(argv)
    deadline = T0 + a.time_budget_s - a.reserve_s
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp_dtype = torch.bfloat16 if cuda else None
    log(f"torch {torch.__version__} on {torch.cuda.get_device_name() if cuda else 'cpu'}; args {vars(a)}")

    corpus = read_corpus(a.corpus)
    log(f"corpus {a.corpus}: content hash {corpus.meta['content_hash']} (python {corpus.meta.get('python')}), "
        f"{len(corpus.documents)} documents")
    tok_dir = load_or_train_tokenizer(a, corpus)
    tok = load_tokenizer(tok_dir)
    ids = encode(a, corpus, tok, tok_dir)
    stream = T.TokenStream(ids["train"], a.seq_len, a.batch_size, a.seed)
    valid, heldout = (T.EvalWindows.build(ids[s], [d.text for d in corpus.split(s)], a.seq_len, T.sequence_start(tok))
                      for s in ("valid", "heldout"))
    if a.valid_windows:
        valid = valid.subset(a.valid_windows)
    fn_cases = select_functions(corpus.split("valid", ("code",)), a.function_cases) if a.function_cases > 0 else []
    fn_prompts = [tok.encode_prompt(c.header) for c in fn_cases]
    if a.final_eval_windows:
        heldout = heldout.subset(a.final_eval_windows)
    log(f"tokenizer {tok_dir} ({tok.vocab_size} ids): {len(stream.tokens):,} training tokens "
        f"({stream.steps_per_epoch} steps per epoch); validation {int(valid.mask.sum()):,} tokens; "
        f"held-out {int(heldout.mask.sum()):,} tokens over {heldout.num_bytes:,} bytes")

    raw = model_config(a, tok)
    cfg = parse_model_config(raw)
    torch.manual_seed(a.seed)
    model = build_model(cfg, dtype=torch.float32)
    T.init_for_training(model, a.seed)
    model.to(device)
    T.make_trainable(model)
    moes = T.use_training_moe(model)
    if a.kda == "fast":
        T.use_fast_kda(model)
    T.add_dropout(model, a.dropout, a.embed_dropout)
    ema = T.WeightAverage(model, a.ema_decay) if a.ema_decay > 0 else None
    counts = param_count(cfg)
    log(f"model: {counts['total']:,} parameters ({counts['active_per_token']:,} active per token), "
        f"layers {''.join('K' if t == 'kda' else 'M' for t in cfg.layer_types)}")
    opt = torch.optim.AdamW(T.param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=cuda)

    a.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = a.work_dir / "ckpt.pt"
    max_epoch_steps = max(1, int(a.max_epochs * stream.steps_per_epoch))
    step, total_steps, history, evals, tokens_seen = 0, a.max_steps or None, [], [], 0
    train_seconds, best = 0.0, {"valid_bpb": math.inf, "rank": None, "step": 0, "weights": None, "state": None}
    ul_rounds_done, ul_log, ul_replay = 0, [], []
    if a.resume and ckpt_path.is_file():
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if ema is not None:
            if ck.get("ema") is None:
                raise SystemExit(f"--resume: {ckpt_path} has no EMA state; resume with --ema-decay 0")
            ema.load_state_dict(ck["ema"])
        step, total_steps, history, evals = ck["step"], ck["total_steps"], ck["history"], ck["evals"]
        tokens_seen, train_seconds, best = ck["tokens_seen"], ck["train_seconds"], ck["best"]
        ul_rounds_done, ul_log = ck.get("ul_rounds_done", 0), ck.get("ul_log", [])
        ul_replay = [RunawaySequence(ids, mask) for ids, mask in ck.get("ul_replay", [])]
        log(f"resumed from {ckpt_path} at step {step} of {total_steps}")
    elif a.init_from is not None:
        model.load_state_dict(load_model(a.init_from, dtype="float32", device=a.device, progress=False).state_dict())
        step = total_steps = a.max_steps
        log(f"weights from {a.init_from}, taken as step {step} of a {total_steps}-step schedule")

    def state() -> dict:
        return {"step": step, "total_steps": total_steps, "history": history, "evals": evals, "best": best,
                "tokens_seen": tokens_seen, "train_seconds": train_seconds, "ul_rounds_done": ul_rounds_done,
                "ul_log": ul_log, "ul_replay": [(x.ids, x.mask) for x in ul_replay],
                "args": {k: str(v) for k, v in vars(a).items()}}

    def measure(suffix: str) -> dict:
        """Validation metrics of the current weights: bits/byte and, with --function-cases, the function test."""
        m = {f"valid_bpb{suffix}": round(T.bits_per_byte(model, valid, a.batch_size, autocast_dtype=amp_dtype), 4)}
        if fn_cases:
            done = engine_completions(model, raw, tok, fn_prompts, max_tokens=a.function_max_tokens,
                                      folder=a.work_dir / "engine")
            fc = summarize(score_rows(fn_cases, [r for r, _ in done]), "valid", a.function_max_tokens)
            probe = T.end_probe(model, tok, fn_cases)
            m.update({f"valid_complete{suffix}": fc["complete_rate"], f"valid_parse{suffix}": fc["parse_rate"],
                      f"valid_eos_top1{suffix}": probe["eos_top1_rate"]})
        return m

    def consider(m: dict, suffix: str, weights: str) -> None:
        """Keep these weights if they rank above the best so far (--select-by)."""
        bpb = m[f"valid_bpb{suffix}"]
        rank = [m[f"valid_complete{suffix}"], m[f"valid_parse{suffix}"], -bpb] if a.select_by == "function" else [-bpb]
        if best["rank"] is None or rank > best["rank"]:
            best.update(valid_bpb=bpb, rank=rank, step=step, weights=weights, metrics=dict(m),
                        state={k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})

    def validate() -> None:
        """Score the raw weights and, with --ema-decay, the average; remember the best of all seen."""
        model.eval()
        row = {"step": step, **measure("")}
        consider(row, "", "raw")
        if ema is not None:
            with ema.applied(model):
                row.update(measure("_ema"))
                consider(row, "_ema", "ema")
        model.train()
        evals.append(row)
        shown = ", ".join(f"{k.removeprefix('valid_')} {v}" for k, v in row.items() if k != "step")
        log(f"step {step}: validation {shown} (best: {best['weights']} weights at step {best['step']}, "
            f"{best['valid_bpb']:.4f} bits/byte)")

    def train_step(lr: float, ul_batch: UnlikelihoodBatch | None = None) -> tuple:
        """One optimizer step at `lr` on the corpus batch of this step, plus with `ul_batch` the weighted
        unlikelihood loss of its marked tokens. Returns (LM loss, grad norm, router imbalance, UL loss)."""
        nonlocal step, tokens_seen
        for g in opt.param_groups:
            g["lr"] = lr
        torch.manual_seed(step_seed(a.seed, step))
        inputs, targets = (t.to(device, non_blocking=True) for t in stream.batch(step))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            nll, count = T.lm_loss(model, inputs, targets)
            loss = nll / count
            ul = None
            if ul_batch is not None:
                ul_sum, ul_count = unlikelihood_loss(model, ul_batch.to(device))
                ul = ul_sum / ul_count.clamp(min=1)
        (loss if ul is None else loss + a.ul_weight * ul).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance = T.balance_routers(moes, a.router_bias_rate)
        if ema is not None:
            ema.update(model)
        step += 1
        tokens_seen += inputs.numel()
        return loss, grad_norm, imbalance, ul

    model.train()
    calib_start: float | None = None
    loop_start = time.monotonic()
    stop_reason = "max steps"
    first_step = step
    while total_steps is None or step < total_steps:
        if time.monotonic() > deadline:
            stop_reason = "time budget"
            break
        if a.stop_after_steps and step - first_step >= a.stop_after_steps:
            stop_reason = "--stop-after-steps"
            break
        horizon = total_steps or 10**9
        lr = T.cosine_lr(step, horizon, a.warmup_steps, a.lr, a.min_lr_ratio)
        loss, grad_norm, imbalance, _ = train_step(lr)

        # time steps first_step+5 .. +5+calibrate_steps (the first ones pay for allocator warm-up)
        if total_steps is None and step == first_step + 5:
            if cuda:
                torch.cuda.synchronize()
            calib_start = time.monotonic()
        if total_steps is None and calib_start is not None and step == first_step + 5 + a.calibrate_steps:
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.monotonic() - calib_start) / a.calibrate_steps
            # the validations ahead cost time too: time one now (an early point of the curve; the function
            # test of an untrained model runs every case to the cap, so this errs towards fewer steps)
            t_eval = time.monotonic()
            validate()
            per_step_with_evals = per_step + (time.monotonic() - t_eval) / a.eval_every
            by_time = step + max(1, int((deadline - time.monotonic()) / per_step_with_evals * 0.97))
            total_steps = min(by_time, max(step + 1, max_epoch_steps))
            log(f"calibrated: {per_step * 1e3:.0f} ms/step ({a.batch_size * a.seq_len / per_step:,.0f} tokens/s), "
                f"{per_step_with_evals * 1e3:.0f} ms with validation; the budget allows {by_time} steps "
                f"({by_time / stream.steps_per_epoch:.1f} epochs) -> cosine horizon {total_steps} steps")
        if step % a.log_every == 0 or step == 1:
            row = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "grad_norm": round(grad_norm.item(), 3),
                   "router_max_over_mean": round(max((x.item() for x in imbalance), default=1.0), 2),
                   "tokens": tokens_seen, "elapsed_s": round(time.monotonic() - T0, 1)}
            history.append(row)
            log(f"step {step}/{total_steps or '?'} loss {row['loss']:.4f} lr {lr:.2e} |g| {row['grad_norm']:.2f} "
                f"router max/mean {row['router_max_over_mean']:.2f} tokens {tokens_seen:,}")
        if step % a.eval_every == 0:
            validate()
        if step % a.ckpt_every == 0:
            train_seconds += time.monotonic() - loop_start
            loop_start = time.monotonic()
            save_checkpoint(ckpt_path, model, opt, ema, state())
    if cuda:
        torch.cuda.synchronize()
    train_seconds += time.monotonic() - loop_start
    log(f"training stopped at step {step} ({stop_reason}); {tokens_seen:,} tokens in {train_seconds:.0f} s")
    if not evals or evals[-1]["step"] != step:
        validate()
    save_checkpoint(ckpt_path, model, opt, ema, state())

    # ---- unlikelihood rounds: the model's own runaway completions, their repeats made unlikely ----
    # (only once the schedule is done: a run stopped by --stop-after-steps or the budget leaves them to the
    # resume, which must run the same steps as an uninterrupted run)
    rounds_due = a.ul_rounds > ul_rounds_done and stop_reason == "max steps"
    ul_pool = []
    if rounds_due:
        ul_pool = select_functions(corpus.split("train", ("code",)), 20_000)
        log(f"unlikelihood: {len(ul_pool)} training functions to draw headers from")
    last_round_s = 0.0
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    while rounds_due and ul_rounds_done < a.ul_rounds:
        if time.monotonic() + last_round_s > deadline:
            stop_reason = "time budget"
            break
        t_round = time.monotonic()
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + 7919 * (ul_rounds_done + 1))
        cases = [ul_pool[i] for i in torch.randperm(len(ul_pool), generator=g)[:a.ul_prompts].tolist()]
        prompts = [tok.encode_prompt(c.header) for c in cases]
        model.eval()
        done = engine_completions(model, raw, tok, prompts, max_tokens=a.function_max_tokens,
                                  folder=a.work_dir / "engine")
        model.train()
        rows = score_rows(cases, [r for r, _ in done])
        fresh = runaway_sequences(prompts, done, n=a.ul_ngram)
        runaways = fresh + ul_replay[:a.ul_replay]
        ul_replay = runaways
        gen_s = time.monotonic() - t_round
        entry = {"round": ul_rounds_done + 1, "step": step, "prompts": len(cases),
                 "train_complete_rate": round(sum(r["complete"] for r in rows) / max(1, len(rows)), 3),
                 "capped": sum(r["stop"] == "length" for r in rows), "runaways": len(fresh),
                 "marked_tokens": sum(x.num_marked for x in fresh), "trained_on": len(runaways),
                 "generate_s": round(gen_s, 1)}
        log(f"unlikelihood round {entry['round']}/{a.ul_rounds}: {entry['train_complete_rate']:.0%} of "
            f"{len(cases)} training functions end and parse, {entry['capped']} hit the cap, {len(fresh)} "
            f"repeat {a.ul_ngram}-grams ({entry['marked_tokens']:,} marked tokens); training on {len(runaways)} "
            f"[{gen_s:.0f} s]")
        pick = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        ul_sums = []
        for u in range(a.ul_steps):
            ub = None
            if runaways:
                idx = torch.randint(len(runaways), (min(a.ul_batch, len(runaways)),), generator=pick).tolist()
                ub = UnlikelihoodBatch.build([runaways[i] for i in idx], pad_id)
            # the first round ramps over 10 steps: its loss is new to the optimizer (and, with --init-from,
            # so are the weights: Adam's moments start at zero)
            lr = a.ul_lr * min(1.0, (u + 1) / 10) if ul_rounds_done == 0 else a.ul_lr
            loss, grad_norm, imbalance, ul = train_step(lr, ub)
            ul_sums.append(0.0 if ul is None else ul.item())
            if step % a.log_every == 0:
                row = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "grad_norm": round(grad_norm.item(), 3),
                       "ul_loss": round(ul_sums[-1], 4), "tokens": tokens_seen,
                       "elapsed_s": round(time.monotonic() - T0, 1)}
                history.append(row)
                log(f"step {step} (unlikelihood) loss {row['loss']:.4f} ul {row['ul_loss']:.4f} lr {lr:.2e} "
                    f"|g| {row['grad_norm']:.2f}")
        entry["ul_loss_first_last"] = [round(ul_sums[0], 4), round(ul_sums[-1], 4)] if ul_sums else None
        validate()
        ul_rounds_done += 1
        entry["round_s"] = round(time.monotonic() - t_round, 1)
        ul_log.append(entry)
        save_checkpoint(ckpt_path, model, opt, ema, state())
        last_round_s = time.monotonic() - t_round
    log(f"exporting the best validation checkpoint: {best['weights']} weights at step {best['step']} "
        f"({best['valid_bpb']:.4f} bits/byte; last step {evals[-1]})")
    model.load_state_dict(best["state"])

    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    report = {
        "model": "k3-tiny", "commit": a.commit or git_commit(), "corpus_content_hash": corpus.meta["content_hash"],
        "corpus_python": corpus.meta.get("python"), "heldout_modules": corpus.meta.get("heldout_modules"),
        "parameters": counts, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "steps": step, "cosine_horizon": total_steps, "stop_reason": stop_reason, "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / max(1, len(stream.tokens)), 2), "train_seconds": round(train_seconds, 1),
        "exported_step": best["step"], "exported_weights": best["weights"],
        "valid_bits_per_byte_exported": round(best["valid_bpb"], 4), "selected_by": a.select_by,
        "unlikelihood_rounds": ul_log,
        "valid_function_test_exported": {k.removesuffix("_ema"): v for k, v in best.get("metrics", {}).items()
                                         if "bpb" not in k} or None,
        "peak_gpu_memory_gib": None if peak_gib is None else round(peak_gib, 1),
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                            if k not in ("corpus", "tokenizer", "out", "work_dir")},
        "evals": evals, "loss_curve": history,
    }

    # export first: the evaluations below must not be able to lose the trained weights
    a.out.mkdir(parents=True, exist_ok=True)
    for stale in [*a.out.glob("*.safetensors"), *a.out.glob("model.safetensors.index.json")]:
        stale.unlink()  # an earlier export's shards would otherwise be read with (or instead of) these
    write_checkpoint(model.cpu(), a.out, raw, dtype=a.export_dtype, max_shard_bytes=MAX_SHARD_BYTES)
    model.to(device)
    if tok_dir.resolve() != a.out.resolve():
        for f in TOKENIZER_FILES:
            shutil.copy(tok_dir / f, a.out / f)
    shards = sorted(a.out.glob("*.safetensors"))
    report.update(weight_bytes=sum(p.stat().st_size for p in shards), shards=[p.name for p in shards],
                  tokenizer_sha256=file_hash([a.out / f for f in TOKENIZER_FILES]))
    log(f"exported {len(shards)} shard(s), {report['weight_bytes'] / 1e6:.2f} MB, to {a.out}")
    write_report(a, report)

    model.eval()
    bpb = T.bits_per_byte(model, heldout, a.batch_size, autocast_dtype=amp_dtype)
    unigram = T.unigram_bits_per_byte(ids["train"], heldout, tok.vocab_size)
    report.update(heldout_bits_per_byte=round(bpb, 4), unigram_bits_per_byte=round(unigram, 4),
                  heldout_bytes=heldout.num_bytes)
    log(f"held-out bits/byte {bpb:.4f} (unigram baseline {unigram:.4f}) on {heldout.num_bytes:,} bytes")
    write_report(a, report)
    try:
        shipped = load_model(a.out, dtype="float32", device=a.device, progress=False)
        shipped_bpb = T.bits_per_byte(shipped, heldout, a.batch_size)
        report["heldout_bits_per_byte_shipped_weights"] = round(shipped_bpb, 4)
        log(f"reloaded export: held-out bits/byte {shipped_bpb:.4f} (fp32 compute on the {a.export_dtype} weights)")
    except Exception as e:  # the export is on disk; report the failure instead of losing the run's record
        report["reload_error"] = f"{type(e).__name__}: {e}"
        log(f"reloading the export failed: {report['reload_error']}")
    report["wall_seconds"] = round(time.monotonic() - T0, 1)
    write_report(a, report)
    log(f"wrote {a.out / 'training.json'}; total {time.monotonic() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
