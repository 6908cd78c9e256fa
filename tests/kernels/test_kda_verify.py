"""Speculative verification: `kda_verify` over T drafted tokens equals T decode steps of the oracle,
with every intermediate state and conv cache recorded and the live ones untouched; `kda_commit`
installs the state after the last accepted token.

CPU cases run under the Triton interpreter at tiny fp32 shapes; the `gpu` case at Kimi shapes in bf16.
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.backend.layers.norm import rms_norm_gated  # noqa: E402
from k3rt.kernels.kda.triton_decode import kda_decode_workspace  # noqa: E402
from k3rt.kernels.kda.triton_verify import kda_commit, kda_verify  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA, rel_err  # noqa: E402
from tests.kernels.test_kda_triton import LOWER_BOUND, decode_case, decode_ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py


def verify_case(N: int, T: int, H: int, D: int, kind: str, dtype: torch.dtype, num_slots: int, seed: int):
    """decode_case's weights and states, with T drafted tokens per sequence; qkv/f/b as strided views."""
    case = decode_case(N, H, D, kind, dtype, num_slots, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    P = H * D
    # one projection output [N*T, 3P + P + H] split into column slices, as the runner's GEMM gives
    proj = torch.randn(N * T, 4 * P + H, generator=gen).to(dtype).to(DEV)
    case["qkv_pre"] = proj[:, :3 * P].view(N, T, 3 * P)
    case["f"] = proj[:, 3 * P:4 * P].view(N, T, P)
    case["b"] = proj[:, 4 * P:].view(N, T, H)
    return case


def ref_steps(case: dict, slots: list[int], kind: str, T: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per position t: (o [N, H, D], state, conv_state) after t+1 oracle decode steps."""
    ref = {k: v.clone() for k, v in case.items()}
    os_, states, convs = [], [], []
    for t in range(T):
        step = {**ref, "qkv_pre": case["qkv_pre"][:, t], "f": case["f"][:, t], "b": case["b"][:, t]}
        o, ref["state"], ref["conv_state"] = decode_ref(step, slots, kind)
        os_.append(o)
        states.append(ref["state"].clone())
        convs.append(ref["conv_state"].clone())
    return os_, states, convs


@pytest.mark.parametrize(
    "T,v_split,kind",
    [(1, 1, "softplus"), (2, 2, "lower_bound"), (5, 4, "softplus"), (3, 1, "lower_bound")],
    ids=["T1_split1", "T2_split2", "T5_split4", "T3_split1"],
)
def test_verify_matches_decode_steps(T: int, v_split: int, kind: str) -> None:
    N, H, D = 3, 2, 32
    case = verify_case(N, T, H, D, kind, torch.float32, num_slots=5, seed=T)
    slots = [3, -1, 0]
    state0, conv0 = case["state"].clone(), case["conv_state"].clone()
    o_ref, s_ref, c_ref = ref_steps(case, slots, kind, T)
    res = kda_verify(**case, slot_indices=torch.tensor(slots, dtype=torch.int32, device=DEV),
                     lower_bound=LOWER_BOUND if kind == "lower_bound" else None, v_split=v_split)
    assert res.o.shape == (N, T, H, D) and res.states_out.shape == (N, T, H, D, D)
    assert res.conv_out.shape == (N, T, 3, 3 * H * D)
    assert torch.equal(case["state"], state0) and torch.equal(case["conv_state"], conv0)  # live untouched
    assert torch.equal(res.o[1], torch.zeros_like(res.o[1]))  # padding row
    for t in range(T):
        assert rel_err(res.o[[0, 2], t], o_ref[t][[0, 2]]) <= 1e-4, t
        for n, s in ((0, 3), (2, 0)):
            assert rel_err(res.states_out[n, t], s_ref[t][s]) <= 1e-4, (t, n)
            assert torch.equal(res.conv_out[n, t], c_ref[t][s]), (t, n)


@pytest.mark.parametrize("v_split", [1, 2], ids=["split1", "split2"])
def test_verify_fused_gated_rmsnorm(v_split: int) -> None:
    N, H, D, T, kind, eps = 2, 2, 32, 3, "softplus", 1e-5
    case = verify_case(N, T, H, D, kind, torch.float32, num_slots=3, seed=11)
    slots = [2, 0]
    o_ref, _, _ = ref_steps(case, slots, kind, T)
    gen = torch.Generator().manual_seed(12)
    wide = torch.randn(N * T, 2 * H * D, generator=gen).to(DEV)
    gate = wide[:, H * D:].view(N, T, H * D)  # strided rows
    weight = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV)
    ws = kda_decode_workspace(N, H, DEV)
    res = kda_verify(**case, slot_indices=torch.tensor(slots, dtype=torch.int32, device=DEV), o_gate=gate,
                     o_norm_weight=weight, o_norm_eps=eps, v_split=v_split, workspace=ws)
    for t in range(T):
        want = rms_norm_gated(o_ref[t], gate[:, t].reshape(N, H, D), weight, eps)
        assert rel_err(res.o[:, t], want) <= 1e-4, t
    assert torch.equal(ws, torch.zeros_like(ws))


def test_commit_installs_state_after_accepted_tokens() -> None:
    """accepted j in 1..T installs the state after j steps; 0, out-of-range and padding leave slots alone."""
    N, H, D, T, kind = 5, 2, 16, 4, "lower_bound"
    case = verify_case(N, T, H, D, kind, torch.float32, num_slots=7, seed=21)
    slots = [6, 1, -1, 3, 4]
    accepted = [2, 0, 3, T, T + 1]
    _, s_ref, c_ref = ref_steps(case, slots, kind, T)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=DEV)
    res = kda_verify(**case, slot_indices=slot_t, lower_bound=LOWER_BOUND, v_split=2)
    state0, conv0 = case["state"].clone(), case["conv_state"].clone()
    kda_commit(res.states_out, res.conv_out, torch.tensor(accepted, dtype=torch.int32, device=DEV), slot_t,
               case["state"], case["conv_state"])
    for s, j in zip(slots, accepted):
        if s < 0:
            continue
        if 1 <= j <= T:
            assert torch.equal(case["state"][s], res.states_out[slots.index(s), j - 1])
            assert rel_err(case["state"][s], s_ref[j - 1][s]) <= 1e-4, s
            assert torch.equal(case["conv_state"][s], c_ref[j - 1][s]), s
        else:
            assert torch.equal(case["state"][s], state0[s]) and torch.equal(case["conv_state"][s], conv0[s])
    for s in (0, 2, 5):  # no sequence's slot
        assert torch.equal(case["state"][s], state0[s]) and torch.equal(case["conv_state"][s], conv0[s])


def test_verify_then_commit_then_verify_continues() -> None:
    """Two rounds: commit j, then a fresh verify from the committed slot equals decoding on from there."""
    N, H, D, T, kind = 2, 2, 16, 3, "softplus"
    case = verify_case(N, T, H, D, kind, torch.float32, num_slots=2, seed=31)
    slots = [1, 0]
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    res = kda_verify(**case, slot_indices=slot_t)
    _, s_ref, c_ref = ref_steps(case, slots, kind, T)
    kda_commit(res.states_out, res.conv_out, torch.tensor([1, 3], dtype=torch.int32, device=DEV), slot_t,
               case["state"], case["conv_state"])
    case2 = verify_case(N, T, H, D, kind, torch.float32, num_slots=2, seed=32)
    case2["state"], case2["conv_state"] = case["state"], case["conv_state"]
    case2.update({k: case[k] for k in ("conv_weight", "A_log", "dt_bias")})
    o2_ref, _, _ = ref_steps(case2, slots, kind, T)
    res2 = kda_verify(**case2, slot_indices=slot_t)
    for t in range(T):
        assert rel_err(res2.o[:, t], o2_ref[t]) <= 1e-4, t
    assert rel_err(case["state"][1], s_ref[0][1]) <= 1e-4 and rel_err(case["state"][0], s_ref[2][0]) <= 1e-4


def test_verify_and_commit_reject_bad_inputs() -> None:
    N, H, D, T = 2, 2, 16, 2
    case = verify_case(N, T, H, D, "softplus", torch.float32, num_slots=3, seed=41)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="qkv_pre"):
        kda_verify(**{**case, "qkv_pre": case["qkv_pre"][..., :-1]}, slot_indices=slots)
    with pytest.raises(ValueError, match="T"):
        kda_verify(**{**case, "qkv_pre": torch.randn(N, 17, 3 * H * D, device=DEV)}, slot_indices=slots)
    with pytest.raises(ValueError, match="f must"):
        kda_verify(**{**case, "f": case["f"][:, :1]}, slot_indices=slots)
    with pytest.raises(ValueError, match="states_out"):
        kda_verify(**case, slot_indices=slots, states_out=torch.zeros(N, T, H, D, D, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="together"):
        kda_verify(**case, slot_indices=slots, o_norm_weight=torch.ones(D, device=DEV))
    res = kda_verify(**case, slot_indices=slots)
    with pytest.raises(ValueError, match="accepted"):
        kda_commit(res.states_out, res.conv_out, torch.ones(N, dtype=torch.int64, device=DEV), slots,
                   case["state"], case["conv_state"])
    with pytest.raises(ValueError, match="conv_state"):
        kda_commit(res.states_out, res.conv_out, torch.ones(N, dtype=torch.int32, device=DEV), slots,
                   case["state"], case["conv_state"].half())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("v_split", [1, 4], ids=["split1", "split4"])
def test_gpu_verify_commit_kimi_shape(v_split: int) -> None:
    N, H, D, T, kind = 6, 32, 128, 4, "lower_bound"
    case = verify_case(N, T, H, D, kind, torch.bfloat16, num_slots=N + 2, seed=51)
    slots = [7, 0, -1, 3, 4, 5]
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    o_ref, s_ref, c_ref = ref_steps(case, slots, kind, T)
    res = kda_verify(**case, slot_indices=slot_t, lower_bound=LOWER_BOUND, v_split=v_split)
    live = [i for i, s in enumerate(slots) if s >= 0]
    for t in range(T):
        assert rel_err(res.o[live, t], o_ref[t][live]) <= 1e-2, t
        for n in live:
            assert rel_err(res.states_out[n, t], s_ref[t][slots[n]]) <= 1e-4
            assert torch.equal(res.conv_out[n, t], c_ref[t][slots[n]])
    accepted = torch.tensor([1, 2, 3, 4, 0, 3], dtype=torch.int32, device=DEV)
    kda_commit(res.states_out, res.conv_out, accepted, slot_t, case["state"], case["conv_state"])
    torch.cuda.synchronize()
    for n, j in enumerate(accepted.tolist()):
        if slots[n] >= 0 and j > 0:
            assert torch.equal(case["state"][slots[n]], res.states_out[n, j - 1])
            assert torch.equal(case["conv_state"][slots[n]], c_ref[j - 1][slots[n]])
