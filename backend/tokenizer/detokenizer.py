"""Stream text out of generated token ids, one token at a time, without ever emitting half a character.

Works on each token's raw bytes (`Tokenizer.token_bytes`) through an incremental UTF-8 decoder, so a push
costs O(length of one token) however long the sequence gets, unlike diffing `decode()` of a growing prefix.
For byte-level vocabularies the concatenated output equals `tokenizer.decode(ids)`. Stop strings and
special-token filtering beyond `skip_special_tokens` are not this module's business.
"""
from __future__ import annotations

import codecs

from k3rt.backend.tokenizer.base import Tokenizer


class IncrementalDetokenizer:
    """Decodes one request's generated ids. Not thread-safe; use one instance per sequence.

    Bytes that end in the middle of a UTF-8 character are held back until the token that completes them
    arrives; bytes that can never become valid UTF-8 are emitted as U+FFFD as soon as that is certain.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; returns only the text it completes (possibly "")."""
        if token_id in self._skipped:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of sequence: returns whatever is held back, an unfinished character becoming U+FFFD."""
        return self._utf8.decode(b"", final=True)
