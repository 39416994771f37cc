"""Structured distributions: lazy log-partition, marginals, argmax, entropy, samples; the
structured loss and the tree helpers a parser needs."""

from ..trees import is_projective, projectivize  # no dynamic program: structattn.trees
from .base import StructuredDistribution
from .constituency import TreeCRF
from .dependency import DependencyCRF, LabelledHeads
from .linear_chain import LinearChainCRF
from .loss import structured_nll
from .nonprojective import NonProjectiveDependencyCRF
from .second_order import SecondOrderDependencyCRF
from .semi_markov import SemiMarkovCRF
from .split_tree import SplitTreeDistribution

__all__ = [
    "DependencyCRF",
    "LabelledHeads",
    "LinearChainCRF",
    "NonProjectiveDependencyCRF",
    "SecondOrderDependencyCRF",
    "SemiMarkovCRF",
    "SplitTreeDistribution",
    "StructuredDistribution",
    "TreeCRF",
    "is_projective",
    "projectivize",
    "structured_nll",
]
