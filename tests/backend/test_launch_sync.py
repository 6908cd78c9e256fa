"""Overlap scheduling needs `launch` to queue a step without waiting for the device: the host packs step N+1
while the GPU runs step N. One hidden wait (a pageable host-to-device copy, `.item()`, `.tolist()` on a device
tensor) makes host and device take turns again, silently: outputs stay exact, only the step gets slower. These
tests run launches under `torch.cuda.set_sync_debug_mode("error")`, which raises at any such wait.

Found this way (session 27): `record_step_states` uploaded its row index with `torch.tensor(..., device=cuda)`,
which waits for the stream, i.e. for the step just launched, in every step of an engine with a model drafter
(prefill steps included)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3rt.backend.engine import Engine, engine_config_for_tests
from k3rt.config import SpecConfig
from k3rt.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


class _NoWait:
    """torch's CUDA sync debug mode set to "error" while the block runs."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def test_recording_target_states_does_not_wait_for_the_device() -> None:
    from types import SimpleNamespace

    from k3rt.backend.spec.target_states import TargetStates, record_step_states

    _cuda()
    store = TargetStates(layers=(1, 2), window=4)
    req = lambda rid: SimpleNamespace(rid=rid, params=SimpleNamespace(speculative=True))  # noqa: E731
    # a prefill chunk of 6 rows (the newest 4 kept) and a decode row
    chunks = [SimpleNamespace(req=req(1), num_tokens=6, num_fed=6, start=0),
              SimpleNamespace(req=req(2), num_tokens=1, num_fed=1, start=9)]
    tapped = {i: torch.randn(7, 8, device="cuda") + i for i in (1, 2)}
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000)  # work in flight that a wait would have to drain
    with _NoWait():
        record_step_states(store, chunks, tapped, {})
        record_step_states(store, [SimpleNamespace(req=req(2), num_tokens=1, num_fed=1, start=10)],
                           {i: t[:1] * 2 for i, t in tapped.items()}, {})
    want = torch.cat([tapped[1], tapped[2]], -1)
    assert torch.equal(store.get(1), want[2:6])
    assert torch.equal(store.get(2), torch.cat([want[6:7], want[:1] * 2]))


@pytest.mark.parametrize("drafter", ["none", "dspark"])
def test_launching_prefill_and_decode_steps_never_waits_for_the_device(tmp_path, drafter) -> None:
    """Greedy requests on the GPU runner with overlap and graphs: no launch (a piecewise prefill step, decode
    graph replays) waits for the device, also with a model drafter whose confidence turns every verify off (its
    steps still record the target states)."""
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.models.tiny import make_tiny
    from tests.backend.test_dspark_engine import _random_drafter

    _cuda()
    ckpt = make_tiny(tmp_path / "k3", arch="k3", dtype="float32", seed=9)
    cfg = replace(engine_config_for_tests(str(ckpt), num_pages=96), device="cuda", runner="gpu", overlap=True)
    if drafter == "dspark":
        folder = _random_drafter(tmp_path / "drafter", load_model(ckpt, dtype="float32", progress=False),
                                 threshold=1.0, min_verify=0)
        cfg = replace(cfg, spec=SpecConfig(method="dspark", num_tokens=5, model=str(folder), adaptive=False))
    eng = Engine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(3, 80)), list(range(90, 101))]
    eng.generate(prompts, params)  # compiles and first uses outside the check
    eng.flush_cache()
    runner, launched, waits = eng.runner, [], []
    launch = runner.launch

    def checked(out, prev):
        try:
            with _NoWait():
                step = launch(out, prev)
        except RuntimeError as e:  # the engine fails the step's requests and goes on: keep what it was
            waits.append(f"{len(out.chunks)} chunks, {len(out.decodes)} decodes: {e}")
            raise
        launched.append((len(out.chunks), len(out.decodes)))
        return step

    runner.launch = checked
    outs = eng.generate([[p + 1 for p in prompt] for prompt in prompts], params)
    assert not waits, waits
    assert all(len(o.output_ids) == 8 for o in outs)
    assert any(chunks for chunks, _ in launched) and any(decodes for _, decodes in launched), launched
    assert eng.stats.spec_verifies == 0
