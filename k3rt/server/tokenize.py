"""The tokenizer over HTTP, as vLLM serves it (and lm-eval's `tokenizer_backend=remote` reads it):

  POST /tokenize        {"prompt": text, "add_special_tokens": true} or {"messages": [...]}
                        -> {"count", "max_model_len", "tokens", "token_strs"}
  POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
  GET  /tokenizer_info  the special tokens as text (bos, eos, pad), model_max_length, vocab size

`add_special_tokens` adds what the model starts every sequence with (BOS for k3-tiny), as a completions
prompt gets; special-token text ("[EOS]") in a prompt becomes that token either way. `messages` go through
the chat template, as /v1/chat/completions builds its prompt.
"""

from __future__ import annotations

from typing import Any

from k3rt.server.errors import bad_request
from k3rt.server.generation import ServerContext, check_vocab, token_text
from k3rt.server.limits import PromptBudget
from k3rt.server.schemas import Message, _List, _Strict


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: _List[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: _List[int]


async def tokenize(ctx: ServerContext, req: TokenizeRequest, budget: PromptBudget) -> dict[str, Any]:
    if req.model is not None:
        ctx.check_model(req.model)
    gw = ctx.gateway
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt", "send exactly one of prompt (a text) or messages (a chat)")
    if req.prompt is not None:
        budget.check_text(req.prompt, "prompt")
        ids = await gw.encode_prompt(req.prompt) if req.add_special_tokens else gw.tokenizer.encode(req.prompt)
    else:
        messages = []
        for i, m in enumerate(req.messages or []):
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(p.text or "" for p in m.content)
            if content is not None:
                budget.check_text(content, f"messages[{i}].content")
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        try:
            ids = await gw.encode_chat(messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:  # no chat template
            raise bad_request("messages", str(e)) from None
    strs = [token_text(ctx, t)[0] for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": gw.context_length, "tokens": ids, "token_strs": strs}


def detokenize(ctx: ServerContext, req: DetokenizeRequest) -> dict[str, Any]:
    if req.model is not None:
        ctx.check_model(req.model)
    if req.tokens:
        check_vocab([req.tokens], ctx.gateway.vocab_size, "tokens")
    return {"prompt": ctx.gateway.tokenizer.decode(req.tokens)}


def tokenizer_info(ctx: ServerContext) -> dict[str, Any]:
    tok = ctx.gateway.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else token_text(ctx, token_id)[0]

    return {
        "tokenizer_class": type(tok).__name__,
        "bos_token": text(tok.bos_token_id),
        "eos_token": text(tok.eos_token_ids[0] if tok.eos_token_ids else None),
        "pad_token": text(tok.pad_token_id),
        "add_bos_token": bool(tok.sequence_prefix),
        "model_max_length": ctx.gateway.context_length,
        "vocab_size": ctx.gateway.vocab_size,
    }
