r"""Attention over spans: weights from a constituency-tree CRF or a semi-Markov CRF (#39).

Three layers and the functions they share (also the ``"constituency"`` / ``"semi-markov"``
heads of :class:`~structattn.attention.StructuredMultiheadAttention`):

* :class:`SpanAttention` (query, memory, mask): for every query a distribution over the
  bracketings (:class:`~structattn.distributions.TreeCRF`) or the segmentations
  (:class:`~structattn.distributions.SemiMarkovCRF`) of the memory, with span potentials
  from the query and a span representation of the memory; the context is the expected
  representation of a span of the structure.
* :class:`SpanSelfAttention` (x, mask): one structure per sentence, span scores from a
  biLSTM (:class:`~structattn.attention.BiLSTMArcScorer` read as start/end scores); each
  position attends to the members of its constituents (segment), see
  :func:`span_membership`. The tree-transduction recipe's ``constituency`` encoder.
* :class:`SemiMarkovSegmentationAttention`: SAN's segmentation attention (Kim et al. 2017,
  sec. 3.2) selecting segments instead of positions, with segment-level potentials.

Spans are written ``[i, j]`` (positions i..j inclusive, i <= j); span tensors are
``[*, N, N]`` with entries below the diagonal 0. A semi-Markov segment (i, k) of
:class:`~structattn.distributions.SemiMarkovCRF` is the span [i, i + k].
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor, nn

from .._validation import check_mask, prefix_lengths
from ..distributions import SemiMarkovCRF, TreeCRF
from ..names import SpanStructure, WeightKind
from ._common import SegmentSelection, as_queries, check_memory
from ._spans import (
    check_structure,
    corner_sums,
    segments_to_spans,
    span_coverage,
    span_marginals,
    span_membership,
    span_self_attention_weights,
    spans_to_segments,
    widths,
)
from ._weights import check_weights, structured_weights
from .syntactic import BiLSTMArcScorer

__all__ = [
    "SPAN_REPRESENTATIONS",
    "SemiMarkovSegmentationAttention",
    "SpanAttention",
    "SpanAttentionOutput",
    "SpanRepresentation",
    "SpanScorer",
    "SpanSelfAttention",
    "SpanSelfAttentionOutput",
    "segments_to_spans",
    "span_coverage",
    "span_marginals",
    "span_membership",
    "span_self_attention_weights",
    "spans_to_segments",
]

#: how a span [i, j] of the memory m is represented: its endpoints [m_i; m_j] or its mean
SpanRepresentation = Literal["endpoints", "mean"]
SPAN_REPRESENTATIONS: tuple[SpanRepresentation, ...] = get_args(SpanRepresentation)


# ---- span potentials from a query and the memory ---------------------------------------------
class SpanScorer(nn.Module):
    r"""Span potentials phi_q(i, j) = q^T W r_ij of queries and spans of the memory:

    * ``"endpoints"``: r_ij = [m_i; m_j], so phi_q(i, j) = (W_s q)^T m_i + (W_e q)^T m_j;
    * ``"mean"``: r_ij = mean(m_i..m_j), so phi_q(i, j) = mean_{i <= k <= j} (W q)^T m_k.

    ``forward(query [B, Q, Dq], memory [B, N, Dm]) -> phi [B, Q, N, N]`` (entries below the
    diagonal are not spans and hold garbage). Time O(B Q N (Dm + N)); r is never built."""

    def __init__(
        self, memory_dim: int, query_dim: int, representation: SpanRepresentation = "endpoints"
    ) -> None:
        super().__init__()
        if representation not in SPAN_REPRESENTATIONS:
            raise ValueError(
                f"`representation` must be one of {SPAN_REPRESENTATIONS}, got {representation!r}"
            )
        self.representation: SpanRepresentation = representation
        parts = 2 if representation == "endpoints" else 1
        self.weight = nn.Linear(query_dim, parts * memory_dim, bias=False)

    def forward(self, query: Tensor, memory: Tensor) -> Tensor:
        projected = self.weight(query)  # [B, Q, P * Dm]
        if self.representation == "endpoints":
            start, end = projected.chunk(2, dim=-1)  # [B, Q, Dm] each
            a = torch.matmul(start, memory.transpose(1, 2))  # [B, Q, N]: start scores
            b = torch.matmul(end, memory.transpose(1, 2))  # [B, Q, N]: end scores
            return a.unsqueeze(-1) + b.unsqueeze(-2)  # [B, Q, N(i), N(j)]
        a = torch.matmul(projected, memory.transpose(1, 2))  # [B, Q, N]
        prefix = torch.nn.functional.pad(a.cumsum(-1), (1, 0))  # [B, Q, N + 1]
        total = prefix[..., 1:].unsqueeze(-2) - prefix[..., :-1].unsqueeze(-1)  # [B,Q,N,N]
        return total / widths(a.shape[-1], a)


# ---- SpanAttention --------------------------------------------------------------------------
class SpanAttentionOutput(NamedTuple):
    """Outputs of :class:`SpanAttention` (without the Q dimension for a [B, Dq] query)."""

    context: Tensor  # [B, Q, D]: D = 2 Dm ("endpoints") or Dm ("mean")
    marginals: Tensor  # [B, Q, N, N]: p(span [i, j] is in the query's structure)
    weights: Tensor  # [B, Q, N]: span_coverage of the marginals (position weights)
    scores: Tensor  # [B, Q, N, N]: the span potentials phi (upper triangle)


def _real_lengths(memory: Tensor, mask: Tensor | None, check: bool = True) -> tuple[Tensor, Tensor]:
    """(mask [B, N] checked as a prefix mask, lengths [B] >= 1; ``check=False``: the
    lengths unchecked, no host read)."""
    mask = check_mask("mask", mask, tuple(memory.shape[:2]), memory.device)
    return mask, prefix_lengths("mask", mask, check=check)


class SpanAttention(nn.Module):
    r"""Attention over the spans of a memory: structured attention whose latent structure is
    a bracketing or a segmentation of the memory rather than one position.

    For each query q, span potentials phi_q(i, j) = q^T W r_ij (:class:`SpanScorer`) define

    * ``structure="constituency"``: a :class:`~structattn.distributions.TreeCRF` over the
      binary bracketings of the memory (2n - 1 spans per tree);
    * ``structure="semi-markov"``: a one-label :class:`~structattn.distributions.SemiMarkovCRF`
      over its segmentations into segments of at most ``max_width`` positions
      (segment i..j scores phi_q(i, j)).

    ``marginals[q, i, j]`` = mu_q(i, j) = p(span [i, j] is in the structure). The context is
    the expected representation of a span of the structure, normalised by the expected
    number of spans (2n - 1 for trees):

    .. math:: c_q = \frac{\sum_{i \le j} \mu_q(i, j)\, r_{ij}}{\sum_{i \le j} \mu_q(i, j)}

    with r_ij = [m_i; m_j] (``representation="endpoints"``, c has 2 Dm features) or
    mean(m_i..m_j) (``"mean"``, Dm features, c_q = sum_k weights[q, k] m_k with the
    position weights of :func:`span_coverage`).

    Args:
        memory_dim: Dm; query_dim: Dq (default Dm).
        structure: ``"constituency"`` or ``"semi-markov"``.
        representation: ``"endpoints"`` (default) or ``"mean"``.
        max_width: longest segment (``"semi-markov"`` only; None = the memory's length).
        validate_args: check that the mask puts padding at the end (one host
            synchronisation per call; default True); False: no value is read on the host.
        weights: what ``marginals`` are: ``"marginals"`` (default, mu_q), ``"sparse"``
            (SparseMAP's: a mix of few structures) or ``"hard-st"`` (the MAP structure's
            spans forward, the marginals' gradient backward: straight-through).

    Forward: ``query`` [B, Dq] or [B, Q, Dq], ``memory`` [B, N, Dm], ``mask`` BoolTensor
    [B, N] (True = real; padding at the end, at least one real position). Time O(B Q N^3)
    (trees) or O(B Q N K) (segmentations); the marginals train by autograd's double backward
    of the CRF's log-partition.

    Example:
        >>> attn = SpanAttention(8, 6, structure="constituency")
        >>> mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
        >>> out = attn(torch.randn(2, 3, 6), torch.randn(2, 4, 8), mask)
        >>> out.context.shape, out.marginals.shape
        (torch.Size([2, 3, 16]), torch.Size([2, 3, 4, 4]))
        >>> out.marginals[1, 0].sum().item()  # 2n - 1 = 3 spans for n = 2
        3.0
    """

    def __init__(
        self,
        memory_dim: int,
        query_dim: int | None = None,
        structure: SpanStructure = "constituency",
        representation: SpanRepresentation = "endpoints",
        max_width: int | None = None,
        validate_args: bool = True,
        weights: WeightKind = "marginals",
    ) -> None:
        super().__init__()
        check_structure(structure, max_width)
        self.weights_mode = check_weights(weights)  # marginals, SparseMAP or hard-st
        self.structure: SpanStructure = structure
        self.max_width = max_width
        self.validate_args = validate_args
        self.memory_dim = memory_dim
        self.query_dim = query_dim or memory_dim
        self.scorer = SpanScorer(memory_dim, self.query_dim, representation)

    @property
    def representation(self) -> SpanRepresentation:
        """``"endpoints"`` or ``"mean"``."""
        return self.scorer.representation

    def forward(
        self, query: Tensor, memory: Tensor, mask: Tensor | None = None
    ) -> SpanAttentionOutput:
        query3, single = as_queries(query)
        memory = check_memory(memory)
        if query3.shape[0] != memory.shape[0]:
            raise ValueError(f"`query` has batch {query3.shape[0]}, `memory` has {memory.shape[0]}")
        if query3.shape[-1] != self.query_dim or memory.shape[-1] != self.memory_dim:
            raise ValueError(
                f"`query` and `memory` must have {self.query_dim} and {self.memory_dim} "
                f"features, got shapes {tuple(query.shape)} and {tuple(memory.shape)}"
            )
        mask, lengths = _real_lengths(memory, mask, self.validate_args)
        memory = memory.masked_fill(~mask.unsqueeze(-1), 0.0)  # padding inert (NaN included)
        scores = self.scorer(query3, memory)  # [B, Q, N, N]
        batch, queries = query3.shape[:2]
        marginals = span_marginals(
            scores,
            lengths.view(batch, 1).expand(batch, queries),
            self.structure,
            self.max_width,
            self.weights_mode,
        )
        weights = span_coverage(marginals)  # [B, Q, N]
        if self.representation == "mean":
            context = torch.matmul(weights, memory)  # [B, Q, Dm]
        else:
            total = marginals.sum((-1, -2)).unsqueeze(-1)  # [B, Q, 1] expected number of spans
            starts = marginals.sum(-1) / total  # [B, Q, N]: p(a span starts at i) / E[#spans]
            ends = marginals.sum(-2) / total
            context = torch.cat([starts @ memory, ends @ memory], -1)  # [B, Q, 2 Dm]
        if single:
            return SpanAttentionOutput(context[:, 0], marginals[:, 0], weights[:, 0], scores[:, 0])
        return SpanAttentionOutput(context, marginals, weights, scores)


# ---- self-attention over a sentence's constituents / segments -------------------------------
class SpanSelfAttentionOutput(NamedTuple):
    """Outputs of :class:`SpanSelfAttention`."""

    context: Tensor  # [B, N, D]: c_q = sum_k weights[q, k] x_k
    weights: Tensor  # [B, N, N]: span_membership of the marginals (rows: queries)
    marginals: Tensor  # [B, N, N]: p(span [i, j] is in the sentence's structure)
    span_scores: Tensor  # [B, N, N]: theta[i, j], the score of span [i, j] (i <= j)


class SpanSelfAttention(nn.Module):
    r"""Self-attention over constituents (or segments): c_q = sum_k w_qk x_k with w the
    :func:`span_membership` of the span marginals of one structure per sentence.

    Span scores theta_ij = tanh(s^T tanh(W_1 h_i + W_2 h_j + b)) of a biLSTM over x
    (:class:`~structattn.attention.BiLSTMArcScorer`: its arc score of (i, j) is read as the
    score of the span with start i and end j, i <= j), and

    * ``structure="constituency"``: a :class:`~structattn.distributions.TreeCRF` over the
      binary bracketings of each sentence: w_qk is the expected share of k in q's
      constituents (from the word q up to the sentence);
    * ``structure="semi-markov"``: a :class:`~structattn.distributions.SemiMarkovCRF` over
      its segmentations (segments of at most ``max_width`` positions): w_qk =
      E[1[k in q's segment] / its length].

    Args:
        input_dim: size D of the inputs; hidden_dim: biLSTM and MLP size (default 50).
        structure, max_width: as above; scorer_layers: stacked biLSTM layers.
        validate_args: check that the mask puts padding at the end (one host
            synchronisation per call; default True); False: no value is read on the host.
        weights: ``"marginals"`` (default), ``"sparse"`` (SparseMAP) or ``"hard-st"`` (the
            MAP structure, straight-through), as :class:`SpanAttention`.

    Forward: ``x`` [B, N, D], ``mask`` BoolTensor [B, N] (True = real, padding at the end).

    Example:
        >>> attn = SpanSelfAttention(8, hidden_dim=5)
        >>> out = attn(torch.randn(2, 4, 8), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool())
        >>> out.context.shape, out.weights.sum(-1).round(decimals=4).tolist()
        (torch.Size([2, 4, 8]), [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int = 50,
        structure: SpanStructure = "constituency",
        max_width: int | None = None,
        scorer_layers: int = 1,
        validate_args: bool = True,
        weights: WeightKind = "marginals",
    ) -> None:
        super().__init__()
        check_structure(structure, max_width)
        self.weights_mode = check_weights(weights)  # marginals, SparseMAP or hard-st
        self.structure: SpanStructure = structure
        self.max_width = max_width
        self.validate_args = validate_args
        self.input_dim = input_dim
        self.scorer = BiLSTMArcScorer(input_dim, hidden_dim, scorer_layers)

    def _prepare(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        x = check_memory(x, "x")
        if x.shape[-1] != self.input_dim:
            raise ValueError(
                f"`x` must have {self.input_dim} features (input_dim), got shape {tuple(x.shape)}"
            )
        mask, lengths = _real_lengths(x, mask, self.validate_args)
        x = x.masked_fill(~mask.unsqueeze(-1), 0.0)  # padding inert (NaN included)
        return x, lengths, self.scorer(x, lengths)  # span scores [B, N, N]

    def distribution(self, span_scores: Tensor, lengths: Tensor) -> TreeCRF | SemiMarkovCRF:
        """The sentence's CRF: a TreeCRF [B, N, N] or a SemiMarkovCRF [B, N, K, 1]."""
        if self.structure == "constituency":
            return TreeCRF(span_scores, lengths, validate_args=False)
        width = span_scores.shape[-1] if self.max_width is None else self.max_width
        width = min(width, span_scores.shape[-1])
        segments = spans_to_segments(span_scores, width).unsqueeze(-1)
        return SemiMarkovCRF(segments, None, lengths, validate_args=False)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> SpanSelfAttentionOutput:
        x, lengths, span_scores = self._prepare(x, mask)
        marginals = span_marginals(
            span_scores, lengths, self.structure, self.max_width, self.weights_mode
        )
        weights = span_membership(marginals)  # [B, N, N]
        context = torch.bmm(weights, x)  # [B, N, D]
        return SpanSelfAttentionOutput(context, weights, marginals, span_scores)

    @torch.no_grad()
    def parse(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """The MAP structure as 0/1 spans, LongTensor [B, N, N] (CKY or semi-Markov Viterbi)."""
        x, lengths, span_scores = self._prepare(x, mask)
        best = self.distribution(span_scores, lengths).argmax
        return best if self.structure == "constituency" else segments_to_spans(best[..., 0])


# ---- semi-Markov segmentation attention -----------------------------------------------------
class SemiMarkovSegmentationAttention(nn.Module, SegmentSelection):
    r"""Segmentation attention (Kim et al. 2017, sec. 3.2) that selects *segments* of the
    memory instead of positions, with segment-level potentials.

    For each query q, a 2-label :class:`~structattn.distributions.SemiMarkovCRF` over the
    memory: a selected segment i..j (label 1, at most ``max_width`` positions) scores
    phi_q(i, j) = q^T W r_ij (:class:`SpanScorer`, endpoints or mean); an unselected
    position is a segment of length 1 (label 0) scoring 0 (so every set of selected
    segments is one structure); consecutive segments score a learned 2x2 ``transitions``
    b (two adjacent selected segments: b[1, 1]). The weight of position k is
    p_k = p(k lies in a selected segment); the context is SAN's, c = sum_k p_k v_k / gamma
    with gamma = sum_k p_k / lambda (``normalize=True``) or sum_k p_k v_k. With
    ``max_width=1`` and ``representation="mean"`` it is :class:`SegmentationAttention`
    with a bilinear scorer.

    Args:
        memory_dim, query_dim: Dm, Dq (default Dm).
        max_width: longest selected segment (default 4).
        representation: ``"endpoints"`` (default) or ``"mean"``.
        normalize, lam, penalty: as :class:`SegmentationAttention` (penalty: L2 on b).
        validate_args: check that the mask puts padding at the end (one host
            synchronisation per call; default True); False: no value is read on the host.
        weights: ``"marginals"`` (default), ``"sparse"`` or ``"hard-st"``, as
            :class:`SpanAttention`.

    Forward: ``query`` [B, Dq] or [B, Q, Dq], ``memory`` [B, N, Dm], ``mask`` [B, N]
    (prefix), ``values`` [B, N, Dv] (default memory) -> :class:`SpanAttentionOutput` with
    ``context`` [B, Q, Dv], ``marginals`` [B, Q, N, N] (p(segment [i, j] is selected)),
    ``weights`` [B, Q, N] (p_k) and ``scores`` [B, Q, N, N] (phi).

    Example:
        >>> attn = SemiMarkovSegmentationAttention(8, max_width=3)
        >>> out = attn(torch.randn(2, 5, 8), torch.randn(2, 6, 8))
        >>> out.context.shape, out.weights.shape
        (torch.Size([2, 5, 8]), torch.Size([2, 5, 6]))
    """

    def __init__(
        self,
        memory_dim: int,
        query_dim: int | None = None,
        max_width: int = 4,
        representation: SpanRepresentation = "endpoints",
        normalize: bool = True,
        lam: float = 2.0,
        penalty: float = 0.005,
        validate_args: bool = True,
        weights: WeightKind = "marginals",
    ) -> None:
        super().__init__()
        check_structure("semi-markov", max_width)
        self.validate_args = validate_args
        self.weights_mode = check_weights(weights)  # marginals, SparseMAP or hard-st
        self.memory_dim = memory_dim
        self.query_dim = query_dim or memory_dim
        self.max_width = max_width
        self.scorer = SpanScorer(memory_dim, self.query_dim, representation)
        self._init_selection(normalize, lam, penalty)  # b[previous label, label], ...

    def crf(self, scores: Tensor, lengths: Tensor) -> SemiMarkovCRF:
        """The CRF of span potentials [B, Q, N, N] with lengths [B] (batch B * Q)."""
        batch, queries, size = scores.shape[:3]
        width = min(self.max_width, size)
        selected = spans_to_segments(scores.reshape(-1, size, size), width)  # [B', N, K]
        single = torch.zeros_like(selected)
        if width > 1:  # label 0: length-1 segments only
            single[..., 1:] = float("-inf")
        segments = torch.stack([single, selected], -1)  # [B', N, K, 2]
        flat_lengths = lengths.view(batch, 1).expand(batch, queries).reshape(-1)
        return SemiMarkovCRF(
            segments, self.transitions.to(scores.dtype), flat_lengths, validate_args=False
        )

    def forward(
        self,
        query: Tensor,
        memory: Tensor,
        mask: Tensor | None = None,
        values: Tensor | None = None,
    ) -> SpanAttentionOutput:
        query3, single = as_queries(query)
        memory = check_memory(memory)
        batch, size = memory.shape[:2]
        if query3.shape[0] != batch:
            raise ValueError(f"`query` has batch {query3.shape[0]}, `memory` has {batch}")
        if query3.shape[-1] != self.query_dim or memory.shape[-1] != self.memory_dim:
            raise ValueError(
                f"`query` and `memory` must have {self.query_dim} and {self.memory_dim} "
                f"features, got shapes {tuple(query.shape)} and {tuple(memory.shape)}"
            )
        values = memory if values is None else check_memory(values, "values")
        if values.shape[:2] != (batch, size):
            raise ValueError(f"`values` must have shape [{batch}, {size}, Dv]")
        mask, lengths = _real_lengths(memory, mask, self.validate_args)
        memory = memory.masked_fill(~mask.unsqueeze(-1), 0.0)
        values = values.masked_fill(~mask.unsqueeze(-1), 0.0)
        scores = self.scorer(query3, memory)  # [B, Q, N, N]
        crf = self.crf(scores, lengths)
        segment_marginals = structured_weights(crf, self.weights_mode)[..., 1]  # [B', N, K]
        marginals = segments_to_spans(segment_marginals).view(scores.shape)  # [B, Q, N, N]
        # p_k = sum of the selected segments [i, j] with i <= k <= j
        weights = corner_sums(marginals.triu()).diagonal(dim1=-2, dim2=-1)  # [B, Q, N]
        context = self.selection_context(weights, values)  # [B, Q, Dv]
        if single:
            return SpanAttentionOutput(context[:, 0], marginals[:, 0], weights[:, 0], scores[:, 0])
        return SpanAttentionOutput(context, marginals, weights, scores)
