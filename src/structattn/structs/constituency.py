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

import torch
from torch import Tensor

from .._validation import last_index
from ..semirings import LogSemiring, Semiring
from ._ops import tensor_cache

__all__ = [
    "cky_inside",
    "cky_kbest",
    "cky_marginals",
    "span_mask",
    "spans_by_width",
    "spans_to_chart",
]


@tensor_cache(maxsize=64)
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
    """``out[w]`` [B, N - w + 1, *]: ``x[:, i, i + w - 1]`` for the spans of width
    w = 1 .. N, by one gather (``out[0]`` is an empty placeholder). ``x`` [B, N, N, *]."""
    batch, size = x.shape[:2]
    index, counts = _width_index(size, x.device)
    flat = x.reshape(batch, size * size, *x.shape[3:]).index_select(1, index)
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


def _inside_chart(span_scores: Tensor, semiring: type[Semiring]) -> list[tuple[Tensor, Tensor]]:
    """By width (``out[w - 1]``, w = 1 .. N): (inner, inside) [B, N - w + 1] of the spans
    [i, i + w - 1]: inner = ⊕ over the splits of the sum of the two children's inside values
    (0 for a word), inside I = inner + the span's score."""
    size = span_scores.shape[1]
    spans = spans_by_width(span_scores)  # spans[w]: [B, N - w + 1]
    chart = [(torch.zeros_like(spans[1]), spans[1])]  # I(i, i) = s(i, i)
    inside = spans[1]
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
        inner = semiring.sum(left + right, dim=-1)
        inside = spans[w] + inner
        chart.append((inner, inside))
    return chart


def cky_inside(span_scores: Tensor, lengths: Tensor | None, semiring: type[Semiring]) -> Tensor:
    """⊕ over the binary bracketings of each item of the sum of its spans' scores, [B].

    ``span_scores`` [B, N, N] (labels already summed out); entries outside the item (below
    the diagonal, past its length) are never read, but must not be NaN where autograd
    multiplies them (callers sanitise the padding). ``-inf`` forbids a span; an item with no
    allowed bracketing gives the semiring zero, ``-inf``.
    """
    batch, size, _ = span_scores.shape
    last = last_index(lengths, batch, size, span_scores.device)  # [B]: n - 1, the top width - 1
    chart = _inside_chart(span_scores, semiring)
    tops = torch.cat([inside[:, :1] for _, inside in chart], -1)  # [B, N]: I(0, w - 1)
    top = tops.gather(1, last.unsqueeze(-1))  # [B, 1]: I(0, n - 1)
    # ⊕ over one term: the same value, but the gradient of an item with no allowed tree
    # (-inf) is 0 at its whole-sentence span too (the safe logsumexp's convention)
    return semiring.sum(top, dim=-1)


@tensor_cache(maxsize=64)
def _parent_index(size: int, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    """Per width w = 1 .. N - 1 (``out[w - 1]``): flat positions in a chart [N * N + 1]
    (last entry a sentinel) of (parent, sibling) [N - w + 1, 2 (N - w)] for every span
    [i, j = i + w - 1] and sibling width d = 1 .. N - w: first as the left child of
    [i, j + d] (sibling [j + 1, j + d]), then as the right child of [i - d, j] (sibling
    [i - d, i - 1]); the sentinel where that parent would leave 0..N-1."""
    with torch.inference_mode(False):
        out = []
        sentinel = size * size
        for w in range(1, size):
            i = torch.arange(size - w + 1, device=device).unsqueeze(-1)  # [n, 1]
            j = i + w - 1
            d = torch.arange(1, size - w + 1, device=device)  # [N - w]
            ok_left = j + d < size
            ok_right = i - d >= 0
            parent = torch.cat([i * size + j + d, (i - d) * size + j], -1)
            sibling = torch.cat([(j + 1) * size + j + d, (i - d) * size + i - 1], -1)
            ok = torch.cat([ok_left, ok_right], -1)
            out.append((parent.where(ok, sentinel), sibling.where(ok, sentinel)))
        return out


@torch.no_grad()
def cky_marginals(span_scores: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """log Z [B] and the span marginals [B, N, N] by inside and outside passes written by
    hand (no autograd: for inference; the marginals are not differentiable).

    The outside pass runs in the probability domain, widest spans first: a span's marginal
    is the sum, over the parents it can be a child of, of the parent's marginal times the
    probability of the parent's split that makes it a child,

        p(i, j) = Σ_{d >= 1} p(i, j + d) exp(I(i, j) + I(j + 1, j + d) - inner(i, j + d))
                           + p(i - d, j) exp(I(i - d, i - 1) + I(i, j) - inner(i - d, j)),

    with p(0, n - 1) = 1 and inner(a, b) = I(a, b) - s(a, b) the log-sum over the splits of
    [a, b] as the inside pass computed it (so a split's probability is a softmax of the
    inside pass's own terms: no difference of large, separately rounded numbers, which
    exp(outside + inside - log Z) would be). Time O(B N^3) (one gather and one reduction per
    width), memory O(B N^2) plus O(N^3) cached indices. ``span_scores`` as for
    :func:`cky_inside`.
    """
    batch, size, _ = span_scores.shape
    device = span_scores.device
    last = last_index(lengths, batch, size, device)  # [B]: n - 1
    chart = _inside_chart(span_scores, LogSemiring)
    inside = spans_to_chart([inside for _, inside in chart]).view(batch, size * size)
    logz = inside.gather(1, last.unsqueeze(-1)).squeeze(-1)  # I(0, n - 1), [B]
    # flat charts [B, N * N + 1] whose last entry is the sentinel of a missing parent
    inside = torch.cat([inside, span_scores.new_full((batch, 1), float("-inf"))], 1)
    inner = spans_to_chart([inner for inner, _ in chart]).view(batch, size * size)
    inner = torch.cat([inner.masked_fill(torch.isneginf(inner), 0.0), inner[:, :1] * 0], 1)
    marginals = span_scores.new_zeros(batch, size * size + 1)
    widths = torch.arange(1, size + 1, device=device)
    index, counts = _width_index(size, device)
    flat_index = index.split(counts)
    parents = _parent_index(size, device)
    for w in range(size, 0, -1):
        n = size - w + 1
        own = inside[:, flat_index[w - 1]]  # [B, n]: I(i, j)
        if w < size:
            parent, sibling = parents[w - 1]  # [n, 2 (N - w)]
            shape = (batch, *parent.shape)
            # [B, n, 2 (N - w)]: I(i, j) + I(sibling) - inner(parent), then the split's
            # probability times the parent's marginal
            split = inside.index_select(1, sibling.flatten()).view(shape) + own.unsqueeze(-1)
            split -= inner.index_select(1, parent.flatten()).view(shape)
            split = split.exp_() * marginals.index_select(1, parent.flatten()).view(shape)
            p_w = split.sum(-1)  # [B, n]
        else:
            p_w = span_scores.new_zeros(batch, n)
        # the whole sentence of each item of length w, if it has a tree at all
        root = (widths[w - 1] == last + 1) & torch.isfinite(logz)  # [B]
        p_w[:, 0] = torch.where(root, 1.0, p_w[:, 0])
        marginals[:, flat_index[w - 1]] = p_w
    mask = span_mask(lengths, batch, size, device).reshape(batch, size * size)
    return logz, marginals[:, :-1].masked_fill(~mask, 0.0).view(batch, size, size)


def _topk(x: Tensor, k: int) -> Tensor:
    """The k largest values along the last dimension, [..., k], best first (``-inf`` where
    there are fewer than k)."""
    if x.shape[-1] < k:
        pad = x.new_full((*x.shape[:-1], k - x.shape[-1]), float("-inf"))
        x = torch.cat([x, pad], -1)
    return x.topk(k, dim=-1).values


def cky_kbest(span_scores: Tensor, lengths: Tensor | None, k: int) -> Tensor:
    """Scores of the k best (labelled) bracketings of each item, [B, k], best first
    (``-inf`` where an item has fewer than k allowed trees).

    ``span_scores`` [B, N, N, L] as for :func:`cky_inside` (labels not summed out). Each
    chart cell keeps the k best values of its span (k-best max-plus semiring; a tree has one
    derivation, so k best derivations are k best trees):

        V(i, j) = top_k { s(i, j, l) + v : l, v in top_k ⊕_split V(i, m) ⊗ V(m + 1, j) }

    where ⊗ adds every pair of the two children's k values. Differentiable: the gradient of
    the r-th value with respect to ``span_scores`` is the 0/1 indicator of the r-th tree (a
    tree's score is a sum of its spans' scores, and top-k routes the gradient to the chosen
    entry). Time O(B N^3 k^2 log k) in N sequential widths, memory O(B N^2 k) forward.
    """
    batch, size = span_scores.shape[:2]
    last = last_index(lengths, batch, size, span_scores.device)  # [B]: n - 1
    labels = _topk(span_scores, k)  # [B, N, N, k]: the k best labels of each span
    spans = spans_by_width(labels)  # spans[w]: [B, N - w + 1, k]
    best = spans[1]  # V(i, i): [B, N, k]
    tops = [best[:, :1]]  # V(0, w - 1): [B, 1, k]
    left: Tensor | None = None
    right: Tensor | None = None
    for w in range(2, size + 1):
        n = size - w + 1
        # stripes [B, n, w - 1, k] as in cky_inside: V(i, i + m), V(i + m + 1, j)
        new_left = best[:, :n, None]
        new_right = best[:, 1:, None]
        left = new_left if left is None else torch.cat([left[:, :n], new_left], 2)
        right = new_right if right is None else torch.cat([new_right, right[:, 1:]], 2)
        # every split and pair of children's values: [B, n, (w - 1) k k] -> top k  [B, n, k]
        pairs = (left.unsqueeze(-1) + right.unsqueeze(-2)).flatten(2)
        inner = _topk(pairs, k)
        # every label value with every inner value: [B, n, k k] -> top k  [B, n, k]
        best = _topk((spans[w].unsqueeze(-1) + inner.unsqueeze(-2)).flatten(2), k)
        tops.append(best[:, :1])
    top = torch.cat(tops, 1)  # [B, N, k]
    return top.gather(1, last.view(-1, 1, 1).expand(batch, 1, k)).squeeze(1)
