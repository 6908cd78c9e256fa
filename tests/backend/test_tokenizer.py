"""Tokenizer layer: both file formats, special tokens, chat template, streaming detokenizer, tiny writers.

The tiny vocabulary (512 ids) is laid out like Kimi's: base tokens 0..479, then 32 special slots with
[BOS]=480, [EOS]=481, <|im_end|>=482, ..., <|im_middle|>=497, [UNK]=510, [PAD]=511.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jinja2
import pytest

from k3rt.backend.tokenizer import (
    HFTokenizer,
    IncrementalDetokenizer,
    TiktokenTokenizer,
    Tokenizer,
    load_tokenizer,
    write_tiny_tiktoken_tokenizer,
    write_tiny_tokenizer,
)
from k3rt.backend.tokenizer.tiktoken_file import _MAX_RUN_CHARS, _pieces

VOCAB_SIZE = 512
FIRST_SPECIAL = 480
KIMI_SPECIAL_IDS = {
    "[BOS]": 480,
    "[EOS]": 481,
    "<|im_end|>": 482,
    "<|im_user|>": 483,
    "<|im_assistant|>": 484,
    "<|start_header_id|>": 486,
    "<|end_header_id|>": 487,
    "[EOT]": 489,
    "<|im_system|>": 490,
    "<|tool_calls_section_begin|>": 491,
    "<|tool_calls_section_end|>": 492,
    "<|tool_call_begin|>": 493,
    "<|tool_call_argument_begin|>": 494,
    "<|tool_call_end|>": 495,
    "<|im_middle|>": 497,
    "<|reserved_token_485|>": 485,
    "[UNK]": 510,
    "[PAD]": 511,
}

TEXTS = {
    "ascii": "Hello, world! It's 2024; don't panic.\n\tIndented    spaces  ",
    "unicode": "naïve café, Grüße, Ærøskøbing, Łódź, Привет мир, αβγ",
    "emoji": "🎉🚀 launch 👩‍💻 coder 👍🏽 🇫🇷 ❤️",
    "cjk": "你好，世界！今天天气很好。日本語のテキスト、한국어 문장",
    "mixed": "def f(x):\n    return {'k': [1, 2, 3]}  # 注释 ✨\r\n\r\n",
    "empty": "",
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_tokenizers")
    write_tiny_tokenizer(root / "hf", vocab_size=VOCAB_SIZE, seed=0)
    write_tiny_tiktoken_tokenizer(root / "tiktoken", vocab_size=VOCAB_SIZE, seed=0)
    return {"hf": root / "hf", "tiktoken": root / "tiktoken"}


@pytest.fixture(scope="module", params=["hf", "tiktoken"])
def tok(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> Tokenizer:
    return load_tokenizer(tiny_dirs[request.param])


def test_load_picks_the_implementation_by_file(tiny_dirs: dict[str, Path]) -> None:
    assert isinstance(load_tokenizer(tiny_dirs["hf"]), HFTokenizer)
    assert isinstance(load_tokenizer(str(tiny_dirs["tiktoken"])), TiktokenTokenizer)


@pytest.mark.parametrize("name", list(TEXTS), ids=list(TEXTS))
def test_round_trip(tok: Tokenizer, name: str) -> None:
    text = TEXTS[name]
    ids = tok.encode(text)
    assert all(0 <= i < FIRST_SPECIAL for i in ids)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_both_formats_encode_identically(tiny_dirs: dict[str, Path]) -> None:
    hf, tt = load_tokenizer(tiny_dirs["hf"]), load_tokenizer(tiny_dirs["tiktoken"])
    corpus = [*TEXTS.values(), Path(__file__).read_text(encoding="utf-8"), json.__doc__ or ""]
    for text in corpus:
        for allow_special in (True, False):
            assert hf.encode(text, allow_special=allow_special) == tt.encode(text, allow_special=allow_special)
    assert all(hf.token_bytes(i) == tt.token_bytes(i) for i in range(VOCAB_SIZE))


def test_vocab_and_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.bos_token_id == 480
    assert tok.pad_token_id == 511
    assert tok.eos_token_ids == (481, 482)
    assert tok.special_token_ids == frozenset(range(FIRST_SPECIAL, VOCAB_SIZE))


@pytest.mark.parametrize("name", list(KIMI_SPECIAL_IDS), ids=list(KIMI_SPECIAL_IDS))
def test_special_token_is_one_id(tok: Tokenizer, name: str) -> None:
    token_id = KIMI_SPECIAL_IDS[name]
    assert tok.encode(name) == [token_id]
    assert tok.decode([token_id]) == name
    assert tok.token_bytes(token_id) == name.encode()
    as_text = tok.encode(name, allow_special=False)
    assert len(as_text) > 1 and not set(as_text) & tok.special_token_ids
    assert tok.decode(as_text) == name


def test_specials_inside_text(tok: Tokenizer) -> None:
    text = "<|im_user|>user<|im_middle|>Hi 你好<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 483 and ids[-1] == 482 and 497 in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "userHi 你好"


def test_token_bytes_rejects_unknown_ids(tok: Tokenizer) -> None:
    for bad in (VOCAB_SIZE, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.token_bytes(bad)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get <b>weather</b> & more",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18°C, sunny"},
    {"role": "assistant", "content": "It is 18°C and sunny in Paris."},
]
EXPECTED_PROMPT = (
    '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
    '"description":"Get <b>weather</b> & more","parameters":{"type":"object","properties":{"city":'
    '{"type":"string"}},"required":["city"]}}}]<|im_end|>'
    "<|im_system|>system<|im_middle|>You are a test.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18°C, sunny<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>It is 18°C and sunny in Paris.<|im_end|>"
)
GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"


def test_chat_template_full_conversation(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=False)
    assert rendered == EXPECTED_PROMPT
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS) == EXPECTED_PROMPT + GENERATION_PROMPT
    ids = tok.encode(rendered)
    assert ids.count(490) == 3 and ids.count(482) == 6 and ids.count(491) == 1


def test_chat_template_defaults_and_openai_nulls(tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>ab<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )


def test_chat_template_rejects_unknown_role(tok: Tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="unsupported role: narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_chat_template_is_sandboxed(tok: Tokenizer, tmp_path: Path) -> None:
    src = Path(tok.source_dir)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}", encoding="utf-8")
    with pytest.raises(jinja2.exceptions.SecurityError):
        load_tokenizer(dst).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(tok: Tokenizer, tmp_path: Path) -> None:
    dst = tmp_path / "model"
    shutil.copytree(tok.source_dir, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    del config["chat_template"]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match=r"has no chat template.*chat_template\.jinja") as error:
        load_tokenizer(dst).apply_chat_template([{"role": "user", "content": "x"}])
    assert str(dst) in str(error.value)


def test_generation_config_and_special_tokens_map(tok: Tokenizer, tmp_path: Path) -> None:
    dst = tmp_path / "model"
    shutil.copytree(tok.source_dir, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    del config["bos_token"]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    (dst / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "[EOT]"}}), encoding="utf-8")
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [489, 481]}), encoding="utf-8")
    (dst / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}", encoding="utf-8")
    reloaded = load_tokenizer(dst)
    assert reloaded.bos_token_id == 489
    assert reloaded.eos_token_ids == (481, 489, 482)
    assert reloaded.apply_chat_template([{"role": "user", "content": "x"}]) == "[EOT]x"


class _NoDecode(Tokenizer):
    """Delegates to a real tokenizer but fails on decode(), to prove the detokenizer works from bytes."""

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner

    source_dir = property(lambda self: self._inner.source_dir)
    vocab_size = property(lambda self: self._inner.vocab_size)
    bos_token_id = property(lambda self: self._inner.bos_token_id)
    eos_token_ids = property(lambda self: self._inner.eos_token_ids)
    pad_token_id = property(lambda self: self._inner.pad_token_id)
    special_token_ids = property(lambda self: self._inner.special_token_ids)
    chat_template = property(lambda self: self._inner.chat_template)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        return self._inner.encode(text, allow_special=allow_special)

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:  # noqa: ANN001
        raise AssertionError("IncrementalDetokenizer must not call decode()")

    def token_bytes(self, token_id: int) -> bytes:
        return self._inner.token_bytes(token_id)


@pytest.mark.parametrize("name", ["unicode", "emoji", "cjk", "mixed"])
def test_incremental_detokenizer_never_splits_a_character(tok: Tokenizer, name: str) -> None:
    text = TEXTS[name] + "<|im_end|>"
    ids = tok.encode(text)
    # the case under test: some token holds only part of a UTF-8 character
    partial = [i for i in ids if not _is_utf8(tok.token_bytes(i))]
    assert partial, "test text should split a multi-byte character across tokens"

    detok = IncrementalDetokenizer(_NoDecode(tok))
    pieces = [detok.push(i) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detok.flush() == text == tok.decode(ids)

    skipping = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(skipping.push(i) for i in ids) + skipping.flush() == TEXTS[name]


def test_incremental_detokenizer_flushes_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == "\ufffd"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_matches_transformers(tiny_dirs: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(tiny_dirs["hf"])
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_dirs["hf"] / "tokenizer.json"))
    for text in [*TEXTS.values(), "<|im_user|>user<|im_middle|>hi<|im_end|>", EXPECTED_PROMPT]:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False)
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)

    with_config = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_dirs["hf"]))
    expected = with_config.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATION, tools=TOOLS) == expected


@pytest.mark.serial  # a wall-clock bound: run alone (Makefile)
def test_tiny_writer_is_deterministic_and_exact(tmp_path: Path) -> None:
    start = time.perf_counter()
    write_tiny_tokenizer(tmp_path / "a")
    assert time.perf_counter() - start < 2.0
    write_tiny_tokenizer(tmp_path / "b")
    write_tiny_tokenizer(tmp_path / "c", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() != (tmp_path / "c" / "tokenizer.json").read_bytes()

    write_tiny_tiktoken_tokenizer(tmp_path / "t1", seed=1)
    write_tiny_tiktoken_tokenizer(tmp_path / "t2", seed=1)
    assert (tmp_path / "t1" / "tiktoken.model").read_bytes() == (tmp_path / "t2" / "tiktoken.model").read_bytes()


@pytest.mark.parametrize("vocab_size", [288, 1000, 4096])
def test_tiny_vocab_size_is_exact(tmp_path: Path, vocab_size: int) -> None:
    write_tiny_tokenizer(tmp_path / "hf", vocab_size=vocab_size)
    write_tiny_tiktoken_tokenizer(tmp_path / "tt", vocab_size=vocab_size)
    for kind in ("hf", "tt"):
        loaded = load_tokenizer(tmp_path / kind)
        assert loaded.vocab_size == vocab_size
        assert loaded.pad_token_id == vocab_size - 1
        assert loaded.encode("<|im_end|>") == [vocab_size - 32 + 2]


def test_tiny_vocab_too_small(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 256"):
        write_tiny_tokenizer(tmp_path, vocab_size=287)


def test_tiktoken_loads_offline_without_cache_writes(
    tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "tiktoken_cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    loaded = TiktokenTokenizer(tiny_dirs["tiktoken"])
    assert loaded.decode(loaded.encode("offline")) == "offline"
    assert not cache.exists()


def test_tiktoken_non_special_added_token(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    # Kimi-K2-Thinking style: an added token marked "special": false stays one id even for untrusted text,
    # and survives skip_special_tokens.
    dst = tmp_path / "model"
    shutil.copytree(tiny_dirs["tiktoken"], dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"]["500"] = {"content": "<think>", "special": False}
    config_path.write_text(json.dumps(config), encoding="utf-8")
    loaded = load_tokenizer(dst)
    assert loaded.encode("<think>", allow_special=False) == [500]
    assert 500 not in loaded.special_token_ids
    assert loaded.decode(loaded.encode("<think>hi<|im_end|>"), skip_special_tokens=True) == "<think>hi"


def test_tiktoken_long_runs_are_cut_like_kimi(tok: Tokenizer) -> None:
    text = "a" * (2 * _MAX_RUN_CHARS + 7) + " " * (_MAX_RUN_CHARS + 1) + "end"
    pieces = list(_pieces(text))
    assert "".join(pieces) == text
    assert [len(p) for p in pieces] == [_MAX_RUN_CHARS, _MAX_RUN_CHARS, 7 + _MAX_RUN_CHARS, 4]
    assert tok.decode(tok.encode(text)) == text


def test_missing_directory_and_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.*tokenizer\.json.*tiktoken\.model"):
        load_tokenizer(empty)


def test_hf_sentencepiece_style_token_bytes(tmp_path: Path) -> None:
    # Not Kimi's format, but HFTokenizer accepts any tokenizer.json: "▁" is a space, <0xNN> is one byte.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xE4>": 2, "▁hi": 3, "▁": 4, "h": 5, "i": 6, "▁h": 7}
    merges = [("▁", "h"), ("▁h", "i")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert [loaded.token_bytes(i) for i in (1, 2, 3)] == [b"\n", b"\xe4", b" hi"]


def test_add_bos_token_starts_prompts_and_chats_with_bos(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    for kind in ("hf", "tiktoken"):
        plain = load_tokenizer(tiny_dirs[kind])
        assert plain.sequence_prefix == () and plain.encode_prompt("x = 1") == plain.encode("x = 1")
        shutil.copytree(tiny_dirs[kind], tmp_path / kind)
        path = tmp_path / kind / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "add_bos_token": True}))
        tok = load_tokenizer(tmp_path / kind)
        bos = tok.bos_token_id
        assert bos is not None and tok.sequence_prefix == (bos,)
        assert tok.encode("x = 1") == plain.encode("x = 1")  # encode itself never adds BOS
        assert tok.encode_prompt("x = 1") == [bos, *plain.encode("x = 1")]
        chat = [{"role": "user", "content": "hi"}]
        assert tok.encode_chat(chat) == [bos, *plain.encode_chat(chat)]
        # a prompt (or template) that already spells the BOS gets it once, not twice
        assert tok.encode_prompt("[BOS]x = 1") == [bos, *plain.encode("x = 1")]
