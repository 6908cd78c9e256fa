"""SGLang's own frontend (`sglang.lang`, installed with --no-deps) running programs against `k3rt serve`
through `sgl.RuntimeEndpoint`: gen, streamed gen, regex-constrained gen, fork/join and select. select's
decision is checked against the choices' scores recomputed from /v1/completions echo logprobs, and the
native /generate wire format is checked directly."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.compat.conftest import MODEL_NAME

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sgl(compat_server):
    try:
        import sglang
    except ImportError as e:
        pytest.skip(f"the SGLang frontend cannot be imported ({e}); `make install` installs it (--no-deps)")
    return sglang


@pytest.fixture(scope="module")
def endpoint(sgl, compat_server):
    return sgl.RuntimeEndpoint(compat_server.url)


def test_runtime_endpoint_reads_model_info(endpoint, compat_server):
    assert endpoint.get_model_name().endswith("tiny-k3")  # the checkpoint path (/get_model_info model_path)
    assert endpoint.model_info["served_model_name"] == MODEL_NAME
    assert endpoint.get_server_info()["served_model_name"] == MODEL_NAME  # /server_info
    endpoint.flush_cache()


def test_gen_stream_regex_fork(sgl, endpoint):
    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)
        s += "\nNumber: " + sgl.gen("number", max_tokens=6, regex=r"[0-9]{3}", temperature=0)

    state = qa.run(question="what is two plus two?", backend=endpoint)
    assert re.fullmatch(r"[0-9]{3}", state["number"]), state["number"]
    assert state.text().startswith("Q: what is two plus two?\nA:" + state["answer"])
    assert state.get_meta_info("answer")["completion_tokens"] == 8

    streamed = qa.run(question="what is two plus two?", backend=endpoint, stream=True)
    assert "".join(streamed.text_iter()) == state.text()  # greedy: the same text, streamed

    @sgl.function
    def branches(s):
        s += "A shared prefix that both branches reuse. "
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Branch {i}:" + sgl.gen("g", max_tokens=4, temperature=0)
        forks.join()
        s += "end"

    state = branches.run(backend=endpoint)
    assert len(state["g"]) == 2 and state.text().endswith("end")

    questions = ["one?", "two?", "three?"]
    batch = qa.run_batch([{"question": q} for q in questions], backend=endpoint, num_threads=3)
    singles = [qa.run(question=q, backend=endpoint) for q in questions]
    assert [b.text() for b in batch] == [x.text() for x in singles]  # greedy: batching changes nothing

    @sgl.function
    def scored(s):
        s += "Scores:" + sgl.gen("x", max_tokens=3, temperature=0, return_logprob=True, top_logprobs_num=2,
                                 return_text_in_logprobs=True)

    meta = scored.run(backend=endpoint).get_meta_info("x")
    assert len(meta["output_token_logprobs"]) == 3 and all(len(t) == 2 for t in meta["output_top_logprobs"])
    # greedy: each sampled token is the most likely one, and its logprob is that entry's
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)


def _echo_scores(url: str, prompt_ids: list[int], start: int) -> list[float]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt_ids, "echo": True,
                                                  "logprobs": 0, "max_tokens": 0}, timeout=60).json()
    return r["choices"][0]["logprobs"]["token_logprobs"][start:]


def test_select_matches_the_scores(sgl, endpoint, compat_server):
    choices = ["red", "green", "blue", "purple"]

    @sgl.function
    def pick(s):
        s += "My favourite colour is"
        s += " " + sgl.select("colour", choices=choices)

    state = pick.run(backend=endpoint)
    meta = state.get_meta_info("colour")
    assert state["colour"] in choices
    # SGLang's default method: the choice with the best mean token logprob
    norm = meta["normalized_prompt_logprobs"]
    assert state["colour"] == choices[max(range(len(choices)), key=lambda i: norm[i])]
    # ... and those logprobs are the ones /v1/completions reports for the same tokens
    url = compat_server.url
    prefix = "My favourite colour is "
    prompt_len = len(httpx.post(url + "/tokenize", json={"prompt": prefix}, timeout=30).json()["tokens"])
    for choice, entries in zip(choices, meta["input_token_logprobs"]):
        ids = httpx.post(url + "/tokenize", json={"prompt": prefix + choice}, timeout=30).json()["tokens"]
        start = prompt_len - 2
        expected = _echo_scores(url, ids, start)
        got = [e[0] for e in entries]
        assert got == pytest.approx(expected[len(expected) - len(got):], abs=1e-4)
        assert [e[1] for e in entries] == ids[len(ids) - len(got):]


def test_generate_wire_format(compat_server):
    url = compat_server.url
    one = httpx.post(url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 0}},
                     timeout=30).json()
    assert one["text"] == "" and one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    ids = httpx.post(url + "/tokenize", json={"prompt": "hello"}, timeout=30).json()["tokens"]
    assert one["meta_info"]["prompt_tokens"] == len(ids)  # [BOS] + "hello", as SGLang tokenizes a text
    batch = httpx.post(url + "/generate", json={
        "input_ids": [[5, 6, 7], [5, 6, 8, 9]], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True},
        timeout=30).json()
    assert isinstance(batch, list) and len(batch) == 2
    first = batch[0]["meta_info"]
    assert [e[1] for e in first["input_token_logprobs"]] == [5, 6, 7]
    assert first["input_token_logprobs"][0][0] is None and first["input_top_logprobs"][0] is None
    assert len(first["output_token_logprobs"]) == 2 == len(batch[0]["output_ids"])
    assert first["output_token_logprobs_length"] == 2  # test_programs.py's test_stream_logprobs reads it
    assert all(len(t) == 2 for t in first["output_top_logprobs"])
    # SSE: cumulative text per event, then [DONE]
    with httpx.stream("POST", url + "/generate", json={"text": "hi", "stream": True, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=30) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "length"
    # refused, not dropped
    for sp, field in (({"min_new_tokens": 9, "max_new_tokens": 2}, "sampling_params.min_new_tokens"),
                      ({"stop_regex": "a+"}, "sampling_params.stop_regex"), ({"bogus": 1}, "sampling_params.bogus"),
                      ({"ebnf": "root ::= ("}, "sampling_params.ebnf"),
                      ({"ebnf": 'root ::= "a"', "regex": "a"}, "sampling_params.ebnf")):
        r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": sp}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # EBNF (SGLang's GBNF style), through llguidance
    out = httpx.post(url + "/generate", json={"text": "Answer:", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ebnf": 'root ::= ("yes" | "no") "!"'}}, timeout=30).json()
    assert out["text"] in ("yes!", "no!"), out
    r = httpx.post(url + "/generate", json={"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"
    r = httpx.post(url + "/generate", json={"text": "x", "image_data": "abc"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200


def test_concate_and_append_request(compat_server):
    # SGLang's frontend posts this for join(mode="concate_and_append"); the join is by text (native.py)
    url = compat_server.url + "/concate_and_append_request"
    r = httpx.post(url, json={"src_rids": ["a", "b"], "dst_rid": "p"}, timeout=30)
    assert r.status_code == 200 and r.json()["success"] is True
    for body, field in (({"src_rids": [], "dst_rid": "p"}, "src_rids"), ({"src_rids": ["a"]}, "dst_rid"),
                        ({"src_rids": ["a"], "dst_rid": "p", "x": 1}, "x")):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
