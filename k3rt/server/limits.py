"""What one request may cost the gateway: the prompt budget (a text that cannot fit is refused before it is
tokenized), and `BigBodies`, which keeps the work on a big body off the event loop and out of the garbage
collector's way, and hands its memory back when the request ends.

Prompt budget. A token stands for at most `max_token_bytes` bytes of UTF-8: the longest entry of the
vocabulary, special tokens' text included (`Tokenizer.token_bytes`). When the tokenizer is lossless
(decode(encode(text)) == text, as byte-level BPE is: tiktoken and GPT-2-style tokenizer.json), the tokens of
a text spell out all of its bytes, so a text of B bytes needs at least B / max_token_bytes tokens, whatever
the merges do. A prompt keeps at least one of the context's `context_length` positions for output, so a text
of more than (context_length - 1) * max_token_bytes bytes can never be served: it is refused (413, naming
the field) before it is tokenized. Nothing that fits is refused. The bound is loose on purpose (real text
averages 3-5 bytes per token, the longest token is often 16-128 bytes); its job is to stop the 20 MB prompt
that would take the tokenizer half a minute and gigabytes, not to replace the exact context check after
tokenizing. A tokenizer that changes text (a normalizer, an unknown-token fallback: a start-up round trip of
a few probe strings fails) gets no budget; its prompts are only checked after tokenizing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from k3rt.server.errors import APIError

if TYPE_CHECKING:
    from k3rt.backend.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bodies above this are parsed, templated and tokenized in worker threads (BigBodies). Below it, parsing
# takes a few milliseconds at most (128K token ids) and a thread hop would cost more than it saves.
BIG_BODY_BYTES = 256 << 10

# text the round trip must reproduce exactly: compatibility forms a normalizer would fold, combining marks,
# characters outside the BMP, control characters, whitespace runs
_PROBES = ("Hello,  World!\n\t x", "ﬁ café cafe\u0301 Ａ ½ ① Ω", "日本語 한국어 🙂\u200b\x00\x7f", "    \n\n  end ")


@dataclass(frozen=True)
class PromptBudget:
    """The most UTF-8 bytes a text field may have and still fit the context (None: no limit known)."""

    context_length: int
    max_token_bytes: int | None  # the longest token's bytes; None for a tokenizer that is not lossless

    @classmethod
    def of(cls, tokenizer: Tokenizer, context_length: int) -> PromptBudget:
        longest = max((len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)), default=0)
        lossless = longest > 0 and all(
            tokenizer.decode(tokenizer.encode(p, allow_special=False)) == p for p in _PROBES)
        if not lossless:
            log.warning("the tokenizer does not reproduce its input exactly: prompts are length-checked only "
                        "after tokenizing")
        return cls(context_length, longest if lossless else None)

    @property
    def max_text_bytes(self) -> int | None:
        if self.max_token_bytes is None:
            return None
        return max(self.context_length - 1, 0) * self.max_token_bytes

    def check_text(self, text: str, param: str) -> None:
        """413 naming `param` if `text` has more UTF-8 bytes than any prompt that fits the context."""
        limit = self.max_text_bytes
        if limit is None or len(text) <= limit // 4:  # at most 4 bytes per character: fits
            return
        if text.isascii() or len(text) > limit:  # >= 1 byte per character: no need to encode (copy) it
            size, at_least = len(text), not text.isascii()
        else:
            size, at_least = len(text.encode("utf-8", "surrogatepass")), False
        if size > limit:
            raise APIError(413, f"{param}: {'at least ' if at_least else ''}{size} bytes of text cannot fit the "
                           f"context of {self.context_length} tokens (no token is longer than "
                           f"{self.max_token_bytes} bytes, so at most {limit} bytes fit)", param=param,
                           code="context_length_exceeded")


_R = TypeVar("_R")


class BigBodies:
    """The work on requests whose body is over BIG_BODY_BYTES: done in worker threads, kept away from the
    cyclic garbage collector, and followed by handing memory back. One per app.

    Parsing a body of 300K messages makes over a million objects, and every burst of allocations triggers
    a collection; the full ones walk every object in the process while holding the GIL, 30-110 ms each,
    and the event loop waits for all of them. So the collector is off while any big request is in flight
    (`begin` to `end`). Refcounts still free the request's objects when it ends (`dismantle`, a piece at a
    time); the last big request to end turns the collector back on, runs one full collection for what was
    left in reference cycles (a 413's traceback holds the coroutine frame that held the token ids) and
    trims the C heap. That collection is short because the server froze its start-up heap
    (`freeze_startup_heap`): it walks only what is younger. Under a steady stream of overlapping big
    requests a collection still comes at least every COLLECT_EVERY_S, so cyclic garbage is never kept long.

    (The collector used to be paused per step and what existed frozen after each; the last request then
    had to unfreeze everything, the start-up heap too, and that one collection held /health 35-60 ms.)"""

    COLLECT_EVERY_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0  # big requests begun and not ended
        self._gc_was_enabled = True
        self._collected_at = time.monotonic()

    def begin(self) -> None:
        with self._lock:
            if self._requests == 0:
                self._gc_was_enabled = gc.isenabled()
                gc.disable()
            self._requests += 1

    async def run(self, fn: Callable[[], _R]) -> _R:
        """`fn()` in a worker thread (between `begin` and `end`: the collector is off)."""
        return await asyncio.to_thread(_step, fn)

    async def end(self, held: list[Any]) -> None:
        """A big request ended (answered or failed). `held`: what it kept alive for this moment (its parsed
        body), freed here in a worker thread; the last big request collects and trims."""
        await asyncio.to_thread(dismantle, held)
        with self._lock:
            self._requests -= 1
            if self._requests == 0 and self._gc_was_enabled:
                gc.enable()
            if self._requests > 0 and time.monotonic() - self._collected_at < self.COLLECT_EVERY_S:
                return
            self._collected_at = time.monotonic()
        await asyncio.to_thread(_collect)


def _step(fn: Callable[[], _R]) -> _R:
    try:
        return fn()
    except BaseException as e:
        # the error goes to the event loop; the frames it passed through need not keep their locals (the
        # token ids of a prompt too long, say), which would otherwise die in a reference cycle later
        traceback.clear_frames(e.__traceback__)
        raise


def _collect() -> None:
    gc.collect()
    release_memory()


def freeze_startup_heap() -> None:
    """Move what the gateway holds once it is up (modules, the app's routes and pydantic validators: ~50K
    objects) out of the cyclic collector's view for good: a full pass over them held the GIL 25-40 ms,
    and the collector runs such passes by itself every so often, stalling every request in flight."""
    gc.collect()
    gc.freeze()


_PIECE = 4096  # list items freed per step of `dismantle` (~0.2 ms of strings)
_LEAVES = (str, int, float, type(None))  # what `dismantle` frees without looking inside


def dismantle(stack: list[Any]) -> None:
    """Free what `stack` holds one object at a time, taking apart the lists, dicts and models that nothing
    else holds. Dropping a parsed body of a million objects at once frees them all in one C call with the
    GIL held (~100 ms for 300K messages, on whichever thread drops the last reference); here each step is
    a point where the event loop can get the GIL."""
    while stack:
        v = stack.pop()
        if sys.getrefcount(v) > 2:  # `v` and getrefcount's argument: anything more is another owner
            continue
        if isinstance(v, BaseModel):
            v = v.__dict__  # the model goes; its fields stay in `v`
        if isinstance(v, dict):
            while v:
                stack.append(v.popitem()[1])
        elif isinstance(v, list):
            while v:  # a piece at a time: the leaves (strings, numbers) are freed with `tail`
                tail = v[-_PIECE:]
                del v[-_PIECE:]
                stack.extend(x for x in tail if not isinstance(x, _LEAVES))
                del tail


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim  # glibc only; musl and macOS have none
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim(0)`; a no-op elsewhere).

    A big body's copies (the bytes, the parsed strings, token lists) are freed when its request ends, but
    glibc keeps freed heap pages, and its mmap threshold grows to the largest block freed, so without this
    the gateway's RSS stays at its high-water mark. Blocking (it walks the heap): call it in a thread."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
