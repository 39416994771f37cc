"""Structured distributions: lazy log-partition, marginals, argmax, entropy, samples."""

from .base import StructuredDistribution
from .dependency import DependencyCRF
from .linear_chain import LinearChainCRF
from .nonprojective import NonProjectiveDependencyCRF

__all__ = [
    "DependencyCRF",
    "LinearChainCRF",
    "NonProjectiveDependencyCRF",
    "StructuredDistribution",
]
