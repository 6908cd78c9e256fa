"""On-device batch sampling: penalties, grammar bitmask, temperature, top-k/min-p/top-p, seeded draw.

`ref` (process_logits, filter_logits, sampling_probs, logprobs) is the torch oracle, imported eagerly;
the Triton-backed `sample` (sampler.py) and its `SampleResult` are exported lazily, so importing the
reference never imports Triton.
"""
from k3rt.kernels.lazy import lazy_exports
from k3rt.kernels.sampling.ref import filter_logits, is_greedy, logprobs, process_logits, sampling_probs

_TRITON_EXPORTS = {
    "sample": "k3rt.kernels.sampling.sampler",
    "SampleResult": "k3rt.kernels.sampling.sampler",
    "filter_thresholds": "k3rt.kernels.sampling.sampler",
}

__all__ = ["SampleResult", "filter_logits", "filter_thresholds", "is_greedy", "logprobs", "process_logits",
           "sample", "sampling_probs"]

__getattr__ = lazy_exports(__name__, _TRITON_EXPORTS)
