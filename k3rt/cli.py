"""The `k3rt` command line. Subcommands import the engine lazily, so `k3rt --help` and
`k3rt inspect` stay fast and need no torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from k3rt.models import DEFAULT_MODEL, resolve_model_dir

if TYPE_CHECKING:
    from k3rt.config import DistConfig, EngineConfig

MODEL_HELP = (f"checkpoint folder (config.json, *.safetensors, tokenizer files) or the name of a model shipped "
              f"with k3rt (default {DEFAULT_MODEL})")

EXAMPLES = """examples:
  k3rt make-tiny --arch k3 --out /tmp/tiny-k3           # small random checkpoint + tokenizer
  k3rt generate --model /tmp/tiny-k3 --prompt "def add(a, b):" --max-tokens 32 --temperature 0
  k3rt generate --prompt "def fibonacci(n):"             # the shipped default model (k3-tiny)
  k3rt inspect --model /tmp/tiny-k3 --tp 2 --json      # sizes from config.json alone
  k3rt quantize --model /tmp/tiny-k3 --out /tmp/tiny-k3-mxfp4 --mxfp4-experts
  k3rt inspect --model kimi-linear-48b --memory-gb 40  # a config-only preset
  k3rt bench cache --workload system-prompt --block-size 1920
  k3rt bench scheduler
  k3rt bench tp --tp 1 2 --batch 1 16 64                # decode under tensor parallelism (GPUs), latent tail
  k3rt bench serve --url http://127.0.0.1:30000 --workload system-prompt --concurrency 16
  k3rt serve --model /tmp/tiny-k3 --port 30000          # OpenAI-compatible server (GET /health, /v1/...)
  k3rt serve --model /tmp/tiny-k3 --tp 2                # tensor parallel: the engine + 1 worker process
"""


def _add_tp(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "tensor parallelism",
        "--tp N runs the model on N ranks (processes; one GPU each with --device cuda), each holding 1/N of "
        "every layer's heads and widths. On one host the engine is rank 0 and starts ranks 1..N-1 itself. "
        "Several hosts: run the same command on each with --nnodes, --node-rank and one --master-addr/"
        "--master-port (node 0 serves; the others only run their ranks). Under torchrun (RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT set) each process is one rank: rank 0 serves, the others run as workers.")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                   help="tensor-parallel degree (default 1, or WORLD_SIZE under torchrun)")
    g.add_argument("--ep", "--expert-parallel-size", dest="ep", type=int, nargs="?", const=True, default=1,
                   metavar="M",
                   help="expert parallelism: the routed experts in M groups of whole experts (M divides --tp), each "
                        "expert's width split over the N/M ranks of its group; --ep alone: M = N, every rank "
                        "num_experts/N whole experts (default 1: each rank 1/N of every expert's width)")
    g.add_argument("--nnodes", type=int, default=1, help="hosts the ranks are spread over (default 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this host's index among them (default 0)")
    g.add_argument("--master-addr", default=None,
                   help="address of node 0, where the ranks meet (default MASTER_ADDR or 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="port there (default MASTER_PORT, or a free port on a single host)")
    g.add_argument("--latent-tail", choices=["reduce_scatter", "all_reduce"], default="reduce_scatter",
                   help="LatentMoE (K3) under --tp: reduce_scatter runs the latent up-projection column-striped "
                        "(each rank reads 1/N of it) between a reduce-scatter of the shared expert and one "
                        "all-gather; all_reduce all-reduces and runs it replicated (default reduce_scatter)")
    g.add_argument("--tp-symm-allreduce", action="store_true",
                   help="all-reduces up to 1 MiB (decode activations) through torch symmetric memory, one kernel "
                        "over NVLink, instead of NCCL; one host, CUDA (not yet measured)")
    g.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds a collective may wait before the engine fails instead of hanging (a lost or hung "
                        "rank); a dead local worker fails it at once (default 60)")


def _dist_from_args(a: argparse.Namespace) -> tuple[int, "DistConfig", int]:
    """-> (tp, DistConfig, this process's role: 0 = the engine (rank 0), r > 0 = rank r under torchrun,
    -1 = a node other than node 0, which only runs its ranks)."""
    from k3rt.config import DistConfig
    from k3rt.launch_env import LaunchEnv

    env = LaunchEnv.read()
    if env.launched:
        tp = a.tp or env.world_size
        if tp != env.world_size:
            raise ValueError(f"tp: {tp} but the launcher started WORLD_SIZE={env.world_size} ranks")
        dist = DistConfig(nnodes=a.nnodes, node_rank=env.rank * a.nnodes // tp,
                          master_addr=a.master_addr or env.master_addr or "127.0.0.1",
                          master_port=a.master_port if a.master_port is not None else env.master_port or 0,
                          timeout_s=a.tp_timeout, external_ranks=True, agent_store=env.agent_store,
                          latent_tail=a.latent_tail, symm_all_reduce=a.tp_symm_allreduce)
        return tp, dist, env.rank
    dist = DistConfig(nnodes=a.nnodes, node_rank=a.node_rank, master_addr=a.master_addr or env.master_addr or "127.0.0.1",
                      master_port=a.master_port if a.master_port is not None else env.master_port or 0,
                      timeout_s=a.tp_timeout, latent_tail=a.latent_tail, symm_all_reduce=a.tp_symm_allreduce)
    return a.tp or 1, dist, 0 if a.node_rank == 0 else -1


def _run_other_rank(engine: "EngineConfig", role: int) -> int:
    """Roles other than the engine: a torchrun-started worker rank, or a non-zero node's ranks."""
    if role > 0:
        from k3rt.backend.distributed.group import Rendezvous
        from k3rt.backend.distributed.launch import WorkerArgs
        from k3rt.backend.distributed.worker import serve_rank

        rdv = Rendezvous(engine.dist.master_addr, engine.dist.master_port)
        return serve_rank(WorkerArgs(engine, role, rdv))
    from k3rt.backend.distributed.worker import run_node

    return run_node(engine)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (reference CPU path)",
                       description="Generate a completion on the plain-torch reference path, with an incremental "
                                   "KDA state and MLA cache. Streams text unless --json.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--prompt", required=True, help="prompt text (tokenized as is, no chat template)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for sampling (default: random)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: the checkpoint's torch_dtype)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: the same tokens as `k3rt serve --deterministic` gives this prompt in any batch, "
                        "greedy ones with or without --spec (slower; docs/deterministic.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt_token_ids, token_ids, text")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; with --tp: cpu or cuda)")
    _add_tp(p)
    _add_spec_args(p)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    from k3rt.config import SPEC_METHODS, SpecConfig

    p.add_argument("--spec", choices=SPEC_METHODS, default=None,
                   help="speculative decoding: 'ngram' (prompt lookup), 'suffix' (suffix tries over the request and "
                        "recent outputs) or 'dspark' (a DSpark block drafter on the target's hidden states, "
                        "docs/dspark.md); off by default")
    p.add_argument("--spec-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per request per step, at most (default 4; dspark: the drafter's block_size)")
    p.add_argument("--spec-model", default=None, metavar="DIR",
                   help="--spec dspark: the drafter folder (config.json + model.safetensors; default: the drafter "
                        "shipped with the target, k3rt/models/k3-tiny-dspark for k3-tiny)")
    p.add_argument("--spec-confidence", type=float, default=None, metavar="P",
                   help="--spec dspark: verify a request's drafts while the drafter's cumulative acceptance estimate "
                        "stays >= P (0 verifies every draft; default: the drafter's confidence_threshold)")
    p.add_argument("--no-spec-graphs", action="store_true",
                   help="gpu runner on CUDA: run verify steps and the dspark drafter's pass eagerly (by default they "
                        "replay CUDA graphs captured at --spec-tokens for batches up to 64; decode graphs are kept; "
                        "--no-cuda-graphs turns off both)")
    p.add_argument("--spec-rounds", type=int, default=SpecConfig.rounds, metavar="N",
                   help="--spec dspark on the gpu runner: up to N verify rounds per engine step on the device "
                        "(greedy requests without grammar, logprobs, logit bias or penalties): each round's "
                        "acceptance, commit, drafter pass and next verify run as one CUDA graph with no host round "
                        "trip, and the step's tokens are read back once, streaming together when the step ends "
                        f"(default {SpecConfig.rounds}; 1: every round is its own step, tokens streaming once per "
                        "round)")
    _add_spec_adaptive(p)


def _add_spec_adaptive(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="the speculation controller (default on): it learns what a plain decode step, a verify step "
                        "and the drafter's pass cost at each batch size from the engine's own step times, and how many "
                        "drafts each request gets accepted, and drafts only in steps where drafting + verifying is "
                        "expected to emit tokens faster than plain decoding (now and then it drafts anyway, to notice "
                        "when that changes); --no-spec-adaptive drafts in every step the drafter can")


def _spec_config(a: argparse.Namespace):
    from k3rt.config import SpecConfig

    num_tokens, model = a.spec_tokens, a.spec_model
    if a.spec == "dspark":
        from k3rt.models import resolve_drafter_dir

        model = str(resolve_drafter_dir(model, a.model))
        if num_tokens is None:
            cfg_path = Path(model) / "config.json"
            try:
                num_tokens = int(json.loads(cfg_path.read_text())["block_size"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"spec_model: cannot read block_size from {cfg_path}: {e}") from None
    return SpecConfig(method=a.spec, num_tokens=4 if num_tokens is None else num_tokens, model=model,
                      confidence_threshold=a.spec_confidence, cuda_graphs=not a.no_spec_graphs,
                      adaptive=a.spec_adaptive, rounds=a.spec_rounds)


def _cmd_generate(a: argparse.Namespace) -> int:
    from k3rt.sampling_params import SamplingParams

    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                            max_tokens=a.max_tokens, ignore_eos=a.ignore_eos)
    spec = _spec_config(a)
    if spec.enabled:
        if (a.tp or 1) > 1:
            raise ValueError(f"spec: speculative decoding runs at tp=1 only for now, got --tp {a.tp}")
        return _generate_speculative(a, params, spec)
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.backend.tokenizer.detokenizer import IncrementalDetokenizer

    model_dir = resolve_model_dir(a.model)
    tp, dist, role = _dist_from_args(a)
    if tp > 1:
        from k3rt.config import EngineConfig

        engine = EngineConfig(model=str(model_dir), dtype=a.dtype, device=a.device, tp=tp, ep=a.ep, runner="model",
                              dist=dist, seed=a.seed or 0, deterministic=a.deterministic)
        if role != 0:
            return _run_other_rank(engine, role)
    tok = load_tokenizer(model_dir)
    prompt_ids = tok.encode_prompt(a.prompt)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    out: list[int] = []
    if tp > 1:
        tokens = _generate_tp(engine, prompt_ids, params, tok.eos_token_ids)
    else:
        from k3rt.backend.generate import generate
        from k3rt.backend.models.loader import load_model

        model = load_model(model_dir, dtype=a.dtype, device=a.device, progress=not a.json)
        model.set_batch_invariant(a.deterministic)
        tokens = generate(model, prompt_ids, params, tok.eos_token_ids)
    for t in tokens:
        out.append(t)
        if not a.json:
            sys.stdout.write(detok.push(t))
            sys.stdout.flush()
    if a.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": out, "text": tok.decode(out, skip_special_tokens=True)}))
    else:
        sys.stdout.write(detok.flush() + "\n")
    return 0


def _generate_tp(engine: "EngineConfig", prompt_ids: list[int], params, eos: list[int]):
    """The tensor-parallel path of `generate`: one request through the engine (rank 0), token by token."""
    from k3rt.backend.engine import Engine

    eng = Engine(engine)
    try:
        eng.add_request(prompt_ids, params, eos_token_ids=eos)
        while eng.has_unfinished:
            for o in eng.step():
                if o.error:
                    raise RuntimeError(o.error)
                yield from o.new_token_ids
    finally:
        eng.close()


def _generate_speculative(a: argparse.Namespace, params, spec) -> int:
    """`generate --spec`: the engine with a drafter (on --device: the GPU runner on CUDA, the reference runner
    elsewhere), one request; reports tau."""
    from k3rt.backend.engine import Engine
    from k3rt.backend.tokenizer import load_tokenizer
    from k3rt.backend.tokenizer.detokenizer import IncrementalDetokenizer
    from k3rt.config import EngineConfig

    model_dir = resolve_model_dir(a.model)
    tok = load_tokenizer(model_dir)
    eng = Engine(EngineConfig(model=str(model_dir), dtype=a.dtype, device=a.device, spec=spec,
                              deterministic=a.deterministic))
    prompt_ids = tok.encode_prompt(a.prompt)
    eng.add_request(prompt_ids, params, eos_token_ids=tok.eos_token_ids)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    out: list[int] = []
    while eng.has_unfinished:
        for o in eng.step():
            out.extend(o.new_token_ids)
            if not a.json:
                sys.stdout.write("".join(detok.push(t) for t in o.new_token_ids))
                sys.stdout.flush()
    s = eng.stats
    info = {"drafted_tokens": s.spec_drafted_tokens, "accepted_tokens": s.spec_accepted_tokens,
            "verifies": s.spec_verifies, "tau": round(s.spec_tau, 3),
            "steps_speculated": s.spec_steps_speculated, "steps_skipped": s.spec_steps_skipped}
    if a.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": out,
                          "text": tok.decode(out, skip_special_tokens=True), "spec": info}))
    else:
        sys.stdout.write(detok.flush() + "\n")
        print(f"spec {spec.method}: {info}", file=sys.stderr)
    return 0


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a small random checkpoint for tests and demos",
                       description="Write config.json, safetensors weights (published Kimi tensor names) and a "
                                   "small byte-level BPE tokenizer with a chat template. Deterministic per --seed.")
    p.add_argument("--arch", choices=["kimi_linear", "k3"], default="kimi_linear",
                   help="kimi_linear: Kimi-Linear layout; k3: full-rank gate, lower-bound gate, gated MLA, "
                        "LatentMoE, SiTU, attention residuals")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                   help="weights dtype on disk (default bfloat16, as published)")


def _cmd_make_tiny(a: argparse.Namespace) -> int:
    from k3rt.backend.models.tiny import make_tiny

    out = make_tiny(a.out, arch=a.arch, seed=a.seed, dtype=a.dtype)
    print(f"wrote {a.arch} tiny checkpoint to {out}")
    return 0


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="rewrite a checkpoint with MXFP4 routed experts (Kimi-K3's published format)",
                       description="Copy a dense checkpoint with its routed experts' w1/w2/w3 quantized to the "
                                   "compressed-tensors mxfp4-pack-quantized format (E2M1 values, one E8M0 scale per "
                                   "32; OCP MX rounding) and the matching quantization_config in config.json. "
                                   "Everything else is copied unchanged. k3rt serves the result weight-only "
                                   "(bf16 activations).")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--out", required=True, help="output folder (created; must be empty)")
    p.add_argument("--mxfp4-experts", action="store_true", required=True,
                   help="quantize the routed experts to MXFP4 (the one scheme supported; required)")


def _cmd_quantize(a: argparse.Namespace) -> int:
    from k3rt.backend.models.quantize import quantize_checkpoint

    out = quantize_checkpoint(a.model, a.out)
    print(f"wrote {out} (routed experts in MXFP4)")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="sizes of a model from its config.json",
                       description="Parameter count, layer pattern (K = KDA, M = MLA; D = dense MLP, E = MoE), "
                                   "KDA state bytes per sequence and MLA bytes per token at a TP degree. "
                                   "Reads config.json only.")
    p.add_argument("--model", required=True, help="checkpoint folder (only config.json is read)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel degree (default 1)")
    p.add_argument("--memory-gb", type=float, default=None, help="cache pool size: adds num_pages to the output")
    p.add_argument("--block-size", type=int, default=None, help="override tokens per page (default: smallest valid)")
    p.add_argument("--json", action="store_true", help="print JSON (default: indented human-readable JSON too)")


def _cmd_inspect(a: argparse.Namespace) -> int:
    from k3rt.inspect_model import inspect_model_dir

    info = inspect_model_dir(a.model, a.tp, memory_gb=a.memory_gb, block_size=a.block_size)
    print(json.dumps(info) if a.json else json.dumps(info, indent=2))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: scheduler and prefix cache (no model compute), a running server, "
                                     "speculative decoding, tensor-parallel decode",
                       description="cache and scheduler replay through the real scheduler and cache with the null "
                                   "runner; serve loads a running server; spec runs the model in process; tp times "
                                   "decode on GPUs under tensor parallelism.")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    c = bsub.add_parser("cache", help="prefix-cache replay: tokens computed vs an ideal cache, k3rt vs baseline",
                        description="Replay a Mooncake-format trace (--trace) or a synthetic workload through the "
                                    "scheduler and radix cache with the null runner, in k3rt mode (snapshot grid "
                                    "--hash-block-size, partial tails, junctions, value-per-byte eviction) and in the "
                                    "full-block baseline (a snapshot per block, hits only at block boundaries, LRU), "
                                    "at one or several cache sizes. Prints per size and mode: prompt tokens computed "
                                    "against an ideal unbounded per-token cache, the hit rate, the share of memory "
                                    "held by KDA snapshots, and the host time per step. Only config.json of --model "
                                    "is read. Workloads: system-prompt (users sharing a few system prompts), "
                                    "multi-turn (agent loops), agents (tool-using agents: long shared tool "
                                    "definitions, small and large tool results, retries), documents (one-off long "
                                    "documents and popular ones mixed with short chats).")
    c.add_argument("--model", default="kimi-linear-48b", help="checkpoint folder or preset (default kimi-linear-48b)")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake JSONL: timestamp, input_length, output_length, hash_ids (512 tok/id)")
    src.add_argument("--workload", choices=["system-prompt", "multi-turn", "agents", "documents"],
                     default="system-prompt", help="synthetic workload (default system-prompt)")
    c.add_argument("--limit", type=int, default=None, help="trace: replay only its first N requests")
    c.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    c.add_argument("--block-size", type=int, default=None, help="tokens per page (default: smallest valid)")
    c.add_argument("--hash-block-size", type=int, default=64, help="snapshot grid in tokens (default 64)")
    c.add_argument("--cache-gb", default="40", help="cache pool size in GiB, or a comma-separated sweep such as "
                                                    "10,20,40,80,160 (default 40)")
    c.add_argument("--eviction", choices=["value", "lru"], default="value",
                   help="k3rt mode's snapshot eviction: value per byte, aged (default), or LRU")
    c.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    c.add_argument("--open-sessions", type=int, default=128,
                   help="synthetic: sessions open at once, taking turns (users and agents think or run tools "
                        "between turns, so a session's prefix must survive the others' turns; default 128)")
    c.add_argument("--users", "--sessions", dest="sessions", type=int, default=None,
                   help="synthetic: sessions (default: the workload's own)")
    c.add_argument("--turns", type=int, default=None, help="synthetic: turns per session (default: the workload's)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--plot", default=None, metavar="PNG", help="write computed/ideal against cache size to this PNG")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s = bsub.add_parser("scheduler", help="host time per engine step, cache operations at scale, wire codec",
                        description="Times schedule + null run + update with every request decoding (--running); "
                                    "then the host cost of the prefix cache and scheduler at scale: one eviction "
                                    "from a 100k-node tree, a 128K-token match, a 128K prompt's snapshot publishes, "
                                    "schedule() with 1,000 requests waiting on a shared prefix, a step of 1,000 "
                                    "decodes beside 100k cached nodes; and the wire codec (a 1,000-update batch, "
                                    "a 128K-token request). Each figure is printed beside its goal.")
    s.add_argument("--model", default="kimi-linear-48b", help="checkpoint folder or preset (default kimi-linear-48b)")
    s.add_argument("--running", type=int, nargs="+", default=[16, 64, 256, 1000])
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--no-scale", action="store_true", help="only the step table (the scale figures take ~20 s)")
    s.add_argument("--json", action="store_true")
    v = bsub.add_parser("serve", help="load a running server: throughput, TTFT / ITL percentiles, cache hit rate",
                        description="Send a seeded synthetic workload to an OpenAI-compatible server (streaming chat "
                                    "completions, fixed output lengths) and report request and token throughput (whole run, "
                                    "and steady: first finish to last send, while the client keeps its concurrency), "
                                    "time-to-first-token, time-per-output-token, inter-token latency and request "
                                    "latency percentiles, the server's GPU-idle share (k3rt /metrics), and "
                                    "the prefix-cache hit rate from usage.prompt_tokens_details.cached_tokens.")
    v.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    v.add_argument("--workload", choices=["sharegpt", "system-prompt", "multi-turn"], default="sharegpt",
                   help="sharegpt: varied independent chats; system-prompt: one long shared system prompt; "
                        "multi-turn: conversations resending their history (default sharegpt)")
    v.add_argument("--concurrency", type=int, default=8,
                   help="requests (conversations) in flight, at most (default 8)")
    v.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="start conversations as a Poisson process of R per second (open loop, vLLM's "
                        "--request-rate), still at most --concurrency in flight (default: all at once)")
    v.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    v.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    v.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation (default 4)")
    v.add_argument("--model-name", default=None, help="model id to send (default: the server's first model)")
    v.add_argument("--api-key", default=None, help="Bearer key, if the server needs one")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    _add_bench_spec(bsub)
    _add_bench_tp(bsub)


def _add_bench_spec(bsub: argparse._SubParsersAction) -> None:
    from k3rt.config import SpecConfig

    s = bsub.add_parser("spec", help="speculative decoding vs plain decoding: tau, draft and verify time, tokens/s",
                        description="Run each workload at each batch size greedily without speculation and with each "
                                    "drafter (in process, the real model), in waves of the batch size (--requests "
                                    "per row at least). Per row: tau (mean tokens a verify step "
                                    "emits: accepted drafts + the bonus token), the acceptance rate, the drafter's "
                                    "time per call (one batched pass for dspark), the mean verify step time against "
                                    "a plain decode step at that batch size, tokens/s with and without speculation "
                                    "and whether the outputs are identical, and the speculation controller's share of "
                                    "steps that speculated (spec share) and steps it decoded plainly (skipped), and "
                                    "the Triton compiles inside the measured runs (plain/spec; CUDA only: each run "
                                    "follows an untimed warm-up on the same workload, every agent turn included). "
                                    "Workloads: code (held-out code "
                                    "completion), chat (questions through the chat template), agent (each turn "
                                    "resends history, the last output and a tool output echoing it). Markdown table "
                                    "to stdout (or JSON with --json); --out also writes the JSON.")
    s.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    s.add_argument("--device", default="cpu", help="torch device (cpu, cuda; default cpu)")
    s.add_argument("--runner", choices=["auto", "model", "gpu"], default="auto",
                   help="compute path (default auto: gpu on CUDA, the reference path on the CPU)")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: the checkpoint's)")
    s.add_argument("--random-weights", action="store_true", help="random weights from config.json (timing only)")
    s.add_argument("--workloads", default="code,chat,agent", help="comma-separated (default code,chat,agent)")
    s.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated (default 1,4,16,64)")
    s.add_argument("--drafters", default="ngram,suffix,dspark",
                   help="comma-separated among ngram, suffix, dspark (default all three)")
    s.add_argument("--spec-tokens", type=int, default=7, metavar="K", help="draft tokens per request (default 7)")
    s.add_argument("--spec-model", default=None, metavar="DIR",
                   help="dspark drafter folder (default: the one shipped with the model)")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request and turn (default 64)")
    s.add_argument("--prompt-len", type=int, default=96, help="code prompt length in tokens (default 96)")
    s.add_argument("--turns", type=int, default=3, help="agent turns per session (default 3)")
    s.add_argument("--requests", type=int, default=8,
                   help="requests per row at least, run in waves of the batch size (each wave submitted together, "
                        "the next when it finishes): batch 1 measures this many prompts one after another, not "
                        "one prompt's luck (default 8)")
    s.add_argument("--waves", type=int, default=1,
                   help="waves per row at least (default 1): more makes a large batch's runs long enough to time")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics for the plain and the speculative runs (docs/deterministic.md): "
                        "speculative greedy output is then byte-identical to plain output in any dtype")
    s.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA: run decode steps, verify steps and the drafter's pass eagerly (default: replayed "
                        "from CUDA graphs; the rows' graph verifies / drafter graphs columns say which ran)")
    s.add_argument("--no-spec-graphs", action="store_true",
                   help="on CUDA: run verify steps and the drafter's pass eagerly, decode steps still from graphs "
                        "(to compare against the default, where all three replay graphs)")
    _add_spec_adaptive(s)
    s.add_argument("--spec-rounds", type=int, default=SpecConfig.rounds, metavar="N",
                   help="dspark on the gpu runner: up to N verify rounds per engine step on the device (as serve's "
                        f"--spec-rounds; default {SpecConfig.rounds})")
    s.add_argument("--rounds", type=int, default=1,
                   help="rounds per row: each round runs every drafter next to a plain run of its own (plain "
                        "first and second in turn); the speedup is the median of those pairs' spec/plain ratios "
                        "(default 1)")
    s.add_argument("--trace", action="store_true",
                   help="keep every engine-step call of the measured runs in the JSON rows (trace_plain, "
                        "trace_spec: kind, running requests, call ms, drafter ms, draft tokens verified, prefill "
                        "tokens, decodes, device rounds planned, tokens delivered) and, per round, the "
                        "controller's plans by reason and its state after the warm-up and each run "
                        "(whys_by_round, controller_by_round), to see where a slow row's time went")
    s.add_argument("--json", action="store_true", help="print JSON instead of the table")
    s.add_argument("--out", default=None, metavar="FILE", help="also write the rows as JSON here")


def _cmd_bench_spec(a: argparse.Namespace) -> int:
    from k3rt.backend.bench.spec_bench import SpecBenchConfig, bench_spec, format_table, parse_list, rows_json

    cfg = SpecBenchConfig(model=a.model, device=a.device, runner=a.runner, dtype=a.dtype,
                          random_weights=a.random_weights, workloads=parse_list(a.workloads, "workloads"),
                          batch_sizes=parse_list(a.batch_sizes, "batch_sizes", int),
                          drafters=parse_list(a.drafters, "drafters"), spec_tokens=a.spec_tokens,
                          spec_model=a.spec_model, max_tokens=a.max_tokens, prompt_len=a.prompt_len, turns=a.turns,
                          requests=a.requests, waves=a.waves, seed=a.seed, deterministic=a.deterministic,
                          cuda_graphs=not a.no_cuda_graphs, spec_graphs=not a.no_spec_graphs,
                          spec_adaptive=a.spec_adaptive, trace=a.trace, rounds=a.rounds, spec_rounds=a.spec_rounds)
    rows = bench_spec(cfg, progress=not a.json)
    data = rows_json(rows)
    if a.out:
        Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data) if a.json else format_table(rows))
    return 0


def _add_bench_tp(bsub: argparse._SubParsersAction) -> None:
    t = bsub.add_parser("tp", help="decode step time and tokens/s at TP 1/2/4/8 (GPU runner), the latent tail AR vs RS",
                        description="Starts one process per rank (one GPU each, NCCL) for each TP degree this host "
                                    "has GPUs for, builds --model's shape with random bf16 weights (each rank its "
                                    "shard) and times decode steps as the engine runs them (rank 0 broadcasts the "
                                    "step plan, every rank replays the decode CUDA graph, logits gathered to rank 0, "
                                    "argmax read back) at each --batch and --context; then, at TP >= 2, LatentMoE's "
                                    "tail per layer at K3 widths, all-reduce vs reduce-scatter variant, at each "
                                    "--tail-m. Prints tables; JSON to --out. --smoke: TP 1 and 2 on CPU (gloo, tiny "
                                    "shape, torch ops): checks that the benchmark runs; its times mean nothing.")
    t.add_argument("--model", default="kimi-linear-48b", help="preset or checkpoint folder, config only "
                                                              "(default kimi-linear-48b)")
    t.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="TP degrees (default 1 2 4 8; those above the GPU count are skipped and listed)")
    t.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes (default 1 16 64)")
    t.add_argument("--context", type=int, default=4096, help="tokens in each sequence's cache (default 4096)")
    t.add_argument("--tail-m", type=int, nargs="+", default=[1, 8, 16, 64], help="tail: tokens (default 1 8 16 64)")
    t.add_argument("--tail-hidden", type=int, default=7168, help="tail: hidden width (default 7168, K3)")
    t.add_argument("--tail-latent", type=int, default=3584, help="tail: latent width (default 3584, K3)")
    t.add_argument("--reps", type=int, default=20, help="timed steps per point, median (default 20)")
    t.add_argument("--ep", action="store_true", help="routed experts split by expert over the ranks (expert "
                                                     "parallelism) instead of by width")
    t.add_argument("--symm-allreduce", action="store_true",
                   help="the model's all-reduces up to 1 MiB through torch symmetric memory instead of NCCL "
                        "(as serve --tp-symm-allreduce); the tail keeps NCCL")
    t.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shape: the benchmark runs (CI)")
    t.add_argument("--out", type=Path, default=Path("bench_tp.json"), help="JSON results (default bench_tp.json)")
    t.add_argument("--json", action="store_true", help="print the JSON instead of the tables")


def _cmd_bench(a: argparse.Namespace) -> int:
    if a.bench == "spec":
        return _cmd_bench_spec(a)
    if a.bench == "tp":
        from k3rt.backend.bench.tp_bench import TpBenchConfig, format_tables, run as bench_tp

        result = bench_tp(TpBenchConfig(model=a.model, tps=tuple(a.tp), batches=tuple(a.batch), context=a.context,
                                        tail_m=tuple(a.tail_m), tail_hidden=a.tail_hidden, tail_latent=a.tail_latent,
                                        reps=a.reps, ep=a.ep, symm_all_reduce=a.symm_allreduce, smoke=a.smoke),
                           a.out)
        print(json.dumps(result) if a.json else format_tables(result))
        return 0
    if a.bench == "serve":
        from k3rt.server.bench import main as bench_serve

        return bench_serve(a)
    if a.bench == "scheduler":
        import gc

        from k3rt.backend.bench.scheduler_bench import bench_steps, default_config

        gc.freeze()  # long-lived engine objects out of the collector's way, as a server would
        rows = [bench_steps(default_config(a.model), r, steps=a.steps) for r in a.running]
        scale = codec = None
        if not a.no_scale:
            from k3rt.backend.bench.codec_bench import bench_codec, format_codec_table
            from k3rt.backend.bench.scale import bench_scale, format_scale

            scale, codec = bench_scale(a.model), bench_codec()
        if a.json:
            print(json.dumps({"steps": rows, "scale": scale, "codec": codec}))
            return 0
        print(f"{'running':>8} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8}")
        for r in rows:
            print(f"{r['running']:>8} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} {r['mean_ms']:>8.3f}")
        if scale is not None:
            print()
            print(format_scale(scale))
            print()
            print(format_codec_table(codec))
        return 0
    from k3rt.backend.bench import workloads
    from k3rt.backend.bench.cache_replay import format_table, plot_sweep, sweep
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig
    from k3rt.model_config import load_model_config

    try:
        sizes = [float(x) for x in a.cache_gb.split(",")]
    except ValueError:
        print(f"--cache-gb: expected numbers separated by commas, got {a.cache_gb!r}", file=sys.stderr)
        return 2
    vocab = load_model_config(a.model).vocab_size
    if a.trace:
        sessions = list(workloads.mooncake(a.trace, vocab, limit=a.limit))
        title = f"{Path(a.trace).name} ({len(sessions)} requests), {a.model}"
    else:
        sessions = workloads.build(a.workload, vocab, sessions=a.sessions, turns=a.turns, seed=a.seed)
        title = (f"workload {a.workload} ({sum(map(len, sessions))} requests, {a.open_sessions} sessions open), "
                 f"{a.model}")
    cache = CacheConfig(block_size=a.block_size, hash_block_size=a.hash_block_size, eviction=a.eviction)
    cfg = EngineConfig(model=a.model, runner="null", tp=a.tp, cache=cache,
                       scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_running=max(64, a.concurrency)))
    results = sweep(cfg, sessions, sizes, concurrency=a.concurrency,
                    open_sessions=None if a.trace else a.open_sessions, progress=not a.json)
    if a.plot:
        plot_sweep(results, a.plot, title)
    if a.json:
        print(json.dumps([r.as_dict() for r in results]))
    else:
        print(title)
        print(format_table(results))
        if a.plot:
            print(f"plot: {a.plot}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (gateway + engine process)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics, the "
                                   "tokenizer (/tokenize, /detokenize, /tokenizer_info, as vLLM) and SGLang's native "
                                   "API (/generate, /get_model_info, /get_server_info, /flush_cache, "
                                   "/health_generate). "
                                   "The gateway process (uvloop + uvicorn) tokenizes and streams; the engine process "
                                   "schedules and runs the model. Ready when GET /health answers 200. SIGINT/SIGTERM "
                                   "(to the server or its whole process group) drain: new requests get 503, running "
                                   "ones have --drain-timeout seconds to finish; those still running then get a 503 "
                                   "server_shutdown error (on a stream: an error event, then [DONE]). A second signal "
                                   "ends the drain at once the same way. Exit status: 0 when every request finished, "
                                   "1 when requests were cut or the engine process failed (at start, e.g. a cache pool "
                                   "too small for one request, or later: its running requests get 503 engine_failed), "
                                   "2 for a bad option or a busy port.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics, and KEY on the DSL port "
                        "(k3rt.connect(ADDR, api_key=KEY) or K3RT_API_KEY; proven in a ZMQ CURVE handshake); "
                        "give it several times for several keys (default: none)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="more keys, one per line (blank lines and lines starting with # are skipped)")
    p.add_argument("--cache-isolation", choices=["none", "api-key"], default=None,
                   help="api-key: each key's requests (HTTP and DSL) share cached prefixes only with that key's, "
                        "so no client can probe another's prompts by cached_tokens or timing; none: one cache "
                        "for all (default: api-key when keys are set)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without a key even when keys are set (default: it needs one)")
    p.add_argument("--max-body-mb", type=float, default=32.0,
                   help="request bodies above this many MiB are answered 413 before they are read (default 32)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the folder's name)")
    p.add_argument("--max-running", "--max-num-seqs", dest="max_running", type=int, default=256,
                   help="requests decoding at once (default 256); the GPU runner captures decode graphs up to "
                        "the first size at or above it (at most 512)")
    p.add_argument("--max-waiting", type=int, default=4096,
                   help="requests queued beyond those; more are answered 429 (default 4096)")
    p.add_argument("--max-batched-tokens", "--max-num-batched-tokens", dest="max_batched_tokens", type=int,
                   default=2048, help="tokens per engine step (default 2048)")
    p.add_argument("--context-length", "--max-model-len", dest="context_length", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's maximum)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="refused: k3rt runs no code from a checkpoint (it implements the Kimi architectures itself)")
    p.add_argument("--grammar-backend", choices=["llguidance", "outlines"], default="llguidance",
                   help="constrained decoding backend (default llguidance)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cache-pages", type=int, default=None,
                       help="cache pool size in pages (default: sized from GPU memory on a GPU, 256 on the CPU)")
    cache.add_argument("--cache-gb", type=float, default=None, help="cache pool size in GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="on a GPU without --cache-pages/--cache-gb: the share of its memory k3rt may use; the "
                        "cache gets it less what is already in use, the weights and 2 GiB of headroom (default 0.9)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: the checkpoint's torch_dtype)")
    p.add_argument("--device", default="auto",
                   help="torch device of the engine: auto (default: the first CUDA GPU if there is one, else cpu), "
                        "cpu, cuda, cuda:N; the choice and the cache size are printed at start with the reason")
    p.add_argument("--runner", choices=["auto", "model", "gpu"], default="auto",
                   help="compute path: 'gpu' = fused Triton kernels + CUDA-graph decode, 'model' = the plain-torch "
                        "reference path; 'auto' (default) picks gpu on a CUDA device (any --tp), model elsewhere")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="gpu runner: run decode steps eagerly; with --spec also the verify steps and the dspark "
                        "drafter's pass (by default replayed from CUDA graphs captured at --spec-tokens for batches "
                        "up to 64; --no-spec-graphs turns off only those)")
    p.add_argument("--no-mixed-graphs", action="store_true",
                   help="gpu runner: run steps with prefill rows (a prompt chunk beside the decodes) eagerly; by default "
                        "those of up to the token budget (at most 4096 tokens) replay piecewise CUDA graphs, every "
                        "layer's attention core run eagerly between captured pieces (off with --no-cuda-graphs too)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run each engine step to its end before scheduling the next; by default the gpu runner on a "
                        "CUDA device overlaps them (the host schedules and launches step N+1 while the GPU runs step "
                        "N and learns step N's tokens one step late; grammar, logprobs, penalties and speculative "
                        "steps still wait for their tokens). See docs/architecture.md")
    p.add_argument("--decode-token-cost", type=float, default=4.0, metavar="TOKENS",
                   help="decode-aware chunk budget: each running decode takes this many tokens from the prefill "
                        "tokens a step may add (--max-batched-tokens less decodes x TOKENS, never below "
                        "--min-prefill-tokens), so prefill chunks do not stall running decodes; 0 turns it off "
                        "(default 4)")
    p.add_argument("--min-prefill-tokens", type=int, default=256,
                   help="prefill tokens a step may always add however many decodes run (a multiple of 64; "
                        "default 256)")
    p.add_argument("--prefill-delay-steps", type=int, default=None, metavar="STEPS",
                   help="admission batching: while requests decode, hold new requests until the oldest has waited "
                        "STEPS engine steps or the waiting prompts fill a step's prefill budget, so several arrivals "
                        "share one mixed step (costlier than a decode-graph replay, piecewise graphs or not) and the "
                        "other steps stay decode-graph replays; 0 admits at "
                        "once (default: 16 with the gpu runner's CUDA graphs, else 0)")
    p.add_argument("--pdl", action="store_true",
                   help="gpu runner: launch chained decode kernels with programmatic dependent launch")
    p.add_argument("--random-weights", action="store_true",
                   help="build the model from config.json with random weights (benchmarks without a checkpoint; "
                        "the output is noise)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: each request's output independent of what else is in the batch, of prefill chunking and of prefix-cache hits; "
                        "with --spec, greedy output byte-identical to non-speculative output (slower; tp 1; docs/deterministic.md)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds running requests may finish after SIGTERM/SIGINT; then they are answered 503 "
                        "server_shutdown and the exit status is 1 (default 10)")
    p.add_argument("--dsl-addr", default="auto",
                   help="ZMQ endpoint for @k3rt.function programs (k3rt.connect(ADDR)); 'auto' = tcp://HOST:PORT+1 "
                        "(a free port when --port is 0), 'off' disables it")
    p.add_argument("--dsl-max-message-mb", type=float, default=16.0, metavar="MB",
                   help="largest message (a flushed program, its texts included) the DSL port reads; a client that "
                        "sends a larger one is disconnected and its program fails with ConnectionError (default 16)")
    p.add_argument("--stall-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="GET /health answers 503 (status 'stalled') when the engine has had work (running or "
                        "waiting requests) and made no progress, or sent no stats at all, for this long; 0 disables "
                        "it (default 30). /health also answers 503 ('pinned_full') when pinned snapshots leave no "
                        "room to admit a request")
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level (default WARNING)")
    _add_tp(p)
    _add_spec_args(p)


def _cmd_serve(a: argparse.Namespace) -> int:
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig
    from k3rt.server.config import ServerConfig

    from k3rt.placement import place, weights_bytes

    if a.trust_remote_code:
        raise ValueError("trust_remote_code: k3rt never runs code shipped with a checkpoint; it implements the Kimi "
                         "architectures itself and reads only config.json, weights and tokenizer files. Remove "
                         "--trust-remote-code")
    model_dir = resolve_model_dir(a.model)
    tp, dist, role = _dist_from_args(a)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    # each rank holds 1/tp of the weights (the replicated parts are small next to the experts)
    placement = place(a.device, cache_pages=a.cache_pages, cache_gb=a.cache_gb,
                      gpu_memory_utilization=a.gpu_memory_utilization,
                      weights_bytes=weights_bytes(str(model_dir), a.dtype) // max(1, tp))
    if role == 0:
        print(f"k3rt serve: {placement.reason}", file=sys.stderr, flush=True)
    cache = placement.cache
    engine = EngineConfig(model=str(model_dir), dtype=a.dtype, device=placement.device, seed=a.seed,
                          grammar_backend=a.grammar_backend,
                          runner=a.runner, cuda_graphs=not a.no_cuda_graphs,
                          mixed_graphs=not a.no_mixed_graphs, use_pdl=a.pdl, random_weights=a.random_weights,
                          overlap=False if a.no_overlap else None,
                          cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=a.max_batched_tokens,
                                                                 max_running=a.max_running, max_waiting=a.max_waiting,
                                                                 decode_token_cost=a.decode_token_cost,
                                                                 min_prefill_tokens=a.min_prefill_tokens,
                                                                 prefill_delay_steps=a.prefill_delay_steps),
                          tp=tp, ep=a.ep, dist=dist, spec=_spec_config(a), deterministic=a.deterministic)
    if role != 0:
        return _run_other_rank(engine, role)
    keys = list(a.api_key or [])
    if a.api_key_file:
        with open(a.api_key_file) as f:
            keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"api_key_file: no keys in {a.api_key_file}")
    cfg = ServerConfig(engine=engine, host=a.host, port=a.port, api_keys=tuple(dict.fromkeys(keys)),
                       cache_isolation=a.cache_isolation, metrics_public=a.metrics_public,
                       max_body_bytes=int(a.max_body_mb * (1 << 20)),
                       served_model_name=a.served_model_name, context_length=a.context_length,
                       drain_timeout_s=a.drain_timeout, log_level=a.log_level.upper(),
                       dsl_addr=None if a.dsl_addr == "off" else a.dsl_addr, stall_timeout_s=a.stall_timeout,
                       dsl_max_message_bytes=int(a.dsl_max_message_mb * (1 << 20)))
    from k3rt.server.launch import serve

    return serve(cfg)


COMMANDS = {"generate": _cmd_generate, "make-tiny": _cmd_make_tiny, "inspect": _cmd_inspect, "bench": _cmd_bench,
            "serve": _cmd_serve, "quantize": _cmd_quantize}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3rt", description="k3rt: inference runtime for the Kimi hybrid family "
                                "(KDA + MLA + MoE/LatentMoE).", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_make_tiny(sub)
    _add_inspect(sub)
    _add_quantize(sub)
    _add_bench(sub)
    _add_serve(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[a.command](a)
    except (ValueError, FileNotFoundError, OSError) as e:
        # ConfigError / CheckpointError / bad sampling values are ValueErrors naming the field
        print(f"k3rt {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
