#!/usr/bin/env python3
"""A speculative verify step against a plain decode step at a real model shape (issue 16's micro-goal:
verify of 1 + 7 tokens at Kimi-Linear-48B's shape, random bf16 weights, context 4K, batch 1, <= 1.30x a
plain decode step), on the GPU runner, graphs and eager, in one run.

    python3 benchmarks/spec_verify.py                  # Kimi-Linear-48B shape, one H200
    python3 benchmarks/spec_verify.py --smoke          # tiny config on CPU (torch ops): bit-rot check
    python3 benchmarks/spec_verify.py --variants multi # one KernelConfig.kda_verify_launch setting only
    python3 benchmarks/spec_verify.py --model k3-tiny --variants multi multi_hoist   # the multi kernel's two forms

Every row is measured once per --variants setting of KernelConfig.kda_verify_launch (default both, side by
side): "decode_loop" (the verify graph form's KDA as R = K + 1 kda_decode launches on scratch state copies,
its commit R more on the live states) and "multi" (kernels/kda/triton_multi.py: one launch each). Each
setting gets its own runner, so its verify and commit graphs are captured with it.

Correctness first (the timings are printed whatever it finds, with the verdict beside them):
  plain    the decode graph's logits against the eager decode step's, from the same states;
  verify   the verify graph's logits (the padded (bucket, K+1) form, backend/runner/gpu/verify_graph.py)
           against the eager verify step's (chunked KDA over the run, expanded MLA), and both leave the
           request's live KDA states as they were (verify runs commit afterwards).
Then medians of CUDA-event-timed repetitions:
  plain_graph_ms / plain_eager_ms      one decode step (batch B, 1 token each)
  verify_graph_ms / verify_eager_ms    one verify step (batch B, 1 + K tokens each)
  commit_ms / commit_eager_ms          the commit after a verify that accepted all K drafts (the accepted
                                       tokens replayed into the live KDA states): the verify form's (its
                                       commit graph, with the host copy of the accepted counts) / the eager
                                       step's kda_commit; their states are compared too
  verify_round_ms                      verify_graph_ms + commit_ms: what a verify round costs the device
and the bytes-moved floor of each (weights actually read: every dense parameter once, and per MoE layer
the distinct experts the step's tokens route to, counted from one recorded forward; plus KDA states read
and written once and the MLA latent KV read once) over the device's copy bandwidth. With random weights
the 1 + K tokens route to nearly independent experts, so a verify reads up to (1 + K) times the routed
expert bytes of a plain step: `floor_ratio` is the ratio physics allows, `verify_over_plain` the one
measured. JSON to --out (default $OUT/spec_verify.json) and a markdown table to stdout; --budget-s bounds
the run (items past it are skipped and say so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


# --variants: KernelConfig settings of the verify form's KDA (each launch value checked against KDA_VERIFY_LAUNCHES)
VARIANTS = {"decode_loop": dict(kda_verify_launch="decode_loop"), "multi": dict(kda_verify_launch="multi"),
            "multi_hoist": dict(kda_verify_launch="multi", kda_multi_hoist=True)}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi-linear-48b", help="preset name or checkpoint folder (config only)")
    p.add_argument("--batch", type=int, nargs="*", default=[1], help="requests per step (each its own context)")
    p.add_argument("--context", type=int, default=4096, help="tokens already in each request's cache")
    p.add_argument("--spec-tokens", type=int, default=7, metavar="K", help="draft tokens per verify (default 7)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--variants", nargs="+", default=["decode_loop", "multi"], metavar="LAUNCH",
                   help="KernelConfig.kda_verify_launch settings to time side by side (default: decode_loop multi); "
                        "multi_hoist: multi in its hoisted form (KernelConfig.kda_multi_hoist)")
    p.add_argument("--check-layers", type=int, default=4, metavar="N",
                   help="the correctness checks run on a random model of the same shape cut to its first N layers "
                        "(default 4: three KDA, one MLA at the 48B shape); after 27 random bf16 layers two correct "
                        "forms of one step differ by ~0.2 (the plain graph against plain eager already does), so "
                        "the full model times and the shallow one checks")
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU with torch ops (no kernels, no graphs)")
    p.add_argument("--budget-s", type=float, default=300.0, help="skip remaining items after this many seconds")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if not a.variants or any(v not in VARIANTS for v in a.variants):
        p.error(f"--variants: each one of {tuple(VARIANTS)}, got {a.variants}")
    if not 1 <= a.spec_tokens <= 16:
        p.error(f"--spec-tokens: must be in [1, 16], got {a.spec_tokens}")
    if not a.batch or min(a.batch) < 1 or max(a.batch) > 64:
        p.error(f"--batch: sizes in [1, 64] (the verify graphs' range), got {a.batch}")
    return a


ARGS = _args()
if ARGS.smoke:
    ARGS.batch, ARGS.context, ARGS.reps, ARGS.spec_tokens = [1, 2], 40, 2, 3

import gc  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
from _routing import distinct_experts  # noqa: E402
from _timing import Report, copy_bandwidth, default_out, rel_err, time_ms  # noqa: E402

from k3rt.backend.cache.pool import PagePool  # noqa: E402
from k3rt.backend.models.random_init import random_model  # noqa: E402
from k3rt.backend.runner.gpu.ops import KDA_VERIFY_LAUNCHES, KernelConfig  # noqa: E402
from k3rt.backend.runner.gpu.runner import GpuModelRunner  # noqa: E402
from k3rt.backend.runner.gpu.step import StepSeq  # noqa: E402
from k3rt.cache_layout import compute_layout  # noqa: E402
from k3rt.model_config import ModelConfig, load_model_config, parse_model_config  # noqa: E402

TOL = 5e-2  # relative error (norm) allowed between two forms of the same step in bf16 (fp32 on the CPU: ~1e-7)

REPORT = Report(default_out(ARGS.out, "spec_verify.json"), ARGS.budget_s,
                {"args": {k: str(v) for k, v in vars(ARGS).items()}})
RESULT, log = REPORT.result, REPORT.log


def config() -> ModelConfig:
    if ARGS.smoke:
        from k3rt.backend.models.tiny import TINY_CONFIGS

        return parse_model_config(TINY_CONFIGS["k3"])
    return load_model_config(ARGS.model)


def requests(pool: PagePool, layout, B: int, vocab: int) -> list[tuple[StepSeq, StepSeq]]:
    """B requests at --context tokens with noise in their caches: (plain decode, verify of 1 + K tokens)."""
    g = torch.Generator().manual_seed(B)
    K, ctx = ARGS.spec_tokens, ARGS.context
    out = []
    for _ in range(B):
        table = pool.allocate(-(-(ctx + 1 + K) // layout.block_size), zero=False)
        states = pool.allocate(max(1, layout.pages_per_state_set), zero=False)
        ids = torch.randint(0, vocab, (1 + K,), generator=g).tolist()
        for page in table:  # each page through the view its role uses (decode.py fill_noise says why)
            for t in range(len(pool.tensors)):
                pool.mla[t][page].normal_()
        for page in states:
            for t in range(len(pool.conv)):
                pool.conv[t][page].normal_()
                pool.rec[t][page].normal_(0.0, 0.05)
        out.append((StepSeq(ids[:1], ctx, table, states, True), StepSeq(ids, ctx, table, states, True, verify=True)))
    return out


def states_of(pool: PagePool, seqs: list[StepSeq]) -> list[torch.Tensor]:
    return [t[p].clone() for s in seqs for p in s.state_pages for t in (*pool.conv, *pool.rec)]


def restore(pool: PagePool, seqs: list[StepSeq], saved: list[torch.Tensor]) -> None:
    it = iter(saved)
    for s in seqs:
        for p in s.state_pages:
            for t in (*pool.conv, *pool.rec):
                t[p].copy_(next(it))


def floor_bytes(model, cfg: ModelConfig, layout, B: int, rows: int, distinct: list[int]) -> dict:
    """Bytes a step of B requests feeding `rows` tokens each must move at least."""
    dense = expert = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            dense += B * rows * p.shape[1] * p.element_size()
        elif name.endswith((".w13", ".w2")):
            expert += n
        else:
            dense += n
    per_layer = len(distinct) or 1
    experts = expert * sum(distinct) / (cfg.moe.num_experts * per_layer) if cfg.moe is not None and distinct else expert
    kda_layers = sum(t == "kda" for t in cfg.layer_types)
    state = 2 * B * kda_layers * layout.kda_state_bytes  # read once, written once (the commit)
    kv = B * len(cfg.mla_layers) * (ARGS.context + rows) * layout.mla_bytes_per_token
    return {"weights_dense": dense, "weights_experts": int(experts), "kda_state": state, "mla_kv": kv,
            "total": int(dense + experts + state + kv),
            "distinct_experts_per_layer": sum(distinct) / len(distinct) if distinct else None}


def shallow(cfg: ModelConfig, n: int) -> ModelConfig:
    """cfg cut to its first n layers (the check model: same widths, kernels and routing, little depth)."""
    n = min(n, cfg.num_hidden_layers)
    return replace(cfg, num_hidden_layers=n, layer_types=cfg.layer_types[:n], mlp_types=cfg.mlp_types[:n])


def build(cfg: ModelConfig, dtype: str, dev: torch.device, extra_pages: int):
    """(model with near-uniform routing, layout, pool for the largest batch) of cfg."""
    model = random_model(cfg, dtype=dtype, device=dev)
    # near-uniform routing, as a trained router balances load (decode.py says why)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate_weight"):
            layer.mlp.gate_weight.normal_(0.0, cfg.hidden_size ** -0.5)
            layer.mlp.e_score_correction_bias.zero_()
    layout = compute_layout(cfg, kv_dtype=dtype, conv_dtype=dtype)
    per_req = -(-(ARGS.context + 1 + ARGS.spec_tokens) // layout.block_size) + layout.pages_per_state_set
    return model, layout, PagePool(layout, max(ARGS.batch) * per_req + 3 + extra_pages, device=dev)


def check(runner: GpuModelRunner, cfg: ModelConfig, layout, B: int) -> dict:
    """The verify forms against eager on runner's (shallow) model: logits, states kept, the commit."""
    pool, K = runner.pool, ARGS.spec_tokens
    pairs = requests(pool, layout, B, cfg.vocab_size)
    plain, verify = [p for p, _ in pairs], [v for _, v in pairs]
    saved = states_of(pool, plain)
    row: dict = {"check_layers": cfg.num_hidden_layers}
    plain_step = runner._build(plain, [])
    want = runner.fwd(plain_step, decode=True).clone()
    restore(pool, plain, saved)
    size = next((s for s in sorted(runner.graphs) if s >= B), None)
    if size is not None:
        got = runner._replay(plain, size)[:B].clone()
        restore(pool, plain, saved)
        row["plain_graph_rel_err"] = rel_err(got, want)
    verify_step = runner._build(verify, [])
    want_v = runner.fwd(verify_step).clone()
    row["verify_eager_keeps_states"] = all(torch.equal(a, b) for a, b in zip(states_of(pool, plain), saved))
    vsize = next((s for s in runner.verify_sizes if s >= B), None)
    raw, vstep, vplan = runner._run_verify(verify, vsize, None, None)
    got_v = runner._verify_rows(raw, vplan)[0]
    row["verify_graph_rel_err"] = rel_err(got_v, want_v)
    row["verify_graph_keeps_states"] = all(torch.equal(a, b) for a, b in zip(states_of(pool, plain), saved))
    row["verify_graph_replayed"] = vsize in runner.verify_graphs
    row["verify_argmax_agree"] = float((got_v.argmax(-1) == want_v.argmax(-1)).float().mean())
    # bf16 over the check model's few layers: the verify graph's form (decode kernel, per-row MLA decode)
    # and the eager one (chunked KDA, expanded MLA) round differently; a broken form is off by O(1)
    ok = (row.get("plain_graph_rel_err", 0.0) < TOL and row["verify_graph_rel_err"] < TOL
          and row["verify_eager_keeps_states"] and row["verify_graph_keeps_states"])
    row["correct"] = bool(ok)
    runs = [(i, 1 + K, s.state_pages) for i, s in enumerate(verify)]
    runner.fwd.commit_verified(verify_step, runs)
    after_eager = states_of(pool, plain)
    restore(pool, plain, saved)
    runner._run_verify(verify, vsize, None, None)  # the graph's buffers hold this step again
    runner._commit_verify_form(vstep, vsize, runs)
    row["commit_graph_rel_err"] = rel_err(torch.cat([t.flatten().float() for t in states_of(pool, plain)]),
                                          torch.cat([t.flatten().float() for t in after_eager]))
    row["correct"] = row["correct"] and row["commit_graph_rel_err"] < TOL
    log(f"B={B} correctness ({cfg.num_hidden_layers} layers): " + ", ".join(f"{k}={row[k]}" for k in row))
    for s in plain:
        pool.unref(s.block_table + s.state_pages)
    return row


def bench(runner: GpuModelRunner, model, cfg: ModelConfig, layout, gbps: float, B: int) -> dict:
    """Times of the plain, verify and commit forms on the full model, and the bytes floors."""
    pool, K = runner.pool, ARGS.spec_tokens
    pairs = requests(pool, layout, B, cfg.vocab_size)
    plain, verify = [p for p, _ in pairs], [v for _, v in pairs]
    saved = states_of(pool, plain)
    row: dict = {"batch": B, "context": ARGS.context, "spec_tokens": K}
    plain_step = runner._build(plain, [])
    size = next((s for s in sorted(runner.graphs) if s >= B), None)
    verify_step = runner._build(verify, [])
    vsize = next((s for s in runner.verify_sizes if s >= B), None)
    vstep = runner._run_verify(verify, vsize, None, None)[1]
    restore(pool, plain, saved)
    runs = [(i, 1 + K, s.state_pages) for i, s in enumerate(verify)]

    # ---- timings ----
    row["plain_eager_ms"] = time_ms(lambda: runner.fwd(plain_step, decode=True), reps=ARGS.reps, warmup=2)["median_ms"]
    if size is not None:
        runner._replay(plain, size)
        row["plain_graph_ms"] = time_ms(runner.graphs[size].graph.replay, reps=ARGS.reps, warmup=3)["median_ms"]
    restore(pool, plain, saved)
    row["verify_eager_ms"] = time_ms(lambda: runner.fwd(verify_step), reps=ARGS.reps, warmup=2)["median_ms"]
    if vsize in runner.verify_graphs:
        runner._run_verify(verify, vsize, None, None)
        row["verify_graph_ms"] = time_ms(runner.verify_graphs[vsize].graph.replay, reps=ARGS.reps,
                                         warmup=3)["median_ms"]
    # the commit after a verify that kept every token: the eager one (kda_commit on the eager step) and the
    # verify form's (its commit graph when captured); both advance the live states, restored after each
    runner._run_verify(verify, vsize, None, None)  # the graph's buffers hold this step again
    restore(pool, plain, saved)
    row["commit_eager_ms"] = time_ms(lambda: runner.fwd.commit_verified(verify_step, runs), reps=ARGS.reps,
                                     warmup=2)["median_ms"]
    restore(pool, plain, saved)
    row["commit_ms"] = time_ms(lambda: runner._commit_verify_form(vstep, vsize, runs), reps=ARGS.reps,
                               warmup=2)["median_ms"]
    restore(pool, plain, saved)
    plain_best = row.get("plain_graph_ms", row["plain_eager_ms"])
    verify_best = row.get("verify_graph_ms", row["verify_eager_ms"])
    row["verify_round_ms"] = verify_best + row["commit_ms"]
    row["verify_over_plain"] = verify_best / plain_best
    row["round_over_plain"] = row["verify_round_ms"] / plain_best

    # ---- the bytes floor ----
    row["plain_bytes"] = floor_bytes(model, cfg, layout, B, 1, distinct_experts(runner, plain_step))
    restore(pool, plain, saved)
    row["verify_bytes"] = floor_bytes(model, cfg, layout, B, 1 + K, distinct_experts(runner, verify_step))
    row["plain_floor_ms"] = row["plain_bytes"]["total"] / (gbps * 1e9) * 1e3
    row["verify_floor_ms"] = row["verify_bytes"]["total"] / (gbps * 1e9) * 1e3
    row["floor_ratio"] = row["verify_floor_ms"] / row["plain_floor_ms"]
    for s in plain:
        pool.unref(s.block_table + s.state_pages)
    return row


def main() -> int:
    cuda = torch.cuda.is_available() and not ARGS.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = config()
    RESULT["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    RESULT["copy"] = copy_bandwidth()
    gbps = RESULT["copy"]["GBps"]
    dtype = "bfloat16" if cuda else "float32"
    model, layout, pool = build(cfg, dtype, dev, len(ARGS.variants))
    log(f"random {'tiny k3 config' if ARGS.smoke else ARGS.model} on {dev}: "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, copy {gbps:.0f} GB/s")
    ccfg = shallow(cfg, ARGS.check_layers)
    cmodel, clayout, cpool = build(ccfg, dtype, dev, len(ARGS.variants))
    sizes = tuple(sorted(set(ARGS.batch)))
    assert {VARIANTS[v]["kda_verify_launch"] for v in ARGS.variants} <= set(KDA_VERIFY_LAUNCHES), ARGS.variants
    RESULT["rows"] = []
    for variant in ARGS.variants:
        if REPORT.over_budget():
            RESULT["rows"] += [{"batch": B, "variant": variant, "skipped": f"budget {ARGS.budget_s:.0f}s spent"}
                               for B in ARGS.batch]
            continue
        # a runner per setting: its verify and commit graphs are captured with it
        kernels = KernelConfig(triton=cuda, **VARIANTS[variant])
        runner, crunner = (GpuModelRunner(m, p, kernels=kernels, cuda_graphs=cuda, graph_sizes=sizes,
                                          verify_graphs=(ARGS.spec_tokens, sizes)) for m, p in ((model, pool), (cmodel, cpool)))
        for r in (runner, crunner):
            if not cuda:  # no graphs: the padded form they replay, run eagerly (the runner keeps it only when captured)
                r.verify_run_len, r.verify_sizes = ARGS.spec_tokens + 1, sizes
        for B in ARGS.batch:
            if REPORT.over_budget():
                RESULT["rows"].append({"batch": B, "variant": variant, "skipped": f"budget {ARGS.budget_s:.0f}s spent"})
                continue
            checked = check(crunner, ccfg, clayout, B)
            RESULT["rows"].append({"variant": variant, **bench(runner, model, cfg, layout, gbps, B), **checked})
            REPORT.save()
        del runner, crunner  # their pad pages stay reserved (the pools count one per setting)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    REPORT.save()
    print_table()
    return 0 if all(r.get("correct", True) for r in RESULT["rows"]) else 1


def print_table() -> None:
    print(f"\n{RESULT['device']}: copy {RESULT['copy']['GBps']:.0f} GB/s, context {ARGS.context}, "
          f"verify of 1 + {ARGS.spec_tokens} tokens per request")
    print(f"| kda_verify_launch | batch | correct ({ARGS.check_layers}-layer check) | plain graph ms | plain eager ms | verify graph ms | verify eager ms | "
          "commit ms | "
          "commit eager ms | "
          "verify/plain | round/plain | plain floor ms | verify floor ms | floor ratio | experts/layer plain, verify |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in RESULT["rows"]:
        if "skipped" in r:
            print(f"| {r['variant']} | {r['batch']} | skipped |")
            continue

        def f(k: str) -> str:
            return f"{r[k]:.3f}" if k in r else "-"
        ex = [r[b]["distinct_experts_per_layer"] for b in ("plain_bytes", "verify_bytes")]
        print(f"| {r['variant']} | {r['batch']} | {'yes' if r['correct'] else 'NO'} | {f('plain_graph_ms')} | "
              f"{f('plain_eager_ms')} | "
              f"{f('verify_graph_ms')} | {f('verify_eager_ms')} | {f('commit_ms')} | {f('commit_eager_ms')} | "
              f"{r['verify_over_plain']:.2f} | "
              f"{r['round_over_plain']:.2f} | {r['plain_floor_ms']:.3f} | {r['verify_floor_ms']:.3f} | "
              f"{r['floor_ratio']:.2f} | {', '.join('-' if e is None else f'{e:.1f}' for e in ex)} |")


if __name__ == "__main__":
    sys.exit(main())
