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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


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

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H*D] -> [B, H, T, D]
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """x [B, S, h] block slots; ctx [B, W, h] projected context (not updated by the layer)."""
        y = self.attn_norm(x)
        kv_in = torch.cat([ctx, y], dim=1)
        q, k, v = self._heads(self.q_proj(y)), self._heads(self.k_proj(kv_in)), self._heads(self.v_proj(kv_in))
        o = F.scaled_dot_product_attention(q, k, v)  # no mask: every slot sees all context and all slots
        x = x + self.o_proj(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DSparkModel(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layers) * cfg.target_hidden_size, h, bias=False)
        self.ctx_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.ctx_pos = nn.Parameter(torch.zeros(cfg.context_len, h))
        self.slot_pos = nn.Parameter(torch.zeros(cfg.block_size + 1, h))
        self.mask_embed = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(_BlockLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(h, cfg.rms_norm_eps)
        if cfg.markov_rank:
            self.markov_in = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
            self.markov_out = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        conf_in = h + cfg.markov_rank
        self.conf_hidden = nn.Linear(conf_in, cfg.confidence_hidden)
        self.conf_out = nn.Linear(cfg.confidence_hidden, 1)

    def init_weights(self, seed: int) -> None:
        """Std-0.02 linears with residual outputs scaled by 1/sqrt(2 * layers) (GPT-2); the Markov output
        at zero so training starts from the plain block logits."""
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

    def block_hidden(self, ctx_states: torch.Tensor, anchor_ids: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """ctx_states [B, W, len(target_layers) * target_hidden] (oldest first; W = context_len),
        anchor_ids [B], embed [vocab, hidden] the target's embedding -> draft states [B, k, hidden]."""
        b = anchor_ids.shape[0]
        if ctx_states.shape[1:] != (self.cfg.context_len, self.fc.in_features):
            raise ValueError(f"ctx_states: expected [B, {self.cfg.context_len}, {self.fc.in_features}], "
                             f"got {list(ctx_states.shape)}")
        ctx = self.ctx_norm(self.fc(ctx_states.to(self.fc.weight.dtype))) + self.ctx_pos
        anchor = F.embedding(anchor_ids, embed).to(ctx.dtype)[:, None]
        masks = self.mask_embed.expand(b, self.cfg.block_size, -1)
        x = torch.cat([anchor, masks], dim=1) + self.slot_pos
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x[:, 1:])

    def base_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] fp32 with the target's LM head weight [vocab, hidden]."""
        return F.linear(hidden, lm_head.to(hidden.dtype)).float()

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[...] previous-token ids -> [..., vocab] logit bias (zero without a Markov head)."""
        if not self.cfg.markov_rank:
            return torch.zeros(*prev_ids.shape, self.cfg.vocab_size, device=prev_ids.device)
        return self.markov_out(self.markov_in(prev_ids)).float()

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Logit of P(draft accepted | all earlier drafts were), from the draft state and its previous token."""
        feats = hidden if not self.cfg.markov_rank else torch.cat([hidden, self.markov_in(prev_ids)], dim=-1)
        return self.conf_out(F.silu(self.conf_hidden(feats))).squeeze(-1).float()

    @torch.no_grad()
    def draft(self, ctx_states: torch.Tensor, anchor_ids: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor,
              *, temperature: float = 0.0, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block pass, then the Markov bias left to right. Returns (tokens [B, k], logits [B, k, vocab]
        that each token was drawn from, acceptance estimates [B, k] in (0, 1))."""
        hidden = self.block_hidden(ctx_states, anchor_ids, embed)
        base = self.base_logits(hidden, lm_head)
        prev = anchor_ids
        tokens, logits, conf = [], [], []
        for j in range(self.cfg.block_size):
            step = base[:, j] + self.markov_bias(prev)
            if temperature > 0:
                tok = torch.multinomial(torch.softmax(step / temperature, dim=-1), 1, generator=generator)[:, 0]
            else:
                tok = step.argmax(dim=-1)
            conf.append(torch.sigmoid(self.confidence(hidden[:, j], prev)))
            tokens.append(tok)
            logits.append(step)
            prev = tok
        return torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(conf, 1)


def verify_length(confidence: torch.Tensor, threshold: float, min_verify: int, max_tokens: int) -> int:
    """How many drafts to send for verification: the longest prefix whose cumulative product of per-draft
    acceptance estimates is >= threshold, at least min_verify and at most max_tokens. The product is
    the drafter's estimate that the whole prefix is accepted; past the threshold, verifying one more
    draft costs more target work than it is expected to return."""
    cum = torch.cumprod(confidence.float(), dim=0)
    n = int((cum >= threshold).sum())  # cum is non-increasing, so this is the prefix length
    return max(0, min(max(n, min_verify), max_tokens, confidence.shape[0]))
