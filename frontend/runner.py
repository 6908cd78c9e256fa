"""Running `@function` programs from the client: sessions, run(), run_batch(), streaming.

A Session buffers the ops the program records and ships them when a value is needed (or the program
ends). The server keeps the session's states between flushes, so a program that looks at a value
mid-way continues where it left off, pinned to the same cache prefix.
"""

from __future__ import annotations

import queue
import threading
import uuid
from typing import TYPE_CHECKING, Any

from k3rt.frontend.ir import Op, Program

if TYPE_CHECKING:
    from k3rt.frontend.api import SglFunction
    from k3rt.frontend.client import Backend

SAMPLING_KEYS = ("max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty", "ignore_eos", "seed", "stop_token_ids")
_END = object()


class ProgramError(RuntimeError):
    """An error while executing a program on the server; names the program's source line."""


class Session:
    def __init__(self, backend: "Backend", name: str, defaults: dict[str, Any], *, ship: bool = True,
                 stream: bool = False) -> None:
        self.backend, self.name, self.defaults, self.ship, self.stream = backend, name, defaults, ship, stream
        self.pid = uuid.uuid4().hex
        self.pending: list[Op] = []
        self.num_states = 1
        self.vars: dict[int, dict[str, Any]] = {}
        self.texts: dict[int, str] = {}
        self.msgs: dict[int, list[dict[str, str]]] = {}
        self.metas: dict[int, dict[str, Any]] = {}
        self.started = False
        self.closed = False
        self.round_trips = 0
        self.error: str | None = None
        self.lock = threading.RLock()
        # not self.lock: flush() holds that while the I/O thread delivers stream events
        self.stream_lock = threading.Lock()
        self.streams: dict[tuple[int, str | None], queue.Queue] = {}
        self.streams_ended = False

    # ---- recording ----

    def add(self, op: Op) -> None:
        with self.lock:
            if self.closed:
                raise ProgramError(f"{self.name}: the program has finished; its state is read-only")
            self.pending.append(op)
            if not self.ship and op.kind in ("gen", "select"):
                self.flush()  # client-side mode: one request per call

    def new_states(self, n: int) -> list[int]:
        with self.lock:
            ids = list(range(self.num_states, self.num_states + n))
            self.num_states += n
            return ids

    # ---- values ----

    def value(self, sid: int, name: str) -> Any:
        self.flush()
        try:
            return self.vars[sid][name]
        except KeyError:
            raise KeyError(f"variable {name!r} was never generated in this state") from None

    def text(self, sid: int) -> str:
        self.flush()
        return self.texts.get(sid, "")

    def messages(self, sid: int) -> list[dict[str, str]]:
        self.flush()
        return self.msgs.get(sid, [])

    def meta(self, sid: int, name: str) -> dict[str, Any]:
        self.flush()
        return self.metas.get(sid, {}).get(name, {})

    # ---- shipping ----

    def flush(self, final: bool = False) -> None:
        with self.lock:
            if not self.pending and not final:
                return
            if not self.pending and self.started:
                self.close()
                return
            prog = Program(self.pending, self.num_states, self.defaults, self.name)
            self.pending = []
            result = self.backend.run(self.pid, prog.to_dict(), final=final, stream=self.stream,
                                      on_event=self._on_event if self.stream else None)
            self.round_trips += 1
            self.started = True
            if final:
                self.closed = True
            for key, table in (("variables", self.vars), ("texts", self.texts), ("messages", self.msgs),
                               ("meta", self.metas)):
                for sid, v in (result.get(key) or {}).items():
                    table[int(sid)] = v
            if result.get("error"):
                self.error = result["error"]
                self.closed = True
                self._end_streams()
                line = result.get("error_line")
                where = f", line {line}" if line else ""
                raise ProgramError(f"{self.name}{where}: {result['error']}")
            if final:
                self._end_streams()

    def close(self) -> None:
        if self.started and not self.closed:
            self.closed = True
            self.backend.close(self.pid)
        self._end_streams()

    # ---- streaming ----

    def _queue(self, sid: int, name: str | None) -> queue.Queue:
        with self.stream_lock:
            q = self.streams.get((sid, name))
            if q is None:
                q = self.streams[(sid, name)] = queue.Queue()
                if self.streams_ended:  # asked for after the program ended: nothing more will come
                    q.put(_END)
            return q

    def _on_event(self, sid: int, name: str | None, delta: str, done: bool) -> None:
        for key in ((sid, name), (sid, None)) if name is not None else ((sid, None),):
            q = self._queue(*key)
            if delta:
                q.put(delta)
            if done and key[1] is not None:
                q.put(_END)

    def _end_streams(self) -> None:
        with self.stream_lock:
            self.streams_ended = True
            for q in self.streams.values():
                q.put(_END)

    def stream_iter(self, sid: int, name: str | None):
        if not self.stream:  # as in SGLang: a state run without stream=True yields the finished value once
            yield self.text(sid) if name is None else str(self.value(sid, name))
            return
        q = self._queue(sid, name)
        while True:
            item = q.get()
            if item is _END:
                return
            yield item


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    defaults = {("max_tokens" if k == "max_new_tokens" else k): kwargs[k] for k in SAMPLING_KEYS if k in kwargs}
    return defaults, {k: v for k, v in kwargs.items() if k not in SAMPLING_KEYS}


def _execute(func: "SglFunction", session: Session, args: tuple, kwargs: dict[str, Any]) -> None:
    from k3rt.frontend.state import ProgramState

    s = ProgramState(session, 0)
    try:
        func.func(s, *args, **{**func.bound, **kwargs})
        session.flush(final=True)
    except ProgramError:
        raise
    except BaseException:
        session.close()
        raise


def run_program(func: "SglFunction", args: tuple, kwargs: dict[str, Any], *, backend: "Backend | None",
                stream: bool, ship: bool) -> Any:
    from k3rt.frontend.client import resolve_backend
    from k3rt.frontend.state import ProgramState

    defaults, kwargs = _split_kwargs(kwargs)
    session = Session(resolve_backend(backend), func.__name__, defaults, ship=ship, stream=stream)
    if not stream:
        _execute(func, session, args, kwargs)
        return ProgramState(session, 0)

    def body() -> None:
        try:
            _execute(func, session, args, kwargs)
        except BaseException as e:  # surfaced through s.error() and by ending the streams
            session.error = session.error or f"{type(e).__name__}: {e}"
            session._end_streams()

    threading.Thread(target=body, name=f"k3rt-{func.__name__}", daemon=True).start()
    return ProgramState(session, 0)


def run_batch(func: "SglFunction", batch: list[dict[str, Any]], defaults: dict[str, Any], *,
              backend: "Backend | None", progress_bar: bool, ship: bool) -> list[Any]:
    """Programs run concurrently: each records its ops on a worker thread and ships them; the server runs
    them as concurrent tasks, so shared prefixes are computed once by the prefix cache."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from k3rt.frontend.client import resolve_backend

    be = resolve_backend(backend)
    with ThreadPoolExecutor(max_workers=max(1, min(64, len(batch)))) as pool:
        futs = [pool.submit(run_program, func, (), {**defaults, **kw}, backend=be, stream=False, ship=ship)
                for kw in batch]
        out = []
        for f in tqdm(futs, desc=f"run_batch {func.__name__}", disable=not progress_bar):
            out.append(f.result())
    return out
