#!/usr/bin/env python3
"""Evaluate a shipped model (default k3-tiny) on the corpus's held-out modules, writing JSON.

    python scripts/eval_default_model.py                       # CPU, fp32 compute, -> .cache/eval/k3-tiny.json
    python scripts/eval_default_model.py --device cuda --out $OUT/eval.json
    # right after a training run, on its export (a folder path works wherever a model name does):
    python scripts/eval_default_model.py --model $OUT/k3-tiny --device cuda --skip-bpb --out $OUT/eval.json

The CPU run is the reported number. On a GPU the Engine runs the same reference torch path in fp32,
but near-ties between the top two logits can break the other way, so a few greedy completions (and the
parse rate by a point or two) may differ from the CPU run.

1. Held-out bits per byte through the runtime's loader (`load_model`), beside a token-unigram
   baseline from the training split (both as in the training script).
2. Function completion: --num-functions functions (default 100) of 3..30 lines, spread evenly over
   the held-out modules in (file, line) order. The prompt is the function's header, its signature
   lines and docstring if it has one, dedented to column 0. The k3rt offline Engine completes each
   prompt (`Tokenizer.encode_prompt`: BOS first, as every k3-tiny prompt) greedily; a completion ends
   at its function's end, the first non-blank line that starts at column 0 (the dedent heuristic), or
   at EOS or --max-tokens. The score is the share of completions that END (at the function's end or
   EOS, not cut at --max-tokens), hold at least one non-blank line (a docstring alone parses, so an empty
   completion does not count) and for which `ast.parse(header + completion)` succeeds.
   Beside it, `parse_rate` also counts completions cut at --max-tokens whose text happens to parse: the
   number reported until 2026-11-30 (session 5), which counted repetition loops (`self.x = x` forty times)
   cut at a line boundary as successes. `--function-split valid` runs the same test on the validation
   modules instead: the one to compare recipes or checkpoints by, so that the held-out number stays a
   measurement and not a choice. Beside the score, `end_probe` feeds each case's true function and
   reads whether EOS is the most likely next token at its end (`train.end_probe`): whether the model
   knows where a function ends once the right body is written. The rules live in
   `training/function_test.py` (`engine_completions` drives the Engine), which the training run's own
   function test (on its current weights, to choose checkpoints) shares.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bootstrap import ROOT, import_k3rt  # noqa: E402

import_k3rt()

from k3rt.models import resolve_model_dir  # noqa: E402
from k3rt.training.corpus import read_corpus  # noqa: E402
from k3rt.training.function_test import (FunctionCase, engine_completions, score_rows,  # noqa: E402
                                         select_functions, summarize)


def complete_functions(model_dir: Path, cases: list[FunctionCase], *, device: str, dtype: str | None,
                       max_tokens: int) -> list[dict]:
    from k3rt.backend.engine import Engine
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.config import CacheConfig, EngineConfig

    tok = load_tokenizer(model_dir)
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, device=device,
                                 cache=CacheConfig(memory_gb=2.0, num_pages=None)))
    done = engine_completions(engine, tok, [tok.encode_prompt(c.header) for c in cases], max_tokens)
    return score_rows(cases, [r for r, _ in done])


def end_probe(model_dir: Path, cases: list[FunctionCase], *, device: str) -> dict:
    from k3rt.training import train as T
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.tokenizer import load_tokenizer

    model = load_model(model_dir, dtype="float32", device=device, progress=False).eval()
    return T.end_probe(model, load_tokenizer(model_dir), cases)


def heldout_bpb(model_dir: Path, corpus, *, device: str, dtype: str, seq_len: int, batch_size: int) -> dict:
    from k3rt.training import train as T
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    heldout_docs = corpus.split("heldout")
    heldout_ids = T.eval_documents(heldout_docs, tok)
    windows = T.EvalWindows.build(heldout_ids, [d.text for d in heldout_docs], seq_len, T.sequence_start(tok))
    model = load_model(model_dir, dtype=dtype, device=device, progress=False)
    bpb = T.bits_per_byte(model, windows, batch_size)
    unigram = T.unigram_bits_per_byte(T.encode_documents(corpus.split("train"), tok), windows, tok.vocab_size)
    return {"heldout_bits_per_byte": round(bpb, 4), "unigram_bits_per_byte": round(unigram, 4),
            "heldout_bytes": windows.num_bytes, "heldout_tokens": int(windows.mask.sum())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "--model-dir", default="k3-tiny",
                   help="checkpoint folder (e.g. a fresh training export) or shipped model name (default k3-tiny)")
    p.add_argument("--corpus", type=Path, default=ROOT / ".cache" / "corpus", help="corpus folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    p.add_argument("--num-functions", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=256, help="completion length cap per function")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--skip-bpb", action="store_true", help="only the function-completion test")
    p.add_argument("--skip-functions", action="store_true", help="only bits per byte")
    p.add_argument("--function-split", choices=["heldout", "valid"], default="heldout",
                   help="modules of the function test: held-out (the reported number) or validation (for choosing)")
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "eval" / "k3-tiny.json")
    a = p.parse_args(argv)

    t0 = time.monotonic()
    model_dir = resolve_model_dir(a.model)
    corpus = read_corpus(a.corpus)
    report: dict = {"model": str(model_dir), "corpus_content_hash": corpus.meta["content_hash"],
                    "device": a.device, "dtype": a.dtype}
    if not a.skip_bpb:
        report.update(heldout_bpb(model_dir, corpus, device=a.device, dtype=a.dtype, seq_len=a.seq_len,
                                  batch_size=a.batch_size))
        print(f"held-out bits/byte {report['heldout_bits_per_byte']:.4f} "
              f"(unigram baseline {report['unigram_bits_per_byte']:.4f}) [{time.monotonic() - t0:.0f} s]", flush=True)
    if not a.skip_functions:
        cases = select_functions(corpus.split(a.function_split, ("code",)), a.num_functions)
        rows = complete_functions(model_dir, cases, device=a.device, dtype=a.dtype, max_tokens=a.max_tokens)
        fc = report["function_completion"] = summarize(rows, a.function_split, a.max_tokens)
        fc["end_probe"] = end_probe(model_dir, cases, device=a.device)
        n = len(rows)
        print(f"function completion ({a.function_split}): {sum(r['complete'] for r in rows)}/{n} end and parse "
              f"({fc['complete_rate']:.0%}); {sum(r['parses'] for r in rows)}/{n} parse counting those cut at "
              f"{a.max_tokens} tokens ({fc['parse_rate']:.0%}); given the true body, EOS is the top token at the "
              f"function's end in {fc['end_probe']['eos_top1_rate']:.0%} [{time.monotonic() - t0:.0f} s]", flush=True)
    report["seconds"] = round(time.monotonic() - t0, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
