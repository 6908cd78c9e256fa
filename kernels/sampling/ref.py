"""Plain-torch oracle for GPU batch sampling, on the tensor contract of the Triton sampler.

The semantics are backend/sampling's (sampler.py, penalties.py, bitmask.py), restated over per-row
tensors instead of SamplingParams and id lists, so that a runner can keep every input on the device:

  1. grammar bitmask: a token whose bit is clear -> -inf
  2. penalties over the row's token history: repetition (HF) where prompt_mask or output_counts > 0,
     then frequency * count and presence * (count > 0) over output tokens (OpenAI)
  3. temperature (0 means greedy and divides by 1)             -> the "processed" logits x
  4. filters: top-k, then min-p, then top-p                    -> a per-row threshold on x
  5. greedy rows (temperature 0 or top_k 1): argmax x (ties: lowest index);
     others draw from softmax(x) restricted to the kept tokens.
Logprobs are log_softmax(x): after stages 1-3, before the filters (backend/sampling/sampler.py).

One deliberate difference: the kept set is {x >= threshold}, so tokens tied with the last token of
the top-p nucleus are all kept; backend's sort-based top-p keeps an arbitrary subset of such ties.
Rows whose values have no exact ties at the cut behave identically.

The draw is the exponential race argmax(x - log E) over kept tokens, E ~ Exp(1) from counter-based
philox noise (`exponential_noise`), so one seed and offset give one token whatever the batch.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

NEG_INF = float("-inf")


def unpack_bitmask(allowed_mask: Tensor, vocab_size: int) -> Tensor:
    """[B, ceil(V/32)] int32 -> [B, V] bool, bit t % 32 of word t // 32 (LSB first)."""
    shifts = torch.arange(32, dtype=torch.int32, device=allowed_mask.device)
    bits = (allowed_mask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(allowed_mask.shape[0], -1)[:, :vocab_size].bool()


def process_logits(
    logits: Tensor,
    temperature: Tensor,
    *,
    allowed_mask: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    penalty_rows: Tensor | None = None,
) -> Tensor:
    """Stages 1-3: logits [B, V] fp32 -> processed logits x [B, V] fp32.

    Args:
        temperature: [B] fp32; 0 = greedy (x is not scaled).
        allowed_mask: optional [B, ceil(V/32)] int32 grammar bitmask (bit set = allowed).
        repetition_penalty, frequency_penalty, presence_penalty: [B] fp32 (1, 0, 0 = off); given
            together with prompt_mask [S, V] bool (token in the prompt) and output_counts [S, V]
            int32 (occurrences in the output so far), S >= B rows of persistent per-request state.
        penalty_rows: optional [B] int row of prompt_mask / output_counts for each batch row
            (None: row i uses state row i).
    """
    x = logits.float()
    if allowed_mask is not None:
        x = x.masked_fill(~unpack_bitmask(allowed_mask, x.shape[1]), NEG_INF)
    if output_counts is not None:
        rows = torch.arange(x.shape[0], device=x.device) if penalty_rows is None else penalty_rows.long()
        counts = output_counts[rows].float()  # [B, V]
        seen = prompt_mask[rows] | (counts > 0)
        rep = repetition_penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - frequency_penalty[:, None] * counts - presence_penalty[:, None] * (counts > 0)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return x / t[:, None]


def filter_logits(x: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Stage 4, one row at a time: x [B, V] -> x with filtered tokens at -inf.

    top_k [B] int (0 or >= V = off; ties with the k-th value kept); min_p [B] (drop p < min_p * p_max);
    top_p [B] (drop a token when the mass of strictly larger tokens already reaches top_p; 1 = off).
    """
    out = x.clone()
    V = x.shape[1]
    for b in range(x.shape[0]):
        row = x[b]
        k = int(top_k[b])
        if 0 < k < V:
            row = row.masked_fill(row < torch.topk(row, k).values[-1], NEG_INF)
        probs = torch.softmax(row, -1)
        row = row.masked_fill(probs < min_p[b] * probs.max(), NEG_INF)
        if float(top_p[b]) < 1.0:
            probs = torch.softmax(row, -1)
            vals, order = torch.sort(row, descending=True)
            mass_before = probs[order].cumsum(-1) - probs[order]
            dropped = mass_before >= top_p[b]
            if bool(dropped.any()):
                # position 0 is never dropped (top_p > 0); keep everything tied with the last kept value
                last_kept = vals[int(dropped.nonzero()[0]) - 1]
                row = row.masked_fill(row < last_kept, NEG_INF)
        out[b] = row
    return out


def is_greedy(temperature: Tensor, top_k: Tensor) -> Tensor:
    """[B] bool: SamplingParams.greedy (temperature 0 or top_k 1)."""
    return (temperature == 0) | (top_k == 1)


def sampling_probs(x: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """[B, V] probability of each token being returned: one-hot argmax for greedy rows."""
    probs = torch.softmax(filter_logits(x, top_k, top_p, min_p), -1)
    onehot = torch.nn.functional.one_hot(x.argmax(-1), x.shape[1]).to(probs.dtype)
    return torch.where(is_greedy(temperature, top_k)[:, None], onehot, probs)


def logprobs(x: Tensor, token_ids: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor]:
    """(chosen [B], top values [B, n], top ids [B, n]) of log_softmax(x), most likely first."""
    lp = x.log_softmax(-1)
    values, ids = lp.topk(num_top, -1)
    return lp.gather(1, token_ids[:, None]).squeeze(1), values, ids


_PHILOX_ROUND_A, _PHILOX_ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PHILOX_KEY_A, _PHILOX_KEY_B = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(seed: np.ndarray, c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray) -> np.ndarray:
    """Philox4x32-10 (Salmon et al. 2011), first output word; uint64 arrays holding 32-bit values.

    Key = (seed lo, seed hi), counter = (c0, c1, c2, c3), the word order tl.philox uses.
    """
    seed = seed.astype(np.uint64)
    k0, k1 = seed & _MASK32, seed >> np.uint64(32)
    c0, c1, c2, c3 = (np.broadcast_to(c, np.broadcast(c0, c1, c2, c3, k0).shape).astype(np.uint64)
                      for c in (c0, c1, c2, c3))
    for _ in range(10):
        p0, p2 = _PHILOX_ROUND_B * c2, _PHILOX_ROUND_A * c0  # full 64-bit products of 32-bit words
        c0, c2, c1, c3 = ((p0 >> np.uint64(32)) ^ c1 ^ k0, (p2 >> np.uint64(32)) ^ c3 ^ k1,
                          p0 & _MASK32, p2 & _MASK32)
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return c0


def exponential_noise(seeds: Tensor, offsets: Tensor, vocab_size: int) -> Tensor:
    """[B, V] fp32 E ~ Exp(1): token v of row b uses philox(seeds[b], (v, offset lo, offset hi, 0))."""
    seed = seeds.cpu().numpy().astype(np.uint64)[:, None]
    off = offsets.cpu().numpy().astype(np.uint64)[:, None]
    v = np.arange(vocab_size, dtype=np.uint64)[None, :]
    r = philox4x32(seed, v, off & _MASK32, off >> np.uint64(32), np.zeros_like(v))
    # w uniform in (0, 1) at full fp32 resolution near 0; -log1p(-w) written with plain logs
    w = (r.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-32)
    a = np.float32(1.0) - w
    with np.errstate(divide="ignore"):
        e = np.where(a == 1, w, -np.log(a) * (w / (np.float32(1.0) - a)))
    return torch.from_numpy(e.astype(np.float32)).to(seeds.device)


def draw(x: Tensor, kept: Tensor, temperature: Tensor, top_k: Tensor, seeds: Tensor, offsets: Tensor) -> Tensor:
    """[B] int64 tokens: argmax x for greedy rows, else argmax over kept tokens of x - log E."""
    score = torch.where(kept, x - exponential_noise(seeds, offsets, x.shape[1]).log(), NEG_INF)
    return torch.where(is_greedy(temperature, top_k), x.argmax(-1), score.argmax(-1))
