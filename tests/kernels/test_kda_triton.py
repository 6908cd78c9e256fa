"""The Triton KDA kernels (decode step, chunked prefill) agree with the torch oracle.

Without a GPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py
before the kernel modules are imported), so the CPU cases use tiny fp32/fp16 shapes. The `gpu` cases
run the compiled kernels at Kimi shapes (H=32, D=128, bf16 activations, fp32 state).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from k3rt.kernels.kda import kda_chunk_fwd, kda_decode  # noqa: E402
from k3rt.kernels.kda import triton_decode  # noqa: E402
from k3rt.kernels.kda.chunk_tables import ChunkTables, chunk_tables  # noqa: E402
from k3rt.kernels.kda.ref import (  # noqa: E402
    kda_chunked,
    kda_gate_lower_bound,
    kda_gate_softplus,
    kda_recurrent,
)
from k3rt.kernels.short_conv.ref import causal_conv1d  # noqa: E402
from tests.kernels.helpers import DEV, HAS_CUDA, REPO, rel_err, run_benchmark_smoke  # noqa: E402

LOWER_BOUND = -5.0
W = 4
INTRA = ["fused", "split", "blocks"]  # kda_chunk_fwd's intra-chunk paths (the state pass is shared)

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py


def gate_params(gen: torch.Generator, H: int, D: int, gate: str) -> tuple[Tensor, Tensor]:
    """(A_log [H], dt_bias [H*D]) drawn like fla's init (safe gate: A_log = 0)."""
    if gate == "softplus":
        A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    else:
        A_log = torch.zeros(H)
    dt = torch.exp(torch.empty(H * D).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    return A_log, dt + torch.log(-torch.expm1(-dt))  # inverse softplus


def gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, kind: str) -> Tensor:
    H = A_log.numel()
    f = f.view(*f.shape[:-1], H, -1)
    dt = dt_bias.view(H, -1)
    if kind == "softplus":
        return kda_gate_softplus(f, A_log, dt)
    return kda_gate_lower_bound(f, A_log, dt, LOWER_BOUND)


# --------------------------------------------------------------------------------------------
# decode


def decode_case(N: int, H: int, D: int, kind: str, dtype: torch.dtype, num_slots: int, seed: int = 0,
                width: int = W):
    gen = torch.Generator().manual_seed(seed)
    P = H * D
    A_log, dt_bias = gate_params(gen, H, D, kind)
    case = dict(
        qkv_pre=torch.randn(N, 3 * P, generator=gen).to(dtype),
        conv_weight=torch.randn(3 * P, width, generator=gen) * 0.5,
        conv_state=torch.randn(num_slots, width - 1, 3 * P, generator=gen).to(dtype),
        f=torch.randn(N, P, generator=gen).to(dtype),
        A_log=A_log,
        dt_bias=dt_bias,
        b=torch.randn(N, H, generator=gen).to(dtype),
        state=torch.randn(num_slots, H, D, D, generator=gen) * 0.5,
    )
    return {k: v.to(DEV) for k, v in case.items()}


def decode_ref(case: dict, slots: list[int], kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """(o [N, H, D] fp32, state, conv_state) after one step, from ref.py + short_conv/ref.py."""
    state, conv_state = case["state"].clone(), case["conv_state"].clone()
    num_slots, H, D, _ = state.shape
    N = len(slots)
    o = torch.zeros(N, H, D, dtype=torch.float32, device=state.device)
    for n, s in enumerate(slots):
        if s < 0:
            continue
        # the kernel keeps the conv output in fp32: so does the oracle here
        y, new_conv = causal_conv1d(case["qkv_pre"][None, n:n + 1].float(), case["conv_weight"],
                                    conv_state[s][None].float())
        q, k, v = y[0].view(1, 3, H, D).unbind(1)  # [1, H, D] each
        g = gate(case["f"][n:n + 1].float(), case["A_log"], case["dt_bias"], kind)  # [1, H, D]
        beta = torch.sigmoid(case["b"][n:n + 1].float())  # [1, H]
        o_n, s_n = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], initial_state=state[s][None])
        o[n] = o_n[0, 0].float()
        state[s] = s_n[0]
        conv_state[s] = new_conv[0].to(conv_state.dtype)
    return o, state, conv_state


@pytest.mark.parametrize("kind", ["softplus", "lower_bound"])
@pytest.mark.parametrize(
    "N,D,slots",
    [(1, 16, [2]), (3, 16, [4, -1, 0]), (3, 32, [1, 3, -1])],
    ids=["N1_D16", "N3_D16_pad", "N3_D32_pad"],
)
def test_decode_matches_ref(N: int, D: int, slots: list[int], kind: str) -> None:
    H, num_slots = 2, 5
    case = decode_case(N, H, D, kind, torch.float32, num_slots)
    o_ref, state_ref, conv_ref = decode_ref(case, slots, kind)
    state0, conv0 = case["state"].clone(), case["conv_state"].clone()
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    o = kda_decode(**case, slot_indices=slot_t, lower_bound=LOWER_BOUND if kind == "lower_bound" else None)
    assert o.shape == (N, H, D) and o.dtype == torch.float32
    assert rel_err(o, o_ref) <= 1e-4
    assert rel_err(case["state"], state_ref) <= 1e-4
    assert rel_err(case["conv_state"], conv_ref) <= 1e-6
    for n, s in enumerate(slots):
        if s < 0:
            assert torch.equal(o[n], torch.zeros_like(o[n]))  # padding: zero output
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(case["state"][untouched], state0[untouched])
    assert torch.equal(case["conv_state"][untouched], conv0[untouched])


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_decode_hoisted_rows_match_the_tile_form(width: int, norm: bool) -> None:
    """Pinned one-warp programs (load_order: one wave, W <= 4) take the conv's operands as one vector per window row
    (_taps_rows); the other forms take them as one [W, channels] tile. Same sums in the same order: on the
    interpreter the outputs, states and conv caches are the same bits at every width (and match the oracle)."""
    N, H, D, slots = 3, 2, 32, [1, -1, 3]
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    got = []
    for prefetch, pin, late, early in ((True, None, False, None), (False, None, False, None), (True, False, False, None),
                                       (True, None, True, None), (True, None, True, False)):
        # HOIST and PIN (load_order: one wave); the tile form unhoisted; hoisted but not pinned (as past one wave);
        # pinned in the PDL wait's load order (the wait itself is GPU only), also with the q/k count at the end
        case = decode_case(N, H, D, "softplus", torch.float32, num_slots=4, seed=9, width=width)
        extra = {}
        if norm:
            gen = torch.Generator().manual_seed(10)
            extra = dict(o_gate=torch.randn(N, H, D, generator=gen).to(DEV), o_norm_weight=torch.ones(D, device=DEV))
        if not norm:
            o_ref, state_ref, conv_ref = decode_ref(case, slots, "softplus")
        o = kda_decode(**case, **extra, slot_indices=slot_t, v_split=2, block_v=16, num_warps=1, prefetch=prefetch,
                       pin=pin, late_wait=late, early=early)
        if not norm:
            assert rel_err(o, o_ref) <= 1e-4 and rel_err(case["state"], state_ref) <= 1e-4
            assert torch.equal(case["conv_state"], conv_ref)
        got.append((o, case["state"], case["conv_state"]))
    if DEV == "cpu":
        for other in got[1:]:
            for a, b in zip(got[0], other):
                assert torch.equal(a, b)


@pytest.mark.parametrize("v_split", [1, 2])
def test_decode_in_place_on_page_pool_views(v_split: int) -> None:
    """State and conv cache as the page pool lays them out: each slot a view into one page of a byte
    tensor (conv rows, then the state, then padding), so slots are contiguous but a page apart."""
    N, H, D, kind = 3, 2, 16, "lower_bound"
    case = decode_case(N, H, D, kind, torch.float32, num_slots=4, seed=5)
    slots = [3, -1, 1]
    o_ref, state_ref, conv_ref = decode_ref(case, slots, kind)
    conv_n, state_n = case["conv_state"][0].numel(), case["state"][0].numel()
    pages = torch.full((4, conv_n + state_n + 24), float("nan"), device=DEV)  # 24 floats of page padding
    conv_view = pages[:, :conv_n].view(4, *case["conv_state"].shape[1:])
    state_view = pages[:, conv_n:conv_n + state_n].view(4, *case["state"].shape[1:])
    conv_view.copy_(case["conv_state"])
    state_view.copy_(case["state"])
    args = {**case, "conv_state": conv_view, "state": state_view}
    o = kda_decode(**args, slot_indices=torch.tensor(slots, device=DEV), lower_bound=LOWER_BOUND, v_split=v_split)
    assert rel_err(o, o_ref) <= 1e-4
    assert rel_err(state_view, state_ref) <= 1e-4 and rel_err(conv_view, conv_ref) <= 1e-6
    assert torch.isnan(pages[:, conv_n + state_n:]).all()  # the padding of every page untouched


def test_decode_two_steps_int64_slots_fp16() -> None:
    """Chained steps reuse the updated conv and recurrent state; fp16 activations, int64 slots."""
    N, H, D, kind = 2, 2, 16, "softplus"
    case = decode_case(N, H, D, kind, torch.float16, num_slots=3, seed=1)
    ref = {k: v.clone() for k, v in case.items()}
    slots = [2, 0]
    slot_t = torch.tensor(slots, dtype=torch.int64, device=DEV)
    for step in range(2):
        o_ref, ref["state"], ref["conv_state"] = decode_ref(ref, slots, kind)
        o = kda_decode(**case, slot_indices=slot_t)
        assert o.dtype == torch.float16
        assert rel_err(o, o_ref) <= 2e-3, step  # fp16 output rounding
        assert rel_err(case["state"], ref["state"]) <= 1e-4, step
        assert torch.equal(case["conv_state"], ref["conv_state"]), step
        gen = torch.Generator().manual_seed(10 + step)
        case["qkv_pre"] = torch.randn(N, 3 * H * D, generator=gen).to(torch.float16).to(DEV)
        ref["qkv_pre"] = case["qkv_pre"]


@pytest.mark.parametrize(
    "v_split,block_v,prefetch,norm",
    [(1, 8, None, False), (2, 32, None, False), (4, 4, None, False), (1, 8, True, False), (2, 8, False, False),
     (4, 4, None, True), (2, 8, False, True)],
    ids=["split1_tiles4", "split2", "split4_tiles2", "split1_tiles4_prefetch", "split2_tiles2_no_prefetch",
         "split4_tiles2_norm", "split2_tiles2_no_prefetch_norm"],
)
def test_decode_v_split_two_steps_shared_workspace(v_split: int, block_v: int, prefetch: bool | None,
                                                    norm: bool) -> None:
    """Heads split over V: the last program of a head to read the q/k conv cache shifts it (counting in early, at one
    warp without the norm; with it, the last to store its o columns shifts and takes the norm); counters return to
    0. Both tile schedules (each state tile loaded one step ahead, or in its own step) give the same result, conv
    cache included, over two steps."""
    from k3rt.backend.layers.norm import rms_norm_gated

    N, H, D, kind = 3, 2, 32, "lower_bound"
    case = decode_case(N, H, D, kind, torch.float32, num_slots=5, seed=7)
    ref = {k: v.clone() for k, v in case.items()}
    slots = [4, -1, 1]
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    ws = triton_decode.kda_decode_workspace(N + 2, H, DEV)
    gen = torch.Generator().manual_seed(11)
    gate, weight = torch.randn(N, H, D, generator=gen).to(DEV), (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV)
    extra = dict(o_gate=gate, o_norm_weight=weight) if norm else {}
    for step in range(2):
        o_ref, ref["state"], ref["conv_state"] = decode_ref(ref, slots, kind)
        if norm:
            o_ref = rms_norm_gated(o_ref, gate, weight, 1e-5)
            o_ref[1] = 0.0  # padding row
        o = kda_decode(**case, slot_indices=slot_t, lower_bound=LOWER_BOUND, v_split=v_split,
                       block_v=block_v, workspace=ws, prefetch=prefetch, **extra)
        assert rel_err(o, o_ref) <= 1e-4, step
        assert torch.equal(o[1], torch.zeros_like(o[1]))
        assert rel_err(case["state"], ref["state"]) <= 1e-4, step
        assert torch.equal(case["conv_state"], ref["conv_state"]), step
        assert torch.equal(ws, torch.zeros_like(ws)), step
        gen = torch.Generator().manual_seed(20 + step)
        case["qkv_pre"] = ref["qkv_pre"] = torch.randn(N, 3 * H * D, generator=gen).to(DEV)


@pytest.mark.parametrize(
    "v_split,block_v,gate_2d", [(1, 8, False), (1, 32, True), (2, 16, False), (4, 8, True)],
    ids=["split1_tiles4", "split1_one_tile_2d_gate", "split2", "split4"],
)
def test_decode_fused_gated_rmsnorm(v_split: int, block_v: int, gate_2d: bool) -> None:
    """o_gate/o_norm_weight: the output is rms_norm_gated(o) (fp32 math); state and cache as without."""
    from k3rt.backend.layers.norm import rms_norm_gated

    N, H, D, kind, eps = 3, 2, 32, "softplus", 1e-5
    case = decode_case(N, H, D, kind, torch.float32, num_slots=4, seed=8)
    slots = [2, 0, -1]
    o_ref, state_ref, conv_ref = decode_ref(case, slots, kind)
    gen = torch.Generator().manual_seed(9)
    # the gate as a column slice of a wider projection output: strided rows
    proj = torch.randn(N, 3 * H * D, generator=gen).to(DEV)
    gate = proj[:, H * D:2 * H * D]
    weight = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV)
    want = rms_norm_gated(o_ref, gate.reshape(N, H, D), weight, eps)
    want[2] = 0.0  # padding row
    o = kda_decode(**case, slot_indices=torch.tensor(slots, dtype=torch.int32, device=DEV),
                   o_gate=gate if gate_2d else gate.view(N, H, D), o_norm_weight=weight, o_norm_eps=eps,
                   v_split=v_split, block_v=block_v)
    assert rel_err(o, want) <= 1e-4
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    assert rel_err(case["state"], state_ref) <= 1e-4
    assert torch.equal(case["conv_state"], conv_ref)


@pytest.mark.parametrize("v_split,block_v,num_warps", [(1, 16, 4), (2, 16, 1), (4, 8, 1), (2, 8, 1)],
                         ids=["whole_head", "split2", "split4", "split2_two_tiles"])
def test_decode_split_norm_finishes_to_the_fused_norm(v_split: int, block_v: int, num_warps: int) -> None:
    """kda_decode_split_norm: y = o * weight * sigmoid(gate) and per-program sums of o^2, the rms factor left to
    the consumer (skinny_linear row_rms): y times that factor is the fused norm's output; states and conv caches
    are the fused launch's, bit for bit on the interpreter; a padding row gives zeros in both."""
    from k3rt.backend.layers.norm import rms_norm_gated
    from k3rt.kernels.kda import kda_decode_split_norm

    N, H, D, kind, eps = 3, 2, 32, "softplus", 1e-5
    slots = torch.tensor([2, 0, -1], dtype=torch.int32, device=DEV)
    gen = torch.Generator().manual_seed(9)
    gate = torch.randn(N, H, D, generator=gen).to(DEV)
    weight = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV)
    fused_case = decode_case(N, H, D, kind, torch.float32, num_slots=4, seed=8)
    split_case = decode_case(N, H, D, kind, torch.float32, num_slots=4, seed=8)
    o_ref, _, _ = decode_ref(decode_case(N, H, D, kind, torch.float32, num_slots=4, seed=8), [2, 0, -1], kind)
    kw = dict(slot_indices=slots, v_split=v_split, block_v=block_v, num_warps=num_warps)
    fused = kda_decode(**fused_case, o_gate=gate, o_norm_weight=weight, o_norm_eps=eps, **kw)
    y, partials = kda_decode_split_norm(**split_case, o_gate=gate, o_norm_weight=weight, **kw)
    assert partials.shape == (N, H, v_split)
    assert rel_err(y, o_ref * weight * torch.sigmoid(gate)) <= 1e-4
    done = y * torch.rsqrt(partials.sum(-1, keepdim=True) / D + eps)
    assert rel_err(done, fused) <= 1e-5
    assert rel_err(done[:2], rms_norm_gated(o_ref, gate, weight, eps)[:2]) <= 1e-4
    assert torch.equal(y[2], torch.zeros_like(y[2])) and torch.equal(partials[2], torch.zeros_like(partials[2]))
    if DEV == "cpu":
        assert torch.equal(split_case["state"], fused_case["state"])
    assert torch.equal(split_case["conv_state"], fused_case["conv_state"])
    with pytest.raises(ValueError, match="norm_partials needs o_gate"):
        kda_decode(**split_case, slot_indices=slots, norm_partials=partials)
    with pytest.raises(ValueError, match="norm_partials must be"):
        kda_decode(**split_case, slot_indices=slots, o_gate=gate, o_norm_weight=weight, v_split=v_split,
                   norm_partials=partials[:, :, :1] if v_split > 1 else partials.expand(N, H, 2).contiguous())


def test_decode_split_defaults_one_warp_programs() -> None:
    """Session 38's defaults at the 48B's KDA shape (H = 32, D = 128): heads split into one-warp programs of at most
    32 value columns while N * H <= 512 (16 columns at N = 1, to reach 256 programs), whole heads at 4 warps above;
    split one-warp programs hoist every load, take the early count without the norm, and pin the state tile's loads
    (the count before the conv math, or the fence) only while one wave holds every program (N = 1 and 2 here)."""
    KD = triton_decode
    assert [KD.default_v_split(n, 32, 128) for n in (1, 2, 4, 8, 16, 17, 64)] == [8, 4, 4, 4, 4, 1, 1]
    assert [KD.default_num_warps(128, s) for s in (8, 4, 2, 1)] == [1, 1, 4, 4]
    assert KD.load_order(True, 1, 8, norm=False, programs=256, conv_width=4) == (True, True, True)
    assert KD.load_order(True, 1, 8, norm=True, programs=256, conv_width=4) == (True, False, True)
    # N = 4: the count after the conv math, no fence
    assert KD.load_order(True, 1, 4, norm=False, programs=512, conv_width=4) == (True, True, False)
    assert KD.load_order(True, 1, 4, norm=True, programs=1024, conv_width=4) == (True, False, False)
    # 2 warps: hoisting lost there
    assert KD.load_order(True, 2, 8, norm=False, programs=256, conv_width=4) == (False, False, False)
    assert KD.load_order(False, 4, 1, norm=False, programs=64, conv_width=4) == (False, False, False)
    assert KD.load_order(True, 1, 8, norm=False, programs=256, conv_width=5) == (True, True, False)  # rows: W <= 4


def test_decode_default_tile_narrow_for_few_programs_and_pinned_with_v_split(monkeypatch) -> None:
    """block_v None: 32-column tiles while (sequence, head) programs <= 512 and heads are unsplit (H200: N=16 H=32
    25.4 against 27.4 us), 64 above; a caller that pins v_split (the batch-invariant mode) gets 64 at any N, so its
    launch shape, and with it the summation order, never depends on the batch."""
    assert triton_decode.default_block_v(16, 32, 1) == 32
    assert triton_decode.default_block_v(17, 32, 1) == 64
    assert triton_decode.default_block_v(4, 32, 2) == 64
    seen = []
    monkeypatch.setattr(triton_decode, "_launch_decode", lambda *a, **kw: seen.append((a[-3], a[-2])))
    N, H, D = 3, 2, 32
    case = decode_case(N, H, D, "softplus", torch.float32, num_slots=4, seed=3)
    slots = torch.tensor([0, 1, 2], device=DEV)
    kda_decode(**case, slot_indices=slots)
    kda_decode(**case, slot_indices=slots, v_split=1)
    kda_decode(**case, slot_indices=slots, v_split=1, block_v=8)
    split = triton_decode.default_v_split(N, H, D)
    assert seen == [(triton_decode.default_block_v(N, H, split), split), (64, 1), (8, 1)]


def test_decode_probes_skip_what_they_name() -> None:
    """kda_decode(probe=) is for timing only (benchmarks/kernels.py's decode sweep). Bit 1 skips the split heads'
    arrival: o and the state as without it (no norm asked), the v channels' conv cache shifted by their programs, the
    q/k channels' left unshifted and the counters untouched. Bit 2 runs the conv at width 1: no conv cache read or
    written. Other values are refused."""
    N, H, D, kind = 2, 2, 32, "softplus"
    case = decode_case(N, H, D, kind, torch.float32, num_slots=3, seed=11)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    ref = {k: v.clone() for k, v in case.items()}
    o_ref = kda_decode(**ref, slot_indices=slots, v_split=2, block_v=8)
    conv0 = case["conv_state"].clone()
    ws = triton_decode.kda_decode_workspace(N, H, DEV)
    o = kda_decode(**case, slot_indices=slots, v_split=2, block_v=8, workspace=ws, probe=1)
    assert torch.equal(o, o_ref) and torch.equal(case["state"], ref["state"])
    qk = slice(0, 2 * H * D)
    assert torch.equal(case["conv_state"][:, :, qk], conv0[:, :, qk])
    assert torch.equal(case["conv_state"][:, :, 2 * H * D:], ref["conv_state"][:, :, 2 * H * D:])
    assert torch.equal(ws, torch.zeros_like(ws))
    case["conv_state"] = conv0.clone()
    kda_decode(**case, slot_indices=slots, v_split=1, probe=2)
    assert torch.equal(case["conv_state"], conv0)
    with pytest.raises(ValueError, match="probe must be 0-3"):
        kda_decode(**case, slot_indices=slots, probe=4)


def test_decode_rejects_bad_inputs() -> None:
    case = decode_case(2, 2, 16, "softplus", torch.float32, num_slots=3)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="qkv_pre"):
        kda_decode(**{**case, "qkv_pre": case["qkv_pre"][:, :-1]}, slot_indices=slots)
    with pytest.raises(ValueError, match="state must be fp32"):
        kda_decode(**{**case, "state": case["state"].half()}, slot_indices=slots)
    with pytest.raises(ValueError, match="slot_indices"):
        kda_decode(**case, slot_indices=slots.float())
    with pytest.raises(ValueError, match="conv_weight must be fp32"):
        kda_decode(**{**case, "conv_weight": case["conv_weight"].half()}, slot_indices=slots)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_decode(**case, slot_indices=slots, lower_bound=-6.0)
    with pytest.raises(ValueError, match="together"):
        kda_decode(**case, slot_indices=slots, o_gate=torch.randn(2, 2, 16, device=DEV))
    with pytest.raises(ValueError, match="o_gate"):
        kda_decode(**case, slot_indices=slots, o_gate=torch.randn(2, 2, 8, device=DEV),
                   o_norm_weight=torch.ones(16, device=DEV))
    with pytest.raises(ValueError, match="v_split"):
        kda_decode(**case, slot_indices=slots, v_split=3)
    with pytest.raises(ValueError, match="workspace"):
        kda_decode(**case, slot_indices=slots, v_split=2, workspace=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="pin=True needs prefetch at num_warps=1"):
        kda_decode(**case, slot_indices=slots, v_split=2, num_warps=2, pin=True)


# --------------------------------------------------------------------------------------------
# chunked prefill


def chunk_case(lens: list[int], H: int, D: int, kind: str, dtype: torch.dtype, num_slots: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    A_log, dt_bias = gate_params(gen, H, D, kind)
    case = dict(
        q=torch.randn(T, H, D, generator=gen).to(dtype),
        k=torch.randn(T, H, D, generator=gen).to(dtype),
        v=torch.randn(T, H, D, generator=gen).to(dtype),
        g=gate(torch.randn(T, H * D, generator=gen), A_log, dt_bias, kind),
        beta=torch.sigmoid(torch.randn(T, H, generator=gen)),
        cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        state=torch.randn(num_slots, H, D, D, generator=gen) * 0.5,
    )
    return {k: v.to(DEV) for k, v in case.items()}


def fp32_exact(case: dict, kw: dict) -> dict:
    """On the GPU, fp32 cases take precision="tf32x3" unless they ask otherwise: the default "tf32" dots put o ~2e-3
    from the fp32 oracle (H100, session 35: every intra form, D 16 and 32), past these tests' 1e-4, so the
    comparison would test tf32 rather than the kernels; at tf32x3 (and ieee) every form measured <= 4.3e-6. The
    interpreter runs fp32 dots exactly either way."""
    if DEV == "cuda" and case["q"].dtype == torch.float32 and "precision" not in kw:
        return dict(kw, precision="tf32x3")
    return kw


def check_chunk(case: dict, slots: list[int], *, has_init: list[bool] | None = None,
                snaps: tuple[list[list[int]], list[list[int]]] | None = None,
                tol: float = 1e-4, **kw) -> None:
    kw = fp32_exact(case, kw)
    state0 = case["state"].clone()
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    init_t = None if has_init is None else torch.tensor(has_init, device=DEV)
    o = kda_chunk_fwd(**case, slot_indices=slot_t, has_initial_state=init_t,
                      snapshot_positions=snaps[0] if snaps else None,
                      snapshot_slots=snaps[1] if snaps else None, **kw)
    cu = case["cu_seqlens"].tolist()
    assert o.shape == case["v"].shape and o.dtype == case["v"].dtype
    written = set()
    for i, s in enumerate(slots):
        b, e = cu[i], cu[i + 1]
        use_init = s >= 0 and (has_init is None or has_init[i])
        args = [case[n][None, b:e] for n in ("q", "k", "v", "g", "beta")]
        positions = snaps[0][i] if snaps else []
        o_ref, s_ref, s_snaps = kda_chunked(*args, initial_state=state0[s][None] if use_init else None,
                                            state_positions=positions)
        assert rel_err(o[b:e], o_ref[0]) <= tol, f"o of sequence {i}"
        if s >= 0:
            assert rel_err(case["state"][s], s_ref[0]) <= tol, f"final state of sequence {i}"
            written.add(s)
        for p, d, s_p in zip(positions, snaps[1][i] if snaps else [], s_snaps):
            assert rel_err(case["state"][d], s_p[0]) <= tol, f"snapshot at {p} of sequence {i}"
            written.add(d)
    untouched = [s for s in range(state0.shape[0]) if s not in written]
    assert torch.equal(case["state"][untouched], state0[untouched])


@pytest.mark.parametrize(
    "T,kind,with_h0",
    [(1, "softplus", True), (63, "lower_bound", False), (64, "softplus", False),
     (65, "lower_bound", True), (130, "softplus", True), (130, "lower_bound", False)],
    ids=lambda x: str(x),
)
def test_chunk_single_sequence(T: int, kind: str, with_h0: bool) -> None:
    case = chunk_case([T], H=2, D=16, kind=kind, dtype=torch.float32, num_slots=3)
    check_chunk(case, [1], has_init=[with_h0])


@pytest.mark.parametrize("intra", INTRA)
@pytest.mark.parametrize("kind", ["softplus", "lower_bound"])
def test_chunk_aligned_keys_high_beta_stay_exact(kind: str, intra: str) -> None:
    """Nearly parallel keys, beta 0.95 and a slow decay make L's entries close to 1: its powers grow
    like binomials, so a power series of L for (I + L)^-1 (repeated squaring) cancelled
    catastrophically (relative error 1e16; 620 with less aligned keys); the block forward substitution
    stays at fp32 rounding."""
    case = chunk_case([128], H=2, D=16, kind=kind, dtype=torch.float32, num_slots=2, seed=3)
    g = torch.Generator().manual_seed(1)
    case["k"] = (torch.randn(1, 2, 16, generator=g) + 0.3 * torch.randn(128, 2, 16, generator=g)).to(DEV)
    case["beta"] = torch.full((128, 2), 0.95, device=DEV)
    case["g"] = case["g"] * 0.05
    check_chunk(case, [1], tol=1e-5, precision="ieee", intra=intra)


@pytest.mark.parametrize("intra", INTRA)
def test_chunk_varlen_padding_slot_d32(intra: str) -> None:
    """Three sequences (63, 1, 130 tokens), one without a slot (zero start, no final write)."""
    case = chunk_case([63, 1, 130], H=2, D=32, kind="lower_bound", dtype=torch.float32, num_slots=5)
    check_chunk(case, [3, -1, 0], intra=intra)


@pytest.mark.parametrize("intra", INTRA)
def test_chunk_varlen_mixed_initial_state_and_snapshots(intra: str) -> None:
    case = chunk_case([130, 65, 64], H=2, D=16, kind="softplus", dtype=torch.float32, num_slots=9, seed=3)
    snaps = ([[64, 128, 130], [65], [64]], [[4, 5, 6], [7], [8]])
    check_chunk(case, [0, 1, 2], has_init=[True, False, True], snaps=snaps, intra=intra)


@pytest.mark.parametrize("intra", INTRA)
def test_chunk_head_dim_not_a_power_of_two(intra: str) -> None:
    """D = 24: the kernels' 32-wide tiles hold 8 padding columns of k, q, v and g (zeros, Gc 0 there)."""
    case = chunk_case([100, 30], H=2, D=24, kind="softplus", dtype=torch.float32, num_slots=3, seed=23)
    check_chunk(case, [2, 0], intra=intra)


@pytest.mark.parametrize("sliced,l_rows,fuse_gc,out_chunk,l_chunk", [
    (False, True, False, False, False), (True, True, False, False, False), (False, False, False, False, False),
    (False, True, True, False, False), (True, True, True, False, False), (False, True, False, True, False),
    (False, True, True, True, False), (False, False, False, True, False), (False, True, False, False, True),
    (False, True, True, True, True)],
    ids=["rows", "rows_sliced", "pairs", "rows_fused_gc", "rows_sliced_fused_gc", "out_chunk", "out_chunk_fused_gc",
         "pairs_out_chunk", "l_chunk", "l_chunk_out_chunk_fused_gc"])
def test_chunk_blocks_k_and_v_slices(sliced: bool, l_rows: bool, fuse_gc: bool, out_chunk: bool, l_chunk: bool) -> None:
    """intra="blocks" with two K and two V slices (D=32, 16-column slices): its row-block launch loops over the slices
    or (sliced_out_blocks) runs one program per row block and slice, or (out_chunk_blocks) one per chunk; L and Aqk
    per row block, all four in one program per chunk (l_chunk_blocks), or (l_rows_blocks False: akk's blocks above
    the diagonal never written) per 16 x 16 block; Gc from phase 0's launch or (fuse_gc_blocks) where it is read;
    with snapshots, a tail chunk and a steep sub-chunk (the inverse's exact fix-up)."""
    case = chunk_case([150, 64], H=2, D=32, kind="softplus", dtype=torch.float32, num_slots=5, seed=21)
    case["g"][100, 1, 5] = -90.0
    check_chunk(case, [1, 0], snaps=([[64, 128, 150], []], [[2, 3, 4], []]), intra="blocks", block_k_blocks=16,
                sliced_out_blocks=sliced, l_rows_blocks=l_rows, fuse_gc_blocks=fuse_gc, out_chunk_blocks=out_chunk,
                l_chunk_blocks=l_chunk)


def blocks_forms(seed: int, steep: list[tuple[int, int, int, float]], forms: list[dict]):
    """Each of `forms` (kda_chunk_fwd keyword sets, intra="blocks" with two 16-column K slices) over the same case
    (lengths 150 / 64 / 7: a padded tail chunk; snapshots at 64, 128 and 150; g set to the given values at the
    given places: steep sub-chunks) and the same starting states: each form's output, final states (snapshots
    included) and scratch dict."""
    case = chunk_case([150, 64, 7], H=2, D=32, kind="softplus", dtype=torch.float32, num_slots=6, seed=seed)
    for t, h, d, value in steep:
        case["g"][t, h, d] = value
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    state0 = case["state"].clone()
    runs = []
    for kw in forms:
        kw = fp32_exact(case, kw)
        case["state"] = state0.clone()
        scratch: dict = {}
        out = kda_chunk_fwd(**case, slot_indices=slots, snapshot_positions=[[64, 128, 150], [], []],
                            snapshot_slots=[[3, 4, 5], [], []], intra="blocks", block_k_blocks=16, scratch=scratch,
                            **kw)
        runs.append((out, case["state"], scratch))
    return case, slots, runs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit in the interpreter; compiled, within fp32 rounding (sums may associate differently)."""
    return torch.equal(a, b) if DEV == "cpu" else rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("fuse_gc", [False, True], ids=["phase0", "fused_gc"])
def test_chunk_blocks_l_chunk_equals_row_blocks(fuse_gc: bool) -> None:
    """l_chunk_blocks (the four row blocks of L and Aqk one after another in one program per chunk) does the row-block
    programs' operations: outputs, final states and snapshots equal bit for bit in the interpreter (compiled: within
    fp32 rounding), steep sub-chunk and padded tail chunk included; with fuse_gc_blocks its norms, spans and
    exp(Gc_last) are phase 0's. Refused without l_rows_blocks and outside intra="blocks"."""
    case, slots, ((o0, s0, _), (o1, s1, _)) = blocks_forms(43, [(100, 1, 5, -90.0)], [
        dict(fuse_gc_blocks=fuse_gc), dict(fuse_gc_blocks=fuse_gc, l_chunk_blocks=True)])
    assert same_bits(o1, o0) and same_bits(s1, s0)
    with pytest.raises(ValueError, match="l_chunk"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="blocks", l_rows_blocks=False, l_chunk_blocks=True)
    with pytest.raises(ValueError, match="l_chunk_blocks"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="fused", l_chunk_blocks=True)


def test_chunk_blocks_per_phase_launch_shapes_equal_the_default() -> None:
    """The per-phase launch shapes (the Gc launch's warps and a K slice of the whole head, the inverse's and W/U's warps)
    compute the same values: the Gc slice only regroups the rows' squared norms, so within fp32 rounding, snapshots,
    padded tail chunk and steep sub-chunk included."""
    case, slots, ((o0, s0, _), (o1, s1, _)) = blocks_forms(44, [(30, 0, 3, -80.0)], [
        {}, dict(num_warps_gc_blocks=8, block_k_gc_blocks=32, num_warps_inverse_blocks=1, num_warps_out_blocks=4)])
    assert rel_err(o1, o0) <= 1e-6 and rel_err(s1, s0) <= 1e-6


def test_chunk_blocks_norms_in_l_equals_phase_zero_norms() -> None:
    """norms_in_l_blocks: L's row-block programs take the rows' squared norms from the rows they load (the Gc launch then
    reads only g): the same operations, so outputs, final states and snapshots equal bit for bit in the interpreter
    (compiled: within fp32 rounding), steep sub-chunk (its span found by the inverse's launch) and padded tail chunk
    included; so does the Gc launch per K slice (gc_sliced_blocks), which needs it. Refused with the per-block L,
    the per-chunk L and fused Gc, and outside intra="blocks"."""
    # the steep channel in the second K slice: the sliced Gc launch's spans are found only by a max over the slices
    case, slots, ((o0, s0, _), (o1, s1, _), (o2, s2, scratch2)) = blocks_forms(45, [(100, 1, 20, -90.0)], [
        dict(norms_in_l_blocks=False), dict(norms_in_l_blocks=True), dict(gc_sliced_blocks=True)])
    assert same_bits(o1, o0) and same_bits(s1, s0)
    # the Gc launch per (chunk, K slice, head) (on with the default norms_in_l): the same values, spans per slice
    assert same_bits(o2, o0) and same_bits(s2, s0)
    assert any(key[0] == "span" and key[1][2] == 4 * 2 for key in scratch2)  # two 16-column K slices
    with pytest.raises(ValueError, match="gc_sliced"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="blocks", norms_in_l_blocks=False, gc_sliced_blocks=True)
    for bad in (dict(l_rows_blocks=False), dict(l_chunk_blocks=True), dict(fuse_gc_blocks=True)):
        with pytest.raises(ValueError, match="norms_in_l"):
            kda_chunk_fwd(**case, slot_indices=slots, intra="blocks", norms_in_l_blocks=True, **bad)
    with pytest.raises(ValueError, match="norms_in_l_blocks"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="fused", norms_in_l_blocks=True)


def test_chunk_blocks_out_chunk_equals_row_blocks() -> None:
    """out_chunk_blocks (W/U one program per chunk) does per row what the row-block programs do; only the dots' sums
    may be taken in another order (the interpreter's host matmul on a [C, C] instead of a [BC, C] operand): outputs
    and states within fp32 rounding of the row-block form's, padded tail chunk and steep sub-chunk included. Refused
    with sliced_out_blocks and outside intra="blocks"."""
    case, slots, ((o0, s0, _), (o1, s1, _)) = blocks_forms(41, [(30, 0, 3, -80.0)], [
        dict(out_chunk_blocks=False), dict(out_chunk_blocks=True)])
    assert rel_err(o1, o0) <= 1e-6 and rel_err(s1, s0) <= 1e-6
    with pytest.raises(ValueError, match="out_chunk"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="blocks", out_chunk_blocks=True, sliced_out_blocks=True)
    with pytest.raises(ValueError, match="out_chunk_blocks"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="split", out_chunk_blocks=True)


def test_chunk_blocks_defaults_per_dot_form(monkeypatch) -> None:
    """The blocks path's launch record as kda_chunk_fwd resolves it (H200 session 37: W/U per chunk at 3 stages 2.37 ->
    1.76 ms and Gc per K slice at 2 warps 0.95 -> 0.65 at 64K tokens): with 16-bit dots W/U one program per (chunk,
    head) at 3 stages; on the fp32 form (its per-chunk W/U programs spill on sm_90) per row block at the blocks
    path's stages; the Gc launch per K slice at 2 warps wherever the rows' norms are in L, else per chunk at 4;
    explicit values win; other intra forms get none of them."""
    from k3rt.kernels.kda import triton_chunk

    seen = []
    monkeypatch.setattr(triton_chunk, "_launch_chunk", lambda *a: seen.append(a[-2]))
    monkeypatch.setattr(triton_chunk, "EXACT_DOTS", False)  # the GPU's choice of dots (nothing launches here)
    slots = torch.tensor([0], dtype=torch.int32, device=DEV)
    for dtype in (torch.bfloat16, torch.float32):
        case = chunk_case([70], H=2, D=64, kind="softplus", dtype=dtype, num_slots=1)
        kda_chunk_fwd(**case, slot_indices=slots, intra="blocks")
        kda_chunk_fwd(**case, slot_indices=slots, intra="blocks", norms_in_l_blocks=False)
        kda_chunk_fwd(**case, slot_indices=slots, intra="blocks", out_chunk_blocks=False, num_warps_gc_blocks=8,
                      num_stages_out_blocks=1)
        kda_chunk_fwd(**case, slot_indices=slots, intra="fused")
    got = [(c.dot16, c.out_chunk_blocks, c.ns_out_blocks, c.gc_sliced_blocks, c.nw_gc_blocks) for c in seen]
    assert got == [(True, True, 3, True, 2), (True, True, 3, False, 4), (True, False, 1, True, 8),
                   (True, False, None, False, 4),
                   (False, False, None, True, 2), (False, False, None, False, 4), (False, False, 1, True, 8),
                   (False, False, None, False, 4)]


@pytest.mark.parametrize("sliced", [False, True], ids=["rows", "rows_sliced"])
def test_chunk_blocks_fused_gc_equals_its_phase_zero(sliced: bool) -> None:
    """fuse_gc_blocks computes what phase 0 stores (Gc, the norms, the spans, exp(Gc_last)) where it is read, with the
    same operations: outputs, final states and snapshots equal the four-launch path's bit for bit in the interpreter
    (compiled, the norms' sums may associate differently: within fp32 rounding), a steep sub-chunk and a padded tail
    chunk included, and under a register cap on its L launch (max_registers_l); no gc scratch is allocated; and
    fuse_gc without row-block programs is refused."""
    case, slots, ((o0, s0, scratch0), (o1, s1, scratch1), (o2, s2, _)) = blocks_forms(31, [(100, 1, 5, -90.0)], [
        dict(sliced_out_blocks=sliced), dict(sliced_out_blocks=sliced, fuse_gc_blocks=True),
        dict(sliced_out_blocks=sliced, fuse_gc_blocks=True, max_registers_l=128)])
    assert same_bits(o1, o0) and same_bits(s1, s0)
    assert same_bits(o2, o1) and same_bits(s2, s1)  # under a register cap (compiled: spills, the same values)
    assert any(key[0] == "gc" for key in scratch0) and not any(key[0] == "gc" for key in scratch1)
    with pytest.raises(ValueError, match="fuse_gc"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="blocks", l_rows_blocks=False, fuse_gc_blocks=True)


@pytest.mark.parametrize("fuse_gc", [False, True], ids=["phase0", "fused_gc"])
def test_chunk_blocks_inverse_regs_equals_scratch_rows(fuse_gc: bool) -> None:
    """inverse_regs_blocks (the inverse launch's blocks in registers, stored once) computes the same products in the
    same order as the row-at-a-time form that reads them back from the scratch: outputs, final states and snapshots
    equal bit for bit in the interpreter (compiled: within fp32 rounding), with steep sub-chunks in two chunks (the
    exact fix-up writes the diagonal blocks the register form then loads) and a padded tail chunk; refused outside
    intra="blocks"."""
    case, slots, ((o0, s0, _), (o1, s1, _)) = blocks_forms(37, [(100, 1, 5, -90.0), (170, 0, 2, -75.0)], [
        dict(fuse_gc_blocks=fuse_gc), dict(fuse_gc_blocks=fuse_gc, inverse_regs_blocks=True)])
    assert same_bits(o1, o0) and same_bits(s1, s0)
    with pytest.raises(ValueError, match="inverse_regs_blocks"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="fused", inverse_regs_blocks=True)


def test_chunk_split_output_pass() -> None:
    """split_output: the state pass stores per-chunk states and Vnew, a third launch computes O."""
    case = chunk_case([130, 63], H=2, D=16, kind="lower_bound", dtype=torch.float32, num_slots=5, seed=11)
    check_chunk(case, [2, 0], snaps=([[64, 130], []], [[3, 4], []]), split_output=True, block_v_out=8)


@pytest.mark.parametrize("intra", INTRA)
def test_chunk_steep_gate_exact_diagonal_blocks(intra: str) -> None:
    """A decay of more than SAFE_SPAN nats inside a 16-row block (one token at -80 or -300 in some
    channels) takes the exact elementwise path for that diagonal block; no inf/NaN anywhere."""
    case = chunk_case([150], H=2, D=16, kind="softplus", dtype=torch.float32, num_slots=2, seed=12)
    g = case["g"]
    g[5, 0, :4] = -80.0  # block 0 of chunk 0, head 0 only
    g[70, 1, 3] = -300.0  # block 0 of chunk 1, head 1
    g[140:142, :, 8:] = -45.0  # block 0 of the tail chunk, both heads: span 90
    check_chunk(case, [1], intra=intra)


@pytest.mark.parametrize("intra", INTRA)
def test_chunk_fp16_inputs_and_scratch(intra: str) -> None:
    """The 16-bit scratch path (16-bit tensor-core dots on the GPU); fp16 runs in the interpreter."""
    case = chunk_case([65, 63], H=2, D=16, kind="lower_bound", dtype=torch.float16, num_slots=2, seed=4)
    check_chunk(case, [1, 0], tol=3e-3, scratch_dtype=torch.float16, intra=intra)


def test_chunk_rejects_bad_inputs() -> None:
    case = chunk_case([64, 3], H=2, D=16, kind="softplus", dtype=torch.float32, num_slots=4)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="g must"):
        kda_chunk_fwd(**{**case, "g": case["g"].half()}, slot_indices=slots)
    with pytest.raises(ValueError, match="slot_indices"):
        kda_chunk_fwd(**case, slot_indices=slots[:1])
    with pytest.raises(ValueError, match="snapshot position"):
        kda_chunk_fwd(**case, slot_indices=slots, snapshot_positions=[[32], []], snapshot_slots=[[2], []])
    with pytest.raises(ValueError, match="snapshot_positions and snapshot_slots"):
        kda_chunk_fwd(**case, slot_indices=slots, snapshot_positions=[[64]], snapshot_slots=[[2]])
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_chunk_fwd(**case, slot_indices=slots, cu_seqlens_cpu=[0, 64, 60])
    with pytest.raises(ValueError, match="intra must be"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="splt")
    with pytest.raises(ValueError, match="block_k_split"):
        kda_chunk_fwd(**case, slot_indices=slots, intra="split", block_k_split=24)


def test_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/kernels.py --smoke runs end to end on the CPU interpreter and writes its JSON."""
    out = tmp_path / "kernels.json"
    result = run_benchmark_smoke("kernels.py", out)
    assert result["mode"] == "smoke"
    assert all(c["ok"] for c in result["correctness"]), result["correctness"]


def test_benchmark_decode_baseline_smoke(tmp_path: Path) -> None:
    """kernels.py --decode-baseline FILE --decode-norm: an earlier triton_decode.py (here the current one, as a file)
    timed beside the current kernel, twice each, interleaved, with and without the fused norm, all in the decode
    rows (the timing itself is the GPU's; here the rows must exist and have run)."""
    base, calls = tmp_path / "old_decode.py", tmp_path / "baseline_calls"
    # the copy counts its own calls, so the baseline rows are shown to run the file's kernel, not the current one
    base.write_text((REPO / "kernels" / "kda" / "triton_decode.py").read_text() + (
        f"\n_kda_decode = kda_decode\n\n\ndef kda_decode(*a, **kw):\n"
        f"    open({str(calls)!r}, 'a').write('.')\n    return _kda_decode(*a, **kw)\n"))
    result = run_benchmark_smoke("kernels.py", tmp_path / "kernels.json", "--decode-baseline", str(base),
                                 "--decode-norm", "--prefill")
    rows = [(d["impl"], d["cfg"]["norm"]) for d in result["decode"] if "us_per_call" in d]
    assert sorted(rows) == sorted([(impl, norm) for impl in ("k3rt", "baseline") for norm in (False, True)] * 2), rows
    assert calls.exists() and len(calls.read_text()) >= 4  # every baseline row called the file's kda_decode


# --------------------------------------------------------------------------------------------
# GPU, Kimi shapes


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", ["softplus", "lower_bound"])
def test_gpu_decode_kimi_shape(kind: str) -> None:
    N, H, D = 64, 32, 128
    case = decode_case(N, H, D, kind, torch.bfloat16, num_slots=N + 8, seed=5)
    slots = list(range(3, N + 3))
    slots[5] = slots[17] = -1
    o_ref, state_ref, conv_ref = decode_ref(case, slots, kind)
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    o = kda_decode(**case, slot_indices=slot_t, lower_bound=LOWER_BOUND if kind == "lower_bound" else None)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16
    assert rel_err(o, o_ref) <= 5e-3
    assert rel_err(case["state"], state_ref) <= 1e-4
    assert torch.equal(case["conv_state"], conv_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "kw,tol",
    [({}, 2e-2), ({"split_output": True}, 2e-2), ({"scratch_dtype": torch.float32}, 2e-2),
     ({"precision": "tf32x3", "scratch_dtype": torch.float32}, 5e-3), ({"intra": "split"}, 2e-2),
     ({"intra": "split", "precision": "tf32x3", "scratch_dtype": torch.float32}, 5e-3),
     ({"num_warps_intra": 4}, 2e-2), ({"intra": "blocks"}, 2e-2),
     ({"intra": "blocks", "sliced_out_blocks": True}, 2e-2), ({"intra": "blocks", "l_rows_blocks": False}, 2e-2),
     ({"intra": "blocks", "precision": "tf32x3", "scratch_dtype": torch.float32}, 5e-3),
     ({"intra": "blocks", "fuse_gc_blocks": True}, 2e-2), ({"intra": "blocks", "inverse_regs_blocks": True}, 2e-2),
     ({"intra": "blocks", "fuse_gc_blocks": True, "inverse_regs_blocks": True}, 2e-2),
     ({"intra": "blocks", "out_chunk_blocks": True}, 2e-2),
     ({"intra": "blocks", "l_chunk_blocks": True}, 2e-2),
     ({"intra": "blocks", "fuse_gc_blocks": True, "inverse_regs_blocks": True, "out_chunk_blocks": True,
       "l_chunk_blocks": True}, 2e-2)],
    ids=["bf16_dots", "bf16_dots_split_output", "bf16_dots_fp32_scratch", "tf32x3_fp32_scratch", "split_intra",
         "split_intra_tf32x3", "intra_w4", "blocks_intra", "blocks_intra_sliced", "blocks_intra_pairs",
         "blocks_intra_tf32x3", "blocks_intra_fused_gc", "blocks_intra_inverse_regs", "blocks_intra_fused_gc_regs",
         "blocks_intra_out_chunk",
         "blocks_intra_l_chunk", "blocks_intra_all_four"],
)
def test_gpu_chunk_kimi_shape(kw: dict, tol: float) -> None:
    lens = [2048, 1000, 64, 1]
    case = chunk_case(lens, H=32, D=128, kind="lower_bound", dtype=torch.bfloat16, num_slots=8, seed=6)
    snaps = ([[64, 1024, 2048], [1000], [], []], [[4, 5, 6], [7], [], []])
    check_chunk(case, [0, 1, 2, 3], has_init=[True, False, True, True], snaps=snaps, tol=tol, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("intra", INTRA)
def test_gpu_chunk_steep_softplus_gate(intra: str) -> None:
    """Softplus gate with steep tokens (the exact diagonal-block path) at Kimi shapes, bf16 dots."""
    case = chunk_case([700, 300], H=32, D=128, kind="softplus", dtype=torch.bfloat16, num_slots=2, seed=15)
    case["g"][5, 0, :4] = -80.0
    case["g"][70, 1:9, 3] = -300.0
    case["g"][690:692, :, 8:] = -45.0
    check_chunk(case, [1, 0], tol=2e-2, intra=intra)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "N,v_split,norm", [(1, 8, False), (1, 4, True), (16, 2, True), (64, 1, True)],
    ids=["N1_split8", "N1_split4_norm", "N16_split2_norm", "N64_split1_norm"],
)
def test_gpu_decode_split_and_norm_kimi_shape(N: int, v_split: int, norm: bool) -> None:
    """Split heads and the fused norm compiled at Kimi shapes: two steps, one shared workspace."""
    from k3rt.backend.layers.norm import rms_norm_gated

    H, D, kind = 32, 128, "lower_bound"
    case = decode_case(N, H, D, kind, torch.bfloat16, num_slots=N + 4, seed=13)
    ref = {k: v.clone() for k, v in case.items()}
    slots = list(range(2, N + 2))
    if N > 1:
        slots[N // 2] = -1
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    ws = triton_decode.kda_decode_workspace(N, H, DEV)
    gen = torch.Generator(device=DEV).manual_seed(14)
    gate = torch.randn(N, H, D, generator=gen, device=DEV).to(torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(D, generator=gen, device=DEV)
    extra = dict(o_gate=gate, o_norm_weight=weight) if norm else {}
    for step in range(2):
        o_ref, ref["state"], ref["conv_state"] = decode_ref(ref, slots, kind)
        if norm:
            o_ref = rms_norm_gated(o_ref, gate, weight, 1e-5)
            o_ref[[i for i, s in enumerate(slots) if s < 0]] = 0.0
        o = kda_decode(**case, slot_indices=slot_t, lower_bound=LOWER_BOUND, v_split=v_split, workspace=ws, **extra)
        torch.cuda.synchronize()
        assert rel_err(o, o_ref) <= 1e-2, step
        assert rel_err(case["state"], ref["state"]) <= 1e-4, step
        assert torch.equal(case["conv_state"], ref["conv_state"]), step
        assert int(ws.abs().sum()) == 0, step
        case["qkv_pre"] = ref["qkv_pre"] = torch.randn(N, 3 * H * D, generator=gen, device=DEV).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_gpu_decode_pdl_late_wait_chain(norm: bool) -> None:
    """PDL with the pinned programs' late wait (state, windows and slot loaded before it): a graph of decode steps
    over three layers' states, each step's input written by a kernel right before it (as the input projection is),
    replayed twice, matches the same chain run eagerly without PDL, bit for bit."""
    N, H, D, kind, layers = 1, 32, 128, "lower_bound", 3
    gen = torch.Generator(device=DEV).manual_seed(21)
    cases = [decode_case(N, H, D, kind, torch.bfloat16, num_slots=3, seed=30 + i) for i in range(layers)]
    slot_t = torch.tensor([1], dtype=torch.int32, device=DEV)
    ws = triton_decode.kda_decode_workspace(N, H, DEV)
    src = torch.randn(N, 3 * H * D, generator=gen, device=DEV).to(torch.bfloat16)
    extra = {}
    if norm:
        extra = dict(o_gate=torch.randn(N, H, D, generator=gen, device=DEV).to(torch.bfloat16),
                     o_norm_weight=1 + 0.1 * torch.randn(D, generator=gen, device=DEV))
    outs = [torch.empty(N, H, D, dtype=torch.bfloat16, device=DEV) for _ in range(layers)]

    def chain(use_pdl: bool) -> None:
        for i, c in enumerate(cases):
            c["qkv_pre"].copy_(src * (i + 1))  # the step's input, written just before it
            kda_decode(**c, slot_indices=slot_t, lower_bound=LOWER_BOUND, workspace=ws, out=outs[i],
                       use_pdl=use_pdl, late_wait=use_pdl, **extra)

    start = [{k: v.clone() for k, v in c.items()} for c in cases]
    for _ in range(2):
        chain(False)
    want = [o.clone() for o in outs] + [c["state"].clone() for c in cases] + [c["conv_state"].clone() for c in cases]
    for c, s in zip(cases, start):
        for k, v in s.items():
            c[k].copy_(v)
    chain(True)  # compile outside the capture, then reset
    for c, s in zip(cases, start):
        for k, v in s.items():
            c[k].copy_(v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(True)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    got = outs + [c["state"] for c in cases] + [c["conv_state"] for c in cases]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert int(ws.abs().sum()) == 0


def _device_tables(lens: list[int], snaps) -> ChunkTables:
    c_seq, c_idx, c_off, c_snap = chunk_tables(lens, *(snaps or (None, None)))
    t = [torch.from_numpy(a).to(DEV, torch.int32) for a in (c_seq, c_idx, c_off, c_snap)]
    return ChunkTables(*t, torch.ones(len(lens), dtype=torch.int32, device=DEV), len(c_seq))


@pytest.mark.parametrize("intra", INTRA)
def test_chunk_prebuilt_tables_equal_its_own(intra: str) -> None:
    """Issue 18: tables built once (the GPU runner's pack_step) and intermediates reused across calls give the
    call's own results bit for bit, also on states in a page pool's strided view, and a table of the wrong size
    is refused naming it."""
    lens, snaps = [130, 1, 64], ([[64, 130], [], [64]], [[3, 4], [], [5]])
    case = chunk_case(lens, H=2, D=16, kind="softplus", dtype=torch.float32, num_slots=6, seed=5)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    state0 = case["state"].clone()
    own = kda_chunk_fwd(**case, slot_indices=slots, snapshot_positions=snaps[0], snapshot_slots=snaps[1],
                        intra=intra)
    own_state, case["state"] = case["state"], state0.clone()
    scratch: dict = {}  # the intermediates allocated by the first call, reused (NaN-poisoned again) by the second
    shared = kda_chunk_fwd(**case, slot_indices=slots, tables=_device_tables(lens, snaps), scratch=scratch,
                           intra=intra)
    # the state pass's six buffers and the intra path's own: fused gc + akk, split akk + kg, blocks gc, akk, sq, span
    assert torch.equal(shared, own) and torch.equal(case["state"], own_state)
    assert len(scratch) == 6 + {"fused": 2, "split": 2, "blocks": 4}[intra]
    # the states as a page pool's view (slots further apart than a state): read and written in place
    pages = torch.full((6, state0[0].numel() + 24), float("nan"), device=DEV)
    case["state"] = pages[:, 8:8 + state0[0].numel()].view(state0.shape)
    case["state"].copy_(state0)
    strided = kda_chunk_fwd(**case, slot_indices=slots, tables=_device_tables(lens, snaps), scratch=scratch,
                            intra=intra)
    assert torch.equal(strided, own) and torch.equal(case["state"], own_state)
    assert pages[:, :8].isnan().all() and pages[:, 8 + state0[0].numel():].isnan().all()  # the rest untouched
    with pytest.raises(ValueError, match="tables: chunk_off"):
        kda_chunk_fwd(**case, slot_indices=slots, tables=_device_tables(lens[:2], None))
