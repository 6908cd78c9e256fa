"""SGLang's own program tests (`sglang/test/test_programs.py`, the vendored copy test_sglang_programs.py
checks) run by SGLang's real frontend against `k3rt serve`: `sgl.RuntimeEndpoint(url)` is the default backend,
so every gen, select and fork goes over SGLang's native HTTP API (k3rt/server/native.py).

The default backend is set the way SGLang's CI sets its `sgl.Runtime`: an object whose `.endpoint` is the
RuntimeEndpoint (test_gen_min_new_tokens reads `default_backend.endpoint`). The one sglang module the file
imports that cannot load here, `sglang.srt.utils.hf_transformers_utils` (it imports torchvision, not among
the --no-deps install's packages), gets the served model's tokenizer as its get_tokenizer.

The server is the compat one: a random-weight tiny model, which writes bytes, not words. Each test is in one
group (the same table is in docs/sglang-compat.md):

  PASSES          runs to completion and passes as written (`check_answer=False` where the test takes it).
  CAPABLE         runs; fails only at one of the listed lines, which check what a capable model writes.
  OPENAI_BACKEND  tests of SGLang's API speculative execution, which its OpenAI backend implements: with a
                  RuntimeEndpoint SGLang's frontend fails before sending anything (no `token_usage`).
  WIRE            k3rt's /generate stream reports the output logprobs so far (cumulative), as SGLang's
                  server does by default (its tokenizer_manager; not run here); the test wants per-chunk
                  deltas (SGLang's --incremental-streaming-output) and text in every chunk.
  VISION          needs an image and a vision model: SGLang's frontend fails reading example_image.png (k3rt
                  answers image_data with a 400 naming it, test_sglang_frontend.py).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from tests.compat.test_sglang_programs import CHECK_ANSWER, MIN_TOKENS_CHECK, _failing_line, _HfEncode, _source

PASSES = ["test_mt_bench", "test_select", "test_expert_answer", "test_parallel_decoding", "test_parallel_encoding",
          "test_stream", "test_regex", "test_dtype_gen", "test_chat_completion_speculative"]
CAPABLE = {
    "test_few_shot_qa": ['assert "washington" in', "assert answers == ["],
    "test_decode_int": ['assert int(ret["hours"]) == 24', 'assert int(ret["days"]) == 365'],
    # REGEX_STR admits control characters (\s); json.loads refuses a raw one inside a string
    "test_decode_json": ['js_obj = json.loads(ret["json_output"])'],
    "test_decode_json_regex": ['js_obj = json.loads(ret["json_output"])'],
    "test_tool_use": ['return f"{eval(expression)}"', 'assert int(ret["answer"]) == lhs * rhs'],
    "test_react": ['answer = ret["answer"].lower()', 'assert "finland" in answer'],
    "test_gen_min_new_tokens": MIN_TOKENS_CHECK,  # the answer's text re-encoded (test_sglang_programs.py says why)
}
OPENAI_BACKEND = {"test_completion_speculative": ["token_usage = sgl.global_config.default_backend.token_usage"]}
WIRE = {"test_stream_logprobs": ["assert chunk_text", "assert len(chunk_output_token_logprobs) == ("]}
VISION = {"test_image_qa": ['"taxi" in state.messages()[-1]["content"]']}

# the 19 take about 20 s on 2 cores against the random-weight model (parallel_decoding's 512-token summary
# is the longest); a hang fails its test instead of the run
# SGLang's interpreter reports an error inside a program as this warning and goes on (the OPENAI_BACKEND and
# VISION tests); the classification above is what is checked
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:Error in stream_executor:UserWarning")]


class _Runtime:
    """What `sgl.Runtime` is to SGLang's frontend once started: a backend whose `.endpoint` does the work."""

    def __init__(self, endpoint) -> None:
        self.endpoint = endpoint


@pytest.fixture(scope="module")
def programs(compat_server) -> Iterator[types.ModuleType]:
    try:
        import sglang
        from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    except ImportError as e:
        pytest.skip(f"the SGLang frontend cannot be imported ({e}); `make install` installs it (--no-deps)")
    from k3rt.backend.tokenizer import load_tokenizer

    text, filename = _source()
    utils = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    utils.get_tokenizer = lambda path, *a, **kw: _HfEncode(load_tokenizer(path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "sglang.srt.utils.hf_transformers_utils", utils)
        mod = types.ModuleType("sglang_test_programs_on_endpoint")
        mod.__file__ = filename
        exec(compile(text, filename, "exec"), mod.__dict__)
        assert mod.sgl is sglang  # SGLang's frontend, not k3rt's
        previous = sglang.global_config.default_backend
        sglang.set_default_backend(_Runtime(RuntimeEndpoint(compat_server.url)))
        try:
            yield mod
        finally:
            sglang.global_config.default_backend = previous


def _call(programs: types.ModuleType, name: str) -> None:
    fn = getattr(programs, name)
    if name in CHECK_ANSWER:
        fn(check_answer=False)
    else:
        fn()


def test_all_nineteen_are_classified() -> None:
    text, _ = _source()
    names = sorted(line.split("(")[0][4:] for line in text.splitlines() if line.startswith("def test_"))
    groups = [PASSES, list(CAPABLE), list(OPENAI_BACKEND), list(WIRE), list(VISION)]
    assert sorted(n for g in groups for n in g) == names


@pytest.mark.parametrize("name", PASSES)
def test_passes(programs: types.ModuleType, name: str) -> None:
    _call(programs, name)


@pytest.mark.parametrize("name", [*CAPABLE, *OPENAI_BACKEND, *WIRE, *VISION])
def test_fails_only_where_listed(programs: types.ModuleType, name: str) -> None:
    allowed = {**CAPABLE, **OPENAI_BACKEND, **WIRE, **VISION}[name]
    try:
        _call(programs, name)
    except Exception as e:
        line = _failing_line(e, programs.__file__)
        assert any(line.startswith(ok) for ok in allowed), (
            f"{name} failed outside its listed lines, at {line!r}: {type(e).__name__}: {e}")
    else:
        assert name in CAPABLE, f"{name} passed: it is listed as failing for a reason independent of the model"
