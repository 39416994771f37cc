"""Semi-Markov chains: the forward pass over labelled segmentations.

Shapes: ``segment_scores`` [B, N, K, C] with ``segment_scores[b, i, k, c]`` the score of a
segment of positions i..i+k (length k + 1 <= K) labelled c; ``transitions`` [B, C, C] with
``transitions[b, a, c]`` the score of a segment labelled c right after one labelled a.
A segmentation of n = lengths[b] positions tiles 0..n-1 with labelled segments of length
at most K (none runs past n); its score is the sum of its segments' scores and of the
transitions between consecutive segments.

The forward recursion (time O(B N (K C + C^2)) in N sequential steps, memory O(B N K C)):

    beta(0, c)  = 0                                  (a segment may start at 0)
    alpha(t, c) = ⊕_{k < K, k <= t} beta(t - k, c) + s(t - k, k, c)   (last segment ends at t)
    beta(t, c)  = ⊕_a alpha(t - 1, a) + T(a, c)      (a segment labelled c starts at t)
    ⊕ over segmentations = ⊕_c alpha(n - 1, c)

is written once against a semiring (:mod:`structattn.semirings`). Each step reads a window
[B, K, C] of the last K betas, rebuilt by one ``cat``, and the scores of the segments that
end at t, [B, K, C], taken from one end-indexed gather of ``segment_scores``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import last_index
from ..semirings import Semiring
from ._ops import tensor_cache

__all__ = ["segment_mask", "semi_markov_inside", "segments_by_end"]


@tensor_cache(maxsize=64)
def _end_index(size: int, width: int, device: torch.device) -> Tensor:
    """Flat [N * K] positions, in ``segment_scores`` [N, K] padded with K - 1 leading rows,
    of the segment that ends at t with length k + 1 (start t - k + K - 1 in the padded rows)."""
    with torch.inference_mode(False):
        t = torch.arange(size, device=device).unsqueeze(-1)  # [N, 1]
        k = torch.arange(width, device=device)  # [K]
        return ((t - k + width - 1) * width + k).flatten()


def segments_by_end(segment_scores: Tensor) -> Tensor:
    """[B, N, K, C]: ``out[:, t, k] = segment_scores[:, t - k, k]`` (the segment of length
    k + 1 ending at t), ``-inf`` where it would start before 0. One gather."""
    batch, size, width, labels = segment_scores.shape
    pad = segment_scores.new_full((batch, width - 1, width, labels), float("-inf"))
    padded = torch.cat([pad, segment_scores], 1)  # [B, K - 1 + N, K, C]
    flat = padded.reshape(batch, (width - 1 + size) * width, labels)
    index = _end_index(size, width, segment_scores.device)
    return flat.index_select(1, index).view(batch, size, width, labels)


def segment_mask(
    lengths: Tensor | None, batch: int, size: int, width: int, device: torch.device
) -> Tensor:
    """BoolTensor [B, N, K]: True at the segments i..i+k that end inside the item
    (i + k < lengths[b])."""
    end = torch.arange(size, device=device).unsqueeze(-1) + torch.arange(width, device=device)
    if lengths is None:
        return (end < size).expand(batch, size, width)
    return end < lengths.view(-1, 1, 1)


def semi_markov_inside(
    segment_scores: Tensor,
    transitions: Tensor,
    lengths: Tensor | None,
    semiring: type[Semiring],
) -> Tensor:
    """⊕ over the labelled segmentations of each item of their scores, [B].

    ``segment_scores`` [B, N, K, C] (segments past the length are never read into the
    result, but must not be NaN: callers sanitise the padding), ``transitions`` [B, C, C].
    ``-inf`` forbids a segment or a transition; an item with no allowed segmentation gives
    ``-inf``.
    """
    batch, size, width, labels = segment_scores.shape
    last = last_index(lengths, batch, size, segment_scores.device)  # [B]
    ends = segments_by_end(segment_scores)  # [B, N, K, C]
    # window[b, k, c] = beta(t - k, c): beta(0) = 0, none before position 0
    window = torch.cat(
        [
            segment_scores.new_zeros(batch, 1, labels),
            segment_scores.new_full((batch, width - 1, labels), float("-inf")),
        ],
        1,
    )
    alphas = []
    for t in range(size):
        # alpha(t, c) = ⊕_k beta(t - k, c) + s(t - k, k, c)   [B, C]
        alpha = semiring.sum(window + ends[:, t], dim=1)
        alphas.append(alpha)
        if t + 1 < size:
            # beta(t + 1, c) = ⊕_a alpha(t, a) + T(a, c)   [B, C]
            beta = semiring.sum(alpha.unsqueeze(-1) + transitions, dim=1)
            window = torch.cat([beta.unsqueeze(1), window[:, :-1]], 1)
    if not alphas:
        return segment_scores.new_full((batch,), float("-inf"))
    final = torch.stack(alphas, 1)  # [B, N, C]
    index = last.view(-1, 1, 1).expand(batch, 1, labels)
    return semiring.sum(final.gather(1, index).squeeze(1), dim=-1)
