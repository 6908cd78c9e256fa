"""Tiny Kimi-style tokenizers for test checkpoints (`k3rt make-tiny`), trained offline in milliseconds, and
`write_trained_tokenizer`, the same layout trained on a real corpus (the default model's 8K vocabulary).

`write_tiny_tokenizer` writes tokenizer.json + tokenizer_config.json; `write_tiny_tiktoken_tokenizer` writes
the same vocabulary as Kimi ships it, tiktoken.model + tokenizer_config.json. Both encode every text to the
same ids. The layout copies Kimi's: byte-level BPE base tokens first (ids 0..N-1, Kimi's pre-tokenizer
pattern), then a block of reserved special tokens whose named slots sit at Kimi's offsets ([BOS] at N,
[EOS] at N+1, <|im_end|> at N+2, ..., [UNK] and [PAD] last). Kimi reserves 256 slots; the tiny vocabulary
reserves `TINY_NUM_RESERVED_SPECIAL_TOKENS` and says so in tokenizer_config.json.

Determinism: the corpus is built-in text plus pseudo-words drawn from `random.Random(seed)`, and HF's
BpeTrainer breaks ties by pair ids, so the same arguments give byte-identical files on every run.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

from k3rt.backend.tokenizer.hf import TOKENIZER_JSON_FILE, byte_level_decode, byte_level_encode
from k3rt.backend.tokenizer.tiktoken_file import KIMI_PAT_STR, TIKTOKEN_MODEL_FILE, write_tiktoken_ranks

TINY_NUM_RESERVED_SPECIAL_TOKENS = 32

# Offsets of Kimi's named special tokens from the first special id; [UNK] and [PAD] take the last two slots.
KIMI_SPECIAL_TOKEN_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
}

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Kimi's chat format: every turn is <|im_{kind}|>{role or name}<|im_middle|>{content}<|im_end|>, tools are
# declared in a leading "tool_declare" system turn as compact JSON, tool calls follow the assistant text in a
# <|tool_calls_section_begin|> block, and tool results are system-kind turns "## Return of {call id}\n...".
# A default system turn is inserted when the conversation does not start with one.
TINY_CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
  {%- if content is string -%}
    {{ content }}
  {%- elif content is not none -%}
    {%- for part in content -%}
      {%- if part['type'] == 'text' -%}
        {{ part['text'] }}
      {%- else -%}
        {{ raise_exception('unsupported content part type: ' ~ part['type']) }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set turn_marker = {'system': '<|im_system|>', 'user': '<|im_user|>', 'assistant': '<|im_assistant|>', \
'tool': '<|im_system|>'} -%}
{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and message['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>""" + DEFAULT_SYSTEM_PROMPT + """<|im_end|>
  {%- endif -%}
  {%- if message['role'] not in turn_marker -%}
    {{ raise_exception('unsupported role: ' ~ message['role']) }}
  {%- endif -%}
  {{ turn_marker[message['role']] }}{{ message.get('name') or message['role'] }}<|im_middle|>
  {%- if message['role'] == 'tool' -%}
    ## Return of {{ message['tool_call_id'] }}{{ '\\n' }}{{ render_content(message.get('content')) }}
  {%- else -%}
    {{ render_content(message.get('content')) }}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    <|tool_calls_section_begin|>
    {%- for call in message['tool_calls'] -%}
      <|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
      {%- if call['function']['arguments'] is string -%}
        {{ call['function']['arguments'] }}
      {%- else -%}
        {{ call['function']['arguments'] | tojson }}
      {%- endif -%}
      <|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

# Built-in training text: prose, code, JSON and several scripts, so that merges cover what tests encode.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tokenizer turns text into numbers and back again;
an inference engine schedules requests, runs the model, samples the next token and streams text out.
Kimi Linear mixes linear attention layers with a few full attention layers, and each request keeps
its own recurrent state. When the batch is full, the scheduler waits; when a request finishes, its
pages return to the free list. Don't panic: it's only a test, and we'll check that they're right.
def encode(self, text: str) -> list[int]:
    ids = []
    for piece in self.split(text):
        ids.extend(self.lookup(piece))
    return ids

class Request:
    def __init__(self, prompt_ids, max_tokens=16, temperature=0.0):
        self.prompt_ids = list(prompt_ids)
        self.output_ids = []
        self.max_tokens = max_tokens
        self.temperature = temperature

if __name__ == "__main__":
    print("hello, world", 12345, 3.14159, [1, 2, 3], {"key": "value"})
{"role": "user", "content": "What is the weather in Paris today?"}
{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
 "properties": {"city": {"type": "string", "description": "City name"}}, "required": ["city"]}}}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 65536 163840 3.5e-4 -42 +7 50% $19.99
Punctuation and symbols: ... !? ;; :: -> => == != <= >= && || // /* */ # @ ~ ^ ` | \\ " '
Voilà: naïve café, Grüße aus Köln, señor, smörgåsbord, façade, déjà vu, Ærøskøbing, Łódź.
Привет, мир! Как дела? Это проверка токенизатора. Ελληνικά γράμματα: αβγδε. שלום עולם.
你好，世界！今天天气很好，我们一起去公园散步吧。机器学习和自然语言处理是人工智能的重要方向。
月之暗面的模型可以阅读很长的上下文。中文、日本語のテキスト、한국어 문장도 포함합니다.
こんにちは、世界。カタカナとひらがなを混ぜた文章です。안녕하세요, 반갑습니다.
Emoji: 🎉 🚀 😀 👍🏽 👩‍💻 🇫🇷 ❤️ ✨ 🤖 — arrows → ← ↑ ↓, math ∑ ∫ √ ∞ ≈ ≠ ±, currency € £ ¥ ₹.
Tabs\tand\ttabs, trailing spaces   
and blank lines


then indentation:
        deeply nested code goes here
"""

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _corpus(num_merges: int, seed: int) -> list[str]:
    # The built-in text supports a few hundred merges; seeded pseudo-words (syllable strings, so merges look
    # like subwords) make room for as many more as the vocabulary asks for, and make `seed` matter.
    rng = random.Random(seed)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    lines = [_CORPUS]
    for _ in range(num_merges // 4 + 16):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(8)]
        lines.append(" ".join(word.capitalize() if rng.random() < 0.2 else word for word in words))
    return lines


def _kimi_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _special_token_names(num_base: int, num_reserved: int) -> list[str]:
    named = dict(KIMI_SPECIAL_TOKEN_OFFSETS)
    named[num_reserved - 2] = "[UNK]"
    named[num_reserved - 1] = "[PAD]"
    return [named.get(offset, f"<|reserved_token_{num_base + offset}|>") for offset in range(num_reserved)]


def _num_base_tokens(vocab_size: int) -> int:
    num_base = vocab_size - TINY_NUM_RESERVED_SPECIAL_TOKENS
    if num_base < 256:
        raise ValueError(
            f"vocab_size={vocab_size} leaves {num_base} base tokens; at least 256 (one per byte) plus "
            f"{TINY_NUM_RESERVED_SPECIAL_TOKENS} special tokens are needed"
        )
    return num_base


def _train_bpe(texts: Iterable[str], num_base: int, what: str) -> list[bytes]:
    """Byte strings of `num_base` base tokens learned from `texts`, index = id = tiktoken rank."""
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = _kimi_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=num_base, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    vocab = backend.get_vocab()
    if len(vocab) != num_base:
        raise ValueError(f"{what} only supports {len(vocab)} base tokens, {num_base} were asked for")
    return [byte_level_decode(token) for token in sorted(vocab, key=vocab.__getitem__)]


def _train_base_tokens(vocab_size: int, seed: int) -> list[bytes]:
    num_base = _num_base_tokens(vocab_size)
    return _train_bpe(_corpus(num_base - 256, seed), num_base, "the tiny corpus")


def _merges_from_ranks(tokens: list[bytes]) -> list[tuple[str, str]]:
    # tiktoken merges whichever adjacent pair forms the lowest-ranked token, by any split; HF's BPE only applies
    # listed merges in list order. Listing every split of every token, ordered by the rank of the token it
    # forms, makes HF's BPE (with ignore_merges, which matches tiktoken's whole-piece lookup) agree exactly.
    rank = {token: i for i, token in enumerate(tokens)}
    merges: list[tuple[int, int, int]] = []
    for merged_rank, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in rank and right in rank:
                merges.append((merged_rank, rank[left], rank[right]))
    merges.sort()
    return [(byte_level_encode(tokens[left]), byte_level_encode(tokens[right])) for _, left, right in merges]


def _tokenizer_config(special_names: list[str], num_base: int, tokenizer_class: str) -> dict[str, Any]:
    added_tokens = {
        str(num_base + offset): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, name in enumerate(special_names)
    }
    return {
        "added_tokens_decoder": added_tokens,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": TINY_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "num_reserved_special_tokens": TINY_NUM_RESERVED_SPECIAL_TOKENS,
        "tokenizer_class": tokenizer_class,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_tokenizer(out_dir: Path, *, vocab_size: int = 512, seed: int = 0) -> None:
    """Write tokenizer.json and tokenizer_config.json for a `vocab_size`-id Kimi-style vocabulary (exactly
    `vocab_size` ids, the special tokens included) into `out_dir`, creating it if needed."""
    _write_tokenizer_files(Path(out_dir), _train_base_tokens(vocab_size, seed), vocab_size)


def write_trained_tokenizer(out_dir: Path, texts: Iterable[str], *, vocab_size: int = 8192) -> None:
    """Train the same Kimi-style byte-level BPE on `texts` (a real corpus, e.g. the default model's training
    split) and write tokenizer.json + tokenizer_config.json into `out_dir`: exactly `vocab_size` ids, the
    last TINY_NUM_RESERVED_SPECIAL_TOKENS of them the special tokens, with the Kimi chat template. The same
    texts in the same order give byte-identical files."""
    _write_tokenizer_files(Path(out_dir), _train_bpe(texts, _num_base_tokens(vocab_size), "the corpus"), vocab_size)


def _write_tokenizer_files(out_dir: Path, tokens: list[bytes], vocab_size: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    special_names = _special_token_names(len(tokens), TINY_NUM_RESERVED_SPECIAL_TOKENS)

    vocab = {byte_level_encode(token): i for i, token in enumerate(tokens)}
    backend = HFBackend(models.BPE(vocab=vocab, merges=_merges_from_ranks(tokens), ignore_merges=True))
    backend.pre_tokenizer = _kimi_pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special_names])
    assert backend.get_vocab_size(with_added_tokens=True) == vocab_size
    assert backend.token_to_id(special_names[-1]) == vocab_size - 1

    (out_dir / TOKENIZER_JSON_FILE).write_text(backend.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(
        out_dir / "tokenizer_config.json",
        _tokenizer_config(special_names, len(tokens), tokenizer_class="PreTrainedTokenizerFast"),
    )


def write_tiny_tiktoken_tokenizer(out_dir: Path, *, vocab_size: int = 512, seed: int = 0) -> None:
    """Write the vocabulary `write_tiny_tokenizer` would, in Kimi's format: tiktoken.model and
    tokenizer_config.json (special-token names in `added_tokens_decoder`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = _train_base_tokens(vocab_size, seed)
    special_names = _special_token_names(len(tokens), TINY_NUM_RESERVED_SPECIAL_TOKENS)
    write_tiktoken_ranks(out_dir / TIKTOKEN_MODEL_FILE, tokens)
    _write_json(
        out_dir / "tokenizer_config.json",
        _tokenizer_config(special_names, len(tokens), tokenizer_class="TikTokenTokenizer"),
    )
