"""Program states on the client. Appending records ops into the program's session; nothing runs until a
value is needed (`s["x"]`, `s.text()`, the end of the program). Then the pending ops
ship in one message and run on the server. A program whose control flow never looks at generated
values therefore ships whole, in one round trip; one that does pays a round trip at each look.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from k3rt.frontend.api import Expr, _expr
from k3rt.frontend.ir import Op

if TYPE_CHECKING:
    from k3rt.frontend.runner import Session


class ProgramState:
    """`s` inside a program: `s += "text" | gen(...) | select(...) | role(...)`, `s[name]`, `s.fork(n)`."""

    def __init__(self, session: "Session", sid: int = 0) -> None:
        self.session, self.sid = session, sid

    def __iadd__(self, expr: Any) -> "ProgramState":
        line = sys._getframe(1).f_lineno
        for op in _expr(expr).ops():
            self.session.add(replace(op, state=self.sid, line=line))
        return self

    def __getitem__(self, name: str) -> Any:
        """The variable's value (a str, or a list after join). Reading it inside a program ships the ops
        recorded so far (one round trip) — so programs that never read values ship whole."""
        return self.session.value(self.sid, name)

    def get_var(self, name: str) -> Any:
        return self.session.value(self.sid, name)

    def text(self) -> str:
        return self.session.text(self.sid)

    def messages(self) -> list[dict[str, str]]:
        return self.session.messages(self.sid)

    def meta(self, name: str) -> dict[str, Any]:
        """Token counts (prompt, completion, cached) and, for select, per-choice scores."""
        return self.session.meta(self.sid, name)

    def fork(self, n: int) -> "ForkGroup":
        if n < 1:
            raise ValueError(f"fork: n must be >= 1, got {n}")
        ids = self.session.new_states(n)
        self.session.add(Op("fork", state=self.sid, children=ids, line=sys._getframe(1).f_lineno))
        return ForkGroup(self, [ProgramState(self.session, i) for i in ids])

    # streaming
    def text_iter(self, name: str | None = None):
        """Yield text chunks of variable `name` as they are generated (the whole text if name is None)."""
        return self.session.stream_iter(self.sid, name)

    async def text_async_iter(self, name: str | None = None):
        import asyncio

        it = self.session.stream_iter(self.sid, name)
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
    """The children of `s.fork(n)`; `join()` waits for them and gathers their new variables into `s`."""

    def __init__(self, parent: ProgramState, children: list[ProgramState]) -> None:
        super().__init__(children)
        self.parent = parent

    def join(self, mode: str = "gather_variable") -> None:
        if mode != "gather_variable":
            raise ValueError(f"join mode: {mode!r} not supported (gather_variable)")
        p = self.parent
        p.session.add(Op("join", state=p.sid, children=[c.sid for c in self], line=sys._getframe(1).f_lineno))
