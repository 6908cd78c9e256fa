"""The prefix cache's snapshot policy: what each snapshot is for (its kind), how likely each kind is
to be reused (learned from the traffic), and how valuable a snapshot is per page it holds.

A KDA snapshot of a large model costs as much memory as thousands of tokens of MLA KV, so a snapshot
has to earn its place. The value of keeping snapshot s:

    value(s) = reuse(s) * recompute_saved(s) / pages_freed(s)

  recompute_saved  tokens between s and the nearest snapshot above it on its path: what a request
                   resuming at s instead of there does not compute (its marginal value)
  pages_freed      its state set, plus for a leaf the KV pages only it keeps alive
  reuse            hits(s) + P(kind): a snapshot that has been used is likely to be used again;
                   one that has not, as likely as its kind has proven to be

P(kind) is learned: each kind keeps exponentially decayed counts of snapshots published and of
snapshots that were hit at least once; P = (hits + 1) / (published + 2) (Laplace's rule). So the
policy finds out what the traffic reuses: in a chat, the end of each turn (the next turn extends
it); in a trace whose sessions resend a prompt truncated to a block (Mooncake), the tail rung a few
hundred tokens before the end; interior checkpoints of one-off documents, rarely.

Eviction (RadixCache) is GreedyDual-Size-Frequency over that value: priority = clock + value, the
clock being the priority of the last victim, so what is not used ages out whatever its value.
Admission uses the same scale: a new snapshot is published only into free pages or by evicting
snapshots of lower priority than its own (a checkpoint worth little is not written at all when the
cache is full of more valuable state; with memory to spare, everything is kept).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# snapshot kinds
CHECKPOINT = "checkpoint"  # interior, every checkpoint_interval tokens of a prefill
REPLAY = "replay"  # the last grid point at or below n - 1: an identical repeat of the prompt hits it
TAIL = "tail"  # the rungs of the tail ladder below the replay boundary ("tail64", "tail128", ...)
JUNCTION = "junction"  # a prefix shared with another path, seen a second time
END = "end"  # the end of a finished request's fed tokens (the next turn of a conversation extends it)
PREEMPTED = "preempted"  # a preempted request's live state (its owner comes back for it)

# kinds whose snapshot is wanted by a request known to exist: they start as if hit once
CONFIRMED = frozenset({JUNCTION, PREEMPTED})


def tail_kind(offset: int) -> str:
    return REPLAY if offset == 0 else f"{TAIL}{offset}"


@dataclass(frozen=True)
class CachePolicy:
    eviction: str = "value"  # "value" (GreedyDual-Size-Frequency over the value above) or "lru"
    decay: float = 0.998  # per publish of a kind: its counts' weight halves every ~350 publishes

    def __post_init__(self) -> None:
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction: {self.eviction!r} not one of value, lru")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay: must be in (0, 1], got {self.decay}")


DEFAULT_HORIZON = 1.0  # pool turnovers: a kind's reuse horizon before any of its reuses was seen
HORIZON_FACTOR = 1.5  # reuses later than the ghosts remember go unseen: look half as far again
MIN_HORIZON = 0.25
AGE_DECAY = 0.99  # per reuse of a kind: its age statistics follow the last ~100 reuses


class ReuseStats:
    """Per kind: decayed counts of snapshots published and of snapshots hit at least once (P), and
    the decayed mean age at which its snapshots are reused (the horizon, in pool turnovers)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.published: dict[str, float] = defaultdict(float)
        self.hit: dict[str, float] = defaultdict(float)
        self.missed: dict[str, float] = defaultdict(float)  # snapshots that outlived their horizon unused
        self.age_sum: dict[str, float] = defaultdict(float)
        self.age_n: dict[str, float] = defaultdict(float)
        self._horizon: dict[str, float] = {}

    def on_hit_age(self, kind: str, age: float) -> bool:
        """A snapshot of `kind` reused `age` turnovers after its last use; True when the kind's horizon
        moved by more than a quarter (its heap is then re-keyed)."""
        self.age_sum[kind] = self.age_sum[kind] * AGE_DECAY + max(age, 0.0)
        self.age_n[kind] = self.age_n[kind] * AGE_DECAY + 1.0
        est = max(MIN_HORIZON, HORIZON_FACTOR * self.age_sum[kind] / self.age_n[kind])
        cur = self._horizon.get(kind, DEFAULT_HORIZON)
        if abs(est - cur) > 0.25 * cur:
            self._horizon[kind] = est
            return True
        return False

    def horizon(self, kind: str) -> float:
        return self._horizon.get(kind, DEFAULT_HORIZON)

    def on_publish(self, kind: str) -> None:
        self.published[kind] = self.published[kind] * self.decay + 1.0

    def on_first_hit(self, kind: str) -> None:
        self.hit[kind] = self.hit[kind] * self.decay + 1.0
        self.missed[kind] *= self.decay

    def on_evicted_unused(self, kind: str, age: float) -> None:
        """A snapshot never used is evicted `age` turnovers after it was published. Only one that
        outlived its kind's horizon counts as not reused: one evicted younger says nothing about its
        kind (it had no time), or P would learn from the eviction order itself and feed it back."""
        if age >= self.horizon(kind):
            self.missed[kind] = self.missed[kind] * self.decay + 1.0
            self.hit[kind] *= self.decay

    def on_ghost_hit(self, kind: str, age: float, was_hit: bool) -> bool:
        """A request would have resumed from an evicted snapshot of `kind`, `age` turnovers after its
        last use: the kind is reused (whatever eviction decided), and that late. Returns whether the
        kind's horizon moved (on_hit_age)."""
        if not was_hit:
            self.hit[kind] = self.hit[kind] * self.decay + 1.0
            self.missed[kind] = max(0.0, self.missed[kind] - 1.0)
        return self.on_hit_age(kind, age)

    def p(self, kind: str) -> float:
        return (self.hit[kind] + 1.0) / (self.hit[kind] + self.missed[kind] + 2.0)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k: {"published": round(self.published[k], 2), "hit": round(self.hit[k], 2),
                    "missed": round(self.missed[k], 2), "p": round(self.p(k), 3),
                    "horizon": round(self.horizon(k), 3)} for k in sorted(self.published)}
