"""Non-projective dependency-tree CRF (matrix-tree theorem)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..semirings import LogSemiring, Semiring
from ..structs.kbest_trees import arborescence_kbest
from ..structs.nonprojective import (
    chu_liu_edmonds,
    matrix_tree_log_partition,
    matrix_tree_marginals,
    matrix_tree_sample,
)
from .base import cached_property
from .dependency import TreeCRFBase

__all__ = ["NonProjectiveDependencyCRF"]


class NonProjectiveDependencyCRF(TreeCRFBase):
    r"""CRF over non-projective dependency trees: all spanning arborescences rooted at ROOT.

    .. math:: p(z) \propto \exp\Big(\sum_{(h \to m) \in z} \text{arc\_scores}[h, m]\Big)

    **Matrix-tree theorem** (Koo et al. 2007; Smith & Smith 2007). With
    :math:`w_{hm} = e^{s_{hm}}` over the words 1..n and root weights
    :math:`\rho_m = e^{s_{0m}}`, the Laplacian :math:`L_{hm} = -w_{hm}` (h != m),
    :math:`L_{mm} = \rho_m + \sum_{h \ne m} w_{hm}` has :math:`\det L = Z`. With one root child
    (``multiroot=False``) :math:`Z = \sum_r \rho_r T_r`, :math:`T_r` the weight of the trees of
    the words rooted at r (Koo et al.'s determinant: :math:`\rho` off the diagonal, first row
    replaced by :math:`\rho`).
    The determinant is the LU of the column-rescaled Laplacian in float64, with marginals
    and their gradient in closed form from its inverse; items where that is ill-conditioned
    (no tree, huge score ranges) are recomputed, per item, by subtraction-free Gaussian
    elimination in log space (see :mod:`structattn.structs.nonprojective`): exact ``-inf``
    handling and no overflow or cancellation at any score scale. Marginals are the gradient
    of log Z (differentiable again, to any order); entropy is
    ``log Z - sum(marginals * scores)``.

    Args:
        arc_scores: [B, N, N]; position 0 is the ROOT symbol; ``arc_scores[b, h, m]`` scores
            the arc head h -> modifier m. Column 0 and the diagonal are ignored; entries may be
            ``-inf`` (forbidden arcs).
        lengths: LongTensor [B] of positions including ROOT, in 2..N (``None`` = all N).
        multiroot: if False, ROOT has exactly one child.
        validate_args: check shapes, dtypes and values (one host sync); default True.

    ``argmax`` (Chu-Liu-Edmonds, batched; ``-inf`` arcs and the one-root-child constraint are
    exact through lexicographic (rank, score) arc weights, no numeric penalty) and ``sample(n)``
    (exact, sequential conditioning on the marginals) are heads, LongTensor [B, N] and
    [n, B, N] (``-1`` at ROOT and padding). An item with no valid tree (e.g. a word whose
    incoming arcs are all ``-inf``) gets ``log_partition = -inf``, zero marginals with finite
    (zero) gradients, ``entropy = 0``, ``max_score = -inf`` and ``-1`` in ``argmax`` and
    samples; no error is raised.

    Complexity: log Z, marginals and entropy O(B N^3) time: a batched LU and inverse (and two
    batched matmuls for a loss on the marginals), memory O(B N^2); items on the fallback take
    N sequential steps (memory O(B N^3) when differentiated); argmax O(B N^2) per
    contraction round, at most N - 1 rounds (one host sync each); ``sample(n)`` O(n B N^3)
    in N sequential conditioning steps (rank-one updates of the inverse Laplacian; O(N^4)
    for the rare ill-conditioned items).

    Example:
        >>> tree = NonProjectiveDependencyCRF(torch.randn(2, 6, 6), lengths=torch.tensor([6, 4]))
        >>> torch.allclose(tree.marginals.sum(1)[1, 1:4], torch.ones(3))
        True
        >>> tree.argmax.shape, tree.sample(3).shape
        (torch.Size([2, 6]), torch.Size([3, 2, 6]))
        >>> bool((tree.log_partition >= tree.max_score).all())
        True
    """

    def _parts(self, *raw: Tensor) -> tuple[Tensor]:
        # the scores as given: the matrix-tree functions ignore column 0, the diagonal and
        # padding themselves (their gradients there are 0), which saves two masked copies
        return (raw[0],)

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        if semiring is not LogSemiring:
            raise NotImplementedError(
                "NonProjectiveDependencyCRF has no dynamic program in the "
                f"{semiring.name!r} semiring: log Z is the matrix-tree determinant (log "
                "semiring only); argmax uses Chu-Liu-Edmonds and sample() sequential conditioning"
            )
        return matrix_tree_log_partition(parts[0], lengths, self.multiroot)

    @cached_property
    def _marginals_tuple(self) -> tuple[Tensor, ...]:
        # in closed form from the LU path (no autograd round trip through log Z); a loss on
        # the marginals back-propagates by a hand-written formula
        return (
            matrix_tree_marginals(
                self.arc_scores, self.lengths, self.multiroot, self._differentiable()
            ),
        )

    @cached_property
    def argmax(self) -> Tensor:
        """Heads of the highest-scoring tree, LongTensor [B, N] (``-1`` at ROOT, padding and
        for items with no valid tree). Labelled trees: a :class:`LabelledHeads` (heads and
        labels [B, N]): the best tree under each arc's best label score, with those labels."""
        if self.label_scores is not None:
            return self._labelled_argmax()  # type: ignore[return-value]
        (arcs,) = self._parts(self.arc_scores.detach())
        return chu_liu_edmonds(arcs, self.lengths, self.multiroot)

    @cached_property
    def max_score(self) -> Tensor:
        """Score of the highest-scoring tree, shape [B] (``-inf`` if none is valid);
        differentiable (its gradient: the arcs (and labels) of ``argmax``) when the scores
        require grad."""
        if self.label_scores is not None:
            return self._labelled_max_score()
        with torch.set_grad_enabled(self._differentiable()):  # -1 (no tree) gives -inf
            return self._map_score()

    def log_prob(self, heads: Tensor, labels: Tensor | None = None) -> Tensor:
        """log p(tree), shape [B]; ``heads`` LongTensor [B, N] (entries at ROOT and padding
        ignored), and ``labels`` [B, N] for labelled trees (or ``heads`` a
        :class:`LabelledHeads`); ``-inf`` when ``heads`` is not a valid tree (also for items
        with no tree, where ``score - log Z`` would be ``-inf - -inf``)."""
        return super().log_prob(heads, labels)

    def sample(self, n: int = 1) -> Tensor:
        """``n`` exact samples of heads, LongTensor [n, B, N] (``-1`` at ROOT and padding, and
        everywhere for items with no valid tree); labelled trees: a :class:`LabelledHeads` of
        [n, B, N] each (each arc's label drawn from the softmax of its label scores). Uses the
        global torch RNG."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"`n` must be a positive int, got {n!r}")
        (arcs,) = self._parts(self.arc_scores.detach())
        heads = matrix_tree_sample(arcs, self.lengths, self.multiroot, n)
        if self.label_scores is None:
            return heads
        return self._sample_labels(heads)  # type: ignore[return-value]

    def _part_argmax(self, parts: tuple[Tensor, ...], lengths: Tensor | None) -> tuple[Tensor, ...]:
        # Chu-Liu-Edmonds: no max-plus inside pass for non-projective trees
        heads = chu_liu_edmonds(parts[0].detach(), lengths, self.multiroot)
        return (self._indicators(heads).to(parts[0].dtype),)

    def _kbest_heads(self, k: int) -> Tensor:
        (arcs,) = self._parts(self.arc_scores.detach())
        return arborescence_kbest(arcs, self.lengths, self.multiroot, k)
