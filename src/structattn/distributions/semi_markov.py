"""Semi-Markov CRF: a distribution over labelled segmentations."""

from __future__ import annotations

import torch
from torch import Tensor

from .._precision import autocast_widened
from .._validation import check_lengths, check_potentials
from ..semirings import LogSemiring, MaxSemiring, Semiring
from ..structs.semi_markov import (
    segment_mask,
    semi_markov_inside,
    semi_markov_log_partition,
    semi_markov_marginals,
)
from ._spans import check_indicators, check_inside, check_read_entries, check_tensor
from .base import StructuredDistribution, cached_property, check_temperature, tempered_inputs

__all__ = ["SemiMarkovCRF"]


class SemiMarkovCRF(StructuredDistribution):
    r"""Semi-Markov CRF over the segmentations of each sequence into labelled segments.

    .. math:: p(z) \propto \exp\Big(\sum_{(i, k, c) \in z} \text{segment\_scores}[i, k, c]
              + \sum_{\text{consecutive } (i, k, a), (i', k', c)} \text{transitions}[a, c]\Big)

    A structure z of n positions is a sequence of segments (i, k, c) -- positions
    i..i+k (length k + 1 <= K), label c -- that tile 0..n-1 (none runs past n); consecutive
    segments also score the transition between their labels. With K = 1 it is the
    linear-chain CRF with unary scores ``segment_scores[:, :, 0]``.

    Args:
        segment_scores: [B, N, K, C]; ``segment_scores[b, i, k, c]`` scores the segment
            i..i+k labelled c. Entries of segments that end past an item's length are
            ignored (they may hold anything, NaN included). ``-inf`` forbids a segment.
        transitions: [C, C] (shared) or [B, C, C]; ``transitions[..., a, c]`` scores a
            segment labelled c right after one labelled a. ``None`` means zeros. Entries
            may be ``-inf`` (forbidden label pairs).
        lengths: LongTensor [B] of positions, in 1..N (``None`` = all N).
        validate_args: check shapes, dtypes and values (one host sync); default True.

    Structures (``argmax``, ``sample``, ``log_prob``) are 0/1 LongTensors [B, N, K, C] of
    the chosen segments (``-1`` everywhere for an item with no allowed segmentation);
    ``marginals`` [B, N, K, C] = p(segment (i, k, c) is in z), ``transition_marginals``
    [B, C, C] the expected number of consecutive segment pairs labelled (a, c).

    Forward pass (:func:`~structattn.structs.semi_markov.semi_markov_inside`): time
    O(B N (K C + C^2)) in N sequential steps, memory O(B N (K C + C^2)); the marginals
    (the backward of log Z) come from a backward sweep written by hand
    (:func:`~structattn.structs.semi_markov.semi_markov_marginals`), and their backward (a
    loss on the marginals, as structured attention trains) from a hand-written
    Hessian-vector product: no autograd graph through the N steps.

    Example:
        >>> crf = SemiMarkovCRF(torch.randn(2, 6, 3, 2), torch.randn(2, 2),
        ...                     lengths=torch.tensor([6, 4]))
        >>> crf.marginals.shape, crf.transition_marginals.shape
        (torch.Size([2, 6, 3, 2]), torch.Size([2, 2, 2]))
        >>> SemiMarkovCRF(torch.zeros(1, 4, 2, 1)).log_partition.exp()  # 4 = 1+1+1+1, 2+2, ...
        tensor([5.])
    """

    def __init__(
        self,
        segment_scores: Tensor,
        transitions: Tensor | None = None,
        lengths: Tensor | None = None,
        validate_args: bool = True,
        *,
        temperature: float = 1.0,
    ) -> None:
        self.temperature = check_temperature(temperature)
        if isinstance(segment_scores, Tensor):  # under autocast: inference in float32
            (segment_scores,) = autocast_widened(segment_scores)
        if isinstance(transitions, Tensor):
            (transitions,) = autocast_widened(transitions)
        if validate_args:
            check_tensor("segment_scores", segment_scores, (4,))
            batch, size, width, labels = segment_scores.shape
            if size < 1 or width < 1 or labels < 1:
                raise ValueError(
                    "`segment_scores` must have shape [B, N, K, C] with N, K, C >= 1, got "
                    f"{tuple(segment_scores.shape)}"
                )
        batch, size, width, labels = segment_scores.shape
        if transitions is None:
            transitions = segment_scores.new_zeros(labels, labels)
        if validate_args:
            check_tensor("transitions", transitions, (2, 3))
            check_potentials("transitions", transitions, rank=transitions.dim())
            if transitions.shape not in ((labels, labels), (batch, labels, labels)):
                raise ValueError(
                    f"`transitions` must have shape ({labels}, {labels}) or ({batch}, "
                    f"{labels}, {labels}), got {tuple(transitions.shape)}"
                )
            if (
                transitions.dtype != segment_scores.dtype
                or transitions.device != segment_scores.device
            ):
                raise ValueError("`transitions` must have the dtype and device of `segment_scores`")
            lengths = check_lengths(lengths, batch, 1, size, segment_scores.device)
            read = segment_mask(lengths, batch, size, width, segment_scores.device)
            check_read_entries("segment_scores", segment_scores, read)
        segment_scores, transitions = tempered_inputs(self.temperature, segment_scores, transitions)
        self.segment_scores = segment_scores
        self.transitions = transitions
        self.lengths = lengths
        self._raw = (segment_scores, transitions)

    @property
    def mask(self) -> Tensor:
        """BoolTensor [B, N, K]: True at the segments i..i+k that end inside the item."""
        batch, size, width, _ = self.segment_scores.shape
        return segment_mask(self.lengths, batch, size, width, self.segment_scores.device)

    def _parts(self, *raw: Tensor) -> tuple[Tensor, Tensor]:
        segments, transitions = raw
        batch, _, _, labels = segments.shape
        # entries never read -> 0 (NaN there must not reach autograd's products)
        segments = torch.where(self.mask.unsqueeze(-1), segments, 0.0)
        return segments, transitions.expand(batch, labels, labels)  # a view

    def _inside(
        self, semiring: type[Semiring], parts: tuple[Tensor, ...], lengths: Tensor | None
    ) -> Tensor:
        segments, transitions = parts
        if semiring is LogSemiring:  # the marginals (its backward) by hand
            return semi_markov_log_partition(segments, transitions, lengths)
        return semi_markov_inside(segments, transitions, lengths, semiring)

    def _to_structure(self, *indicators: Tensor) -> Tensor:
        return indicators[0].long()

    def _num_tokens(self) -> Tensor:
        batch, size = self.segment_scores.shape[:2]
        if self.lengths is None:
            return torch.full((batch,), size, dtype=torch.long, device=self.segment_scores.device)
        return self.lengths

    @cached_property
    def _marginals_tuple(self) -> tuple[Tensor, ...]:
        # the marginals by hand in one autograd node whose backward is the hand-written
        # Hessian-vector product (a loss on the marginals trains through it)
        with torch.set_grad_enabled(self._differentiable()):
            segments, transitions = self._parts(self.segment_scores, self.transitions)
            return semi_markov_marginals(segments, transitions, self.lengths)

    @property
    def marginals(self) -> Tensor:
        """p(segment i..i+k labelled c is in z), [B, N, K, C] (0 past the length)."""
        return self._marginals_tuple[0]

    @property
    def transition_marginals(self) -> Tensor:
        """Expected number of consecutive segments labelled (a, c), [B, C, C]."""
        return self._marginals_tuple[1]

    def _check_segments(self, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(indicators, "no segmentation" items, tiling items [B]) of ``value``; ValueError if
        it is not 0/1 segments of this distribution's shape that end inside the items."""
        segments = self.segment_scores
        batch, size, width, _ = segments.shape
        ind, none = check_indicators("segments", value, tuple(segments.shape), segments.device)
        check_inside("segments", ind, self.mask, "a segment that ends past its length")
        # coverage of each position: segments started at or before it minus those ended
        # before it; a tiling covers every real position exactly once
        count = ind.sum(-1)  # [B, N, K]
        starts = count.sum(-1)  # [B, N]
        pos = torch.arange(max(size, width), device=segments.device)
        end = pos[:size].unsqueeze(-1) + pos[:width]  # [N, K]: i + k
        ends = count.new_zeros(batch, size + width).index_add_(
            1, end.flatten(), count.reshape(batch, size * width)
        )[:, :size]  # [B, N]: segments ending at each position
        cover = starts.cumsum(-1) - ends.cumsum(-1) + ends  # [B, N]
        real = torch.arange(size, device=segments.device) < self._num_tokens().unsqueeze(-1)
        tiling = ((cover == 1) | ~real).all(-1)
        return ind, none, tiling

    def _score(self, value: Tensor) -> Tensor:
        ind, none, tiling = self._check_segments(value)
        segments, transitions = self._parts(self.segment_scores, self.transitions)
        # the only segmentation inside a tiling is the tiling itself
        restricted = segments + ind.to(segments.dtype).log()  # -inf outside ``value``
        score = semi_markov_inside(restricted, transitions, self.lengths, MaxSemiring)
        return score.masked_fill(~tiling | none, float("-inf"))

    def _impossible_reason(self, value: Tensor, item: int) -> str:
        _, none, tiling = self._check_segments(value)
        if bool(none[item]):
            return "-1 everywhere (no segmentation)"
        if not bool(tiling[item]):
            return "its segments do not tile the item (a position covered twice or never)"
        return "it uses a segment or a transition whose score is -inf (forbidden)"

    def log_prob(self, segments: Tensor) -> Tensor:
        """log p(segmentation), shape [B]; ``segments`` 0/1 [B, N, K, C].

        ``-inf`` where the segments do not tile the item or use a forbidden segment or
        transition, and for an item with ``-1`` everywhere (no segmentation); ``ValueError``
        for values other than 0/1 or a segment that ends past its item."""
        return super().log_prob(segments)
