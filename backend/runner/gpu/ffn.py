"""Feed-forward blocks on the GPU path: the dense MLP as is, MoE/LatentMoE through the fused
router + grouped expert kernels (the reference expert loop when kernels are off: eager only, it
reads the routing on the host).

Shared-expert fusion (plain MoE with kernels): the shared MLP of intermediate S * I is S more experts
of width I (its gate/up columns and down rows split into S independent blocks: act(g) * u is
per column and the down projection sums over columns), so they are stacked after the E routed
experts and run by the same grouped GEMMs over every token with weight 1
(`fused_experts(shared_experts=S)`: their blocks follow the routed ones, outside the alignment).
One grouped GEMM pair then computes routed + shared, instead of two more GEMMs, the activation, the
product and the add per layer (at batch 1 those launches cost more than the shared expert's bytes).
The routed and shared outputs are summed in fp32 before one rounding (the reference rounds the
routed sum first): equal up to that rounding. For S = 1 the module's own parameters become views of
the stacks (no second copy); for S > 1 the stacks hold a copy of the shared weights.
LatentMoE's shared expert reads the full-width x while its routed experts read the latent: no fusion into the
stacks. Its projections fuse instead (`LatentFusion`, kernels on, not batch-invariant): the shared expert's gate/up
rows and the routed down projection read the same x, so they are one GEMM (`head`); at TP 1 the shared expert's
down projection and the latent up projection both end in the layer's output, so [h | latent] @ [down | up]^T is one
GEMM too (`tail`): routed + shared summed in fp32 before one rounding, as the shared-expert fusion above (the
reference rounds each, then their sum). h and the normed latent are written side by side into the tail's input
(the activation and the experts' sum take strided rows; the latent norm runs in the sum's launch). Per layer 4
launches of its own instead of 8 (two GEMMs, the add and the norm gone):
at batch 1 k3-tiny's forward is launch-bound (issue 16's batch-1 round, RESULTS.md session 23).

The router's fp32 logits of prefill-sized batches (`KernelConfig.split_router_min_rows`) come from one bf16
tensor-core GEMM against three bf16 parts of its fp32 weight (`bf16_parts`: their sum is the weight exactly) with
fp32 output, summed, instead of torch's fp32 linear (a cast of x and a SIMT sgemm, 5.5 ms of the 48B's 8K chunk).

MXFP4 routed experts (`KernelConfig.mxfp4_experts`): by default repacked once here, in place, into the planar
layout (`PlanarMxfp4.from_packed(in_place=True)`: the words take the packed codes' own storage, so device
memory stays what the checkpoint's stacks take) and run by `fused_experts_mxfp4_planar`; the module then
holds the words (`MoE.use_planar`) and its reference loop decodes them. A layer that does not fit the layout
(tiny test models, an I per rank that is not a multiple of 256 under TP) keeps the packed codes and the
dot_scaled kernel (`GpuForward` logs why, once per reason). The shared expert stays dense: no fusion into
the quantized stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3rt.backend.layers.activation import act_and_mul
from k3rt.backend.models.moe import GatedMLP, MoE, route
from k3rt.backend.runner.gpu.ops import ROW_ALIGN, KernelConfig, fuse_rows, kernel, linear, norm


@dataclass
class MoeWeights:
    """One MoE layer's expert stacks for the kernels: [E (+S), 2I, D] and [E (+S), D, I]; for MXFP4 experts no
    dense stacks but either the planar words (`planar`, a PlanarMxfp4) or the packed codes and scales for the
    dot_scaled kernel (`mx`: w13_packed, w13_scale, w2_packed, w2_scale)."""

    w13: torch.Tensor | None
    w2: torch.Tensor | None
    shared_fused: int  # S: shared experts stacked after the routed ones (0: the module runs them)
    mx: dict[str, torch.Tensor] | None = None
    planar: object | None = None  # kernels.moe.PlanarMxfp4 (not imported here: Triton only when kernels run)
    unfit: str | None = None  # why planar was asked for and these stacks kept the packed codes (GpuForward logs it)
    # the fp32 router weight as three bf16 parts stacked [3E, D] (`split_router`): prefill-sized batches' logits.
    # A copy taken when the runner is built (as the benchmarks' re-drawn routers are, before it): the weights of a
    # served model do not change after load
    gate_split: torch.Tensor | None = None
    latent: "LatentFusion | None" = None
    # kernels/moe moe_layer_one_token's counters (zero between launches; one launch in flight per layer at a time:
    # the runner's forward runs on one stream): for a layer it can run (`one_token_layer`), whatever the config says
    sync: torch.Tensor | None = None

    @staticmethod
    def of(moe: MoE, k: KernelConfig) -> "MoeWeights":
        w = MoeWeights._stacks(moe, k)
        gate = moe.gate_weight.detach()
        if k.triton and not k.batch_invariant and gate.is_cuda and gate.dtype == torch.float32:
            w.gate_split = bf16_parts(gate)
        if k.triton and not k.batch_invariant:
            w.latent = LatentFusion.of(moe)
            if w.mx is None and w.planar is None and m_plain(moe) and gate.is_contiguous():
                w.sync = torch.zeros(kernel("moe", "LAYER_SYNC_WORDS"), dtype=torch.int32, device=gate.device)
        return w

    @staticmethod
    def _stacks(moe: MoE, k: KernelConfig) -> "MoeWeights":
        m, mlp = moe.m, moe.shared_experts
        if moe.mxfp4:
            return MoeWeights._mxfp4(moe, k)
        if not k.triton or mlp is None or m.latent_size is not None:
            return MoeWeights(moe.w13, moe.w2, 0)
        E, two_i, D = moe.w13.shape
        I, S = two_i // 2, m.num_shared_experts
        gu, down = mlp.gate_up_proj.weight.detach(), mlp.down_proj.weight.detach()  # [2SI, D], [D, SI]
        if gu.shape != (2 * S * I, D) or down.shape != (D, S * I) or gu.dtype != moe.w13.dtype:
            return MoeWeights(moe.w13, moe.w2, 0)  # a shared width that is not S experts' (never in Kimi)
        w13 = torch.empty(E + S, two_i, D, dtype=moe.w13.dtype, device=moe.w13.device)
        w2 = torch.empty(E + S, D, I, dtype=moe.w2.dtype, device=moe.w2.device)
        w13[:E], w2[:E] = moe.w13.detach(), moe.w2.detach()
        g, u = gu.view(2, S, I, D).unbind(0)  # gate rows, then up rows, each S blocks of I
        w13[E:, :I], w13[E:, I:] = g, u
        w2[E:] = down.view(D, S, I).transpose(0, 1)
        moe.w13.data, moe.w2.data = w13[:E], w2[:E]
        if S == 1:
            mlp.gate_up_proj.weight.data = w13[E]
            mlp.down_proj.weight.data = w2[E]
        return MoeWeights(w13, w2, S)

    @staticmethod
    def _mxfp4(moe: MoE, k: KernelConfig) -> "MoeWeights":
        stacks = {n: getattr(moe, n) for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")}
        planar_cls = kernel("moe", "PlanarMxfp4") if k.triton and k.mxfp4_experts == "planar" else None
        if planar_cls is None:  # the kernels off (the module's loop reads the codes) or dot_scaled asked for
            return MoeWeights(None, None, 0, mx=stacks)
        why = planar_cls.unfit(*(t.data for t in stacks.values()))
        if why is not None:
            return MoeWeights(None, None, 0, mx=stacks, unfit=why)
        planar = planar_cls.from_packed(*(t.data for t in stacks.values()), in_place=True)
        moe.use_planar(planar.w13_words, planar.w2_words)
        return MoeWeights(None, None, 0, planar=planar)


@dataclass
class LatentFusion:
    """A LatentMoE layer's fused projections (module docstring). The module's weights become views of these (its
    reference forward keeps working on the same storage, no second copy)."""

    head: torch.Tensor  # [2SI + L + pad, D]: the shared expert's gate/up rows, the routed experts' down projection
    tail: torch.Tensor | None  # [D, SI + L]: the shared expert's down columns, then the latent up projection's (TP 1)
    inter: int  # SI: the shared expert's width on this rank
    latent: int  # L

    @staticmethod
    def of(moe: MoE) -> "LatentFusion | None":
        mlp, m = moe.shared_experts, moe.m
        if m.latent_size is None or mlp is None:
            return None
        gu, sd = mlp.gate_up_proj.weight, mlp.down_proj.weight
        down, up = moe.routed_expert_down_proj.weight, moe.routed_expert_up_proj.weight
        ws = (gu, sd, down, up)
        SI = sd.shape[1]
        # one 16/32-bit float dtype (no quantized shared expert), the latent's columns 16-byte aligned in both
        # (ROW_ALIGN elements): the kernels reading those slices compile for that alignment
        if (len({t.dtype for t in ws}) != 1 or gu.dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or SI % ROW_ALIGN
                or any(t.stride(-1) != 1 for t in ws)
                or (m.latent_norm and moe.routed_expert_norm.dtype != gu.dtype)):  # normed into the tail's input
            return None
        head, _ = fuse_rows([gu, down])
        tail = None
        if moe.tp.size == 1 and up.shape[0] == sd.shape[0]:
            tail = torch.cat([sd.detach(), up.detach()], dim=1)
            sd.data, up.data = tail[:, :SI], tail[:, SI:]
        return LatentFusion(head, tail, SI, down.shape[0])


def _latent_forward(moe: MoE, lf: LatentFusion, x: torch.Tensor, routed, k: KernelConfig) -> torch.Tensor:
    """LatentMoE through the fused projections: head GEMM -> (shared h, latent z); routed experts on z, normed; the
    tail GEMM over [h | latent] (TP 1), else the shared down projection and the module's latent tail."""
    mlp, SI, T = moe.shared_experts, lf.inter, x.shape[0]
    both = linear(x, lf.head, k)  # [T, 2SI + L]
    gate_up, z = both[:, :2 * SI], both[:, 2 * SI:2 * SI + lf.latent]
    act = kernel("moe", "act_and_mul")
    if lf.tail is None:
        shared = linear(act(gate_up, mlp.act), mlp.down_proj.weight, k)
        y = moe.tp.all_reduce(routed(z))
        if moe.m.latent_norm:
            y = norm(y, moe.routed_expert_norm, moe.eps, k)
        return moe.latent_tail(y, shared, moe.routed_expert_up_proj.weight, lambda a, w: linear(a, w, k))
    cat = x.new_empty(T, lf.tail.shape[1])  # [h | latent]: the tail GEMM's input
    act(gate_up, mlp.act, out=cat[:, :SI])
    # the latent norm in the experts' sum launch (kernels/moe/triton_experts.py sum_slots)
    routed(z, out=cat[:, SI:], norm=(moe.routed_expert_norm, moe.eps) if moe.m.latent_norm else None)
    return linear(cat, lf.tail, k)


def sums_add_norm(moe: MoE, w: MoeWeights, x: torch.Tensor, weight: torch.Tensor, k: KernelConfig) -> bool:
    """Whether the decoder layer's residual add and its next norm can run in this MoE's experts' sum launch
    (`moe_add_norm`): the grouped kernels' plain MoE with its shared experts stacked in (the sum is the layer's
    whole output), nothing to reduce across ranks, a norm weight in x's dtype (the sum's epilogue rounds to it)."""
    return (k.triton and k.moe_sum_add_norm and bool(w.shared_fused) and moe.m.latent_size is None
            and moe.tp.size == 1 and weight.dtype == x.dtype)


def moe_add_norm(moe: MoE, w: MoeWeights, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 k: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + moe(x)), residual + moe(x)) with the add and the norm in the experts' sum launch
    (kernels/moe SumNorm; only where `sums_add_norm` says so): one launch per layer fewer than the sum and then
    kernels/norm's add-and-norm, the same rounding order."""
    h = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)  # written whole by the sum
    y = moe_forward(moe, w, x, k, sum_norm=kernel("moe", "SumNorm")(weight, eps, residual, h))
    return y, h


def m_plain(moe: MoE) -> bool:
    """A plain MoE layer on one rank: no latent, every expert here, nothing to reduce across ranks."""
    return moe.m.latent_size is None and moe.tp.size == 1 and moe.num_local_experts == moe.m.num_experts


def one_token_layer(moe: MoE, w: MoeWeights, x: torch.Tensor, k: KernelConfig, sum_norm=None) -> torch.Tensor | None:
    """The layer's output (normed by sum_norm when given) from kernels/moe moe_layer_one_token, where it runs:
    KernelConfig.moe_layer_one_token, one row, a layer `MoeWeights.of` gave counters (dense stacks, a plain MoE on
    one rank), its shared experts stacked in (or none), an ungrouped router within the kernel's bounds; else None."""
    m = moe.m
    if (not k.moe_layer_one_token or w.sync is None or x.shape[0] != 1
            or (moe.shared_experts is not None and not w.shared_fused)
            or not kernel("moe", "layer_fits")(1, moe.gate_weight.shape[0], x.shape[1], m.num_expert_group,
                                               sum_norm is not None)):
        return None
    w13, w2 = (w.w13, w.w2) if w.shared_fused else (moe.w13, moe.w2)
    out, _, _ = kernel("moe", "moe_layer_one_token")(
        x, moe.gate_weight, moe.e_score_correction_bias.float(), w13, w2, w.sync, top_k=m.num_experts_per_token,
        act=moe.act, renormalize=m.renormalize, scaling=m.routed_scaling_factor, shared_experts=w.shared_fused,
        norm=sum_norm, use_pdl=k.use_pdl)
    return out


def moe_forward(moe: MoE, w: MoeWeights, x: torch.Tensor, k: KernelConfig, sum_norm=None) -> torch.Tensor:
    """The MoE layer's output for x's rows (reduced across ranks, routed + shared, the latent tail); with sum_norm
    (a kernels/moe SumNorm, `moe_add_norm`) the normed rows of residual + that output instead."""
    m = moe.m
    if k.triton and (y := one_token_layer(moe, w, x, k, sum_norm)) is not None:
        return y
    name = ("fused_experts_mxfp4_planar" if w.planar is not None else "fused_experts_mxfp4" if w.mx is not None
            else "fused_experts")
    experts = kernel("moe", name) if k.triton else None
    router = kernel("moe", "moe_route") if k.triton else None
    if router is not None:
        how = dict(top_k=m.num_experts_per_token, num_expert_group=m.num_expert_group, topk_group=m.topk_group,
                   renormalize=m.renormalize, scaling=m.routed_scaling_factor)
        gate, bias = moe.gate_weight, moe.e_score_correction_bias.float()
        if (k.moe_fused_router and not k.batch_invariant and gate.is_contiguous()
                and kernel("moe", "fused_router_fits")(x.shape[0], *gate.shape, m.num_expert_group)):
            tw, ids = kernel("moe", "moe_route_from_x")(x, gate, bias, **how)  # the logits in the same launch
        else:
            if w.gate_split is not None and 0 < k.split_router_min_rows <= x.shape[0] and x.dtype == torch.bfloat16:
                logits = split_router(x, w.gate_split)
            else:
                logits = linear(x, gate, k, out_dtype=torch.float32)
            tw, ids = router(logits, bias, **how)
    else:
        tw, ids = route(x, moe.gate_weight, moe.e_score_correction_bias, m)

    if experts is not None and moe.num_local_experts != m.num_experts:
        tw, ids = local_routing(tw, ids, moe.expert_offset, moe.num_local_experts)

    tiles = None
    if experts is not None and k.batch_invariant:
        from k3rt.kernels.moe.triton_experts import pick_tiles

        # the decode tiles at every batch size: the default follows the rows per expert, and the
        # prefill tiles' BLOCK_K (64, against 128) would sum each row's products in another order
        tiles = pick_tiles(1, w.w13.shape[0])

    def routed(z: torch.Tensor, out: torch.Tensor | None = None, norm=None) -> torch.Tensor:
        """The routed experts' sum of z's rows (into out), RMSNormed by norm = (weight, eps) when given (the
        kernels only)."""
        if experts is None:
            return moe.experts(z, tw, ids)
        if w.planar is not None:
            return experts(z, w.planar, tw, ids.to(torch.int32), act=moe.act,
                           variant=kernel("moe", "PLANAR_SERVE_VARIANT"), use_pdl=k.use_pdl, out=out, norm=norm)
        if w.mx is not None:
            return experts(z, **w.mx, topk_weights=tw, topk_ids=ids.to(torch.int32), act=moe.act, use_pdl=k.use_pdl,
                           out=out, norm=norm)
        return experts(z, w.w13, w.w2, tw, ids.to(torch.int32), act=moe.act, shared_experts=w.shared_fused,
                       use_pdl=k.use_pdl, tiles=tiles, grouped_tiles=k.moe_grouped_tiles, one_token=k.moe_one_token,
                       out=out, norm=norm, pair_blocks_bytes=k.moe_pair_blocks_bytes, gemv=k.moe_gemv)

    if sum_norm is not None:
        assert experts is not None and w.shared_fused and moe.tp.size == 1, "sums_add_norm decides"
        return routed(x, norm=sum_norm)
    if w.latent is not None and experts is not None and k.moe_latent_fusion:
        return _latent_forward(moe, w.latent, x, routed, k)
    if w.shared_fused:
        return moe.tp.all_reduce(routed(x))
    # the shared expert's partial sum (its module does not reduce: the all-reduce or the latent tail does)
    shared = mlp_forward(moe.shared_experts, x, k) if moe.shared_experts is not None else None
    if m.latent_size is None:
        y = routed(x)
        return moe.tp.all_reduce(y if shared is None else y + shared)
    y = moe.tp.all_reduce(routed(linear(x, moe.routed_expert_down_proj.weight, k)))
    if m.latent_norm:
        y = norm(y, moe.routed_expert_norm, moe.eps, k)
    return moe.latent_tail(y, shared, moe.routed_expert_up_proj.weight, lambda a, w: linear(a, w, k))


def bf16_parts(w: torch.Tensor) -> torch.Tensor:
    """An fp32 [E, D] weight as three bf16 parts stacked [3E, D] whose fp32 sum is w exactly: each part takes the
    next 8 significant bits of what the ones before left (fp32's 24 = 3 x 8; the exponent range is the same)."""
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo])


def split_router(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """fp32 logits x @ w^T of bf16 rows x through the parts of w (`bf16_parts`): one bf16 tensor-core GEMM with fp32
    output (each product of 8-bit significands exact, sums in fp32) against three part columns per expert, then
    their sum, where torch's fp32 linear runs a SIMT sgemm after casting x (CUDA only: torch.mm's out_dtype)."""
    E = parts.shape[0] // 3
    return torch.mm(x, parts.t(), out_dtype=torch.float32).view(x.shape[0], 3, E).sum(1)


def local_routing(tw: torch.Tensor, ids: torch.Tensor, offset: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert parallelism for the grouped kernels, which index a stack of this rank's experts only: global ids
    -> local ids, and a pair routed to another rank's expert gets weight 0 (its product adds an exact zero;
    that expert's contribution arrives in the all-reduce) and the token's first local expert, whose weights
    the step reads anyway (local expert 0 for a token with none here). Shapes stay fixed, so it captures in a
    CUDA graph; the cost is those pairs' wasted rows, which can add row blocks to an expert at larger batches
    (an expert map in the alignment kernel that drops them is not built)."""
    local = ids - offset
    mine = (local >= 0) & (local < num_local)
    first = torch.where(mine, local, torch.full_like(local, num_local)).min(dim=-1, keepdim=True).values
    first = torch.where(first == num_local, torch.zeros_like(first), first)
    return torch.where(mine, tw, torch.zeros_like(tw)), torch.where(mine, local, first.expand_as(local))


def mlp_forward(mlp: GatedMLP, x: torch.Tensor, k: KernelConfig) -> torch.Tensor:
    """The dense gated MLP with its projections through `linear`; under TP this rank's partial sum (the
    caller all-reduces it, as RowParallelLinear does)."""
    gate_up = linear(x, mlp.gate_up_proj.weight, k)
    fused = kernel("moe", "act_and_mul") if k.triton else None  # one launch, not SiTU's nine (triton_act.py)
    h = fused(gate_up, mlp.act) if fused is not None else act_and_mul(gate_up, mlp.act)
    return linear(h, mlp.down_proj.weight, k)
