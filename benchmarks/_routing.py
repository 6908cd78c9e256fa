"""Which routed experts a step reads: shared by the benchmarks that count the bytes a step must move."""

from __future__ import annotations

import torch


def distinct_experts(runner, step) -> list[int]:
    """Distinct routed experts each MoE layer reads for this step (one eager forward in the step's own form,
    routing recorded: the routing kernels (any form, the one-token layer's too) on the GPU, the torch router on the
    CPU path). A decode step packed the way the graphs are (no chunk tables) must run in the decode form: the chunked
    KDA kernel needs the tables."""
    import k3rt.backend.runner.gpu.ffn as ffn

    seen: list[int] = []
    E = runner.fwd.cfg.moe.num_experts if runner.fwd.cfg.moe is not None else 0
    real_kernel, real_route = ffn.kernel, ffn.route

    def count(ids: torch.Tensor) -> None:
        seen.append(int((ids.unique() < E).sum()))  # the shared experts' extra slots are dense weights

    def recording(module: str, name: str):
        fn = real_kernel(module, name)
        if module != "moe" or name not in ("moe_route", "moe_route_from_x", "moe_layer_one_token") or fn is None:
            return fn

        def routed(*a, **kw):
            res = fn(*a, **kw)
            count(res[-1])  # (weights, ids), or the one-token layer's (out, weights, ids)
            return res
        return routed

    def torch_route(*a, **kw):
        w, ids = real_route(*a, **kw)
        count(ids)
        return w, ids

    ffn.kernel, ffn.route = recording, torch_route
    try:
        runner.fwd(step, decode=step.decode_only)
    finally:
        ffn.kernel, ffn.route = real_kernel, real_route
    return seen
