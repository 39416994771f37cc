"""Projective dependency trees: Eisner's inside algorithm in any semiring, tree checks.

Shapes: ``arc_scores`` [B, N, N] with position 0 the ROOT symbol and ``arc_scores[b, h, m]``
the score of the arc h -> m; ``lengths`` [B] counts positions including ROOT.

Charts ([B, N, N], batch first; ``s < t``):
  ``complete[s, t]``   right complete span s..t headed at s;   ``complete[t, s]`` left, head t.
  ``incomplete[s, t]`` arc s -> t spanning s..t;               ``incomplete[t, s]`` arc t -> s.
Each span width w is one batched step over all N - w spans, reading "stripes" [B, 2, N - w, w]
of the narrower spans. The charts are never materialised: each stripe is rebuilt from the
previous step's by one ``cat`` (drop a row, add the new width's column), so autograd sees
no in-place writes and no strided views of a big tensor (whose backward would allocate and
scatter into a full [B, N, N] chart at every step). Time O(B N^3), N sequential steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..semirings import LogSemiring, Semiring

__all__ = ["eisner_inside", "eisner_log_partition", "is_projective", "is_tree", "tree_score"]


def _skew(arc_scores: Tensor) -> tuple[Tensor, ...]:
    """Per-width arc scores from one gather: ``out[w][b, 0, s] = arc_scores[b, s + w, s]``
    (arc t -> s), ``out[w][b, 1, s] = arc_scores[b, s, s + w]`` (arc s -> t), for
    ``s < N - w`` (entries beyond are padding)."""
    batch, size, _ = arc_scores.shape
    pos = torch.arange(size, device=arc_scores.device)
    start = pos.view(1, 1, size)
    end = (start + pos.view(size, 1, 1)).clamp_max(size - 1)  # [N(width), 1, N(start)]
    index = torch.cat([end * size + start, start * size + end], 1)  # [N, 2, N]
    flat = arc_scores.reshape(batch, size * size)
    skewed = flat.gather(1, index.view(1, -1).expand(batch, -1))
    return skewed.view(batch, size, 2, size).unbind(1)


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
    arcs = _skew(arc_scores)
    if not multiroot:
        widths = torch.arange(size, device=device)
        # root_open[w, b, 1, 0]: ROOT's right span of width w is not the whole sentence
        root_open = torch.zeros(size, batch, 2, size, dtype=torch.bool, device=device)
        root_open[:, :, 1, 0] = last.unsqueeze(0) != widths.unsqueeze(1)
    # Stripes [B, 2, n, w] (n = N - w spans of width w, j < w), maintained incrementally:
    #   comp_s = (complete[i+j, i], complete[i, i+j])
    #   comp_e = (complete[i+w, i+1+j], complete[i+1+j, i+w])
    #   inc_s[b, i, j] = incomplete[i, i+1+j];  inc_e[b, i, j] = incomplete[i+w, i+j]
    comp_s = arc_scores.new_zeros(batch, 2, size - 1, 1)
    comp_e = comp_s
    inc_s: Tensor | None = None
    inc_e: Tensor | None = None
    tops = []
    for w in range(1, size):
        n = size - w
        # inner[b, s] = ⊕_{s<=k<t} complete[s, k] + complete[t, k+1],  t = s + w   [B, n]
        inner = semiring.sum(comp_s[:, 1] + comp_e[:, 0], dim=-1)
        inc = inner.unsqueeze(1) + arcs[w][:, :, :n]  # [B, 2, n]: (t -> s, s -> t)
        new_s = inc[:, 1].unsqueeze(-1)
        new_e = inc[:, 0].unsqueeze(-1)
        inc_s = new_s if inc_s is None else torch.cat([inc_s[:, :n], new_s], -1)
        inc_e = new_e if inc_e is None else torch.cat([new_e, inc_e[:, 1:]], -1)
        # left  complete[t, s] = ⊕_{s<=k<t} complete[k, s] + incomplete[t, k]
        # right complete[s, t] = ⊕_{s<k<=t} incomplete[s, k] + complete[k, t]
        comp = semiring.sum(
            torch.stack([comp_s[:, 0] + inc_e, inc_s + comp_e[:, 1]], 1), dim=-1
        )  # [B, 2, n]
        if not multiroot:
            # ROOT's right span may only be closed at the sentence end: one child of ROOT
            comp = comp.masked_fill(root_open[w, :, :, :n], float("-inf"))
        tops.append(comp[:, 1, :1])
        if w < size - 1:
            comp_s = torch.cat([comp_s[:, :, : n - 1], comp[:, :, : n - 1, None]], -1)
            comp_e = torch.cat([comp[:, :, 1:, None], comp_e[:, :, 1:]], -1)
    top = torch.cat(tops, -1)  # [B, N-1]: complete[0, w] for w = 1..N-1
    return top.gather(1, (last - 1).unsqueeze(-1)).squeeze(-1)


# ---- log Z with a hand-written outside pass -----------------------------------------------------
# Charts in (start, width) layout, [B, 2, N, N]: ``chart[:, d, s, j]`` is the span s..s+j,
# d = 0 headed at its right end (left complete / arc s+j -> s), d = 1 headed at s. For width
# w and the n = N - w spans s..t (t = s + w), the narrower pieces are views, no copies:
#   slice   chart[:, :, :n, :w]              (s, j) -> span s..s+j
#   strided _ending(chart, w, 1)             (s, j) -> span s+1+j..t   (complete; j = w - 1: t..t)
#   strided _ending(chart[:, :1], w, 0)      (s, j) -> span s+j..t     (incomplete, left)
# Without autograd these are read and written in place; the backward walks the widths down,
# spreading each span's gradient over its split points with the softmax weights.
def _ending(chart: Tensor, width: int, first: int) -> Tensor:
    """View [B, D, N - width, width] of ``chart`` [B, D, N, N] (D directions):
    ``(s, j) -> chart[:, :, s + first + j, width - first - j]``, the spans ending at
    s + width that start at s + first + j."""
    batch, dirs, size, _ = chart.shape
    n = size - width
    b_stride, d_stride, row, _ = chart.stride()
    return chart.as_strided(
        (batch, dirs, n, width),
        (b_stride, d_stride, row, row - 1),
        chart.storage_offset() + first * row + width - first,
    )


def _safe(x: Tensor) -> Tensor:
    """``x`` with ``-inf`` replaced by 0 (a normaliser that keeps exp(-inf - it) = 0)."""
    return x.masked_fill(torch.isneginf(x), 0.0)


def _pieces(complete: Tensor, incomplete: Tensor, w: int) -> tuple[Tensor, ...]:
    """Views of the narrower spans combined by the spans of width ``w`` (n = N - w starts s,
    t = s + w; [B, ...]): ``starts`` [B, 2, n, w] spans s..s+j, ``ends`` [B, 2, n, w] spans
    s+1+j..t, ``inc_left`` [B, n, w] I_L(s+j, t), ``inc_right`` [B, n, w] I_R(s, s+1+j)."""
    n = complete.shape[2] - w
    return (
        complete[:, :, :n, :w],
        _ending(complete, w, 1),
        _ending(incomplete[:, :1], w, 0)[:, 0],
        incomplete[:, 1, :n, 1 : w + 1],
    )


def _eisner_charts(
    arc_scores: Tensor, last: Tensor, multiroot: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Inside pass on in-place charts (no autograd): (complete, incomplete, inner), the first
    two [B, 2, N, N] and ``inner`` [B, N, N], all in (start, width) layout."""
    batch, size, _ = arc_scores.shape
    arcs = _skew(arc_scores)  # per width [B, 2, N]: (t -> s, s -> t)
    complete = arc_scores.new_full((batch, 2, size, size), float("-inf"))
    complete[:, :, :, 0] = 0.0
    incomplete = torch.full_like(complete, float("-inf"))
    inner = arc_scores.new_full((batch, size, size), float("-inf"))  # [B, s, w]
    for w in range(1, size):
        n = size - w
        starts, ends, inc_left, _ = _pieces(complete, incomplete, w)
        # inner[s] = log sum_j C_R(s, s+j) + C_L(s+j+1, t)                    [B, n]
        inner[:, :n, w] = torch.logsumexp(starts[:, 1] + ends[:, 0], -1)
        # I(s, t) = inner + arc, both directions                              [B, 2, n]
        torch.add(inner[:, None, :n, w], arcs[w][:, :, :n], out=incomplete[:, :, :n, w])
        # C_L(s, t) = log sum_j C_L(s, s+j) + I_L(s+j, t)
        # C_R(s, t) = log sum_j I_R(s, s+1+j) + C_R(s+1+j, t)
        left = starts[:, 0] + inc_left  # [B, n, w]
        right = incomplete[:, 1, :n, 1 : w + 1] + ends[:, 1]  # [B, n, w]
        comp = torch.logsumexp(torch.stack([left, right], 1), -1)  # [B, 2, n]
        if not multiroot:  # ROOT's right span is closed only at the sentence end
            comp[:, 1, 0] = comp[:, 1, 0].masked_fill(last != w, float("-inf"))
        complete[:, :, :n, w] = comp
    return complete, incomplete, inner


def _normalisers(
    complete: Tensor, inner: Tensor, last: Tensor, multiroot: bool
) -> tuple[Tensor, Tensor]:
    """The charts as softmax normalisers: ``-inf`` -> 0 (so exp(-inf - it) = 0, not NaN) and
    the masked ROOT spans of single-root trees -> ``+inf`` (so their split weights are 0)."""
    complete_safe = _safe(complete)
    if not multiroot:
        closed = torch.arange(complete.shape[-1], device=last.device) == last.unsqueeze(-1)
        complete_safe[:, 1, 0].masked_fill_(~closed, float("inf"))
    return complete_safe, _safe(inner)


def _eisner_outside(
    charts: tuple[Tensor, Tensor, Tensor], norms: tuple[Tensor, Tensor], last: Tensor, seed: Tensor
) -> tuple[Tensor, Tensor]:
    """Outside pass by hand: d (seed . log Z) / d chart entry for the complete and incomplete
    charts ([B, 2, N, N] each); ``seed`` [B] is the incoming gradient of log Z."""
    complete, incomplete, inner = charts
    complete_safe, inner_safe = norms
    size = complete.shape[-1]
    g_comp = torch.zeros_like(complete)
    g_inc = torch.zeros_like(incomplete)
    g_comp[:, 1, 0].scatter_(1, last.unsqueeze(-1), seed.unsqueeze(-1))
    for w in range(size - 1, 0, -1):
        n = size - w
        starts, ends, inc_left, inc_right = _pieces(complete, incomplete, w)
        g = g_comp[:, :, :n, w].unsqueeze(-1)  # [B, 2, n, 1]
        norm = complete_safe[:, :, :n, w].unsqueeze(-1)
        # complete spans: softmax over the split points times their gradient
        p_left = (starts[:, 0] + inc_left - norm[:, 0]).exp_().mul_(g[:, 0])  # [B, n, w]
        p_right = (inc_right + ends[:, 1] - norm[:, 1]).exp_().mul_(g[:, 1])
        g_comp[:, 0, :n, :w] += p_left
        _ending(g_inc[:, :1], w, 0)[:, 0].add_(p_left)
        g_inc[:, 1, :n, 1 : w + 1] += p_right
        _ending(g_comp, w, 1)[:, 1].add_(p_right)
        # incomplete spans (every use is in complete spans of width >= w: done)
        g_inner = g_inc[:, :, :n, w].sum(1).unsqueeze(-1)  # [B, n, 1]
        p_in = (starts[:, 1] + ends[:, 0] - inner_safe[:, :n, w, None]).exp_().mul_(g_inner)
        g_comp[:, 1, :n, :w] += p_in
        _ending(g_comp, w, 1)[:, 0].add_(p_in)
    return g_comp, g_inc


def _arc_grads(g_inc: Tensor) -> Tensor:
    """[B, N, N] arc gradients from the incomplete chart's [B, 2, N, N] (an arc enters only
    its own span; entries beyond the chart's spans are 0)."""
    return _unskew(g_inc.permute(0, 3, 1, 2), g_inc.shape[-1])


def _eisner_hvp(
    charts: tuple[Tensor, Tensor, Tensor],
    norms: tuple[Tensor, Tensor],
    outside: tuple[Tensor, Tensor],
    direction: Tensor,
) -> Tensor:
    """Hessian of log Z times ``direction`` [B, N, N] (arc layout), i.e. the derivative of the
    marginals along ``direction``: forward-mode tangents of the inside pass (widths up), then
    of the outside pass (widths down), all by hand. With p_j the split weights of a span P
    (softmax over its terms A_j + B_j) and dot the tangent:
      inside   dot P = sum_j p_j (dot A_j + dot B_j)      (+ the arc's direction for I)
      outside  dot g(A_j) += p_j ((dot A_j + dot B_j - dot P) g(P) + dot g(P))   (same for B_j)
    and the result is dot g of the incomplete spans, mapped back to arcs."""
    complete, incomplete, inner = charts
    complete_safe, inner_safe = norms
    g_comp, g_inc = outside
    size = complete.shape[-1]
    dirs = _skew(direction)
    d_comp = torch.zeros_like(complete)
    d_inc = torch.zeros_like(incomplete)
    d_inner = torch.zeros_like(inner)
    for w in range(1, size):
        n = size - w
        starts, ends, inc_left, inc_right = _pieces(complete, incomplete, w)
        d_starts, d_ends, d_inc_left, d_inc_right = _pieces(d_comp, d_inc, w)
        p_in = (starts[:, 1] + ends[:, 0] - inner_safe[:, :n, w, None]).exp_()  # [B, n, w]
        d_inner[:, :n, w] = (p_in * (d_starts[:, 1] + d_ends[:, 0])).sum(-1)
        torch.add(d_inner[:, None, :n, w], dirs[w][:, :, :n], out=d_inc[:, :, :n, w])
        norm = complete_safe[:, :, :n, w].unsqueeze(-1)
        p_left = (starts[:, 0] + inc_left - norm[:, 0]).exp_()
        p_right = (inc_right + ends[:, 1] - norm[:, 1]).exp_()
        d_comp[:, 0, :n, w] = (p_left * (d_starts[:, 0] + d_inc_left)).sum(-1)
        d_comp[:, 1, :n, w] = (p_right * (d_inc_right + d_ends[:, 1])).sum(-1)
    dg_comp = torch.zeros_like(complete)
    dg_inc = torch.zeros_like(incomplete)
    for w in range(size - 1, 0, -1):
        n = size - w
        starts, ends, inc_left, inc_right = _pieces(complete, incomplete, w)
        d_starts, d_ends, d_inc_left, d_inc_right = _pieces(d_comp, d_inc, w)
        norm = complete_safe[:, :, :n, w].unsqueeze(-1)
        g = g_comp[:, :, :n, w].unsqueeze(-1)  # [B, 2, n, 1]
        dg = dg_comp[:, :, :n, w].unsqueeze(-1)
        dp = d_comp[:, :, :n, w].unsqueeze(-1)
        p_left = (starts[:, 0] + inc_left - norm[:, 0]).exp_()
        t_left = (d_starts[:, 0] + d_inc_left - dp[:, 0]).mul_(g[:, 0]).add_(dg[:, 0]).mul_(p_left)
        p_right = (inc_right + ends[:, 1] - norm[:, 1]).exp_()
        t_right = (d_inc_right + d_ends[:, 1] - dp[:, 1]).mul_(g[:, 1]).add_(dg[:, 1]).mul_(p_right)
        dg_comp[:, 0, :n, :w] += t_left
        _ending(dg_inc[:, :1], w, 0)[:, 0].add_(t_left)
        dg_inc[:, 1, :n, 1 : w + 1] += t_right
        _ending(dg_comp, w, 1)[:, 1].add_(t_right)
        g_inner = g_inc[:, :, :n, w].sum(1).unsqueeze(-1)  # [B, n, 1]
        dg_inner = dg_inc[:, :, :n, w].sum(1).unsqueeze(-1)
        p_in = (starts[:, 1] + ends[:, 0] - inner_safe[:, :n, w, None]).exp_()
        t_in = d_starts[:, 1] + d_ends[:, 0] - d_inner[:, :n, w, None]
        t_in = t_in.mul_(g_inner).add_(dg_inner).mul_(p_in)
        dg_comp[:, 1, :n, :w] += t_in
        _ending(dg_comp, w, 1)[:, 0].add_(t_in)
    return _arc_grads(dg_inc)


class _EisnerLogPartition(torch.autograd.Function):
    """log Z over projective trees (forward: inside pass on in-place charts, no autograd
    graph; backward: the outside pass by hand, the marginals times the incoming gradient).
    When the backward is itself differentiated (``create_graph``), the marginals come from
    :class:`_EisnerMarginals`, whose backward is a hand-written Hessian-vector product."""

    @staticmethod
    def forward(ctx: Any, arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
        batch, size, _ = arc_scores.shape
        last = (
            torch.full((batch,), size - 1, dtype=torch.long, device=arc_scores.device)
            if lengths is None
            else lengths - 1
        )
        complete, incomplete, inner = _eisner_charts(arc_scores.detach(), last, multiroot)
        logz = complete[:, 1, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)  # [B]
        ctx.save_for_backward(arc_scores, complete, incomplete, inner, last)
        ctx.lengths = lengths
        ctx.multiroot = multiroot
        return logz

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        arc_scores, complete, incomplete, inner, last = ctx.saved_tensors
        charts = (complete, incomplete, inner)
        if torch.is_grad_enabled():  # differentiated again: one node with its own backward
            marginals = _EisnerMarginals.apply(
                arc_scores, grad, charts, last, ctx.lengths, ctx.multiroot
            )
            return marginals, None, None
        norms = _normalisers(complete, inner, last, ctx.multiroot)
        _, g_inc = _eisner_outside(charts, norms, last, grad)
        return _arc_grads(g_inc), None, None


class _EisnerMarginals(torch.autograd.Function):
    """``seed[b] * marginals[b]`` from saved inside charts (forward: the outside pass by
    hand); backward: ``seed[b]`` times the Hessian-vector product of log Z by hand (the
    tangents of the inside and outside passes). Differentiating that once more falls back to
    autograd through :func:`eisner_inside` (any order)."""

    @staticmethod
    def forward(
        ctx: Any,
        arc_scores: Tensor,
        seed: Tensor,
        charts: tuple[Tensor, Tensor, Tensor],
        last: Tensor,
        lengths: Tensor | None,
        multiroot: bool,
    ) -> Tensor:
        norms = _normalisers(charts[0], charts[2], last, multiroot)
        outside = _eisner_outside(charts, norms, last, torch.ones_like(seed))
        marginals = _arc_grads(outside[1])  # [B, N, N]
        ctx.save_for_backward(arc_scores, seed, marginals, last, *charts, *norms, *outside)
        ctx.lengths = lengths
        ctx.multiroot = multiroot
        return marginals * seed.view(-1, 1, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        arc_scores, seed, marginals, last, *saved = ctx.saved_tensors
        if ctx.needs_input_grad[0] and torch.is_grad_enabled():
            # third order and beyond: autograd through the inside pass
            logz = eisner_inside(arc_scores, ctx.lengths, ctx.multiroot, LogSemiring)
            (unit,) = torch.autograd.grad(logz.sum(), arc_scores, create_graph=True)
            scaled = grad * seed.view(-1, 1, 1)
            (hvp,) = torch.autograd.grad(unit, arc_scores, scaled, create_graph=True)
            return hvp, (grad * unit).flatten(1).sum(-1), None, None, None, None
        g_seed = (grad * marginals).flatten(1).sum(-1) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, g_seed, None, None, None, None
        charts = (saved[0], saved[1], saved[2])
        hvp = _eisner_hvp(charts, (saved[3], saved[4]), (saved[5], saved[6]), grad)
        return hvp * seed.view(-1, 1, 1), g_seed, None, None, None, None


def _unskew(skewed: Tensor, size: int) -> Tensor:
    """Adjoint of :func:`_skew`: [B, N, 2, N] per-width values back to [B, N, N] (the
    entries at starts ``s >= N - w`` must be 0)."""
    batch = skewed.shape[0]
    pos = torch.arange(size, device=skewed.device)
    start = pos.view(1, 1, size)
    end = (start + pos.view(size, 1, 1)).clamp_max(size - 1)
    index = torch.cat([end * size + start, start * size + end], 1)  # [N, 2, N]
    flat = skewed.new_zeros(batch, size * size)
    flat.scatter_add_(1, index.view(1, -1).expand(batch, -1), skewed.reshape(batch, -1))
    return flat.view(batch, size, size)


def eisner_log_partition(arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
    """log Z over projective trees, [B], like ``eisner_inside(..., LogSemiring)`` but with a
    hand-written outside pass as its backward (about half the time of autograd through the
    inside pass); ``arc_scores`` must already have ``-inf`` in column 0."""
    return _EisnerLogPartition.apply(arc_scores, lengths, multiroot)


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
