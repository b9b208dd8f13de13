"""Speculative decoding: proposers of draft tokens (host side, no JAX).

Verification is part of the normal step (`runner/`): a sequence with k proposals
schedules 1 + k query tokens, the sampler accepts or rejects each (rejection
sampling, exact for the target distribution) and the scheduler rolls the
sequence back past the first rejection.
"""

from jaxserve.spec.ngram import NgramProposer

__all__ = ["NgramProposer"]
