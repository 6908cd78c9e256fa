#!/usr/bin/env python3
"""One token's MLA layer at the Kimi-Linear-48B's shape (32 heads, L 512, R 64, P = V = 128, hidden 2304, bf16,
--context tokens of cache): the runner's separate launches against kernels/mla/triton_layer.py's two persistent
launches around the same `mla_decode`.

GPU mode (default), one H200-class GPU:
  1. the copy bandwidth (bytes read + written of a 1 GiB copy);
  2. the separate path as the runner runs a batch-1 decode's MLA layer: the fused input projection on cuBLAS (torch
     F.linear), `mla_store_latent`, the absorb product and the concatenation, `mla_decode` (split and combine), the
     W_UV product, o_proj through the skinny GEMV, kernels/norm's add + norm;
  3. `mla_pre_one_token` + `mla_decode` + `mla_post_one_token`, checked against the separate path first (outputs and
     the cache row written), and its phased form;
each timed as one call replayed from a CUDA graph over layers rotated past the L2. Floor = (w_in + W_UK + W_UV +
o_proj + the context's latents) / copy. A table goes to stdout, all numbers to JSON ($OUT/mla_layer.json, or --out).

--smoke: a tiny CPU run under the Triton interpreter (no meaningful times) so CI notices rot.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_bench_args  # noqa: E402


def _add_args(p) -> None:
    p.add_argument("--context", type=int, default=4096, help="cached tokens the decode reads (the 48B step's 4K)")


ARGS = kernel_bench_args(__doc__, "mla_layer.json", 120.0, _add_args)

from _timing import (  # noqa: E402
    Report, default_out, finish_layer_report, floor_timed, import_k3rt_kernels, l2_rotation, persistent_forms,
    rel_err, start_device,
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.linear import skinny_linear  # noqa: E402
from k3rt.kernels.mla import mla_decode, mla_store_latent  # noqa: E402
from k3rt.kernels.mla import triton_layer as L  # noqa: E402
from k3rt.kernels.norm import rms_norm  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
DT = torch.float32 if ARGS.smoke else torch.bfloat16
H, P, R, LAT, V, HID, BLOCK = (2, 16, 16, 32, 16, 48, 16) if ARGS.smoke else (32, 128, 64, 512, 128, 2304, 64)
CTX = 40 if ARGS.smoke else ARGS.context
NQ = H * (P + R)
REPS = 2 if ARGS.smoke else 30
REPORT = Report(default_out(ARGS.out, "mla_layer.json"), ARGS.budget_s,
                {"mode": "smoke" if ARGS.smoke else "gpu", "shape": dict(H=H, P=P, R=R, L=LAT, V=V, hidden=HID,
                                                                          context=CTX)})
RESULT, item, log, save = REPORT.result, REPORT.item, REPORT.log, REPORT.save


def make_layer(seed: int) -> dict:
    """One layer's weights, its paged cache (CTX - 1 tokens there, the new one's row written by the step), input and
    residual."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=DEV) * scale  # noqa: E731
    pages = -(-CTX // BLOCK)
    kv_b = r(H * (P + V), LAT, scale=LAT ** -0.5).to(DT)
    w = kv_b.view(H, P + V, LAT)
    return dict(x=r(1, HID).to(DT), w_in=r(NQ + LAT + R, HID, scale=HID ** -0.5).to(DT), kv_b=kv_b,
                w_uk=w[:, :P].contiguous(), w_uk_t=w[:, :P].transpose(1, 2).contiguous(),
                w_uv_t=w[:, P:].transpose(1, 2).contiguous(), kv_norm=(r(LAT).abs() + 0.5).to(DT),
                kv_pages=r(pages, BLOCK, LAT + R).to(DT),
                table=torch.randperm(pages, generator=g if DEV == "cpu" else None, device=DEV).int()[None],
                ctx=torch.tensor([CTX], dtype=torch.int32, device=DEV),
                o_proj=r(HID, H * V, scale=(H * V) ** -0.5).to(DT),
                residual=r(1, HID).to(DT), norm_weight=(r(HID).abs() + 0.5).to(DT))


def slot(c: dict) -> torch.Tensor:
    """The new token's cache row: position CTX - 1 through the table."""
    pos = CTX - 1
    return (c["table"][0, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(1)


def separate(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's batch-1 decode of the layer (backend/runner/gpu/mla.py, forward.add_norm), launch by launch."""
    proj = F.linear(c["x"], c["w_in"])
    mla_store_latent(proj[:, NQ:NQ + LAT + R], c["kv_norm"], 1e-6, c["kv_pages"].view(-1, LAT + R), slot(c),
                     kv_lora_rank=LAT)
    q = proj[:, :NQ].view(1, H, P + R)
    q_lat = torch.bmm(q[..., :P].transpose(0, 1), c["w_uk"]).transpose(0, 1)
    o_lat = mla_decode(torch.cat([q_lat, q[..., P:]], dim=-1), c["kv_pages"], c["table"], c["ctx"], (P + R) ** -0.5,
                       kv_lora_rank=LAT)
    o = torch.bmm(o_lat.transpose(0, 1), c["w_uv_t"]).transpose(0, 1)
    return rms_norm(skinny_linear(o.reshape(1, H * V), c["o_proj"]), c["norm_weight"], 1e-6, residual=c["residual"])


def persistent(c: dict, sync: torch.Tensor, phased: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    qcat = L.mla_pre_one_token(c["x"], c["w_in"], c["kv_norm"], 1e-6, c["kv_pages"].view(-1, LAT + R), slot(c),
                               c["w_uk_t"], sync, qk_rope_head_dim=R, phased=phased)
    o_lat = mla_decode(qcat, c["kv_pages"], c["table"], c["ctx"], (P + R) ** -0.5, kv_lora_rank=LAT)
    return L.mla_post_one_token(o_lat, c["kv_b"], c["o_proj"], c["residual"], c["norm_weight"], 1e-6, sync,
                                qk_nope_head_dim=P, phased=phased)


def main() -> None:
    bw = start_device(REPORT, ARGS.smoke)
    layer_bytes = ((NQ + LAT + R) * HID + 2 * H * P * LAT + HID * H * V + CTX * (LAT + R)) * DT.itemsize
    floor_us = layer_bytes / (bw * 1e9) * 1e6
    layers = [make_layer(seed) for seed in range(l2_rotation(layer_bytes))]
    sync = torch.zeros(L.MLA_LAYER_SYNC_WORDS, dtype=torch.int32, device=DEV)
    base = {"layer_bytes": layer_bytes, "floor_us": floor_us, "rotation": len(layers)}
    log(f"copy {bw:.0f} GB/s, layer {layer_bytes / 1e6:.1f} MB with {CTX} cached tokens, floor {floor_us:.2f} us")

    def check(tiles, phased) -> dict:
        a = {k: v.clone() for k, v in layers[0].items()}
        b = {k: v.clone() for k, v in layers[0].items()}
        want, want_h = separate(a)
        got, got_h = persistent(b, sync, phased)
        err = max(rel_err(got, want), rel_err(got_h, want_h), rel_err(b["kv_pages"].float(), a["kv_pages"].float()))
        return {"rel_err": err, "ok": err <= (1e-4 if ARGS.smoke else 1e-2) and not bool(sync.any())}

    item("layer", "separate (9 launches)", lambda: floor_timed(separate, layers, REPS, base))
    # one form: the kernels take no tile options (kernels/mla/triton_layer.py ROWS, NUM_WARPS, PER_SM)
    persistent_forms(REPORT, "layer", [None], None, "phased (6 launches)", check,
                     lambda tiles, phased: floor_timed(lambda c: persistent(c, sync, phased), layers, REPS, base),
                     ARGS.smoke)
    finish_layer_report(REPORT, int(sync[L.STALLED.value]))


if __name__ == "__main__":
    main()
