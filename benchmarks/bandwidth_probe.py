"""What the memory system gives at issue 18's decode shapes, against the 1 GiB copy its floors are taken from.

Issue 18's decode goals are fractions of the device-to-device copy bandwidth of a 1 GiB buffer (4.2 TB/s on the
H200). On the H200 the KDA decode (ours and fla's) stops at 62-75 % of that floor at N = 16-64 and the MLA decode
at 64-71 % at batch >= 16, while on the H100 the same kernels reach 76-100 % (benchmarks/RESULTS.md). This script
asks what a kernel with no math at all reaches on the same bytes, so a shortfall can be told apart: the access
pattern's (size, tiles, pages) or the kernel's.

KDA (H = 32, D = 128, fp32 states [N, H, D, D], one slot per sequence, rotated over enough layers that every call
reads cold memory), per N, each replayed from a CUDA graph, GB/s counting the state read + written:
  - torch's in-place scale of the N states (`mul_`: the elementwise kernel, read and write the same bytes),
    and torch's copy of them to another buffer;
  - a Triton read-modify-write with the decode kernel's grid and tiles ((sequence, head, V slice) programs walking
    [D, BV] tiles): at the decode's default shape for that N, at fla's (4 programs a head, 32 columns, 4 warps),
    and with the delta rule's two reductions over the key axis (k^T S and S^T q) kept in;
  - kernels/kda kda_decode at its defaults (the whole step: conv, gates, norms, the update).
MLA (H = 32, latent 512 + rope 64 = 576 bf16 a token, 1888-token pages shuffled in one pool), per (batch, context),
GB/s counting the KV read:
  - torch's sum of the same number of bytes in one contiguous buffer (a read-only reduction);
  - a Triton paged read: the decode's split-KV grid over the page table, 64-token tiles of the 576 columns summed,
    no dots;
  - kernels/mla mla_decode at its defaults.

    python3 benchmarks/bandwidth_probe.py --out $OUT/bandwidth_probe.json     # GPU
    python benchmarks/bandwidth_probe.py --smoke --out /tmp/bw.json           # CPU interpreter, tiny shapes
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import (Report, default_out, graph_time, import_k3rt_kernels,  # noqa: E402
                     kernel_bench_args, l2_rotation, start_device)


def _add(p) -> None:
    p.add_argument("--kda-n", type=int, nargs="*", default=[1, 16, 64], help="KDA decode batch sizes")
    p.add_argument("--mla", nargs="*", default=["1x32768", "16x32768", "64x32768", "16x131072"],
                   help="MLA decode cases, BATCHxCONTEXT")
    p.add_argument("--kda-tilings", type=lambda t: tuple(int(x) for x in t.split(",")), nargs="*",
                   default=[(1, 32, 4), (1, 64, 4), (1, 128, 8), (2, 64, 4), (4, 32, 2), (2, 32, 1), (16, 8, 1),
                            (4, 32, 1, 1), (4, 32, 4, 1), (2, 64, 4, 1), (8, 16, 1, 1), (1, 32, 4, 1)],
                   help="more state RMW tilings, SPLIT,BLOCK_V,WARPS[,T] each (programs a head, columns a tile, "
                        "warps; T=1: the state stored value-major, [V, K] a head, so a program's columns are one "
                        "contiguous block)")


ARGS = kernel_bench_args(__doc__, "bandwidth_probe.json", 200.0, _add)
import_k3rt_kernels()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3rt.kernels.kda import kda_decode, kda_decode_workspace  # noqa: E402
from k3rt.kernels.kda.triton_decode import default_block_v, default_num_warps, default_v_split  # noqa: E402
from k3rt.kernels.mla import mla_decode, mla_decode_num_splits  # noqa: E402

SMOKE = ARGS.smoke
DEV = "cpu" if SMOKE else "cuda"
H, D = (2, 16) if SMOKE else (32, 128)
L_RANK, ROPE, PAGE = (32, 16, 48) if SMOKE else (512, 64, 1888)
C = L_RANK + ROPE
BN_READ = 16 if SMOKE else 64


@triton.jit
def _state_rmw_kernel(s_ptr, slot_ptr, stride_slot, k_ptr, o_ptr, D: tl.constexpr, BV: tl.constexpr,
                      BVS: tl.constexpr, REDUCE: tl.constexpr, TRANS: tl.constexpr = False):
    """Program (sequence, head, V slice): its [D, BVS] columns of the head's state in [D, BV] tiles, scaled and
    stored back; REDUCE: also the delta rule's two reductions over the key axis and its rank-1 update. TRANS: the
    head's state read as [V, K] (value-major), so the program's BVS columns are D * BVS contiguous floats instead of
    D rows of BVS."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    H = tl.num_programs(1)
    slot = tl.load(slot_ptr + i_n).to(tl.int64)
    base = s_ptr + slot * stride_slot + i_h.to(tl.int64) * D * D
    offs_k = tl.arange(0, D)
    if REDUCE:
        k = tl.load(k_ptr + (i_n * H + i_h) * D + offs_k)
    for v0 in tl.static_range(0, BVS, BV):
        offs_v = i_v * BVS + v0 + tl.arange(0, BV)
        if TRANS:
            p = base + offs_v[None, :] * D + offs_k[:, None]
        else:
            p = base + offs_k[:, None] * D + offs_v[None, :]
        s = tl.load(p) * 0.999
        if REDUCE:
            kv = tl.sum(s * k[:, None], axis=0)  # k^T S
            s = s + k[:, None] * (kv * 1e-3)[None, :]
            o = tl.sum(s * k[:, None], axis=0)  # S^T q (k standing in for q)
            tl.store(o_ptr + (i_n * H + i_h) * D + offs_v, o)
        tl.store(p, s)


@triton.jit
def _paged_read_kernel(kv_ptr, table_ptr, stride_table, lens_ptr, out_ptr, SPLITS: tl.constexpr, PAGE: tl.constexpr,
                       LR: tl.constexpr, R: tl.constexpr, BN: tl.constexpr):
    """Program (sequence, split): its share of the sequence's BN-token tiles, read through the page table (each
    token's page looked up: a tile may straddle pages), [BN, LR] and [BN, R] summed in fp32; one sum written."""
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(lens_ptr + i_n)
    tiles = tl.cdiv(seq_len, BN)
    per = tl.cdiv(tiles, SPLITS)
    t0 = i_s * per
    t1 = tl.minimum(t0 + per, tiles)
    offs_n = tl.arange(0, BN)
    offs_l = tl.arange(0, LR)
    offs_r = tl.arange(0, R)
    acc_l = tl.zeros([BN, LR], dtype=tl.float32)
    acc_r = tl.zeros([BN, R], dtype=tl.float32)
    for t in range(t0, t1):
        tok = t * BN + offs_n
        ok = tok < seq_len
        page = tl.load(table_ptr + i_n * stride_table + tok // PAGE, mask=ok, other=0).to(tl.int64)
        row = (page * PAGE + tok % PAGE) * (LR + R)
        acc_l += tl.load(kv_ptr + row[:, None] + offs_l[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        acc_r += tl.load(kv_ptr + row[:, None] + LR + offs_r[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + i_n * SPLITS + i_s, tl.sum(tl.sum(acc_l, axis=1), axis=0) + tl.sum(tl.sum(acc_r, axis=1),
                                                                                      axis=0))


def _rotated(fn, n: int) -> list:
    """fn(i) over the n rotated input sets, at least 8 calls (one graph's worth)."""
    return [lambda i=i: fn(i) for i in range(n)] * max(1, -(-8 // n))


def _timed(calls: list, bytes_per_call: int, copy_gbps: float) -> dict:
    t = graph_time(calls, reps=1 if SMOKE else 30, cuda=not SMOKE)
    gbps = bytes_per_call / (t["us_per_call"] * 1e-6) / 1e9
    return {"us": t["us_per_call"], "GBps": gbps, "pct_copy": 100 * gbps / copy_gbps}


def _check_rmw(state: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, o: torch.Tensor, shapes: dict) -> dict:
    """Each RMW shape does what it says (on a copy of the state): scale, or scale + the rank-1 update and o."""
    N = state.shape[0]
    errs = []
    for split, bv, warps, *t in shapes.values():
        trans = bool(t and t[0])
        for reduce in (False, True):
            s = state.clone()
            _state_rmw_kernel[(N, H, split)](s, slots, s.stride(0), k, o, D=D, BV=bv, BVS=D // split, REDUCE=reduce,
                                             TRANS=trans, num_warps=warps)
            if trans:  # the kernel's view: each head's [D, D] block is [V, K]
                s = s.transpose(-1, -2)
                state_kv = state.transpose(-1, -2)
            else:
                state_kv = state
            want = state_kv * 0.999
            if reduce:
                kv = torch.einsum("nhk,nhkv->nhv", k, want)
                want = want + k[..., :, None] * (kv * 1e-3)[..., None, :]
                errs.append(float((o - torch.einsum("nhk,nhkv->nhv", k, want)).abs().max()))
            errs.append(float((s - want).abs().max()))
    return {"max_abs_err": max(errs), "ok": max(errs) < 1e-4}


def _check_read(kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, splits: int, part: torch.Tensor) -> dict:
    """The paged read's sums add up to the sequences' tokens' sum, gathered through the table."""
    N = table.shape[0]
    _paged_read_kernel[(N, splits)](kv, table, table.stride(0), lens, part, SPLITS=splits, PAGE=PAGE, LR=L_RANK,
                                    R=ROPE, BN=BN_READ)
    want = sum(float(kv[table[n]].reshape(-1, C)[:int(lens[n])].float().sum()) for n in range(N))
    got = float(part.double().sum())
    err = abs(got - want) / max(1.0, abs(want))
    return {"rel_err": err, "ok": err < 1e-3}


def kda_items(report: Report, N: int, copy_gbps: float) -> None:
    state_bytes = N * H * D * D * 4
    layers = l2_rotation(2 * state_bytes, cuda=not SMOKE)
    gen = torch.Generator(device=DEV).manual_seed(N)
    states = [torch.randn(N, H, D, D, generator=gen, device=DEV) * 0.1 for _ in range(layers)]
    others = [torch.empty_like(s) for s in states]
    slots = torch.arange(N, dtype=torch.int32, device=DEV)
    k = torch.randn(N, H, D, generator=gen, device=DEV) * 0.1
    o = torch.empty(N, H, D, device=DEV)
    moved = 2 * state_bytes
    report.result.setdefault("kda_floor_us", {})[str(N)] = moved / (copy_gbps * 1e9) * 1e6
    calls = lambda fn: _rotated(fn, layers)  # noqa: E731
    report.item("kda", f"N={N} torch mul_ in place", lambda: {
        "N": N, **_timed(calls(lambda i: states[i].mul_(0.999)), moved, copy_gbps)})
    report.item("kda", f"N={N} torch copy", lambda: {
        "N": N, **_timed(calls(lambda i: others[i].copy_(states[i])), moved, copy_gbps)})
    nv = default_v_split(N, H, D)
    shapes = {"decode's tiles": (nv, min(default_block_v(N, H, nv), D // nv), default_num_warps(D, nv)),
              # fla 0.6.0's fused_recurrent_kda launch: BV = 32, one program per 32 columns, Triton's 4 warps
              "fla's tiles (4 a head, 32 columns, 4 warps)": (4 if not SMOKE else 2, 32 if not SMOKE else 8, 4)}
    # other tilings, no reductions (--kda-tilings; the decode's tiling stopped at 77 % at N = 16 on the H200)
    # and value-major ([V, K] a head: a program's columns one contiguous block), with the reductions
    extra = {f"{t[0]} a head, {t[1]} columns, {t[2]} warps{', value-major' if t[3:] and t[3] else ''}": t
             for t in ARGS.kda_tilings if not SMOKE and D % t[0] == 0 and t[1] <= D // t[0]}
    if SMOKE:  # the value-major form's check on the interpreter
        extra = {"2 a head, 8 columns, 1 warp, value-major": (2, 8, 1, 1)}
    report.item("check", f"N={N} triton rmw", lambda: _check_rmw(states[0], slots, k, o, {**shapes, **extra}))
    for label, (split, bv, warps, *t) in {**shapes, **extra}.items():
        trans = bool(t and t[0])
        for reduce in (False, True) if label in shapes or trans else (False,):
            def rmw(i, split=split, bv=bv, warps=warps, reduce=reduce, trans=trans):
                _state_rmw_kernel[(N, H, split)](states[i], slots, states[i].stride(0), k, o, D=D, BV=bv,
                                                 BVS=D // split, REDUCE=reduce, TRANS=trans, num_warps=warps)
            name = f"N={N} triton rmw, {label}{', two reductions' if reduce else ''}"
            report.item("kda", name, lambda rmw=rmw, split=split, bv=bv, warps=warps, trans=trans: {
                "N": N, "v_split": split, "block_v": bv, "num_warps": warps, "value_major": trans,
                **_timed(calls(rmw), moved, copy_gbps)})
    P = H * D
    dt = torch.bfloat16 if not SMOKE else torch.float32
    qkv = torch.randn(N, 3 * P, generator=gen, device=DEV).to(dt)
    conv_w = torch.randn(3 * P, 4, generator=gen, device=DEV) * 0.3
    convs = [torch.randn(N, 3, 3 * P, generator=gen, device=DEV).to(dt) for _ in range(layers)]
    f = torch.randn(N, P, generator=gen, device=DEV).to(dt)
    a_log = torch.randn(H, generator=gen, device=DEV) * 0.1
    dt_bias = torch.randn(P, generator=gen, device=DEV) * 0.1
    b = torch.randn(N, H, generator=gen, device=DEV).to(dt)
    outs = [torch.empty(N, H, D, dtype=dt, device=DEV) for _ in range(layers)]
    ws = kda_decode_workspace(N, H, DEV)
    report.item("kda", f"N={N} kda_decode (defaults)", lambda: {"N": N, **_timed(calls(
        lambda i: kda_decode(qkv, conv_w, convs[i], f, a_log, dt_bias, b, states[i], slots, out=outs[i],
                             workspace=ws)), moved, copy_gbps)})


def mla_items(report: Report, case: str, copy_gbps: float) -> None:
    N, ctx = (int(x) for x in case.lower().split("x"))
    if SMOKE:
        N, ctx = min(N, 2), min(ctx, 100)
    blocks = -(-ctx // PAGE)
    kv_bytes = N * ctx * C * 2
    rot = l2_rotation(kv_bytes, cuda=not SMOKE)
    gen = torch.Generator(device=DEV).manual_seed(ctx + N)
    dt = torch.bfloat16 if not SMOKE else torch.float32
    num_pages = rot * N * blocks
    kv = torch.empty(num_pages, PAGE, C, dtype=dt, device=DEV).normal_(generator=gen)
    perm = torch.randperm(num_pages, generator=gen, device=DEV).int()
    tables = [perm[r * N * blocks:(r + 1) * N * blocks].view(N, blocks).contiguous() for r in range(rot)]
    lens = torch.full((N,), ctx, dtype=torch.int32, device=DEV)
    flat = [torch.empty(N * ctx * C, dtype=dt, device=DEV).normal_(generator=gen) for _ in range(rot)]
    sums = torch.empty((), dtype=torch.float32, device=DEV)
    calls = lambda fn: _rotated(fn, rot)  # noqa: E731
    report.item("mla", f"{case} torch sum, contiguous", lambda: {
        "case": case, **_timed(calls(lambda r: torch.sum(flat[r], dim=0, dtype=torch.float32, out=sums)), kv_bytes,
                               copy_gbps)})
    splits = mla_decode_num_splits(N, H, ctx)
    part = torch.empty(N * splits, dtype=torch.float32, device=DEV)
    report.item("check", f"{case} triton paged read", lambda: _check_read(kv, tables[0], lens, splits, part))
    for warps in (4, 8):
        def read(r, warps=warps):
            _paged_read_kernel[(N, splits)](kv, tables[r], tables[r].stride(0), lens, part, SPLITS=splits, PAGE=PAGE,
                                            LR=L_RANK, R=ROPE, BN=BN_READ, num_warps=warps)
        report.item("mla", f"{case} triton paged read, {BN_READ}-token tiles, {warps} warps", lambda read=read: {
            "case": case, "num_splits": splits, **_timed(calls(read), kv_bytes, copy_gbps)})
    qs = [torch.randn(N, H, C, generator=gen, device=DEV).to(dt) for _ in range(rot)]
    outs = [torch.empty(N, H, L_RANK, dtype=dt, device=DEV) for _ in range(rot)]
    forms = {"mla_decode (defaults)": {}}
    if not SMOKE:  # the Gluon kernel's layouts (sm_90)
        forms.update({"mla_decode gluon heads": dict(gluon=True, block_n=64, num_stages=2),
                      "mla_decode gluon tokens": dict(gluon=True, block_n=64, num_stages=2, gluon_layout="tokens")})
    for label, tune in forms.items():
        report.item("mla", f"{case} {label}", lambda tune=tune: {"case": case, **_timed(calls(
            lambda r: mla_decode(qs[r], kv, tables[r], lens, C ** -0.5, kv_lora_rank=L_RANK, out=outs[r], **tune)),
            kv_bytes, copy_gbps)})


def main() -> int:
    report = Report(default_out(ARGS.out, "bandwidth_probe.json"), ARGS.budget_s)
    copy_gbps = start_device(report, SMOKE)
    report.log(f"{report.result['device']}: copy {copy_gbps:.0f} GB/s")
    for N in ARGS.kda_n if not SMOKE else [2]:
        kda_items(report, N, copy_gbps)
    for case in ARGS.mla if not SMOKE else ["2x100"]:
        mla_items(report, case, copy_gbps)
    report.save()
    for rec in report.result.get("check", []):
        report.log(f"check {rec['name']}: {rec.get('ok', rec.get('error'))}")
    print(f"\ncopy {copy_gbps:.0f} GB/s ({report.result['device']})\n\n| item | us | GB/s | % of copy |\n|---|---:|---:|---:|")
    for section in ("kda", "mla"):
        for rec in report.result.get(section, []):
            if "us" in rec:
                print(f"| {rec['name']} | {rec['us']:.2f} | {rec['GBps']:.0f} | {rec['pct_copy']:.1f} |")
            else:
                print(f"| {rec['name']} | {rec.get('error') or rec.get('skipped')} | | |")
    report.log(f"wrote {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
