"""Constituency-tree CRF: a distribution over binary bracketings (CKY)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import check_lengths
from ..semirings import LogSemiring, MaxSemiring, Semiring
from ..structs.constituency import (
    cky_inside,
    cky_kbest,
    cky_labelled_log_partition,
    cky_labelled_marginals,
    cky_log_partition,
    cky_marginals,
    span_mask,
)
from ._spans import check_indicators, check_inside, check_read_entries, check_tensor
from .base import StructuredDistribution, cached_property, check_temperature, tempered_inputs

__all__ = ["TreeCRF"]


class TreeCRF(StructuredDistribution):
    r"""CRF over the binary bracketings (constituency trees) of each sentence.

    .. math:: p(z) \propto \exp\Big(\sum_{(i, j, l) \in z} \text{span\_scores}[i, j, l]\Big)

    A tree z of n words is a set of 2n - 1 spans [i, j] (words i..j inclusive): every word,
    the whole sentence and n - 2 nested constituents, each of at least two words, that split
    in two (every node of the tree has two children); a labelled tree gives each of its
    spans exactly one label; its score is the sum of its spans' scores (torch-struct's
    ``TreeCRF`` convention). There are Catalan(n - 1) unlabelled trees.

    Args:
        span_scores: [B, N, N] (unlabelled) or [B, N, N, L] (labelled);
            ``span_scores[b, i, j(, l)]`` scores the span of words i..j (i <= j) with label l.
            Entries below the diagonal and past an item's length are ignored (they may hold
            anything, NaN included). ``-inf`` forbids a span (e.g. one that crosses a
            given bracket).
        lengths: LongTensor [B] of words, in 1..N (``None`` = all N).
        validate_args: check shapes, dtypes and values (one host sync); default True.

    Structures (``argmax``, ``sample``, ``log_prob``) are 0/1 LongTensors of the shape of
    ``span_scores`` (0 below the diagonal and at padding; ``-1`` everywhere for an item with
    no allowed tree); ``marginals`` has that shape too: p(span [i, j] (with label l) is in
    the tree). The labels factor, so they are summed out first (a log-sum-exp over L per
    span, by hand in the same autograd node as the CKY:
    :func:`~structattn.structs.constituency.cky_labelled_log_partition`) and the labelled
    CKY costs O(B N^2 L) on top of the unlabelled pass.

    CKY inside pass (:func:`~structattn.structs.constituency.cky_log_partition`): time
    O(B N^3) (N - 1 sequential span widths, one batched step each), memory O(B N^2); its
    backward, the marginals, is an outside pass written by hand
    (:func:`~structattn.structs.constituency.cky_marginals`), and their backward (a loss on
    the marginals, as structured attention trains) a hand-written Hessian-vector product:
    no autograd graph through the O(B N^3) terms.
    ``topk(k)`` gives the exact k best trees (k-best CKY, O(B N^3 k^2 log k)).

    Example:
        >>> crf = TreeCRF(torch.randn(2, 5, 5), lengths=torch.tensor([5, 3]))
        >>> crf.marginals.shape, int(crf.argmax[1].sum())  # 2n - 1 spans for n = 3
        (torch.Size([2, 5, 5]), 5)
    """

    def __init__(
        self,
        span_scores: Tensor,
        lengths: Tensor | None = None,
        validate_args: bool = True,
        *,
        temperature: float = 1.0,
    ) -> None:
        self.temperature = check_temperature(temperature)
        if isinstance(span_scores, Tensor):  # under autocast: inference in float32
            (span_scores,) = autocast_widened(span_scores)
        if validate_args:
            check_tensor("span_scores", span_scores, (3, 4))
            batch, size, size2 = span_scores.shape[:3]
            labels = span_scores.shape[3] if span_scores.dim() == 4 else 1
            if size != size2 or size < 1 or labels < 1:
                raise ValueError(
                    "`span_scores` must have shape [B, N, N] or [B, N, N, L] with N >= 1 and "
                    f"L >= 1, got {tuple(span_scores.shape)}"
                )
            lengths = check_lengths(lengths, batch, 1, size, span_scores.device)
            read = span_mask(lengths, batch, size, span_scores.device)
            check_read_entries("span_scores", span_scores, read)
        (span_scores,) = tempered_inputs(self.temperature, span_scores)
        self.span_scores = span_scores
        self.lengths = lengths
        self.labelled = span_scores.dim() == 4
        self._raw = (span_scores,)

    @property
    def mask(self) -> Tensor:
        """BoolTensor [B, N, N]: True at the spans [i, j] of each item (i <= j < length)."""
        batch, size = self.span_scores.shape[:2]
        return span_mask(self.lengths, batch, size, self.span_scores.device)

    def _parts(self, *raw: Tensor) -> tuple[Tensor]:
        (scores,) = raw
        read = self.mask
        if self.labelled:
            read = read.unsqueeze(-1)
        # entries never read -> 0 (NaN there must not reach autograd's products)
        return (torch.where(read, scores, 0.0),)

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        (scores,) = parts
        if self.labelled:  # the labels factor: ⊕ over them first, [B, N, N]
            scores = semiring.sum(scores, dim=-1)
        if semiring is LogSemiring:  # hand-written outside pass and Hessian-vector product
            return cky_log_partition(scores, lengths)
        return cky_inside(scores, lengths, semiring)

    def _to_structure(self, *indicators: Tensor) -> Tensor:
        return indicators[0].long()

    def _num_tokens(self) -> Tensor:
        batch, size = self.span_scores.shape[:2]
        if self.lengths is None:
            return torch.full((batch,), size, dtype=torch.long, device=self.span_scores.device)
        return self.lengths

    @cached_property
    def log_partition(self) -> Tensor:
        """log Z, shape [B]; ``-inf`` for an item with no valid tree."""
        with torch.set_grad_enabled(self._differentiable()):
            if not self.labelled:
                return self._inside(LogSemiring, self._parts(*self._raw), self.lengths)
            # the labels summed out with the inside pass in one node (padding never read)
            return cky_labelled_log_partition(self.span_scores, self.lengths)

    @cached_property
    def _marginals_tuple(self) -> tuple[Tensor, ...]:
        # the outside pass by hand, one autograd node whose backward is the hand-written
        # Hessian-vector product (a loss on the marginals trains through it)
        with torch.set_grad_enabled(self._differentiable()):
            if self.labelled:  # the span marginals times the labels' softmax, one node
                return (cky_labelled_marginals(self.span_scores, self.lengths),)
            (parts,) = self._parts(self.span_scores)
            _, marginals = cky_marginals(parts, self.lengths)
        return (marginals,)

    @property
    def marginals(self) -> Tensor:
        """p(span [i, j] (with label l) is in the tree), the shape of ``span_scores``; 0 below
        the diagonal and at padding. The diagonal and the whole sentence have total 1."""
        return self._marginals_tuple[0]

    def topk(self, k: int) -> tuple[Tensor, Tensor]:
        """Exact k best trees: (scores [k, B], spans [k, B, ...] 0/1 of the shape of
        ``span_scores``), best first; missing trees (fewer than k allowed) have score -inf
        and spans -1. Rank 0 is ``argmax`` for every k (among tied best trees too); the
        scores are differentiable (gradient: each tree's spans) when the scores require grad.

        A k-best CKY pass (:func:`~structattn.structs.constituency.cky_kbest`, time
        O(B N^3 k^2 log k)) and one backward pass per rank for the trees."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        with torch.inference_mode(False), torch.enable_grad():
            scores = self.span_scores.detach().clone().requires_grad_(True)
            (parts,) = self._parts(scores)
            if not self.labelled:
                parts = parts.unsqueeze(-1)  # [B, N, N, 1]
            values = cky_kbest(parts, self.lengths, k)  # [B, k]
            trees = []
            for rank in range(k):
                (grad,) = torch.autograd.grad(
                    values[:, rank].sum(), scores, retain_graph=rank + 1 < k
                )
                trees.append(self._invalidate(grad.round().long(), values[:, rank].detach()))
        # rank 0 is ``argmax`` also among tied best trees; differentiable scores (#41)
        scores, spans = self._argmax_first(
            values.detach().T.contiguous(), torch.stack(trees), self.argmax
        )
        if self._differentiable():
            (parts,) = self._parts(self.span_scores)
            scores = torch.stack(
                [
                    self._indicator_score((tree.clamp_min(0),), (parts,), best)
                    for tree, best in zip(spans, scores, strict=True)
                ]
            )
        return scores, spans

    def _check_spans(self, value: Tensor) -> tuple[Tensor, Tensor]:
        """(indicators, "no tree" items) of ``value``; ValueError if it is not 0/1 spans of
        this distribution's shape inside the items."""
        ind, none = check_indicators(
            "spans", value, tuple(self.span_scores.shape), self.span_scores.device
        )
        check_inside("spans", ind, self.mask, "a span below the diagonal or past its length")
        return ind, none

    def _score(self, value: Tensor) -> Tensor:
        ind, none = self._check_spans(value)
        (parts,) = self._parts(self.span_scores)
        spans = ind.sum(-1) if self.labelled else ind  # [B, N, N] labels per span
        # a tree of n words is 2n - 1 spans with one label each; the best tree whose spans
        # all are in ``value`` is then ``value`` itself, and -inf if there is none
        valid = (spans <= 1).flatten(1).all(-1) & (
            spans.flatten(1).sum(-1) == 2 * self._num_tokens() - 1
        )
        restricted = parts + ind.to(parts.dtype).log()  # -inf outside ``value``
        if self.labelled:
            restricted = MaxSemiring.sum(restricted, dim=-1)
        score = cky_inside(restricted, self.lengths, MaxSemiring)
        return score.masked_fill(~valid | none, float("-inf"))

    def _impossible_reason(self, value: Tensor, item: int) -> str:
        ind, none = self._check_spans(value)
        if bool(none[item]):
            return "-1 everywhere (no tree)"
        spans = ind[item].sum(-1) if self.labelled else ind[item]
        n = int(self._num_tokens()[item])
        if bool((spans > 1).any()):
            return "a span with several labels"
        forbidden = self._parts(self.span_scores)[0][item].isneginf() & (ind[item] == 1)
        if bool(forbidden.any()):
            return "it uses a span whose score is -inf (a forbidden span)"
        if int(spans.sum()) != 2 * n - 1:
            return f"{int(spans.sum())} spans, but a binary tree of {n} words has {2 * n - 1}"
        return "its spans are not a binary bracketing (they cross or leave a node unsplit)"

    def log_prob(self, spans: Tensor) -> Tensor:
        """log p(tree), shape [B]; ``spans`` 0/1 of the shape of ``span_scores``.

        ``-inf`` where ``spans`` is not a (labelled) binary bracketing of the item or uses a
        forbidden span, and for an item with ``-1`` everywhere (no tree); ``ValueError`` for
        values other than 0/1 or a span outside the item."""
        return super().log_prob(spans)
