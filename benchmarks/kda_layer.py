#!/usr/bin/env python3
"""One token's KDA layer at the Kimi-Linear-48B's shape (H 32, D 128, hidden 2304, bf16): the runner's separate
launches against kernels/kda/triton_layer.py's one persistent launch.

GPU mode (default), one H200-class GPU:
  1. the copy bandwidth (bytes read + written of a 1 GiB copy);
  2. the separate path as the runner runs a batch-1 decode's KDA layer: the fused input projection and the low-rank
     gates' up-projection on cuBLAS (torch F.linear: wider than the skinny GEMV's 4,096 outputs), `kda_decode` with
     the gated output norm, o_proj through the skinny GEMV, kernels/norm's add + norm;
  3. `kda_layer_one_token` at each KdaLayerTiles candidate, checked against the separate path first (outputs, the
     state and conv window it leaves), and its phased form (four launches);
each timed as one call replayed from a CUDA graph over layers rotated past the L2 (every call reads cold weights and
states). Floor = (w_in + w_up's diagonal blocks + o_proj + the state read and written + the conv window) / copy.
A table goes to stdout, all numbers to JSON ($OUT/kda_layer.json, or --out).

--smoke: a tiny CPU run under the Triton interpreter (no meaningful times) so CI notices rot.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import kernel_bench_args  # noqa: E402

ARGS = kernel_bench_args(__doc__, "kda_layer.json", 150.0)

from _timing import (  # noqa: E402
    Report, default_out, finish_layer_report, floor_timed, import_k3rt_kernels, l2_rotation, persistent_forms,
    rel_err, start_device,
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import_k3rt_kernels()
from k3rt.kernels.kda import kda_decode  # noqa: E402
from k3rt.kernels.kda import triton_layer as L  # noqa: E402
from k3rt.kernels.kda.triton_decode import kda_decode_workspace  # noqa: E402
from k3rt.kernels.linear import skinny_linear  # noqa: E402
from k3rt.kernels.norm import rms_norm  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
DT = torch.float32 if ARGS.smoke else torch.bfloat16
H, D, HID, W = (2, 16, 48, 4) if ARGS.smoke else (32, 128, 2304, 4)
P = H * D
REPS = 2 if ARGS.smoke else 30
REPORT = Report(default_out(ARGS.out, "kda_layer.json"), ARGS.budget_s,
                {"mode": "smoke" if ARGS.smoke else "gpu", "shape": dict(H=H, D=D, hidden=HID, W=W)})
RESULT, item, log, save = REPORT.result, REPORT.item, REPORT.log, REPORT.save


def make_layer(seed: int) -> dict:
    """One layer's weights, a 2-slot state and conv pool (slot 1 read and written), its input and residual."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=DEV) * scale  # noqa: E731
    w_up = torch.zeros(2 * P, 2 * D, device=DEV)
    w_up[:P, :D], w_up[P:, D:] = r(P, D, scale=D ** -0.5), r(P, D, scale=D ** -0.5)
    rows = 3 * P + 2 * D + H
    return dict(x=r(1, HID).to(DT), w_in=r(rows + (-rows) % 64, HID, scale=HID ** -0.5).to(DT), w_up=w_up.to(DT),
                conv_weight=r(3 * P, W, scale=0.5), conv_pool=r(2, W - 1, 3 * P).to(DT), A_log=r(H, scale=0.5),
                dt_bias=r(P, scale=0.5), state_pool=r(2, H, D, D, scale=0.1),
                slot=torch.tensor([1], device=DEV), o_norm_weight=(r(D).abs() + 0.5).to(DT),
                o_proj=r(HID, P, scale=P ** -0.5).to(DT), residual=r(1, HID).to(DT),
                norm_weight=(r(HID).abs() + 0.5).to(DT))


def separate(c: dict, workspace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's batch-1 decode of the layer (backend/runner/gpu/kda.py, forward.add_norm), launch by launch."""
    proj = F.linear(c["x"], c["w_in"])
    gate, f = F.linear(proj[:, 3 * P:3 * P + 2 * D], c["w_up"]).split(P, dim=-1)
    o = kda_decode(proj[:, :3 * P], c["conv_weight"], c["conv_pool"], f, c["A_log"], c["dt_bias"],
                   proj[:, 3 * P + 2 * D:3 * P + 2 * D + H], c["state_pool"], c["slot"], o_gate=gate.reshape(1, H, D),
                   o_norm_weight=c["o_norm_weight"], o_norm_eps=1e-5, workspace=workspace)
    y = skinny_linear(o.reshape(1, P), c["o_proj"])
    return rms_norm(y, c["norm_weight"], 1e-6, residual=c["residual"])


def persistent(c: dict, sync: torch.Tensor, tiles=None, phased=None) -> tuple[torch.Tensor, torch.Tensor]:
    return L.kda_layer_one_token(**c, sync=sync, o_norm_eps=1e-5, eps=1e-6, tiles=tiles, phased=phased)


def main() -> None:
    bw = start_device(REPORT, ARGS.smoke)
    e = DT.itemsize
    layer_bytes = ((3 * P + 2 * D + H) * HID + 2 * P * D + HID * P) * e + 2 * H * D * D * 4 + 2 * (W - 1) * 3 * P * e
    floor_us = layer_bytes / (bw * 1e9) * 1e6
    layers = [make_layer(seed) for seed in range(l2_rotation(layer_bytes))]
    workspace = kda_decode_workspace(1, H, torch.device(DEV))
    sync = torch.zeros(L.kda_layer_sync_words(H), dtype=torch.int32, device=DEV)
    base = {"layer_bytes": layer_bytes, "floor_us": floor_us, "rotation": len(layers)}
    log(f"copy {bw:.0f} GB/s, layer {layer_bytes / 1e6:.1f} MB, floor {floor_us:.2f} us")

    def check(tiles, phased) -> dict:
        a = {k: v.clone() for k, v in layers[0].items()}
        b = {k: v.clone() for k, v in layers[0].items()}
        want, want_h = separate(a, workspace)
        got, got_h = persistent(b, sync, tiles, phased)
        err = max(rel_err(got, want), rel_err(got_h, want_h), rel_err(b["state_pool"], a["state_pool"]),
                  rel_err(b["conv_pool"].float(), a["conv_pool"].float()))
        return {"rel_err": err, "ok": err <= (1e-4 if ARGS.smoke else 1e-2) and not bool(sync.any())}

    item("layer", "separate (5 launches)", lambda: floor_timed(lambda c: separate(c, workspace), layers, REPS, base))
    persistent_forms(
        REPORT, "layer", L.CANDIDATES, L.KDA_LAYER_TILES, "phased (4 launches)", check,
        lambda tiles, phased: floor_timed(lambda c: persistent(c, sync, tiles, phased), layers, REPS, base), ARGS.smoke)
    finish_layer_report(REPORT, int(sync[L.STALLED.value]))


if __name__ == "__main__":
    main()
