"""Token sampling on the reference path (torch)."""
from k3rt.backend.sampling.sampler import sample

__all__ = ["sample"]
