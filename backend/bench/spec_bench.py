"""`k3rt bench spec`: speculative decoding against plain decoding, per workload, batch size and drafter.

Each (workload, batch size) runs its requests without speculation and with each drafter, greedy, in waves of
`batch` requests submitted together (`requests` per row at least, so a batch-1 row measures several prompts one
after another, not one prompt's luck: with k3-tiny's drafter on the CPU the first code prompt gave tau 2.62 and
16 prompts one after another 3.67), on one engine per drafter, all engines alive at once and sharing the
weights (the prefix cache is flushed and the drafter rebuilt before each run, so no run drafts from another's
outputs). Each round runs every drafter next to a plain run of its own (plain first or second, alternating), so
each ratio compares two adjacent runs: the speedup is the median over rounds of the pair's tokens/s ratio (the
host's speed drifts between runs far apart; with one plain run per round shared by every drafter, k3-tiny's
code at batch 64 on the H200 measured 0.96-0.98 in round 1 and 0.73-0.77 in round 2 for all three drafters
alike, speculating in under 1% of steps). Workloads:

  code   held-out code completion: windows of the stdlib modules k3-tiny and its drafter never trained on
         (CODE_MODULES, the corpus' HELDOUT_MODULES; serving code imports nothing from k3rt.training),
         each starting at a line start;
  chat   short questions through the model's chat template;
  agent  repetitive agent turns: each session's next prompt resends its history, the model's last output
         and a tool output that echoes it (a tool reading back the file the agent wrote), for `turns` turns.

Per row: tau = mean tokens a verify step emits (accepted drafts + the bonus token, i.e. (accepted + verifies)
/ verifies); draft ms = mean wall time of one drafter call (one batched pass for dspark); verify ms = mean
time of the steps that verified drafts and ran no prefill; plain ms = mean decode-only step time without
speculation at that batch size; tokens/s with and without speculation (generated tokens / wall time of the
run), their ratio, and whether the speculative outputs equal the plain ones token for token. On the CPU the
times are the reference path's; on CUDA the steps end with the sampled tokens on the host, so wall times
include the device work. On CUDA the GPU runner replays plain decode steps, verify steps (batch <= 64) and
the dspark drafter's pass from CUDA graphs (cuda_graphs=False: all eager; spec_graphs=False: verify steps and
the drafter eager, decode steps still replayed); `graph_verifies` counts the
verify steps that replayed a graph and `drafter_graphs` says whether the drafter's pass did.

The speculation controller (backend/spec/gate.py) is on unless spec_adaptive=False: `spec_share` is the share of
the steps in which some request could speculate that verified drafts (the rest the controller decoded plainly,
or the drafter had nothing), `skipped` the steps the controller turned down, `plan_whys` its plans by reason and
`controller` what it believed after the row (SpecGate.state: per bucket costs, acceptance, the governor's modes
and rates). Each method's engine (and so its
controller's learned costs) is kept across the rows and rounds, warm-up runs included. Counts and times are
summed over the rounds.
"""

from __future__ import annotations

import gc
import random
import statistics
import sysconfig
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from k3rt.backend.spec.cost import StepKind, classify, ran_prefill

WORKLOADS = ("code", "chat", "agent")
# training/corpus.py HELDOUT_MODULES (a test keeps the two equal): k3-tiny's held-out code
CODE_MODULES = (
    "base64", "calendar", "colorsys", "configparser", "filecmp", "fileinput", "fnmatch", "fractions",
    "gettext", "glob", "graphlib", "heapq", "ipaddress", "json", "netrc", "plistlib", "pprint", "queue",
    "reprlib", "sched", "shlex", "statistics", "string", "tempfile", "textwrap", "wave",
)
DRAFTERS = ("ngram", "suffix", "dspark")

_QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "Explain how a hash table handles collisions.",
    "Write a short function that reverses a string.",
    "How do I read a file line by line?",
    "What does the yield keyword do?",
    "Give an example of a context manager.",
    "How do I sort a dictionary by value?",
    "What is a closure?",
]


@dataclass(frozen=True)
class SpecBenchConfig:
    model: str = "k3-tiny"
    device: str = "cpu"
    runner: str = "auto"
    dtype: str | None = None
    random_weights: bool = False
    workloads: tuple[str, ...] = WORKLOADS
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    drafters: tuple[str, ...] = DRAFTERS
    spec_tokens: int = 7
    spec_model: str | None = None  # dspark drafter folder (None: the one shipped with the model)
    max_tokens: int = 64  # generated per request (per turn for agent)
    prompt_len: int = 96  # code prompts
    turns: int = 3  # agent turns per session
    # requests per row at least: a row runs ceil(requests / batch) waves of `batch` requests (each wave submitted
    # together, the next after it finishes), so small batches sample as many prompts as large ones; and `waves`
    # waves at least, so a large batch's run lasts long enough to time (64 x 64 tokens of k3-tiny on the H200: 0.2 s)
    requests: int = 8
    waves: int = 1
    seed: int = 0
    overlap: bool | None = None  # the engine's overlap scheduling (None: its default, on for the GPU runner)
    # batch-invariant numerics (docs/deterministic.md) for the plain and the speculative runs alike
    deterministic: bool = False
    cuda_graphs: bool = True  # the GPU runner's decode/verify graphs and the dspark drafter's (CUDA only)
    spec_graphs: bool = True  # the verify and drafter graphs alone (False: those eager, decode graphs kept)
    spec_adaptive: bool = True  # the speculation controller (False: every step that can draft does)
    # dspark on the GPU runner: verify rounds per step on the device (SpecConfig.rounds; rows then count a step of
    # several rounds as one verify step in their verify-time columns: tokens/s and speedup are per token)
    spec_rounds: int = 16  # SpecConfig.rounds' default
    # measured runs per engine and (workload, batch), the engines taking turns (rows sum counts and times over
    # them; speedup is the median of the rounds' ratios)
    rounds: int = 1
    # every engine-step call of the measured runs in the rows (SpecRow.trace_plain / trace_spec): for diagnosis
    trace: bool = False

    def __post_init__(self) -> None:
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise ValueError(f"workloads: {bad or 'none'} not among {', '.join(WORKLOADS)}")
        bad = [d for d in self.drafters if d not in DRAFTERS]
        if bad or not self.drafters:
            raise ValueError(f"drafters: {bad or 'none'} not among {', '.join(DRAFTERS)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes: need sizes >= 1, got {self.batch_sizes}")
        for name in ("max_tokens", "prompt_len", "turns", "rounds", "requests", "waves"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass
class SpecRow:
    workload: str
    batch: int
    drafter: str
    requests: int  # per run, in waves of `batch`
    spec_tokens: int
    tau: float  # (accepted + verifies) / verifies
    accept_rate: float  # accepted / drafted
    verifies: int
    draft_ms: float  # mean per drafter call
    verify_step_ms: float  # mean per step that verified (no prefill in it), less its drafter call
    plain_step_ms: float  # mean decode-only step without speculation, same batch
    verify_over_plain: float
    draft_over_plain: float
    tokens_per_s_plain: float
    tokens_per_s_spec: float
    # tokens/s spec / plain, wall clock over whole runs (prefills included): the median over rounds of the ratio
    # of the round's two runs (`speedups`, one per round)
    speedup: float
    # from the step times: plain_step_ms * tau / (verify_step_ms + draft_ms), the decode-phase speedup when every
    # step verifies (batch 1; at larger batches a step also carries plain decodes, so it is an estimate)
    step_speedup: float
    identical: bool
    speedups: list[float] = field(default_factory=list)
    graph_verifies: int = 0  # verify steps replayed from a CUDA graph
    drafter_graphs: bool = False  # the drafter's pass replayed CUDA graphs (dspark on CUDA)
    # of the steps in which some request could speculate, the share that verified drafts (the controller's choice)
    spec_share: float = 0.0
    skipped: int = 0  # steps the speculation controller decoded plainly
    # Triton binaries compiled inside the measured runs (CUDA only; 0 is the goal: a compile there is seconds of
    # the run's wall time, which the warm-up is for)
    compiles_plain: int = 0
    compiles_spec: int = 0
    compiled_kernels_plain: dict[str, int] = field(default_factory=dict)  # the compiles per kernel
    compiled_kernels_spec: dict[str, int] = field(default_factory=dict)
    # where each run's wall time went: engine-step calls by what they ran (_call_kind) -> [calls, ms]; the
    # drafter's calls under "draft" (their ms are inside the calls' too); "other": outside any step call
    time_plain: dict[str, list[float]] = field(default_factory=dict)
    time_spec: dict[str, list[float]] = field(default_factory=dict)
    # SpecBenchConfig.trace: per engine-step call [kind, running requests, call ms, drafter ms, draft tokens
    # verified, prefill tokens, decodes, device rounds planned, tokens the call delivered] in call order (empty
    # otherwise)
    trace_plain: list[list] = field(default_factory=list)
    trace_spec: list[list] = field(default_factory=list)
    # the controller's plans in the measured runs by reason (gate.Why: pays, not_worth, explore, probe, refresh,
    # cheap, off), and what it believed after them (SpecGate.state: costs, acceptance, the governor's modes)
    plan_whys: dict[str, int] = field(default_factory=dict)
    controller: dict = field(default_factory=dict)
    # SpecBenchConfig.trace: per round the controller's plans by reason in that run, and its state after the warm-up
    # (first) and after each round's run (a round's speedup depends on what the runs before taught it)
    whys_by_round: list[dict[str, int]] = field(default_factory=list)
    controller_by_round: list[dict] = field(default_factory=list)


def _call_kind(launched, collected) -> str:
    """What one engine-step call ran: "prefill" (a prefill chunk launched or read back), "verify" (it launched a
    verify step), "plain_overlap" (it launched a plain step and read back the one before), "plain_sync" (it
    launched a plain step and read that same step back: the synchronous path, or overlap given up because the
    next step drafts), "drain" (it launched nothing)."""
    if launched is None:
        return "drain"
    if ran_prefill(launched, collected):
        return "prefill"
    if classify(launched)[0] is StepKind.VERIFY:
        return "verify"
    return "plain_sync" if any(o is launched for o in collected) else "plain_overlap"


@dataclass
class _Run:
    outputs: list[list[int]]
    wall_s: float
    tokens: int
    step_ms: list[float]  # decode-only steps (plain) or verify steps without prefill (spec)
    draft_ms: list[float]
    verifies: int
    drafted: int
    accepted: int
    graph_verifies: int = 0
    drafter_graphs: bool = False
    spec_steps: int = 0
    speculated: int = 0
    skipped: int = 0
    compiles: int = 0  # Triton binaries compiled during the run (CUDA; kernels/jit_probe.py)
    compiled_kernels: dict[str, int] = field(default_factory=dict)  # of those, per kernel
    time_ms: dict[str, list[float]] = field(default_factory=dict)  # SpecRow.time_plain / time_spec
    trace: list[list] = field(default_factory=list)  # SpecRow.trace_plain / trace_spec
    whys: dict[str, int] = field(default_factory=dict)  # the controller's plans in the run by reason


def _code_sources() -> list[str]:
    """The modules' sources in relative-path order with newlines normalized, as the training corpus reads them
    (so the prompts are the ones the drafter's held-out evaluation draws)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for m in CODE_MODULES:
        single = root / f"{m}.py"
        paths += [single] if single.is_file() else [p for p in (root / m).rglob("*.py") if "__pycache__" not in p.parts]
    if not paths:
        raise ValueError(f"workloads: code needs the Python stdlib sources, none found under {root}")
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    return [p.read_text(encoding="utf-8").replace("\r\n", "\n").replace("\r", "\n") for p in paths]


def _code_prompts(tok, num: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`num` windows of `prompt_len` tokens of held-out stdlib code."""
    return code_windows(_code_sources(), tok, num, prompt_len, seed)


def code_windows(texts: Sequence[str], tok, num: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`num` windows of `prompt_len` tokens of these texts, each starting at a line start of a random text (a
    served prompt's sequence prefix first). The DSpark trainer's held-out prompts are these too."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < num:
        text = rng.choice(texts)
        starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        begin = rng.choice(starts[:max(1, len(starts) - 20)])
        ids = [*tok.sequence_prefix, *tok.encode(text[begin:begin + 8 * prompt_len])]
        if len(ids) >= prompt_len:
            out.append(ids[:prompt_len])
    return out


def requests_per_row(batch: int, requests: int, waves: int = 1) -> int:
    """`requests` rounded up to whole waves of `batch`, `waves` waves at least."""
    return batch * max(waves, -(-requests // batch))


def _prompts(cfg: SpecBenchConfig, tok, workload: str, batch: int) -> list[list[int]]:
    """The row's prompts, requests_per_row of them: the first `batch` are the same whatever `requests` is."""
    n = requests_per_row(batch, cfg.requests, cfg.waves)
    if workload == "code":
        return _code_prompts(tok, n, cfg.prompt_len, seed=cfg.seed * 1000 + batch)
    texts = [_QUESTIONS[i % len(_QUESTIONS)] + (f" (question {i})" if i >= len(_QUESTIONS) else "")
             for i in range(n)]
    if workload == "chat" and tok.chat_template is not None:
        return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    if workload == "chat":
        return [tok.encode_prompt(t) for t in texts]
    # agent: a tool-using session's first turn; later turns are built from the outputs (_agent_turn)
    return [tok.encode_prompt(f"# task {i}: {t}\n# plan, then call tools\n") for i, t in enumerate(texts)]


def _agent_turn(tok, prompt: list[int], output: list[int], echo_len: int | None = None) -> list[int]:
    """History + the model's turn + a tool result that echoes it (the agent's file, read back). echo_len (the
    warm-up): the echo repeated to that length (the measured turn's output length), so the part of the next
    prompt past the cached history (the prefill) is as long as the measured turn's."""
    return prompt + output + tok.encode("\n# tool read_file ->\n") + _padded(output, echo_len) + \
        tok.encode("\n# next step\n")


def _padded(output: list[int], length: int | None) -> list[int]:
    """`output` repeated up to `length` tokens (None: as it is)."""
    if length is None or not output:
        return output
    return (output * -(-length // len(output)))[:length]


def _compiled(eng) -> dict[str, int]:
    """Triton binaries the GPU runner's kernels hold now, per kernel (kernels/jit_probe.py); {} off CUDA."""
    if not str(eng.cfg.device).startswith("cuda"):
        return {}
    from k3rt.kernels.jit_probe import compiled_counts

    return compiled_counts()


def _run(eng, prompts: list[list[int]], cfg: SpecBenchConfig, tok, workload: str, *, batch: int,
         turn_output_len: int | None = None) -> _Run:
    """One run of `workload` on these prompts, in waves of `batch` (an agent wave runs all its turns before the
    next wave starts). turn_output_len (the warm-up): each agent turn's echoed output is
    repeated to this length in the next turn's prompt, so the warm-up's later turns prefill as many new tokens
    as the measured turns (their cached history is shorter: it holds the warm-up's few generated tokens) while
    generating only cfg.max_tokens per turn."""
    from k3rt.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    step_ms: list[float] = []
    draft_ms: list[float] = []
    # timed per engine step, classified by what that step scheduled: with overlap scheduling (the GPU
    # runner's default) the runner's execute is not called and a step's wall time spans the device's step
    step, schedule = eng.step, eng.scheduler.schedule
    scheduled: list = []
    time_ms: dict[str, list[float]] = {}
    trace: list[list] = []

    def account(kind: str, ms: float) -> None:
        slot = time_ms.setdefault(kind, [0, 0.0])
        slot[0] += 1
        slot[1] += ms

    def recording_schedule():
        out = schedule()
        scheduled.append(out)
        return out

    def timed_step():
        scheduled.clear()
        drafts_before = len(draft_ms)
        t0 = time.perf_counter()
        res = step()
        # the scheduler drafts inside the step: its time is the draft column's, not the verify step's
        call_ms = (time.perf_counter() - t0) * 1e3
        dt = call_ms - sum(draft_ms[drafts_before:])
        kind = _call_kind(*eng.last_step)
        account(kind, call_ms)
        if len(draft_ms) > drafts_before:
            account("draft", sum(draft_ms[drafts_before:]))
        if cfg.trace:
            launched = eng.last_step[0]
            chunks = launched.chunks if launched is not None else ()
            trace.append([kind, len(eng.scheduler.running), round(call_ms, 3), round(call_ms - dt, 3),
                          sum(len(c.draft_ids) for c in chunks),
                          sum(c.num_tokens for c in chunks if not c.draft_ids),
                          len(launched.decodes) if launched is not None else 0,
                          launched.spec_rounds if launched is not None else 0,
                          sum(len(o.new_token_ids) for o in res)])
        for out in scheduled:
            verify = any(c.draft_ids for c in out.chunks)
            prefill = any(not c.draft_ids for c in out.chunks)
            if not prefill and (verify or (out.decodes and eng.scheduler.drafter is None)):
                step_ms.append(dt)
        return res

    drafter = eng.scheduler.drafter
    if drafter is not None:
        propose = drafter.propose_scored  # what the scheduler calls

        def timed_propose(queries, full=False):
            t0 = time.perf_counter()
            res = propose(queries, full)
            draft_ms.append((time.perf_counter() - t0) * 1e3)
            return res

        drafter.propose_scored = timed_propose
    eng.step, eng.scheduler.schedule = timed_step, recording_schedule
    s0 = (eng.stats.spec_verifies, eng.stats.spec_drafted_tokens, eng.stats.spec_accepted_tokens,
          eng.stats.spec_steps, eng.stats.spec_steps_speculated, eng.stats.spec_steps_skipped)
    errors0 = eng.stats.spec_drafter_errors
    g0 = getattr(eng.runner, "verify_graph_replays", 0)
    whys0 = dict(eng.stats.spec_plan_whys)
    outputs: list[list[int]] = []
    compiled0 = _compiled(eng)
    t0 = time.perf_counter()
    try:
        turns = cfg.turns if workload == "agent" else 1
        for start in range(0, len(prompts), batch):
            wave = prompts[start:start + batch]
            for _ in range(turns):
                outs = [o.output_ids for o in eng.generate(wave, params)]
                outputs += outs
                if workload == "agent":
                    wave = [_agent_turn(tok, p, o, turn_output_len) for p, o in zip(wave, outs)]
    finally:
        eng.step, eng.scheduler.schedule = step, schedule
        if drafter is not None:  # a drafter kept for the next run (dspark) must not time into this run's list
            drafter.propose_scored = propose
    wall = time.perf_counter() - t0
    if eng.stats.spec_drafter_errors > errors0:
        # the engine carries on without drafts, so the row would time plain decoding under the drafter's name (an
        # H200 gate call did: a wrapper here took the wrong arguments and every drafter call raised)
        raise RuntimeError(f"the drafter raised in {eng.stats.spec_drafter_errors - errors0} calls of a measured run "
                           "(the log has the tracebacks): its row would measure plain decoding")
    time_ms["other"] = [0, wall * 1e3 - sum(v[1] for k, v in time_ms.items() if k != "draft")]
    compiled_now = _compiled(eng)
    compiled = _count_delta(compiled_now, compiled0)
    s = eng.stats
    return _Run(outputs, wall, sum(map(len, outputs)), step_ms, draft_ms, s.spec_verifies - s0[0],
                s.spec_drafted_tokens - s0[1], s.spec_accepted_tokens - s0[2],
                getattr(eng.runner, "verify_graph_replays", 0) - g0, getattr(drafter, "graphs", None) is not None,
                s.spec_steps - s0[3], s.spec_steps_speculated - s0[4], s.spec_steps_skipped - s0[5],
                compiles=sum(compiled.values()), compiled_kernels=compiled,
                time_ms={k: [int(n), round(ms, 3)] for k, (n, ms) in time_ms.items()}, trace=trace,
                whys=_count_delta(s.spec_plan_whys, whys0))


def _count_delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in sorted(now.items()) if n > before.get(k, 0)}


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out


def _merge(runs: Sequence[_Run]) -> _Run:
    """One run's figures summed (counts, times) or concatenated (step and drafter times) over rounds; the
    outputs and traces are the first round's."""
    first = runs[0]
    time_ms: dict[str, list[float]] = {}
    for r in runs:
        for k, (n, ms) in r.time_ms.items():
            slot = time_ms.setdefault(k, [0, 0.0])
            slot[0] += n
            slot[1] = round(slot[1] + ms, 3)
    return _Run(first.outputs, sum(r.wall_s for r in runs), sum(r.tokens for r in runs),
                [x for r in runs for x in r.step_ms], [x for r in runs for x in r.draft_ms],
                sum(r.verifies for r in runs), sum(r.drafted for r in runs), sum(r.accepted for r in runs),
                sum(r.graph_verifies for r in runs), first.drafter_graphs, sum(r.spec_steps for r in runs),
                sum(r.speculated for r in runs), sum(r.skipped for r in runs), compiles=sum(r.compiles for r in runs),
                compiled_kernels=_sum_counts(r.compiled_kernels for r in runs), time_ms=time_ms, trace=first.trace,
                whys=_sum_counts(r.whys for r in runs))


def step_speedup(plain_ms: float, verify_ms: float, draft: float, tau: float) -> float:
    """Tokens per ms of a drafting + verifying step over a plain step's, from the step times (0: no verify)."""
    if not tau or not plain_ms or verify_ms + draft <= 0:
        return 0.0
    return plain_ms * tau / (verify_ms + draft)


WARMUP_TOKENS = 8  # tokens per request of the untimed run before each measured one


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def bench_spec(cfg: SpecBenchConfig, progress: bool = True) -> list[SpecRow]:
    """Every (workload, batch, drafter) row; raises ValueError naming the option for bad input."""
    import torch
    from tqdm import tqdm

    from k3rt.backend.engine import Engine, cache_geometry
    from k3rt.backend.models.loader import load_model
    from k3rt.backend.spec.base import create_drafter
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from k3rt.model_config import load_model_config
    from k3rt.models import resolve_drafter_dir, resolve_model_dir

    model_dir = resolve_model_dir(cfg.model)
    cfg = replace(cfg, model=str(model_dir))
    spec_model = str(resolve_drafter_dir(cfg.spec_model, model_dir)) if "dspark" in cfg.drafters else None
    tok = load_tokenizer(model_dir)
    mcfg = load_model_config(model_dir)
    if cfg.random_weights:
        from k3rt.backend.models.random_init import random_model

        model = random_model(mcfg, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed, progress=progress)
    else:
        model = load_model(model_dir, dtype=cfg.dtype, device=cfg.device, progress=progress)
    prompts = {(w, b): _prompts(cfg, tok, w, b) for w in cfg.workloads for b in cfg.batch_sizes}
    bmax = max(cfg.batch_sizes)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    if "agent" in cfg.workloads:  # each turn adds two outputs and two short tags
        longest += cfg.turns * (2 * cfg.max_tokens + 24)
    base = EngineConfig(model=str(model_dir), dtype=cfg.dtype, device=cfg.device, runner=cfg.runner,
                        seed=cfg.seed, overlap=cfg.overlap, deterministic=cfg.deterministic,
                        cuda_graphs=cfg.cuda_graphs,
                        scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, bmax * 16), max_running=max(bmax, 1)))
    layout, _ = cache_geometry(base, mcfg)
    per_req = -(-(longest + cfg.max_tokens + cfg.spec_tokens + 1) // layout.block_size) + 2 * layout.pages_per_state_set
    base = replace(base, cache=CacheConfig(num_pages=bmax * per_req * 2 + 64))

    methods = [None, *cfg.drafters]
    engines: dict[str, Engine] = {}
    for method in methods:
        spec = SpecConfig() if method is None else SpecConfig(method=method, num_tokens=cfg.spec_tokens,
                                                              model=spec_model if method == "dspark" else None,
                                                              cuda_graphs=cfg.spec_graphs,
                                                              adaptive=cfg.spec_adaptive, rounds=cfg.spec_rounds)
        engines[method or "plain"] = Engine(replace(base, spec=spec), model=model)
    runs: dict[tuple[str, int, str], list[_Run]] = {}
    controllers: dict[tuple[str, int, str], dict] = {}
    states: dict[tuple[str, int, str], list[dict]] = {}  # cfg.trace: the controller after the warm-up and each run
    bar = tqdm(total=2 * len(cfg.drafters) * len(prompts) * cfg.rounds, desc="bench spec", unit="run",
               disable=not progress)
    try:
        for (w, b), ps in prompts.items():
            for eng in engines.values():
                # warm-up on the measured workload itself, untimed: these very prompts, every agent turn (each
                # turn prefilling as many new tokens as the measured one), so what compiles for their prefill and
                # batch shapes (tile choices by size; per-step sizes are not specialized, kernels/common.py)
                # compiles outside the measured runs; on the H200 the measured runs otherwise timed compiles
                # (plain k3-tiny at 30 tokens/s instead of ~700 on the first method's runs). Few tokens per
                # request and turn: the warm-up's cost stays bounded
                eng.flush_cache()
                _run(eng, ps, replace(cfg, max_tokens=min(cfg.max_tokens, WARMUP_TOKENS)), tok, w, batch=b,
                     turn_output_len=cfg.max_tokens)
            for name, eng in engines.items():
                if cfg.trace and eng.scheduler.gate is not None:
                    states[(w, b, name)] = [eng.scheduler.gate.state()]
            for rnd in range(cfg.rounds):
                # each drafter next to a plain run of its own, the drafters' order rotating and plain going first
                # and second in turn: the host's speed drifts by up to ~1.35x over tens of seconds on the H200's
                # machine (benchmarks/spec_upkeep.py, session 16), so only adjacent runs are compared
                drafters = list(cfg.drafters)
                drafters = drafters[rnd % len(drafters):] + drafters[:rnd % len(drafters)]
                for i, d in enumerate(drafters):
                    for name in (("plain", d) if (rnd + i) % 2 == 0 else (d, "plain")):
                        eng = engines[name]
                        eng.flush_cache()
                        # a fresh drafter: no run drafts from another's outputs (dspark keeps nothing between
                        # requests: its drafter, with the CUDA graphs it captured, is kept)
                        if name not in ("plain", "dspark"):
                            eng.scheduler.drafter = create_drafter(eng.cfg.spec, model)
                        bar.set_postfix_str(f"{name} {w} b={b} round {rnd + 1}")
                        key = (w, b, name) if name != "plain" else (w, b, f"plain/{d}")
                        runs.setdefault(key, []).append(_run(eng, ps, cfg, tok, w, batch=b))
                        if (w, b, name) in states:
                            states[(w, b, name)].append(eng.scheduler.gate.state())
                        bar.update()
            for name, eng in engines.items():
                if eng.scheduler.gate is not None:
                    controllers[(w, b, name)] = eng.scheduler.gate.state()
    finally:
        bar.close()
        for eng in engines.values():
            eng.close()
        engines.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    rows = []
    for (w, b), ps in prompts.items():
        for d in cfg.drafters:
            plains = runs[(w, b, f"plain/{d}")]  # the plain runs paired with this drafter's, round by round
            plain = _merge(plains)
            plain_ms = _mean(plain.step_ms)
            specs = runs[(w, b, d)]
            r = _merge(specs)
            verify_ms, draft = _mean(r.step_ms), _mean(r.draft_ms)
            tau = (r.accepted + r.verifies) / r.verifies if r.verifies else 0.0
            # per round: the speculative run's tokens/s over the plain run's of the same round
            ratios = [(s.tokens / s.wall_s) / (p.tokens / p.wall_s) for s, p in zip(specs, plains)]
            rows.append(SpecRow(w, b, d, len(ps), cfg.spec_tokens, tau=tau,
                                accept_rate=r.accepted / r.drafted if r.drafted else 0.0, verifies=r.verifies,
                                draft_ms=draft, verify_step_ms=verify_ms, plain_step_ms=plain_ms,
                                verify_over_plain=verify_ms / plain_ms if plain_ms else 0.0,
                                draft_over_plain=draft / plain_ms if plain_ms else 0.0,
                                tokens_per_s_plain=statistics.median(p.tokens / p.wall_s for p in plains),
                                tokens_per_s_spec=statistics.median(s.tokens / s.wall_s for s in specs),
                                speedup=statistics.median(ratios), speedups=[round(x, 4) for x in ratios],
                                step_speedup=step_speedup(plain_ms, verify_ms, draft, tau),
                                identical=all(s.outputs == p.outputs for s, p in zip(specs, plains)),
                                graph_verifies=r.graph_verifies, drafter_graphs=r.drafter_graphs,
                                spec_share=r.speculated / r.spec_steps if r.spec_steps else 0.0, skipped=r.skipped,
                                compiles_plain=plain.compiles, compiles_spec=r.compiles,
                                compiled_kernels_plain=plain.compiled_kernels, compiled_kernels_spec=r.compiled_kernels,
                                time_plain=plain.time_ms, time_spec=r.time_ms, trace_plain=plains[0].trace,
                                trace_spec=specs[0].trace, plan_whys=r.whys, controller=controllers.get((w, b, d), {}),
                                whys_by_round=[s.whys for s in specs] if cfg.trace else [],
                                controller_by_round=states.get((w, b, d), [])))
    return rows


def rows_json(rows: Sequence[SpecRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def format_table(rows: Sequence[SpecRow]) -> str:
    """A markdown table, one line per row."""
    head = ("| workload | batch | requests | drafter | K | tau | accept | verifies | draft ms | verify ms | plain ms | "
            "verify/plain | draft/plain | tok/s plain | tok/s spec | speedup | step speedup | identical | "
            "graph verifies | drafter graphs | spec share | skipped | compiles |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r.workload} | {r.batch} | {r.requests} | {r.drafter} | {r.spec_tokens} | {r.tau:.2f} | "
                     f"{r.accept_rate:.2f} | {r.verifies} | {r.draft_ms:.2f} | {r.verify_step_ms:.2f} | "
                     f"{r.plain_step_ms:.2f} | {r.verify_over_plain:.2f} | {r.draft_over_plain:.2f} | "
                     f"{r.tokens_per_s_plain:.1f} | {r.tokens_per_s_spec:.1f} | {r.speedup:.2f} | "
                     f"{r.step_speedup:.2f} | "
                     f"{'yes' if r.identical else 'NO'} | {r.graph_verifies} | {'yes' if r.drafter_graphs else 'no'} | "
                     f"{r.spec_share:.2f} | {r.skipped} | {r.compiles_plain}/{r.compiles_spec} |")
    return "\n".join(lines)


def parse_list(text: str, name: str, cast: Callable = str) -> tuple:
    """A comma-separated option value -> a tuple, or ValueError naming the option."""
    try:
        return tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{name}: expected a comma-separated list, got {text!r}") from None
