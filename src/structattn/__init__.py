"""structattn: structured attention for PyTorch.

Inference core (exact where the papers are exact): :class:`LinearChainCRF`,
:class:`DependencyCRF` (projective, Eisner), :class:`NonProjectiveDependencyCRF`
(matrix-tree theorem) and :func:`mean_field_marginals` (fully connected binary CRF).
"""

from .distributions import DependencyCRF, LinearChainCRF, StructuredDistribution
from .structs.mean_field import mean_field_free_energy, mean_field_marginals

__all__ = [
    "DependencyCRF",
    "LinearChainCRF",
    "StructuredDistribution",
    "mean_field_free_energy",
    "mean_field_marginals",
]
__version__ = "0.1.0"
