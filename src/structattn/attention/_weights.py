"""The ``weights`` option of the structured attention layers (#41 item 7): what a layer takes
of its CRF as attention weights.

* ``"marginals"`` (default): the CRF's marginals, dense and smooth;
* ``"sparse"``: SparseMAP's marginals (:mod:`structattn.distributions.sparsemap`), a convex
  combination of few structures, differentiable (closed-form backward);
* ``"hard-st"``: the MAP structure's 0/1 indicators forward and the marginals' gradient
  backward (straight-through).

Each has the shape of the distribution's ``marginals``, so a layer swaps one for another
without reshaping; for labelled structures (dependency trees with [B, N, N, L] arc scores,
labelled ``TreeCRF``) that is the labelled parts: SparseMAP projects the labelled arcs
(spans) and ``"hard-st"`` gives the labelled MAP structure's indicators.
"""

from __future__ import annotations

from torch import Tensor

from ..distributions.base import StructuredDistribution
from ..names import WEIGHT_KINDS, WeightKind

__all__ = ["check_weights", "structured_weights"]


def check_weights(weights: object) -> WeightKind:
    """``weights`` if it is one of :data:`structattn.names.WEIGHT_KINDS`, else ValueError."""
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"`weights` must be one of {WEIGHT_KINDS}, got {weights!r}")
    return weights


def structured_weights(dist: StructuredDistribution, weights: WeightKind) -> Tensor:
    """The attention weights of ``dist`` under the ``weights`` option, the shape of its
    ``marginals``."""
    if weights == "marginals":
        return dist.marginals  # type: ignore[attr-defined]
    if weights == "sparse":
        return dist.sparsemap().marginals
    return dist.straight_through()
