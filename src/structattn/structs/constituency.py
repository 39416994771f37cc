"""Binary bracketings: the CKY inside pass over span scores, and span helpers.

Shapes: ``span_scores`` [B, N, N] with ``span_scores[b, i, j]`` the score of the span of
words i..j inclusive (i <= j; entries below the diagonal are never read); ``lengths`` [B]
counts words. A binary bracketing of n words has 2n - 1 spans: every word, the whole
sentence, and the n - 2 other constituents; there are Catalan(n - 1) of them.

The dynamic program (time O(B N^3) in N - 1 sequential span widths, each one batched step
over all N - w + 1 spans of width w; memory O(B N^2) plus what autograd keeps, O(B N^3)):

    I(i, i) = s(i, i)
    I(i, j) = s(i, j) + ⊕_{i <= k < j} I(i, k) + I(k + 1, j)

is written once against a semiring (:mod:`structattn.semirings`): log Z in the log
semiring, the MAP score in the max semiring, an exact sample as the gradient of the
sampling semiring's pass. As in :func:`~structattn.structs.dependency.eisner_inside`, each
width reads two "stripes" [B, n, w - 1] of narrower spans (left pieces I(i, i+k), right
pieces I(i+k+1, j)), each rebuilt from the previous width's by one ``cat``: no in-place
writes into a chart, no strided views of a big tensor for autograd to scatter into.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._validation import last_index
from ..semirings import Semiring

__all__ = ["cky_inside", "span_mask", "spans_by_width", "spans_to_chart"]


@functools.lru_cache(maxsize=64)
def _width_index(size: int, device: torch.device) -> tuple[Tensor, list[int]]:
    """Flat [N * N] positions of the spans [i, i + w - 1], width by width (w = 1 .. N; per
    width the N - w + 1 starts in order), and the per-width counts."""
    with torch.inference_mode(False):
        index = []
        for w in range(1, size + 1):
            start = torch.arange(size - w + 1, device=device)
            index.append(start * size + start + w - 1)
        if not index:
            return torch.zeros(0, dtype=torch.long, device=device), []
        return torch.cat(index), [size - w + 1 for w in range(1, size + 1)]


def spans_by_width(x: Tensor) -> list[Tensor]:
    """``out[w]`` [B, N - w + 1]: ``x[:, i, i + w - 1]`` for the spans of width w = 1 .. N, by
    one gather (``out[0]`` is an empty placeholder). ``x`` [B, N, N]."""
    batch, size, _ = x.shape
    index, counts = _width_index(size, x.device)
    flat = x.reshape(batch, size * size).index_select(1, index)
    return [flat[:, :0], *flat.split(counts, 1)]


def spans_to_chart(per_width: list[Tensor]) -> Tensor:
    """The inverse of :func:`spans_by_width` (without its placeholder): ``per_width[w - 1]``
    [B, N - w + 1] for w = 1 .. N into a chart [B, N, N], 0 below the diagonal. One scatter."""
    batch, size = per_width[0].shape
    index, _ = _width_index(size, per_width[0].device)
    flat = per_width[0].new_zeros(batch, size * size)
    return flat.index_copy(1, index, torch.cat(per_width, 1)).view(batch, size, size)


def span_mask(lengths: Tensor | None, batch: int, size: int, device: torch.device) -> Tensor:
    """BoolTensor [B, N, N]: True at the spans [i, j] of each item (i <= j < lengths[b])."""
    pos = torch.arange(size, device=device)
    upper = pos.unsqueeze(-1) <= pos  # [N, N]: i <= j
    if lengths is None:
        return upper.expand(batch, size, size)
    return upper & (pos < lengths.view(-1, 1, 1))  # j < length (then i < length too)


def cky_inside(span_scores: Tensor, lengths: Tensor | None, semiring: type[Semiring]) -> Tensor:
    """⊕ over the binary bracketings of each item of the sum of its spans' scores, [B].

    ``span_scores`` [B, N, N] (labels already summed out); entries outside the item (below
    the diagonal, past its length) are never read, but must not be NaN where autograd
    multiplies them (callers sanitise the padding). ``-inf`` forbids a span; an item with no
    allowed bracketing gives the semiring zero, ``-inf``.
    """
    batch, size, _ = span_scores.shape
    last = last_index(lengths, batch, size, span_scores.device)  # [B]: n - 1, the top width - 1
    spans = spans_by_width(span_scores)  # spans[w]: [B, N - w + 1]
    inside = spans[1]  # I(i, i), [B, N]
    tops = [inside[:, :1]]  # I(0, w - 1) for w = 1 .. N
    left: Tensor | None = None
    right: Tensor | None = None
    for w in range(2, size + 1):
        n = size - w + 1  # spans [i, j = i + w - 1]
        # stripes [B, n, w - 1], split k = 0 .. w - 2 (left piece of width k + 1):
        #   left[b, i, k]  = I(i, i + k)
        #   right[b, i, k] = I(i + k + 1, j)
        # the newest column of each is the width w - 1 of the previous step, [B, n + 1]
        new_left = inside[:, :n, None]
        new_right = inside[:, 1:, None]
        left = new_left if left is None else torch.cat([left[:, :n], new_left], -1)
        right = new_right if right is None else torch.cat([new_right, right[:, 1:]], -1)
        # I(i, j) = s(i, j) + ⊕_k I(i, i + k) + I(i + k + 1, j)   [B, n]
        inside = spans[w] + semiring.sum(left + right, dim=-1)
        tops.append(inside[:, :1])
    top = torch.cat(tops, -1).gather(1, last.unsqueeze(-1))  # [B, 1]: I(0, n - 1)
    # ⊕ over one term: the same value, but the gradient of an item with no allowed tree
    # (-inf) is 0 at its whole-sentence span too (the safe logsumexp's convention)
    return semiring.sum(top, dim=-1)
