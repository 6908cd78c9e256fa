"""The tokenizer-side JSON files of a model directory, parsed once into a `TokenizerConfig`.

Reads `tokenizer_config.json` (special-token names, `added_tokens_decoder`, `chat_template`), and optionally
`special_tokens_map.json`, `generation_config.json` (extra end-of-generation ids) and `chat_template.jinja`.
Every file is optional; what a missing file would have said is simply absent. This module knows nothing about
vocabularies or token ids other than the ones these files state.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True, slots=True)
class AddedToken:
    """One entry of `added_tokens_decoder`: the token's text and whether decode may skip it."""

    content: str
    special: bool = True


@dataclass(frozen=True)
class TokenizerConfig:
    """What the JSON files around a vocabulary say; names, never ids, except where the files give ids."""

    # token id -> entry, from tokenizer_config.json `added_tokens_decoder` (string keys in the file)
    added_tokens: dict[int, AddedToken] = field(default_factory=dict)
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    # a single template, or named templates ({"default": ..., "tool_use": ...}) as HF allows; None if absent
    chat_template: str | dict[str, str] | None = None
    # generation_config.json `eos_token_id` (an int or a list in the file)
    generation_eos_token_ids: tuple[int, ...] = ()
    # k3rt extension for tiny test vocabularies; real Kimi configs omit it and the tiktoken loader uses 256
    num_reserved_special_tokens: int | None = None
    # HF's `add_bos_token`: every sequence the model sees starts with BOS (text prompts and chat alike);
    # absent means False, as for Kimi, whose chat template opens with its own marker
    add_bos_token: bool = False

    @property
    def special_token_names(self) -> dict[str, str]:
        """`{"bos_token": "[BOS]", ...}` for the names that are set; chat templates see these as variables."""
        return {key: value for key in _SPECIAL_TOKEN_KEYS if (value := getattr(self, key)) is not None}


def read_tokenizer_config(model_dir: Path) -> TokenizerConfig:
    """Parse the optional tokenizer-side files of `model_dir`; values in tokenizer_config.json win over
    special_tokens_map.json, and chat_template.jinja wins over tokenizer_config.json's `chat_template`."""
    config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
    special_map = _read_json(model_dir / SPECIAL_TOKENS_MAP_FILE)
    generation = _read_json(model_dir / GENERATION_CONFIG_FILE)

    added_tokens = {
        int(token_id): AddedToken(content=_token_text(entry), special=bool(entry.get("special", True)))
        for token_id, entry in config.get("added_tokens_decoder", {}).items()
    }
    names = {key: _token_text(config.get(key)) or _token_text(special_map.get(key)) for key in _SPECIAL_TOKEN_KEYS}

    template_file = model_dir / CHAT_TEMPLATE_FILE
    chat_template = config.get("chat_template")
    if template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    if isinstance(chat_template, list):
        # HF stores several named templates as [{"name": ..., "template": ...}, ...]
        chat_template = {entry["name"]: entry["template"] for entry in chat_template}

    eos_ids = generation.get("eos_token_id")
    if eos_ids is None:
        eos_ids = []
    elif isinstance(eos_ids, int):
        eos_ids = [eos_ids]

    reserved = config.get("num_reserved_special_tokens")
    return TokenizerConfig(
        added_tokens=added_tokens,
        chat_template=chat_template,
        generation_eos_token_ids=tuple(int(i) for i in eos_ids),
        num_reserved_special_tokens=int(reserved) if reserved is not None else None,
        add_bos_token=bool(config.get("add_bos_token", False)),
        **names,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    # Special tokens appear either as plain strings or as serialized AddedToken dicts with a "content" key.
    if isinstance(value, dict):
        return value.get("content")
    return value
