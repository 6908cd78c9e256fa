"""k3rt: an inference runtime for the Kimi hybrid family (KDA + MLA + MoE/LatentMoE).

`import k3rt` stays light: it never imports torch (a DSL client needs neither torch nor a GPU).
Engine code lives in `k3rt.backend` and is imported only by what starts an engine.

    import k3rt

    @k3rt.function
    def qa(s, question):
        s += k3rt.user(question)
        s += k3rt.assistant(k3rt.gen("answer", max_tokens=64))

    with k3rt.Runtime(model="path/to/checkpoint") as rt:
        print(qa.run(question="What is KDA?", backend=rt)["answer"])
"""

from k3rt.frontend import (
    ChoicesSamplingMethod, ProgramError, RuntimeEndpoint, assistant, assistant_begin, assistant_end, connect,
    flush_cache, function, gen, gen_int, gen_string, get_default_backend, get_server_info, global_config,
    greedy_token_selection, image, select, set_default_backend, system, system_begin, system_end,
    token_length_normalized, tool, tool_begin, tool_end, unconditional_likelihood_normalized, user, user_begin,
    user_end, video,
)
from k3rt.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "ChoicesSamplingMethod", "ProgramError", "Runtime", "RuntimeEndpoint", "SamplingParams", "__version__",
    "assistant", "assistant_begin", "assistant_end", "connect", "flush_cache", "function", "gen", "gen_int",
    "gen_string", "get_default_backend", "get_server_info", "global_config", "greedy_token_selection", "image",
    "select", "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized", "tool",
    "tool_begin", "tool_end", "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]


def __getattr__(name: str):
    # Runtime pulls in asyncio and threads: import it only when asked for, keeping `import k3rt` fast
    if name == "Runtime":
        from k3rt.runtime import Runtime

        return Runtime
    raise AttributeError(f"module 'k3rt' has no attribute {name!r}")
