"""Structured distributions: lazy log-partition, marginals, argmax, entropy, samples."""

from .base import StructuredDistribution
from .dependency import DependencyCRF
from .linear_chain import LinearChainCRF

__all__ = ["DependencyCRF", "LinearChainCRF", "StructuredDistribution"]
