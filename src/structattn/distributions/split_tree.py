"""Split-tree distribution: binary trees by recursive splitting (the PRPN notes, eq. 8)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import check_lengths, length_mask
from ..semirings import MaxSemiring, Semiring
from ..structs.constituency import span_mask, spans_to_chart
from ..structs.split_tree import split_inside
from ._spans import check_indicators, check_inside, check_read_entries, check_tensor
from .base import StructuredDistribution, cached_property

__all__ = ["SplitTreeDistribution"]


class SplitTreeDistribution(StructuredDistribution):
    r"""Trees drawn by recursive splitting at a softmax-chosen pivot (PRPN notes, eq. 8).

    The tree of a span [a, b] chooses its pivot i in a..b with probability
    softmax(scores[a..b])_i and recurses on [a, i - 1] and [i + 1, b] (an empty part ends the
    recursion). A tree is the set of its *nodes*, the non-empty spans of the recursion: n of
    them for n words, one per pivot (there are Catalan(n) trees). Its probability is

    .. math:: p(z) = \prod_{[a, b] \in z} \frac{\exp(s_{\text{pivot}(a, b)})}
              {\sum_{a \le k \le b} \exp(s_k)},

    a product of local choices, so ``log_partition`` is 0 by construction (the inside pass
    computes it; in float32 it is 0 up to round-off). In Gibbs form the parts are a pivot
    score ``s_i`` per word and a node score ``-logsumexp(s[a..b])`` per node, and the generic
    machinery gives the exact ``argmax`` (the most likely tree, in O(N^3), not the greedy one
    below), ``max_score`` = its log-probability, exact samples, ``log_prob`` and the
    marginals. ``entropy`` is the sum over spans of p(node) times the entropy of that span's
    pivot softmax (the choice at a node is independent of how the recursion got there).

    *Plackett-Luce* (eq. 9): ranking the words by sampling without replacement
    proportionally to exp(scores) and splitting every span at its top-ranked word induces
    exactly this distribution over trees (the top-ranked word of a span is softmax-distributed
    over the span, and the rankings restricted to its two sides are independent
    Plackett-Luce rankings; ``tests/test_span_structures.py`` checks it by enumeration).

    *Greedy SPLIT* (:func:`~structattn.trees.split_tree`, PRPN's tree
    extraction) splits every span at the argmax of its scores: the most likely choice at
    each node, which is not the most likely tree in general, because a likely first split
    can leave harder choices below it. With scores ``[0, 1, 1.5, 2]`` greedy SPLIT splits at
    word 3 (p = 0.474), then 2 (0.547), then 1 (0.731): the left-branching tree
    ``(((a b) c) d)``, nodes [0, 3], [0, 2], [0, 1], [0, 0], p = 0.189. Splitting at word 2
    first (p = 0.288) leaves [0, 1] (0.731) and the single word 3: ``((a b) (c d))``, nodes
    [0, 3], [0, 1], [0, 0], [3, 3], p = 0.210, the ``argmax``.

    Args:
        scores: [B, N] pivot scores (log d_i of the notes; e.g. PRPN's syntactic distances
            over a temperature). Finite at real words (a word scored ``-inf`` could never
            be a pivot, yet every word is the pivot of one node); entries past an item's
            length are ignored (NaN included).
        lengths: LongTensor [B] of words, in 1..N (``None`` = all N).
        validate_args: check shapes, dtypes and values (one host sync); default True.

    Structures (``argmax``, ``sample``, ``log_prob``) are 0/1 LongTensors [B, N, N] of the
    nodes [i, j] (0 below the diagonal and at padding); ``marginals`` [B, N, N] =
    p(span [i, j] is a node of the recursion). Time O(B N^3) in N sequential span widths,
    memory O(B N^2) forward (O(B N^3) kept by autograd for the marginals).

    Example:
        >>> tree = SplitTreeDistribution(torch.tensor([[0.0, 1.0, 1.5, 2.0]]))
        >>> tree.argmax[0].nonzero().tolist()  # the nodes [i, j] of the most likely tree
        [[0, 0], [0, 1], [0, 3], [3, 3]]
        >>> round(tree.max_score.exp().item(), 3), tree.log_partition.abs().item() < 1e-6
        (0.21, True)
    """

    # the node scores -logsumexp(scores) are not proportional to the scores (no ``tempered``)
    _homogeneous_parts = False

    def __init__(
        self, scores: Tensor, lengths: Tensor | None = None, validate_args: bool = True
    ) -> None:
        if isinstance(scores, Tensor):  # under autocast: inference in float32
            (scores,) = autocast_widened(scores)
        if validate_args:
            check_tensor("scores", scores, (2,))
            batch, size = scores.shape
            if size < 1:
                raise ValueError(f"`scores` must have shape [B, N] with N >= 1, got {(batch, 0)}")
            lengths = check_lengths(lengths, batch, 1, size, scores.device)
            read = length_mask(lengths, batch, size, scores.device)
            check_read_entries("scores", scores, read, allow_neg_inf=False)
        self.scores = scores
        self.lengths = lengths
        self._raw = (scores,)

    @property
    def mask(self) -> Tensor:
        """BoolTensor [B, N, N]: True at the spans [i, j] of each item (i <= j < length)."""
        batch, size = self.scores.shape
        return span_mask(self.lengths, batch, size, self.scores.device)

    def _pivot_scores(self, scores: Tensor) -> Tensor:
        """Scores with the padding set to 0, [B, N]."""
        batch, size = scores.shape
        real = length_mask(self.lengths, batch, size, scores.device)
        return torch.where(real, scores, 0.0)

    def _parts(self, *raw: Tensor) -> tuple[Tensor, Tensor]:
        pivot = self._pivot_scores(raw[0])  # [B, N]
        # lse[w - 1][b, a] = logsumexp(s[a..a+w-1]), one logaddexp per width (the scores are
        # finite: no -inf for which higher-order gradients of a logsumexp would be NaN)
        lse = [pivot]
        for w in range(2, pivot.shape[1] + 1):
            lse.append(torch.logaddexp(lse[-1][:, :-1], pivot[:, w - 1 :]))
        node = torch.where(self.mask, -spans_to_chart(lse), 0.0)  # [B, N, N]
        return node, pivot

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        node, pivot = parts
        return split_inside(node, pivot, lengths, semiring)

    def _to_structure(self, *indicators: Tensor) -> Tensor:
        return indicators[0].long()

    def _num_tokens(self) -> Tensor:
        batch, size = self.scores.shape
        if self.lengths is None:
            return torch.full((batch,), size, dtype=torch.long, device=self.scores.device)
        return self.lengths

    @property
    def marginals(self) -> Tensor:
        """p(span [i, j] is a node of the recursion), [B, N, N] (0 below the diagonal and at
        padding); the whole item has probability 1 and each item's marginals sum to its
        number of words (one node per pivot)."""
        return self._marginals_tuple[0]

    def _local_entropy(self, scores: Tensor) -> Tensor:
        """Entropy of the pivot softmax of every span [a, b], [B, N, N] (0 elsewhere): one
        batched op per width, written into the chart by one ``index_copy``."""
        pivot = self._pivot_scores(scores)
        batch, size = pivot.shape
        per_width = []
        for w in range(1, size + 1):
            logq = pivot.unfold(1, w, 1).log_softmax(-1)  # [B, N - w + 1, w]
            per_width.append(-(logq.exp() * logq).sum(-1))
        return spans_to_chart(per_width)

    @cached_property
    def entropy(self) -> Tensor:
        """Shannon entropy H(p) = Σ_spans p(node) H(softmax(scores[i..j])), shape [B]
        (exact, no difference of large numbers)."""
        marginals = self.marginals
        with torch.set_grad_enabled(self._differentiable()):
            local = self._local_entropy(self.scores)
            return (marginals * local).flatten(1).sum(-1)

    def _check_nodes(self, value: Tensor) -> tuple[Tensor, Tensor]:
        ind, none = check_indicators("spans", value, tuple(self.mask.shape), self.scores.device)
        check_inside("spans", ind, self.mask, "a span below the diagonal or past its length")
        return ind, none

    def _score(self, value: Tensor) -> Tensor:
        ind, none = self._check_nodes(value)
        node, pivot = self._parts(self.scores)
        # a split tree of n words has n nodes; the most likely tree whose nodes all are in
        # ``value`` is then ``value`` itself, and -inf if there is none
        valid = ind.flatten(1).sum(-1) == self._num_tokens()
        restricted = node + ind.to(node.dtype).log()  # -inf outside ``value``
        score = split_inside(restricted, pivot, self.lengths, MaxSemiring)
        return score.masked_fill(~valid | none, float("-inf"))

    def _impossible_reason(self, value: Tensor, item: int) -> str:
        ind, none = self._check_nodes(value)
        if bool(none[item]):
            return "-1 everywhere (no tree)"
        n, count = int(self._num_tokens()[item]), int(ind[item].sum())
        if count != n:
            return f"{count} nodes, but a split tree of {n} words has {n}"
        return "its spans are not the nodes of a recursive split"

    def log_prob(self, spans: Tensor) -> Tensor:
        """log p(tree), shape [B]; ``spans`` 0/1 [B, N, N] marking the tree's nodes.

        ``-inf`` where ``spans`` are not the nodes of a split tree of the item, and for an
        item with ``-1`` everywhere; ``ValueError`` for values other than 0/1 or a span
        outside the item."""
        return super().log_prob(spans)
