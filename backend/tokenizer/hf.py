"""`HFTokenizer`: a HF `tokenizers` tokenizer.json, plus the names and template from tokenizer_config.json.

tokenizer.json is the truth for ids and for which added tokens are special; tokenizer_config.json (and the
other files `read_tokenizer_config` reads) only adds the BOS/EOS/PAD names, the chat template and extra EOS ids.
`token_bytes` is exact for byte-level vocabularies (GPT-2 style, as Kimi-derived and Qwen/Llama-3 files are);
for SentencePiece-style vocabularies it maps "▁" to a space and <0xNN> byte-fallback tokens to their byte.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from k3rt.backend.tokenizer.base import IM_END, LoadedTokenizer, collect_eos_token_ids
from k3rt.backend.tokenizer.chat_template import ChatTemplate
from k3rt.backend.tokenizer.config import read_tokenizer_config

TOKENIZER_JSON_FILE = "tokenizer.json"
# tokenizers' `encode` keeps the GIL (an 8 MB text: 5 s in which no other thread of the gateway runs, its event
# loop included, even when the caller is a worker thread); `encode_batch` releases it
_RELEASE_GIL_CHARS = 16 << 10

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_to_char() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-character table: printable Latin-1 bytes stand for themselves, the
    # other 68 bytes are shifted to U+0100 upwards, in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update((b, chr(256 + n)) for n, b in enumerate(shifted))
    return table


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {char: b for b, char in BYTE_TO_CHAR.items()}


# str.translate table: byte-level character -> the Latin-1 character of its byte; characters below U+0100 that
# are not in the byte-level alphabet map to U+FFFF so that encoding to Latin-1 fails for them.
_BYTE_LEVEL_TO_LATIN1 = {**{c: 0xFFFF for c in range(256)}, **{ord(char): b for char, b in CHAR_TO_BYTE.items()}}


def byte_level_decode(token: str) -> bytes:
    """The bytes a byte-level token string stands for, e.g. "Ġhi" -> b" hi"."""
    return bytes(CHAR_TO_BYTE[char] for char in token)


def byte_level_encode(data: bytes) -> str:
    """Inverse of `byte_level_decode`."""
    return "".join(BYTE_TO_CHAR[b] for b in data)


def _mentions_byte_level(component: Any) -> bool:
    if isinstance(component, dict):
        if component.get("type") == "ByteLevel":
            return True
        return any(_mentions_byte_level(value) for value in component.values())
    if isinstance(component, list):
        return any(_mentions_byte_level(value) for value in component)
    return False


class HFTokenizer(LoadedTokenizer):
    """Loads `<model_dir>/tokenizer.json` and the optional tokenizer-side JSON files beside it."""

    def __init__(self, model_dir: str | Path) -> None:
        self._dir = Path(model_dir)
        serialized = (self._dir / TOKENIZER_JSON_FILE).read_text(encoding="utf-8")
        self._tokenizer = tokenizers.Tokenizer.from_str(serialized)
        # A second copy for allow_special=False: `encode_special_tokens` is a setting of the tokenizer object,
        # not of one call, and flipping it per call would race between threads.
        self._tokenizer_without_specials = tokenizers.Tokenizer.from_str(serialized)
        self._tokenizer_without_specials.encode_special_tokens = True
        config = read_tokenizer_config(self._dir)

        added = self._tokenizer.get_added_tokens_decoder()
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(self._tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._id_to_bytes = self._token_byte_table(vocab, added)

        self._bos_id = self._id_of(config.bos_token)
        self._add_bos = config.add_bos_token
        self._pad_id = self._id_of(config.pad_token)
        self._eos_ids = collect_eos_token_ids(
            self._id_of(config.eos_token), config.generation_eos_token_ids, self._id_of(IM_END)
        )
        self._chat_template = (
            ChatTemplate(config.chat_template, special_tokens=config.special_token_names)
            if config.chat_template is not None
            else None
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def _token_byte_table(self, vocab: dict[str, int], added: dict[int, tokenizers.AddedToken]) -> list[bytes]:
        components = [self._tokenizer.decoder, self._tokenizer.pre_tokenizer]
        byte_level = any(_mentions_byte_level(json.loads(c.__getstate__())) for c in components if c is not None)
        byte_fallback = bool(getattr(self._tokenizer.model, "byte_fallback", False))
        table = [b""] * self._vocab_size
        for token, token_id in vocab.items():
            if token_id in added:
                # added tokens hold plain text, not the byte-level alphabet
                table[token_id] = added[token_id].content.encode("utf-8")
                continue
            if byte_level:
                try:
                    table[token_id] = token.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1")
                    continue
                except UnicodeEncodeError:
                    pass  # not a byte-level token after all; fall through
            if byte_fallback and (match := _BYTE_FALLBACK.fullmatch(token)):
                table[token_id] = bytes([int(match.group(1), 16)])
            else:
                table[token_id] = token.replace("▁", " ").encode("utf-8")
        return table

    @property
    def source_dir(self) -> Path:
        return self._dir

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        tokenizer = self._tokenizer if allow_special else self._tokenizer_without_specials
        if len(text) >= _RELEASE_GIL_CHARS:  # same ids; `encode` holds the GIL throughout, `encode_batch` not
            return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})")
        return self._id_to_bytes[token_id]
