"""Recursive splitting (the PRPN notes, eq. 8): the inside pass over split trees.

A split tree of the positions a..b picks a *pivot* i in a..b and recurses on a..i-1 and
i+1..b (an empty part ends the recursion). Its *nodes* are the non-empty spans of the
recursion, n of them for n positions (every position is the pivot of exactly one node);
there are Catalan(n) split trees of n positions (the binary search trees on them). A node
[a, b] with pivot i scores ``node[a, b] + pivot[i]``; the dynamic program (time O(B N^3)
in N sequential span widths, each one batched step over the N - w + 1 spans of width w):

    I(a, a - 1) = 0                                                  (empty span)
    I(a, b)     = node(a, b) + ⊕_{a <= i <= b} pivot(i) + I(a, i - 1) + I(i + 1, b)

With ``node(a, b) = -logsumexp(pivot[a..b])`` the term of pivot i is its log-softmax over
the span, and I(a, b) = 0 for every span: the recursion is a generative process whose
inside values are all log 1 (:class:`~structattn.distributions.SplitTreeDistribution`).
The stripes are kept as in :func:`~structattn.structs.constituency.cky_inside`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import last_index
from ..semirings import Semiring
from .constituency import spans_by_width

__all__ = ["split_inside"]


@full_precision
def split_inside(
    node: Tensor, pivot: Tensor, lengths: Tensor | None, semiring: type[Semiring]
) -> Tensor:
    """⊕ over the split trees of each item of the sum of its node and pivot scores, [B].

    ``node`` [B, N, N] (``node[b, a, c]`` scores the node a..c inclusive; entries below the
    diagonal and past the length are never read), ``pivot`` [B, N]; both must be free of
    NaN where autograd reads them (callers sanitise the padding).
    """
    batch, size = pivot.shape
    last = last_index(lengths, batch, size, pivot.device)  # [B]: n - 1
    spans = spans_by_width(node)  # spans[w]: [B, N - w + 1]
    inside = pivot.new_zeros(batch, size + 1)  # I of the empty spans at a = 0 .. N
    tops = []  # I(0, w - 1) for w = 1 .. N
    left: Tensor | None = None
    right: Tensor | None = None
    for w in range(1, size + 1):
        n = size - w + 1  # spans [a, b = a + w - 1]
        # stripes [B, n, w], pivot i = a + k for k = 0 .. w - 1:
        #   left[b, a, k]  = I(a, a + k - 1)   (width k)
        #   right[b, a, k] = I(a + k + 1, b)   (width w - 1 - k)
        #   piv[b, a, k]   = pivot(a + k)      (a strided view)
        # the newest column of each is the width w - 1 of the previous step, [B, n + 1]
        new_left = inside[:, :n, None]
        new_right = inside[:, 1:, None]
        left = new_left if left is None else torch.cat([left[:, :n], new_left], -1)
        right = new_right if right is None else torch.cat([new_right, right[:, 1:]], -1)
        piv = pivot.unfold(1, w, 1)
        # I(a, b) = node(a, b) + ⊕_k pivot(a + k) + I(a, a + k - 1) + I(a + k + 1, b)  [B, n]
        inside = spans[w] + semiring.sum(left + piv + right, dim=-1)
        tops.append(inside[:, :1])
    if not tops:
        return pivot.new_zeros(batch)
    top = torch.cat(tops, -1)  # [B, N]
    return top.gather(1, last.unsqueeze(-1)).squeeze(-1)
