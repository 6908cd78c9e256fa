"""The KDA reference ops agree with each other, with an independent fp64 loop, and with HF."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from k3rt.kernels.kda import (
    kda_chunked,
    kda_gate_lower_bound,
    kda_gate_softplus,
    kda_recurrent,
    l2norm,
)

B, H, K, V = 2, 2, 16, 16
LOWER_BOUND = -5.0


def _gate_params(gen: torch.Generator, gate: str) -> tuple[Tensor, Tensor]:
    """(A_log [H], dt_bias [H, K]) drawn like fla's init, so decays range from mild to strong."""
    if gate == "softplus":
        A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    else:
        A_log = torch.zeros(H)  # fla's safe-gate init
    dt = torch.exp(torch.empty(H, K).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    return A_log, dt_bias


def _inputs(
    T: int, gate: str = "softplus", seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K], beta [B,T,H], h0 [B,H,K,V] fp32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    f = torch.randn(B, T, H, K, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen)
    A_log, dt_bias = _gate_params(gen, gate)
    if gate == "softplus":
        g = kda_gate_softplus(f, A_log, dt_bias)
    else:
        g = kda_gate_lower_bound(f, A_log, dt_bias, LOWER_BOUND)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    return q, k, v, g, beta, h0


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("chunk_size", [64, 32], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["h0_none", "h0"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200], ids=lambda t: f"T{t}")
def test_recurrent_matches_chunked(T: int, with_h0: bool, gate: str, chunk_size: int) -> None:
    q, k, v, g, beta, h0 = _inputs(T, gate)
    h0 = h0 if with_h0 else None
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o_c, s_c, states = kda_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)
    assert o_r.shape == o_c.shape == (B, T, H, V)
    assert s_r.shape == s_c.shape == (B, H, K, V)
    assert s_r.dtype == s_c.dtype == torch.float32
    assert states == []
    assert _max_diff(o_r, o_c) <= 1e-5
    assert _max_diff(s_r, s_c) <= 1e-5


def _literal_loop_fp64(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor
) -> tuple[Tensor, Tensor]:
    """model-facts §1.2 written out per batch, head and token with explicit matrices, in fp64."""
    q, k, v, g, beta, S0 = (t.double() for t in (q, k, v, g, beta, h0))
    Bn, T, Hn, Kn = q.shape
    o = torch.zeros(Bn, T, Hn, v.shape[-1], dtype=torch.float64)
    S_final = torch.zeros_like(S0)
    for b in range(Bn):
        for h in range(Hn):
            S = S0[b, h].clone()  # [K, V]
            for t in range(T):
                q_t = q[b, t, h] / torch.sqrt(q[b, t, h].pow(2).sum() + 1e-6) * Kn**-0.5
                k_t = k[b, t, h] / torch.sqrt(k[b, t, h].pow(2).sum() + 1e-6)
                S = torch.diag(torch.exp(g[b, t, h])) @ S
                S = S + beta[b, t, h] * torch.outer(k_t, v[b, t, h] - S.T @ k_t)
                o[b, t, h] = S.T @ q_t
            S_final[b, h] = S
    return o, S_final


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("T", [5, 70], ids=lambda t: f"T{t}")
def test_against_independent_fp64_loop(T: int, gate: str) -> None:
    q, k, v, g, beta, h0 = _inputs(T, gate, seed=1)
    o_ref, s_ref = _literal_loop_fp64(q, k, v, g, beta, h0)
    # fp64 inputs (exactly the fp32 values): the ops compute in fp32 and return v.dtype.
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o_c, s_c, _ = kda_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=32)
    assert o_r.dtype == o_c.dtype == torch.float64
    for o, s in ((o_r, s_r), (o_c, s_c)):
        assert _max_diff(o, o_ref) <= 1e-5
        assert _max_diff(s, s_ref) <= 1e-5


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("split", [1, 37, 64, 129], ids=lambda t: f"split{t}")
def test_split_with_state_carry_equals_whole(split: int, form: str) -> None:
    T = 130
    q, k, v, g, beta, h0 = _inputs(T, seed=2)

    def run(sl: slice, state: Tensor) -> tuple[Tensor, Tensor]:
        args = (q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl])
        if form == "recurrent":
            return kda_recurrent(*args, initial_state=state)
        o, s, _ = kda_chunked(*args, initial_state=state, chunk_size=32)
        return o, s

    o_whole, s_whole = run(slice(None), h0)
    o_1, s_1 = run(slice(0, split), h0)
    o_2, s_2 = run(slice(split, None), s_1)
    assert _max_diff(torch.cat([o_1, o_2], dim=1), o_whole) <= 1e-6
    assert _max_diff(s_2, s_whole) <= 1e-6


@pytest.mark.parametrize(
    "T, chunk_size, positions",
    [(130, 32, [32, 64, 128, 130]), (130, 64, [130, 64]), (128, 64, [128]), (7, 64, [7, 7])],
    ids=["T130_C32_all", "T130_C64_unordered", "T128_C64_end", "T7_C64_repeat"],
)
def test_state_positions_are_prefix_states(T: int, chunk_size: int, positions: list[int]) -> None:
    q, k, v, g, beta, h0 = _inputs(T, seed=3)
    _, final, states = kda_chunked(
        q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size, state_positions=positions
    )
    assert len(states) == len(positions)
    for p, s in zip(positions, states):
        prefix = (q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p])
        _, s_prefix = kda_recurrent(*prefix, initial_state=h0)
        assert s.dtype == torch.float32 and s.shape == (B, H, K, V)
        assert _max_diff(s, s_prefix) <= 1e-5
    # Snapshots are independent tensors: writing one cannot corrupt the final state.
    states[-1].zero_()
    assert final.abs().sum() > 0


@pytest.mark.parametrize("bad", [0, -64, 65, 96, 200, 1.5], ids=lambda p: f"p{p}")
def test_state_positions_rejects_invalid(bad: float) -> None:
    q, k, v, g, beta, _ = _inputs(130)
    with pytest.raises(ValueError, match="state_positions"):
        kda_chunked(q, k, v, g, beta, chunk_size=64, state_positions=[64, bad])


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_empty_sequence_returns_initial_state(form: str) -> None:
    q, k, v, g, beta, h0 = _inputs(0)
    if form == "recurrent":
        o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    else:
        o, s, _ = kda_chunked(q, k, v, g, beta, initial_state=h0)
    assert o.shape == (B, 0, H, V)
    assert torch.equal(s, h0) and s is not h0


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_bf16_inputs_compute_in_fp32(form: str) -> None:
    q, k, v, g, beta, h0 = _inputs(40, dtype=torch.bfloat16)
    h0_before = h0.clone()

    def run(*args: Tensor) -> tuple[Tensor, Tensor]:
        if form == "recurrent":
            return kda_recurrent(*args, initial_state=h0)
        o, s, _ = kda_chunked(*args, initial_state=h0, chunk_size=32)
        return o, s

    o16, s16 = run(q, k, v, g, beta)
    o32, s32 = run(*(t.float() for t in (q, k, v, g, beta)))
    assert o16.dtype == torch.bfloat16 and s16.dtype == torch.float32
    assert torch.equal(o16, o32.to(torch.bfloat16))
    assert torch.equal(s16, s32)
    assert torch.equal(h0, h0_before)


def test_scale_and_no_l2norm_options() -> None:
    q, k, v, g, beta, h0 = _inputs(50, seed=4)
    k = F.normalize(k, dim=-1)  # keep the delta rule stable without the in-op l2norm
    kwargs = dict(scale=0.3, initial_state=h0, use_qk_l2norm=False)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, **kwargs)
    o_c, s_c, _ = kda_chunked(q, k, v, g, beta, chunk_size=16, **kwargs)
    assert _max_diff(o_r, o_c) <= 1e-5 and _max_diff(s_r, s_c) <= 1e-5
    # The output is linear in q, so scale only scales it.
    o_1, _ = kda_recurrent(q, k, v, g, beta, scale=1.0, initial_state=h0, use_qk_l2norm=False)
    assert _max_diff(o_r, 0.3 * o_1) <= 1e-5


def test_rejects_bad_shapes_and_state_dtype() -> None:
    q, k, v, g, beta, h0 = _inputs(8)
    with pytest.raises(ValueError, match="beta"):
        kda_recurrent(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunked(q, k, v, g, beta, initial_state=h0.to(torch.bfloat16))


def test_matches_transformers_recurrent() -> None:
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    q, k, v, g, beta, h0 = _inputs(70, seed=5)
    o_hf, s_hf = recurrent_kimi_delta_attention(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    assert _max_diff(o, o_hf) <= 1e-6
    assert _max_diff(s, s_hf) <= 1e-6


def test_gate_softplus_matches_independent_expression() -> None:
    gen = torch.Generator().manual_seed(6)
    f = torch.randn(3, 5, H, K, generator=gen) * 10  # reaches both softplus branches
    f[0, 0] = 100.0  # far past the threshold: must stay finite and linear
    A_log, dt_bias = _gate_params(gen, "softplus")
    g = kda_gate_softplus(f, A_log, dt_bias)
    expected = -A_log.exp()[:, None] * F.softplus(f + dt_bias, beta=1.0, threshold=20.0)
    assert g.dtype == torch.float32 and g.shape == f.shape
    assert torch.isfinite(g).all() and (g <= 0).all()
    assert _max_diff(g, expected) <= 1e-5
    # The checkpoint layouts A_log [1, 1, H, 1] and dt_bias [H*K] give the same gate.
    assert torch.equal(kda_gate_softplus(f, A_log.view(1, 1, H, 1), dt_bias.flatten()), g)


def test_gate_lower_bound_matches_independent_expression() -> None:
    gen = torch.Generator().manual_seed(7)
    f = torch.randn(3, 5, H, K, generator=gen) * 4
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, K, generator=gen)
    g = kda_gate_lower_bound(f.to(torch.bfloat16), A_log, dt_bias, -2.5)
    fb = f.to(torch.bfloat16).float()
    expected = -2.5 / (1 + torch.exp(-A_log.exp()[:, None] * (fb + dt_bias)))
    assert g.dtype == torch.float32
    assert _max_diff(g, expected) <= 1e-6
    # (lb, 0) in exact math; fp32 sigmoid saturates to the closed ends for large |f|.
    assert ((g >= -2.5) & (g <= 0)).all()


@pytest.mark.parametrize("lower_bound", [-5.5, 0.0, 0.5], ids=lambda b: f"lb{b}")
def test_gate_lower_bound_rejects_out_of_range(lower_bound: float) -> None:
    f = torch.zeros(1, H, K)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        kda_gate_lower_bound(f, torch.zeros(H), torch.zeros(H, K), lower_bound)


def test_gate_lower_bound_accepts_minus_five() -> None:
    g = kda_gate_lower_bound(torch.zeros(1, H, K), torch.zeros(H), torch.zeros(H, K), -5.0)
    assert torch.allclose(g, torch.full_like(g, -2.5))


def test_l2norm_eps_inside_sqrt() -> None:
    assert torch.equal(l2norm(torch.zeros(4, K)), torch.zeros(4, K))
    # sum(x^2) = 1e-6 = eps: ours gives 1e-3 / sqrt(2e-6); F.normalize would give exactly 1.
    x = torch.zeros(K, dtype=torch.float64)
    x[0] = 1e-3
    y = l2norm(x)
    assert y.dtype == torch.float32
    assert abs(y[0].item() - 1 / math.sqrt(2)) <= 1e-6
    assert F.normalize(x, dim=-1)[0].item() == 1.0
    # A typical vector is unit length to fp32 precision, and bf16 input is normalized in fp32.
    z = torch.randn(8, K, dtype=torch.bfloat16)
    expected = z.double() / torch.sqrt(z.double().pow(2).sum(-1, keepdim=True) + 1e-6)
    assert _max_diff(l2norm(z), expected) <= 1e-6
