#!/usr/bin/env python3
"""End-to-end decode and prefill of the GPU runner at a real model shape, with random bf16 weights.

    python3 benchmarks/decode.py                                  # Kimi-Linear-48B shape, one H200
    python3 benchmarks/decode.py --smoke                          # tiny config on CPU (torch ops): bit-rot check

What it measures, in one run (medians of CUDA-event-timed repetitions after warm-up):
  1. copy bandwidth (bytes read + written of a 1 GiB device copy): the roofline's denominator;
  2. decode, batch B in --batch at context --context: one step of the model forward
       eager (every kernel launched from Python), graph (replay of the captured CUDA graph),
       graph variants (--variants: re-captured with PDL between kernels, or with cuBLAS for the
         decode-row projections instead of the skinny GEMV kernel, or batch 1's MoE in two launches
         (moe_one_token), or as the default again: "control",
         the spread a variant's gain is read against), each graph timed from the batch's seeded cache contents,
     and the full runner step (host packing + copy + graph replay + argmax + reading the tokens);
     against the roofline: bytes a step must move (weights it touches + KDA state read and written +
     MLA latent KV read) / copy bandwidth;
  3. prefill tokens/s of one sequence of each --prefill length, fed as chunks of --chunk tokens
     (as the scheduler feeds it), against the matmul-bound floor: 2 x active parameters x tokens
     (+ attention) / measured bf16 matmul rate.

Weights touched per decode step: every dense parameter once (the embedding table: B rows only), and
for each MoE layer the experts that at least one of the B tokens picks; with near-uniform routing
that is E * (1 - (1 - k/E)^B) experts per layer (the expectation is used; random weights route
near-uniformly). The cache contents are random too (the pool is filled with noise first): timing
does not depend on their values. Table to stdout, everything to JSON (--out, default $OUT/decode.json).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


# KernelConfig fields; "control" re-captures the default and times it as the variants are timed: its gain is the
# benchmark's own noise (0 up to that), against which the others' gains are read
VARIANTS = {"control": {}, "pdl": dict(use_pdl=True), "cublas_gemv": dict(skinny_gemv=False),
            "moe_one_token": dict(moe_one_token=True),
            # session 31's launch cuts, off (their gain is then the default's over these): LatentMoE's fused
            # projections and the router's logits in its top-k launch (the MLA gate kernel has no switch)
            "no_latent_fusion": dict(moe_latent_fusion=False), "no_fused_router": dict(moe_fused_router=False),
            "unfused": dict(moe_latent_fusion=False, moe_fused_router=False),
            "no_pair_blocks": dict(moe_pair_blocks_bytes=0), "stacked_mix": dict(attn_res_stacked=True),
            # session 38: the residual add and the next norm in the MoE's experts' sum launch, off
            "no_sum_add_norm": dict(moe_sum_add_norm=False),
            # session 39: batch 1's KDA output norm finished in o_proj's launch (off by default until timed)
            "kda_norm_in_o_proj": dict(kda_norm_in_o_proj=True),
            # session 40: batch 1's MoE and KDA layers each in one persistent launch, MLA's in two around its core
            # (off until timed)
            "moe_layer_one_token": dict(moe_layer_one_token=True),
            "kda_layer_one_token": dict(kda_layer_one_token=True),
            "mla_layer_one_token": dict(mla_layer_one_token=True),
            "layers_one_token": dict(moe_layer_one_token=True, kda_layer_one_token=True, mla_layer_one_token=True),
            # session 42: the MLA decode's Gluon kernel in its heads layout; session 44: the Triton kernel (the
            # default before session 44, when the Gluon kernel's tokens layout became it)
            "mla_gluon": dict(mla_gluon=True, mla_gluon_layout="heads"), "mla_triton": dict(mla_gluon=False),
            # session 43: the MLA decode's two-step combine past 32 splits (the default before session 43)
            "mla_two_step_combine": dict(mla_wide_combine=False),
            # session 43: the Gluon kernel's tokens layout (the default since session 44)
            "mla_gluon_tokens": dict(mla_gluon=True, mla_gluon_layout="tokens"),
            # session 44: the KDA decode launched with PDL, its state and windows loaded before the wait
            "kda_decode_pdl": dict(kda_decode_pdl=True),
            # ... and the gates' up-projection before it in the skinny GEMV, triggering the decode at once
            "kda_decode_pdl_trigger": dict(kda_decode_pdl=True, kda_decode_pdl_trigger=True),
            # session 45: the skinny GEMVs with PDL, their weight rows asked into the L2 ("l2") or their first K
            # step loaded ("tile": the looped launches only, o_proj's K = 4096 among them) before the wait; alone (the
            # kernels before them trigger as they end), and with every kernel's PDL (they trigger early)
            "gemv_prefetch": dict(gemv_prefetch="l2"), "gemv_prefetch_tile": dict(gemv_prefetch="tile"),
            "gemv_prefetch_pdl": dict(gemv_prefetch="l2", use_pdl=True),
            # session 45's one-row forms, the default since session 46, off: the wide projections (KDA/MLA input, LM
            # head) back on cuBLAS; the one-row GEMVs in the looped form (and so no wide GEMV); one token's experts
            # through the grouped MMA tiles; all of them (the default before session 46)
            "no_gemv_wide": dict(gemv_wide=False), "no_gemv_unrolled": dict(gemv_unrolled=False),
            "no_moe_gemv": dict(moe_gemv=False), "no_gemv_forms": dict(gemv_unrolled=False, moe_gemv=False)}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi-linear-48b", help="preset name or checkpoint folder (config only)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep the preset's first N layers (its KDA and full-attention layer lists cut to them): the "
                        "48B's per-layer behaviour on a GPU its 27 layers do not fit (12 layers: ~42 GB, an H100)")
    p.add_argument("--batch", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=4096, help="tokens already in each sequence's cache")
    p.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (the scheduler's token budget)")
    p.add_argument("--prefill-kda-intra", choices=["fused", "split", "blocks", "both"], default=None,
                   help="--prefill: the chunked KDA kernel's intra step (KernelConfig.kda_intra; default: its default, "
                        "blocks); both: each prefill timed with each form (fused, split, blocks: a row per variant)")
    p.add_argument("--prefill-router", choices=["split", "fp32", "both"], default="split",
                   help="--prefill: the MoE router's logits from the bf16 parts of its weight (the default, "
                        "KernelConfig.split_router_min_rows) or torch's fp32 linear; both: each prefill timed with each")
    p.add_argument("--prefill-configs", nargs="*", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                   help="--prefill: also time each prefill with these KernelConfig overrides (e.g. "
                        "kda_prep_one_seq=1 or mla_prefill_tma=1,kda_prep_one_seq=1), after the default's rows")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                   help="decode graphs re-captured with other kernel settings and timed beside the default: "
                        "pdl (programmatic dependent launch between kernels), cublas_gemv (torch/cuBLAS for "
                        "the projections of decode rows instead of the skinny GEMV kernel), moe_one_token (batch "
                        "1's MoE in two launches: KernelConfig.moe_one_token), no_latent_fusion / no_fused_router / "
                        "unfused (LatentMoE's fused projections, the router's logits in its top-k launch, both: off; "
                        "a negative gain is what they save), no_pair_blocks (a few tokens' MoE through the "
                        "alignment again), stacked_mix (K3's residual mix in its stacked form: "
                        "KernelConfig.attn_res_stacked on), control (the default again)")
    p.add_argument("--mixed", type=int, nargs="*", default=[], metavar="P",
                   help="also time steps of (the largest --batch) decodes plus one P-token prefill chunk, per P: "
                        "a served step when a request arrives (time, kernel time, launches, top kernels, host issue "
                        "time), after checking its decodes' logits against an eager decode-only step's; eager, and "
                        "replayed from the piecewise graphs of its token bucket (on CUDA; --no-mixed-graphs: not)")
    p.add_argument("--mixed-split", choices=["on", "off", "both"], default="both",
                   help="--mixed steps with the KDA split (plain decodes through the decode kernel, the chunk alone "
                        "through the chunked form: KernelConfig.kda_split, the default), without it (every row "
                        "chunked, as before issue 18), or both side by side (default)")
    p.add_argument("--no-mixed-graphs", dest="mixed_graphs", action="store_false",
                   help="--mixed: skip the piecewise-graph variant (by default, on CUDA, each --mixed step is also "
                        "replayed from piecewise graphs captured for its token bucket: backend/runner/gpu/pieces.py)")
    p.add_argument("--profile", type=int, nargs="*", default=[], metavar="B",
                   help="also profile one eager decode step at each batch B: time per kernel name, top 30 "
                        "(kernel times as in the graph; the launch gaps are the graph's to remove)")
    p.add_argument("--graph-timeline", type=int, nargs="*", default=[], metavar="B",
                   help="last: one replay of the batch-B decode graph of the default and of each --variants under "
                        "torch.profiler: span, kernels' busy time, idle gaps and PDL overlaps by the kernel after "
                        "them (why a variant's graph is slower or faster)")
    p.add_argument("--graph-timeline-variants", nargs="*", default=None, metavar="NAME",
                   help="--graph-timeline: only these of --variants (default: all of them)")
    p.add_argument("--profile-prefill", action="store_true",
                   help="--prefill: also profile the last chunk of each prefill (eager, as it runs): time per "
                        "kernel name, top 30")
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU with torch ops (no kernels, no graphs)")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip remaining items after this many seconds")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


ARGS = _args()

import torch  # noqa: E402
from _routing import distinct_experts  # noqa: E402
from _timing import Report, copy_bandwidth, default_out, device_timeline, time_ms  # noqa: E402

from k3rt.backend.cache.pool import PagePool  # noqa: E402
from k3rt.kernels.kda.chunk_tables import INTRA_FORMS  # noqa: E402
from k3rt.backend.models.random_init import random_model  # noqa: E402
from k3rt.backend.runner.gpu.ops import KernelConfig, parse_overrides  # noqa: E402
from k3rt.backend.runner.gpu.pieces import DEFAULT_MIXED_BUCKETS, PiecewiseForward  # noqa: E402
from k3rt.backend.runner.gpu.runner import GpuModelRunner  # noqa: E402
from k3rt.backend.runner.gpu.step import StepSeq  # noqa: E402
from k3rt.cache_layout import compute_layout  # noqa: E402
from k3rt.model_config import ModelConfig, load_model_config, param_count, parse_model_config  # noqa: E402

REPORT = Report(default_out(ARGS.out, "decode.json"), ARGS.budget_s,
                {"args": {k: str(v) for k, v in vars(ARGS).items()}})
RESULT, log, save, over_budget = REPORT.result, REPORT.log, REPORT.save, REPORT.over_budget


def bucket_for(num_tokens: int) -> int | None:
    return next((b for b in DEFAULT_MIXED_BUCKETS if b >= num_tokens), None)


def config() -> ModelConfig:
    if ARGS.smoke:
        from k3rt.backend.models.tiny import TINY_CONFIGS

        return parse_model_config(TINY_CONFIGS["k3"])
    if ARGS.layers is None:
        return load_model_config(ARGS.model)
    from k3rt.presets import PRESETS, cut_layers

    if ARGS.model not in PRESETS:
        raise SystemExit(f"--layers cuts a preset ({', '.join(PRESETS)}), not {ARGS.model!r}")
    return parse_model_config(cut_layers(PRESETS[ARGS.model], ARGS.layers))


def step_bytes(model, cfg: ModelConfig, B: int, ctx: int, layout) -> dict:
    """Bytes one decode step of B sequences at context ctx must move at least."""
    m = cfg.moe
    dense = expert = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            dense += B * p.shape[1] * p.element_size()  # only the B rows looked up
        elif name.endswith(".w13") or name.endswith(".w2"):
            expert += n
        else:
            dense += n
    frac = 1.0 if m is None else 1.0 - (1.0 - m.num_experts_per_token / m.num_experts) ** B
    kda_layers = sum(t == "kda" for t in cfg.layer_types)
    state = 2 * B * kda_layers * layout.kda_state_bytes  # read + write, in place
    kv = B * len(cfg.mla_layers) * (ctx + 1) * layout.mla_bytes_per_token
    return {"weights_dense": dense, "weights_experts": int(expert * frac), "kda_state": state, "mla_kv": kv,
            "total": int(dense + expert * frac + state + kv), "expert_fraction": frac}


def fill_noise(pool: PagePool, seq: StepSeq, gen: torch.Generator) -> None:
    """Random cache contents for one sequence: latent KV in its MLA pages, conv and recurrent state in
    its state set. Views of one page overlap (a page is either KV or a KDA state), so each page is
    filled only through the view its role uses: noise written through the other would read back as
    arbitrary bit patterns, NaN included. Drawn from `gen`: the cache contents steer the hidden states and so
    the routing, and the experts a step reads are most of its bytes, so every timing of a batch must start
    from the same contents (unseeded, the graph timed first read 1-1.7% slower at batch 64 than the
    variants re-captured after it, whatever the variant: RESULTS.md session 28)."""
    for page in seq.block_table:
        for t in range(len(pool.tensors)):
            pool.mla[t][page].normal_(generator=gen)
    for page in seq.state_pages or []:
        for t in range(len(pool.conv)):
            pool.conv[t][page].normal_(generator=gen)
            pool.rec[t][page].normal_(0.0, 0.05, generator=gen)


def decode_seqs(pool: PagePool, layout, B: int, ctx: int, vocab: int) -> list[StepSeq]:
    """B sequences at context ctx with seeded tokens and cache contents: the same batch at every call for B."""
    g = torch.Generator().manual_seed(B)
    noise = torch.Generator(device=pool.tensors[0].device).manual_seed(B)
    seqs = []
    for _ in range(B):
        table = pool.allocate(-(-(ctx + 1) // layout.block_size), zero=False)
        states = pool.allocate(max(1, layout.pages_per_state_set), zero=False)
        tok = int(torch.randint(0, vocab, (1,), generator=g))
        seqs.append(StepSeq([tok], ctx, table, states, True))
        fill_noise(pool, seqs[-1], noise)
    return seqs


def release(pool: PagePool, seqs: list[StepSeq]) -> None:
    for s in seqs:
        pool.unref(s.block_table + (s.state_pages or []))


def bench_decode(runner: GpuModelRunner, model, cfg, layout, copy_gbps: float, B: int) -> dict:
    ctx = ARGS.context
    seqs = decode_seqs(runner.pool, layout, B, ctx, cfg.vocab_size)
    step = runner._build(seqs, [])
    row: dict = {"batch": B, "context": ctx, "bytes": step_bytes(model, cfg, B, ctx, layout)}
    # the experts the batch's seeded contents route to, before any step moves its states on; each replay moves
    # them on (the graph decodes the same token again), and the routing with them, so the roofline takes the mean
    # of this and the routing after the timed replays
    routed = [distinct_experts(runner, step)]
    row["eager_ms"] = time_ms(lambda: runner.fwd(step, decode=True), reps=ARGS.reps, warmup=2)["median_ms"]
    size = next((s for s in sorted(runner.graphs) if s >= B), None)
    if size is not None:
        # the eager steps moved these sequences' states on: the graph starts from the batch's seeded contents,
        # as each variant's graph does
        release(runner.pool, seqs)
        seqs = decode_seqs(runner.pool, layout, B, ctx, cfg.vocab_size)
        g = runner.graphs[size]
        runner._replay(seqs, size)  # loads this batch's indices into the graph's buffers
        row["graph_ms"] = time_ms(g.graph.replay, reps=ARGS.reps, warmup=3)["median_ms"]
        row["graph_size"] = size
        routed.append(distinct_experts(runner, runner._build(seqs, [])))

        def full_step() -> None:
            runner._replay(seqs, size)
            torch.argmax(g.logits[:B], dim=-1).tolist()

        row["runner_step_ms"] = time_ms(full_step, reps=ARGS.reps, warmup=2)["median_ms"]
    routed = [d for d in routed if d]
    if routed:  # replace the uniform-routing expectation by what this batch routes to
        layers = len(routed[0])
        per_expert = sum(
            p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith((".w13", ".w2"))
        ) / (cfg.moe.num_experts * layers)
        b = row["bytes"]
        mean = sum(map(sum, routed)) / len(routed)  # distinct experts summed over the layers, averaged
        b["weights_experts"] = int(per_expert * mean)
        b["distinct_experts_per_layer"] = mean / layers
        b["distinct_experts_per_layer_first_last"] = [sum(d) / layers for d in routed]
        b["total"] = b["weights_dense"] + b["weights_experts"] + b["kda_state"] + b["mla_kv"]
    roof_ms = row["bytes"]["total"] / (copy_gbps * 1e9) * 1e3
    row["roofline_ms"] = roof_ms
    best = row.get("graph_ms", row["eager_ms"])
    row["x_roofline"] = best / roof_ms
    row["tokens_per_s"] = B / (row.get("runner_step_ms", best) * 1e-3)
    release(runner.pool, seqs)
    return row


def kernel_profile(fn) -> tuple[float, int, list[dict]]:
    """(device kernel ms, launches, top-30 kernels by time) of one call of fn (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    gpu = torch.cuda.is_available()
    rows = []
    for e in prof.key_averages():
        if gpu:  # device kernels only (their own time); CPU-side ops would count it again
            if "CUDA" not in str(getattr(e, "device_type", "")):
                continue
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        else:
            t = e.cpu_time_total
        rows.append((e.key, e.count, t))
    rows.sort(key=lambda r: -r[2])
    total = sum(t for _, _, t in rows)
    top = [{"kernel": k[:90], "calls": n, "us": round(t, 1), "share": round(t / total, 4) if total else 0.0}
           for k, n, t in rows[:30]]
    return total / 1e3, sum(n for _, n, _ in rows), top


def profile_step(runner: GpuModelRunner, cfg, layout, B: int) -> dict:
    """Kernel time by name for one decode step of B sequences (torch.profiler), largest first."""
    seqs = decode_seqs(runner.pool, layout, B, ARGS.context, cfg.vocab_size)
    step = runner._build(seqs, [])
    runner.fwd(step, decode=True)  # compile and warm up outside the trace
    kernel_ms, launches, top = kernel_profile(lambda: runner.fwd(step, decode=True))
    release(runner.pool, seqs)
    print(f"\nprofile: one eager decode step, batch {B}: {kernel_ms:.3f} ms of kernel time, {launches} kernel launches")
    for r in top:
        print(f"  {r['us']:9.1f} us {100 * r['share']:5.1f} %  x{r['calls']:<4} {r['kernel']}")
    return {"batch": B, "kernel_ms": kernel_ms, "launches": launches, "top": top}


def use_variant(runner: GpuModelRunner, name: str) -> None:
    """Switch the runner to decode.py variant `name` and capture its decode graphs."""
    runner.fwd.k = KernelConfig(triton=True, **VARIANTS[name])
    # the persistent one-token layers' start-up check (a launch that did not finish cleanly turns them off, and
    # the variant then times the separate launches: recorded, never a silent number)
    faults = runner.check_persistent()
    if faults:
        RESULT.setdefault("variant_faults", {})[name] = faults
        log(f"variant {name}: persistent launches did not finish cleanly, timed without them: {faults}")
    runner.graphs.clear()
    runner.capture(mixed=False)


def graph_timeline(runner: GpuModelRunner, cfg, layout, name: str, B: int) -> dict:
    """One replay of variant `name`'s batch-B decode graph under torch.profiler: its span, the kernels' busy time,
    the idle gaps and PDL overlaps by the kernel after them (_timing.timeline_stats)."""
    use_variant(runner, name)
    size = next(s for s in sorted(runner.graphs) if s >= B)
    seqs = decode_seqs(runner.pool, layout, B, ARGS.context, cfg.vocab_size)
    runner._replay(seqs, size)
    g = runner.graphs[size]
    for _ in range(3):
        g.graph.replay()
    row = {"variant": name, "batch": B, **device_timeline(g.graph.replay)}
    release(runner.pool, seqs)
    print(f"\ngraph timeline, batch {B}, {name}: span {row.get('span_us', 0):.1f} us, kernels busy "
          f"{row.get('busy_us', 0):.1f}, idle {row.get('gap_us', 0):.1f}, overlapped {row.get('overlap_us', 0):.1f} "
          f"({row['kernels']} kernels)")
    for r in row.get("idle_before", [])[:10]:
        print(f"  idle {r['us']:8.1f} us before x{r['count']:<4} {r['kernel']}")
    for r in row.get("overlap_before", [])[:5]:
        print(f"  overlap {r['us']:5.1f} us by x{r['count']:<4} {r['kernel']}")
    base = next((t for t in RESULT.get("graph_timeline", []) if t["variant"] == "control" and t["batch"] == B), None)
    if base is not None and name != "control":  # which kernels got longer or shorter than in the default's graph
        was = {d["kernel"]: d["us"] for d in base.get("duration", [])}
        now = {d["kernel"]: d["us"] for d in row.get("duration", [])}
        delta = sorted(((now.get(k, 0.0) - was.get(k, 0.0), k) for k in set(was) | set(now)), key=lambda d: -abs(d[0]))
        for d, k in delta[:8]:
            print(f"  {d:+8.1f} us against control: {k[:90]}")
    return row


def bench_mixed(runner: GpuModelRunner, cfg, layout, B: int, P: int) -> dict:
    """One eager step of B decodes (context ARGS.context) plus a new request's P-token prefill chunk, the
    step a server runs when a request arrives while B others decode, per --mixed-split variant: first the
    check (from the same states, the decodes' logits against an eager decode-only step's: with the split only
    the GEMMs' row grouping differs, so the error is far below the unsplit step's), then its time (CUDA
    events, so host launch gaps count), its device kernel time and launches (profiler), and its top kernels.
    The split variant's numbers are the row's own fields, the other's under "unsplit"; with the runner's
    piecewise graphs for the step's bucket, the replayed step's under "piecewise" (its decodes against the
    decode step's, its logits against the eager split step's)."""
    pool = runner.pool
    seqs = decode_seqs(pool, layout, B, ARGS.context, cfg.vocab_size)
    g = torch.Generator().manual_seed(P)
    table = pool.allocate(-(-P // layout.block_size), zero=False)
    states = pool.allocate(max(1, layout.pages_per_state_set))
    chunk = StepSeq(torch.randint(0, cfg.vocab_size, (P,), generator=g).tolist(), 0, table, states, True)
    # the KDA state pages, restored before each checked step (a step writes the MLA cache only at its own
    # positions, before reading them)
    pages = torch.tensor(sorted({p for s in seqs + [chunk] for p in s.state_pages}), device=pool.tensors[0].device)
    saved = [t[pages] for t in pool.tensors]

    def restore() -> None:
        for t, v in zip(pool.tensors, saved):
            t[pages] = v

    base = runner.fwd.k
    restore()
    want = runner.fwd(runner._build(seqs, []), decode=True)[:B].float()
    variants = {"on": [True], "off": [False], "both": [True, False]}[ARGS.mixed_split]
    row: dict = {"batch": B, "prefill": P}
    steps = {}
    for split in variants:
        runner.fwd.k = replace(base, kda_split=split)
        steps[split] = step = runner._build(seqs + [chunk], [])
        restore()
        got = runner.fwd(step)[:B].float()
        out = row if split else row.setdefault("unsplit", {})
        out.update(split=step.kda_split is not None, rel_vs_decode_step=float((got - want).norm() / want.norm()),
                   argmax_agree=float((got.argmax(-1) == want.argmax(-1)).float().mean()))
    timed = [(row if split else row["unsplit"], split, lambda step=step: runner.fwd(step))
             for split, step in steps.items()]
    mixed = runner.mixed
    if mixed is not None and (mixed.bucket(B + P) in mixed.graphs or not torch.cuda.is_available()):
        # the piecewise graphs (backend/runner/gpu/pieces.py) on the split step: its decodes against the decode
        # step's, and all its logits against the eager step's
        runner.fwd.k = base
        step = runner._build(seqs + [chunk], [])
        restore()
        eager = runner.fwd(step).float()
        restore()
        got = mixed.run(step).float()
        row["piecewise"] = out = {"bucket": mixed.bucket(B + P), "split": step.kda_split is not None,
                                  "rel_vs_decode_step": float((got[:B] - want).norm() / want.norm()),
                                  "argmax_agree": float((got[:B].argmax(-1) == want.argmax(-1)).float().mean()),
                                  "rel_vs_eager_step": float((got - eager).norm() / eager.norm())}
        timed.append((out, True, lambda step=step: mixed.run(step)))
    for out, split, fn in timed:
        runner.fwd.k = replace(base, kda_split=split)
        out["ms"] = time_ms(fn, reps=ARGS.reps, warmup=2)["median_ms"]
        out["kernel_ms"], out["launches"], top = kernel_profile(fn)
        out["top"] = top[:12]
        out["host"] = host_probe(fn)
    runner.fwd.k = base
    restore()
    del saved
    release(pool, seqs)
    pool.unref(table + states)
    return row


def host_probe(fn) -> dict:
    """Where a step's host time goes: the seconds until fn returns (the launches issued, before any wait
    for the device) against the wall with the wait; every host sync it makes (torch's sync debug mode,
    each with the innermost k3rt frame that caused it); and cProfile's top functions by own time. A step
    whose wall is its host time plus its kernel time waits on the device mid-step."""
    import cProfile
    import pstats
    import time
    import traceback
    import warnings

    if not torch.cuda.is_available():
        return {}  # the sync debug mode and the issue/wall split are the device's
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    syncs: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "k3rt" in f.filename or "/kernels/" in f.filename
                  or "/backend/" in f.filename]
        where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames else filename
        syncs[where] = syncs.get(where, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # (file, line, name) -> (cc, nc, tt, ct, ..)
    return {"issued_ms": issued * 1e3, "wall_ms": wall * 1e3, "syncs": syncs,
            "top_tottime": [{"fn": f"{Path(k[0]).name}:{k[1]} {k[2]}", "calls": v[1], "tottime_ms": v[2] * 1e3,
                             "cumtime_ms": v[3] * 1e3} for k, v in top]}


def bench_prefill(runner: GpuModelRunner, cfg, layout, T: int, matmul_tflops: float, active: int) -> dict:
    pool = runner.pool
    g = torch.Generator().manual_seed(T)
    toks = torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist()
    table = pool.allocate(-(-T // layout.block_size), zero=False)
    states = pool.allocate(max(1, layout.pages_per_state_set))
    chunks = [StepSeq(toks[s:s + ARGS.chunk], s, table, states, s + ARGS.chunk >= T)
              for s in range(0, T, ARGS.chunk)]
    steps = [runner._build([c], []) for c in chunks]

    def run() -> None:
        for s in steps:
            runner.fwd(s)

    t = time_ms(run, reps=3, warmup=1)["median_ms"]
    prof = {}
    if ARGS.profile_prefill:  # the last chunk: the most context its attention reads
        prof["kernel_ms"], prof["launches"], prof["top"] = kernel_profile(lambda: runner.fwd(steps[-1]))
        print(f"\nprofile: the last {len(chunks[-1].token_ids)}-token chunk of a {T}-token prefill: "
              f"{prof['kernel_ms']:.1f} ms of kernel time, {prof['launches']} kernel launches")
        for r in prof["top"]:
            print(f"  {r['us']:9.1f} us {100 * r['share']:5.1f} %  x{r['calls']:<4} {r['kernel']}")
    # attention flops of the MLA layers (expanded form: (P+R) + V per head per key, causal half)
    m = cfg.mla
    attn = sum(2 * m.num_heads * (m.qk_head_dim + m.v_head_dim) * T * T / 2 for _ in cfg.mla_layers)
    flops = 2 * active * T + attn
    pool.unref(table + states)
    return {"tokens": T, "chunk": ARGS.chunk, "ms": t, "tokens_per_s": T / (t * 1e-3),
            "tflops": flops / (t * 1e-3) / 1e12, "floor_ms": flops / (matmul_tflops * 1e12) * 1e3,
            "x_floor": t / (flops / (matmul_tflops * 1e12) * 1e3), **({"profile_last_chunk": prof} if prof else {})}


def matmul_rate() -> float:
    """bf16 8192^3 GEMMs (cuBLAS), TFLOP/s: the median of 30 after 10 of warm-up (session 29: a 10-rep reading
    taken at the process's start spread 732-796 TFLOP/s between calls)."""
    n = 8192 if torch.cuda.is_available() else 256
    dt = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    a = torch.randn(n, n, dtype=dt, device="cuda" if torch.cuda.is_available() else "cpu")
    b = torch.randn_like(a)
    t = time_ms(lambda: a @ b, reps=30, warmup=10)["median_ms"]
    return 2 * n**3 / (t * 1e-3) / 1e12


def rescale_prefill_floors() -> None:
    """The matmul rate measured again after the prefill timings (a warm GPU): the floors and ratios of every
    prefill row use the higher of the two readings, so a low first reading cannot flatter them."""
    again = matmul_rate()
    RESULT["matmul_tflops_readings"] = [RESULT["matmul_tflops"], again]
    if again <= RESULT["matmul_tflops"]:
        return
    scale = RESULT["matmul_tflops"] / again
    RESULT["matmul_tflops"] = again
    for r in RESULT["prefill"]:
        if "floor_ms" in r:
            r["floor_ms"] *= scale
            r["x_floor"] /= scale


def main() -> int:
    cuda = torch.cuda.is_available() and not ARGS.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if ARGS.smoke:
        ARGS.batch, ARGS.context, ARGS.prefill, ARGS.chunk, ARGS.reps = [1, 2], 40, [80], 64, 2
        ARGS.model = "tiny k3 config"
    cfg = config()
    RESULT["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    RESULT["copy"] = copy_bandwidth()
    gbps = RESULT["copy"]["GBps"]
    RESULT["matmul_tflops"] = matmul_rate()
    log(f"copy {gbps:.0f} GB/s, bf16 matmul {RESULT['matmul_tflops']:.0f} TFLOP/s")
    dtype = "bfloat16" if cuda else "float32"
    model = random_model(cfg, dtype=dtype, device=dev)
    log(f"random {ARGS.model} on {dev}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
    # routers drawn at the projections' small std send every token to the experts with the largest
    # correction bias; unit-variance logits and no bias route near-uniformly, as a trained router
    # balances load, so the expected-distinct-experts count below holds
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate_weight"):
            layer.mlp.gate_weight.normal_(0.0, cfg.hidden_size ** -0.5)
            layer.mlp.e_score_correction_bias.zero_()
    layout = compute_layout(cfg, kv_dtype=dtype, conv_dtype=dtype)
    per_seq = -(-(ARGS.context + 1) // layout.block_size) + layout.pages_per_state_set
    longest = -(-max(ARGS.prefill + ARGS.mixed, default=0) // layout.block_size) + layout.pages_per_state_set
    pool = PagePool(layout, max(ARGS.batch) * per_seq + longest + 2, device=dev)
    sizes = tuple(sorted(set(ARGS.batch)))
    # the piecewise graphs of the --mixed steps: the bucket each one pads to (not every bucket: capture time)
    buckets = tuple(sorted({b for P in ARGS.mixed if (b := bucket_for(max(ARGS.batch) + P)) is not None}))
    runner = GpuModelRunner(model, pool, kernels=KernelConfig(triton=cuda), cuda_graphs=cuda, graph_sizes=sizes,
                            mixed_buckets=buckets if ARGS.mixed_graphs else ())
    if ARGS.smoke and ARGS.mixed_graphs and buckets:  # no capture on the CPU: the same pieces run eagerly (bit-rot)
        runner.mixed = PiecewiseForward(runner.fwd, buckets)
    RESULT["layout"] = layout.as_dict()
    RESULT["decode"], RESULT["prefill"] = [], []
    for B in ARGS.batch:
        if over_budget():
            RESULT["decode"].append({"batch": B, "skipped": "budget"})
            continue
        row = bench_decode(runner, model, cfg, layout, gbps, B)
        log(f"decode B={B}: {row}")
        RESULT["decode"].append(row)
        save()
    for name in ARGS.variants if cuda else []:
        if over_budget():
            break
        use_variant(runner, name)
        for row in RESULT["decode"]:
            if "graph_size" in row:
                seqs = decode_seqs(pool, layout, row["batch"], ARGS.context, cfg.vocab_size)
                g = runner.graphs[row["graph_size"]]
                runner._replay(seqs, row["graph_size"])
                row[f"graph_{name}_ms"] = time_ms(g.graph.replay, reps=ARGS.reps, warmup=3)["median_ms"]
                row[f"{name}_gain"] = 1 - row[f"graph_{name}_ms"] / row["graph_ms"]
                release(pool, seqs)
        runner.fwd.k = KernelConfig(triton=True)
        runner.graphs.clear()
        runner.capture(mixed=False)
    RESULT["mixed"] = []
    for P in ARGS.mixed:
        if over_budget():
            break
        row = bench_mixed(runner, cfg, layout, max(ARGS.batch), P)
        for name, r in (("split", row), ("unsplit", row.get("unsplit")), ("piecewise", row.get("piecewise"))):
            if r is None or "ms" not in r:
                continue
            log(f"mixed B={row['batch']} P={P} {name}: {r['ms']:.2f} ms, kernels {r['kernel_ms']:.2f} ms, "
                f"{r['launches']} launches; decodes vs a decode step: rel {r['rel_vs_decode_step']:.2e}, "
                f"argmax {100 * r['argmax_agree']:.0f} %")
            for k in r["top"]:
                print(f"  {k['us']:9.1f} us {100 * k['share']:5.1f} %  x{k['calls']:<4} {k['kernel']}")
            h = r.get("host", {})
            if h:
                log(f"  host: issued in {h['issued_ms']:.2f} ms of a {h['wall_ms']:.2f} ms wall; syncs {h['syncs']}")
                for t in h["top_tottime"][:15]:
                    print(f"  {t['tottime_ms']:8.2f} ms own {t['cumtime_ms']:8.2f} ms cum x{t['calls']:<5} {t['fn']}")
        RESULT["mixed"].append(row)
        save()
    active = param_count(cfg)["active_per_token"] - cfg.vocab_size * cfg.hidden_size  # lookups are not flops
    base_k = runner.fwd.k
    intras = (list(INTRA_FORMS) if ARGS.prefill_kda_intra == "both"
              else [ARGS.prefill_kda_intra or base_k.kda_intra])
    routers = ["split", "fp32"] if ARGS.prefill_router == "both" else [ARGS.prefill_router]
    # the defaults first: a failing variant cannot cost the measured default's rows
    runs = [(f"{i}/{r}", dict(kda_intra=i, split_router_min_rows=base_k.split_router_min_rows if r == "split" else 0),
             i, r) for i in intras for r in routers]
    runs += [(c, _overrides(c), base_k.kda_intra, "split") for c in ARGS.prefill_configs]
    for label, overrides, intra, router in runs:
        runner.fwd.k = replace(base_k, **overrides)
        for T in ARGS.prefill:
            if over_budget():
                RESULT["prefill"].append({"tokens": T, "kda_intra": intra, "router": router, "config": label,
                                          "skipped": "budget"})
                continue
            row = {**bench_prefill(runner, cfg, layout, T, RESULT["matmul_tflops"], active), "kda_intra": intra,
                   "router": router, "config": label}
            log(f"prefill T={T}: {row}")
            RESULT["prefill"].append(row)
            save()
    runner.fwd.k = base_k
    if RESULT["prefill"]:
        rescale_prefill_floors()
        log(f"bf16 matmul readings {RESULT['matmul_tflops_readings'][0]:.0f} / "
            f"{RESULT['matmul_tflops_readings'][1]:.0f} TFLOP/s: the floors use the higher")
    # last: graphs replayed after a torch.profiler session ran 1-7% slower (RESULTS.md session 28)
    RESULT["profile"] = []
    for B in ARGS.profile:
        if not over_budget():
            RESULT["profile"].append(profile_step(runner, cfg, layout, B))
            save()
    RESULT["graph_timeline"] = []
    for B in ARGS.graph_timeline if cuda else []:
        chosen = ARGS.variants if ARGS.graph_timeline_variants is None else ARGS.graph_timeline_variants
        for name in ["control", *(v for v in chosen if v != "control")]:
            if over_budget():
                break
            RESULT["graph_timeline"].append(graph_timeline(runner, cfg, layout, name, B))
            save()
        use_variant(runner, "control")
    save()
    print_table()
    return 0


def _overrides(spec: str) -> dict:
    try:
        return parse_overrides(spec)
    except ValueError as e:
        raise SystemExit(f"--prefill-configs: {e}") from None


def print_table() -> None:
    print(f"\n{RESULT['device']}: copy {RESULT['copy']['GBps']:.0f} GB/s, matmul {RESULT['matmul_tflops']:.0f} TFLOP/s")
    var = [v for v in VARIANTS if any(f"graph_{v}_ms" in r for r in RESULT["decode"])]
    print("| batch | ctx | MB/step | roofline ms | eager ms | graph ms | " + "".join(f"graph {v} ms | " for v in var)
          + "runner step ms | x roofline | tok/s |")
    print("|---:|---:|---:|---:|---:|---:|" + "---:|" * len(var) + "---:|---:|---:|")
    for r in RESULT["decode"]:
        if "skipped" in r:
            print(f"| {r['batch']} | skipped |")
            continue

        def f(k: str) -> str:
            return f"{r[k]:.3f}" if k in r else "-"
        print(f"| {r['batch']} | {r['context']} | {r['bytes']['total'] / 1e6:.0f} | {r['roofline_ms']:.3f} | "
              f"{f('eager_ms')} | {f('graph_ms')} | " + "".join(f"{f(f'graph_{v}_ms')} | " for v in var) + f"{f('runner_step_ms')} | "
              f"{r['x_roofline']:.2f} | {r['tokens_per_s']:.0f} |")
    if RESULT.get("mixed"):
        print("\n| decodes | + prefill tokens | KDA split (graphs) | step ms | kernel ms | launches "
              "| decodes' rel err vs decode step |")
        print("|---:|---:|---|---:|---:|---:|---:|")
        for row in RESULT["mixed"]:
            for r in (row, row.get("unsplit"), row.get("piecewise")):
                if r is not None and "ms" in r:
                    form = ("on" if r["split"] else "off") + (f", piecewise {r['bucket']}" if "bucket" in r else "")
                    print(f"| {row['batch']} | {row['prefill']} | {form} | {r['ms']:.2f} | "
                          f"{r['kernel_ms']:.2f} | {r['launches']} | {r['rel_vs_decode_step']:.2e} |")
    if not RESULT["prefill"]:  # `--prefill` with no sizes: no prefill timed, no empty table
        return
    print("\n| prefill tokens | config | chunk | ms | tokens/s | TFLOP/s | x matmul floor |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in RESULT["prefill"]:
        if "skipped" in r:
            print(f"| {r['tokens']} | {r.get('config', '-')} | skipped |")
            continue
        print(f"| {r['tokens']} | {r['config']} | {r['chunk']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops']:.0f} | {r['x_floor']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
