"""k3rt: an inference runtime for the Kimi hybrid family (KDA + MLA + MoE/LatentMoE).

`import k3rt` stays light: it never imports torch (a DSL client needs neither torch nor a GPU).
Engine code lives in `k3rt.backend` and is imported only by what starts an engine.
"""

from k3rt.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["SamplingParams", "__version__"]
