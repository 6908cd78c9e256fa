"""Plain-torch reference for the depthwise causal short convolution in front of KDA's q/k/v.

What this module knows: the conv math and the vLLM/SGLang-style cache of the previous W-1
*pre-conv* inputs per channel, laid out [B, W-1, C] oldest first (fla instead keeps W entries;
model-facts §2.2). It does not know about cache slots, paging, varlen packing or bias (Kimi's
convs have none). It is the oracle for the short-conv kernels, so it favours clarity over speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time, continuing from `conv_state`.

    y_t[c] = sum_{i=0..W-1} weight[c, i] * xs_{t+i}[c], where xs = concat(conv_state, x) along
    time, so weight[:, W-1] multiplies the current token. Prefill (T > 1), decode (T == 1) and
    pieces shorter than W-1 all go through the same path.

    Args:
        x: [B, T, C] pre-conv inputs.
        weight: [C, W] per-channel taps (the checkpoint's [C, 1, W] squeezed).
        conv_state: [B, W-1, C], the previous W-1 inputs, oldest first; zeros (or None) start a
            fresh sequence. Not modified.
        activation: "silu" or None.

    Returns:
        y: [B, T, C] in x.dtype.
        new_state: [B, W-1, C], the last W-1 rows of concat(conv_state, x), in conv_state's dtype
            (x.dtype when conv_state is None).
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C={C}, W], got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state is None:
        state_dtype = x.dtype
        conv_state = torch.zeros(B, W - 1, C, dtype=torch.float32, device=x.device)
    else:
        state_dtype = conv_state.dtype
        if tuple(conv_state.shape) != (B, W - 1, C):
            raise ValueError(
                f"conv_state must be [B, W-1, C]={[B, W - 1, C]}, got {list(conv_state.shape)}"
            )

    xs = torch.cat([conv_state.float(), x.float()], dim=1)  # xs: [B, W-1+T, C]
    windows = xs.unfold(1, W, 1)  # windows: [B, T, C, W], windows[b, t, c, i] = xs[b, t+i, c]
    y = (windows * weight.float()).sum(dim=-1)  # y: [B, T, C]
    if activation == "silu":
        y = F.silu(y)
    new_state = xs[:, xs.shape[1] - (W - 1) :]  # new_state: [B, W-1, C]
    return y.to(x.dtype), new_state.to(state_dtype).clone()


def _ext(x: Tensor, conv_state: Tensor, slots: Tensor) -> Tensor:
    """[old windows of `slots` (B*(W-1) rows, oldest first per slot) ; x]: the rows the index tables name."""
    old = conv_state[slots]  # old: [B, W-1, C]
    return torch.cat([old.reshape(-1, old.shape[-1]).to(x.dtype), x])


def causal_conv1d_rows(x: Tensor, conv_state: Tensor, slots: Tensor, idx: Tensor, weight: Tensor) -> Tensor:
    """The conv of a packed varlen step whose windows are given as row indices (the GPU runner's general KDA
    form: backend/runner/gpu/step.py conv_idx).

    Args:
        x: [T, C] the step's pre-conv rows.
        conv_state: [S, W-1, C] cached windows; slots: [B] the step's sequences' slots in it.
        idx: [T, W] rows of ext = [conv_state[slots] as B*(W-1) rows (cast to x.dtype) ; x] forming each
            row's window, oldest first.
        weight: [C, W] fp32 taps.

    Returns:
        silu(sum_i weight[:, i] * ext[idx[:, i]]) [T, C] in x.dtype (fp32 sum, taps in order).
    """
    ext = _ext(x, conv_state, slots)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for tap in range(weight.shape[1]):  # one [T, C] gather per tap keeps the working set at 2 rows of the step
        y.addcmul_(ext[idx[:, tap]].float(), weight[:, tap])
    return F.silu(y).to(x.dtype)


def conv_windows_store(x: Tensor, conv_state: Tensor, slots: Tensor, idx: Tensor, dest: Tensor) -> None:
    """conv_state[dest[m]] = ext[idx[m]] (ext as in `causal_conv1d_rows`, read before anything is written):
    each sequence's new window, or a snapshot's window, from the old windows and the step's rows.

    Args:
        idx: [M, W-1] rows of ext; dest: [M] slots of conv_state to write (in conv_state's dtype).
    """
    conv_state[dest] = _ext(x, conv_state, slots)[idx].to(conv_state.dtype)
