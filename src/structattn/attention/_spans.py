"""Span tensors and span self-attention weights (functions shared by
:mod:`structattn.attention.spans` and :mod:`structattn.attention.normalizers`).

Spans are written ``[i, j]`` (positions i..j inclusive, i <= j); span tensors are
``[*, N, N]`` with entries below the diagonal ignored. A semi-Markov segment (i, k) of
:class:`~structattn.distributions.SemiMarkovCRF` is the span [i, i + k].
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..distributions import SemiMarkovCRF, TreeCRF
from ..names import SPAN_STRUCTURES, SpanStructure, WeightKind
from ._weights import structured_weights

__all__ = [
    "check_structure",
    "corner_sums",
    "segments_to_spans",
    "span_coverage",
    "span_marginals",
    "span_membership",
    "span_self_attention_weights",
    "spans_to_segments",
    "widths",
]


# ---- span tensors ----------------------------------------------------------------------------
def widths(size: int, like: Tensor) -> Tensor:
    """[N, N]: j - i + 1 on and above the diagonal, 1 below (never divides by 0)."""
    pos = torch.arange(size, device=like.device)
    return (pos - pos.unsqueeze(-1) + 1).clamp_min(1).to(like.dtype)


def corner_sums(w: Tensor) -> Tensor:
    """C[*, a, b] = sum_{i <= a, j >= b} w[*, i, j] for w [*, N, N]."""
    return w.cumsum(-2).flip(-1).cumsum(-1).flip(-1)


def span_membership(marginals: Tensor) -> Tensor:
    r"""Self-attention weights [*, N, N] from span marginals [*, N, N] (``mu[i, j]`` =
    p(span [i, j] is in the structure); entries below the diagonal are ignored).

    Query q's weight on key k is the expected, normalised membership of k in q's spans:

    .. math:: w_{qk} = \frac{\sum_{[i, j] \ni q, k} \mu_{ij} / (j - i + 1)}
                            {\sum_{[i, j] \ni q} \mu_{ij}}

    i.e. E[sum over the spans c containing q of 1[k in c] / |c|] / E[number of spans
    containing q]: every span containing q spreads its weight uniformly over its members,
    averaged over q's spans. For a segmentation exactly one segment contains q, the
    denominator is 1 and w_qk = E[1[k in seg(q)] / |seg(q)|] exactly; for a binary tree q's
    spans are the chain from the word [q, q] to the sentence, and w is the ratio of the two
    expectations (both linear in the marginals). Rows sum to 1 where q is covered, 0 where
    it is not (padding). Time and memory O(N^2) per problem (two cumulative sums).
    """
    size = marginals.shape[-1]
    w = marginals.triu() / widths(size, marginals)  # mu / |span|
    corner = corner_sums(w)  # corner[a, b] = sum over spans [i <= a, j >= b]
    # spans containing q and k: i <= min(q, k), j >= max(q, k)
    numerator = corner.triu() + corner.transpose(-1, -2).tril(-1)  # [*, N, N]
    coverage = numerator.sum(-1, keepdim=True)  # = sum of mu over the spans containing q
    safe = torch.where(coverage > 0, coverage, torch.ones_like(coverage))
    return torch.where(coverage > 0, numerator / safe, torch.zeros_like(numerator))


def span_coverage(marginals: Tensor) -> Tensor:
    r"""Position weights [*, N] of span marginals [*, N, N]: the expected mean of one-hot
    positions over the spans of the structure,

    .. math:: \alpha_k = \frac{\sum_{[i, j] \ni k} \mu_{ij} / (j - i + 1)}{\sum_{i \le j} \mu_{ij}}

    (sums to 1 where any span has mass; 0 everywhere for an all-zero input). The context of
    ``SpanAttention(..., representation="mean")`` is sum_k alpha_k m_k."""
    size = marginals.shape[-1]
    upper = marginals.triu()
    w = upper / widths(size, marginals)
    covered = corner_sums(w).diagonal(dim1=-2, dim2=-1)  # [*, N]: spans i <= k <= j
    total = upper.sum((-1, -2)).unsqueeze(-1)  # expected number of spans
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, covered / safe, torch.zeros_like(covered))


def spans_to_segments(spans: Tensor, width: int) -> Tensor:
    """Span tensor [*, N, N] -> segment tensor [*, N, K] (``[..., i, k]`` = span [i, i + k];
    0 where i + k >= N)."""
    size = spans.shape[-1]
    pos = torch.arange(size, device=spans.device)
    end = pos.unsqueeze(-1) + torch.arange(width, device=spans.device)  # [N, K]
    inside = end < size
    index = end.clamp_max(size - 1).expand(*spans.shape[:-1], width)  # [*, N, K]
    return spans.gather(-1, index).masked_fill(~inside, 0.0)


def segments_to_spans(segments: Tensor) -> Tensor:
    """Segment tensor [*, N, K] -> span tensor [*, N, N] (segments past N are dropped)."""
    size, width = segments.shape[-2:]
    pos = torch.arange(size, device=segments.device)
    end = pos.unsqueeze(-1) + torch.arange(width, device=segments.device)  # [N, K]
    inside = end < size
    values = segments.masked_fill(~inside, 0.0)
    index = end.clamp_max(size - 1).expand(*segments.shape[:-1], width)
    out = segments.new_zeros(*segments.shape[:-1], size)
    return out.scatter_add(-1, index, values)


def span_marginals(
    span_scores: Tensor,
    lengths: Tensor,
    structure: SpanStructure,
    max_width: int | None = None,
    weights: WeightKind = "marginals",
) -> Tensor:
    """Span marginals [*, N, N] of span scores [*, N, N] (``[i, j]``: span i..j, i <= j)
    with lengths [*] >= 1: of a :class:`~structattn.distributions.TreeCRF`
    (``"constituency"``) or of a one-label :class:`~structattn.distributions.SemiMarkovCRF`
    whose segment (i, k) scores ``span_scores[i, i + k]`` (``"semi-markov"``, segments of
    at most ``max_width`` positions; None = N). One batched structure per leading index.
    ``weights`` "sparse" / "hard-st": SparseMAP's spans / the MAP structure's spans
    (straight-through) instead of the marginals."""
    if structure not in SPAN_STRUCTURES:
        raise ValueError(f"`structure` must be one of {SPAN_STRUCTURES}, got {structure!r}")
    size = span_scores.shape[-1]
    flat = span_scores.reshape(-1, size, size)  # [B', N, N]
    flat_lengths = lengths.reshape(-1)
    if structure == "constituency":
        tree = TreeCRF(flat, flat_lengths, validate_args=False)
        marginals = tree.marginals if weights == "marginals" else structured_weights(tree, weights)
    else:
        width = size if max_width is None else min(max_width, size)
        segments = spans_to_segments(flat, width).unsqueeze(-1)  # [B', N, K, 1]
        crf = SemiMarkovCRF(segments, None, flat_lengths, validate_args=False)
        chosen = crf.marginals if weights == "marginals" else structured_weights(crf, weights)
        marginals = segments_to_spans(chosen[..., 0])
    return marginals.reshape(span_scores.shape)


def check_structure(structure: object, max_width: object) -> None:
    if structure not in SPAN_STRUCTURES:
        raise ValueError(f"`structure` must be one of {SPAN_STRUCTURES}, got {structure!r}")
    if max_width is not None and (
        not isinstance(max_width, int) or isinstance(max_width, bool) or max_width < 1
    ):
        raise ValueError(f"`max_width` must be a positive int or None, got {max_width!r}")


def span_self_attention_weights(
    scores: Tensor,
    lengths: Tensor,
    structure: SpanStructure,
    max_width: int | None = None,
    weights: WeightKind = "marginals",
) -> Tensor:
    """Self-attention weights [*, L, L] of scores [*, L, L] (``S[q, k]``) with lengths [*]:
    the span [i, j] (i <= j) scores ``S[i, j]`` (start as query, end as key) in one
    structure per leading index (:func:`span_marginals`), and query q's weight on key k is
    the :func:`span_membership` of the marginals (``weights``: as :func:`span_marginals`).
    Rows beyond the length are 0."""
    return span_membership(span_marginals(scores, lengths, structure, max_width, weights))
