"""The OpenAI SDK (and plain HTTP for vLLM's tokenizer routes) against a real `k3rt serve`: echo with prompt
logprobs and max_tokens 0, token-id prompts, logit_bias, unknown fields, /tokenize, /detokenize,
/tokenizer_info."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from tests.compat.conftest import CONTEXT, MODEL_NAME

pytestmark = pytest.mark.timeout(120)

TEXT = "The quick brown fox jumps over the lazy dog"


def _tokenize(server, text: str, add_special_tokens: bool = True) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens},
                   timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT
    return body["tokens"]


def test_tokenizer_routes(compat_server):
    url = compat_server.url
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    assert info["bos_token"] == "[BOS]" and info["eos_token"] == "[EOS]" and info["add_bos_token"] is True
    assert info["model_max_length"] == CONTEXT
    plain = _tokenize(compat_server, TEXT, add_special_tokens=False)
    with_bos = _tokenize(compat_server, TEXT)
    assert with_bos[1:] == plain and with_bos[0] != plain[0]
    # special-token text is that token (lm-eval reads the EOS id this way)
    eos = _tokenize(compat_server, info["eos_token"], add_special_tokens=False)
    assert len(eos) == 1
    r = httpx.post(url + "/detokenize", json={"tokens": plain}, timeout=30)
    assert r.json() == {"prompt": TEXT}
    r = httpx.post(url + "/detokenize", json={"tokens": [1, 10**6]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(url + "/tokenize", json={"prompt": 5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30).json()
    assert chat["count"] > 2


def test_echo_returns_the_prompt_as_sent(oai):
    # the text as sent, not "[BOS]" + text (the tokenizer adds BOS to this model's prompts)
    r = oai.completions.create(model=MODEL_NAME, prompt=TEXT, echo=True, max_tokens=2, temperature=0)
    assert r.choices[0].text.startswith(TEXT) and not r.choices[0].text.startswith("[BOS]")
    r = oai.completions.create(model=MODEL_NAME, prompt=TEXT, echo=True, max_tokens=0)
    assert r.choices[0].text == TEXT and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0


def test_echo_logprobs_max_tokens_0_score_the_prompt(oai, compat_server):
    ids = _tokenize(compat_server, TEXT)
    r = oai.completions.create(model=MODEL_NAME, prompt=TEXT, echo=True, logprobs=3, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == TEXT
    assert len(lp.tokens) == len(ids) and lp.tokens[0] == "[BOS]"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v < 0 for v in lp.token_logprobs[1:])
    # each position's top dict holds the token itself and 3 most likely ones
    for tok, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == value and 1 <= len(top) <= 4 and max(top.values()) >= value

    # token-id prompt: the same scores, and echo decodes the ids
    r2 = oai.completions.create(model=MODEL_NAME, prompt=ids, echo=True, logprobs=3, max_tokens=0)
    assert r2.choices[0].text == "[BOS]" + TEXT
    assert r2.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)

    # alignment: the logprob at position i is that of the next token after ids[:i]. Greedy generation from
    # ids[:i] picks the most likely token there, whose logprob is the top entry at position i.
    for i in (3, len(ids) - 1):
        g = oai.completions.create(model=MODEL_NAME, prompt=ids[:i], max_tokens=1, temperature=0, logprobs=1)
        top_i = lp.top_logprobs[i]
        best = max(top_i, key=top_i.get)
        assert g.choices[0].text == best
        assert g.choices[0].logprobs.token_logprobs[0] == pytest.approx(top_i[best], abs=1e-4)


def test_echo_logprobs_with_output_tokens(oai, compat_server):
    """lm-eval's request: max_tokens 1, logprobs 1, echo: prompt entries then the one output entry."""
    ids = _tokenize(compat_server, TEXT)
    r = oai.completions.create(model=MODEL_NAME, prompt=[ids, ids[:5]], echo=True, logprobs=1, max_tokens=1,
                               temperature=0)
    assert [len(c.logprobs.tokens) for c in r.choices] == [len(ids) + 1, 6]
    assert r.choices[1].logprobs.token_logprobs[1:5] == pytest.approx(
        r.choices[0].logprobs.token_logprobs[1:5], abs=1e-5)
    offsets = r.choices[1].logprobs.text_offset
    assert offsets == sorted(offsets)


def test_echo_logprobs_streamed(oai, compat_server):
    # as vLLM: the echoed prompt (with its logprobs) is the choice's first chunk, the generated text follows
    kw = {"model": MODEL_NAME, "prompt": TEXT, "echo": True, "logprobs": 2, "temperature": 0}
    for max_tokens in (0, 3):
        whole = oai.completions.create(max_tokens=max_tokens, **kw).choices[0]
        chunks = [c.choices[0] for c in oai.completions.create(max_tokens=max_tokens, stream=True, **kw)]
        assert chunks[0].text == TEXT and chunks[0].finish_reason is None
        assert chunks[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in chunks) == whole.text
        assert [c.finish_reason for c in chunks][-1] == whole.finish_reason == "length"
        tokens = [t for c in chunks for t in c.logprobs.tokens]
        values = [v for c in chunks for v in c.logprobs.token_logprobs]
        offsets = [o for c in chunks for o in c.logprobs.text_offset]
        assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
        assert values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    r = httpx.post(compat_server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": -1},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_logit_bias_steers_sampling(oai):
    base = oai.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=4, temperature=0,
                                  extra_body={"return_token_ids": True})
    first = base.choices[0].token_ids[0]
    target = (first + 7) % 400  # an ordinary (non-special) token
    forced = oai.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=4, temperature=0,
                                    logit_bias={str(target): 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].token_ids == [target] * 4
    banned = oai.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=4, temperature=0.8, seed=3,
                                    logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
    assert first not in banned.choices[0].token_ids
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logit_bias={str(target): 100},
                                       extra_body={"return_token_ids": True})
    assert chat.choices[0].token_ids == [target] * 3  # type: ignore[attr-defined]


def test_min_tokens_holds_eos_back(oai, compat_server):
    """EOS pushed to the top by logit_bias ends the output at once, unless min_tokens holds it back."""
    eos = _tokenize(compat_server, "[EOS]", add_special_tokens=False)[0]
    kw = dict(model=MODEL_NAME, prompt=TEXT, max_tokens=10, temperature=0, logit_bias={str(eos): 100})
    r = oai.completions.create(**kw, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [eos] and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(**kw, extra_body={"return_token_ids": True, "min_tokens": 3})
    ids = r.choices[0].token_ids
    assert len(ids) == 4 and eos not in ids[:3] and ids[3] == eos and r.choices[0].finish_reason == "stop"
    g = httpx.post(compat_server.url + "/generate", json={"text": TEXT, "sampling_params": {
        "max_new_tokens": 10, "min_new_tokens": 3, "temperature": 0, "logit_bias": {str(eos): 100}}}, timeout=30)
    assert g.json()["output_ids"] == ids
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"min_tokens": 5})
    assert e.value.body["param"] == "min_tokens"


@pytest.mark.parametrize("bias, why", [({"abc": 1}, "is not a token id"), ({"99999": 1}, "is not a token id"),
                                      ({"5": 101}, "must be a number in [-100, 100]"),
                                      ({"5": "x"}, None)], ids=["key-not-int", "key-out-of-vocab", "too-big", "str"])
def test_bad_logit_bias_is_a_400_naming_it(oai, bias, why):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, logit_bias=bias)
    err = e.value.body
    assert err["param"].startswith("logit_bias"), err
    if why:
        assert why in err["message"]


def test_unknown_fields(oai):
    raw = oai.completions.with_raw_response.create(model=MODEL_NAME, prompt="x", max_tokens=1,
                                                   extra_body={"metadata_x": 1, "zzz": "y"})
    assert raw.headers["x-k3rt-ignored-fields"] == "metadata_x, zzz"
    raw = oai.completions.with_raw_response.create(model=MODEL_NAME, prompt="x", max_tokens=1,
                                                   extra_body={"a\nb\u00e9": 1})
    assert raw.headers["x-k3rt-ignored-fields"] == "a?b?"  # printable ASCII only in a header
    # a field that would change sampling is never dropped silently
    for name, value in (("bad_words", ["x"]), ("use_beam_search", True), ("guided_json", {})):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, extra_body={name: value})
        assert e.value.body["param"] == name
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                    extra_body={"prompt_logprobs": 2})
    assert e.value.body["param"] == "prompt_logprobs"


def test_served_flags(compat_server):
    models = httpx.get(compat_server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == CONTEXT  # --max-model-len
    info = httpx.get(compat_server.url + "/get_server_info", timeout=30).json()
    assert info["max_running_requests"] == 32  # --max-num-seqs
    log = compat_server.log_path.read_text(errors="replace")
    assert "cache 2048 pages (--cache-pages)" in log
    if shutil.which("nvidia-smi") is None:
        assert ("k3rt serve: device cpu (--device auto: no usable GPU (no nvidia-smi on PATH; torch sees no CUDA "
                "GPU))") in log
