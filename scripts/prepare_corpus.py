#!/usr/bin/env python3
"""Build the k3-tiny training corpus from this machine's CPython stdlib and train its tokenizer.

    python scripts/prepare_corpus.py                 # -> .cache/corpus/{corpus.jsonl.xz,corpus.meta.json}
                                                     #    and k3rt/models/k3-tiny/tokenizer{,_config}.json

What goes in and why: training/corpus.py. The corpus is built here, not on the training machine:
CPython versions ship different stdlibs (the GPU image has 3.12), so the file travels (about 5 MB,
xz) and its content hash, printed below and stored in corpus.meta.json, names exactly what a model
was trained on. Rebuilding on the same interpreter gives the same hash (--check verifies that).
The tokenizer (8192 ids: byte-level BPE on the training split's code and pydoc text, plus Kimi's
special tokens and chat template) is deterministic in the corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bootstrap import ROOT, import_k3rt  # noqa: E402

import_k3rt()

from k3rt.backend.tokenizer import load_tokenizer, write_trained_tokenizer  # noqa: E402
from k3rt.training.corpus import META_FILE, build_corpus, stdlib_dir, write_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stdlib", type=Path, default=None, help=f"stdlib folder (default {stdlib_dir()})")
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "corpus", help="corpus folder")
    p.add_argument("--tokenizer-out", type=Path, default=ROOT / "k3rt" / "models" / "k3-tiny",
                   help="where tokenizer.json + tokenizer_config.json go")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--no-tokenizer", action="store_true", help="only build the corpus")
    p.add_argument("--check", action="store_true", help="rebuild and compare with the hash already in --out")
    a = p.parse_args(argv)

    t0 = time.monotonic()
    corpus = build_corpus(a.stdlib)
    digest = corpus.meta["content_hash"]
    print(f"corpus: {len(corpus.documents)} documents from {corpus.meta['stdlib']} (python {corpus.meta['python']}), "
          f"built in {time.monotonic() - t0:.0f} s")
    for k, c in corpus.meta["counts"].items():
        print(f"  {k:14s} {c['documents']:6d} documents {c['chars']:>12,} chars")
    if corpus.meta["missing_modules"]:
        print(f"  warning: held-out or validation modules not found: {corpus.meta['missing_modules']}")
    print(f"content hash: {digest}")
    if a.check:
        old = json.loads((a.out / META_FILE).read_text())["content_hash"]
        print("check:", "same hash" if old == digest else f"DIFFERENT from {old}")
        return 0 if old == digest else 1
    path = write_corpus(corpus, a.out)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    if a.no_tokenizer:
        return 0
    t0 = time.monotonic()
    write_trained_tokenizer(a.tokenizer_out, [d.text for d in corpus.split("train", ("code", "doc"))],
                            vocab_size=a.vocab_size)
    tok = load_tokenizer(a.tokenizer_out)
    h = hashlib.sha256((a.tokenizer_out / "tokenizer.json").read_bytes()).hexdigest()
    print(f"tokenizer: {tok.vocab_size} ids in {a.tokenizer_out} ({time.monotonic() - t0:.0f} s), "
          f"tokenizer.json sha256 {h}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
