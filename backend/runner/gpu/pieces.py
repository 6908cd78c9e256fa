"""Piecewise CUDA graphs for steps with prefill rows (issue 18): the forward cut at its attention cores.

An eager step with prefill rows is host-bound (on the H200 at the 48B shape, 64 decodes + a 512-token chunk:
589 launches, the host issuing for 40.7 of a 41.6 ms wall, its kernels 25-33 ms), yet only the attention
cores depend on the step's per-sequence layout. Everything between two cores (the attention output
projection, residual add + norm, the FFN/MoE, the next layer's norm and its attention input projections) is
row-wise, so it is captured once per token-count bucket and replayed; the cores run eagerly between the
pieces, on the step's real rows, exactly as in the eager step. A step of T tokens takes the smallest bucket
Tb >= T:

  piece 0        ids -> embedding, first norm (attention residuals: the first mix), layer 0's input projections
  core i         eager, rows 0..T-1, the step's GpuStep: KDA (`kda_attend`) or MLA (`mla_attend`) on the
                 paged caches -> o
  piece i + 1    layer i's o_proj (+ the all-reduce under TP), add + norm, FFN/MoE, add + norm, layer i+1's
                 input projections; after the last layer the final norm
  logits         eager: the step's logit rows of the final norm's output through lm_head (their count
                 varies per step; one gather and one GEMM)

Every tensor crossing a piece boundary lives in one static buffer per boundary name ([largest bucket, ...],
`Boundary`), shared by every layer of a kind and every bucket: a piece writes rows 0..Tb-1, a core reads and
writes rows 0..T-1. Rows T..Tb-1 are padding: the pieces compute them from stale ids and core outputs of
earlier steps (finite: they were real rows once; the buffers start zeroed), nothing reads them, and the
cores never see them, so padding touches no cache page and no KDA state. All the pieces' graphs share one
memory pool (their intermediates are dead at each piece's end), so graph memory is one piece's intermediates
at the largest bucket plus the boundary buffers.
The pieces hold GEMMs, norms, the attention-residual mix, the MoE router (fixed [T, k] outputs) and the
grouped expert kernels (sized from T and k on the host: the alignment kernel writes a fixed-size block
list), the collectives of tensor parallelism: no host sync and no data-dependent shape, the ops the decode
graphs already capture, at more rows.
Without captured graphs (CPU tests) `run` executes the same pieces eagerly, padding and buffers included,
so the tested path is the replayed one less the capture.
"""

from __future__ import annotations

import logging
import time

import torch

from k3rt.backend.models.attn_res import AttnResStream
from k3rt.backend.runner.gpu.forward import GpuForward
from k3rt.backend.runner.gpu.kda import KdaWeights, kda_attend, kda_project
from k3rt.backend.runner.gpu.mla import mla_attend, mla_output, mla_project
from k3rt.backend.runner.gpu.ops import linear
from k3rt.backend.runner.gpu.step import GpuStep

log = logging.getLogger(__name__)

# token counts of the mixed-step buckets. A step pads up to the next one, so a bucket costs its padding
# rows' compute: negligible at the small end (the step reads every weight whatever its rows), up to 25%
# above 1024 (steps of 4 + 1 per 4 rows there). Sizes above the step's token budget are not captured
# (mixed_buckets_for); steps larger than the largest bucket run eagerly, where the kernels outweigh the
# host's launches anyway (48B shape: an eager step's host issues ~40 ms; a 2K-token step's kernels take
# about that).
DEFAULT_MIXED_BUCKETS = (32, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048,
                         2560, 3072, 4096)


def mixed_buckets_for(max_tokens: int, buckets: tuple[int, ...] = DEFAULT_MIXED_BUCKETS) -> tuple[int, ...]:
    """The buckets a step of at most `max_tokens` tokens (the scheduler's token budget) can take: those below
    it and the first at or above it (None above the largest: those steps run eagerly)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    ordered = sorted(buckets)
    cover = next((b for b in ordered if b >= max_tokens), None)
    return tuple(b for b in ordered if b < max_tokens or b == cover)


class Boundary:
    """The static buffers of the piece boundaries, one per name, [rows, *shape] each, allocated zeroed on first
    use (never during a capture: a graph's pool must not own them)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows, self.device = rows, device
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self.bufs.get(name)
        if buf is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"boundary {name!r}: allocated inside a capture (run the pieces once first)")
            buf = self.bufs[name] = torch.zeros(self.rows, *shape, dtype=dtype, device=self.device)
        elif tuple(buf.shape[1:]) != tuple(shape) or buf.dtype != dtype:
            raise ValueError(f"boundary {name!r}: holds {list(buf.shape[1:])} {buf.dtype}, "
                             f"got {list(shape)} {dtype}")
        return buf

    def put(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """t [n, ...] into rows 0..n-1 of its buffer -> that view (t itself when it is that view already)."""
        view = self.get(name, tuple(t.shape[1:]), t.dtype)[:t.shape[0]]
        if t.data_ptr() == view.data_ptr() and t.stride() == view.stride():
            return t
        return view.copy_(t)


class PiecewiseForward:
    """A GpuForward's forward for steps with prefill rows, cut at the attention cores and padded to buckets
    (module docstring): `run(step)` replays the bucket's pieces when `capture` took them, else runs the same
    pieces eagerly. Every rank of a tensor-parallel engine builds one with the same buckets, so a step's
    pieces (and their collectives) replay identically on each (the workers check the bucket against the one
    rank 0's plan names: GpuModelRunner.run_seqs)."""

    def __init__(self, fwd: GpuForward, buckets: tuple[int, ...]) -> None:
        if not buckets:
            raise ValueError("buckets: at least one token-count bucket")
        self.fwd, self.buckets = fwd, tuple(sorted(buckets))
        device = fwd.pool.tensors[0].device
        self.buf = Boundary(self.buckets[-1], device)
        self.ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)  # rows past T: stale ids
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> its pieces' graphs (num_layers + 1)
        self.runs = self.replays = 0  # steps run piecewise, and of them replayed from graphs (benchmarks, tests)
        # a model drafter's target states (GpuForward.taps): each tapped layer's normalized input is written to a
        # boundary buffer of its own ("tap{i}"; the last one is "final") by the piece that computes it; `run`
        # leaves views of the step's rows here, as GpuForward leaves its `tapped`
        self.tapped: dict[int, torch.Tensor] = {}
        self.num_layers = len(fwd.layers)
        self.res_block = fwd.cfg.attn_res_block_size  # attention residuals (K3): the stream crosses boundaries

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    # ---- the step ----

    @torch.no_grad()
    def run(self, step: GpuStep) -> torch.Tensor:
        """The step's forward -> fp32 logits of its logit rows (this rank's vocabulary slice under TP, as
        GpuForward returns them). The step must fit a bucket. Verify runs in it take the eager step's mixed form
        in the cores (their states left as they were, their commit inputs kept on the step), as in GpuForward."""
        T = step.num_tokens
        n = self.bucket(T)
        if n is None:
            raise ValueError(f"step: {T} tokens, more than the largest bucket {self.buckets[-1]}")
        self.ids[:T].copy_(step.ids)
        step.derived.clear()  # as GpuForward: the cores re-derive what they share (GpuStep.derived)
        graphs = self.graphs.get(n)
        self.runs += 1
        self.replays += graphs is not None
        for j in range(self.num_layers + 1):
            if j:
                self._core(j - 1, step)
            if graphs is not None:
                graphs[j].replay()
            else:
                self._piece(j, n)
        x = self.buf.bufs["final"][:T]
        self.tapped = {i: (x if i == self.num_layers else self.buf.bufs[f"tap{i}"][:T]) for i in self.fwd.taps}
        return self.fwd.logits(x if step.logits_every_row else x[step.logit_rows])

    def _core(self, i: int, step: GpuStep) -> None:
        """Layer i's attention core on the step's real rows: its inputs and output in the boundary buffers."""
        fwd, T = self.fwd, step.num_tokens
        w, attn = fwd.prepared[i], fwd.layers[i].self_attn
        o = self._out(i)[:T]
        if isinstance(w, KdaWeights):
            qkv, gate, f, b = (self.buf.bufs[f"kda.{name}"][:T] for name in ("qkv", "gate", "f", "b"))
            kda_attend(attn, w, qkv, gate, f, b, step, fwd.pool.conv[w.tensor], fwd.pool.rec[w.tensor], fwd.k,
                       decode=False, workspace=fwd.kda_workspace, out=o)
        else:
            q, ckv = self.buf.bufs["mla.q"][:T], self.buf.bufs["mla.ckv"][:T]
            mla_attend(attn, w, q, ckv, step, fwd.pool.mla[w.slot], fwd.k, out=o)

    def _out(self, i: int) -> torch.Tensor:
        """The static buffer of layer i's core output, [rows, H, D] (KDA) or [rows, H, V] (MLA): one per kind."""
        attn, dtype = self.fwd.layers[i].self_attn, self.fwd.model.model.embed_tokens.weight.dtype
        if isinstance(self.fwd.prepared[i], KdaWeights):
            return self.buf.get("kda.o", (attn.num_heads, attn.head_dim), dtype)
        return self.buf.get("mla.o", (attn.num_heads, attn.cfg.v_head_dim), dtype)

    # ---- the pieces: everything between two cores, over rows 0..n-1 ----

    @torch.no_grad()
    def _piece(self, j: int, n: int) -> None:
        """Piece j (0: before layer 0's core; j: after layer j-1's) over n rows, boundary buffers in and out."""
        fwd, eps, L = self.fwd, self.fwd.cfg.rms_norm_eps, self.num_layers
        m = fwd.model.model
        if not self.res_block:
            if j == 0:
                h = self.buf.put("h", m.embed_tokens(self.ids[:n]))
                x = fwd.norm(h, fwd.layers[0].input_layernorm.weight, eps)
            else:
                i, layer = j - 1, fwd.layers[j - 1]
                h = self.buf.bufs["h"][:n]
                x, h = fwd.add_norm(self._o_proj(i, n), h, layer.post_attention_layernorm.weight, eps)
                nxt = fwd.layers[j].input_layernorm.weight if j < L else m.norm.weight
                x, h = fwd.ffn_add_norm(i, x, h, nxt, eps)
                self.buf.put("h", h)
        else:
            if j == 0:
                stream = AttnResStream(m.embed_tokens(self.ids[:n]), self.res_block)
            else:
                i, layer = j - 1, fwd.layers[j - 1]
                stream = self._load_stream(i, n)
                stream.add(self._o_proj(i, n))
                x = fwd.mix(stream, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps,
                            then_norm=layer.post_attention_layernorm.weight)
                stream.add(fwd.ffn(i, x))
            if j < L:
                layer = fwd.layers[j]
                x = fwd.mix(stream, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, eps,
                            then_norm=layer.input_layernorm.weight)
                stream.begin_layer(j)
                self._save_stream(stream)
            else:
                x = fwd.mix(stream, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, eps,
                            then_norm=m.norm.weight)
        if j < L:
            if j in fwd.taps:
                self.buf.put(f"tap{j}", x)
            self._project(j, x)
        else:
            self.buf.put("final", x)

    def _project(self, i: int, x: torch.Tensor) -> None:
        fwd = self.fwd
        w, attn = fwd.prepared[i], fwd.layers[i].self_attn
        if isinstance(w, KdaWeights):
            for name, t in zip(("qkv", "gate", "f", "b"), kda_project(attn, w, x, fwd.k)):
                self.buf.put(f"kda.{name}", t)
        else:
            q, ckv, gate = mla_project(attn, w, x, fwd.k)
            self.buf.put("mla.q", q)
            self.buf.put("mla.ckv", ckv)
            if gate is not None:
                self.buf.put("mla.gate", gate)

    def _o_proj(self, i: int, n: int) -> torch.Tensor:
        """Layer i's attention output through o_proj (and the output gate), reduced over the ranks."""
        fwd = self.fwd
        w, attn = fwd.prepared[i], fwd.layers[i].self_attn
        o = self._out(i)[:n]
        if isinstance(w, KdaWeights):
            y = linear(o.reshape(n, -1), attn.o_proj.weight, fwd.k)
        else:
            y = mla_output(attn, o, self.buf.bufs["mla.gate"][:n] if attn.cfg.use_output_gate else None, fwd.k)
        return fwd.tp.all_reduce(y)

    def _save_stream(self, stream: AttnResStream) -> None:
        for b, block in enumerate(stream.blocks):
            self.buf.put(f"res.block{b}", block)
        if stream.prefix is not None:
            self.buf.put("res.prefix", stream.prefix)

    def _load_stream(self, i: int, n: int) -> AttnResStream:
        """The residual stream as piece i left it (before layer i's core): blocks 0..i // block_size, and a
        running prefix unless layer i opened a block (GpuForward.__call__'s order)."""
        stream = AttnResStream(None if i % self.res_block == 0 else self.buf.bufs["res.prefix"][:n], self.res_block)
        stream.blocks = [self.buf.bufs[f"res.block{b}"][:n] for b in range(i // self.res_block + 1)]
        return stream

    # ---- capture ----

    @torch.no_grad()
    def capture(self, pool) -> None:
        """Capture every bucket's pieces (largest first), sharing the memory pool `pool`, with a progress bar;
        the time and memory they took are logged."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        reserved0 = torch.cuda.memory_reserved(self.buf.device)
        for j in range(self.num_layers + 1):  # the boundary buffers, allocated outside any capture and side stream
            self._piece(j, self.buckets[-1])
        bar = tqdm(sorted(self.buckets, reverse=True), desc="capturing mixed-step graphs", unit="bucket", leave=False,
                   disable=None)  # a terminal's bar only: the log line after it reports the capture
        for n in bar:
            bar.set_postfix_str(f"{n} tokens, {self.num_layers + 1} pieces")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile and autotune outside the capture
                    for j in range(self.num_layers + 1):
                        self._piece(j, n)
            torch.cuda.current_stream().wait_stream(side)
            graphs = []
            for j in range(self.num_layers + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._piece(j, n)
                graphs.append(g)
            self.graphs[n] = graphs
        torch.cuda.synchronize()
        boundary = sum(b.numel() * b.element_size() for b in self.buf.bufs.values())
        log.info("captured mixed-step graphs for %d buckets (%d to %d tokens, %d pieces each) in %.1f s, "
                 "%.2f GiB of device memory (%.2f GiB of it boundary buffers)", len(self.graphs), min(self.graphs),
                 max(self.graphs), self.num_layers + 1, time.perf_counter() - t0,
                 (torch.cuda.memory_reserved(self.buf.device) - reserved0) / 2**30, boundary / 2**30)
