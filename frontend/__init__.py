"""The `@k3rt.function` DSL (client side): IR, states, primitives, transport. Never imports torch."""

from k3rt.frontend.api import (
    assistant, assistant_begin, assistant_end, function, gen, gen_int, gen_string, select, system, system_begin,
    system_end, tool, tool_begin, tool_end, user, user_begin, user_end,
)
from k3rt.frontend.client import connect, get_default_backend, set_default_backend
from k3rt.frontend.runner import ProgramError

__all__ = [
    "ProgramError", "assistant", "assistant_begin", "assistant_end", "connect", "function", "gen", "gen_int",
    "gen_string", "get_default_backend", "select", "set_default_backend", "system", "system_begin", "system_end",
    "tool", "tool_begin", "tool_end", "user", "user_begin", "user_end",
]
