r"""Normalisers: attention scores -> weights, written once and used by every layer.

:data:`NORMALIZERS` maps a name to a :class:`Normalizer` record (its function and what it
needs of the masks). :class:`~structattn.attention.SegmentationAttention`,
:class:`~structattn.attention.SyntacticAttention`,
:class:`~structattn.attention.MeanFieldAttention` and
:class:`~structattn.attention.StructuredMultiheadAttention` all call these functions.

Shapes: ``*`` is any batch of independent problems (e.g. ``[B, H]`` or ``[B]``), Q the
queries and N the keys (memory positions).

* ``softmax``: p = softmax(s) over the allowed keys;
* ``sigmoid``: p_i = sigmoid(s_i) (independent Bernoulli selection);
* ``segmentation``: p_i = p(z_i = 1) of a 2-state linear-chain CRF over the keys with
  unary s_i (state 1) and 2x2 transitions (Kim et al. 2017, sec. 3.2);
* ``projective`` / ``non-projective``: arc marginals of a dependency CRF (Eisner /
  matrix-tree), for self-attention: key h of query m gets p(h is the head of m);
* ``mean-field``: expected spins after k mean-field updates with unary s and couplings J;
* ``constituency`` / ``semi-markov``: self-attention over spans: span [i, j] scores s[i, j],
  one constituency-tree CRF / semi-Markov CRF over the keys, and key k of query q gets the
  expected normalised membership of k in q's constituents / segment
  (:func:`~structattn.attention.spans.span_self_attention_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..distributions import DependencyCRF, LinearChainCRF
from ..distributions.base import StructuredDistribution
from ..names import Structure, TreeStructure, WeightKind
from ..structs.dependency import eisner_marginals
from ..structs.mean_field import mean_field_marginals
from ._common import masked_softmax
from ._spans import span_self_attention_weights
from ._weights import structured_weights

__all__ = [
    "NORMALIZERS",
    "Normalizer",
    "mean_field_weights",
    "segmentation_crf",
    "segmentation_weights",
    "self_attention_tree_weights",
    "sigmoid_weights",
    "softmax_weights",
    "tree_distribution",
    "tree_marginals",
]


def softmax_weights(scores: Tensor, mask: Tensor) -> Tensor:
    """scores [*, Q, N], mask broadcastable to them (True = allowed) -> softmax weights
    (0 where not allowed; rows with nothing allowed are 0)."""
    return masked_softmax(scores, mask)


def sigmoid_weights(scores: Tensor, mask: Tensor) -> Tensor:
    """scores [*, Q, N], mask broadcastable (True = allowed) -> sigmoid(scores), 0 elsewhere."""
    return torch.sigmoid(scores).masked_fill(~mask, 0.0)


def segmentation_crf(scores: Tensor, lengths: Tensor, transitions: Tensor) -> LinearChainCRF:
    """One 2-state chain per row of ``scores`` [*, N] over its first ``lengths`` [*] >= 1
    positions; ``transitions`` [2, 2] (shared) or [*, 2, 2] (one matrix per chain, may be a
    broadcast view). theta_i(0) = 0, theta_i(1) = scores_i. Batch of the CRF: prod(*)."""
    n = scores.shape[-1]
    on = scores.reshape(-1, n)  # [C, N], C chains
    chains = on.shape[0]
    # theta_i(0) = 0, theta_i(1) = score; a product rather than a stack, so that the gradient
    # of the scores is contiguous (bmm is several times slower on strided ones)
    unary = on.unsqueeze(-1) * on.new_tensor([0.0, 1.0])  # [C, N, 2]
    pairwise = transitions.to(on.dtype)
    if pairwise.dim() > 2:  # one matrix per chain, the same at every step: [C, N-1, 2, 2]
        pairwise = pairwise.expand(*scores.shape[:-1], 2, 2).reshape(chains, 1, 2, 2)
        pairwise = pairwise.expand(chains, n - 1, 2, 2)  # n = 1: [C, 0, 2, 2]
    return LinearChainCRF(unary, pairwise, lengths.reshape(chains), validate_args=False)


def segmentation_weights(
    scores: Tensor, lengths: Tensor, transitions: Tensor, weights: WeightKind = "marginals"
) -> Tensor:
    """p(z_i = 1), [*, N] (0 beyond each chain's length); arguments as
    :func:`segmentation_crf`; ``weights`` "sparse" / "hard-st": SparseMAP's / the Viterbi
    path's (straight-through) z_i = 1 instead of the marginals (:mod:`._weights`)."""
    crf = segmentation_crf(scores, lengths, transitions)
    if weights == "marginals":
        node = crf.marginals
    else:
        node = structured_weights(crf, weights)
    # contiguous, as bmm is several times slower on a strided matrix
    return node[..., 1].contiguous().reshape(scores.shape)


def tree_distribution(
    arc_scores: Tensor, lengths: Tensor, kind: TreeStructure, multiroot: bool = True
) -> StructuredDistribution:
    """The dependency CRF of arc scores [B, N', N'] (``[h, m]``: h heads m, ROOT at 0) and
    lengths [B] (ROOT included): ``kind`` "projective" (Eisner) or "non-projective"
    (matrix-tree)."""
    if kind == "projective":
        return DependencyCRF(arc_scores, lengths, multiroot, validate_args=False)
    if kind == "non-projective":
        from ..distributions.nonprojective import NonProjectiveDependencyCRF

        return NonProjectiveDependencyCRF(arc_scores, lengths, multiroot, validate_args=False)
    raise ValueError(f"tree `kind` must be 'projective' or 'non-projective', got {kind!r}")


def tree_marginals(
    arc_scores: Tensor,
    lengths: Tensor,
    kind: TreeStructure,
    multiroot: bool = True,
    weights: WeightKind = "marginals",
) -> Tensor:
    """Arc marginals p(h -> m) [*, N', N'] of arc scores [*, N', N'] (ROOT at 0) with
    lengths [*] (ROOT included); see :func:`tree_distribution`. ``weights`` "sparse" /
    "hard-st": SparseMAP's arcs / the MAP tree's arcs (straight-through) instead."""
    n = arc_scores.shape[-1]
    flat = arc_scores.reshape(-1, n, n)  # [B', N', N']
    dist = tree_distribution(flat, lengths.reshape(-1), kind, multiroot)
    return structured_weights(dist, weights).reshape(arc_scores.shape)


def self_attention_tree_weights(
    scores: Tensor,
    root_scores: Tensor,
    lengths: Tensor,
    kind: TreeStructure,
    weights: WeightKind = "marginals",
) -> tuple[Tensor, Tensor]:
    """Tree self-attention: scores [*, L, L] (``[m, h]``: query m, key h), ROOT scores [*, L]
    and lengths [*] (words) -> (weights [*, L, L] with weights[m, h] = p(h -> m), ROOT share
    [*, L] = p(ROOT -> m)). Rows sum to 1 - ROOT share (0 beyond the length). ``weights``
    "sparse" / "hard-st": SparseMAP's / the MAP tree's arcs (straight-through) instead of
    p(h -> m)."""
    length = scores.shape[-1]
    if kind == "projective" and weights == "marginals":  # one autograd node (eisner_marginals)
        lead = scores.shape[:-2]
        arcs = torch.cat([root_scores.unsqueeze(-2), scores.transpose(-1, -2)], -2)
        arcs = arcs.reshape(-1, length + 1, length)  # [B', L+1, L]: arcs[h, m - 1]
        flat = lengths.reshape(-1) + 1  # [B'] positions with ROOT
        pos = torch.arange(length + 1, device=scores.device)
        real = pos < flat.unsqueeze(-1)  # [B', L+1]
        padding = ~(real.unsqueeze(-1) & real[:, 1:].unsqueeze(1))  # [B', L+1, L]
        arcs = arcs.masked_fill(padding, 0.0)
        loop = pos.unsqueeze(-1) == pos[1:]  # [L+1, L]: h == m (self-loops)
        arcs = arcs.masked_fill(loop, float("-inf"))
        arcs = F.pad(arcs, (1, 0), value=float("-inf"))  # [B', L+1, L+1]: no arc into ROOT
        marginals = eisner_marginals(arcs, flat, True)
        marginals = marginals.reshape(*lead, length + 1, length + 1)
    else:
        arcs = scores.new_zeros(*scores.shape[:-2], length + 1, length + 1)  # [*, L+1, L+1]
        arcs[..., 0, 1:] = root_scores  # ROOT -> m
        arcs[..., 1:, 1:] = scores.transpose(-1, -2)  # arcs[h, m] = S[m, h]
        marginals = tree_marginals(arcs, lengths + 1, kind, weights=weights)  # [*, L+1, L+1]
    return marginals[..., 1:, 1:].transpose(-1, -2), marginals[..., 0, 1:]


def mean_field_weights(
    scores: Tensor, coupling: Tensor, mask: Tensor, iterations: int, validate_args: bool = True
) -> Tensor:
    """Expected spins [*, Q, N] after ``iterations`` mean-field updates with unary scores
    [*, Q, N], couplings J broadcastable to [*, Q, N, N] (e.g. [*, 1, N, N]: shared by the
    queries) and mask broadcastable to [*, Q, N] (True = allowed; any pattern)."""
    n = scores.shape[-1]
    spins = mean_field_marginals(
        scores.reshape(-1, n),  # [B', N]
        coupling.expand(*scores.shape, n).reshape(-1, n, n),  # [B', N, N]
        iterations,
        mask.expand(scores.shape).reshape(-1, n),  # [B', N]
        validate_args=validate_args,  # no NaN or infinity (one host sync)
    )
    return spins.reshape(scores.shape)


@dataclass(frozen=True)
class Normalizer:
    """A registered normaliser."""

    name: Structure  # one of structattn.names.STRUCTURES
    weights: Callable[..., Tensor] | Callable[..., tuple[Tensor, Tensor]]  # the function
    ordered: bool  # a structure over positions in order: padding must come at the end
    joint: bool  # one structure over all queries (self-attention; no per-query mask)
    parameters: tuple[str, ...]  # what StructuredMultiheadAttention learns for its heads


def _tree(kind: TreeStructure) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    def weights(scores: Tensor, root_scores: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        return self_attention_tree_weights(scores, root_scores, lengths, kind)

    weights.__name__ = f"{kind.replace('-', '_')}_weights"
    return weights


#: name -> :class:`Normalizer`, one for each of :data:`structattn.names.STRUCTURES` (in order)
NORMALIZERS: dict[Structure, Normalizer] = {
    n.name: n
    for n in (
        Normalizer("softmax", softmax_weights, ordered=False, joint=False, parameters=()),
        Normalizer("sigmoid", sigmoid_weights, ordered=False, joint=False, parameters=()),
        Normalizer("segmentation", segmentation_weights, True, False, parameters=("transitions",)),
        Normalizer(
            "projective", _tree("projective"), True, True, parameters=("root_key", "root_value")
        ),
        Normalizer(
            "non-projective",
            _tree("non-projective"),
            True,
            True,
            parameters=("root_key", "root_value"),
        ),
        Normalizer("mean-field", mean_field_weights, False, False, parameters=("coupling",)),
        Normalizer("constituency", span_self_attention_weights, True, True, parameters=()),
        Normalizer("semi-markov", span_self_attention_weights, True, True, parameters=()),
    )
}
