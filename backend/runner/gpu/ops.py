"""Which implementation each op of the GPU path uses.

`KernelConfig.triton` selects the Triton kernels (on a GPU, or under the Triton interpreter in tests);
off, every op runs its torch reference, which is also what runs where a kernel does not exist yet.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from functools import cache

import torch
import torch.nn.functional as F

from k3rt.backend.layers.batch_invariant import invariant_linear
from k3rt.backend.layers.norm import rms_norm
from k3rt.kernels.kda.chunk_tables import INTRA_FORMS
from k3rt.kernels.linear import PREFETCH_FORMS


MXFP4_EXPERT_PATHS = ("planar", "dot_scaled")
KDA_VERIFY_LAUNCHES = ("decode_loop", "multi")
# the KernelConfig fields of the persistent one-token layer forms (kernels/persistent.py), which the runner checks
# once at start and turns off together if a launch did not finish cleanly (GpuModelRunner.check_persistent)
PERSISTENT_FORMS = ("moe_layer_one_token", "kda_layer_one_token", "mla_layer_one_token")


@dataclass(frozen=True)
class KernelConfig:
    triton: bool = True
    use_pdl: bool = False  # programmatic dependent launch between chained decode kernels (GPU only)
    # projections of decode-sized batches (<= kernels.linear.MAX_ROWS rows) through the skinny GEMV
    # kernel instead of torch's matmul (cuBLAS): benchmarks/kernels_linear.py, decode.py --variants
    skinny_gemv: bool = True
    # mixed steps (plain decodes beside prefill chunks, snapshot rows or verify runs): the plain decodes' KDA rows
    # through the decode kernel and only the rest through the chunked form (backend/runner/gpu/kda.py; on with
    # the kernels outside the batch-invariant mode; off: every row chunked, as before, for benchmarks/decode.py)
    kda_split: bool = True
    # deterministic mode (EngineConfig.deterministic): projections in fixed row tiles through torch's
    # matmul (never the skinny kernel, whose use depends on M), MLA one query per row through the decode
    # kernel with one split, KDA token by token through the decode kernel with one program per head,
    # fixed expert-GEMM tiles: see docs/deterministic.md
    batch_invariant: bool = False
    # MXFP4 routed experts: "planar" repacks them at load into the planar layout and runs
    # kernels/moe/triton_mxfp4_planar.py (its PLANAR_SERVE_VARIANT at its default tiles: 45% of copy bandwidth at
    # M = 1-4 rows per expert on the H200 against 26% for "dot_scaled"), where a layer fits that layout (K of
    # both weights a multiple of 256, E8M0 exponents <= 240) and "dot_scaled" (kernels/moe/triton_mxfp4.py on
    # the checkpoint's packed codes) elsewhere; "dot_scaled" everywhere: the phase-1 kernel, for comparison
    mxfp4_experts: str = "planar"
    # the verify graph form's KDA (backend/runner/gpu/kda.py, R = K + 1 rows per sequence): "decode_loop" steps
    # scratch copies of the states through kda_decode R times and the commit replays the kept tokens through it
    # R more times (2R launches per layer); "multi" runs both through kernels/kda/triton_multi.py, one launch
    # each, no scratch copies: the default, measured faster on the H200 (benchmarks/spec_verify.py at the 48B
    # shape, 1 + 7 tokens: verify graph 7.48 vs 8.38 ms at batch 1, 26.2 vs 31.5 ms at 16; commit 0.53 vs 1.64 ms)
    kda_verify_launch: str = "multi"
    # "multi"'s form (kernels/kda/triton_multi.py `hoist`): every token's conv, norms and gates first as [R, D]
    # tiles, the token loop then only the recurrence, and the verify pass's output norm over all rows at once;
    # False: each token's loads and conv inside the loop and the norm a row at a time (the form before session 33)
    kda_multi_hoist: bool = False
    # the chunked KDA prefill's intra step (kernels/kda/triton_chunk.py `intra`): "blocks" (kernels/kda/
    # triton_intra_blocks.py: four launches on 16 x 16 blocks and K slices, one program per block of L/Aqk and per
    # row block of W/U), the default: on the H200 with fla 0.6.0 in the same run (session 32, H=32 D=128 bf16)
    # 1.353 / 2.476 / 9.138 / 4.717 ms at 8K / 16K / 64K / 8 x 4K tokens against "fused" (one program per chunk
    # and head) 1.567 / 2.958 / 11.203 / 5.731, and the 48B prefill 137.1 vs 138.8 ms at 8K; "split"
    # (kernels/kda/triton_intra_split.py: two launches of small programs; no faster than fused, session 14)
    kda_intra: str = "blocks"
    # "blocks" without its phase-0 launch: L's and W/U's programs take Gc (the in-chunk cumsum of g) from g's rows
    # themselves (kernels/kda/triton_intra_blocks.py fuse_gc; no fp32 Gc scratch). Off: 30-36% slower on the H100
    # (session 35: its L launch takes 254 registers against 139; kernels.py variants blocks_intra_fused_gc, and under
    # a register cap or in 16-column slices _r168, _r128, _bk16, not yet run)
    kda_blocks_fuse_gc: bool = False
    # "blocks"'s (I + L)^-1 launch with its blocks in registers (kernels/kda/triton_intra_blocks.py REGS: the same
    # values; the substitution's rows from one load, the blocks below from one load of L and X's diagonal, stored
    # once: ~3 dependent waits on the scratch per program against ~22). That launch took 1.23 ms of 8.71 at 64K
    # tokens (session 33). Off: 8-10% slower on the H100 (session 35; benchmarks/kernels.py variant
    # blocks_intra_inverse_regs)
    kda_blocks_inverse_regs: bool = False
    # "blocks"'s W/U launch one program per (chunk, head) at 4 warps (kernels/kda/triton_intra_blocks.py
    # _blocks_out_kernel ROWS = C) instead of one per 16-row block at kda_intra's warps: the row-block programs each
    # read the chunk's k, v and Gc rows for their dot, four times what the chunk holds (~4.2 GB from the L2 at
    # 8 x 4K tokens of the 48B layer against ~1.05; that launch took 1.17 of 4.67 ms there, session 33). None: the
    # kernel's default, on with 16-bit dots at 3 stages (H200 session 37: that launch 2.37 -> 1.76 ms at 64K tokens,
    # 1.23 -> 0.92 at 8 x 4K; at 2 stages it was 1-5% slower on the H100, session 35)
    kda_blocks_out_chunk: bool | None = None
    # "blocks"'s L/Aqk launch one program per (chunk, head) (kernels/kda/triton_intra_blocks.py
    # _blocks_lrow_kernel CHUNK): the row-block programs' four row blocks one after another, so blocks 1-3 find the
    # chunk's k and Gc rows in the SM's L1 instead of the L2 (~3 GB against ~0.8 at 8 x 4K tokens of the 48B layer;
    # that launch took 0.95 of 4.67 ms there, session 33). The same values. Off: 10-11% slower on the H100 (session
    # 35; benchmarks/kernels.py variant blocks_intra_l_chunk)
    kda_blocks_l_chunk: bool = False
    # batches of at least this many rows take the fp32 MoE router's logits from three bf16 parts of its weight in
    # one tensor-core GEMM (backend/runner/gpu/ffn.py split_router) instead of torch's fp32 linear, a SIMT sgemm;
    # 0: never. H200, the 48B's 256 x 2304 router (RESULTS.md session 28): 0.055 against 0.072 ms at 1,024 rows,
    # 0.078 against 0.269 at 8,192; equal at 256, slower at 64
    split_router_min_rows: int = 1024
    # the chunked KDA form's conv/gate launch (kernels/kda/triton_prep.py) for a step of one sequence: the taps'
    # rows computed instead of loaded from conv_idx (`one_seq`, the same bits). H200, 48B layer (RESULTS.md
    # session 29): 0.283-0.310 against 0.489 ms at 8K rows, 0.903 against 1.574 at 32K
    kda_prep_one_seq: bool = True
    # MLA prefill (kernels/mla/triton_prefill.py): the key tiles through TMA descriptors where the GPU has TMA
    # (sm90+). H200 (session 29): 1.04-1.10x at 8K-32K. (The MoE prefill's 128-row tiles take TMA by their own
    # tile config, kernels/moe/triton_experts.py PREFILL_TILES_128: 1.05x at 8K, 1.07x at 32K.)
    mla_prefill_tma: bool = True
    # the MoE prefill's 128-row expert tiles over runs padded to 64 rows (kernels/moe/triton_experts.py
    # PREFILL_TILES_128_GROUPED: the runs' odd 64-row blocks in a second launch of 64-row tiles) instead of runs
    # padded to 128: a quarter of the 48B's rows at 8K tokens are padding with 128 (256 rows per expert), an
    # eighth with 64. Off: slower on the H200 (session 32, the 48B prefill: 143.1 vs 138.8 ms at 8K, 686.6 vs 680.1
    # at 32K)
    moe_grouped_tiles: bool = False
    # one token's MoE (batch-1 decode) in two launches instead of three (kernels/moe/triton_one_token.py: each
    # program's gate/up tile and its down product together, then the partials' sum), so no launch waits for the
    # whole gate/up. The grouped path took 38.9 us per 48B layer at T = 1 against a 27.4-30 us floor (session 25).
    # Off: slower on the H200 (session 32, the 48B decode graph at batch 1: 2.851 vs 2.669 ms; k3-tiny 0.276 vs
    # 0.278)
    moe_one_token: bool = False
    # one token's MoE (batch-1 decode) as GEMVs of a few weight rows a program (kernels/moe/triton_gemv_experts.py:
    # 2,304 gate/up and 2,592 down programs at the 48B shape, each walking its rows' whole K in one basic block,
    # against the grouped path's 288 / 324 16-row MMA tiles, 2.2 / 2.5 an SM on 132 SMs: session 29 measured that path
    # at 72 % of copy at T = 1, 97-100 % from 16 tokens). The same slot sum after. The default since session 46: H100,
    # 46.6 against 50.0 us a 48B layer (kernels_moe.py --decode-t 1), and the 48B's first 12 layers' batch-1 graph
    # 1.534 against 1.581 ms (decode.py --layers 12, variant no_moe_gemv; with gemv_unrolled/gemv_wide 1.463). Not
    # yet timed in the whole 48B step on the H200 (device stage gemv-forms)
    moe_gemv: bool = True
    # one token's whole MoE layer in one persistent launch (kernels/moe/triton_layer.py moe_layer_one_token: the
    # router GEMV, the top-k, gate/up, down, the sum and the residual add + next norm, the programs ordered by arrival
    # counters instead of five launch boundaries): batch-1 decode of a plain MoE at TP 1 (the 48B's 26 layers, ~47 us
    # each against a 30.7 us floor in session 39's profile). Off: one layer no faster than the separate launches (H100,
    # session 43: 64.6 against 64.6 us), and the three one-token forms together make the 48B batch-1 step slower
    # (H200, session 44: 3.021 against 2.576 ms; decode.py variants moe_layer_one_token, layers_one_token)
    moe_layer_one_token: bool = False
    # one token's whole KDA layer in one persistent launch (kernels/kda/triton_layer.py kda_layer_one_token: the input
    # projection, the low-rank gates' up-projections, the decode step with its gated norm, o_proj and the residual add
    # + next norm): batch-1 decode at TP 1 (the 48B's 20 KDA layers, five launches and ~37 us each against ~20 us of
    # bytes in session 39's profile). Off: one layer 46.9 against 46.9 us separate (H100, session 43), and see
    # moe_layer_one_token (decode.py variant kda_layer_one_token)
    kda_layer_one_token: bool = False
    # one token's MLA layer around its attention core in two persistent launches (kernels/mla/triton_layer.py: the
    # input projection, the latent store and the absorbed query; the W_UV product, o_proj and the residual add + next
    # norm) with mla_decode between: four launches where the separate path takes nine (the 48B's 7 MLA layers: no
    # q_lora, no output gate). Off: one layer even with the separate launches (H100, session 42: 62.9 against 62.8
    # us), and see moe_layer_one_token (decode.py variant mla_layer_one_token)
    mla_layer_one_token: bool = False
    # the MLA decode's Gluon kernel (kernels/mla/gluon_decode.py GLUON_LAUNCH: a TMA ring of two 64-token KV tiles,
    # one program an SM) where it runs: sm_90+, bf16/fp16, pages a multiple of 32 tokens, the layout's latent width;
    # elsewhere (and in the batch-invariant mode) the Triton kernel. The default since session 44: on the H200
    # (kernels_mla.py, % of copy bandwidth, Triton / Gluon heads / Gluon tokens) 16x32K 64.2 / 67.7 / 81.0, 64x32K
    # 69.4 / 75.1 / 92.0, 64x128K 71.3 / 76.9 / 95.9, 1x32K 31.9 / 35.8 / 37.0, 1x128K 48.3 / 59.6 / 67.3 (the Gluon
    # rows at the Triton rule's splits; at their own one-wave count, as here, tokens 82.7 / 92.5 / 98.5); the 48B
    # step (decode.py, graph ms, Triton / tokens) 2.576 / 2.578 at batch 1, 11.050 / 10.975 at 16, 21.915 / 21.745
    # at 64 (decode.py variants mla_triton, mla_gluon for the heads layout)
    mla_gluon: bool = True
    # the Gluon kernel's layout (MlaDecodeConfig.gluon_layout): "tokens" (session 43: the tile's tokens on wgmma's M,
    # the heads on N unpadded, half the heads layout's tensor work at 32 heads; needs kv_lora_rank % 64 == 0, else
    # the Triton kernel runs), or "heads" (session 42: heads padded to wgmma's 64 rows)
    mla_gluon_layout: str = "tokens"
    # the MLA decode's combine past 32 splits in one pass over up to 256 (MlaDecodeConfig.wide_combine, its default)
    # instead of 32-split steps: batch 1-4 at long contexts. Off only to time the two-step form (decode.py variant
    # mla_two_step_combine)
    mla_wide_combine: bool = True
    # small routers (kernels/moe/triton_router.py fused_router_fits: E x D <= 32K weights, <= 16 rows, one expert
    # group; k3-tiny's 8 x 384) compute their logits inside the top-k launch (`moe_route_from_x`): one launch per
    # MoE layer fewer in a decode or verify forward, which at batch 1 is launch-bound (issue 16). Off in the
    # batch-invariant mode (a prefill's router stays a GEMM, so a token's logits would depend on the step's rows)
    moe_fused_router: bool = True
    # LatentMoE (K3, k3-tiny) with a shared expert: its gate/up and the routed down projection in one GEMM, and at
    # TP 1 its down and the latent up projection with their sum in one more (backend/runner/gpu/ffn.py
    # LatentFusion): 5 launches of the layer's own instead of 8. The fused weights are prepared whatever this
    # says (the module's weights become views of them), so benchmarks switch it per run. H200 (session 32,
    # k3-tiny decode graphs at batch 1 / 4 / 16): 0.278 / 0.348 / 0.415 ms against 0.325 / 0.418 / 0.477 without
    moe_latent_fusion: bool = True
    # the decoder layer's residual add and the next norm in the MoE's experts' sum launch (backend/runner/gpu/ffn.py
    # moe_add_norm: plain MoE with stacked shared experts at TP 1, the 48B's layers) instead of a norm launch after:
    # one launch per MoE layer fewer (26 in the 48B's forward; decode.py variant no_sum_add_norm). H200, 48B graphs
    # (session 39): 2.678 -> 2.643 ms at batch 1, 11.111 -> 11.054 at 16, 22.041 -> 21.958 at 64
    moe_sum_add_norm: bool = True
    # a one-sequence decode's KDA output norm split between the decode launch and o_proj's (kernels/kda
    # kda_decode_split_norm: y = o * weight * sigmoid(gate) and per-program sums of o^2, no program waiting for its
    # head's others; kernels/linear skinny_linear(row_rms=) applies the rms factor as it reads y). The fused norm's
    # arrival cost ~0.9 us of the N = 1 step (H100 probes, session 39). Off: the 48B step at batch 1 is slower with
    # it (H200, session 44: 2.650 against 2.576 ms; decode.py variant kda_norm_in_o_proj)
    kda_norm_in_o_proj: bool = False
    # a decode step's KDA decode launched with PDL (programmatic dependent launch; the other kernels as they are),
    # its pinned programs (one wave: N = 1) loading the slot, state tile, conv windows and gate constants before the
    # PDL wait, so those trips overlap the input projection's tail and the launch (kernels/kda kda_decode
    # late_wait). Sound: no kernel right before a decode step's KDA writes its states. Off: in a chain of PDL decode
    # calls N = 1 runs 3.78 us against 5.15 (H200, fused norm, benchmarks/kernels.py), but the 48B step at batch 1 is
    # slower with it (H200, session 44: 2.618 against 2.576 ms; decode.py variant kda_decode_pdl). Why (session 46,
    # the graph timeline of the 48B's first 12 layers on the H100): no overlap at all (the GEMM before it does not
    # trigger early), and the late-wait form itself 5.94 against 5.43 us a call
    kda_decode_pdl: bool = False
    # with kda_decode_pdl, a one-sequence decode's last KDA projection (the gates' up-projection) through the skinny
    # GEMV, which triggers the PDL launch after it first thing (skinny_linear trigger=), so the decode step's loads
    # before its wait run beside that GEMV (cuBLAS's PDL trigger is not ours to place). Off: the 48B step at batch 1
    # 2.628 against 2.576 ms (H200, session 44; decode.py variant kda_decode_pdl_trigger)
    kda_decode_pdl_trigger: bool = False
    # the skinny GEMVs (one decode row: o_proj, the dense projections, the fp32 router; `linear`) launched with PDL,
    # each program reading its weight rows before the PDL wait (kernels/linear skinny_linear use_pdl=, prefetch=):
    # "l2", every line into the L2; "tile", its first K step into registers. The weights are never written by a
    # step, so that trip to memory can run in the tail of the kernel before. Session 44's next lever for the 48B
    # batch-1 step (~300 short launches, each losing its ramp). None (off) until timed on the H200 (decode.py
    # variants gemv_prefetch, gemv_prefetch_tile, gemv_prefetch_pdl). With gemv_unrolled, "l2" applies to the
    # unrolled launches too; "tile" to the looped ones only
    gemv_prefetch: str | None = None
    # one-row skinny GEMVs in the unrolled form where it led on the H100 (kernels/linear pick_unrolled: `rows_dot`,
    # every K step's loads in one basic block, a warp a row; the looped form's K steps each wait for their loads,
    # sm_90 SASS, session 45): K <= 3072 one row a program (KDA input 21.8 us against cuBLAS 24.7), K <= 512 four;
    # past that pick_tiles' looped tiles. The default since session 46, with gemv_wide: the 48B's first 12 layers'
    # batch-1 graph on the H100 (decode.py --layers 12) 1.515 ms with both against 1.581 without, 1.577 with this
    # alone; with moe_gemv 1.461-1.463 against 1.581-1.585 (two runs). Not yet timed in the whole 48B step on the H200
    gemv_unrolled: bool = True
    # gemv_unrolled's one-row projections wider than 4096 outputs (KDA and MLA input, dense gate/up, the LM head, the
    # gates' block-diagonal up-projection) through the skinny GEMV too instead of cuBLAS (prefer_skinny's wide rule;
    # H100: 0.8-0.9x cuBLAS's time). No effect without gemv_unrolled (the looped tiles lose to cuBLAS there)
    gemv_wide: bool = True
    # a few tokens' MoE pairs as blocks of one row, no alignment launch, while their experts' weights (read once per
    # pair) stay within this many bytes (kernels/moe/triton_experts.py align_blocks: k3-tiny's verify steps; never the
    # 48B's 14 MB experts); None: the kernel's own bound (PAIR_BLOCKS_MAX_BYTES, 4 MB); 0: one token only, as before
    # session 31. H200 (session 32, k3-tiny decode graphs): 0.348 vs 0.375 ms at batch 4, 0.415 vs 0.433 at 16,
    # equal at 1
    moe_pair_blocks_bytes: int | None = None
    # K3's attention-residual mix in its stacked form where a row's stack fits one tile (kernels/attn_res/triton_mix.py:
    # k3-tiny's 9 x 384; every slot loaded at once, the softmax in two passes) instead of the online chain of J
    # dependent steps. Off: no faster on the H200 (session 33, k3-tiny decode graphs at batch 1 / 4 / 16: 0.285 /
    # 0.351 / 0.414 ms stacked against 0.281 / 0.337 / 0.412 online; decode.py variant stacked_mix). And less
    # exact on the GPU: the bf16 runner's k3 prefill logits at 1.57x the torch reference's own bf16 error with it
    # against 0.92x without (H100, session 35, benchmarks/bf16_paths.py, checkpoint seed 10: session 33's failing
    # test_gpu_runner_bf16_logits_within_tolerance, 0.0459) while the CPU's GPU-numerics emulation gives the two
    # forms equal logits (1.03x); not diagnosed
    attn_res_stacked: bool = False

    def __post_init__(self) -> None:
        if self.moe_pair_blocks_bytes is not None and self.moe_pair_blocks_bytes < 0:
            raise ValueError(f"moe_pair_blocks_bytes: must be >= 0, got {self.moe_pair_blocks_bytes}")
        if self.split_router_min_rows < 0:
            raise ValueError(f"split_router_min_rows: must be >= 0, got {self.split_router_min_rows}")
        if self.kda_intra not in INTRA_FORMS:
            raise ValueError(f"kda_intra: must be one of {INTRA_FORMS}, got {self.kda_intra!r}")
        for name in ("kda_blocks_fuse_gc", "kda_blocks_inverse_regs", "kda_blocks_out_chunk", "kda_blocks_l_chunk"):
            if getattr(self, name) and self.kda_intra != "blocks":
                raise ValueError(f"{name}: a form of kda_intra='blocks', got kda_intra={self.kda_intra!r}")
        if self.mxfp4_experts not in MXFP4_EXPERT_PATHS:
            raise ValueError(f"mxfp4_experts: must be one of {MXFP4_EXPERT_PATHS}, got {self.mxfp4_experts!r}")
        if self.gemv_prefetch is not None and self.gemv_prefetch not in PREFETCH_FORMS:
            raise ValueError(f"gemv_prefetch: must be one of {PREFETCH_FORMS} or None, got {self.gemv_prefetch!r}")
        if self.kda_verify_launch not in KDA_VERIFY_LAUNCHES:
            raise ValueError(f"kda_verify_launch: must be one of {KDA_VERIFY_LAUNCHES}, "
                             f"got {self.kda_verify_launch!r}")


def parse_overrides(spec: str) -> dict:
    """'kda_prep_one_seq=1,moe_pair_blocks_bytes=0' -> KernelConfig overrides, each value parsed as its field's type
    (bools from 1/0, true/false, on/off; `none` for the fields whose default is None)."""
    types = {f.name: str(f.type) for f in fields(KernelConfig)}  # annotations are strings here (future import)
    out: dict = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in types or not value:
            raise ValueError(f"{item!r}: not FIELD=VALUE over KernelConfig's fields")
        kind = types[name].split(" | ")
        if value.lower() == "none" and "None" in kind:
            out[name] = None
        elif kind[0] == "bool":
            if value.lower() not in ("1", "0", "true", "false", "on", "off"):
                raise ValueError(f"{item!r}: {name} takes 1/0, true/false or on/off")
            out[name] = value.lower() in ("1", "true", "on")
        else:
            out[name] = {"int": int, "float": float, "str": str}[kind[0]](value)
    return out


@cache
def kernel(module: str, name: str):
    """The Triton op `name` of `k3rt.kernels.<module>`, or None where that op is not built."""
    try:
        return getattr(importlib.import_module(f"k3rt.kernels.{module}"), name)
    except (ImportError, AttributeError):
        return None


def gemv_launch(x, w, k: KernelConfig) -> dict:
    """The skinny GEMV's tiles for x @ w^T as the config picks them: the unrolled form's at one row with
    gemv_unrolled (kernels/linear pick_unrolled), else the kernel's own ({}). Every caller of skinny_linear for a
    projection `linear` could run takes them from here, so a switch of its own (a PDL trigger) changes nothing else."""
    tiles = kernel("linear", "pick_unrolled")(*w.shape) if k.gemv_unrolled and x.shape[0] == 1 else None
    return {} if tiles is None else {"tiles": tiles}


def linear(x, w, k: KernelConfig, out_dtype=None):
    """x @ w^T (no bias): the skinny GEMV kernel where it measured faster than torch's matmul
    (`kernels.linear.prefer_skinny`: one decode row and a narrow output, or the fp32 router), when
    the kernels are on; else torch (out_dtype: the router's fp32 logits from bf16 x and fp32 weight).
    Batch-invariant mode: always torch, in fixed row tiles, so the kernel (and cuBLAS's algorithm) is
    the same whatever the number of rows."""
    if k.batch_invariant:
        if out_dtype is not None:
            x, w = x.to(out_dtype), w.to(out_dtype)
        return invariant_linear(x, w)
    if k.triton and k.skinny_gemv and x.dim() == 2 and x.stride(-1) == 1:
        prefer = kernel("linear", "prefer_skinny")
        wide = k.gemv_wide and k.gemv_unrolled
        if prefer is not None and prefer(x.shape[0], w.shape[0], x.dtype, w.dtype, wide=wide):
            launch = gemv_launch(x, w, k)
            if k.gemv_prefetch and not (k.gemv_prefetch == "tile" and "tiles" in launch):
                launch.update(use_pdl=True, prefetch=k.gemv_prefetch)
            return kernel("linear", "skinny_linear")(x, w, out_dtype=out_dtype, **launch)
    if out_dtype is not None and (x.dtype != out_dtype or w.dtype != out_dtype):
        return F.linear(x.to(out_dtype), w.to(out_dtype))
    return F.linear(x, w)


def norm(x, weight, eps: float, k: KernelConfig):
    """RMSNorm of x's rows: the Triton norm kernel when the kernels are on (one launch), else the torch expression
    (six kernels; the reference's rounding order either way)."""
    fn = kernel("norm", "rms_norm") if k.triton else None
    return fn(x, weight, eps) if fn is not None else rms_norm(x, weight, eps)


# A fused projection's output width is padded (zero weight rows) to a multiple of this: its row stride is then a
# multiple of 16 elements, so a row slice of any column view (a mixed step's rows) keeps the 16-byte alignment the
# kernels reading it were compiled for, whatever row it starts at (kernels/common.py, "Compiles"); k3-tiny's KDA
# projection (1,092 columns) otherwise gave them a binary per parity of the slice's first row
ROW_ALIGN = 16


def fuse_rows(parts: list) -> tuple:
    """The concatenation of the weights `parts` along dim 0, then zero rows up to a multiple of ROW_ALIGN, each part
    pointed at its rows (share_rows). -> (fused weight, (each part's rows..., the pad's rows))."""
    pad = -sum(p.shape[0] for p in parts) % ROW_ALIGN
    p0 = parts[0]
    fused = torch.cat([p.detach() for p in parts] + [p0.new_zeros(pad, *p0.shape[1:])]).contiguous()
    share_rows(parts, fused)
    return fused, (*(p.shape[0] for p in parts), pad)


def share_rows(parts: list, fused) -> None:
    """Point each weight in `parts` at its rows of `fused` (their concatenation along dim 0), so the
    fused GEMM's copy is the only one in memory and the reference modules keep working."""
    o = 0
    for p in parts:
        n = p.shape[0]
        p.data = fused[o:o + n]
        o += n
