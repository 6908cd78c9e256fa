"""Plain-torch reference ops for Kimi Delta Attention (KDA): the oracle for every KDA kernel.

What this module knows: the gate formulas, the l2norm used on q and k, the exact per-token
recurrence (model-facts §1.2) and the chunked WY/UT-transform form (§1.3), on the fla state layout
S [B, H, K, V] (key channels are rows). All math runs in fp32 whatever the input dtype; outputs are
cast back to `v.dtype` and states are always fp32.

What it does not know: projections, the short convolution, the output norm/gate, caches or paging.
It does not support GVA (value heads == qk heads, as in every Kimi model) or varlen packing; callers
loop over sequences. It favours readability and exactness over speed and memory.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# fla enforces this range for the bounded ("safe") gate, vLLM asserts the same (model-facts §1.1).
_LOWER_BOUND_MIN = -5.0
_SOFTPLUS_THRESHOLD = 20.0


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """Normalize the last dim as fla's kernels do: `x / sqrt(sum(x*x) + eps)`.

    This is not `F.normalize` (which divides by `max(norm, eps)`): the eps sits inside the sqrt,
    so small vectors shrink below unit length.

    Args:
        x: [..., D], any float dtype.
        eps: added to the sum of squares before the sqrt.

    Returns:
        [..., D] in fp32.
    """
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gate_params(f: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Check shapes and return (f [..., H, K], A [H, 1], dt_bias [H, K]), all fp32."""
    if f.dim() < 2:
        raise ValueError(f"f must be [..., H, K], got shape {tuple(f.shape)}")
    H, K = f.shape[-2:]
    # The original checkpoint stores A_log as [1, 1, H, 1] and dt_bias flat as [H*K]; accept both.
    if A_log.numel() != H:
        raise ValueError(f"A_log must hold H={H} values, got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must be [H, K]=[{H}, {K}], got shape {tuple(dt_bias.shape)}")
    A = A_log.float().reshape(H, 1).exp()  # A: [H, 1], broadcasts over K
    return f.float(), A, dt_bias.float().reshape(H, K)


def kda_gate_softplus(f: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tensor:
    """Kimi-Linear forget gate: `g = -exp(A_log[h]) * softplus(f + dt_bias)`, in log space.

    softplus(x) = x if x > 20 else log1p(exp(x)), as in the fla/vLLM kernels.

    Args:
        f: [..., H, K] raw `f_b_proj` output viewed per head.
        A_log: [H] (the checkpoint's [1, 1, H, 1] is accepted too).
        dt_bias: [H, K] (a flat [H*K] is accepted too).

    Returns:
        g: [..., H, K] fp32, g <= 0.
    """
    f, A, dt_bias = _gate_params(f, A_log, dt_bias)
    x = f + dt_bias  # x: [..., H, K]
    # Clamp inside exp so the unused branch cannot overflow to inf.
    softplus = torch.where(
        x > _SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x.clamp(max=_SOFTPLUS_THRESHOLD)))
    )
    return -A * softplus


def kda_gate_lower_bound(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """Bounded ("safe") forget gate used by K3.

    g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)).

    Args:
        f: [..., H, K] raw `f_b_proj` output viewed per head.
        A_log: [H] (the checkpoint's [1, 1, H, 1] is accepted too).
        dt_bias: [H, K] (a flat [H*K] is accepted too).
        lower_bound: the config's `gate_lower_bound`; must satisfy -5 <= lower_bound < 0.

    Returns:
        g: [..., H, K] fp32, lower_bound < g < 0.
    """
    if not (_LOWER_BOUND_MIN <= lower_bound < 0.0):
        raise ValueError(
            f"gate_lower_bound must satisfy {_LOWER_BOUND_MIN} <= gate_lower_bound < 0, "
            f"got {lower_bound}"
        )
    f, A, dt_bias = _gate_params(f, A_log, dt_bias)
    return lower_bound * torch.sigmoid(A * (f + dt_bias))


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Validate shapes, cast to fp32, normalize and scale q/k.

    Returns (q*scale, k, v, g, beta, S0), all fp32 and laid out [B, H, T, ...];
    S0 is [B, H, K, V], a fresh tensor (the caller's initial_state is never written).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    expected = {
        "k": (k, (B, T, H, K)),
        "v": (v, (B, T, H, V)),
        "g": (g, (B, T, H, K)),
        "beta": (beta, (B, T, H)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if initial_state is None:
        S0 = torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device)
    else:
        if tuple(initial_state.shape) != (B, H, K, V) or initial_state.dtype != torch.float32:
            raise ValueError(
                f"initial_state must be fp32 [B, H, K, V]={[B, H, K, V]}, "
                f"got {initial_state.dtype} {list(initial_state.shape)}"
            )
        S0 = initial_state.clone()
    if scale is None:
        scale = K**-0.5

    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    # [B, T, H, X] -> [B, H, T, X]: per (batch, head) sequences are contiguous in time.
    q, k, v, g = (t.float().transpose(1, 2) for t in (q, k, v, g))
    beta = beta.float().transpose(1, 2)  # beta: [B, H, T]
    return q, k, v, g, beta, S0


def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """Exact per-token KDA recurrence (model-facts §1.2), one token at a time.

    Per head, with q <- l2norm(q) * scale and k <- l2norm(k):
        S' = Diag(exp(g_t)) S
        S  = S' + beta_t k_t (v_t - S'^T k_t)^T
        o_t = S^T q_t                      (the output reads the updated state)

    Args:
        q: [B, T, H, K].
        k: [B, T, H, K].
        v: [B, T, H, V].
        g: [B, T, H, K] log decay (<= 0), e.g. from `kda_gate_softplus`.
        beta: [B, T, H], already through the sigmoid.
        scale: query scale; None means K**-0.5.
        initial_state: [B, H, K, V] fp32, or None for zeros. Not modified.
        use_qk_l2norm: apply `l2norm` to q and k first (as the Kimi layers do).

    Returns:
        o: [B, T, H, V] in v.dtype.
        final_state: [B, H, K, V] fp32.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    B, H, T, V = v.shape
    o = torch.empty(B, H, T, V, dtype=torch.float32, device=v.device)
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]  # q_t, k_t: [B, H, K]; v_t: [B, H, V]
        S = S * g[:, :, t].exp().unsqueeze(-1)  # decay rows (key channels) of S: [B, H, K, V]
        kv = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what S' predicts for k_t: [B, H, V]
        delta = beta[:, :, t, None] * (v_t - kv)  # [B, H, V]
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q_t, S)
    return o.transpose(1, 2).to(out_dtype), S


def _check_state_positions(state_positions: Sequence[int], T: int, chunk_size: int) -> list[int]:
    positions = []
    for p in state_positions:
        try:
            p = operator.index(p)
        except TypeError:
            raise ValueError(f"state_positions must hold ints, got {p!r}") from None
        if not (0 < p <= T) or (p % chunk_size != 0 and p != T):
            raise ValueError(
                f"state_positions entries must satisfy 0 < p <= T={T} and be a multiple of "
                f"chunk_size={chunk_size} or equal T; got {p}"
            )
        positions.append(p)
    return positions


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    state_positions: Sequence[int] = (),
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """KDA in the chunked WY/UT-transform form (model-facts §1.3); equal to `kda_recurrent`.

    Within a chunk of C tokens (local index i), with Gc_i = cumsum(g)_i and
    E(i, j) = exp(Gc_i - Gc_j) elementwise over K:
        L[i, j]   = beta_i * sum_d k_i[d] E(i, j)[d] k_j[d]      (j < i, else 0)
        W         = (I + L)^-1 Diag(beta) (exp(Gc) * K_c)        [C, K]
        U         = (I + L)^-1 Diag(beta) V_c                    [C, V]
        Aqk[i, j] = sum_d q_i[d] E(i, j)[d] k_j[d]               (j <= i, else 0)
    and per chunk, from the incoming state S:
        Vnew   = U - W S
        O_c    = (exp(Gc) * Q_c) S + Aqk Vnew
        S_next = Diag(exp(Gc_last)) S + (exp(Gc_last - Gc) * K_c)^T Vnew
    E is built from masked differences, never as exp(Gc_i) * exp(-Gc_j), so it cannot overflow.

    T need not be a multiple of C: the tail chunk is padded with zero q/k/v, zero g (no decay)
    and zero beta (no update), so the final state is exact.

    Args:
        q: [B, T, H, K].
        k: [B, T, H, K].
        v: [B, T, H, V].
        g: [B, T, H, K] log decay (<= 0).
        beta: [B, T, H], already through the sigmoid.
        scale: query scale; None means K**-0.5.
        initial_state: [B, H, K, V] fp32, or None for zeros. Not modified.
        use_qk_l2norm: apply `l2norm` to q and k first.
        chunk_size: C, tokens per chunk (fla uses 64 or 32).
        state_positions: token counts p (0 < p <= T; each a multiple of chunk_size, or T) at which
            to also return the state after exactly p tokens, e.g. for prefix-cache snapshots.

    Returns:
        o: [B, T, H, V] in v.dtype.
        final_state: [B, H, K, V] fp32.
        states: one [B, H, K, V] fp32 tensor per entry of state_positions, in that order.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    B, H, T, V = v.shape
    positions = _check_state_positions(state_positions, T, chunk_size)
    C = chunk_size
    num_chunks = math.ceil(T / C)
    pad = num_chunks * C - T
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))

    strictly_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # [C, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [C, C], diagonal included
    eye = torch.eye(C, dtype=torch.float32, device=q.device)

    o = torch.empty(B, H, num_chunks * C, V, dtype=torch.float32, device=q.device)
    states_at: dict[int, Tensor] = {}  # chunk end (tokens) -> state after it
    for n in range(num_chunks):
        span = slice(n * C, (n + 1) * C)
        q_c, k_c, v_c = q[:, :, span], k[:, :, span], v[:, :, span]  # [B, H, C, K|V]
        g_c, b_c = g[:, :, span], beta[:, :, span]  # g_c: [B, H, C, K], b_c: [B, H, C]
        Gc = g_c.cumsum(dim=2)  # Gc: [B, H, C, K]
        # E[i, j] = exp(Gc_i - Gc_j) for j <= i, 0 above the diagonal: [B, H, C, C, K]
        diff = Gc.unsqueeze(3) - Gc.unsqueeze(2)
        E = torch.where(lower[:, :, None], diff, float("-inf")).exp()

        L = torch.einsum("bhik,bhijk,bhjk->bhij", k_c, E, k_c) * b_c.unsqueeze(-1)
        L = L.masked_fill(~strictly_lower, 0.0)  # L: [B, H, C, C]
        Aqk = torch.einsum("bhik,bhijk,bhjk->bhij", q_c, E, k_c)  # Aqk: [B, H, C, C], lower by E

        # (I + L) is unit lower triangular: solve for W and U by substitution, no explicit inverse.
        rhs = torch.cat([b_c.unsqueeze(-1) * Gc.exp() * k_c, b_c.unsqueeze(-1) * v_c], dim=-1)
        WU = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
        W, U = WU.split([k_c.shape[-1], V], dim=-1)  # W: [B, H, C, K], U: [B, H, C, V]

        v_new = U - W @ S  # [B, H, C, V]
        o[:, :, span] = (q_c * Gc.exp()) @ S + Aqk @ v_new
        G_last = Gc[:, :, -1]  # [B, H, K]
        k_decayed = k_c * (G_last.unsqueeze(2) - Gc).exp()  # [B, H, C, K]
        S = S * G_last.exp().unsqueeze(-1) + k_decayed.transpose(-1, -2) @ v_new
        states_at[min((n + 1) * C, T)] = S

    states = [states_at[p].clone() for p in positions]
    return o[:, :, :T].transpose(1, 2).to(out_dtype), S, states
