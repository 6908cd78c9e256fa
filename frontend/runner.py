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

import orjson

from k3rt.frontend.ir import GEN_OPTIONS, Op, Program

if TYPE_CHECKING:
    from k3rt.frontend.api import SglFunction
    from k3rt.frontend.client import Backend

SAMPLING_KEYS = ("max_tokens", "max_new_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed", "stop_token_ids")
# every keyword of run()/run_batch() that is a default for the program's gens, never a program argument
RUN_KEYS = (*SAMPLING_KEYS, "stop", *GEN_OPTIONS)
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
        self.ret_value: Any = None  # what the program function returned
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

    def has(self, sid: int, name: str) -> bool:
        self.flush()
        return name in self.vars.get(sid, {})

    def set_value(self, sid: int, name: str, value: Any, line: int = 0) -> None:
        """A running program ships the assignment (its server-side state has the variable, so a join
        gathers it); a finished program's state is only a record here, so only the record changes."""
        with self.lock:
            if not self.closed:
                try:
                    orjson.dumps(value)
                except TypeError:
                    raise TypeError(f"s[{name!r}] = ...: a running program's variables travel as JSON; "
                                    f"{type(value).__name__} is not JSON-serializable") from None
                self.add(Op("set_var", state=sid, name=name, params={"value": value}, line=line))
                return
        self.vars.setdefault(sid, {})[name] = value

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

    def _on_event(self, sid: int, name: str | None, delta: str, done: bool,
                  meta: dict[str, Any] | None = None) -> None:
        for key in ((sid, name), (sid, None)) if name is not None else ((sid, None),):
            q = self._queue(*key)
            if delta or (meta and key[1] is not None):
                q.put((delta, meta if key[1] is not None else None))
            if done and key[1] is not None:
                q.put(_END)

    def _end_streams(self) -> None:
        with self.stream_lock:
            self.streams_ended = True
            for q in self.streams.values():
                q.put(_END)

    def stream_iter(self, sid: int, name: str | None, with_meta: bool = False):
        """The text of variable `name` (the whole text if None) as it is generated: str chunks, or with_meta
        (chunk, meta) pairs, meta as sglang's stream: completion_tokens so far, and with return_logprob the
        logprobs of this chunk's tokens (output_token_logprobs) and their running count
        (output_token_logprobs_length). Tokens that add no text yet (a held stop-string prefix, half a
        character) have their meta merged into the next chunk's."""
        if not self.stream:  # as in SGLang: a state run without stream=True yields the finished value once
            yield self.text(sid) if name is None else self.value(sid, name)
            return
        q = self._queue(sid, name)
        pending: dict[str, Any] | None = None
        while True:
            item = q.get()
            if item is _END:
                return
            delta, meta = item
            if meta is not None:
                pending = _merge_meta(pending, meta)
            if not delta:
                continue
            if with_meta:
                yield delta, pending if pending is not None else {}
            else:
                yield delta
            pending = None


# meta keys a stream event carries for its own tokens only; merged across events by concatenation
_INCREMENTAL_META = ("output_token_logprobs", "output_top_logprobs")


def _merge_meta(pending: dict[str, Any] | None, meta: dict[str, Any]) -> dict[str, Any]:
    if pending is None:
        return dict(meta)
    merged = dict(meta)
    for k in _INCREMENTAL_META:
        if k in meta or k in pending:
            merged[k] = list(pending.get(k, [])) + list(meta.get(k, []))
    return merged


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(gen defaults, program arguments). Defaults are normalized as gen() normalizes its keywords."""
    from k3rt.frontend.api import check_gen_options

    defaults = {("max_tokens" if k == "max_new_tokens" else k): kwargs[k] for k in RUN_KEYS
                if k in kwargs and kwargs[k] is not None}
    if defaults.get("top_k") == -1:
        defaults["top_k"] = 0  # sglang's "off"
    if "stop" in defaults:
        stop = defaults["stop"]
        defaults["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if "stop_token_ids" in defaults:
        defaults["stop_token_ids"] = list(defaults["stop_token_ids"])
    check_gen_options(defaults)
    return defaults, {k: v for k, v in kwargs.items() if k not in RUN_KEYS}


def _execute(func: "SglFunction", session: Session, args: tuple, kwargs: dict[str, Any]) -> None:
    from k3rt.frontend.state import ProgramState

    s = ProgramState(session, 0)
    try:
        session.ret_value = func.func(s, *args, **{**func.bound, **kwargs})
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
        state = ProgramState(session, 0)
        from k3rt.frontend.client import global_config

        if global_config.verbosity >= 2:
            print(state.text())
        return state

    def body() -> None:
        try:
            _execute(func, session, args, kwargs)
        except BaseException as e:  # surfaced through s.error() and by ending the streams
            session.error = session.error or f"{type(e).__name__}: {e}"
            session._end_streams()

    threading.Thread(target=body, name=f"k3rt-{func.__name__}", daemon=True).start()
    return ProgramState(session, 0)


def run_batch(func: "SglFunction", batch: list[Any], defaults: dict[str, Any], *, backend: "Backend | None",
              num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
              ship: bool = True) -> Any:
    """Programs run concurrently: each records its ops on a worker thread and ships them; the server runs
    them as concurrent tasks, so shared prefixes are computed once by the prefix cache."""
    from k3rt.frontend.client import resolve_backend

    batch = [_arguments(func, entry) for entry in batch]
    if num_threads == "auto":
        num_threads = 64
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads: must be 'auto' or an int >= 1, got {num_threads!r}")
    be = resolve_backend(backend)
    states = _batch_states(func, batch, defaults, be, min(num_threads, max(1, len(batch))), progress_bar, ship)
    return states if generator_style else list(states)


def _arguments(func: "SglFunction", entry: Any) -> dict[str, Any]:
    """A run_batch entry as keyword arguments: a dict, or values in the function's argument order."""
    if isinstance(entry, dict):
        return entry
    if isinstance(entry, (list, tuple)):
        if len(entry) > len(func.arg_names):
            raise TypeError(f"run_batch: {len(entry)} arguments for {func.__name__}({', '.join(func.arg_names)})")
        return dict(zip(func.arg_names, entry))
    raise TypeError(f"run_batch: an entry must be a dict or a list/tuple of arguments, got {type(entry).__name__}")


def _batch_states(func: "SglFunction", batch: list[dict[str, Any]], defaults: dict[str, Any], be: "Backend",
                  workers: int, progress_bar: bool, ship: bool):
    """Yield the states in order; at most `workers` programs are submitted ahead of the one yielded."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    with ThreadPoolExecutor(max_workers=workers) as pool, \
            tqdm(total=len(batch), desc=f"run_batch {func.__name__}", disable=not progress_bar) as bar:
        futs: deque = deque()
        todo = iter(batch)
        for kw in todo:
            futs.append(pool.submit(run_program, func, (), {**defaults, **kw}, backend=be, stream=False, ship=ship))
            if len(futs) >= workers:
                break
        while futs:
            state = futs.popleft().result()
            bar.update()
            for kw in todo:  # keep `workers` programs in flight
                futs.append(pool.submit(run_program, func, (), {**defaults, **kw}, backend=be, stream=False,
                                        ship=ship))
                break
            yield state
