"""Token sampling (torch): the batched Sampler, grammar bitmasks, penalties."""
from k3rt.backend.sampling.bitmask import apply_token_bitmask, unpack_token_bitmask
from k3rt.backend.sampling.sampler import SampleOutput, Sampler, make_generator, sample

__all__ = ["SampleOutput", "Sampler", "apply_token_bitmask", "make_generator", "sample", "unpack_token_bitmask"]
