#!/usr/bin/env python3
"""Correctness check and timing of the Triton KDA kernels against the torch oracle and fla.

GPU mode (default), one H200-class GPU:
  1. device-to-device copy bandwidth (bytes read + written), the ceiling for the state-traffic floor;
  2. correctness at a moderate shape: kda_decode and kda_chunk_fwd (each timed launch variant, and
     a steep gate) vs kernels/kda/ref.py, and fla's kernels vs the same oracle (to show they are
     called right);
  3. KDA decode, N in {1, 16, 64, 256} sequences, H=32, D=128, bf16 activations, fp32 state,
     replayed from a CUDA graph, the state rotated over enough layers to defeat the L2; against fla
     `fused_recurrent_kda` (in-place state, gate/beta/l2norm in kernel; it has no conv) and against
     the floor 2 x state bytes / copy bandwidth;
  4. KDA prefill, T in {4K, 16K, 64K} and varlen 8 x 4K, against fla `chunk_kda` (g pre-gated,
     l2norm in kernel, initial and final state); --prefill-variants / --prefill-sweep time launch
     variants of kda_chunk_fwd (PREFILL_VARIANTS), with the time of each of its launches.
Times are medians of CUDA-event-timed repetitions after warm-up. A table goes to stdout, all numbers
to JSON ($OUT/kernels.json, or --out). Items past --budget-s are skipped and say so.

--smoke: a tiny CPU run under the Triton interpreter (no GPU, no fla, no meaningful times) so CI
notices when this script rots.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
import types
from pathlib import Path


# kda_chunk_fwd keyword sets the prefill items can time ("base" is the launcher's defaults)
PREFILL_VARIANTS: dict[str, dict] = {
    "base": {},
    "split": {"split_output": True},
    "split_bv64": {"split_output": True, "block_v": 64},
    "split_bv16": {"split_output": True, "block_v": 16},
    "intra_w4": {"num_warps_intra": 4},  # the default before session 24 (8 now)
    "intra_w16": {"num_warps_intra": 16},
    "inv_tf32x3": {"inv_precision": "tf32x3"},
    "state_w8": {"num_warps_state": 8},
    "state_s1": {"num_stages_state": 1},
    "state_s2": {"num_stages_state": 2},  # the default before session 29 (now 3 with 16-bit scratch)
    "state_w2": {"num_warps_state": 2},
    "bv16": {"block_v": 16},
    "bv16_w2": {"block_v": 16, "num_warps_state": 2},
    "bv64": {"block_v": 64},
    "fp32_scratch": {"scratch_dtype": "float32"},
    "tf32x3": {"precision": "tf32x3", "scratch_dtype": "float32"},  # fp32 operands everywhere
    # the split intra path (kernels/kda/triton_intra_split.py, session 13): (chunk, 16-row block, head) programs
    # then (chunk, head) programs instead of one fused intra program per (chunk, head)
    "split_intra": {"intra": "split"},
    "split_intra_bk32": {"intra": "split", "block_k_split": 32},
    "split_intra_w8": {"intra": "split", "num_warps_split": 8},
    "split_intra_s2": {"intra": "split", "num_stages_split": 2},  # cp.async prefetch of the next K slice
    # the blocks intra path (kernels/kda/triton_intra_blocks.py, session 29): one program per (chunk, head) on 16 x 16
    # blocks and K slices (fla's decomposition); the runner's default since session 32 (2 warps on 16-bit dots)
    "blocks_intra": {"intra": "blocks"},
    "blocks_intra_bk16": {"intra": "blocks", "block_k_blocks": 16},
    "blocks_intra_bk64": {"intra": "blocks", "block_k_blocks": 64},
    "blocks_intra_w1": {"intra": "blocks", "num_warps_blocks": 1},
    "blocks_intra_w2": {"intra": "blocks", "num_warps_blocks": 2},
    "blocks_intra_w4": {"intra": "blocks", "num_warps_blocks": 4},
    "blocks_intra_w8": {"intra": "blocks", "num_warps_blocks": 8},
    "blocks_intra_s1": {"intra": "blocks", "num_stages_blocks": 1},
    "blocks_intra_sliced": {"intra": "blocks", "sliced_out_blocks": True},
    "blocks_intra_sliced_w2": {"intra": "blocks", "sliced_out_blocks": True, "num_warps_blocks": 2},
    "blocks_intra_pairs": {"intra": "blocks", "l_rows_blocks": False},
    "blocks_intra_pairs_w2": {"intra": "blocks", "l_rows_blocks": False, "num_warps_blocks": 2},
    # session 33: no phase-0 launch, Gc (the in-chunk cumsum of g) taken from g where it is read (no fp32 Gc scratch:
    # ~1 GB written and 2 GB read less at 64K tokens); phase 1 then holds 255 registers at 2 warps (139 before)
    "blocks_intra_fused_gc": {"intra": "blocks", "fuse_gc_blocks": True},
    "blocks_intra_fused_gc_w4": {"intra": "blocks", "fuse_gc_blocks": True, "num_warps_blocks": 4},
    # session 34: the inverse launch (1.23 of 8.71 ms at 64K, session 33) with its blocks in registers, ~3 waits on
    # the scratch per program instead of ~22 (the same values)
    "blocks_intra_inverse_regs": {"intra": "blocks", "inverse_regs_blocks": True},
    "blocks_intra_fused_gc_inverse_regs": {"intra": "blocks", "fuse_gc_blocks": True, "inverse_regs_blocks": True},
    # session 34: W/U one program per (chunk, head), the chunk's k, v and Gc rows read once instead of once per row
    # block (~4.2 GB from the L2 at 8 x 4K tokens against ~1.05)
    "blocks_intra_out_chunk": {"intra": "blocks", "out_chunk_blocks": True},
    "blocks_intra_out_chunk_w8": {"intra": "blocks", "out_chunk_blocks": True, "num_warps_out_chunk": 8},
    # session 34: L's four row blocks one after another in one program per chunk (blocks 1-3 read the chunk's rows
    # from the L1)
    "blocks_intra_l_chunk": {"intra": "blocks", "l_chunk_blocks": True},
    "blocks_intra_all_three": {"intra": "blocks", "fuse_gc_blocks": True, "inverse_regs_blocks": True,
                               "out_chunk_blocks": True},
    "blocks_intra_all_four": {"intra": "blocks", "fuse_gc_blocks": True, "inverse_regs_blocks": True,
                              "out_chunk_blocks": True, "l_chunk_blocks": True},
    "blocks_intra_chunks_regs": {"intra": "blocks", "inverse_regs_blocks": True, "out_chunk_blocks": True,
                                 "l_chunk_blocks": True},
    # session 35: the row-block L launch with fused Gc takes 254 registers at 2 warps (4 programs per SM; 139
    # without; fused_gc 30% slower than the default on the H100): capped
    # 16-column K slices: sm_90 registers 102 (L, default), 168 (L, fused Gc: no spills), 72 / 128 (W/U)
    "blocks_intra_fused_gc_bk16": {"intra": "blocks", "fuse_gc_blocks": True, "block_k_blocks": 16},
    "blocks_intra_fused_gc_r168": {"intra": "blocks", "fuse_gc_blocks": True, "max_registers_l": 168},
    "blocks_intra_fused_gc_r128": {"intra": "blocks", "fuse_gc_blocks": True, "max_registers_l": 128},
    # session 36: per-phase launch shapes (sm_90 bf16 registers): Gc at 4 warps and 32-column slices takes 128 and its
    # slice loop is not software-pipelined (no async copies), so a program has 16 KB in flight at a time; 8 warps
    # with 64 or 128 columns (128 registers) issue 32-64 KB at once. The inverse at 4 warps 96, at 2 128, at 1 168:
    # its 16 x 16 dots need no more than a warp or two. W/U (out) at 4 warps 80 against 96 at 2.
    "blocks_intra_gc_w8_bk128": {"intra": "blocks", "num_warps_gc_blocks": 8, "block_k_gc_blocks": 128},
    "blocks_intra_gc_w8_bk64": {"intra": "blocks", "num_warps_gc_blocks": 8, "block_k_gc_blocks": 64},
    "blocks_intra_gc_w4_bk64": {"intra": "blocks", "block_k_gc_blocks": 64},
    "blocks_intra_inv_w2": {"intra": "blocks", "num_warps_inverse_blocks": 2},
    "blocks_intra_inv_w1": {"intra": "blocks", "num_warps_inverse_blocks": 1},
    "blocks_intra_out_w4": {"intra": "blocks", "num_warps_out_blocks": 4},
    "blocks_intra_out_w1": {"intra": "blocks", "num_warps_out_blocks": 1},
    # session 36, second call: the default is now norms_in_l with the inverse at 1 warp; the earlier default beside it,
    # the Gc launch per (chunk, K slice, head), and W/U's launch shapes (fla's recompute_w_u: one program per chunk,
    # 1.50 ms at 64K on the H100 against the row blocks' 2.62)
    "blocks_intra_old_default": {"intra": "blocks", "norms_in_l_blocks": False, "num_warps_inverse_blocks": 4,
                                 "out_chunk_blocks": False},
    "blocks_intra_gc_sliced_w2": {"intra": "blocks", "gc_sliced_blocks": True, "num_warps_gc_blocks": 2},
    "blocks_intra_gc_sliced_w4": {"intra": "blocks", "gc_sliced_blocks": True, "num_warps_gc_blocks": 4},
    "blocks_intra_gc_sliced_w2_bk16": {"intra": "blocks", "gc_sliced_blocks": True, "num_warps_gc_blocks": 2,
                                       "block_k_gc_blocks": 16},
    "blocks_intra_out_s3": {"intra": "blocks", "num_stages_out_blocks": 3},
    "blocks_intra_out_s4": {"intra": "blocks", "num_stages_out_blocks": 4},
    "blocks_intra_out_chunk_s3": {"intra": "blocks", "out_chunk_blocks": True, "num_stages_out_blocks": 3},
    "blocks_intra_out_chunk_s4": {"intra": "blocks", "out_chunk_blocks": True, "num_stages_out_blocks": 4},
    "blocks_intra_out_chunk_w8_s3": {"intra": "blocks", "out_chunk_blocks": True, "num_warps_out_chunk": 8,
                                     "num_stages_out_blocks": 3},
    "blocks_intra_out_chunk_bk64": {"intra": "blocks", "out_chunk_blocks": True, "block_k_out_blocks": 64},
    "blocks_intra_out_chunk_w8_bk64": {"intra": "blocks", "out_chunk_blocks": True, "num_warps_out_chunk": 8,
                                       "block_k_out_blocks": 64},
    # session 37: the default is now also W/U per (chunk, head) at 3 stages and Gc per (chunk, K slice, head) at 2
    # warps; session 36's default beside it
    "blocks_intra_s36_default": {"intra": "blocks", "out_chunk_blocks": False, "gc_sliced_blocks": False},
    # session 36: the rows' squared norms in L's row-block programs (L 139 -> 168 registers at 2 warps), so the Gc launch
    # reads only g (80 registers at 4 warps, 103 at 8 with 128 columns)
    "blocks_intra_norms_in_l": {"intra": "blocks", "norms_in_l_blocks": True},
    "blocks_intra_norms_in_l_gc_w8_bk128": {"intra": "blocks", "norms_in_l_blocks": True, "num_warps_gc_blocks": 8,
                                            "block_k_gc_blocks": 128},
    # timing probes (results wrong, not checked): the fused intra kernel with one stage skipped each (its PROBE
    # bits), so base minus a probe is about what that stage costs
    "probe_no_blocks": {"probe": 1},  # L and Aqk
    "probe_no_subst": {"probe": 2},  # the 16x16 diagonal inverses
    "probe_no_series": {"probe": 4},  # the block series of the inverse
    "probe_no_wu": {"probe": 8},  # W and U
    "probe_no_cumsum": {"probe": 16},
    "probe_only_io": {"probe": 31},  # loads, Gc-free step 1, stores
}


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_bench_args  # noqa: E402


def _add_args(p) -> None:
    p.add_argument("--no-fla", action="store_true", help="do not import or time fla")
    p.add_argument("--decode-n", type=int, nargs="*", default=[1, 16, 64, 256])
    p.add_argument("--decode-sweep", action="store_true",
                   help="time kda_decode over (v_split, block_v, num_warps, pdl, fused norm) configs per N")
    p.add_argument("--decode-baseline", default=None, metavar="FILE",
                   help="an earlier kernels/kda/triton_decode.py (e.g. `git show REV:kernels/kda/triton_decode.py > "
                        "FILE`; carry it to the device) timed at its defaults beside the current kernel, interleaved, "
                        "in the decode rows (and with the fused norm: `--decode-norm`)")
    p.add_argument("--decode-norm", action="store_true", help="decode rows with the fused gated norm too")
    p.add_argument("--verify", nargs="*", default=[], help="kda_verify cases NxT (N sequences, T drafted tokens)")
    p.add_argument("--prefill", nargs="*", default=["4096", "16384", "65536", "8x4096"],
                   help="prefill cases: T (one sequence) or NxT (N sequences of T)")
    p.add_argument("--prefill-variants", nargs="*", default=["base"], choices=sorted(PREFILL_VARIANTS),
                   help="kda_chunk_fwd launch variants timed on every --prefill case (each checked first)")
    p.add_argument("--prefill-sweep", nargs="*", default=[], choices=sorted(PREFILL_VARIANTS),
                   help="more variants, checked, then timed on --sweep-case only")
    p.add_argument("--sweep-case", default="16384", help="the prefill case --prefill-sweep variants are timed on")
    p.add_argument("--profile-kernels", action="store_true",
                   help="per-kernel device time (torch.profiler) of fla's and the default's prefill calls")


ARGS = kernel_bench_args(__doc__, "kernels.json", 420.0, _add_args)

import torch  # noqa: E402

import _timing  # noqa: E402
from _timing import Report, copy_bandwidth, default_out, import_k3rt_kernels, load_file_module, rel_err  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.kda import kda_chunk_fwd, kda_commit, kda_decode, kda_decode_workspace, kda_verify  # noqa: E402
from k3rt.kernels.kda.ref import kda_chunked, kda_gate_lower_bound, kda_recurrent  # noqa: E402
from k3rt.kernels.short_conv.ref import causal_conv1d  # noqa: E402

LB = -5.0  # K3's gate_lower_bound
REPORT = Report(default_out(ARGS.out, "kernels.json"), ARGS.budget_s)
RESULT, item, log, save = REPORT.result, REPORT.item, REPORT.log, REPORT.save


# ------------------------------------------------------------------------------------------
# inputs


def gate_params(H: int, D: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(H * D).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    return A_log.to(DEV), (dt + torch.log(-torch.expm1(-dt))).to(DEV)


def decode_inputs(N: int, H: int, D: int, dtype: torch.dtype, layers: int = 1, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    P = H * D
    A_log, dt_bias = gate_params(H, D, gen)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(
        qkv_pre=r(N, 3 * P).to(dtype).to(DEV),
        conv_weight=(r(3 * P, 4) * 0.5).to(DEV),
        conv_states=[r(N, 3, 3 * P).to(dtype).to(DEV) for _ in range(layers)],
        f=r(N, P).to(dtype).to(DEV),
        A_log=A_log,
        dt_bias=dt_bias,
        b=r(N, H).to(dtype).to(DEV),
        states=[(r(N, H, D, D) * 0.1).to(DEV) for _ in range(layers)],
        slots=torch.arange(N, dtype=torch.int32, device=DEV),
    )


def prefill_inputs(lens: list[int], H: int, D: int, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lens)
    A_log = torch.zeros(H, device=DEV)
    dt_bias = torch.full((H * D,), -3.0, device=DEV)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    f = r(T, H, D)
    return dict(
        q=r(T, H, D).to(dtype), k=r(T, H, D).to(dtype), v=r(T, H, D).to(dtype),
        g=kda_gate_lower_bound(f, A_log, dt_bias.view(H, D), LB),
        beta=torch.sigmoid(r(T, H)),
        cu=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV),
        cu_list=[0, *torch.tensor(lens).cumsum(0).tolist()],
        state=r(len(lens), H, D, D) * 0.1,
        slots=torch.arange(len(lens), dtype=torch.int32, device=DEV),
    )


# ------------------------------------------------------------------------------------------
# correctness


def decode_reference(x: dict, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    N = x["qkv_pre"].shape[0]
    y, _ = causal_conv1d(x["qkv_pre"].float()[:, None], x["conv_weight"], x["conv_states"][0].float())
    q, k, v = y.view(N, 1, 3, H, D).unbind(2)  # [N, 1, H, D]
    g = kda_gate_lower_bound(x["f"].float().view(N, 1, H, D), x["A_log"], x["dt_bias"].view(H, D), LB)
    beta = torch.sigmoid(x["b"].float()).view(N, 1, H)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=x["states"][0])
    return o[:, 0], s


def check_decode(N: int, H: int, D: int) -> dict:
    x = decode_inputs(N, H, D, ACT, seed=1)
    o_ref, s_ref = decode_reference(x, H, D)
    o = kda_decode(x["qkv_pre"], x["conv_weight"], x["conv_states"][0], x["f"], x["A_log"], x["dt_bias"],
                   x["b"], x["states"][0], x["slots"], lower_bound=LB)
    e_o, e_s = rel_err(o, o_ref), rel_err(x["states"][0], s_ref)
    tol = 5e-3 if ACT == torch.bfloat16 else 1e-4
    return {"shape": f"N={N} H={H} D={D} {ACT}", "rel_err_o": e_o, "rel_err_state": e_s,
            "ok": e_o <= tol and e_s <= 1e-4}


def variant_kwargs(name: str) -> dict:
    kw = dict(PREFILL_VARIANTS[name])
    if "scratch_dtype" in kw:
        kw["scratch_dtype"] = getattr(torch, kw["scratch_dtype"])
    return kw


def check_chunk(lens: list[int], H: int, D: int, variant: str, steep: bool = False) -> dict:
    """kda_chunk_fwd (one launch variant) against the oracle, with two snapshots; steep: some tokens
    decay by 40-300 nats in some channels (the exact diagonal-block path)."""
    x = prefill_inputs(lens, H, D, ACT, seed=2)
    if steep:
        x["g"][5, 0, :4] = -80.0
        x["g"][70, 1:5, 3] = -300.0
        x["g"][lens[0] - 10:lens[0] - 8, :, 8:] = -45.0
    s0 = x["state"].clone()
    snaps = [[p for p in (64, lens[0]) if p <= lens[0]]] + [[] for _ in lens[1:]]
    dest = [[len(lens) + j for j in range(len(snaps[0]))]] + [[] for _ in lens[1:]]
    state = torch.cat([x["state"], torch.zeros(len(snaps[0]), H, D, D, device=DEV)])
    o = kda_chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], state, x["slots"],
                      snapshot_positions=snaps, snapshot_slots=dest, **variant_kwargs(variant))
    e_o = e_s = 0.0
    for i, (b, e) in enumerate(zip(x["cu_list"], x["cu_list"][1:])):
        args = [x[n][None, b:e] for n in ("q", "k", "v", "g", "beta")]
        o_r, s_r, snap_r = kda_chunked(*args, initial_state=s0[i][None], state_positions=snaps[i])
        e_o = max(e_o, rel_err(o[b:e], o_r[0]))
        e_s = max(e_s, rel_err(state[i], s_r[0]))
        for d, s in zip(dest[i], snap_r):
            e_s = max(e_s, rel_err(state[d], s[0]))
    tol = (5e-3 if variant == "tf32x3" else 2e-2) if DEV == "cuda" else 3e-3
    return {"shape": f"lens={lens} H={H} D={D} {ACT} {variant}{' steep' if steep else ''}", "rel_err_o": e_o,
            "rel_err_state": e_s, "ok": e_o <= tol and e_s <= tol}


def check_fla_decode(N: int, H: int, D: int) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q, k, v = (r(N, 1, H, D).to(ACT) for _ in range(3))
    f, b = r(N, 1, H, D).to(ACT), r(N, 1, H).to(ACT)
    A_log, dt_bias = gate_params(H, D, torch.Generator().manual_seed(3))
    state = r(N, H, D, D) * 0.1
    g = kda_gate_lower_bound(f.float(), A_log, dt_bias.view(H, D), LB)
    o_ref, s_ref = kda_recurrent(q, k, v, g, torch.sigmoid(b.float()), initial_state=state)
    o = fla_decode(q, k, v, f, b, A_log, dt_bias, state, torch.arange(N, dtype=torch.int32, device=DEV))
    return {"shape": f"fla fused_recurrent N={N} H={H} D={D}", "rel_err_o": rel_err(o, o_ref),
            "rel_err_state": rel_err(state, s_ref),
            "ok": rel_err(o, o_ref) <= 1e-2 and rel_err(state, s_ref) <= 1e-3}


def check_fla_chunk(lens: list[int], H: int, D: int) -> dict:
    x = prefill_inputs(lens, H, D, ACT, seed=4)
    s0 = x["state"].clone()
    o, s = fla_chunk(x)
    e_o = e_s = 0.0
    for i, (b, e) in enumerate(zip(x["cu_list"], x["cu_list"][1:])):
        args = [x[n][None, b:e] for n in ("q", "k", "v", "g", "beta")]
        o_r, s_r, _ = kda_chunked(*args, initial_state=s0[i][None])
        e_o, e_s = max(e_o, rel_err(o[0, b:e], o_r[0])), max(e_s, rel_err(s[i], s_r[0]))
    return {"shape": f"fla chunk_kda lens={lens} H={H} D={D}", "rel_err_o": e_o, "rel_err_state": e_s,
            "ok": e_o <= 2e-2 and e_s <= 2e-2}


# ------------------------------------------------------------------------------------------
# fla wrappers (fla must be importable: carried as a wheel on the device machine)

FLA = None


def load_fla() -> str:
    global FLA
    if ARGS.no_fla or ARGS.smoke:
        return "fla skipped"
    try:
        import fla
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        FLA = types.SimpleNamespace(chunk_kda=chunk_kda, fused_recurrent_kda_fwd=fused_recurrent_kda_fwd)
        return f"fla {getattr(fla, '__version__', '?')}"
    except Exception as e:
        return f"fla missing ({type(e).__name__}: {e})"


def fla_decode(q, k, v, f, b, A_log, dt_bias, state, slots, out=None):
    """fla's decode path: in-place state at ssm_state_indices, gate/beta/l2norm inside, no conv."""
    o, _ = FLA.fused_recurrent_kda_fwd(
        q, k, v, f, b, A_log=A_log, dt_bias=dt_bias, initial_state=state, scale=q.shape[-1] ** -0.5,
        inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LB, out=out,
    )
    return o


def fla_chunk(x: dict):
    return FLA.chunk_kda(
        x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None],
        scale=x["q"].shape[-1] ** -0.5, initial_state=x["state"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"].long(),
        cu_seqlens_cpu=torch.tensor(x["cu_list"], dtype=torch.long),
    )


# ------------------------------------------------------------------------------------------
# timing: _timing's, on the device this run chose (DEV), not on whichever one is present (--smoke
# runs on the CPU even where there is a GPU)


def time_ms(fn, reps: int, warmup: int) -> dict:
    return _timing.time_ms(fn, reps=reps, warmup=warmup, cuda=DEV == "cuda")


def graph_time(calls: list, reps: int) -> dict:
    return _timing.graph_time(calls, reps=reps, cuda=DEV == "cuda")


def rotation_layers(state_bytes: int) -> int:
    """Enough distinct layer buffers that one pass over them is 3x the L2 (cold state each call)."""
    return _timing.l2_rotation(state_bytes, cuda=DEV == "cuda")


def load_baseline(path: str) -> types.SimpleNamespace:
    """kda_decode and kda_decode_workspace of an earlier triton_decode.py (--decode-baseline)."""
    mod = load_file_module(path, "k3rt_decode_baseline")
    return types.SimpleNamespace(kda_decode=mod.kda_decode, kda_decode_workspace=mod.kda_decode_workspace)


def bench_decode(N: int, H: int, D: int, impl: str, cfg: dict | None = None,
                 kernel: types.SimpleNamespace | None = None) -> dict:
    """cfg (k3rt only): kda_decode keywords (v_split, block_v, num_warps, use_pdl) plus norm=True for
    the fused gated RMSNorm epilogue. kernel: another kda_decode / kda_decode_workspace pair (load_baseline)."""
    decode, workspace = (kda_decode, kda_decode_workspace) if kernel is None else (kernel.kda_decode,
                                                                                  kernel.kda_decode_workspace)
    cfg = dict(cfg or {})
    norm = cfg.pop("norm", False)
    state_bytes = N * H * D * D * 4
    L = rotation_layers(state_bytes)
    x = decode_inputs(N, H, D, ACT, layers=L, seed=5)
    outs = [torch.empty(N, H, D, dtype=ACT, device=DEV) for _ in range(L)]
    if impl != "fla":
        extra = dict(cfg)
        if norm:
            gen = torch.Generator(device=DEV).manual_seed(6)
            extra.update(o_gate=torch.randn(N, 2 * H * D, generator=gen, device=DEV).to(ACT)[:, H * D:],
                         o_norm_weight=torch.ones(D, device=DEV, dtype=ACT))
        extra["workspace"] = workspace(N, H, DEV)  # allocated before capture, reused
        calls = [
            (lambda l=l: decode(x["qkv_pre"], x["conv_weight"], x["conv_states"][l], x["f"], x["A_log"],
                                    x["dt_bias"], x["b"], x["states"][l], x["slots"], lower_bound=LB, out=outs[l],
                                    **extra))
            for l in range(L)
        ]
    else:
        P = H * D
        q, k, v = (x["qkv_pre"][:, i * P:(i + 1) * P].reshape(N, 1, H, D).contiguous() for i in range(3))
        f, b = x["f"].view(N, 1, H, D), x["b"].view(N, 1, H)
        calls = [
            (lambda l=l: fla_decode(q, k, v, f, b, x["A_log"], x["dt_bias"], x["states"][l], x["slots"],
                                    out=outs[l].view(N, 1, H, D)))
            for l in range(L)
        ]
    calls = calls * max(1, math.ceil(8 / L))
    t = graph_time(calls, reps=30 if DEV == "cuda" else 1)
    floor_us = 2 * state_bytes / BW * 1e6 if BW else None
    t.update({"N": N, "impl": impl, "cfg": {**cfg, "norm": norm}, "rotation_layers": L,
              "state_MB": state_bytes / 1e6, "floor_us": floor_us,
              "state_GBps": 2 * state_bytes / (t["us_per_call"] * 1e-6) / 1e9})
    if floor_us:
        t["floor_frac"] = floor_us / t["us_per_call"]
    return t


def decode_sweep_configs(N: int) -> list[dict]:
    """The launch shapes worth timing at batch N (small N: split V, PDL; large N: tile width, warps)."""
    def c(s: int, bv: int, w: int = 4, **kw) -> dict:
        return dict(v_split=s, block_v=bv, num_warps=w, **kw)
    # one or two warps per program: the state tile's key axis (the reduced one) then stays inside a warp, so the
    # two reductions per tile are shuffles, not shared-memory round trips with barriers
    if N <= 4:
        # session 38: split programs at one warp take every load up front (triton_decode.load_order), the
        # default now; the 2- and 4-warp shapes stay for comparison
        return [{}, c(8, 16, 1), c(8, 16, 1, use_pdl=True), c(8, 16, 2), c(8, 16, 2, use_pdl=True), c(4, 32, 1),
                c(4, 32, 1, use_pdl=True), c(4, 32, 4), c(16, 8, 1), c(16, 8, 1, use_pdl=True), c(2, 64, 4),
                c(8, 16, 1, norm=True), c(8, 16, 1, norm=True, use_pdl=True), c(8, 16, 2, norm=True),
                c(4, 32, 1, norm=True),
                # timing probes (results wrong, not checked; session 37): the default one-warp shape without the
                # split heads' arrival (1), without the conv cache (2), without both (3), and with the norm asked for
                c(8, 16, 1, probe=1), c(8, 16, 1, probe=2), c(8, 16, 1, probe=3), c(8, 16, 1, use_pdl=True, probe=3),
                c(8, 16, 1, norm=True, probe=1),
                # session 39: the pinned form (row vectors, the tile before the fence) off at N = 1 and on at N = 4
                c(8, 16, 1, pin=False), c(8, 16, 1, norm=True, pin=False), c(4, 32, 1, pin=True),
                c(4, 32, 1, norm=True, pin=True),
                # session 44: with PDL the pinned programs load the state tile and windows before the wait
                # (against the wait first, above; sound here: each call's state was written L calls back)
                c(8, 16, 1, use_pdl=True, late_wait=True), c(8, 16, 1, norm=True, use_pdl=True, late_wait=True),
                # without the norm the late wait gained nothing on the H100 (4.13 -> 4.10 us; with it 5.17 -> 3.97):
                # the count for the q/k cache shift at the end, as with the norm, instead of right after the windows
                c(8, 16, 1, use_pdl=True, late_wait=True, early=False), c(8, 16, 1, early=False)]
    # {}: the default (split one-warp programs up to N * H = 512 since session 38); c(4, 32, 1) and c(8, 16, 1), the
    # split one-warp shapes, are in the list below
    return [{}, c(4, 32, 1, use_pdl=True), c(4, 32, 1, norm=True),
            c(1, 32), c(1, 64), c(1, 64, 8), c(2, 32), c(2, 64), c(1, 64, norm=True),
            c(1, 16, 1), c(1, 32, 1), c(2, 16, 1), c(2, 32, 1), c(4, 16, 1), c(4, 32, 1), c(8, 16, 1),
            c(1, 16, 2), c(1, 32, 2), c(2, 32, 2), c(4, 32, 2), c(1, 16, 1, norm=True), c(2, 32, 1, norm=True),
            c(1, 16, 1, prefetch=True), c(2, 16, 1, prefetch=True), c(1, 32, 4, prefetch=True),
            # session 39: the pinned form past one wave (load_order pins up to 256 programs; on the H100 the row
            # vectors alone lost at N = 8-16, the tile before the fence was not tried there). Its registers (sm_90
            # build): 216 at 32 columns, 158 at 16 (12 programs an SM against 8), 255 with two or four 16-column
            # tiles a program (the tile form spilled there: c(2, 16, 1, prefetch=True) above)
            c(4, 32, 1, pin=True), c(4, 32, 1, norm=True, pin=True), c(8, 16, 1, pin=True),
            c(8, 16, 1, norm=True, pin=True), c(4, 16, 1, pin=True), c(2, 16, 1, pin=True)]


def check_decode_cfg(N: int, H: int, D: int, cfg: dict) -> dict:
    """One sweep config against the oracle (fused norm: against rms_norm_gated of the oracle's o)."""
    cfg = dict(cfg)
    norm = cfg.pop("norm", False)
    x = decode_inputs(N, H, D, ACT, seed=7)
    o_ref, s_ref = decode_reference(x, H, D)
    extra = {}
    if norm:
        gate = torch.randn(N, H, D, device=DEV).to(ACT)
        w = 1 + 0.1 * torch.randn(D, device=DEV)
        extra = dict(o_gate=gate, o_norm_weight=w)
        o_ref = o_ref.float()
        o_ref = o_ref * torch.rsqrt(o_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w * torch.sigmoid(gate.float())
    o = kda_decode(x["qkv_pre"], x["conv_weight"], x["conv_states"][0], x["f"], x["A_log"], x["dt_bias"],
                   x["b"], x["states"][0], x["slots"], lower_bound=LB, **cfg, **extra)
    e_o, e_s = rel_err(o, o_ref), rel_err(x["states"][0], s_ref)
    return {"shape": f"N={N} {cfg} norm={norm}", "rel_err_o": e_o, "rel_err_state": e_s,
            "ok": e_o <= 1e-2 and e_s <= 1e-4}


def bench_verify(case: str, H: int, D: int) -> dict:
    """kda_verify and kda_commit, each timed in a CUDA graph; floor: read the live state once, write T states."""
    n, _, t = case.partition("x")
    N, T = int(n), int(t)
    x = decode_inputs(N, H, D, ACT, seed=8)
    gen = torch.Generator(device=DEV).manual_seed(9)
    P = H * D
    proj = torch.randn(N * T, 4 * P + H, generator=gen, device=DEV).to(ACT)
    qkv, f, b = proj[:, :3 * P].view(N, T, -1), proj[:, 3 * P:4 * P].view(N, T, -1), proj[:, 4 * P:].view(N, T, H)
    st_out = torch.empty(N, T, H, D, D, device=DEV)
    cv_out = torch.empty(N, T, 3, 3 * P, device=DEV, dtype=ACT)
    o = torch.empty(N, T, H, D, device=DEV, dtype=ACT)
    acc = torch.randint(0, T + 1, (N,), generator=gen, device=DEV, dtype=torch.int32)
    st, cs = x["states"][0], x["conv_states"][0]
    res = kda_verify(qkv, x["conv_weight"], cs, f, x["A_log"], x["dt_bias"], b, st, x["slots"], lower_bound=LB)
    # correctness of the last position against T oracle steps
    step = dict(x)
    states, convs = [st.clone()], [cs.clone()]
    for i in range(T):
        step.update(qkv_pre=qkv[:, i], f=f[:, i], b=b[:, i], states=[states[-1]], conv_states=[convs[-1]])
        o_r, s_r = decode_reference(step, H, D)
        _, c_r = causal_conv1d(qkv[:, i].float()[:, None], x["conv_weight"], convs[-1].float())
        states.append(s_r)
        convs.append(c_r.to(ACT))
    e_o = rel_err(res.o[:, -1], o_r)
    e_s = rel_err(res.states_out[:, -1], states[-1])
    verify = lambda: kda_verify(qkv, x["conv_weight"], cs, f, x["A_log"], x["dt_bias"], b, st,  # noqa: E731
                                x["slots"], lower_bound=LB, out=o, states_out=st_out, conv_out=cv_out)
    commit = lambda: kda_commit(st_out, cv_out, acc, x["slots"], st, cs)  # noqa: E731
    tv = graph_time([verify] * 4, reps=20)
    tc = graph_time([commit] * 4, reps=20)
    state_bytes = N * H * D * D * 4
    floor_us = (1 + T) * state_bytes / BW * 1e6 if BW else None
    return {"N": N, "T": T, "verify_us": tv["us_per_call"], "commit_us": tc["us_per_call"],
            "verify_floor_us": floor_us, "rel_err_o_last": e_o, "rel_err_state_last": e_s,
            "ok": e_o <= 1e-2 and e_s <= 1e-4}


def kernel_split_ms(fn, reps: int) -> dict:
    """Median time of each of kda_chunk_fwd's launches (events around each; syncs in between)."""
    import k3rt.kernels.kda.triton_chunk as tc
    import k3rt.kernels.kda.triton_intra_blocks as tb
    import k3rt.kernels.kda.triton_intra_split as ts

    # (kernel, module): the split and blocks intra paths' launches live in their own modules
    names = (("_kda_chunk_intra_kernel", tc), ("_kda_intra_rows_kernel", ts), ("_kda_intra_solve_kernel", ts),
             ("_blocks_gc_kernel", tb), ("_blocks_gc_slice_kernel", tb), ("_blocks_pair_kernel", tb),
             ("_blocks_lrow_kernel", tb),
             ("_blocks_inverse_kernel", tb),
             ("_blocks_out_kernel", tb), ("_kda_chunk_state_kernel", tc), ("_kda_chunk_out_kernel", tc))
    orig = {n: getattr(m, n) for n, m in names}
    times: dict = {n: [] for n, _ in names}

    class Timed:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            launch = orig[self.name][grid]

            def run(*a, **kw):
                if DEV == "cuda":
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    launch(*a, **kw)
                    e.record()
                    e.synchronize()
                    times[self.name].append(s.elapsed_time(e))
                else:
                    t = time.perf_counter()
                    launch(*a, **kw)
                    times[self.name].append((time.perf_counter() - t) * 1e3)
            return run

    try:
        for n, m in names:
            setattr(m, n, Timed(n))
        for _ in range(reps):
            fn()
    finally:
        for n, m in names:
            setattr(m, n, orig[n])
    # intra_kernel_ms, state_kernel_ms, out_kernel_ms; split intra: intra_rows_kernel_ms, intra_solve_kernel_ms
    return {f"{n.strip('_').removeprefix('kda_chunk_').removeprefix('kda_')}_ms": statistics.median(t)
            for n, t in times.items() if t}


def back_to_back_ms(fn, calls: int = 4, reps: int = 3) -> float:
    """Median per-call time of `calls` calls issued back to back between two events: the host's per-call work (tables,
    launches) runs while the GPU works on the previous call, as in a forward over many layers, so this is the
    kernels' throughput. time_ms's single call also counts the host's work before its first launch."""
    return time_ms(lambda: [fn() for _ in range(calls)], reps=reps, warmup=0)["median_ms"] / calls


def kernel_profile(fn, calls: int = 3) -> dict:
    """Device time per call of each kernel `fn` launches (torch.profiler; names cut to 80 characters), largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if us and ev.key:
            per[ev.key[:80]] = per.get(ev.key[:80], 0.0) + us / calls
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def bench_prefill(case: str, H: int, D: int, impl: str, variant: str = "base") -> dict:
    n, _, t = case.rpartition("x")
    lens = [int(t)] * (int(n) if n else 1)
    x = prefill_inputs(lens, H, D, ACT, seed=6)
    if impl == "k3rt":
        fn = lambda: kda_chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["state"],  # noqa: E731
                                   x["slots"], cu_seqlens_cpu=x["cu_list"], **variant_kwargs(variant))
    else:
        fn = lambda: fla_chunk(x)  # noqa: E731
    t0 = time.monotonic()
    fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    first_s = time.monotonic() - t0
    reps = 10 if sum(lens) <= 16384 else 5
    t = time_ms(fn, reps=reps if DEV == "cuda" else 1, warmup=2 if DEV == "cuda" else 0)
    t.update({"case": case, "tokens": sum(lens), "impl": impl if impl != "k3rt" else f"k3rt {variant}",
              "first_call_s": first_s, "Mtok_per_s": sum(lens) / (t["median_ms"] * 1e-3) / 1e6})
    if DEV == "cuda":
        t["b2b_ms"] = back_to_back_ms(fn)
        if ARGS.profile_kernels and variant in ("base", "blocks_intra"):
            t["kernels_us"] = kernel_profile(fn)
    if impl == "k3rt":  # where the time goes: the parallel intra-chunk pass, the sequential state pass, output
        t.update(kernel_split_ms(fn, reps=3 if DEV == "cuda" else 1))
    return t


# ------------------------------------------------------------------------------------------


def main() -> int:
    global DEV, ACT, BW
    smoke = ARGS.smoke or not torch.cuda.is_available()
    DEV = "cpu" if smoke else "cuda"
    ACT = torch.float32 if smoke else torch.bfloat16
    BW = None
    import triton

    RESULT.update(mode="smoke" if smoke else "gpu", torch=torch.__version__, triton=triton.__version__,
                  device=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (triton interpreter)")
    RESULT["fla"] = load_fla()
    log(f"{RESULT['device']} torch {torch.__version__} triton {triton.__version__}; {RESULT['fla']}")
    if DEV == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the oracle runs in true fp32
        bw = item("bandwidth", "d2d copy 1 GiB", copy_bandwidth)
        BW = bw.get("GBps", 0) * 1e9 or None

    # Kimi shapes throughout: the kernels specialize on H and D, so the checks compile what is timed
    H, D = (32, 128) if not smoke else (2, 16)
    item("correctness", "kda_decode", lambda: check_decode(8 if not smoke else 2, H, D))
    lens = [300, 64, 1000] if not smoke else [65, 3]
    item("correctness", "kda_chunk_fwd base", lambda: check_chunk(lens, H, D, "base"))
    if FLA is not None:
        item("correctness", "fla fused_recurrent_kda", lambda: check_fla_decode(8, H, D))

    decode_n = ARGS.decode_n if not smoke else [2]
    prefill = ARGS.prefill if not smoke else ["65", "2x33"]
    base = load_baseline(ARGS.decode_baseline) if ARGS.decode_baseline else None
    for N in (decode_n if not ARGS.decode_sweep else []):
        for cfg, tag in [({}, "")] + ([({"norm": True}, " norm")] if ARGS.decode_norm else []):
            # the baseline right after the current kernel, then the current kernel again: two readings each,
            # interleaved, so a drift of the GPU's clocks shows instead of favouring one side
            for rep in ("", " again")[:2 if base else 1]:
                item("decode", f"k3rt{tag} N={N}{rep}", lambda N=N, c=cfg: bench_decode(N, H, D, "k3rt", c))
                if base:
                    item("decode", f"baseline{tag} N={N}{rep}",
                         lambda N=N, c=cfg: bench_decode(N, H, D, "baseline", c, kernel=base))
        if FLA is not None:
            item("decode", f"fla N={N}", lambda N=N: bench_decode(N, H, D, "fla"))
    if ARGS.decode_sweep:
        for N in (decode_n or [1, 16, 64, 256]):
            for i, cfg in enumerate(decode_sweep_configs(N)):
                if not cfg.get("probe") and (i == 0 or cfg.get("norm") or cfg.get("v_split", 1) > 1
                                             or cfg.get("num_warps", 4) < 4):
                    item("correctness", f"kda_decode N={N} {cfg}", lambda N=N, c=cfg: check_decode_cfg(N, H, D, c))
                item("decode_sweep", f"k3rt N={N} {cfg}", lambda N=N, c=cfg: bench_decode(N, H, D, "k3rt", c))
    for case in (ARGS.verify if not smoke else ["2x3"]):
        item("verify", f"k3rt {case}", lambda c=case: bench_verify(c, H, D))
    smoke_variants = ["base", "split", "split_intra", "blocks_intra", "blocks_intra_all_four"]
    variants = ARGS.prefill_variants if not smoke else smoke_variants
    if not smoke:
        item("correctness", "kda_chunk_fwd base steep", lambda: check_chunk([300, 64, 1000], H, D, "base", True))
        # the split and blocks intra paths have steep-gate code of their own
        for var in sorted({v for v in variants + ARGS.prefill_sweep
                           if PREFILL_VARIANTS[v].get("intra") in ("split", "blocks")}):
            item("correctness", f"kda_chunk_fwd {var} steep",
                 lambda v=var: check_chunk([300, 64, 1000], H, D, v, True))
    # the first variant, then fla, then the others: fla's chunk kernels autotune on first use (a minute or more),
    # and a budget that ends early should cut the extra variants, not the peer (session 33 lost fla's 64K and 8 x 4K)
    for i, var in enumerate(variants):
        if var != "base" and "probe" not in PREFILL_VARIANTS[var]:
            item("correctness", f"kda_chunk_fwd {var}", lambda v=var: check_chunk(lens, H, D, v))
        for case in prefill:
            item("prefill", f"k3rt {case} {var}", lambda c=case, v=var: bench_prefill(c, H, D, "k3rt", v))
        if i == 0 and FLA is not None:
            item("correctness", "fla chunk_kda", lambda: check_fla_chunk([300, 64, 1000], H, D))
            for case in prefill:
                item("prefill", f"fla {case}", lambda c=case: bench_prefill(c, H, D, "fla"))
    for var in (ARGS.prefill_sweep if not smoke else []):
        if "probe" not in PREFILL_VARIANTS[var]:  # a probe's output is wrong by design
            item("correctness", f"kda_chunk_fwd {var}", lambda v=var: check_chunk(lens, H, D, v))
        item("prefill", f"k3rt {ARGS.sweep_case} {var}", lambda v=var: bench_prefill(ARGS.sweep_case, H, D, "k3rt", v))
    if FLA is not None and len(variants) > 1:
        # fla's times moved by up to 38% between calls (its autotuner's picks; session 35): a second reading of the
        # peer in the same call, after every variant, so the ratio can be taken against its faster one
        for case in prefill:
            item("prefill", f"fla {case} again", lambda c=case: {**bench_prefill(c, H, D, "fla"), "impl": "fla again"})

    print_table()
    save()
    ok = all(c.get("ok") for c in RESULT.get("correctness", []) + RESULT.get("verify", []))
    log(f"wrote {REPORT.path}; correctness {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def print_table() -> None:
    print(f"\n== {RESULT['device']} | {RESULT['fla']} | copy "
          f"{(RESULT.get('bandwidth') or [{}])[0].get('GBps', float('nan')):.0f} GB/s ==")
    for c in RESULT.get("correctness", []):
        print(f"check {c['name']:<32} {c.get('shape', ''):<58} o {c.get('rel_err_o', float('nan')):.2e} "
              f"state {c.get('rel_err_state', float('nan')):.2e} {'ok' if c.get('ok') else 'FAIL'} "
              f"{c.get('error', c.get('skipped', ''))}")
    by = {}  # (N, norm) -> impl -> readings (k3rt and the baseline twice each with --decode-baseline)
    for d in RESULT.get("decode", []):
        if "N" in d:
            by.setdefault((d["N"], d["cfg"].get("norm", False)), {}).setdefault(d["impl"], []).append(d)
    print(f"\ndecode (H=32 D=128, CUDA graph, us/call)  {'N':>4} {'norm':>5} {'k3rt':>13} {'baseline':>13} "
          f"{'fla':>9} {'floor':>9} {'k3rt GB/s':>10}")

    def us(rows: list) -> str:
        return " / ".join(f"{d['us_per_call']:.2f}" for d in rows) or "-"

    for (N, norm), r in sorted(by.items()):
        k, b, f = r.get("k3rt", []), r.get("baseline", []), r.get("fla", [])
        fl = next((d["floor_us"] for d in k + f if d.get("floor_us")), float("nan"))
        gbps = k[0].get("state_GBps", float("nan")) if k else float("nan")
        print(f"{'':42}{N:>4} {'yes' if norm else 'no':>5} {us(k):>13} {us(b):>13} {us(f):>9} {fl:9.2f} {gbps:10.0f}")
    sweep = [d for d in RESULT.get("decode_sweep", []) if "us_per_call" in d]
    if sweep:
        print(f"\ndecode sweep (us/call, CUDA graph)  {'N':>4} {'us':>8} {'floor%':>7}  config")
        for d in sweep:
            print(f"{'':35}{d['N']:>4} {d['us_per_call']:8.2f} {100 * d.get('floor_frac', float('nan')):6.0f}%  {d['cfg']}")
    for d in RESULT.get("verify", []):
        if "verify_us" in d:
            print(f"verify N={d['N']} T={d['T']}: verify {d['verify_us']:.2f} us (floor {d['verify_floor_us'] or float('nan'):.2f}),"
                  f" commit {d['commit_us']:.2f} us, err o {d['rel_err_o_last']:.1e} state {d['rel_err_state_last']:.1e}")
    print(f"\nprefill (H=32 D=128, ms)  {'case':>8} {'impl':<34} {'median':>9} {'b2b':>8} {'Mtok/s':>8} {'first s':>8} "
          f"{'intra':>8} {'state':>8} {'out':>8} {'rows':>8} {'solve':>8}")
    nan = float("nan")
    for p in RESULT.get("prefill", []):
        if "median_ms" in p:
            # the split intra path's intra time is its two launches (rows, solve) together
            intra = p.get("intra_kernel_ms", p.get("intra_rows_kernel_ms", nan) + p.get("intra_solve_kernel_ms", nan))
            print(f"{'':26}{p['case']:>8} {p['impl']:<34} {p['median_ms']:9.3f} {p.get('b2b_ms', nan):8.3f} "
                  f"{p['Mtok_per_s']:8.2f} "
                  f"{p['first_call_s']:8.1f} {intra:8.3f} "
                  f"{p.get('state_kernel_ms', nan):8.3f} {p.get('out_kernel_ms', nan):8.3f} "
                  f"{p.get('intra_rows_kernel_ms', nan):8.3f} {p.get('intra_solve_kernel_ms', nan):8.3f}")
            if "blocks_gc_kernel_ms" in p or "blocks_lrow_kernel_ms" in p:
                gc = p.get("blocks_gc_kernel_ms", p.get("blocks_gc_slice_kernel_ms", nan))
                phases = " / ".join(f"{x:.3f}" for x in [gc] + [p.get(f"blocks_{n}_kernel_ms", nan)
                                                                 for n in ("lrow", "inverse", "out")])
                print(f"{'':36}blocks phases gc / lrow / inverse / out: {phases}")
            for name, us in list(p.get("kernels_us", {}).items())[:10]:
                print(f"{'':36}{us:10.1f} us  {name}")
        else:
            print(f"{'':26}{p['name']:<44} {p.get('error', p.get('skipped', ''))}")
    for sec in ("decode", "decode_sweep", "verify"):
        for d in RESULT.get(sec, []):
            if "error" in d or "skipped" in d:
                print(f"{sec} {d['name']}: {d.get('error', d.get('skipped'))}")


if __name__ == "__main__":
    sys.exit(main())
