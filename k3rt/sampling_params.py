"""User-facing sampling parameters, validated where they enter (CLI, HTTP, DSL). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature: 0 means greedy (argmax, exactly deterministic); otherwise logits / temperature.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass (1.0 = off).
    min_p: drop tokens whose probability is below min_p * p_max (0 = off).
    seed: per-request RNG seed (None: nondeterministic). max_tokens: tokens to generate at most.
    stop_token_ids: extra ids that end generation (besides the model's EOS unless ignore_eos).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be in [0, 2^63)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
