"""Chat-role text for the DSL's system/user/assistant ops, derived from the model's chat template.

The template is rendered around a marker and split, so role text is exactly what the template would
produce for a whole conversation. The assistant prefix is the template's generation prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3rt.backend.tokenizer import Tokenizer

_MARK = "\x00K3RT_CONTENT\x00"


@dataclass(frozen=True)
class RoleText:
    prefix: dict[str, str]
    suffix: dict[str, str]


def role_text(tok: Tokenizer) -> RoleText:
    if tok.chat_template is None:
        # plain-text fallback: the program's role markers become readable headers
        p = {r: f"{r.capitalize()}: " for r in ("system", "user", "assistant", "tool")}
        return RoleText(p, {r: "\n" for r in p})
    prefix, suffix = {}, {}
    sys_only = tok.apply_chat_template([{"role": "system", "content": "S"}], add_generation_prompt=False)
    for role in ("system", "user", "assistant", "tool"):
        msgs = [{"role": role, "content": _MARK}]
        if role != "system":
            msgs.insert(0, {"role": "system", "content": "S"})
        if role == "tool":
            msgs[-1]["tool_call_id"] = "call_0"
        full = tok.apply_chat_template(msgs, add_generation_prompt=False)
        if role != "system" and full.startswith(sys_only):
            full = full[len(sys_only):]
        head, _, tail = full.partition(_MARK)
        prefix[role], suffix[role] = head, tail
    with_gen = tok.apply_chat_template([{"role": "user", "content": "U"}], add_generation_prompt=True)
    without = tok.apply_chat_template([{"role": "user", "content": "U"}], add_generation_prompt=False)
    if with_gen.startswith(without) and len(with_gen) > len(without):
        prefix["assistant"] = with_gen[len(without):]
    return RoleText(prefix, suffix)
