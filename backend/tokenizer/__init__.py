"""Tokenizers for k3rt: `load_tokenizer(model_dir)` picks the implementation from the files it finds.

tokenizer.json (HF `tokenizers`) wins over tiktoken.model (Kimi's native format) when both exist, since it
needs no Python-side regex pass. `write_tiny_tokenizer` / `write_tiny_tiktoken_tokenizer` make small
Kimi-style vocabularies for test checkpoints.
"""
from __future__ import annotations

from pathlib import Path

from k3rt.backend.tokenizer.base import Tokenizer
from k3rt.backend.tokenizer.detokenizer import IncrementalDetokenizer
from k3rt.backend.tokenizer.hf import TOKENIZER_JSON_FILE, HFTokenizer
from k3rt.backend.tokenizer.tiktoken_file import TIKTOKEN_MODEL_FILE, TiktokenTokenizer
from k3rt.backend.tokenizer.tiny import write_tiny_tiktoken_tokenizer, write_tiny_tokenizer, write_trained_tokenizer
from k3rt.models import resolve_model_dir

__all__ = [
    "HFTokenizer",
    "IncrementalDetokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "write_tiny_tiktoken_tokenizer",
    "write_tiny_tokenizer",
    "write_trained_tokenizer",
]


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of the model in `model_dir` (a folder, or the name of a model shipped with k3rt):
    tokenizer.json if present, else tiktoken.model. Raises FileNotFoundError naming the directory and the
    files looked for."""
    model_dir = resolve_model_dir(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist (or is not a directory)")
    if (model_dir / TOKENIZER_JSON_FILE).is_file():
        return HFTokenizer(model_dir)
    if (model_dir / TIKTOKEN_MODEL_FILE).is_file():
        return TiktokenTokenizer(model_dir)
    raise FileNotFoundError(
        f"no tokenizer in {model_dir}: looked for {TOKENIZER_JSON_FILE} and {TIKTOKEN_MODEL_FILE}"
    )
