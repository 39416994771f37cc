"""Structured distributions: lazy log-partition, marginals, argmax, entropy, samples, KL
divergence and cross-entropy; the structured loss and the tree helpers a parser needs."""

from ..trees import is_projective, projectivize  # no dynamic program: structattn.trees
from .base import StructuredDistribution
from .constituency import TreeCRF
from .dependency import DependencyCRF, LabelledHeads
from .divergence import cross_entropy, kl_divergence
from .linear_chain import LinearChainCRF
from .loss import structured_nll
from .nonprojective import NonProjectiveDependencyCRF
from .second_order import SecondOrderDependencyCRF
from .semi_markov import SemiMarkovCRF
from .sparsemap import SparseMAPResult, sparsemap
from .split_tree import SplitTreeDistribution

__all__ = [
    "DependencyCRF",
    "LabelledHeads",
    "LinearChainCRF",
    "NonProjectiveDependencyCRF",
    "SecondOrderDependencyCRF",
    "SemiMarkovCRF",
    "SparseMAPResult",
    "SplitTreeDistribution",
    "StructuredDistribution",
    "TreeCRF",
    "cross_entropy",
    "is_projective",
    "kl_divergence",
    "projectivize",
    "sparsemap",
    "structured_nll",
]
