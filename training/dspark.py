"""Distill a DSpark drafter (backend/spec/dspark/) from a target's own greedy outputs.

    python -m k3rt.training.dspark gen   --out .cache/dspark/train.pt --minutes 6      # target greedy data
    python -m k3rt.training.dspark train --data .cache/dspark/train.pt --out DIR --minutes 20
    python -m k3rt.training.dspark eval  --drafter DIR --num-prompts 24               # tau on held-out code

gen: prompts are random windows of the corpus's training-split code (training/corpus.py: this machine's
stdlib, minus the held-out modules); the target continues each greedily (through k3rt's engine, many
requests at once: the default on a GPU; its cached decode path; or repeated dense forwards: --greedy-path),
and forward hooks keep the chosen layers' states at every processed position (the engine path: one dense
forward over each finished sequence, in gen or, with --no-states, when train loads the file). Those
continuations are what the target emits, so teacher forcing on them trains the drafter to predict the
target's greedy tokens, from exactly the states it will be given at serving time (a position's state is
known once the target has run that token; the newest token, the anchor, has none yet).
train: per anchor position t: the states at t-W..t-1 (left-padded and masked before the sequence start),
their tokens and x_t -> x_{t+1..t+k}. Loss = position-weighted cross-entropy of the draft distribution
(base + Markov logits, the Markov head given the true previous tokens, mixed with the copy head's) + BCE of the confidence head on "draft j's argmax is
right" over the anchors whose drafts before j were all right (its estimate is conditional, so the
product over a prefix estimates that the whole prefix is accepted); confidence reads detached states.
A held-out split of the greedy prompts is evaluated against the training ones as it goes (teacher-forced
tau, logged and kept in training.json); the weights with the best held-out tau are saved.
eval: tau = mean(accepted + 1) per verify round, replaying greedy speculative decoding against the
target's greedy continuation of held-out prompts (no engine: greedy verification accepts exactly the
prefix of drafts that equals the target's greedy tokens); with n-gram prompt lookup on the same
continuations as the baseline. On a GPU machine, training/dspark_device.sh runs them all in about 8.5 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from k3rt.backend.bench.spec_bench import code_windows
from k3rt.backend.models.batch import ForwardBatch
from k3rt.backend.models.kimi import KimiForCausalLM
from k3rt.backend.models.loader import load_model
from k3rt.backend.spec.base import DraftQuery, Drafter
from k3rt.backend.spec.dspark.checkpoint import load_drafter, save_drafter
from k3rt.backend.spec.dspark.model import DSparkConfig, DSparkModel, verify_length
from k3rt.backend.spec.dspark.target import capture_states, dense_states, stack_states
from k3rt.backend.spec.ngram import NgramDrafter
from k3rt.backend.tokenizer import load_tokenizer
from k3rt.model_config import load_model_config
from k3rt.training.corpus import HELDOUT_MODULES, code_documents, stdlib_dir
from k3rt.training.train import use_fast_kda

# The k3-tiny drafter's shape (docs/dspark.md): three target states (after 2 and 5 layers, and the final
# one) with their tokens, the last 128 run positions (a greedy small target repeats itself from far back:
# the copy head points there), 2 block layers at the target's width, 7 drafts.
K3_TINY_DSPARK = dict(vocab_size=8192, hidden_size=384, target_hidden_size=384, target_layers=(2, 5, 8),
                      context_len=128, block_size=7, num_layers=2, num_heads=6, head_dim=64, intermediate_size=768,
                      markov_rank=32, confidence_hidden=64, confidence_threshold=0.3, min_verify=1,
                      context_tokens=True, copy_dim=64)


# ---- data: the target's own greedy continuations --------------------------------------------------

def code_prompts(split: str, num: int, prompt_len: int, seed: int, model: str = "k3-tiny") -> list[list[int]]:
    """`num` windows of `prompt_len` tokens from code documents of one corpus split, each starting at a
    line start of a random document (BOS first, as a served prompt)."""
    texts = _heldout_sources() if split == "heldout" else [d.text for d in code_documents(stdlib_dir()) if d.split == split]
    return code_windows(texts, load_tokenizer(model), num, prompt_len, seed)


def training_prompts(split: str, num: int, prompt_len: int, seed: int, model: str, holdout_frac: float
                     ) -> tuple[list[list[int]], list[bool]]:
    """gen's prompts: code_prompts' windows without exact repeats, and which of them come from the
    `holdout_frac` of the split's documents that train keeps out of training (chosen by a hash of each
    document's name, so every run holds out the same ones; whole documents, so no held-out window overlaps
    a training window). The held-out prompts come first (a budget that ends early still has them)."""
    docs = [d for d in code_documents(stdlib_dir()) if d.split == split]
    cut = round(holdout_frac * 2**32)
    held = [d.text for d in docs if zlib.crc32(d.name.encode()) < cut]
    rest = [d.text for d in docs if zlib.crc32(d.name.encode()) >= cut]
    if holdout_frac > 0 and (not held or not rest):
        raise ValueError(f"--holdout-docs: {holdout_frac} of {len(docs)} documents leaves no "
                         f"{'held-out' if not held else 'training'} document")
    tok = load_tokenizer(model)
    n_held = min(num, max(1, round(holdout_frac * num))) if held else 0
    out: list[list[int]] = []
    for texts, n, sd in ((held, n_held, seed + 1), (rest, num - n_held, seed)):
        seen: set[tuple[int, ...]] = set()
        for w in code_windows(texts, tok, n, prompt_len, sd) if n else []:
            if tuple(w) not in seen:  # a repeated window would only repeat its continuation
                seen.add(tuple(w))
                out.append(w)
        if texts is held:
            n_held = len(out)
    return out, [i < n_held for i in range(len(out))]


def _heldout_sources() -> list[str]:
    """The held-out modules' code documents' texts in code_documents' order, read directly: scanning and
    parsing the whole stdlib for them takes seconds (too slow for the tests' prompts)."""
    root = stdlib_dir()
    paths = []
    for m in HELDOUT_MODULES:
        single = root / f"{m}.py"
        paths += [single] if single.is_file() else [p for p in (root / m).rglob("*.py") if "__pycache__" not in p.parts]
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    return [p.read_text(encoding="utf-8").replace("\r\n", "\n").replace("\r", "\n") for p in paths]


@torch.no_grad()
def greedy_with_states(target: KimiForCausalLM, prompts: Sequence[Sequence[int]], gen_len: int,
                       layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy continuation of equal-length prompts through the cached decode path. Returns tokens
    [B, P + gen_len], states [B, P + gen_len - 1, F] fp16 (the last token never runs) and the target's
    argmax next token after every run position [B, P + gen_len - 1] (inside the prompt too)."""
    b, p = len(prompts), len(prompts[0])
    device = target.lm_head.weight.device
    caches = [target.new_cache(device) for _ in range(b)]
    ids = torch.tensor(prompts, device=device)
    states = []
    with capture_states(target, layers) as got:
        logits = target(ids.reshape(-1), ForwardBatch([p] * b, [0] * b, caches))
        states.append(stack_states(got, layers).view(b, p, -1).half())
        prompt_next = logits.view(b, p, -1).argmax(-1)
        tok = prompt_next[:, -1]
        out = [tok]
        for s in range(gen_len - 1):
            tok = target(tok, ForwardBatch([1] * b, [p + s] * b, caches)).argmax(-1)
            states.append(stack_states(got, layers).view(b, 1, -1).half())
            out.append(tok)
    gen = torch.stack(out, 1)
    return torch.cat([ids, gen], 1), torch.cat(states, 1), torch.cat([prompt_next, gen[:, 1:]], 1)


@torch.no_grad()
def greedy_dense(target: KimiForCausalLM, prompts: Sequence[Sequence[int]], gen_len: int, layers: Sequence[int],
                 deadline: float = math.inf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """greedy_with_states' result from cache-less dense forwards: each new token is the argmax after a full
    forward of the sequence so far, then one more dense forward gives every position's states and argmax.
    Quadratic work, but every forward is one [B, T] batch: on a GPU this beats the cached path, whose
    layers loop over the batch's sequences (kernel-launch bound at k3-tiny's size). None when `deadline`
    (time.time()) passes first. Labels are the final forward's argmaxes, so a near-tie decided differently
    by the stepwise forwards only shortens that anchor's label chain (gather)."""
    device = target.lm_head.weight.device
    ids = torch.tensor(prompts, device=device)
    b = ids.shape[0]
    for _ in range(gen_len):
        if time.time() > deadline:
            return None
        t = ids.shape[1]
        last = torch.arange(1, b + 1, device=device) * t - 1
        nxt = target(ids.reshape(-1), ForwardBatch([t] * b, logits_indices=last)).argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
    nexts, states = dense_states(target, ids[:, :-1], layers)
    return ids, states.half(), nexts


def greedy_engine(target: KimiForCausalLM, model: str, prompts: Sequence[Sequence[int]], gen_len: int, *,
                  batch: int, device: str, dtype: str, deadline: float = math.inf,
                  progress: Callable[[int], None] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Greedy continuations through k3rt's own engine, `batch` sequences at once (continuous batching; the
    GPU runner with decode CUDA graphs on CUDA, the reference runner elsewhere): one prefill and then one
    decode step per token, instead of the dense path's forward of every sequence so far per token.
    Returns (tokens [N, P + gen_len], their prompt indices) of the prompts that finished before `deadline`
    (time.time()), in prompt order; the rest are dropped with the engine. No states: capture them after
    with one dense forward (`states_and_next`), which is exact and keeps the engine unchanged. `target` is the loaded model of
    checkpoint `model`, shared with the engine (not copied)."""
    from k3rt.backend.engine import Engine, cache_geometry
    from k3rt.config import CacheConfig, EngineConfig, SchedulerConfig
    from k3rt.sampling_params import SamplingParams

    p = len(prompts[0])
    if any(len(x) != p for x in prompts):
        raise ValueError("prompts: the engine path needs equal-length prompts (the output is one [N, T] tensor)")
    # pages: every running request's KV for its whole length plus its KDA state set; no prefix cache (random
    # windows share nothing), so nothing else holds pages
    base = EngineConfig(model=model, dtype=dtype, device=device)
    layout, _ = cache_geometry(base, load_model_config(model))
    per_request = -(-(p + gen_len) // layout.block_size) + layout.pages_per_state_set
    cache = CacheConfig(num_pages=batch * per_request + 8, enable_prefix_cache=False)
    # one step may prefill a whole batch of prompts (they arrive together and finish together)
    budget = max(2048, -(-batch * p // 64) * 64)
    sched = SchedulerConfig(max_running=batch, max_waiting=2 * batch, max_num_batched_tokens=budget)
    engine = Engine(replace(base, cache=cache, scheduler=sched), model=target)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    rids: dict[int, int] = {}  # engine request id -> prompt index
    done: dict[int, list[int]] = {}
    fed = 0
    try:
        while len(done) < len(prompts):
            if time.time() > deadline:
                break
            while fed < len(prompts) and len(rids) - len(done) < 2 * batch:  # running + one batch waiting
                rids[engine.add_request(prompts[fed], params)] = fed
                fed += 1
            if not engine.has_unfinished:
                raise RuntimeError(f"greedy_engine: the engine stalled with {len(rids) - len(done)} requests "
                                   "unfinished")
            for o in engine.step():
                if o.finished:
                    if o.error is not None or len(o.output_ids) != gen_len:
                        raise RuntimeError(f"greedy_engine: request {o.rid} ended {o.finish_reason} after "
                                           f"{len(o.output_ids or [])} of {gen_len} tokens ({o.error})")
                    done[rids[o.rid]] = o.output_ids
                    if progress is not None:
                        progress(1)
    finally:
        engine.close()
    idx = sorted(done)
    if not idx:
        return torch.empty(0, p + gen_len, dtype=torch.long), idx
    return torch.tensor([list(prompts[i]) + done[i] for i in idx], dtype=torch.long), idx


@torch.no_grad()
def states_and_next(target: KimiForCausalLM, tokens: torch.Tensor, layers: Sequence[int], batch: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The states [N, T - 1, F] fp16 and argmax next tokens [N, T - 1] of finished sequences [N, T] (the
    last token is never run), from one dense forward per `batch` sequences on the target's device; the
    result stays there. Exact: what the cached path records (test_dspark.py checks they agree)."""
    device = target.lm_head.weight.device
    states, nexts = [], []
    for i in range(0, tokens.shape[0], batch):
        nx, st = dense_states(target, tokens[i: i + batch, :-1].to(device), layers)
        states.append(st.half())
        nexts.append(nx)
    return torch.cat(states), torch.cat(nexts)


@torch.no_grad()
def corpus_with_states(target: KimiForCausalLM, windows: torch.Tensor, layers: Sequence[int]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Corpus windows [B, T] through one dense forward: (tokens, states [B, T - 1, F] fp16, argmax next
    [B, T - 1]) in greedy_with_states' layout. Far cheaper per position than decoding, but a corpus
    token is a target greedy token only where it equals the argmax before it (`label_chain`)."""
    nxt, st = dense_states(target, windows, layers)
    return windows, st[:, :-1].half(), nxt[:, :-1]


def cmd_gen(args: argparse.Namespace) -> None:
    target = load_model(args.target, dtype=args.target_dtype, device=args.device, progress=False)
    layers = tuple(args.layers)
    path = args.greedy_path
    if path == "auto":
        path = "engine" if args.device.startswith("cuda") else "cached"
    if args.source == "corpus" or path in ("dense", "engine"):
        # the dense [B, T] path only (the engine path's state capture); the cached path and the engine's
        # runners do not read it, and the checkpoint is untouched
        use_fast_kda(target)
    if not 0 <= args.holdout_docs < 1:
        raise ValueError(f"--holdout-docs: must be in [0, 1), got {args.holdout_docs}")
    held = None
    if args.source == "corpus":
        prompts = code_prompts(args.split, args.max_prompts, args.prompt_len + args.gen_len, args.seed, args.target)
    else:
        prompts, held = training_prompts(args.split, args.max_prompts, args.prompt_len, args.seed, args.target,
                                         args.holdout_docs)
    tokens, states, nexts, t0 = [], [], [], time.time()
    deadline = t0 + args.minutes * 60
    bar = tqdm(total=len(prompts), desc=f"gen {args.source} {args.split}", unit="seq")
    if args.source == "greedy" and path == "engine":
        # one engine over all prompts (continuous batching); the states come after, per batch
        tk, finished = greedy_engine(target, args.target, prompts, args.gen_len, batch=args.batch,
                                     device=args.device, dtype=args.target_dtype, deadline=deadline,
                                     progress=bar.update)
        held = [held[i] for i in finished]
        if tk.shape[0]:
            tokens.append(tk)
        gen_s = time.time() - t0
        if tk.shape[0] and not args.no_states:
            st, nx = states_and_next(target, tk, layers, args.batch)
            states.append(st.cpu())
            nexts.append(nx.cpu())
    else:
        for i in range(0, len(prompts), args.batch):
            if time.time() > deadline:
                break
            if args.source == "corpus":
                tk = torch.tensor(prompts[i: i + args.batch], device=args.device)
                if args.no_states:  # train runs the same forward when it loads the file
                    tk, st, nx = tk, None, None
                else:
                    tk, st, nx = corpus_with_states(target, tk, layers)
            elif path == "dense":
                got = greedy_dense(target, prompts[i: i + args.batch], args.gen_len, layers, deadline)
                if got is None:  # the budget ran out inside this batch: it is dropped
                    break
                tk, st, nx = got
            else:
                tk, st, nx = greedy_with_states(target, prompts[i: i + args.batch], args.gen_len, layers)
            tokens.append(tk.cpu())
            if st is not None and not args.no_states:
                states.append(st.cpu())
                nexts.append(nx.cpu())
            bar.update(tk.shape[0])
        gen_s = time.time() - t0
    bar.close()
    if not tokens:
        raise SystemExit(f"gen: no batch finished within --minutes {args.minutes} (lower --batch or --gen-len)")
    data = {"tokens": torch.cat(tokens), "states": torch.cat(states) if states else None,
            "next": torch.cat(nexts) if nexts else None, "source": args.source, "target_layers": list(layers),
            "target": args.target, "split": args.split}
    if held is not None:  # which sequences train holds out (their prompts' documents never train)
        data["holdout"] = torch.tensor(held[: data["tokens"].shape[0]], dtype=torch.bool)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, args.out)
    n, t = data["tokens"].shape
    how = f"{path} path, {n / gen_s * 60:.0f} sequences/min" if args.source == "greedy" else "corpus windows"
    print(f"{n} sequences x {t} tokens ({how}, {gen_s:.1f} s; states "
          f"{'left to train' if data['states'] is None else 'included'}) -> {args.out}")


# ---- training ---------------------------------------------------------------------------------------

# anchors need at least this many run positions before them (or the whole window, if shorter)
MIN_CONTEXT = 8


def anchors(nxt: torch.Tensor, cfg: DSparkConfig) -> torch.Tensor:
    """All (sequence, t) pairs with some context before t and a known first label. A window that reaches
    before the sequence start is left-padded (`window`), as the engine pads a short request's."""
    n, run = nxt.shape  # run = tokens - 1 positions have states and an argmax
    ts = torch.arange(min(cfg.context_len, MIN_CONTEXT), run, device=nxt.device)
    pairs = torch.stack(torch.meshgrid(torch.arange(n, device=nxt.device), ts, indexing="ij"), -1).reshape(-1, 2)
    return pairs[nxt[pairs[:, 0], pairs[:, 1]] >= 0]


def window(tokens: torch.Tensor, states: torch.Tensor, pairs: torch.Tensor, cfg: DSparkConfig
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pairs [B, 2] (sequence, anchor position t) -> (states of t-W..t-1 [B, W, F] fp32, token ids of t-W..t
    [B, W + 1], valid [B, W]). Positions before 0 repeat position 0 (the engine's padding of a short
    request) and are invalid."""
    seq, t = pairs[:, 0:1], pairs[:, 1:2]
    pos = t + torch.arange(-cfg.context_len, 1, device=t.device)  # [B, W + 1], the anchor last
    ctx = states[seq, pos[:, :-1].clamp(min=0)].float()
    return ctx, tokens[seq, pos.clamp(min=0)], pos[:, :-1] >= 0


def gather(tokens: torch.Tensor, states: torch.Tensor, nxt: torch.Tensor, pairs: torch.Tensor, cfg: DSparkConfig
           ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """pairs [B, 2] -> (window(...), previous tokens x_t..x_{t+k-1} [B, k], labels [B, k], valid [B, k]).
    Label j is the target's argmax after x_{t+j-1}; it is the target's greedy draft j only while
    x_{t+1..t+j-1} are themselves the target's argmaxes (always, on greedy data)."""
    seq, t = pairs[:, 0:1], pairs[:, 1:2]
    k, run = cfg.block_size, nxt.shape[1]
    pos = t + torch.arange(k, device=t.device)  # positions whose argmax is label j (j = 1..k)
    inside = pos < run
    pos = pos.clamp(max=run - 1)
    labels = nxt[seq, pos]
    prev = tokens[seq, pos]
    # x_{t+j} (j >= 1) agrees with the argmax before it; label j needs agreement at t+1..t+j-1
    agree = tokens[seq, (pos + 1).clamp(max=tokens.shape[1] - 1)] == labels
    chain = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1].int().cumprod(1).bool()], 1)
    valid = inside & chain & (labels >= 0)
    return window(tokens, states, pairs, cfg), prev, labels.clamp(min=0), valid


def _window_kwargs(model: DSparkModel, win: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict:
    """The block's window arguments as the engine's drafter passes them: an old-format drafter (no context
    tokens, no copy head) gets neither ids nor mask (its padding rows are plain repeats)."""
    return dict(ctx_tokens=win[1], ctx_valid=win[2]) if model.needs_tokens else {}


def losses(model: DSparkModel, win: tuple[torch.Tensor, torch.Tensor, torch.Tensor], prev: torch.Tensor,
           labels: torch.Tensor, valid: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor,
           pos_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token loss, confidence loss, per-position argmax match [B, k]) of one batch."""
    logits, hidden = model.scores(win[0], prev, embed, lm_head, **_window_kwargs(model, win))
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    w = pos_weight * valid
    token_loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    match = (logits.argmax(-1) == labels) & valid
    # draft j counts only where drafts 1..j-1 were all right: the estimate is conditional on them
    reached = torch.cat([torch.ones_like(match[:, :1]), match.int().cumprod(1)[:, :-1].bool()], 1) & valid
    top = torch.softmax(logits.detach(), -1).amax(-1) if model.cfg.copy_dim else None
    conf = model.confidence(hidden.detach(), prev, top)
    bce = F.binary_cross_entropy_with_logits(conf, match.float(), reduction="none")
    conf_loss = (bce * reached).sum() / reached.sum().clamp(min=1)
    return token_loss, conf_loss, match


def split_holdout(pairs: torch.Tensor, num_seqs: int, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [N, 2] -> (training anchors, held-out anchors): a random `frac` of the sequences (whole
    prompts, so no held-out anchor shares a continuation with a training one) keep all their anchors out of
    training. At least one sequence each way when frac > 0 and there are two or more."""
    held = round(frac * num_seqs)
    held = min(max(held, 1 if frac > 0 else 0), num_seqs - 1) if num_seqs > 1 else 0
    out = torch.zeros(num_seqs, dtype=torch.bool)
    out[torch.randperm(num_seqs, generator=torch.Generator().manual_seed(seed))[:held]] = True
    return split_by_mask(pairs, out)


def split_by_mask(pairs: torch.Tensor, held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [N, 2] -> (those of sequences not in `held` [num_seqs] bool, those of sequences in it)."""
    is_out = held.to(pairs.device)[pairs[:, 0]]
    return pairs[~is_out], pairs[is_out]


@torch.no_grad()
def teacher_forced_tau(model: DSparkModel, tokens: torch.Tensor, states: torch.Tensor, nxt: torch.Tensor,
                       pairs: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor, batch: int) -> float:
    """Mean over anchors of 1 + the drafts' longest prefix equal to the labels, teacher-forced (the Markov
    head given the true previous tokens, as in training). On greedy data it estimates replay_tau's τ at
    every position, not only at round starts."""
    was = model.training
    model.eval()
    total = 0.0
    for i in range(0, pairs.shape[0], batch):
        win, prev, labels, valid = gather(tokens, states, nxt, pairs[i: i + batch], model.cfg)
        logits, _ = model.scores(win[0], prev, embed, lm_head, **_window_kwargs(model, win))
        match = (logits.argmax(-1) == labels) & valid
        total += float(match.int().cumprod(1).sum(1).add(1).sum())
    model.train(was)
    return total / max(1, pairs.shape[0])


def _sample(pairs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """A fixed random subset of at most n anchors (the same one at every evaluation)."""
    if pairs.shape[0] <= n:
        return pairs
    return pairs[torch.randperm(pairs.shape[0], generator=torch.Generator().manual_seed(seed))[:n].to(pairs.device)]


class BestWeights:
    """Early stopping's memory: the weights at the best score so far (held-out τ; higher is better) and how
    many scores since did not beat it."""

    def __init__(self) -> None:
        self.score: float | None = None
        self.step: int | None = None
        self.weights: dict[str, torch.Tensor] | None = None
        self.stale = 0

    def update(self, score: float, step: int, model: torch.nn.Module) -> bool:
        """Record one evaluation; True when it is the new best (a tie keeps the earlier weights)."""
        if self.score is not None and score <= self.score + 1e-4:
            self.stale += 1
            return False
        self.score, self.step, self.stale = score, step, 0
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return True

    def restore(self, model: torch.nn.Module) -> None:
        if self.weights is not None:
            model.load_state_dict(self.weights)


def cmd_train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    if not 0 <= args.holdout_frac < 1:
        raise ValueError(f"--holdout-frac: must be in [0, 1), got {args.holdout_frac}")
    if not 0 <= args.state_dropout < 1:
        raise ValueError(f"--state-dropout: must be in [0, 1), got {args.state_dropout}")
    for name in ("holdout_anchors", "capture_batch", "batch") + (("patience",) if args.patience is not None else ()):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.eval_every < 0:
        raise ValueError(f"--eval-every: must be >= 0 seconds, got {args.eval_every}")
    if args.device.startswith("cuda"):  # TF32 matmuls: a drafter's argmax does not need fp32's last bits
        torch.set_float32_matmul_precision("high")
    parts = [torch.load(path) for path in args.data]
    data = {"target_layers": parts[0]["target_layers"], "target": parts[0]["target"]}
    if any(d["target_layers"] != data["target_layers"] or d["target"] != data["target"] for d in parts):
        raise ValueError("--data: the files were generated with different targets or target_layers")
    cfg = DSparkConfig(**{**K3_TINY_DSPARK, "target_layers": tuple(data["target_layers"]),
                          "block_size": args.block_size, "num_layers": args.num_layers,
                          "markov_rank": args.markov_rank, "context_len": args.context_len,
                          "context_tokens": args.context_tokens, "copy_dim": args.copy_dim})
    if args.init is not None:  # continue a drafter (its own config; the shape flags are ignored)
        model = load_drafter(args.init, device=args.device).train()
        if model.cfg.target_layers != cfg.target_layers:
            raise ValueError(f"--init: the drafter reads target_layers {list(model.cfg.target_layers)}, the data "
                             f"holds {list(cfg.target_layers)}")
        cfg = model.cfg
        notes_file = args.init / "training.json"
        prior = json.loads(notes_file.read_text()) if notes_file.is_file() else None
    else:
        model = DSparkModel(cfg).to(args.device)
        model.init_weights(args.seed)
        prior = None
    target = load_model(data["target"], dtype="float32", device=args.device, progress=False)
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    t_load = time.time()
    if any(d["states"] is None for d in parts):  # gen --no-states: the same dense forward gen would have run
        use_fast_kda(target)
    # each file's sequences keep their own length: train on one file's anchors at a time, files drawn
    # in proportion to their anchors
    sets = []
    for d in parts:
        tk = d["tokens"].to(args.device)
        if d["states"] is None:
            st, nx = states_and_next(target, tk, cfg.target_layers, args.capture_batch)
        else:
            st, nx = d["states"].to(args.device), d["next"].to(args.device)
        sets.append((tk, st, nx, anchors(nx, cfg)))
    del target
    capture_s = time.time() - t_load
    # held-out split: whole sequences of the greedy files (every label exact there; a corpus file's masked
    # labels would count as misses), or of every file when none is greedy
    greedy = [i for i, d in enumerate(parts) if d.get("source") == "greedy"] or list(range(len(parts)))
    held_in, held_out = [], []  # (set index, fixed anchor sample) for the evaluations
    by = set()  # how each file's split was made
    for i in greedy:
        tk, st, nx, pairs = sets[i]
        mask = parts[i].get("holdout")
        if mask is not None and bool(mask.any()):  # gen's held-out documents
            train_pairs, out_pairs = split_by_mask(pairs, mask)
            by.add(f"documents ({int(mask.sum())} of {tk.shape[0]} sequences)")
        else:
            train_pairs, out_pairs = split_holdout(pairs, tk.shape[0], args.holdout_frac, args.seed + i)
            by.add(f"random sequences ({args.holdout_frac:.0%})")
        sets[i] = (tk, st, nx, train_pairs)
        held_in.append((i, _sample(train_pairs, args.holdout_anchors, args.seed)))
        if out_pairs.shape[0]:
            held_out.append((i, _sample(out_pairs, args.holdout_anchors, args.seed)))
    sizes = torch.tensor([float(s[3].shape[0]) for s in sets])
    if args.data_weights is not None:
        if len(args.data_weights) != len(sets):
            raise ValueError(f"--data-weights: {len(args.data_weights)} weights for {len(sets)} --data files")
        draw = torch.tensor(args.data_weights, dtype=torch.float)
    else:
        draw = sizes

    def evaluate(which: list[tuple[int, torch.Tensor]]) -> float | None:
        """Teacher-forced τ over a fixed anchor sample, weighted by anchors (None: no anchors)."""
        n = sum(p.shape[0] for _, p in which)
        if not n:
            return None
        return sum(teacher_forced_tau(model, *sets[i][:3], p, embed, lm_head, 4 * args.batch) * p.shape[0]
                   for i, p in which) / n

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    # earlier drafts matter more: draft j is only useful if 1..j-1 were accepted
    pos_weight = torch.tensor([args.pos_decay ** j for j in range(cfg.block_size)], device=args.device)
    t0, step, ema = time.time(), 0, None
    budget = args.minutes * 60
    curve: list[dict] = []  # every evaluation: step, seconds, held-in and held-out teacher-forced tau
    best = BestWeights()
    last_eval = t0

    def checkpoint() -> bool:
        """Evaluate both splits, log them, keep the best weights by held-out τ; True: stop (patience)."""
        nonlocal last_eval
        tau_in, tau_out = evaluate(held_in), evaluate(held_out)
        curve.append({"step": step, "s": round(time.time() - t0, 1),
                      "tau_in": None if tau_in is None else round(tau_in, 4),
                      "tau_out": None if tau_out is None else round(tau_out, 4)})
        show = [("-" if v is None else f"{v:.3f}") for v in (tau_in, tau_out)]
        tqdm.write(f"eval step {step} {time.time() - t0:.0f}s: held-in tau {show[0]}, held-out-split tau {show[1]}")
        last_eval = time.time()
        if tau_out is None:
            return False
        best.update(tau_out, step, model)
        return args.patience is not None and best.stale >= args.patience

    bar = tqdm(total=int(budget), desc="train", unit="s", bar_format="{l_bar}{bar}| {n:.0f}/{total}s {postfix}")
    cpu_g = torch.Generator().manual_seed(args.seed)
    stopped = False
    while time.time() - t0 < budget and (args.max_steps is None or step < args.max_steps):
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        tk, st, nx, pairs = sets[int(torch.multinomial(draw, 1, generator=cpu_g))]
        idx = torch.randint(0, pairs.shape[0], (args.batch,), generator=cpu_g).to(args.device)
        win, prev, labels, valid = gather(tk, st, nx, pairs[idx], cfg)
        if args.state_dropout:  # regularizes the block's reliance on any one state feature
            win = (F.dropout(win[0], args.state_dropout), *win[1:])
        token_loss, conf_loss, match = losses(model, win, prev, labels, valid, embed, lm_head, pos_weight)
        opt.zero_grad(set_to_none=True)
        (token_loss + args.conf_weight * conf_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        # tau this batch would give with teacher forcing; on corpus data a masked label counts as a miss
        acc = match.float().cumprod(1).sum(1).mean().item() + 1
        cur = (token_loss.item(), conf_loss.item(), acc)
        ema = cur if ema is None else tuple(0.98 * e + 0.02 * c for e, c in zip(ema, cur))
        bar.n = min(bar.total, time.time() - t0)
        bar.set_postfix_str(f"step {step} ce {ema[0]:.3f} bce {ema[1]:.3f} tau~{ema[2]:.2f}")
        if time.time() - last_eval >= args.eval_every and checkpoint():
            stopped = True
            break
    bar.close()
    minutes = round((time.time() - t0) / 60, 1)
    if not curve or curve[-1]["step"] != step:
        checkpoint()
    final = curve[-1]
    if best.step is not None and best.step != step:  # early stopping: ship the weights held-out τ liked best
        best.restore(model)
    notes = {"data": [str(p) for p in args.data], "sources": [d.get("source") for d in parts],
             "sequences": sum(int(s[0].shape[0]) for s in sets),
             "sequences_per_file": [int(s[0].shape[0]) for s in sets],
             "anchors": [int(n) for n in sizes], "data_weights": args.data_weights,
             "steps": step, "batch": args.batch, "lr": args.lr, "weight_decay": args.weight_decay,
             "state_dropout": args.state_dropout, "minutes": minutes, "capture_s": round(capture_s, 1),
             "device": args.device, "final_ce": round(ema[0], 4), "final_bce": round(ema[1], 4),
             "train_tau_teacher_forced": round(ema[2], 3), "seed": args.seed,
             "holdout": {"by": ", ".join(sorted(by)), "anchors": sum(int(p.shape[0]) for _, p in held_out),
                         "stopped_early": stopped, "best_step": best.step,
                         "best_tau_out": None if best.score is None else round(best.score, 4),
                         "final_tau_in": final["tau_in"], "final_tau_out": final["tau_out"], "curve": curve},
             "init": None if args.init is None else {"from": str(args.init), "training": prior}}
    save_drafter(model.cpu(), args.out, extra=notes)
    print(json.dumps({k: v for k, v in notes.items() if k != "holdout"} | {
        "holdout": {k: v for k, v in notes["holdout"].items() if k != "curve"}}))


# ---- evaluation: tau on held-out code -----------------------------------------------------------

@torch.no_grad()
def replay_tau(model: DSparkModel, tokens: torch.Tensor, states: torch.Tensor, prompt_len: int, embed: torch.Tensor,
               lm_head: torch.Tensor, k: int | None = None, held: int | None = None) -> dict:
    """Greedy speculative decoding replayed on the target's greedy continuations: each round drafts from
    the anchor (newest token) and the states of the W positions before it; accepted = the drafts'
    longest prefix equal to the target's next tokens; the round yields accepted + 1 tokens (the target's
    own next token follows). Rounds start after the first generated token and stop when the
    continuation cannot check a full block. All sequences advance together: one block pass per round
    over every sequence still going. Also reports the confidence-scheduled variant (verify only
    verify_length drafts; accepted capped there). held: only the window's last `held` rows hold states (the engine's
    window after target-state recording resumed; benchmarks/dspark_window_fill.py)."""
    cfg = model.cfg
    k = cfg.block_size if k is None else k
    rounds, scheduled, verified = [], [], []
    pos = [prompt_len] * tokens.shape[0]
    while True:
        live = [s for s in range(tokens.shape[0]) if pos[s] + k < tokens.shape[1]]
        if not live:
            break
        pairs = torch.tensor([[s, pos[s]] for s in live], device=tokens.device)
        win = window(tokens, states, pairs, cfg)
        if held is not None:
            w = cfg.context_len
            win = (win[0], win[1], win[2] & (torch.arange(w, device=win[2].device)[None, :] >= w - held))
        drafts, _, conf = model.draft(win[0], pairs.new_tensor([int(tokens[s, pos[s]]) for s in live]),
                                      embed, lm_head, **_window_kwargs(model, win))
        drafts, conf = drafts.cpu(), conf.cpu()
        for row, s in enumerate(live):
            t = pos[s]
            ok = (drafts[row, :k] == tokens[s, t + 1: t + 1 + k].cpu()).int().cumprod(0)
            accepted = int(ok.sum())
            n = verify_length(conf[row, :k], cfg.confidence_threshold, cfg.min_verify, k)
            rounds.append(accepted + 1)
            scheduled.append(min(accepted, n) + 1)
            verified.append(n)
            pos[s] = t + accepted + 1
    return {"k": k, "rounds": len(rounds), "tau": sum(rounds) / len(rounds),
            "tau_scheduled": sum(scheduled) / len(scheduled), "mean_verified_scheduled": sum(verified) / len(verified),
            "threshold": cfg.confidence_threshold}


def replay_tau_drafter(drafter: Drafter, tokens: torch.Tensor, prompt_len: int, k: int) -> dict:
    """replay_tau's rounds for any token-only Drafter (the n-gram baseline on the same continuations)."""
    rounds = []
    for s in range(tokens.shape[0]):
        t, seq = prompt_len, tokens[s].tolist()
        while t + k < len(seq):
            drafts = drafter.propose([DraftQuery(s, seq[: t + 1], prompt_len, k)])[0]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == seq[t + 1 + accepted]:
                accepted += 1
            rounds.append(accepted + 1)
            t += accepted + 1
        drafter.finish(s, seq, prompt_len)
    return {"rounds": len(rounds), "tau": sum(rounds) / len(rounds)}


def cmd_eval(args: argparse.Namespace) -> None:
    model = load_drafter(args.drafter, device=args.device)
    target = load_model(args.target, dtype=args.target_dtype, device=args.device, progress=False)
    prompts = code_prompts("heldout", args.num_prompts, args.prompt_len, args.seed, args.target)
    tokens, states, _ = greedy_with_states(target, prompts, args.gen_len, model.cfg.target_layers)
    res = replay_tau(model, tokens, states, args.prompt_len, target.model.embed_tokens.weight.float(),
                     target.lm_head.weight.float(), args.k)
    res["ngram_tau"] = replay_tau_drafter(NgramDrafter(2, 4), tokens, args.prompt_len, res["k"])["tau"]
    res.update(prompts=args.num_prompts, prompt_len=args.prompt_len, gen_len=args.gen_len, seed=args.seed,
               target_dtype=args.target_dtype)
    print(json.dumps(res))
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")


def cmd_genbench(args: argparse.Namespace) -> None:
    """gen's greedy paths side by side, within --budget-s: correctness first (each path's tokens against the
    cached path's on a few held-out prompts; exit 1 when the engine matches fewer than half), then
    sequences per minute of each path at the given shapes. JSON, then a markdown table, on stdout."""
    target = load_model(args.target, dtype=args.target_dtype, device=args.device, progress=False)
    use_fast_kda(target)  # the dense path's forwards, as gen runs them
    t_start = time.time()
    end = t_start + args.budget_s
    layers = tuple(args.layers)
    n = max(args.check_prompts, args.prompts, args.dense_batch)
    prompts = code_prompts("heldout", n, args.prompt_len, args.seed, args.target)
    check = prompts[: args.check_prompts]
    ref = greedy_with_states(target, check, args.check_len, layers)[0].cpu()
    eng = greedy_engine(target, args.target, check, args.check_len, batch=len(check), device=args.device,
                        dtype=args.target_dtype)[0]
    dense = greedy_dense(target, check, args.check_len, layers)[0].cpu()
    same = {name: int((got == ref).all(1).sum()) for name, got in (("engine", eng), ("dense", dense))}
    res: dict = {"device": args.device, "target_dtype": args.target_dtype, "prompt_len": args.prompt_len,
                 "gen_len": args.gen_len, "check": {"prompts": len(check), "tokens": args.check_len,
                                                     "identical_to_cached": same}, "paths": []}
    # the rest of the budget: the engine (the one gen uses) 45%, the dense path 35% (one batch: its result
    # comes only at the end), the cached path whatever is left (one batch of at most 64, no deadline inside:
    # skipped under 15 s)
    left = end - time.time()
    for name, share, count in (("engine", 0.45, args.prompts), ("dense", 0.35, args.dense_batch),
                               ("cached", None, min(64, args.dense_batch))):
        t0 = time.time()
        row = {"path": name, "batch": args.batch if name == "engine" else count}
        done = 0
        if name == "engine":
            tk, _ = greedy_engine(target, args.target, prompts[:count], args.gen_len, batch=args.batch,
                                  device=args.device, dtype=args.target_dtype, deadline=t0 + share * left)
            done, t1 = tk.shape[0], time.time()
            if done:  # the state capture train runs over them (gen --no-states): counted in its seconds
                states_and_next(target, tk, layers, args.dense_batch)
                _sync(args.device)
            row["capture_s"] = round(time.time() - t1, 2)
        elif name == "dense":  # its states come from its last forward, inside
            got = greedy_dense(target, prompts[:count], args.gen_len, layers, t0 + share * left)
            done = 0 if got is None else count
            _sync(args.device)
        elif end - t0 >= 15:
            greedy_with_states(target, prompts[:count], args.gen_len, layers)
            _sync(args.device)
            done = count
        secs = time.time() - t0
        row.update(sequences=done, seconds=round(secs, 2), seq_per_min=round(done / secs * 60, 1) if done else 0.0)
        res["paths"].append(row)
    dense_rate = next(r["seq_per_min"] for r in res["paths"] if r["path"] == "dense")
    for r in res["paths"]:
        r["vs_dense"] = round(r["seq_per_min"] / dense_rate, 2) if dense_rate else None
    res["seconds"] = round(time.time() - t_start, 1)
    print(json.dumps(res))
    print(f"\ncheck: {same['engine']}/{len(check)} engine and {same['dense']}/{len(check)} dense continuations "
          f"({args.check_len} tokens) identical to the cached path's\n")
    print("| path | batch | sequences | seconds | sequences/min | vs dense |\n|---|---:|---:|---:|---:|---:|")
    for r in res["paths"]:
        vs = "-" if r["vs_dense"] is None else f"{r['vs_dense']}×"
        print(f"| {r['path']} | {r['batch']} | {r['sequences']} | {r['seconds']} | {r['seq_per_min']} | {vs} |")
    if same["engine"] * 2 < len(check):
        raise SystemExit(f"genbench: the engine path matched the cached path on {same['engine']} of "
                         f"{len(check)} prompts")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cmd_card(args: argparse.Namespace) -> None:
    """README.md of a trained drafter folder from its config.json, training.json and an eval JSON."""
    cfg = load_drafter(args.drafter).cfg
    notes = json.loads((args.drafter / "training.json").read_text())
    ev = json.loads(args.eval.read_text())
    size = (args.drafter / "model.safetensors").stat().st_size
    text = f"""# k3-tiny-dspark

A DSpark block drafter for k3-tiny (docs/dspark.md): reads k3-tiny's states {list(cfg.target_layers)} (target.py
numbering) at the last {cfg.context_len} run positions, with their tokens' embeddings (context_tokens:
{str(cfg.context_tokens).lower()}) and a copy head (copy_dim {cfg.copy_dim}); drafts {cfg.block_size} tokens per pass
with k3-tiny's own embedding and LM head (not stored here), a rank-{cfg.markov_rank} Markov head and a
confidence head (threshold {cfg.confidence_threshold}). model.safetensors: {size / 1e6:.1f} MB, bf16.

Training (training.json): {notes["minutes"]} minutes on {notes["device"]}, {notes["steps"]} steps of {notes["batch"]}
anchors, on {_card_data(notes)} ({args.trained_by}).{_card_holdout(notes)}

Held-out τ (mean accepted + 1 per verify round, k = {ev["k"]}, temperature 0; k3-tiny {ev["target_dtype"]} greedy
continuations of {ev["prompts"]} held-out-module prompts, {ev["prompt_len"]} + {ev["gen_len"]} tokens, {ev["rounds"]} rounds):

    python -m k3rt.training.dspark eval --drafter k3rt/models/k3-tiny-dspark --num-prompts {ev["prompts"]} --gen-len {ev["gen_len"]}

| drafter | τ |
|---|---|
| this drafter, all {ev["k"]} drafts verified | {ev["tau"]:.2f} |
| this drafter, confidence-scheduled ({ev["mean_verified_scheduled"]:.2f} drafts verified on average) | {ev["tau_scheduled"]:.2f} |
| n-gram prompt lookup (2..4), same continuations | {ev["ngram_tau"]:.2f} |
"""
    (args.drafter / "README.md").write_text(text)
    print(text)


def _card_data(notes: dict) -> str:
    """What the drafter was trained on, per source (older training.json files list one count)."""
    if "sequences_per_file" not in notes:
        return f"k3-tiny's greedy continuations of {notes['sequences']} training-split stdlib code prompts"
    count = {"greedy": 0, "corpus": 0}
    for src, n in zip(notes["sources"], notes["sequences_per_file"]):
        count[src or "greedy"] += n
    text = f"k3-tiny's greedy continuations of {count['greedy']} training-split stdlib code prompts"
    return text + (f" and {count['corpus']} corpus windows" if count["corpus"] else "")


def _card_holdout(notes: dict) -> str:
    h = notes.get("holdout")
    if not h or h["best_tau_out"] is None:
        return ""
    return (f" Teacher-forced τ at the end: {h['final_tau_in']:.2f} on training prompts, {h['final_tau_out']:.2f} on "
            f"prompts held out of training (by {h['by']}); saved: the weights of step {h['best_step']} "
            f"(held-out {h['best_tau_out']:.2f}).")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("gen", help="generate the target's greedy continuations with layer states")
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--split", default="train", choices=["train", "valid", "heldout"])
    gen.add_argument("--source", default="greedy", choices=["greedy", "corpus"],
                     help="greedy: decode continuations (every label exact, slow on CPU); corpus: one dense "
                          "pass over corpus windows of prompt-len + gen-len tokens (labels exact along "
                          "the stretch where the corpus agrees with the target's argmax)")
    gen.add_argument("--max-prompts", type=int, default=4096)
    gen.add_argument("--prompt-len", type=int, default=48)
    gen.add_argument("--gen-len", type=int, default=80)
    gen.add_argument("--batch", type=int, default=32)
    gen.add_argument("--layers", type=int, nargs="+", default=list(K3_TINY_DSPARK["target_layers"]))
    gen.add_argument("--minutes", type=float, default=6.0, help="stop generating after this long")
    gen.add_argument("--greedy-path", default="auto", choices=["auto", "cached", "dense", "engine"],
                     help="greedy continuations through k3rt's engine (engine: continuous batching of --batch "
                          "requests, CUDA graphs on cuda; states from one dense forward per finished batch), "
                          "the cached decode path (cached: one batch of --batch at a time), or repeated dense "
                          "forwards (dense: one [B, T] forward of every sequence so far per token); auto: "
                          "engine on cuda, cached elsewhere")
    gen.add_argument("--holdout-docs", type=float, default=0.03,
                     help="greedy source: share of the split's documents whose prompts train holds out of "
                          "training (its held-out-split tau; whole documents, chosen by name; 0: none, train "
                          "then holds out random sequences, --holdout-frac)")
    gen.add_argument("--no-states", action="store_true",
                     help="save the token ids only: train captures the states and labels with one dense "
                          "forward when it loads the file (a big GPU run's file stays small)")
    tr = sub.add_parser("train", help="train a drafter on gen's data")
    tr.add_argument("--data", type=Path, nargs="+", required=True, help="one or more gen outputs")
    tr.add_argument("--data-weights", type=float, nargs="+", default=None,
                    help="share of batches drawn from each --data file (default: in proportion to its anchors)")
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument("--init", type=Path, default=None, help="continue training this drafter folder")
    tr.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    tr.add_argument("--max-steps", type=int, default=None)
    tr.add_argument("--batch", type=int, default=64)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--warmup", type=int, default=100)
    tr.add_argument("--pos-decay", type=float, default=0.85)
    tr.add_argument("--conf-weight", type=float, default=0.5)
    tr.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    tr.add_argument("--state-dropout", type=float, default=0.0,
                    help="dropout on the window's target states while training (0: none)")
    tr.add_argument("--holdout-frac", type=float, default=0.05,
                    help="share of a greedy file's sequences held out of training when gen marked none "
                         "(gen --holdout-docs marks whole documents' prompts); the held-out sequences' "
                         "teacher-forced tau is logged against the training sequences' (held-in) every "
                         "--eval-every seconds, and the weights with the best held-out tau are saved (0 and "
                         "no marks: no split, final weights)")
    tr.add_argument("--holdout-anchors", type=int, default=2048, help="anchors per split in each evaluation")
    tr.add_argument("--eval-every", type=float, default=20.0, help="seconds between held-in/held-out evaluations")
    tr.add_argument("--patience", type=int, default=None,
                    help="stop after this many evaluations without a better held-out tau (default: never)")
    tr.add_argument("--capture-batch", type=int, default=128,
                    help="sequences per dense forward when capturing the states of a gen --no-states file")
    tr.add_argument("--block-size", type=int, default=K3_TINY_DSPARK["block_size"])
    tr.add_argument("--num-layers", type=int, default=K3_TINY_DSPARK["num_layers"])
    tr.add_argument("--markov-rank", type=int, default=K3_TINY_DSPARK["markov_rank"])
    tr.add_argument("--context-len", type=int, default=K3_TINY_DSPARK["context_len"])
    tr.add_argument("--context-tokens", action=argparse.BooleanOptionalAction, default=K3_TINY_DSPARK["context_tokens"],
                    help="context positions also carry their token's and the next token's embeddings")
    tr.add_argument("--copy-dim", type=int, default=K3_TINY_DSPARK["copy_dim"], help="copy head width (0: none)")
    ev = sub.add_parser("eval", help="tau on held-out code prompts")
    ev.add_argument("--drafter", type=Path, required=True)
    ev.add_argument("--num-prompts", type=int, default=24)
    ev.add_argument("--prompt-len", type=int, default=48)
    ev.add_argument("--gen-len", type=int, default=96)
    ev.add_argument("--k", type=int, default=None, help="drafts per round (default: the drafter's block_size)")
    ev.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    cd = sub.add_parser("card", help="write a drafter folder's README.md from its training notes and an eval JSON")
    cd.add_argument("--drafter", type=Path, required=True)
    cd.add_argument("--eval", type=Path, required=True, help="eval --out's JSON")
    cd.add_argument("--trained-by", default="`bash training/dspark_device.sh`; its header gives every command and size",
                    help="how the drafter was made (the card's training line)")
    cd.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    gb = sub.add_parser("genbench", help="check gen's greedy paths against each other, then time them")
    gb.add_argument("--budget-s", type=float, default=90.0,
                    help="wall-clock limit (seconds) of everything after loading the model, the check included")
    gb.add_argument("--prompts", type=int, default=1024, help="prompts the engine path gets")
    gb.add_argument("--batch", type=int, default=512, help="the engine's requests in flight")
    gb.add_argument("--dense-batch", type=int, default=256, help="one batch of the dense and cached paths")
    gb.add_argument("--prompt-len", type=int, default=48)
    gb.add_argument("--gen-len", type=int, default=160)
    gb.add_argument("--check-prompts", type=int, default=8)
    gb.add_argument("--check-len", type=int, default=32, help="tokens continued in the correctness check")
    gb.add_argument("--layers", type=int, nargs="+", default=list(K3_TINY_DSPARK["target_layers"]))
    for s in (gen, tr, ev, gb):
        s.add_argument("--target", default="k3-tiny")
        s.add_argument("--device", default="cpu")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    for s in (gen, ev, gb):
        s.add_argument("--target-dtype", default="float32", help="the target's weights while generating")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    {"gen": cmd_gen, "train": cmd_train, "eval": cmd_eval, "card": cmd_card, "genbench": cmd_genbench}[args.cmd](args)


if __name__ == "__main__":
    main()
