"""Program states on the client. Appending records ops into the program's session; nothing runs until a
value is needed (`s["x"]`, `s.text()`, the end of the program). Then the pending ops
ship in one message and run on the server. A program whose control flow never looks at generated
values therefore ships whole, in one round trip; one that does pays a round trip at each look.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from k3rt.frontend.api import Expr, RoleExpr, _expr
from k3rt.frontend.ir import JOIN_MODES, Op

if TYPE_CHECKING:
    from k3rt.frontend.runner import Session


class ProgramState:
    """`s` inside a program (and the state run() returns): the methods of sglang's ProgramState.

    `s += "text" | gen(...) | select(...) | role(...)`, `s[name]`, `s[name] = value`, `name in s`,
    `with s.user(): ...`, `with s.var_scope(name): ...`, `s.fork(n)`, `with s.copy() as c: ...`."""

    def __init__(self, session: "Session", sid: int = 0) -> None:
        self.session, self.sid = session, sid

    def __iadd__(self, expr: Any) -> "ProgramState":
        if expr is None:
            raise ValueError("cannot append None to a program state")
        self._add(_expr(expr).ops(), sys._getframe(1).f_lineno)
        return self

    def _add(self, ops: list[Op], line: int) -> None:
        for op in ops:
            self.session.add(replace(op, state=self.sid, line=line))

    # ---- variables ----

    def __getitem__(self, name: str) -> Any:
        """The variable's value (a str, or a list after join or for gen(n > 1)). Reading it inside a program
        ships the ops recorded so far (one round trip) — so programs that never read values ship whole."""
        return self.session.value(self.sid, name)

    def get_var(self, name: str) -> Any:
        return self.session.value(self.sid, name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.session.set_value(self.sid, name, value, sys._getframe(1).f_lineno)

    def set_var(self, name: str, value: Any) -> None:
        """Set a variable: in a running program the server's state gets it (a JSON value), so later reads
        and a join see it; on a finished program's state only the returned record changes."""
        self.session.set_value(self.sid, name, value, sys._getframe(1).f_lineno)

    def __contains__(self, name: str) -> bool:
        return self.session.has(self.sid, name)

    def get_meta_info(self, name: str) -> dict[str, Any] | list[dict[str, Any]] | None:
        """What the server reports for variable `name` (None if it has none, as in sglang): a gen's
        prompt_tokens, completion_tokens, cached_tokens, finish_reason and, with return_logprob, its
        logprobs; a select's per-choice logprobs and scores (frontend/choices.py); a list, one per sample,
        for gen(n > 1)."""
        return self.session.meta(self.sid, name) or None

    def meta(self, name: str) -> dict[str, Any]:
        """get_meta_info, {} when there is none (k3rt's older name)."""
        return self.session.meta(self.sid, name)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """The text appended inside the block becomes variable `name`."""
        line = sys._getframe(2).f_lineno
        self._add([Op("var_begin", name=name)], line)
        yield
        self._add([Op("var_end", name=name)], line)

    # ---- roles ----

    def system(self, expr: Any = None) -> Any:
        """`s.system(expr)` appends a system turn; `with s.system(): ...` wraps the block in one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def _role(self, role: str, expr: Any) -> Any:
        line = sys._getframe(2).f_lineno
        if expr is not None:
            whole = RoleExpr(role, _expr(expr))
            self._add(whole.ops(), line)
            return whole
        return self._role_scope(role, line)

    @contextmanager
    def _role_scope(self, role: str, line: int) -> Iterator[None]:
        self._add(RoleExpr(role, None, "begin").ops(), line)
        yield
        self._add(RoleExpr(role, None, "end").ops(), line)

    # ---- reading ----

    def text(self) -> str:
        return self.session.text(self.sid)

    def messages(self) -> list[dict[str, str]]:
        return self.session.messages(self.sid)

    def sync(self) -> None:
        """Wait until every op appended so far has run (ships them: one round trip)."""
        self.session.flush()

    @property
    def ret_value(self) -> Any:
        """What the program function returned."""
        return self.session.ret_value

    # ---- fork ----

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> "ForkGroup":
        """`size` copies of this state, run concurrently; they share its cached prefix.

        position_ids_offset: sglang's per-child position shift, which its own runtime backend never
        applies either; anything but None is refused, since k3rt cannot honour it."""
        if position_ids_offset is not None:
            raise ValueError("fork: position_ids_offset is not supported (forked states continue at their "
                             "parent's positions)")
        size = int(size)
        if size < 1:
            raise ValueError(f"fork: size must be >= 1, got {size}")
        ids = self.session.new_states(size)
        self.session.add(Op("fork", state=self.sid, children=ids, line=sys._getframe(1).f_lineno))
        return ForkGroup(self, [ProgramState(self.session, i) for i in ids])

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator["ProgramState"]:
        """`with s.copy() as c:` a fork of one, joined (gathering its new variables) when the block ends."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- streaming ----

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield text chunks of variable `var_name` as they are generated (the whole text if None)."""
        return self.session.stream_iter(self.sid, var_name)

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False):
        """text_iter for `async for`. return_meta_data (streamed runs, a variable): (chunk, meta) pairs,
        meta as runner.py `Session.stream_iter` describes."""
        import asyncio

        it = self.session.stream_iter(self.sid, var_name, with_meta=return_meta_data and var_name is not None)
        sentinel = object()
        while True:
            chunk = await asyncio.to_thread(next, it, sentinel)
            if chunk is sentinel:
                return
            yield chunk

    def error(self) -> str | None:
        return self.session.error

    def __repr__(self) -> str:
        return f"ProgramState(state={self.sid}, program={self.session.name!r})"


class ForkGroup(list):
    """The children of `s.fork(n)`. `group += x` appends to every child (x a lambda i: expr, an expr or
    text, or a list with one item per child); `join()` waits for them."""

    def __init__(self, parent: ProgramState, children: list[ProgramState]) -> None:
        super().__init__(children)
        self.parent = parent

    def __iadd__(self, other: Any) -> "ForkGroup":
        line = sys._getframe(1).f_lineno
        if callable(other) and not isinstance(other, Expr):
            items = [other(i) for i in range(len(self))]
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self):
                raise ValueError(f"fork group +=: {len(other)} items for {len(self)} states")
            items = list(other)
        else:
            items = [other] * len(self)
        for child, item in zip(self, items):
            child._add(_expr(item).ops(), line)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each new variable of the children becomes a list in the parent, in child
        order. concate_and_append: the children's text since the fork is appended to the parent, in
        child order (as text: a KDA state cannot be spliced the way sglang splices KV caches)."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode: {mode!r} not one of {JOIN_MODES}")
        p = self.parent
        p.session.add(Op("join", state=p.sid, children=[c.sid for c in self], line=sys._getframe(1).f_lineno,
                         value=None if mode == "gather_variable" else mode))
