"""`kda_decode_multi`: the first n_i of R tokens per sequence in one launch equals n_i successive
`kda_decode` calls (bit for bit: the per-token op order is the decode kernel's) and the torch oracle;
commit=False leaves the live slots untouched, commit=True leaves them as the calls would.

CPU cases run under the Triton interpreter at tiny fp32 shapes.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from k3rt.backend.layers.norm import rms_norm_gated  # noqa: E402
from k3rt.kernels.kda.triton_decode import kda_decode, kda_decode_workspace  # noqa: E402
from k3rt.kernels.kda.triton_multi import kda_decode_multi  # noqa: E402
from tests.kernels.helpers import DEV, rel_err  # noqa: E402
from tests.kernels.test_kda_triton import LOWER_BOUND  # noqa: E402
from tests.kernels.test_kda_verify import ref_steps, verify_case  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # NaN-filled outputs: conftest.py


def decode_loop(case: dict, slots: list[int], ns: list[int], R: int, lb: float | None, v_split: int,
                norm: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [N, R, H, D], state, conv_state): ns[i] kda_decode calls on sequence i's slot of a copy."""
    state, conv = case["state"].clone(), case["conv_state"].clone()
    N, H, D = len(slots), state.shape[1], state.shape[2]
    o = torch.zeros(N, R, H, D, device=DEV)
    for t in range(R):
        live = [s if n > t else -1 for s, n in zip(slots, ns)]
        kw = {} if norm is None else dict(o_gate=norm[0][:, t], o_norm_weight=norm[1], o_norm_eps=norm[2])
        o[:, t] = kda_decode(case["qkv_pre"][:, t], case["conv_weight"], conv, case["f"][:, t], case["A_log"],
                             case["dt_bias"], case["b"][:, t], state, torch.tensor(live, device=DEV),
                             lower_bound=lb, v_split=v_split, **kw)
    return o, state, conv


@pytest.mark.parametrize(
    "R,v_split,kind,ns,norm",
    [(1, 1, "softplus", [1, 0, 1], False), (4, 2, "lower_bound", [0, 1, 4], False),
     (5, 4, "softplus", [5, 3, 2], True), (3, 1, "lower_bound", [3, 3, 1], True)],
    ids=["R1_split1", "R4_split2_0_1_R", "R5_split4_norm", "R3_split1_norm"],
)
@pytest.mark.parametrize("commit", [False, True], ids=["verify", "commit"])
@pytest.mark.parametrize("hoist", [False, True], ids=["loop", "hoist"])
def test_multi_equals_decode_calls(R: int, v_split: int, kind: str, ns: list[int], norm: bool, commit: bool,
                                   hoist: bool) -> None:
    N, H, D, eps = 4, 2, 32, 1e-5
    case = verify_case(N, R, H, D, kind, torch.float32, num_slots=6, seed=R + 7 * v_split)
    slots = [4, 0, 2, -1]
    ns = ns + [R]  # the padding sequence (slot -1) is asked for R tokens: it runs none
    lb = LOWER_BOUND if kind == "lower_bound" else None
    nrm = None
    if norm:
        gen = torch.Generator().manual_seed(R)
        gate = torch.randn(N * R, 2 * H * D, generator=gen).to(DEV)[:, H * D:].view(N, R, H, D)  # strided rows
        nrm = (gate, (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV), eps)
    o_loop, s_loop, c_loop = decode_loop(case, slots, ns, R, lb, v_split, nrm)
    state0, conv0 = case["state"].clone(), case["conv_state"].clone()
    ws = kda_decode_workspace(N, H, DEV)
    o = kda_decode_multi(**case, slot_indices=torch.tensor(slots, device=DEV),
                         num_tokens=torch.tensor(ns, dtype=torch.int32, device=DEV), commit=commit,
                         lower_bound=lb, v_split=v_split, workspace=ws, hoist=hoist,
                         **({} if nrm is None else dict(o_gate=nrm[0], o_norm_weight=nrm[1], o_norm_eps=eps)))
    assert torch.equal(ws, torch.zeros_like(ws))
    # the interpreter: the same bits. Compiled, the two kernels' multiply-adds contract differently: about one fp32
    # ulp apart (the H200, 2026-12-04: at most 4.8e-7 on outputs up to 3.4, and 6 of these 8 cases differed before
    # the multi kernel loaded its constants once)
    same = torch.equal if DEV == "cpu" else (lambda a, b: bool(((a - b).abs() <= 1e-6 * b.abs().max().clamp(min=1))
                                                                  .all()))
    assert same(o, o_loop)  # rows past n (and the padding sequence's) are zero in both
    if commit:
        assert same(case["state"], s_loop) and torch.equal(case["conv_state"], c_loop)
    else:
        assert torch.equal(case["state"], state0) and torch.equal(case["conv_state"], conv0)
    # and the torch oracle: ref_steps runs all R tokens per live slot
    o_ref, s_ref, c_ref = ref_steps(case | {"state": state0, "conv_state": conv0}, slots, kind, R)
    for i, (s, n) in enumerate(zip(slots, ns)):
        for t in range(n if s >= 0 else 0):
            want = o_ref[t][i] if nrm is None else rms_norm_gated(o_ref[t][i:i + 1], nrm[0][i:i + 1, t], nrm[1],
                                                                  eps)[0]
            assert rel_err(o[i, t], want) <= 1e-4, (i, t)
        if commit and s >= 0 and n > 0:
            assert rel_err(case["state"][s], s_ref[n - 1][s]) <= 1e-4 and torch.equal(case["conv_state"][s],
                                                                                      c_ref[n - 1][s])


def test_multi_rejects_bad_inputs() -> None:
    N, H, D, R = 2, 2, 16, 2
    case = verify_case(N, R, H, D, "softplus", torch.float32, num_slots=3, seed=41)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    n = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="num_tokens"):
        kda_decode_multi(**case, slot_indices=slots, num_tokens=n.float(), commit=True)
    with pytest.raises(ValueError, match="R \\(tokens"):
        kda_decode_multi(**{**case, "qkv_pre": torch.randn(N, 17, 3 * H * D, device=DEV)}, slot_indices=slots,
                         num_tokens=n, commit=False)
    with pytest.raises(ValueError, match="v_split"):
        kda_decode_multi(**case, slot_indices=slots, num_tokens=n, commit=False, v_split=3)
    from k3rt.backend.runner.gpu.ops import KernelConfig

    with pytest.raises(ValueError, match="kda_verify_launch"):
        KernelConfig(kda_verify_launch="mutli")


_BUILD = r'''
import inspect
import itertools
from k3rt.kernels.kda.triton_multi import _kda_multi_kernel as fn
names = list(inspect.signature(fn.fn).parameters)
act = {"qkv_ptr", "f_ptr", "b_ptr", "o_ptr", "gate_ptr", "conv_state_ptr", "norm_w_ptr"}
out = {}
for (commit, norm, nv), hoist in itertools.product(((False, True, 4), (True, False, 4), (True, False, 1)),
                                                   (False, True)):
    # the launcher's tile: 32 value columns (D = 128 split 4; one program per head at D = 32)
    consts = dict(R=8, RP=8, H=32, D=32 * nv, BK=32 * nv, BV=32, NV=nv, W=4, WP=4, USE_LOWER_BOUND=True,
                  NORM=norm, COMMIT=commit, HOIST=hoist, USE_PDL=False)
    sig = {n: "constexpr" if n in consts else "i64" if n.startswith("stride")
           else "fp32" if n in ("scale", "lower_bound", "eps")
           else "*i32" if n in ("slot_ptr", "n_ptr", "count_ptr") else "*bf16" if n in act else "*fp32"
           for n in names}
    out[f"{commit},{norm},{nv},{hoist}"] = sm90_build(fn, sig, consts, 4, 1, lambda k: False)
print(json.dumps(out))
'''


def test_multi_builds_for_sm90_without_spills() -> None:
    """The compiled kernel (no GPU here: built for sm_90 by the wheel's compiler), R = 8, H = 32, for the
    verify pass (norm, D = 128 split 4), the split commit and the one-program commit (D = 32), the token loop's
    form and the hoisted one (every token's [R, D] tiles held too): the state tile stays in registers across the
    tokens (no local memory)."""
    from tests.kernels.helpers import run_sm90_build

    for key, b in run_sm90_build(_BUILD, timeout=240).items():
        assert b["local"] == 0, (key, b)


def test_benchmark_smoke(tmp_path) -> None:
    """benchmarks/kda_multi.py --smoke: the hoisted form against the token loop (pass and commit) on the CPU
    interpreter, every check passing (the timing runs on the GPU only)."""
    from tests.kernels.helpers import run_benchmark_smoke

    result = run_benchmark_smoke("kda_multi.py", tmp_path / "kda_multi.json")
    assert result["mode"] == "smoke" and result["rows"] == []
    assert len(result["checks"]) == 4 and all(c["ok"] for c in result["checks"]), result["checks"]
