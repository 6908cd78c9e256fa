"""`TiktokenTokenizer`: Kimi's `tiktoken.model` vocabulary, run by `tiktoken.Encoding`, fully offline.

The format, as Kimi's HF repos ship it (tokenization_kimi.py + tiktoken.model + tokenizer_config.json):
- tiktoken.model: one `<base64 token bytes> <rank>` per line; ranks are the ids 0..N-1 of the N base tokens.
- Ids N .. N+255 are 256 reserved special tokens. Their names come from tokenizer_config.json's
  `added_tokens_decoder` ("[BOS]" at N, "[EOS]" at N+1, "<|im_end|>" at N+2, ...); an unnamed slot i is called
  `<|reserved_token_{i}|>`. (Tiny test vocabularies set `num_reserved_special_tokens` to use fewer slots.)
- Text is split by `KIMI_PAT_STR` before byte-pair merging; runs of Han characters form their own pieces.
- Very long inputs are cut into pieces before encoding, as Kimi does, because tiktoken's regex pass is slow
  (or fails) on a single run of hundreds of thousands of whitespace or non-whitespace characters.

The rank file is parsed here rather than with `tiktoken.load.load_tiktoken_bpe`, which copies every file it
reads into a cache directory (TIKTOKEN_CACHE_DIR, else a "data-gym-cache" dir under the system temp dir).
Constructing `tiktoken.Encoding` from in-memory ranks touches neither the network nor any cache.
"""
from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from k3rt.backend.tokenizer.base import IM_END, LoadedTokenizer, collect_eos_token_ids
from k3rt.backend.tokenizer.chat_template import ChatTemplate
from k3rt.backend.tokenizer.config import read_tokenizer_config

TIKTOKEN_MODEL_FILE = "tiktoken.model"
NUM_RESERVED_SPECIAL_TOKENS = 256

# Kimi's pre-tokenizer split (pat_str in tokenization_kimi.py), one alternative per line. Letter classes
# exclude Han (`&&[^\p{Han}]`) so Chinese runs are split off by the first alternative on their own.
_HAN_RUN = r"[\p{Han}]+"
_LOWER_ENDED_WORD = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
)
_UPPER_LED_WORD = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
)
_DIGITS = r"\p{N}{1,3}"
_PUNCTUATION = r" ?[^\s\p{L}\p{N}]+[\r\n]*"
_NEWLINES = r"\s*[\r\n]+"
_TRAILING_SPACE = r"\s+(?!\S)"
_SPACE = r"\s+"
KIMI_PAT_STR = "|".join(
    [_HAN_RUN, _LOWER_ENDED_WORD, _UPPER_LED_WORD, _DIGITS, _PUNCTUATION, _NEWLINES, _TRAILING_SPACE, _SPACE]
)

# Limits Kimi applies before calling tiktoken: windows of at most 400k characters, and within a window a new
# piece starts every 25k characters of one unbroken whitespace or non-whitespace run.
_MAX_WINDOW_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUN = re.compile(r"\s+|\S+")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file. Ranks must be exactly 0..N-1, since they double as token ids."""
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2:
                raise ValueError(f"{path}:{line_number}: expected '<base64 token> <rank>', got {line[:80]!r}")
            ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not the contiguous ids 0..{len(ranks) - 1} (or a token repeats)")
    return ranks


def write_tiktoken_ranks(path: Path, tokens: Sequence[bytes]) -> None:
    """Write `tokens` (index = rank) in the rank-file format `read_tiktoken_ranks` reads."""
    lines = (f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in enumerate(tokens))
    path.write_text("".join(lines), encoding="ascii")


def _pieces(text: str) -> Iterator[str]:
    if len(text) <= _MAX_RUN_CHARS:
        yield text
        return
    for window_start in range(0, len(text), _MAX_WINDOW_CHARS):
        window = text[window_start : window_start + _MAX_WINDOW_CHARS]
        piece_start = 0
        for run in _RUN.finditer(window):
            cut = run.start() + _MAX_RUN_CHARS
            while cut < run.end():
                yield window[piece_start:cut]
                piece_start = cut
                cut += _MAX_RUN_CHARS
        yield window[piece_start:]


class TiktokenTokenizer(LoadedTokenizer):
    """Loads `<model_dir>/tiktoken.model` and the special-token names from tokenizer_config.json."""

    def __init__(self, model_dir: str | Path) -> None:
        self._dir = Path(model_dir)
        rank_file = self._dir / TIKTOKEN_MODEL_FILE
        ranks = read_tiktoken_ranks(rank_file)
        config = read_tokenizer_config(self._dir)

        num_base = len(ranks)
        num_reserved = config.num_reserved_special_tokens or NUM_RESERVED_SPECIAL_TOKENS
        # ids past the reserved block that added_tokens_decoder names are special tokens too
        named_extra = (i for i in config.added_tokens if i >= num_base)
        special_ids = sorted({*range(num_base, num_base + num_reserved), *named_extra})
        names = {
            i: config.added_tokens[i].content if i in config.added_tokens else f"<|reserved_token_{i}|>"
            for i in special_ids
        }
        self._name_to_id = {name: i for i, name in names.items()}
        if len(self._name_to_id) != len(names):
            raise ValueError(f"{self._dir}: two special token ids share one name in added_tokens_decoder")

        self._encoding = tiktoken.Encoding(
            name=str(rank_file), pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=self._name_to_id
        )
        self._vocab_size = self._encoding.max_token_value + 1
        # Added tokens marked "special": false still encode as one id with allow_special=False, and survive
        # skip_special_tokens, as in HF.
        entries = config.added_tokens
        self._special_ids = frozenset(i for i in special_ids if i not in entries or entries[i].special)
        self._always_allowed = frozenset(names[i] for i in special_ids if i not in self._special_ids)

        self._bos_id = self._name_to_id.get(config.bos_token) if config.bos_token else None
        self._add_bos = config.add_bos_token
        self._pad_id = self._name_to_id.get(config.pad_token) if config.pad_token else None
        eos_id = self._name_to_id.get(config.eos_token) if config.eos_token else None
        self._eos_ids = collect_eos_token_ids(eos_id, config.generation_eos_token_ids, self._name_to_id.get(IM_END))
        self._chat_template = (
            ChatTemplate(config.chat_template, special_tokens=config.special_token_names)
            if config.chat_template is not None
            else None
        )

    @property
    def source_dir(self) -> Path:
        return self._dir

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        allowed = "all" if allow_special else self._always_allowed
        ids: list[int] = []
        for piece in _pieces(text):
            ids.extend(self._encoding.encode(piece, allowed_special=allowed, disallowed_special=()))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._encoding.decode(list(ids), errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._encoding.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError) as e:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})") from e
