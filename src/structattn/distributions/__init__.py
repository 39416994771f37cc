"""Structured distributions: lazy log-partition, marginals, argmax, entropy, samples; the
structured loss and the tree helpers a parser needs."""

from ..trees import is_projective, projectivize  # no dynamic program: structattn.trees
from .base import StructuredDistribution
from .dependency import DependencyCRF
from .linear_chain import LinearChainCRF
from .loss import structured_nll
from .nonprojective import NonProjectiveDependencyCRF

__all__ = [
    "DependencyCRF",
    "LinearChainCRF",
    "NonProjectiveDependencyCRF",
    "StructuredDistribution",
    "is_projective",
    "projectivize",
    "structured_nll",
]
