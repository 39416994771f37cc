"""Projective dependency trees: Eisner's inside algorithm in any semiring, tree checks.

Shapes: ``arc_scores`` [B, N, N] with position 0 the ROOT symbol and ``arc_scores[b, h, m]``
the score of the arc h -> m; ``lengths`` [B] counts positions including ROOT.

Charts ([B, N, N], batch first; ``s < t``):
  ``complete[s, t]``   right complete span s..t headed at s;   ``complete[t, s]`` left, head t.
  ``incomplete[s, t]`` arc s -> t spanning s..t;               ``incomplete[t, s]`` arc t -> s.
Each span width w is one batched step over all N - w spans, reading "stripes" (strided views
of the charts) of the narrower spans. Time O(B N^3), N sequential steps.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..semirings import Semiring

__all__ = ["eisner_inside", "is_projective", "is_tree", "tree_score"]


def _stripe(x: Tensor, n: int, w: int, row: int, col: int, horizontal: bool = True) -> Tensor:
    """[B, n, w] strided view of a [B, N, N] chart.

    horizontal: ``out[b, i, j] = x[b, row + i, col + i + j]``
    vertical:   ``out[b, i, j] = x[b, row + i + j, col + i]``
    """
    size = x.shape[-1]
    return x.as_strided(
        (x.shape[0], n, w),
        (x.stride(0), size + 1, 1 if horizontal else size),
        x.storage_offset() + row * size + col,
    )


def eisner_inside(
    arc_scores: Tensor, lengths: Tensor | None, multiroot: bool, semiring: type[Semiring]
) -> Tensor:
    """⊕ over projective trees of the tree score (sum of arc scores), shape [B].

    ``arc_scores`` must already have ``-inf`` in column 0 (no arc into ROOT).
    """
    batch, size, _ = arc_scores.shape
    device = arc_scores.device
    if lengths is None:
        lengths = torch.full((batch,), size, dtype=torch.long, device=device)
    last = lengths - 1  # [B] index of the last real position
    complete = arc_scores.new_zeros(batch, size, size)
    incomplete = arc_scores.new_zeros(batch, size, size)
    for w in range(1, size):
        n = size - w
        # inner[b, s] = ⊕_{s<=k<t} complete[s, k] + complete[t, k+1],  t = s + w   [B, n]
        inner = semiring.sum(_stripe(complete, n, w, 0, 0) + _stripe(complete, n, w, w, 1), dim=-1)
        incomplete.diagonal(-w, 1, 2).copy_(inner + arc_scores.diagonal(-w, 1, 2))  # t -> s
        incomplete.diagonal(w, 1, 2).copy_(inner + arc_scores.diagonal(w, 1, 2))  # s -> t
        # left complete[t, s] = ⊕_{s<=k<t} complete[k, s] + incomplete[t, k]
        left = semiring.sum(
            _stripe(complete, n, w, 0, 0, horizontal=False) + _stripe(incomplete, n, w, w, 0),
            dim=-1,
        )
        complete.diagonal(-w, 1, 2).copy_(left)
        # right complete[s, t] = ⊕_{s<k<=t} incomplete[s, k] + complete[k, t]
        right = semiring.sum(
            _stripe(incomplete, n, w, 0, 1) + _stripe(complete, n, w, 1, w, horizontal=False),
            dim=-1,
        )
        if not multiroot:
            # ROOT's right span may only be closed at the sentence end: one child of ROOT
            root_open = torch.zeros(batch, n, dtype=torch.bool, device=device)
            root_open[:, 0] = last != w
            right = right.masked_fill(root_open, float("-inf"))
        complete.diagonal(w, 1, 2).copy_(right)
    return complete[:, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)


def tree_score(arc_scores: Tensor, heads: Tensor, mask: Tensor) -> Tensor:
    """Sum of the scores of the arcs heads[m] -> m over real modifiers (``mask``), [B]."""
    safe = heads.masked_fill(~mask, 0).clamp(0, arc_scores.shape[-1] - 1)
    scores = arc_scores.gather(1, safe.unsqueeze(1)).squeeze(1)  # [B, N]: arc heads[m] -> m
    return scores.masked_fill(~mask, 0.0).sum(-1)


def is_tree(heads: Tensor, lengths: Tensor, multiroot: bool) -> Tensor:
    """BoolTensor [B]: ``heads`` [B, N] is a tree over positions 1..len-1 rooted at 0.

    Real modifiers are positions 1..lengths-1; entries at 0 and at padding are ignored.
    With ``multiroot=False`` exactly one modifier has head 0.
    """
    batch, size = heads.shape
    device = heads.device
    pos = torch.arange(size, device=device)
    real = (pos >= 1) & (pos < lengths.unsqueeze(-1))  # [B, N]
    in_range = (heads >= 0) & (heads < lengths.unsqueeze(-1)) & (heads != pos)
    ok = (in_range | ~real).all(-1)
    parent = torch.where(real & in_range, heads, torch.zeros_like(heads))
    for _ in range(max(1, math.ceil(math.log2(max(size, 2)))) + 1):
        parent = parent.gather(1, parent)  # pointer jumping: ancestor 2^k steps up
    ok &= ((parent == 0) | ~real).all(-1)  # every real node reaches ROOT: no cycle
    if not multiroot:
        ok &= ((heads == 0) & real).sum(-1) == 1
    return ok


def is_projective(heads: Tensor, lengths: Tensor) -> Tensor:
    """BoolTensor [B]: no two arcs of ``heads`` [B, N] cross (ROOT at position 0 included)."""
    size = heads.shape[1]
    pos = torch.arange(size, device=heads.device)
    real = (pos >= 1) & (pos < lengths.unsqueeze(-1))
    safe = heads.masked_fill(~real, 0)
    left = torch.minimum(safe, pos).unsqueeze(-1)  # [B, N, 1]
    right = torch.maximum(safe, pos).unsqueeze(-1)
    # arcs a (rows) and b (cols) cross if left_a < left_b < right_a < right_b
    cross = (
        (left < left.transpose(1, 2))
        & (left.transpose(1, 2) < right)
        & (right < right.transpose(1, 2))
    )
    both = real.unsqueeze(-1) & real.unsqueeze(1)
    return ~(cross & both).flatten(1).any(-1)
