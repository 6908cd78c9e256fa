"""The tokenizer interface the rest of k3rt uses: text <-> token ids, raw token bytes, and chat prompts.

Two implementations exist, chosen by `load_tokenizer` from the files in the model directory: `HFTokenizer`
(tokenizer.json) and `TiktokenTokenizer` (Kimi's tiktoken.model). `encode` never adds BOS/EOS; the
sequence-level entry points (`encode_prompt` for a text prompt, `encode_chat`) start with BOS when the
model's tokenizer_config.json says `add_bos_token` (k3-tiny does; Kimi's chat template carries its own
markers). Streaming text out of generated ids is `IncrementalDetokenizer`'s job.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3rt.backend.tokenizer.chat_template import ChatTemplate

# Kimi's end-of-turn marker; generation stops on it even where the config names only [EOS].
IM_END = "<|im_end|>"


class Tokenizer(ABC):
    """A loaded vocabulary. Instances are immutable after construction and safe to share between threads."""

    @property
    @abstractmethod
    def source_dir(self) -> Path:
        """The model directory this tokenizer was loaded from (used in error messages)."""

    @abstractmethod
    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids for `text`, without BOS/EOS. With `allow_special`, special-token strings in `text`
        (e.g. "<|im_end|>") become their single ids; without it they are encoded as ordinary text, which is
        what untrusted user content needs."""

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; a special token gives its UTF-8 text. Byte-level tokens may
        hold part of a UTF-8 character. Concatenating these over a sequence and decoding gives `decode`."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (largest id + 1)."""

    @property
    @abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the EOS token, generation_config's `eos_token_id`s and <|im_end|>,
        deduplicated, in that order."""

    @property
    @abstractmethod
    def pad_token_id(self) -> int | None: ...

    @property
    @abstractmethod
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""

    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate | None: ...

    @property
    def sequence_prefix(self) -> tuple[int, ...]:
        """Ids every sequence starts with: (BOS,) for a model trained that way (`add_bos_token`), else ()."""
        return ()

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a whole text prompt (the start of a sequence): `sequence_prefix`, then `encode(text)`."""
        return self._start_sequence(self.encode(text))

    def _start_sequence(self, ids: list[int]) -> list[int]:
        # once: a prompt or template that already spells the BOS (e.g. "{{ bos_token }}...") must not get two
        prefix = list(self.sequence_prefix)
        return ids if ids[:len(prefix)] == prefix else prefix + ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) with the model's chat template; returns text to `encode`
        with `allow_special=True`. Raises ValueError if the model has no chat template."""
        template = self.chat_template
        if template is None:
            raise ValueError(
                f"the tokenizer in {self.source_dir} has no chat template (looked for chat_template.jinja and "
                f"'chat_template' in tokenizer_config.json)"
            )
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation, where only the template's own text may produce special
        tokens: message contents are encoded with `allow_special=False`, so a user who types
        "<|im_end|>" gets those characters, not a turn boundary. The template is rendered with a marker in
        place of each string content and the pieces are encoded separately; a template that transforms
        contents (so a marker does not come back exactly once) falls back to encoding the whole text."""
        marked, contents = [], []
        for m in messages:
            c = m.get("content")
            if isinstance(c, str) and c:
                marked.append({**m, "content": f"\x00K3RT{len(contents)}\x00"})
                contents.append(c)
            else:
                marked.append(m)
        text = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        pieces = text.split("\x00")
        # pieces alternate template text / "K3RT{i}" markers when every marker appears once, in order
        if len(pieces) != 2 * len(contents) + 1 or [p for p in pieces[1::2]] != [f"K3RT{i}" for i in range(len(contents))]:
            return self.encode_prompt(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                               tools=tools, **kwargs))
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.encode(piece) if piece else []
            else:
                ids += self.encode(contents[i // 2], allow_special=False)
        return self._start_sequence(ids)


class LoadedTokenizer(Tokenizer):
    """The descriptive properties, read from attributes every loader sets in its constructor:
    _vocab_size, _bos_id, _add_bos, _eos_ids, _pad_id, _special_ids, _chat_template."""

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._chat_template

    @property
    def sequence_prefix(self) -> tuple[int, ...]:
        return (self._bos_id,) if self._add_bos and self._bos_id is not None else ()


def collect_eos_token_ids(
    eos_token_id: int | None, generation_eos_ids: Sequence[int], im_end_id: int | None
) -> tuple[int, ...]:
    """The `eos_token_ids` rule shared by the implementations: EOS, then generation_config's ids, then
    <|im_end|>, each once."""
    candidates = [eos_token_id, *generation_eos_ids, im_end_id]
    return tuple(dict.fromkeys(i for i in candidates if i is not None))
