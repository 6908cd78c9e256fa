"""The DSpark block drafter: k draft logits in one pass, then a cheap left-to-right Markov correction.

The drafter never sees the target's weights except two it shares and does not store: the token
embedding (its block inputs) and the LM head (its output vocabulary). Everything else is small:

  context   target states at `target_layers`, for the last `context_len` verified positions, each
            position's layer states concatenated and projected to `hidden_size` (`fc`), plus a learned
            position vector. These are the extra K/V every block query attends to.
  block     `block_size + 1` slots: slot 0 is the anchor (the newest token, which the target has not run
            yet), slots 1..k are a learned mask vector; each gets a learned slot vector. The slots attend
            to the context and to each other without a causal mask, so the whole block is one forward.
  logits    slot j (1..k) -> lm_head(norm(h_j)): the base logits of draft j.
  Markov    a rank-`markov_rank` bias on draft j's logits from the token before it (slot j-1's token):
            out(emb[prev]). Parallel drafts cannot see each other; this is the cheapest way to make draft j
            agree with the token actually drafted at j-1. Sampled left to right, one table row per step.
  confidence  P(draft j is accepted | drafts 1..j-1 were) from [h_j, emb[prev_j]]; the verify length is
            the longest prefix whose cumulative product stays >= `confidence_threshold` (`verify_length`).

Two optional parts let the block copy from far back (induction), which a greedy small target needs: it
repeats itself, and n-gram prompt lookup beats a drafter that cannot look past a few positions.
  context_tokens  each context position p also carries the target's embedding of its token x_p and of the
            token after it x_{p+1} (both known: the window ends right before the anchor), so attention can
            match "where did the anchor occur before" and read "what came next" without decoding a state.
  copy head (`copy_dim` > 0)  a pointer over the window: the anchor slot's query scores every context
            position; draft j's copy distribution puts that softmax's mass on x_{p+j} (positions whose
            x_{p+j} is not known yet are masked), and a per-slot gate mixes it with the vocabulary logits.
            It is prompt lookup made soft and learned (which match, how far, when to trust it); the mix's
            top probability also feeds the confidence head.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3rt.kernels.spec import DraftHeads
from k3rt.model_config import ActivationConfig

_SILU = ActivationConfig("silu")  # the layers' MLP activation, as the act_and_mul kernel takes it


# learned context position vectors: a window past this would be mostly untrained rows, and the engine
# keeps context_len states per running request
MAX_CONTEXT_LEN = 1024


@dataclass(frozen=True)
class DSparkConfig:
    """Every field is a config.json key (docs/dspark.md)."""

    vocab_size: int  # the target's vocabulary (the shared LM head's rows)
    hidden_size: int  # drafter width; equals the target's hidden size (shared embedding / LM head)
    target_hidden_size: int  # width of one target layer state
    target_layers: tuple[int, ...]  # target layer states read (see target.py: i < L input of layer i, L = output)
    context_len: int  # verified positions of target states the block attends to (the newest last)
    block_size: int  # k: drafts per pass
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int  # SwiGLU width of each layer's MLP
    markov_rank: int  # rank of the previous-token bias (0: no Markov head)
    confidence_hidden: int  # width of the confidence MLP
    confidence_threshold: float  # verify drafts while the cumulative acceptance estimate stays >= this
    min_verify: int = 1  # verify at least this many drafts whatever the confidence says
    rms_norm_eps: float = 1e-5
    context_tokens: bool = False  # context positions also carry emb[x_p] and emb[x_{p+1}] (false: old drafters)
    copy_dim: int = 0  # width of the copy head's query/key (0: no copy head)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "target_hidden_size", "context_len", "block_size", "num_layers",
                    "num_heads", "head_dim", "intermediate_size", "confidence_hidden")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if not self.target_layers or any(not isinstance(i, int) or i < 0 for i in self.target_layers):
            raise ValueError(f"target_layers: must be a non-empty list of layer indices >= 0, got {self.target_layers!r}")
        if len(set(self.target_layers)) != len(self.target_layers):
            raise ValueError(f"target_layers: repeated index in {self.target_layers!r}")
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"markov_rank: must be an integer >= 0, got {self.markov_rank!r}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold: must be in [0, 1], got {self.confidence_threshold!r}")
        if not isinstance(self.context_tokens, bool):
            raise ValueError(f"context_tokens: must be true or false, got {self.context_tokens!r}")
        if not isinstance(self.copy_dim, int) or isinstance(self.copy_dim, bool) or self.copy_dim < 0:
            raise ValueError(f"copy_dim: must be an integer >= 0, got {self.copy_dim!r}")
        if self.context_len > MAX_CONTEXT_LEN:
            raise ValueError(f"context_len: at most {MAX_CONTEXT_LEN} (learned position vectors), got {self.context_len}")
        if not 0 <= self.min_verify <= self.block_size:
            raise ValueError(f"min_verify: must be in [0, block_size={self.block_size}], got {self.min_verify!r}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight as one op, not six (the drafter's pass is launch-bound); in fp32
        # it equals the spelled-out form to rounding, in bf16 it is closer to fp32 (it normalizes in fp32)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _BlockLayer(nn.Module):
    """Pre-norm attention (block queries over [context; block] keys) + SwiGLU MLP."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        h, inner = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.attn_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, inner, bias=False)
        self.k_proj = nn.Linear(h, inner, bias=False)
        self.v_proj = nn.Linear(h, inner, bias=False)
        self.o_proj = nn.Linear(inner, h, bias=False)
        self.mlp_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self._qkv: tuple[tuple, torch.Tensor] | None = None  # (source key, [3 * inner, h] stacked q|k|v weights)

    def _qkv_weight(self) -> torch.Tensor:
        """q, k and v weights stacked for one matmul, rebuilt whenever one of them changes (written in place,
        moved or cast: their version, storage or dtype moves), so the stack is never stale."""
        ws = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in ws)
        if self._qkv is None or self._qkv[0] != key:
            self._qkv = (key, torch.cat([w.detach() for w in ws]))
        return self._qkv[1]

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, h] block slots; ctx [B, W, h] projected context (not updated by the layer); mask [B, W + S]
        bool, False for context rows that hold no state (a window longer than what has run), or None."""
        x = x + self.attend(self.attn_norm(x), ctx, mask)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def attend(self, y: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The attention sub-layer's output (before the residual add) for the normed slots y [B, S, h]."""
        kv_in = torch.cat([ctx, y], dim=1)
        if torch.is_grad_enabled():
            q, k, v = self._heads(self.q_proj(y)), self._heads(self.k_proj(kv_in)), self._heads(self.v_proj(kv_in))
        else:
            # inference: q, k and v in one matmul over every row (one launch, not three; the context rows' q,
            # W of W + S rows, are computed and dropped: cheaper than two more launches at the pass's sizes)
            q, k, v = F.linear(kv_in, self._qkv_weight()).split(self.num_heads * self.head_dim, dim=-1)
            q, k, v = self._heads(q[:, ctx.shape[1]:]), self._heads(k), self._heads(v)
        # no causal mask: every slot sees all context and all slots
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None, None])
        return self.o_proj(o.transpose(1, 2).reshape(y.shape[0], y.shape[1], -1))


class DSparkModel(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layers) * cfg.target_hidden_size, h, bias=False)
        self.ctx_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.ctx_pos = nn.Parameter(torch.zeros(cfg.context_len, h))
        if cfg.context_tokens:
            self.ctx_tok = nn.Linear(h, h, bias=False)  # emb[x_p] of context position p
            self.ctx_next = nn.Linear(h, h, bias=False)  # emb[x_{p+1}]
        self.slot_pos = nn.Parameter(torch.zeros(cfg.block_size + 1, h))
        self.mask_embed = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(_BlockLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(h, cfg.rms_norm_eps)
        if cfg.markov_rank:
            self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
            self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        if cfg.copy_dim:
            self.copy_q = nn.Linear(h, cfg.copy_dim, bias=False)
            self.copy_k = nn.Linear(h, cfg.copy_dim, bias=False)
            self.copy_gate = nn.Linear(h, 1)
            # which context token draft j copies from window index i (i + j: ctx_tokens' column of x_{p+j}) and
            # whether it is known (i + j <= W): fixed by the config, so built once, not per pass
            i, j = torch.arange(cfg.context_len), torch.arange(1, cfg.block_size + 1)
            src = i[None, :] + j[:, None]  # [k, W]
            self.register_buffer("copy_src", src.clamp(max=cfg.context_len), persistent=False)
            self.register_buffer("copy_known", src <= cfg.context_len, persistent=False)
        conf_in = h + cfg.markov_rank + (1 if cfg.copy_dim else 0)
        self.conf_hidden = nn.Linear(conf_in, cfg.confidence_hidden)
        self.conf_out = nn.Linear(cfg.confidence_hidden, 1)

    @property
    def needs_tokens(self) -> bool:
        """Whether a pass needs the window's token ids (context_tokens or a copy head)."""
        return self.cfg.context_tokens or bool(self.cfg.copy_dim)

    def init_weights(self, seed: int) -> None:
        """Std-0.02 linears with residual outputs scaled by 1/sqrt(2 * layers) (GPT-2); the Markov output
        at zero so training starts from the plain block logits; the copy gate starts closed (bias -2)."""
        g = torch.Generator().manual_seed(seed)
        out_scale = 1.0 / math.sqrt(2 * self.cfg.num_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("markov_out.weight") or name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                    if name.endswith(("o_proj.weight", "down.weight")):
                        p.mul_(out_scale)
            if self.cfg.copy_dim:
                self.copy_gate.bias.fill_(-2.0)

    def _check_window(self, ctx_states: torch.Tensor, ctx_tokens: torch.Tensor | None,
                      ctx_valid: torch.Tensor | None) -> None:
        b, w = ctx_states.shape[0], self.cfg.context_len
        if ctx_states.shape[1:] != (w, self.fc.in_features):
            raise ValueError(f"ctx_states: expected [B, {w}, {self.fc.in_features}], got {list(ctx_states.shape)}")
        if self.needs_tokens and (ctx_tokens is None or tuple(ctx_tokens.shape) != (b, w + 1)):
            raise ValueError(f"ctx_tokens: this drafter needs the window's token ids [B, {w + 1}] (context "
                             f"positions then the anchor), got {None if ctx_tokens is None else list(ctx_tokens.shape)}")
        if ctx_valid is not None and tuple(ctx_valid.shape) != (b, w):
            raise ValueError(f"ctx_valid: expected [B, {w}], got {list(ctx_valid.shape)}")

    def _block(self, ctx_states: torch.Tensor, anchor_ids: torch.Tensor, embed: torch.Tensor,
               ctx_tokens: torch.Tensor | None, ctx_valid: torch.Tensor | None, kernels: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (all k+1 slots after the final norm [B, k+1, h], projected context [B, W, h]). kernels: the norms and
        the SiLU product through the Triton kernels (`_layers_kernels`; the fused serving pass)."""
        self._check_window(ctx_states, ctx_tokens, ctx_valid)
        b = anchor_ids.shape[0]
        fc = self.fc(ctx_states.to(self.fc.weight.dtype))
        if kernels:
            from k3rt.kernels.norm import rms_norm  # Triton: imported only where the kernels run

            ctx = rms_norm(fc.reshape(-1, fc.shape[-1]), self.ctx_norm.weight, self.ctx_norm.eps).view(fc.shape)
            ctx = ctx + self.ctx_pos
        else:
            ctx = self.ctx_norm(fc) + self.ctx_pos
        if self.cfg.context_tokens:
            emb = F.embedding(ctx_tokens, embed).to(ctx.dtype)
            ctx = ctx + self.ctx_tok(emb[:, :-1]) + self.ctx_next(emb[:, 1:])
        anchor = F.embedding(anchor_ids, embed).to(ctx.dtype)[:, None]
        masks = self.mask_embed.expand(b, self.cfg.block_size, -1)
        x = torch.cat([anchor, masks], dim=1) + self.slot_pos
        mask = None
        if ctx_valid is not None:
            mask = torch.cat([ctx_valid, ctx_valid.new_ones(b, x.shape[1])], dim=1)
        if kernels:
            return self._layers_kernels(x, ctx, mask), ctx
        for layer in self.layers:
            x = layer(x, ctx, mask)
        return self.norm(x), ctx

    def _layers_kernels(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The layers and the final norm as `_BlockLayer.forward` and `norm` compute them, each residual add inside
        the next norm's launch (kernels/norm rms_norm(residual=): the sum rounded, then normed, as the torch
        form rounds) and SiLU-and-product one launch: per layer 3 launches fewer, and every norm one launch. The
        serving pass is launch-bound at small batch (issue 16's batch-1 round)."""
        from k3rt.kernels.moe import act_and_mul
        from k3rt.kernels.norm import rms_norm

        B, S, h = x.shape
        eps = self.cfg.rms_norm_eps
        x = x.reshape(B * S, h).contiguous()
        y = rms_norm(x, self.layers[0].attn_norm.weight, eps)
        for i, layer in enumerate(self.layers):
            attn = layer.attend(y.view(B, S, h), ctx, mask).reshape(B * S, h)
            y, x = rms_norm(attn, layer.mlp_norm.weight, eps, residual=x)
            mlp = layer.down(act_and_mul(layer.gate_up(y), _SILU))
            nxt = self.layers[i + 1].attn_norm.weight if i + 1 < len(self.layers) else self.norm.weight
            y, x = rms_norm(mlp, nxt, eps, residual=x)
        return y.view(B, S, h)

    def block_hidden(self, ctx_states: torch.Tensor, anchor_ids: torch.Tensor, embed: torch.Tensor, *,
                     ctx_tokens: torch.Tensor | None = None, ctx_valid: torch.Tensor | None = None) -> torch.Tensor:
        """ctx_states [B, W, len(target_layers) * target_hidden] (oldest first; W = context_len),
        anchor_ids [B], embed [vocab, hidden] the target's embedding -> draft states [B, k, hidden].
        ctx_tokens [B, W + 1]: the token ids of the context positions then the anchor (needed with
        context_tokens or a copy head); ctx_valid [B, W]: False where a row holds no state (left padding)."""
        return self._block(ctx_states, anchor_ids, embed, ctx_tokens, ctx_valid)[0][:, 1:]

    def copy_probs(self, slots: torch.Tensor, ctx: torch.Tensor, ctx_tokens: torch.Tensor,
                   ctx_valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [B, k+1, h] (anchor first), ctx [B, W, h] -> (copy distributions [B, k, vocab], gates [B, k]).
        Draft j copies x_{p+j} from the positions p the anchor's query points at; only p with p + j <= the
        anchor's position (token known) take part. A draft with no such position gets all-zero mass."""
        cfg = self.cfg
        b, k = ctx.shape[0], cfg.block_size
        score = torch.einsum("bd,bwd->bw", self.copy_q(slots[:, 0]), self.copy_k(ctx)).float() / math.sqrt(cfg.copy_dim)
        # [B, k, W]: draft j may copy through window index i when x_{p+j} is known and row i holds a state
        keep = self.copy_known[None] & ctx_valid[:, None] if ctx_valid is not None else self.copy_known[None]
        # (one mask op and a select: the pass is launch-bound, and a not, an or and a fill were three)
        attn = torch.softmax(torch.where(keep, score[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
        src = ctx_tokens[:, self.copy_src]  # [B, k, W]: window index i's x_{p+j} is ctx_tokens[:, i + j]
        copy = torch.zeros(b, k, cfg.vocab_size, device=ctx.device, dtype=attn.dtype).scatter_add_(-1, src, attn)
        return copy, torch.sigmoid(self.copy_gate(slots[:, 1:]).squeeze(-1).float())

    @staticmethod
    def mix(logits: torch.Tensor, copy: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of (1 - g) softmax(logits) + g copy; a draft whose copy has no mass (no position
        to copy from) keeps softmax(logits) whatever its gate says."""
        g = (gate * (copy.sum(-1) > 0.5))[..., None]  # a copy row sums to 1 or to 0
        return ((1 - g) * torch.softmax(logits.float(), -1) + g * copy).clamp(min=1e-12).log()

    def base_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] fp32 with the target's LM head weight [vocab, hidden]."""
        return F.linear(hidden, lm_head.to(hidden.dtype)).float()

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[...] previous-token ids -> [..., vocab] logit bias (zero without a Markov head)."""
        if not self.cfg.markov_rank:
            return torch.zeros(*prev_ids.shape, self.cfg.vocab_size, device=prev_ids.device)
        return self.markov_out(self.markov_in(prev_ids)).float()

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor, top_prob: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Logit of P(draft accepted | all earlier drafts were), from the draft state, its previous token and
        (copy head only) the probability the draft's distribution gives its own argmax."""
        feats = [hidden]
        if self.cfg.markov_rank:
            feats.append(self.markov_in(prev_ids))
        if self.cfg.copy_dim:
            feats.append(top_prob[..., None].to(hidden.dtype))
        return self.conf_out(F.silu(self.conf_hidden(torch.cat(feats, dim=-1)))).squeeze(-1).float()

    def scores(self, ctx_states: torch.Tensor, prev_ids: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor, *,
               ctx_tokens: torch.Tensor | None = None, ctx_valid: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced pass (training): prev_ids [B, k] the token before each draft (prev_ids[:, 0] is the
        anchor) -> (draft log-scores [B, k, vocab] whose argmax is the draft, draft states [B, k, hidden])."""
        slots, ctx = self._block(ctx_states, prev_ids[:, 0], embed, ctx_tokens, ctx_valid)
        hidden = slots[:, 1:]
        out = self.base_logits(hidden, lm_head) + self.markov_bias(prev_ids)
        if self.cfg.copy_dim:
            out = self.mix(out, *self.copy_probs(slots, ctx, ctx_tokens, ctx_valid))
        return out, hidden

    @torch.no_grad()
    def draft(self, ctx_states: torch.Tensor, anchor_ids: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor,
              *, ctx_tokens: torch.Tensor | None = None, ctx_valid: torch.Tensor | None = None,
              temperature: float = 0.0, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block pass, then the Markov bias (and copy mix) left to right. Returns (tokens [B, k], log-scores
        [B, k, vocab] that each token was drawn from, acceptance estimates [B, k] in (0, 1))."""
        slots, ctx = self._block(ctx_states, anchor_ids, embed, ctx_tokens, ctx_valid)
        hidden = slots[:, 1:]
        base = self.base_logits(hidden, lm_head)
        copy, gate = self.copy_probs(slots, ctx, ctx_tokens, ctx_valid) if self.cfg.copy_dim else (None, None)
        prev = anchor_ids
        tokens, logits, conf = [], [], []
        for j in range(self.cfg.block_size):
            step = base[:, j] + self.markov_bias(prev)
            if copy is not None:
                step = self.mix(step, copy[:, j], gate[:, j])
            if temperature > 0:
                tok = torch.multinomial(torch.softmax(step / temperature, dim=-1), 1, generator=generator)[:, 0]
            else:
                tok = step.argmax(dim=-1)
            top = torch.softmax(step, -1).amax(-1) if copy is not None else None
            conf.append(torch.sigmoid(self.confidence(hidden[:, j], prev, top)))
            tokens.append(tok)
            logits.append(step)
            prev = tok
        return torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(conf, 1)

    def draft_heads(self) -> DraftHeads:
        """The left-to-right heads as kernels/spec reads them: views of this model's parameters (the
        confidence MLP's hidden layer split by the features it reads: draft state | Markov code | top)."""
        cfg = self.cfg
        h, r = cfg.hidden_size, cfg.markov_rank
        w = self.conf_hidden.weight  # [C, h + r + (1 with a copy head)]
        return DraftHeads(markov_in=self.markov_in.weight if r else None,
                          markov_out=self.markov_out.weight if r else None, conf_prev=w[:, h:h + r] if r else None, conf_top=w[:, h + r] if cfg.copy_dim else None,
                          conf_out=self.conf_out.weight[0], conf_out_bias=self.conf_out.bias)

    @torch.no_grad()
    def greedy_pass(self, ctx_states: torch.Tensor, anchor_ids: torch.Tensor, embed: torch.Tensor,
                    lm_head: torch.Tensor, *, ctx_tokens: torch.Tensor | None = None,
                    ctx_valid: torch.Tensor | None = None, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The serving pass at temperature 0 -> (tokens [B, k], acceptance estimates [B, k]); no logits.
        fused: the block pass, then every left-to-right step in one Triton launch (kernels/spec.greedy_draft:
        the same tokens as `draft` given the same fp32 inputs, confidences to fp32 rounding); else `draft`."""
        if not fused:
            tokens, _, conf = self.draft(ctx_states, anchor_ids, embed, lm_head, ctx_tokens=ctx_tokens,
                                         ctx_valid=ctx_valid)
            return tokens, conf
        from k3rt.kernels.spec import greedy_draft  # Triton: imported only where the kernel runs

        return greedy_draft(*self.greedy_step_inputs(ctx_states, anchor_ids, embed, lm_head, ctx_tokens=ctx_tokens,
                                                     ctx_valid=ctx_valid))

    @torch.no_grad()
    def greedy_step_inputs(self, ctx_states: torch.Tensor, anchor_ids: torch.Tensor, embed: torch.Tensor,
                           lm_head: torch.Tensor, *, ctx_tokens: torch.Tensor | None = None,
                           ctx_valid: torch.Tensor | None = None) -> tuple:
        """The block pass, and what the fused left-to-right steps read from it: (base logits [B, k, V] fp32,
        anchor_ids, conf_pre [B, k, C], the heads, copy distributions [B, k, V] | None, gates [B, k] | None),
        the arguments of kernels/spec.greedy_draft in order."""
        slots, ctx = self._block(ctx_states, anchor_ids, embed, ctx_tokens, ctx_valid, kernels=True)
        hidden = slots[:, 1:]
        copy, gate = self.copy_probs(slots, ctx, ctx_tokens, ctx_valid) if self.cfg.copy_dim else (None, None)
        # the confidence MLP's hidden layer over the draft states, for all k at once; the kernel adds the
        # columns that read each step's previous token and top probability
        h = self.cfg.hidden_size
        conf_pre = F.linear(hidden, self.conf_hidden.weight[:, :h], self.conf_hidden.bias)
        return self.base_logits(hidden, lm_head), anchor_ids, conf_pre, self.draft_heads(), copy, gate


def confident_prefix(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """[..., k] per-draft acceptance estimates -> [...] int64: the longest prefix whose cumulative product is
    >= threshold (the product is non-increasing, so counting where it holds gives the prefix)."""
    return (torch.cumprod(confidence.float(), dim=-1) >= threshold).sum(-1)


def clamp_verify(prefix: int, min_verify: int, max_tokens: int, k: int) -> int:
    """A confident prefix length -> the drafts to verify: at least min_verify, at most max_tokens and k."""
    return max(0, min(max(prefix, min_verify), max_tokens, k))


def verify_length(confidence: torch.Tensor, threshold: float, min_verify: int, max_tokens: int) -> int:
    """How many drafts to send for verification: the longest prefix whose cumulative product of per-draft
    acceptance estimates is >= threshold, at least min_verify and at most max_tokens. The product is
    the drafter's estimate that the whole prefix is accepted; past the threshold, verifying one more
    draft costs more target work than it is expected to return."""
    return clamp_verify(int(confident_prefix(confidence, threshold)), min_verify, max_tokens, confidence.shape[0])
