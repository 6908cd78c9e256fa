"""The `@k3rt.function` DSL (client side): IR, states, primitives, transport. Never imports torch."""

from k3rt.frontend.api import (
    assistant, assistant_begin, assistant_end, function, gen, gen_int, gen_string, image, select, system,
    system_begin, system_end, tool, tool_begin, tool_end, user, user_begin, user_end, video,
)
from k3rt.frontend.choices import (
    ChoicesSamplingMethod, greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized,
)
from k3rt.frontend.client import (
    RuntimeEndpoint, connect, flush_cache, get_default_backend, get_server_info, global_config, set_default_backend,
)
from k3rt.frontend.runner import ProgramError

__all__ = [
    "ChoicesSamplingMethod", "ProgramError", "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end",
    "connect", "flush_cache", "function", "gen", "gen_int", "gen_string", "get_default_backend",
    "get_server_info", "global_config", "greedy_token_selection", "image", "select", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "tool", "tool_begin", "tool_end",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]
