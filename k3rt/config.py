"""Typed, frozen engine configuration, composed per component and passed down. No torch.

Validated in __post_init__; errors name the field and the limit. Derived values are properties.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Literal

from k3rt.model_config import ep_degree

KDA_CHUNK = 64  # the chunked KDA kernels' chunk: snapshot grids must be multiples of it


@dataclass(frozen=True)
class CacheConfig:
    memory_gb: float | None = None  # cache pool size; None: use num_pages
    num_pages: int | None = 256  # used when memory_gb is None
    block_size: int | None = None  # tokens per MLA page; None: smallest that holds a KDA state
    hash_block_size: int = 64  # snapshot grid (prefix-cache hit granularity), multiple of KDA_CHUNK
    full_block_mode: bool = False  # baseline: hits only at block boundaries, no tails/junctions
    enable_prefix_cache: bool = True
    # rungs of the tail ladder before each prompt's end: the replay boundary (the grid point at or below
    # n - 1), then grid points 64, 128, 256, ... below it (hash_block_size doubling)
    tail_snapshots: int = 5
    # interior checkpoints of a prefill, every this many tokens (a multiple of hash_block_size), written
    # only into free pages ("value" eviction); 0: none; -1: at every physical block boundary, as before
    checkpoint_interval: int = 2048
    # eviction priority of snapshots: "value" (recompute saved per page freed, aged: GreedyDual-Size-
    # Frequency) or "lru"; the full-block baseline always uses "lru"
    eviction: str = "value"
    max_pinned_fraction: float = 0.5  # pinned snapshots (DSL programs between calls) hold at most this share
    kv_dtype: str | None = None  # None: the model's compute dtype
    conv_dtype: str | None = None  # None: the model's compute dtype
    state_dtype: str = "float32"  # KDA recurrent state
    poison_freed: bool = False  # debug: fill freed pages with NaN so a stale read cannot hide

    def __post_init__(self) -> None:
        if self.hash_block_size < KDA_CHUNK or self.hash_block_size % KDA_CHUNK:
            raise ValueError(f"hash_block_size: must be a positive multiple of {KDA_CHUNK}, got {self.hash_block_size}")
        if self.memory_gb is None and (self.num_pages is None or self.num_pages < 1):
            raise ValueError("num_pages: set memory_gb or num_pages >= 1")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"memory_gb: must be > 0, got {self.memory_gb}")
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction: {self.eviction!r} not one of value, lru")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction: must be in [0, 1], got {self.max_pinned_fraction}")
        if self.checkpoint_interval < -1 or (self.checkpoint_interval > 0
                                             and self.checkpoint_interval % self.hash_block_size):
            raise ValueError(f"checkpoint_interval: must be -1, 0 or a positive multiple of hash_block_size "
                             f"({self.hash_block_size}), got {self.checkpoint_interval}")
        if self.tail_snapshots < 1:
            raise ValueError(f"tail_snapshots: must be >= 1 (the replay boundary), got {self.tail_snapshots}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step (decode tokens first, then prefill chunks)
    max_running: int = 256
    max_waiting: int = 4096
    # decode-aware chunk budget (Scheduler.prefill_budget): each running decode takes this many tokens' worth of
    # step time from the prefill chunks of the step, so a long prompt arriving does not stall the decodes
    # (0: off, chunks take whatever budget the decodes left)
    decode_token_cost: float = 4.0
    # prefill tokens a step may always add, however many decodes run (capped by max_num_batched_tokens)
    min_prefill_tokens: int = 256
    # admission batching (Scheduler.hold_admissions): while decodes run and the step has no prefill chunk of
    # its own, a waiting request is admitted only once the head of the queue has waited this many steps or
    # the waiting prompts fill the step's prefill budget. A step that admits a request cannot replay the decode
    # CUDA graph, and on the GPU such a mixed step costs about 2.5x a decode step whatever its prefill size
    # (host-bound: benchmarks/RESULTS.md, session 11), so admitting several arrivals in one mixed step instead
    # of one per step keeps most steps graph replays. 0: admit at once; None: the engine picks
    # (EngineConfig: PREFILL_DELAY_STEPS_GRAPHS with the GPU runner's decode graphs on CUDA, else 0)
    prefill_delay_steps: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < KDA_CHUNK:
            # a smaller budget could never end a non-final chunk on the snapshot grid
            raise ValueError(f"max_num_batched_tokens: must be >= {KDA_CHUNK}, got {self.max_num_batched_tokens}")
        if self.max_running < 1:
            raise ValueError(f"max_running: must be >= 1, got {self.max_running}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if not self.decode_token_cost >= 0:
            raise ValueError(f"decode_token_cost: must be >= 0, got {self.decode_token_cost}")
        if self.prefill_delay_steps is not None and self.prefill_delay_steps < 0:
            raise ValueError(f"prefill_delay_steps: must be >= 0, got {self.prefill_delay_steps}")
        if self.min_prefill_tokens < KDA_CHUNK or self.min_prefill_tokens % KDA_CHUNK:
            raise ValueError(f"min_prefill_tokens: must be a positive multiple of {KDA_CHUNK}, "
                             f"got {self.min_prefill_tokens}")


# SchedulerConfig.prefill_delay_steps when the engine replays decode graphs: at 64 running requests and a 24 ms
# decode step, a request waits at most ~0.4 s more for its first token, and about one step in 12 or more mixes
# prefill in (so the decodes' p90 inter-token latency is a graph replay's)
PREFILL_DELAY_STEPS_GRAPHS = 16

# ngram, suffix: model-free drafters; dspark: a DSpark block drafter folder (docs/dspark.md)
SPEC_METHODS = ("ngram", "suffix", "dspark")


@dataclass(frozen=True)
class SpecGateConfig:
    """The cost-aware speculation controller (backend/spec/gate.py): per step, speculate only when the expected
    tokens per second of drafting + verifying beat plain decoding, from step times and acceptance it learns."""

    # speculate only when the expected rate beats plain decoding's by this fraction (noise in the estimates)
    margin: float = 0.05
    # while speculation is off, one step in this many drafts anyway (a probe), so the acceptance and verify-cost
    # estimates follow changing conditions; while it is on, a plain step is forced when the batch bucket's plain
    # cost is older than 4x this many steps
    probe_interval: int = 16
    # ...and at most this share of plain decoding's time is spent on probes: a probe at a batch where a verify
    # costs several plain steps comes that many times less often (probe_interval is the shortest spacing)
    probe_overhead: float = 0.02
    # request outcomes of drafting steps seen (per method) before its acceptance estimate is trusted: until then
    # every step that can draft does (one unlucky first verify must not turn speculation off for long)
    explore_samples: int = 8
    # weight of a new sample in the exponential moving averages (step times, acceptance)
    ema_weight: float = 0.125
    # per request, the method-wide acceptance counts as this many verifies of prior (a new request starts there)
    prior_verifies: float = 2.0
    # the governor (backend/spec/governor.py): per batch bucket, speculation allowed or off by the tokens/s each
    # delivered, in trials of this many decode-only steps (0: no governor, the per-step rule alone)...
    governor_trial: int = 8
    # ...the winning mode holding for up to this many steps between trials of the other (growing while it wins)
    governor_max_hold: int = 1024

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin <= 1.0:
            raise ValueError(f"spec_gate.margin: must be in [0, 1], got {self.margin}")
        if self.probe_interval < 1:
            raise ValueError(f"spec_gate.probe_interval: must be >= 1, got {self.probe_interval}")
        if self.explore_samples < 1:
            raise ValueError(f"spec_gate.explore_samples: must be >= 1, got {self.explore_samples}")
        if not 0.0 < self.probe_overhead <= 1.0:
            raise ValueError(f"spec_gate.probe_overhead: must be in (0, 1], got {self.probe_overhead}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"spec_gate.ema_weight: must be in (0, 1], got {self.ema_weight}")
        if self.prior_verifies < 0:
            raise ValueError(f"spec_gate.prior_verifies: must be >= 0, got {self.prior_verifies}")
        if self.governor_trial < 0 or (self.governor_trial and self.governor_max_hold < self.governor_trial):
            raise ValueError(f"spec_gate.governor_trial, governor_max_hold: need 0 <= governor_trial <= "
                             f"governor_max_hold, got {self.governor_trial}, {self.governor_max_hold}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (backend/spec/): who drafts, how many tokens, and the drafters' knobs."""

    method: str | None = None  # None: off; one of SPEC_METHODS
    num_tokens: int = 4  # draft tokens per request per step, at most (K)
    # draft tokens per step over all requests; they also count against max_num_batched_tokens. Not applied where
    # the controller is on and the step's verify replays a CUDA graph (K + 1 rows per request whatever it carries)
    max_draft_tokens_per_step: int = 256
    ngram_min: int = 2  # prompt lookup: match the last n tokens, n from ngram_max down to ngram_min
    ngram_max: int = 4
    suffix_max_depth: int = 24  # longest substring the suffix tries index (pattern + continuation)
    suffix_min_prob: float = 0.1  # stop a draft when its estimated probability of survival drops below this
    suffix_max_spec_factor: float = 1.0  # a draft is at most this many times the matched pattern's length
    suffix_index_tokens: int = 8192  # a request's trie indexes only its last this many tokens (bounded host time)
    suffix_cached_requests: int = 256  # finished requests whose outputs the global trie keeps
    # finished outputs' tokens the suffix drafter indexes into its global trie per call (at least one output per call,
    # oldest first): a batch's drain is spread over calls instead of landing on one (backend/spec/suffix.py)
    suffix_drain_tokens: int = 128
    # dspark: the drafter folder (config.json + model.safetensors); None: the drafter shipped beside the
    # target (k3rt/models/<target>-dspark), resolved by the engine
    model: str | None = None
    # dspark: override the drafter's confidence_threshold (verify while the cumulative acceptance estimate
    # stays >= this; 0 verifies every draft); None keeps the drafter's own
    confidence_threshold: float | None = None
    # gpu runner on CUDA: verify steps and the dspark drafter's pass replay CUDA graphs (batches up to 64) where
    # decode steps do (EngineConfig.cuda_graphs); False runs them eagerly, the decode graphs kept
    cuda_graphs: bool = True
    # the cost-aware controller (backend/spec/gate.py): skip drafting in steps where a verify would not pay for
    # itself (learned step times and acceptance); False drafts every step the drafter can
    adaptive: bool = True
    # gpu runner, dspark: verify rounds one engine step may run on the device (backend/runner/gpu/rounds.py): a
    # step of greedy verify chunks runs round after round without the host, each round's drafts drafted on the
    # device from the round before; 1: every round is its own step. 16 by default: on the H200 (session 26,
    # benchmarks/RESULTS.md) the gate's speedups at 16 rounds beat 1 round's in every row (batch 1: 1.96-2.66x
    # against 1.12-1.53x); tokens of such a step stream together when it ends (~15 ms at batch 1 for k3-tiny)
    rounds: int = 16
    gate: SpecGateConfig = field(default_factory=SpecGateConfig)

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(f"spec: {self.method!r} not one of {', '.join(SPEC_METHODS)}")
        # 16: the KDA verify kernel's longest run, and within every grammar backend's rollback (outlines keeps 32)
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"spec_tokens: must be in [1, 16], got {self.num_tokens}")
        if not 1 <= self.rounds <= 64:
            raise ValueError(f"spec_rounds: must be in [1, 64], got {self.rounds}")
        if self.max_draft_tokens_per_step < 1:
            raise ValueError(f"max_draft_tokens_per_step: must be >= 1, got {self.max_draft_tokens_per_step}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min, ngram_max: need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.suffix_max_depth < 2:
            raise ValueError(f"suffix_max_depth: must be >= 2, got {self.suffix_max_depth}")
        if not 0.0 <= self.suffix_min_prob <= 1.0:
            raise ValueError(f"suffix_min_prob: must be in [0, 1], got {self.suffix_min_prob}")
        if self.suffix_max_spec_factor <= 0:
            raise ValueError(f"suffix_max_spec_factor: must be > 0, got {self.suffix_max_spec_factor}")
        if self.suffix_index_tokens < 1 or self.suffix_cached_requests < 0:
            raise ValueError("suffix_index_tokens must be >= 1 and suffix_cached_requests >= 0")
        if self.suffix_drain_tokens < 1:
            raise ValueError(f"suffix_drain_tokens: must be >= 1, got {self.suffix_drain_tokens}")
        if self.model is not None and self.method != "dspark":
            raise ValueError(f"spec_model: a drafter folder is read by --spec dspark only, got --spec {self.method}")
        if self.confidence_threshold is not None and not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"spec_confidence: must be in [0, 1], got {self.confidence_threshold}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class DistConfig:
    """Where the tensor-parallel ranks of one engine run and how they meet (torchrun-style rendezvous).

    Single host (nnodes 1): the engine process is rank 0 and starts ranks 1..tp-1 itself. Several hosts:
    each host runs tp/nnodes ranks, node `node_rank` holding ranks node_rank*(tp/nnodes) ...; node 0 runs
    the engine (rank 0) and the others only workers. Every rank meets at master_addr:master_port.
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port on this host (single host only)
    # a collective that waits longer than this fails the engine instead of hanging (a hung or lost rank);
    # idle engines keep it from firing with a heartbeat every timeout_s / 4
    timeout_s: float = 60.0
    startup_timeout_s: float = 900.0  # every rank has loaded its shard within this (big checkpoints)
    # every rank was started by an outside launcher (torchrun): the engine starts no workers and waits
    # for ranks 1..tp-1 to join
    external_ranks: bool = False
    # the launcher hosts the rendezvous store at master_addr:master_port (torchrun's agent store): rank 0
    # connects to it instead of hosting one
    agent_store: bool = False
    # LatentMoE's output under TP (backend/models/moe.py latent_tail): reduce-scatter the shared partial and
    # run the up-projection column-striped, one all-gather; or all-reduce with the replicated up-projection
    latent_tail: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    # small all-reduces through torch's symmetric memory (one kernel over NVLink) instead of NCCL: one host,
    # CUDA (backend/distributed/symm_all_reduce.py; not yet run on GPUs)
    symm_all_reduce: bool = False

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes: must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank} outside 0..{self.nnodes - 1}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port: must be in [0, 65535], got {self.master_port}")
        if self.master_port == 0 and self.nnodes > 1:
            raise ValueError("master_port: several nodes must agree on a port; set --master-port")
        if self.symm_all_reduce and self.nnodes > 1:
            raise ValueError(f"symm_all_reduce: symmetric memory spans one host, got nnodes={self.nnodes}")
        if not self.timeout_s > 0 or not self.startup_timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s} (startup {self.startup_timeout_s})")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # checkpoint folder
    dtype: str | None = None  # compute dtype; None: the checkpoint's
    device: str = "cpu"
    tp: int = 1
    # expert parallelism: the routed experts in `ep` groups of whole experts over the tp ranks, each expert's width
    # split over the tp / ep ranks of its group (1: none, every rank a 1/tp slice of every expert; tp: each rank
    # num_experts / tp whole experts; True/False are read as tp/1; k3rt.model_config.ep_degree)
    ep: int = 1
    # "model": the reference torch path (any device); "gpu": fused Triton kernels, device-side batch
    # description, decode in CUDA graphs; "null": no compute, fake tokens (scheduler benchmarks);
    # "auto": gpu on a CUDA device (any tp), model elsewhere
    runner: str = "auto"
    kernels: bool = True  # gpu runner: Triton kernels (off: the same path with torch ops; tests)
    # gpu runner: replay decode steps from captured CUDA graphs; with speculation also verify steps and the dspark
    # drafter's pass (batches up to 64, backend/runner/gpu/runner.py spec_graph_sizes)
    cuda_graphs: bool = True
    # gpu runner, with cuda_graphs on CUDA: steps with prefill rows replay piecewise graphs (every layer's attention
    # core eager between captured pieces; backend/runner/gpu/pieces.py) for token counts up to the step budget
    mixed_graphs: bool = True
    # test/debug (not a CLI flag): build the piecewise forward on every rank and run its pieces eagerly, never
    # captured, on any device (the replayed path less the capture: CPU/gloo tests of the pieces under TP, whose
    # workers no test can reach into; on CUDA it separates a capture problem from a piece problem). Needs
    # mixed_graphs; the decode graphs are unaffected
    mixed_pieces_eager: bool = False
    # overlap scheduling (backend/overlap.py): the host schedules and launches step N+1 while the device runs
    # step N, learning step N's tokens one step late; None (auto): on for the gpu runner on a CUDA device at tp=1.
    # The reference and null runners compute eagerly, so on them overlap only exercises the protocol (tests)
    overlap: bool | None = None
    use_pdl: bool = False  # gpu runner: programmatic dependent launch between chained decode kernels
    random_weights: bool = False  # build the model from its config with random weights (benchmarks)
    grammar_backend: str = "llguidance"  # or "outlines"
    seed: int = 0
    # batch-invariant numerics: each request's tokens are independent of batch composition, prefill
    # chunking and prefix-cache hits (fixed-tile matmuls, per-query MLA, recurrent KDA); slower, see
    # docs/deterministic.md
    deterministic: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.runner == "auto":
            object.__setattr__(self, "runner", "gpu" if self.device.startswith("cuda") else "model")
        if self.runner not in ("model", "gpu", "null"):
            raise ValueError(f"runner: {self.runner!r} not one of auto, model, gpu, null")
        if self.overlap is None:
            object.__setattr__(self, "overlap", self.runner == "gpu" and self.device.startswith("cuda") and self.tp == 1)
        if self.scheduler.prefill_delay_steps is None:
            graphs = self.runner == "gpu" and self.device.startswith("cuda") and self.cuda_graphs
            object.__setattr__(self, "scheduler", replace(self.scheduler,
                                                          prefill_delay_steps=PREFILL_DELAY_STEPS_GRAPHS if graphs else 0))
        if self.overlap and self.runner == "gpu" and self.tp > 1:
            # the GPU runner feeds step N's tokens into step N+1 on rank 0's device; the workers' plans carry
            # host token ids, which are not known yet when N+1 launches
            raise ValueError(f"overlap: the gpu runner overlaps steps at tp=1 only, got tp={self.tp}; set overlap=False")
        if (self.runner == "gpu" and self.kernels and not self.device.startswith("cuda")
                and os.environ.get("TRITON_INTERPRET") != "1"):
            raise ValueError(f"device: the gpu runner's Triton kernels need a CUDA device, got {self.device!r} "
                             "(use runner='model', or kernels=False for its torch-op path)")
        if self.runner == "gpu" and self.deterministic and not self.kernels:
            raise ValueError("deterministic: the gpu runner's batch-invariant mode needs its Triton kernels "
                             "(kernels=True), or use runner='model'")
        if self.mixed_pieces_eager and (self.runner != "gpu" or not self.mixed_graphs or self.deterministic):
            # the pieces belong to the gpu runner, which keeps them off in the batch-invariant mode
            # (GpuModelRunner): refused here rather than silently ignored
            raise ValueError(f"mixed_pieces_eager: needs runner='gpu' with mixed_graphs, not deterministic; got "
                             f"runner={self.runner!r}, mixed_graphs={self.mixed_graphs}, "
                             f"deterministic={self.deterministic}")
        if self.grammar_backend not in ("llguidance", "outlines"):
            raise ValueError(f"grammar_backend: {self.grammar_backend!r} not one of llguidance, outlines")
        if self.tp < 1:
            raise ValueError(f"tp: must be >= 1, got {self.tp}")
        object.__setattr__(self, "ep", ep_degree(self.ep, self.tp))
        if self.tp % self.dist.nnodes:
            raise ValueError(f"tp: {self.tp} ranks do not split evenly over nnodes={self.dist.nnodes}")
        if self.tp > 1 and self.random_weights:
            raise ValueError("random_weights: each rank would draw different weights for its shard; use tp=1")
        if self.deterministic and self.tp > 1:
            # the batch-invariant mode covers one rank's steps; the workers' shards (and the order of an
            # all-reduce) are not made batch-invariant (docs/deterministic.md)
            raise ValueError(f"deterministic: runs at tp=1 only, got tp={self.tp}")
        if self.tp > 1 and self.spec.enabled:
            # the workers would need the accepted length of every verify run to commit their KDA shards
            raise ValueError(f"spec: speculative decoding runs at tp=1 only for now, got tp={self.tp}")
        if self.dist.symm_all_reduce and (self.tp == 1 or self.device != "cuda"):
            raise ValueError(f"symm_all_reduce: needs tp > 1 on CUDA, got tp={self.tp}, device={self.device!r}")
        if self.tp > 1 and self.device not in ("cpu", "cuda"):
            # each rank takes its own device (cuda:<local rank>); a fixed index would put every rank on one GPU
            raise ValueError(f"device: with tp > 1 use 'cpu' or 'cuda' (one GPU per rank), got {self.device!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.dist.nnodes

    @property
    def node_ranks(self) -> range:
        """The ranks this node runs (node 0 holds rank 0, the engine)."""
        n = self.ranks_per_node
        return range(self.dist.node_rank * n, (self.dist.node_rank + 1) * n)
