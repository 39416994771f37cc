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
from torch.autograd.function import once_differentiable

from ..semirings import LogSemiring, Semiring

__all__ = [
    "eisner_inside",
    "eisner_log_partition",
    "eisner_max",
    "is_projective",
    "is_tree",
    "tree_score",
]


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


# ---- log Z, marginals and their derivative by hand -------------------------------------------
# In-place charts without autograd: the inside pass (widths up), the outside pass (widths down,
# spreading each span's gradient over its split points with the softmax weights) and the
# tangents of both (the Hessian-vector product that trains structured attention).
def _safe(x: Tensor) -> Tensor:
    """``x`` with ``-inf`` replaced by 0 (a normaliser that keeps exp(-inf - it) = 0)."""
    return x.masked_fill(torch.isneginf(x), 0.0)


class _Stripes:
    """Per-width views of a chart [B, 2, N, N] in (start, width) layout (``x[:, d, s, j]`` is
    the span s..s+j headed at its right end for d = 0, at s for d = 1), each one
    ``as_strided`` call (this code is per-op-overhead bound at small N). For width w, the
    n = N - w spans s..t (t = s + w) and split index j < w, all [B, n, w]:
      ``start(x, d)``  x[d, s, j]             the span s..s+j
      ``end(x, d)``    x[d, s+1+j, w-1-j]     the span s+1+j..t
      ``inc_left(x)``  x[0, s+j, w-j]         the span s+j..t, headed at t
      ``inc_right(x)`` x[1, s, 1+j]           the span s..s+1+j, headed at s
      ``col(x)``       x[:, s, w]             the spans of width w, [B, 2, n]."""

    def __init__(self, chart: Tensor) -> None:
        batch, _, size, _ = chart.shape
        self.b, self.d, self.row, _ = chart.stride()
        self.size = size

    def start(self, x: Tensor, d: int, w: int) -> Tensor:
        return x.as_strided((x.shape[0], self.size - w, w), (self.b, self.row, 1), d * self.d)

    def end(self, x: Tensor, d: int, w: int) -> Tensor:
        return x.as_strided(
            (x.shape[0], self.size - w, w),
            (self.b, self.row, self.row - 1),
            d * self.d + self.row + w - 1,
        )

    def inc_left(self, x: Tensor, w: int) -> Tensor:
        return x.as_strided((x.shape[0], self.size - w, w), (self.b, self.row, self.row - 1), w)

    def inc_right(self, x: Tensor, w: int) -> Tensor:
        return x.as_strided((x.shape[0], self.size - w, w), (self.b, self.row, 1), self.d + 1)

    def col(self, x: Tensor, w: int) -> Tensor:
        return x.as_strided((x.shape[0], 2, self.size - w), (self.b, self.d, self.row), w)


def _eisner_charts(
    arc_scores: Tensor,
    last: Tensor,
    multiroot: bool,
    splits: list[tuple[Tensor, Tensor]] | None = None,
    weights: list[tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Inside pass on in-place charts (no autograd): (complete, incomplete, inner), the first
    two [B, 2, N, N] and ``inner`` [B, N, N] (``inner[b, s, w]``), in (start, width) layout.
    With ``splits`` (a list), the pass is in the max semiring and the best split points of
    widths 1 .. N-1 are appended to it: (inner [B, n], complete [B, 2, n]) LongTensors.
    With ``weights`` (a list), the split weights of widths 1 .. N-1 are appended to it (see
    :func:`_split_weights`)."""
    batch, size, _ = arc_scores.shape
    arcs = _skew(arc_scores)  # per width [B, 2, N]: (t -> s, s -> t)
    complete = arc_scores.new_full((batch, 2, size, size), float("-inf"))
    complete[:, :, :, 0] = 0.0
    incomplete = torch.full_like(complete, float("-inf"))
    inner = arc_scores.new_full((batch, size, size), float("-inf"))
    v = _Stripes(complete)
    for w in range(1, size):
        n = size - w
        # inner[s] = log sum_j C_R(s, s+j) + C_L(s+j+1, t)                    [B, n]
        terms_in = v.start(complete, 1, w) + v.end(complete, 0, w)  # [B, n, w]
        if weights is not None:
            lse_in, p_in = _logsumexp_softmax(terms_in)
            inner[:, :n, w] = lse_in
        elif splits is None:
            inner[:, :n, w] = torch.logsumexp(terms_in, -1)
        else:
            best_in, split_in = terms_in.max(-1)
            inner[:, :n, w] = best_in
        # I(s, t) = inner + arc, both directions                              [B, 2, n]
        torch.add(inner[:, None, :n, w], arcs[w][:, :, :n], out=v.col(incomplete, w))
        # C_L(s, t) = log sum_j C_L(s, s+j) + I_L(s+j, t)
        # C_R(s, t) = log sum_j I_R(s, s+1+j) + C_R(s+1+j, t)
        terms = torch.stack(
            [
                v.start(complete, 0, w) + v.inc_left(incomplete, w),
                v.inc_right(incomplete, w) + v.end(complete, 1, w),
            ],
            1,
        )  # [B, 2, n, w]
        if weights is not None:
            comp, p_comp = _logsumexp_softmax(terms)
            weights.append((p_in, p_comp))
        elif splits is None:
            comp = torch.logsumexp(terms, -1)  # [B, 2, n]
        else:
            comp, split_comp = terms.max(-1)
            splits.append((split_in, split_comp))
        if not multiroot:  # ROOT's right span is closed only at the sentence end
            comp[:, 1, 0].masked_fill_(last != w, float("-inf"))
            if weights is not None:
                p_comp[:, 1, 0].masked_fill_((last != w).unsqueeze(-1), 0.0)
        v.col(complete, w).copy_(comp)
    return complete, incomplete, inner


def _logsumexp_softmax(x: Tensor) -> tuple[Tensor, Tensor]:
    """(logsumexp(x, -1), softmax(x, -1)) in one go; both 0-safe: a slice of only ``-inf``
    gives ``-inf`` and all-zero weights."""
    top = x.amax(-1, keepdim=True).clamp_min_(torch.finfo(x.dtype).min)  # no -inf - -inf
    e = (x - top).exp_()
    total = e.sum(-1, keepdim=True)  # >= 1, or 0 when the slice is all -inf
    lse = total.log().add_(top).squeeze(-1)
    return lse, e.div_(total.clamp_min_(1.0))


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


# The split weights of the spans of one width: p_in [B, n, w] (inner), p_comp [B, 2, n, w]
# (left / right complete); kept from the inside pass for the outside pass and the
# Hessian-vector product when their total size is below this many elements (the small,
# overhead-bound problems), else recomputed (memory stays O(B N^2)).
_CACHE_ELEMENTS = 1 << 22


def _split_weights(
    charts: tuple[Tensor, Tensor, Tensor], norms: tuple[Tensor, Tensor], v: _Stripes, w: int
) -> tuple[Tensor, Tensor]:
    """(p_in [B, n, w], p_comp [B, 2, n, w]) of width ``w``: softmax over the split points."""
    complete, incomplete, inner = charts
    complete_safe, inner_safe = norms
    n = v.size - w
    p_in = v.start(complete, 1, w) + v.end(complete, 0, w)
    p_in = p_in.sub_(inner_safe[:, :n, w, None]).exp_()
    p_comp = torch.stack(
        [
            v.start(complete, 0, w) + v.inc_left(incomplete, w),
            v.inc_right(incomplete, w) + v.end(complete, 1, w),
        ],
        1,
    )
    p_comp = p_comp.sub_(v.col(complete_safe, w).unsqueeze(-1)).exp_()
    return p_in, p_comp


def _eisner_outside(
    charts: tuple[Tensor, Tensor, Tensor],
    norms: tuple[Tensor, Tensor],
    last: Tensor,
    seed: Tensor,
    cache: list[tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, Tensor]:
    """Outside pass by hand: d (seed . log Z) / d chart entry for the complete and incomplete
    charts ([B, 2, N, N] each); ``seed`` [B] is the incoming gradient of log Z. ``cache``:
    the split weights of widths 1 .. N-1 from the inside pass (else recomputed)."""
    complete = charts[0]
    size = complete.shape[-1]
    g_comp = torch.zeros_like(complete)
    g_inc = torch.zeros_like(complete)
    g_comp[:, 1, 0].scatter_(1, last.unsqueeze(-1), seed.unsqueeze(-1))
    v = _Stripes(complete)
    for w in range(size - 1, 0, -1):
        p_in, p_comp = cache[w - 1] if cache is not None else _split_weights(charts, norms, v, w)
        # complete spans: the split weights times their gradient go to both pieces
        q = p_comp * v.col(g_comp, w).unsqueeze(-1)  # [B, 2, n, w]
        v.start(g_comp, 0, w).add_(q[:, 0])
        v.inc_left(g_inc, w).add_(q[:, 0])
        v.inc_right(g_inc, w).add_(q[:, 1])
        v.end(g_comp, 1, w).add_(q[:, 1])
        # incomplete spans (every use is in complete spans of width >= w: done)
        q_in = p_in * v.col(g_inc, w).sum(1).unsqueeze(-1)  # [B, n, w]
        v.start(g_comp, 1, w).add_(q_in)
        v.end(g_comp, 0, w).add_(q_in)
    return g_comp, g_inc


def _arc_grads(g_inc: Tensor) -> Tensor:
    """[B, N, N] arc gradients from the incomplete chart's [B, 2, N, N] (an arc enters only
    its own span; entries beyond the chart's spans are 0)."""
    return _unskew(g_inc.permute(0, 3, 1, 2), g_inc.shape[-1])


def _tangent_sums(v: _Stripes, d_comp: Tensor, d_inc: Tensor, w: int, inner: bool) -> Tensor:
    """dot A_j + dot B_j over the split points of the spans of width ``w``: [B, n, w] for the
    inner spans, [B, 2, n, w] for the (left, right) complete spans."""
    if inner:
        return v.start(d_comp, 1, w) + v.end(d_comp, 0, w)
    return torch.stack(
        [
            v.start(d_comp, 0, w) + v.inc_left(d_inc, w),
            v.inc_right(d_inc, w) + v.end(d_comp, 1, w),
        ],
        1,
    )


def _eisner_hvp(
    charts: tuple[Tensor, Tensor, Tensor],
    norms: tuple[Tensor, Tensor],
    outside: tuple[Tensor, Tensor],
    direction: Tensor,
    cache: list[tuple[Tensor, Tensor]] | None,
) -> Tensor:
    """Hessian of log Z times ``direction`` [B, N, N] (arc layout), i.e. the derivative of the
    marginals along ``direction``: forward-mode tangents of the inside pass (widths up), then
    of the outside pass (widths down), all by hand. With p_j the split weights of a span P
    (softmax over its terms A_j + B_j) and dot the tangent:
      inside   dot P = sum_j p_j (dot A_j + dot B_j)      (+ the arc's direction for I)
      outside  dot g(A_j) += p_j ((dot A_j + dot B_j - dot P) g(P) + dot g(P))   (same for B_j)
    and the result is dot g of the incomplete spans, mapped back to arcs. ``cache``: the
    split weights of widths 1 .. N-1 (else recomputed)."""
    complete = charts[0]
    g_comp, g_inc = outside
    size = complete.shape[-1]
    v = _Stripes(complete)
    dirs = _skew(direction)
    d_comp = torch.zeros_like(complete)
    d_inc = torch.zeros_like(complete)
    d_inner = torch.zeros_like(charts[2])
    sums: list[tuple[Tensor, Tensor]] = []  # per width: dot A_j + dot B_j (if small)
    for w in range(1, size):
        n = size - w
        p_in, p_comp = cache[w - 1] if cache is not None else _split_weights(charts, norms, v, w)
        s_in = _tangent_sums(v, d_comp, d_inc, w, inner=True)  # [B, n, w]
        torch.sum(p_in * s_in, -1, out=d_inner[:, :n, w])
        torch.add(d_inner[:, None, :n, w], dirs[w][:, :, :n], out=v.col(d_inc, w))
        s_comp = _tangent_sums(v, d_comp, d_inc, w, inner=False)  # [B, 2, n, w]
        torch.sum(p_comp * s_comp, -1, out=v.col(d_comp, w))
        if cache is not None:
            sums.append((s_in, s_comp))
    dg_comp = torch.zeros_like(complete)
    dg_inc = torch.zeros_like(complete)
    for w in range(size - 1, 0, -1):
        n = size - w
        p_in, p_comp = cache[w - 1] if cache is not None else _split_weights(charts, norms, v, w)
        if cache is not None:
            s_in, s_comp = sums.pop()
        else:
            s_in = _tangent_sums(v, d_comp, d_inc, w, inner=True)
            s_comp = _tangent_sums(v, d_comp, d_inc, w, inner=False)
        # (s - dot P) g(P) + dot g(P) = s g(P) + (dot g(P) - dot P g(P))
        g = v.col(g_comp, w).unsqueeze(-1)  # [B, 2, n, 1]
        shift = v.col(dg_comp, w).unsqueeze(-1) - v.col(d_comp, w).unsqueeze(-1) * g
        t = torch.addcmul(shift, s_comp, g).mul_(p_comp)  # [B, 2, n, w]
        v.start(dg_comp, 0, w).add_(t[:, 0])
        v.inc_left(dg_inc, w).add_(t[:, 0])
        v.inc_right(dg_inc, w).add_(t[:, 1])
        v.end(dg_comp, 1, w).add_(t[:, 1])
        g_in = v.col(g_inc, w).sum(1).unsqueeze(-1)  # [B, n, 1]
        shift_in = v.col(dg_inc, w).sum(1).unsqueeze(-1) - d_inner[:, :n, w, None] * g_in
        t_in = torch.addcmul(shift_in, s_in, g_in).mul_(p_in)  # [B, n, w]
        v.start(dg_comp, 1, w).add_(t_in)
        v.end(dg_comp, 0, w).add_(t_in)
    return _arc_grads(dg_inc)


def _eisner_backtrack(
    splits: list[tuple[Tensor, Tensor]], last: Tensor, seed: Tensor, size: int
) -> Tensor:
    """The best tree's arc indicators [B, N, N] times ``seed`` [B], from the best split points
    of :func:`_eisner_charts`: the outside pass of the max semiring, widths down, each used
    span passing its indicator to the two pieces of its best split."""
    batch = seed.shape[0]
    g_comp = seed.new_zeros(batch, 2, size, size)
    g_inc = torch.zeros_like(g_comp)
    g_comp[:, 1, 0].scatter_(1, last.unsqueeze(-1), seed.unsqueeze(-1))
    v = _Stripes(g_comp)
    for w in range(size - 1, 0, -1):
        split_in, split_comp = splits[w - 1]  # [B, n], [B, 2, n]
        g = v.col(g_comp, w)  # [B, 2, n]
        left, right = split_comp[:, 0, :, None], split_comp[:, 1, :, None]  # [B, n, 1]
        v.start(g_comp, 0, w).scatter_add_(-1, left, g[:, 0, :, None])
        v.inc_left(g_inc, w).scatter_add_(-1, left, g[:, 0, :, None])
        v.inc_right(g_inc, w).scatter_add_(-1, right, g[:, 1, :, None])
        v.end(g_comp, 1, w).scatter_add_(-1, right, g[:, 1, :, None])
        g_in = v.col(g_inc, w).sum(1, keepdim=True).transpose(1, 2)  # [B, n, 1]
        v.start(g_comp, 1, w).scatter_add_(-1, split_in[..., None], g_in)
        v.end(g_comp, 0, w).scatter_add_(-1, split_in[..., None], g_in)
    return _arc_grads(g_inc)


class _EisnerMax(torch.autograd.Function):
    """Score of the best projective tree, [B] (forward: max-inside pass on in-place charts,
    keeping the best split points; backward: the backtrack by hand, the best tree's arcs times
    the incoming gradient)."""

    @staticmethod
    def forward(ctx: Any, arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
        last = _last(arc_scores, lengths)
        splits: list[tuple[Tensor, Tensor]] = []
        complete, _, _ = _eisner_charts(arc_scores.detach(), last, multiroot, splits)
        ctx.splits = splits
        ctx.save_for_backward(last)
        ctx.size = arc_scores.shape[-1]
        return complete[:, 1, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (last,) = ctx.saved_tensors
        return _eisner_backtrack(ctx.splits, last, grad, ctx.size), None, None


def eisner_max(arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
    """Score of the best projective tree, [B], like ``eisner_inside(..., MaxSemiring)``
    (ties: the first split point), with a hand-written backtrack as its backward (the
    gradient is the best tree's arc indicators); ``arc_scores`` must already have ``-inf``
    in column 0. Its gradient cannot be differentiated again (it is piecewise constant)."""
    return _EisnerMax.apply(arc_scores, lengths, multiroot)


def _last(arc_scores: Tensor, lengths: Tensor | None) -> Tensor:
    """Index of each item's last real position, LongTensor [B]."""
    batch, size, _ = arc_scores.shape
    if lengths is None:
        return torch.full((batch,), size - 1, dtype=torch.long, device=arc_scores.device)
    return lengths - 1


class _EisnerLogPartition(torch.autograd.Function):
    """log Z over projective trees (forward: inside pass on in-place charts, no autograd
    graph; backward: the outside pass by hand, the marginals times the incoming gradient).
    When the backward is itself differentiated (``create_graph``), the marginals come from
    :class:`_EisnerMarginals`, whose backward is a hand-written Hessian-vector product."""

    @staticmethod
    def forward(ctx: Any, arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
        last = _last(arc_scores, lengths)
        batch, size, _ = arc_scores.shape
        small = 3 * batch * size**3 // 6 <= _CACHE_ELEMENTS and ctx.needs_input_grad[0]
        cache: list[tuple[Tensor, Tensor]] | None = [] if small else None
        complete, incomplete, inner = _eisner_charts(
            arc_scores.detach(), last, multiroot, weights=cache
        )
        logz = complete[:, 1, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)  # [B]
        ctx.save_for_backward(arc_scores, complete, incomplete, inner, last)
        ctx.cache = cache
        ctx.lengths = lengths
        ctx.multiroot = multiroot
        return logz

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        arc_scores, complete, incomplete, inner, last = ctx.saved_tensors
        charts = (complete, incomplete, inner)
        if torch.is_grad_enabled():  # differentiated again: one node with its own backward
            marginals = _EisnerMarginals.apply(
                arc_scores, grad, charts, last, ctx.lengths, ctx.multiroot, ctx.cache
            )
            return marginals, None, None
        norms = _normalisers(complete, inner, last, ctx.multiroot)
        _, g_inc = _eisner_outside(charts, norms, last, grad, ctx.cache)
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
        cache: list[tuple[Tensor, Tensor]] | None,
    ) -> Tensor:
        norms = _normalisers(charts[0], charts[2], last, multiroot)
        outside = _eisner_outside(charts, norms, last, torch.ones_like(seed), cache)
        marginals = _arc_grads(outside[1])  # [B, N, N]
        ctx.save_for_backward(arc_scores, seed, marginals, last, *charts, *norms, *outside)
        ctx.cache = cache
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
            return hvp, (grad * unit).flatten(1).sum(-1), None, None, None, None, None
        g_seed = (grad * marginals).flatten(1).sum(-1) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, g_seed, None, None, None, None, None
        charts = (saved[0], saved[1], saved[2])
        hvp = _eisner_hvp(charts, (saved[3], saved[4]), (saved[5], saved[6]), grad, ctx.cache)
        return hvp * seed.view(-1, 1, 1), g_seed, None, None, None, None, None


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
