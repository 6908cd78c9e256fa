"""User-facing sampling parameters, validated where they enter (CLI, HTTP, DSL). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature: 0 means greedy (argmax, exactly deterministic); otherwise logits / temperature.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass (1.0 = off).
    min_p: drop tokens whose probability is below min_p * p_max (0 = off).
    repetition_penalty: HF semantics over prompt + output tokens: a present token's logit is divided by
        the penalty if positive, multiplied by it otherwise (1.0 = off; > 1 discourages repeats).
    frequency_penalty, presence_penalty: OpenAI semantics over output tokens only:
        logit -= frequency_penalty * count + presence_penalty * (count > 0)  (0.0 = off).
    logprobs: also return the sampled token's logprob and the top-N (N = logprobs, 0..20) alternatives
        (None = off). The backend sampler documents which distribution they come from.
    seed: per-request RNG seed (None: nondeterministic). max_tokens: tokens to generate at most.
    min_tokens: the tokens that would end generation (EOS, stop_token_ids) cannot be sampled before this
        many tokens (0 = off; SGLang's min_new_tokens, vLLM's min_tokens).
    stop_token_ids: extra ids that end generation (besides the model's EOS unless ignore_eos).
    logit_bias: (token id, bias) pairs added to those tokens' logits before penalties and temperature
        (OpenAI semantics; bias in [-100, 100], -100 bans a token in practice). The ids' upper bound (the
        vocabulary) is checked where the vocabulary is known (the HTTP edge, the sampler).
    speculative: let a speculative server draft and verify tokens for this request (False: plain decoding;
        outputs are the same either way under greedy sampling, and the same in distribution otherwise).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    speculative: bool = True

    def __post_init__(self) -> None:
        # comparisons are written so that NaN fails them
        checks = [
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0 (1 disables)"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or (not isinstance(self.logprobs, bool) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"must be None or an int in [0, {MAX_LOGPROBS}]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", not isinstance(self.min_tokens, bool) and 0 <= self.min_tokens <= self.max_tokens,
             f"must be in [0, max_tokens={self.max_tokens}]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be in [0, 2^63)"),
            ("logit_bias", all(_bias_pair(x) for x in self.logit_bias),
             f"must be (token id >= 0, bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]) pairs"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _bias_pair(x: object) -> bool:
    if not isinstance(x, tuple) or len(x) != 2:
        return False
    t, b = x
    return (isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
            and not isinstance(b, bool) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS)
