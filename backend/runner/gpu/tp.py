"""Tensor parallelism in the GPU runner: the workers' side of a step, and where the fused forward reduces.

Rank 0's GpuModelRunner turns each step into a StepPlan (backend/distributed/plan.py: fills, page and
state copies, sequences, logits rows, which decode graph it replays and which piecewise bucket it takes)
and broadcasts it once; every worker's runner turns the plan back into the same StepSeqs (`plan_seqs`) and
runs the same forward or graph replay on its shard, refusing a step whose bucket it would choose otherwise.
The fused forward (forward.py, ffn.py) calls the collectives at the points the reference layers do:
  embedding (vocab-parallel)       all-reduce of the masked lookups (VocabParallelEmbedding itself);
  attention o_proj (KDA, MLA)      all-reduce of the per-head-shard partial sums;
  dense MLP down_proj              all-reduce;
  MoE routed (+ fused shared)      one all-reduce (routed experts split by width, or by expert with EP);
  LatentMoE                        all-reduce of the routed latent, then the latent tail (moe.latent_tail);
  LM head (vocab-parallel)         the slices gathered to rank 0 after the forward, outside any graph.
On NCCL the in-forward collectives are captured in the decode graphs and the piecewise graphs (pieces.py)
with the rest; on gloo (CPU) the runner never captures. Only rank 0 samples.
"""

from __future__ import annotations

import torch

from k3rt.backend.distributed.plan import StepPlan
from k3rt.backend.runner.gpu.step import StepSeq


def plan_seqs(plan: StepPlan) -> tuple[list[StepSeq], list[int]]:
    """A RUN plan's sequences as the GPU runner's StepSeqs, and the extra logits rows (prompt scoring).

    The plan's logits rows are the sampled sequences' last rows in sequence order, then the scored rows
    (build_plan; verify runs do not run under TP). Taking, in sequence order, each sequence whose last row
    is the next unmatched row as sampled rebuilds exactly those rows in that order, even where a scored
    row happens to be a sequence's last one (it lands at the same place in the list either way)."""
    if any(plan.verify):
        raise ValueError("step plan: verify runs (speculative decoding) do not run under tensor parallelism")
    rows, ids = plan.logits_rows, plan.token_ids
    seqs, row, j = [], 0, 0
    for q in plan.seqs:
        end = row + q.num_tokens
        sampled = j < len(rows) and rows[j] == end - 1
        j += sampled
        seqs.append(StepSeq(list(ids[row:end]), q.start, list(q.block_table),
                            None if q.state_set is None else list(q.state_set), sampled,
                            [(p, list(d)) for p, d in q.snapshots]))
        row = end
    if row != len(ids):
        raise ValueError(f"step plan: the sequences feed {row} tokens, token_ids holds {len(ids)}")
    return seqs, list(rows[j:])


@torch.no_grad()
def run_worker_plan(runner, plan: StepPlan) -> None:
    """One RUN plan on a worker's GpuModelRunner: the cache operations (every fill too: this pool never
    allocates), then the step's forward or graph replay, taking part in every collective rank 0 does. Raises
    when this runner would run the step in another piecewise bucket than rank 0 (its collectives would differ)."""
    from k3rt.backend.runner.step_plan import apply_cache_ops

    apply_cache_ops(runner.pool, plan)
    if plan.seqs:
        seqs, extra = plan_seqs(plan)
        runner.run_seqs(seqs, extra, plan.graph, mixed=plan.mixed)
