"""Training helpers for the default model (k3-tiny) on k3rt's own KimiForCausalLM, so the checkpoint
written after training is exactly what the runtime loads.

What this module knows: the K3 architecture config of k3-tiny, initialization, which parameters train,
the MoE forward used while training, dropout and the weight average (both training-only, added from
outside the runtime modules), the language-model loss on [B, T] windows (the layers' dense path,
`ForwardBatch.dense_shape`), the token stream and its batches, held-out bits per byte and the
unigram baseline, and the end-of-function probe on the training model (`end_probe`; the function
test itself runs through the Engine, `function_test.engine_completions`). What it does not know:
corpus files, the optimizer loop, checkpoints on disk, time budgets (scripts/train_default_model.py).

The training MoE computes every expert on every token and weights the outputs by the router's sparse
top-k weights (zero for unselected experts). That is the reference math exactly, and the gradients
too (unselected experts get a zero weight), without the reference loop's data-dependent shapes and
host syncs. Expert balance is DeepSeek-V3's auxiliary-loss-free rule: after each step, every expert's
`e_score_correction_bias` moves by `rate` towards balance (up when under-loaded, down when over).
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFBackend
from torch import nn
from torch.utils.hooks import RemovableHandle

from k3rt.backend.layers.activation import act_and_mul
from k3rt.backend.layers.norm import rms_norm
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kda import KimiDeltaAttention
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.moe import MoE, route
from k3rt.backend.models.tiny import random_init
from k3rt.backend.tokenizer import HFTokenizer, Tokenizer
from k3rt.kernels.kda.ref import l2norm
from k3rt.training.corpus import Document
from k3rt.training.function_test import FunctionCase

# The Kimi-K3 text architecture at 12.1M parameters (about 24.4 MB in bf16; model card in
# k3rt/models/k3-tiny/README.md): 8 layers, KDA:MLA = 3:1 as in Kimi, KDA with the lower-bound gate
# and the full-rank output gate, gated MLA with a q LoRA, LatentMoE (8 routed experts, top-2, in a
# 128-wide latent with its RMSNorm, plus 2 shared experts at full width), SiTU, attention residuals
# over blocks of 2 layers. Embeddings are tied: untied, they alone would take half of the size budget.
# A 512-wide variant (recipe 2, 19.0M parameters) cost 1.21x the CPU decode time for no gain.
K3_TINY_CONFIG: dict = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 8192,
    "hidden_size": 384, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32, "v_head_dim": 64, "mla_use_nope": True, "mla_use_output_gate": True,
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 96,
    "routed_expert_hidden_size": 128, "latent_moe_use_norm": True, "routed_scaling_factor": 1.0,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "model_max_length": 8192,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 4,
                           "head_dim": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True},
}

# The same architecture at toy size, for --smoke runs and tests on CPU.
SMOKE_CONFIG: dict = {
    **K3_TINY_CONFIG, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
    "num_shared_experts": 1,
    "linear_attn_config": {**K3_TINY_CONFIG["linear_attn_config"], "kda_layers": [1, 2, 3], "full_attn_layers": [4],
                           "num_heads": 2, "head_dim": 16},
}

_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", ".w2", "routed_expert_up_proj.weight")


def init_for_training(model: KimiForCausalLM, seed: int) -> None:
    """From-scratch init: tiny.random_init's fla-style gate parameters and std-0.02 linears, with
    norms at 1, attention-residual projections at 0 (each sub-layer starts by averaging the blocks),
    router biases at 0 and residual-branch outputs scaled by 1/sqrt(2 * layers) (GPT-2)."""
    random_init(model, seed)
    out_scale = 1.0 / math.sqrt(2 * model.cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            last = name.split(".")[-1]
            if name.endswith("_res_proj.weight") or name.endswith("e_score_correction_bias"):
                p.zero_()
            elif "norm" in last or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(_OUTPUT_PROJECTIONS):
                p.mul_(out_scale)


def make_trainable(model: KimiForCausalLM) -> None:
    """The model builds inference parameters (requires_grad=False); switch on all but the router biases,
    which the balancing rule moves instead of the gradient."""
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias"))


def param_groups(model: KimiForCausalLM, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices, none on norms, gate parameters, convs and mixing rows."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = p.dim() < 2 or name.endswith(("conv_weight", "_res_proj.weight"))
        (no_decay if plain else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def cosine_lr(step: int, total_steps: int, warmup_steps: int, peak: float, floor_ratio: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to `floor_ratio * peak` at `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- KDA while training -------------------------------------------------------------------------

def kda_chunked_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                      chunk_size: int = 64, sub_chunk: int = 16) -> torch.Tensor:
    """kernels/kda/ref.py `kda_chunked` for fresh sequences (zero initial state, no snapshots), returning
    o only, in a form that is fast under autograd: everything that does not depend on the state is
    computed for all chunks at once, and only the two-matmul state recurrence loops over chunks.

    Within a chunk, exp(Gc_i - Gc_j) is factored per row block of `sub_chunk` rows with the block's first
    cumulative gate R as reference: (x_i exp(Gc_i - R)) . (k_j exp(R - Gc_j)) for columns j up to the
    block's end. Both factors stay finite because the gate is bounded below (K3's lower-bound gate,
    lb >= -5): |Gc_i - R| <= 5 * sub_chunk = 80 < 88, the fp32 exponent limit. The softplus gate of
    Kimi-Linear has no such bound: use the reference there.

    Args: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log decay in [-5, 0]; beta [B, T, H].
    Returns: o [B, T, H, V] in v.dtype; all math in fp32 (call it outside autocast).
    """
    out_dtype = v.dtype
    b, t, h, d_k = q.shape
    d_v, c = v.shape[-1], chunk_size
    if c % sub_chunk:
        raise ValueError(f"chunk_size {c} must be a multiple of sub_chunk {sub_chunk}")
    n = -(-t // c)
    pad = n * c - t
    q = l2norm(q.float()) * d_k**-0.5
    k = l2norm(k.float())

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, X] -> [B, H, N, C, X] (zero-padded)
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
        return x.view(b, n, c, h, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = F.pad(beta.float(), (0, 0, 0, pad)).view(b, n, c, h).permute(0, 3, 1, 2)  # [B, H, N, C]
    gc = g.cumsum(dim=3)  # [B, H, N, C, K]

    nb = c // sub_chunk
    pos = torch.arange(c, device=q.device)
    ref = gc[:, :, :, ::sub_chunk]  # [B, H, N, nb, K]: cumulative gate at each row block's first row
    row_ref = ref.repeat_interleave(sub_chunk, dim=3)  # [B, H, N, C, K]
    # column j enters row block r's product only up to the block's end (beyond, exp(R - Gc_j) overflows)
    col_ok = pos[None, :] < ((torch.arange(nb, device=q.device) + 1) * sub_chunk)[:, None]  # [nb, C]
    col_exp = torch.where(col_ok[:, :, None], ref[:, :, :, :, None] - gc[:, :, :, None], float("-inf"))
    k_cols = k[:, :, :, None] * col_exp.exp()  # [B, H, N, nb, C, K]

    def intra(x: torch.Tensor) -> torch.Tensor:  # rows x_i (i in block r) . k_cols[r] -> [B, H, N, C, C]
        rows = (x * (gc - row_ref).exp()).view(b, h, n, nb, sub_chunk, d_k)
        return (rows @ k_cols.transpose(-1, -2)).reshape(b, h, n, c, c)

    lower = pos[None, :] <= pos[:, None]
    a_qk = intra(q).masked_fill(~lower, 0.0)
    a_kk = (intra(k) * beta[..., None]).masked_fill(~lower | torch.eye(c, dtype=torch.bool, device=q.device), 0.0)
    rhs = torch.cat([beta[..., None] * gc.exp() * k, beta[..., None] * v], dim=-1)
    wu = torch.linalg.solve_triangular(torch.eye(c, device=q.device) + a_kk, rhs, upper=False, unitriangular=True)
    w, u = wu.split([d_k, d_v], dim=-1)  # [B, H, N, C, K], [B, H, N, C, V]

    g_last = gc[:, :, :, -1:]  # [B, H, N, 1, K]
    k_decayed = (k * (g_last - gc).exp()).transpose(-1, -2)  # [B, H, N, K, C]
    decay = g_last.squeeze(3).exp()[..., None]  # [B, H, N, K, 1]
    state = q.new_zeros(b, h, d_k, d_v)
    states = []  # the state entering each chunk
    for i in range(n):
        states.append(state)
        v_new = u[:, :, i] - w[:, :, i] @ state
        state = state * decay[:, :, i] + k_decayed[:, :, i] @ v_new
    s_in = torch.stack(states, dim=2)  # [B, H, N, K, V]
    # o = (q e^Gc) S + Aqk (U - W S) = (q e^Gc - Aqk W) S + Aqk U
    o = (q * gc.exp() - a_qk @ w) @ s_in + a_qk @ u  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, d_v)[:, :t].to(out_dtype)


def use_fast_kda(model: KimiForCausalLM) -> int:
    """Run the dense (training) path of every KDA layer with `kda_chunked_fresh`; needs the lower-bound
    gate. Returns the number of layers switched."""
    layers = [mod for mod in model.modules() if isinstance(mod, KimiDeltaAttention)]
    for layer in layers:
        if layer.lower_bound is None or layer.lower_bound < -5.0:
            raise ValueError("use_fast_kda: needs gate_lower_bound in [-5, 0) (the factored form would overflow)")
        layer.dense_core = kda_chunked_fresh
    return len(layers)


# ---- the MoE while training ---------------------------------------------------------------------

def _all_experts(moe: MoE, z: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MoE.experts without data-dependent shapes: z [N, width], w/ids [N, k] -> Σ_k w * Expert_ids(z)."""
    combine = torch.zeros(z.shape[0], moe.w13.shape[0], dtype=torch.float32, device=z.device).scatter(1, ids, w)
    gate_up = torch.einsum("nd,efd->nef", z, moe.w13)  # [N, E, 2I]
    y = torch.einsum("nei,edi->ned", act_and_mul(gate_up, moe.act), moe.w2)  # [N, E, width]
    return (y.float() * combine[..., None]).sum(1).to(z.dtype)


def _training_moe_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward (TP = 1) with every expert computed, the router kept in fp32 under autocast, and the
    tokens per expert counted for the balancing rule."""
    m = moe.m
    with torch.autocast(x.device.type, enabled=False):
        w, ids = route(x.float(), moe.gate_weight, moe.e_score_correction_bias, m)
    flat = ids.flatten()
    moe.routed_counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))  # no host sync
    if m.latent_size is None:
        y = _all_experts(moe, x, w, ids)
    else:
        y = _all_experts(moe, moe.routed_expert_down_proj(x), w, ids)
        if m.latent_norm:
            y = rms_norm(y, moe.routed_expert_norm, moe.eps)
        y = moe.routed_expert_up_proj(y)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y


def use_training_moe(model: KimiForCausalLM) -> list[MoE]:
    """Switch every MoE of `model` (already on its device) to the training forward; returns them."""
    moes = [mod for mod in model.modules() if isinstance(mod, MoE)]
    for moe in moes:
        if moe.tp.size != 1:
            raise ValueError("use_training_moe: training runs at tensor-parallel size 1")
        moe.routed_counts = torch.zeros(moe.m.num_experts, device=moe.gate_weight.device)
        moe.forward = types.MethodType(_training_moe_forward, moe)
    return moes


@torch.no_grad()
def balance_routers(moes: Sequence[MoE], rate: float) -> list[torch.Tensor]:
    """Move each router's correction bias towards equal load and reset the counts. Returns each layer's
    max/mean load ratio as a 0-dim device tensor (read it only when logging: reading syncs the GPU)."""
    imbalance = []
    for moe in moes:
        c = moe.routed_counts
        moe.e_score_correction_bias.add_(rate * torch.sign(c.mean() - c))
        imbalance.append(c.max() / c.mean().clamp_min(1.0))
        c.zero_()
    return imbalance


# ---- regularization while training ---------------------------------------------------------------

def add_dropout(model: KimiForCausalLM, p_sublayer: float, p_embed: float) -> list[RemovableHandle]:
    """Dropout on the token embeddings and on every mixer (KDA / MLA) and FFN output, as forward hooks,
    so the runtime modules and the checkpoint stay exactly the inference ones. A hook drops only while
    its module is in training mode: `model.eval()` turns it off. Returns the hook handles (`.remove()`).

    The corpus is small and trained for several epochs; without dropout validation loss turned up after
    about 3.5 passes (first k3-tiny run). The masks come from torch's global generator."""
    def hook(p: float):
        def drop(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            return F.dropout(out, p, training=module.training)
        return drop

    handles = []
    if p_embed > 0:
        handles.append(model.model.embed_tokens.register_forward_hook(hook(p_embed)))
    if p_sublayer > 0:
        for layer in model.model.layers:
            handles.append(layer.self_attn.register_forward_hook(hook(p_sublayer)))
            handles.append(layer.mlp.register_forward_hook(hook(p_sublayer)))
    return handles


class WeightAverage:
    """An exponential moving average (EMA) of every parameter of a model, router biases included (they
    move by the balancing rule, not the gradient, and must stay consistent with the averaged experts).

    `update` after each optimizer step: shadow <- d * shadow + (1 - d) * param with
    d = min(decay, (1 + n) / (10 + n)) at the n-th update, so early updates are not dominated by the
    random init. `applied(model)` swaps the average into the model for evaluation or export and
    restores the trained weights on exit. Shadows live on the parameters' device, in fp32."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay: must be in (0, 1), got {decay}")
        self.decay, self.num_updates = decay, 0
        self.names = [n for n, _ in model.named_parameters()]
        self.shadow = [p.detach().float().clone() for _, p in model.named_parameters()]

    def _params(self, model: nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        return [params[n] for n in self.names]

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self._params(model)], 1.0 - d)
        self.num_updates += 1

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        params = self._params(model)
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, s in zip(params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: dict) -> None:
        if list(state["shadow"]) != self.names:
            raise ValueError("WeightAverage.load_state_dict: the saved parameters are not this model's")
        self.decay, self.num_updates = state["decay"], state["num_updates"]
        for dst, src in zip(self.shadow, state["shadow"].values()):
            dst.copy_(src)


# ---- loss, data and evaluation ------------------------------------------------------------------

def window_logits(model: KimiForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] (B fresh windows) -> fp32 logits [B*T, vocab], with autograd (KimiForCausalLM.forward
    is inference-only)."""
    b, t = ids.shape
    return model.lm_head(model.model(ids.reshape(-1), ForwardBatch([t] * b)))


def lm_loss(model: KimiForCausalLM, inputs: torch.Tensor, targets: torch.Tensor,
            mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross entropies in nats, number of counted tokens) over [B, T] windows."""
    nll = F.cross_entropy(window_logits(model, inputs), targets.reshape(-1), reduction="none")
    if mask is None:
        return nll.sum(), torch.tensor(nll.numel(), device=nll.device)
    m = mask.reshape(-1)
    return (nll * m).sum(), m.sum()


def encode_documents(docs: Sequence[Document], tok: Tokenizer) -> list[list[int]]:
    """Token ids of corpus documents, each preceded by the tokenizer's sequence prefix (BOS for
    `add_bos_token` models, as every prompt at serving time) and followed by EOS. Code and doc text is
    encoded as plain text (a special token's spelling inside code stays text); chat is rendered with the
    tokenizer's template.
    Ids equal `tok.encode`'s; a tokenizer.json is encoded in parallel batches (HF `encode_batch`)."""
    texts = [tok.apply_chat_template(list(d.messages), add_generation_prompt=False) if d.kind == "chat" else d.text
             for d in docs]
    special = [d.kind == "chat" for d in docs]
    ids: list[list[int]] = [[] for _ in docs]
    json_file = tok.source_dir / "tokenizer.json"
    for allow in (False, True):
        idx = [i for i, s in enumerate(special) if s == allow]
        if isinstance(tok, HFTokenizer) and json_file.is_file():
            backend = HFBackend.from_file(str(json_file))
            backend.encode_special_tokens = not allow  # as HFTokenizer.encode(allow_special=allow)
            encoded = [e.ids for e in backend.encode_batch([texts[i] for i in idx], add_special_tokens=False)]
        else:
            encoded = [tok.encode(texts[i], allow_special=allow) for i in idx]
        for i, e in zip(idx, encoded):
            ids[i] = e
    eos, prefix = tok.eos_token_ids[0], tok.sequence_prefix
    return [[*prefix, *x, eos] for x in ids]


def eval_documents(docs: Sequence[Document], tok: Tokenizer) -> list[list[int]]:
    """The scored ids of evaluation documents: `encode_documents` without the sequence prefix (BOS, the
    context every document starts from) and without the closing EOS (it stands for no bytes of text)."""
    skip = len(tok.sequence_prefix)
    return [ids[skip:-1] for ids in encode_documents(docs, tok)]


def sequence_start(tok: Tokenizer) -> int:
    """The token a document is predicted from in evaluation: BOS for `add_bos_token` models, else EOS
    (documents follow an EOS in the packed training stream)."""
    return tok.sequence_prefix[0] if tok.sequence_prefix else tok.eos_token_ids[0]


class TokenStream:
    """The training documents' tokens back to back (each followed by EOS), cut into windows of
    seq_len + 1 tokens. Batches are deterministic in (seed, step): epoch e visits every window once in
    a seeded order, so a resumed run sees exactly the batches the uninterrupted run would."""

    def __init__(self, docs: Sequence[Sequence[int]], seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens = torch.tensor([t for d in docs for t in d], dtype=torch.int32)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < batch_size:
            raise ValueError(f"batch_size: {batch_size} windows of {seq_len} tokens, the corpus holds {self.num_windows}")
        self.steps_per_epoch = self.num_windows // batch_size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch_size, seq_len] int64 on the CPU."""
        epoch, k = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_windows, generator=g)[k * self.batch_size:(k + 1) * self.batch_size]
        idx = order[:, None] * self.seq_len + torch.arange(self.seq_len + 1)[None, :]
        w = self.tokens[idx].long()
        return w[:, :-1], w[:, 1:]


@dataclass(frozen=True)
class EvalWindows:
    """Held-out documents as [W, T] windows: each document's tokens are predicted from a start token
    (`sequence_start`: BOS, or EOS where a document follows an EOS in training); the last window of a
    document is right-padded and masked."""

    inputs: torch.Tensor  # [W, T] int64
    targets: torch.Tensor  # [W, T] int64
    mask: torch.Tensor  # [W, T] bool: True where a real target is scored
    num_bytes: int  # UTF-8 bytes of the held-out text, the denominator of bits/byte

    @staticmethod
    def build(docs: Sequence[Sequence[int]], texts: Sequence[str], seq_len: int, start_id: int) -> "EvalWindows":
        rows_in, rows_tg, rows_mask = [], [], []
        for ids in docs:
            ctx = [start_id, *ids[:-1]]
            for s in range(0, len(ids), seq_len):
                tg, inp = list(ids[s:s + seq_len]), ctx[s:s + seq_len]
                pad = seq_len - len(tg)
                rows_in.append(inp + [start_id] * pad)
                rows_tg.append(tg + [start_id] * pad)
                rows_mask.append([True] * len(tg) + [False] * pad)
        return EvalWindows(torch.tensor(rows_in), torch.tensor(rows_tg), torch.tensor(rows_mask),
                           sum(len(t.encode("utf-8")) for t in texts))

    def subset(self, n: int) -> "EvalWindows":
        """The first n windows, with the byte count scaled by the share of scored tokens they hold."""
        share = self.mask[:n].sum().item() / max(1, self.mask.sum().item())
        return EvalWindows(self.inputs[:n], self.targets[:n], self.mask[:n], max(1, round(self.num_bytes * share)))


@torch.no_grad()
def bits_per_byte(model: KimiForCausalLM, windows: EvalWindows, batch_size: int, *,
                  autocast_dtype: torch.dtype | None = None) -> float:
    """Held-out bits per UTF-8 byte: total next-token NLL (nats) / ln 2 / bytes."""
    device = model.lm_head.weight.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for s in range(0, windows.inputs.shape[0], batch_size):
        inp, tg, mk = (t[s:s + batch_size].to(device) for t in (windows.inputs, windows.targets, windows.mask))
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            nll, _ = lm_loss(model, inp, tg, mk)
        total += nll.double()
    return total.item() / math.log(2) / windows.num_bytes


def _last_token_logits(model: KimiForCausalLM, tok: Tokenizer, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """fp32 logits [len(seqs), vocab] after each sequence's last token, from one dense forward of the
    sequences right-padded to the longest (every layer is causal, so padding after a sequence never
    reaches its last token)."""
    device = model.lm_head.weight.device
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    t = max(map(len, seqs))
    ids = torch.tensor([[*q, *[pad] * (t - len(q))] for q in seqs], device=device)
    hidden = model.model(ids.reshape(-1), ForwardBatch([t] * len(seqs)))
    last = torch.tensor([k * t + len(q) - 1 for k, q in enumerate(seqs)], device=device)
    return model.lm_head(hidden[last]).float()


@torch.no_grad()
def end_probe(model: KimiForCausalLM, tok: Tokenizer, cases: Sequence[FunctionCase], *, batch_size: int = 8) -> dict:
    """Does the model know where a function ends once the true body is written? Each case's whole function
    is fed as a training function document is (sequence prefix + the dedented text, which ends at its last
    statement's last character), and the next-token distribution there is read: `eos_top1_rate`, the share
    of cases where EOS is the most likely token, and `eos_p_median`, the median probability of EOS.
    Teacher-forced, batched through the dense path (`_last_token_logits`)."""
    eos = tok.eos_token_ids[0]
    # by length, so that a batch pads little (the two statistics do not depend on the order)
    seqs = sorted((tok.encode_prompt(c.reference.rstrip("\n")) for c in cases), key=len)
    p_eos, top1 = [], []
    for start in range(0, len(seqs), batch_size):
        probs = torch.softmax(_last_token_logits(model, tok, seqs[start:start + batch_size]), dim=-1)
        p_eos += probs[:, eos].tolist()
        top1 += (probs.argmax(-1) == eos).tolist()
    if not seqs:
        return {"eos_top1_rate": 0.0, "eos_p_median": 0.0}
    return {"eos_top1_rate": round(sum(top1) / len(top1), 3),
            "eos_p_median": round(float(torch.tensor(p_eos).median()), 3)}


def unigram_bits_per_byte(train_docs: Sequence[Sequence[int]], windows: EvalWindows, vocab_size: int) -> float:
    """The baseline beside bits/byte: a token-unigram model of the training tokens (add-one smoothed)."""
    counts = torch.ones(vocab_size, dtype=torch.float64)
    for ids in train_docs:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size).double()
    logp = counts.log2() - counts.sum().log2()
    return -(logp[windows.targets[windows.mask]]).sum().item() / windows.num_bytes


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
