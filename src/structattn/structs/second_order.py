"""Second-order projective dependency trees: Eisner's algorithm with adjacent siblings
(McDonald & Pereira 2006), in any semiring.

Shapes: ``arc_scores`` [B, N, N] (position 0 is ROOT, ``arc_scores[b, h, m]`` scores the
arc h -> m), ``sibling_scores`` [B, N, N, N] with ``sibling_scores[b, h, m, s]`` the score of
the head h taking the modifier m right after the modifier s on the same side, s strictly
between h and m (s is m's inner sibling: no child of h lies between s and m). The child of h
closest to h on each side has no sibling score. ``lengths`` [B] counts positions incl. ROOT.

The charts, for s < t (complete spans as in :mod:`structattn.structs.dependency`):

* ``I(s -> t) = arc(s, t) + ⊕{ C_L(s+1, t) [t is s's first right child],
  ⊕_{s<r<t} I(s -> r) + S(r, t) + sib(s, t, r) }``
* ``I(t -> s) = arc(t, s) + ⊕{ C_R(s, t-1) [s is t's first left child],
  ⊕_{s<r<t} S(s, r) + I(t -> r) + sib(t, s, r) }``
* ``S(s, t) = ⊕_{s<=u<t} C_R(s, u) + C_L(u+1, t)`` (two adjacent siblings' facing halves)
* ``C_R(s, t) = ⊕_{s<r<=t} I(s -> r) + C_R(r, t)``, ``C_L(s, t) = ⊕_{s<=r<t} C_L(s, r) + I(t -> r)``

Each width is one batched step over its N - w spans: time O(B N^3), memory O(B N^2) for the
charts (O(B N^3) with the sibling scores and autograd's graph). In the log semiring
:func:`second_order_log_partition` runs the same charts without autograd, keeping each
width's split weights (O(B N^3)), and its backward is the outside pass by hand.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import is_transformed, last_index, tracing
from ..semirings import LogSemiring, Semiring
from .dependency import _arcs_by_width
from .kbest_trees import _indicators_to_heads, _rank_arcs, _rank_pairs, _top

__all__ = [
    "second_order_inside",
    "second_order_log_partition",
    "second_order_kbest",
    "second_order_map",
    "sibling_indicators",
    "sibling_score",
]


@functools.lru_cache(maxsize=64)
def _sibling_index(size: int, device: torch.device) -> tuple[Tensor, list[int]]:
    """Flat [N * N * N] positions of the sibling scores read by widths 2..N-1: per width the
    n = N - w spans s..t and their w - 1 inner siblings r = s + 1 + j, first (h = s, m = t, r)
    then (h = t, m = s, r); and the per-width counts."""
    index, counts = [], []
    for w in range(2, size):
        start = torch.arange(size - w, device=device).unsqueeze(1)  # [n, 1]
        inner = start + 1 + torch.arange(w - 1, device=device)  # [n, w-1]
        end = start + w
        index += [((start * size + end) * size + inner).flatten()]
        index += [((end * size + start) * size + inner).flatten()]
        counts.append(2 * (size - w) * (w - 1))
    if not index:
        return torch.zeros(0, dtype=torch.long, device=device), []
    return torch.cat(index), counts


def _siblings_by_width(sibling_scores: Tensor) -> dict[int, Tensor]:
    """``out[w]`` [B, 2, n, w - 1] for w >= 2: (sib(s, t, s+1+j), sib(t, s, s+1+j))."""
    batch, size = sibling_scores.shape[:2]
    index, counts = _sibling_index(size, sibling_scores.device)
    flat = sibling_scores.reshape(batch, size**3).index_select(1, index)
    return {
        w: part.view(batch, 2, size - w, w - 1)
        for w, part in zip(range(2, size), flat.split(counts, 1), strict=True)
    }


@full_precision
def second_order_inside(
    arc_scores: Tensor,
    sibling_scores: Tensor,
    lengths: Tensor | None,
    semiring: type[Semiring],
) -> Tensor:
    """⊕ over projective trees of arc + adjacent-sibling scores, shape [B] (differentiable by
    autograd: in the log semiring the gradients are the arc and sibling marginals).

    ``arc_scores`` must already have ``-inf`` in column 0 and on the diagonal; a single-root
    constraint is ``sibling_scores[:, 0] = -inf`` (ROOT then takes only a first child).
    Stripes [B, n, w] (n = N - w spans of width w, j < w), rebuilt by one ``cat`` a width:
      comp_s = (C_L(i, i+j), C_R(i, i+j)), comp_e = (C_L(i+1+j, i+w), C_R(i+1+j, i+w))
      inc_s[b, i, j] = I(i -> i+1+j), inc_e[b, i, j] = I(i+w -> i+j)
      sib_s[b, i, j] = S(i, i+1+j), sib_e[b, i, j] = S(i+j, i+w)
    """
    batch, size, _ = arc_scores.shape
    last = last_index(lengths, batch, size, arc_scores.device)
    arcs = _arcs_by_width(arc_scores)  # per width [B, 2, n]: (s -> t, t -> s)
    sibs = _siblings_by_width(sibling_scores)  # per width >= 2 [B, 2, n, w-1]
    comp_s = arc_scores.new_zeros(batch, 2, size - 1, 1)
    comp_e = comp_s
    inc_s = inc_e = sib_s = sib_e = arc_scores.new_zeros(batch, size, 0)  # [B, n + 1, w - 1]
    tops = []
    for w in range(1, size):
        n = size - w
        # S(s, t) = ⊕_j C_R(s, s+j) + C_L(s+j+1, t)                                   [B, n]
        sib_new = semiring.sum(comp_s[:, 1] + comp_e[:, 0], dim=-1)
        # first children: I(s -> t) from C_L(s+1, t), I(t -> s) from C_R(s, t-1)   [B, 2, n]
        first = torch.stack([comp_e[:, 0, :, 0], comp_s[:, 1, :, w - 1]], 1)
        if w == 1:
            inc = first + arcs[w]
        else:
            # the inner sibling r = s+1+j, j < w-1: I(s -> r) + S(r, t) + sib(s, t, r) and
            # S(s, r) + I(t -> r) + sib(t, s, r)                                [B, 2, n, w-1]
            right = inc_s[:, :n] + sib_e[:, 1:]
            left = sib_s[:, :n] + inc_e[:, 1:]
            terms = torch.stack([right, left], 1) + sibs[w]
            inc = semiring.sum(torch.cat([first.unsqueeze(-1), terms], -1), dim=-1) + arcs[w]
        inc_s = torch.cat([inc_s[:, :n], inc[:, 0, :, None]], -1)
        inc_e = torch.cat([inc[:, 1, :, None], inc_e[:, 1:]], -1)
        sib_s = torch.cat([sib_s[:, :n], sib_new[..., None]], -1)
        sib_e = torch.cat([sib_new[..., None], sib_e[:, 1:]], -1)
        # C_L(s, t) = ⊕_j C_L(s, s+j) + I(t -> s+j);  C_R(s, t) = ⊕_j I(s -> s+1+j) + C_R(.., t)
        comp = semiring.sum(
            torch.stack([comp_s[:, 0] + inc_e, inc_s + comp_e[:, 1]], 1), dim=-1
        )  # [B, 2, n]
        tops.append(comp[:, 1, :1])
        if w < size - 1:
            comp_s = torch.cat([comp_s[:, :, : n - 1], comp[:, :, : n - 1, None]], -1)
            comp_e = torch.cat([comp[:, :, 1:, None], comp_e[:, :, 1:]], -1)
    top = torch.cat(tops, -1)  # [B, N-1]: C_R(0, w)
    return top.gather(1, (last - 1).unsqueeze(-1)).squeeze(-1)


def _cells(x: Tensor, n: int, m: int, row: int, col: int, step: int) -> Tensor:
    """View [B, n, m] of the chart ``x`` [B, N, N] (rows contiguous): the cells
    (i + row + j * (step == N), i + col + j * (step == 1)), i.e. ``step`` 1 walks along a
    row (cells (i + row, i + col + j)), ``step`` N down a column (cells (i + row + j, i + col))."""
    size = x.shape[-1]
    offset = x.storage_offset() + row * size + col
    return x.as_strided((x.shape[0], n, m), (x.stride(0), size + 1, step), offset)


def _weights(x: Tensor) -> tuple[Tensor, Tensor]:
    """(logsumexp over the last dim, the softmax weights), 0 weights where all are -inf."""
    total = x.logsumexp(-1)
    safe = total.clamp_min(torch.finfo(x.dtype).min).unsqueeze(-1)
    return total, (x - safe).exp_()


def _second_order_log_charts(
    arc_scores: Tensor, sibling_scores: Tensor, keep: bool
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """The log-semiring charts of :func:`second_order_inside` on full [B, N, N] charts
    (cell (s, t), s < t) read by strided views, without autograd: returns the chart C_R
    (log Z of the prefix 0..t is ``C_R[:, 0, t]``) and, if ``keep``, per width w >= 1 the
    softmax weights of each cell's splits ([B, 3, n, w]: I(s -> t) and I(t -> s) with the
    first child first, then S; and [B, 2, n, w]: C_L, C_R)."""
    batch, size, _ = arc_scores.shape
    step = size
    sibs = sibling_scores.contiguous().view(batch, size**3)
    cube, base = size * size + size + 1, sibs.storage_offset()
    charts = arc_scores.new_zeros(batch, 2, size, size)  # C_L(s, t), C_R(s, t); diagonal 0
    c_l, c_r = charts.unbind(1)
    spans = arc_scores.new_empty(batch, 3, size, size)  # I(s -> t), I(t -> s), S(s, t)
    i_r, i_l, s_c = spans.unbind(1)
    # the arcs of the cells of ``spans``: arc(s, t), arc(t, s), 0
    arcs = torch.stack([arc_scores, arc_scores.transpose(1, 2), torch.zeros_like(arc_scores)], 1)
    kept = []
    for w in range(1, size):
        n = size - w
        # one [B, 3, n, w] tensor of splits, reduced at once:
        # I(s -> t): first child C_L(s+1, t), or I(s -> r) + S(r, t) + sib(s, t, r)
        # I(t -> s): first child C_R(s, t-1), or S(s, r) + I(t -> r) + sib(t, s, r)
        # S(s, t) = ⊕_j C_R(s, s+j) + C_L(s+j+1, t)
        terms = arc_scores.new_empty(batch, 3, n, w)
        torch.add(_cells(c_r, n, w, 0, 0, 1), _cells(c_l, n, w, 1, w, step), out=terms[:, 2])
        terms[:, 0, :, 0] = c_l.diagonal(w - 1, 1, 2)[:, 1:]
        terms[:, 1, :, 0] = c_r.diagonal(w - 1, 1, 2)[:, :n]
        if w > 1:
            rest = terms[:, :, :, 1:]
            torch.add(
                _cells(i_r, n, w - 1, 0, 1, 1), _cells(s_c, n, w - 1, 1, w, step), out=rest[:, 0]
            )
            torch.add(
                _cells(s_c, n, w - 1, 0, 1, 1), _cells(i_l, n, w - 1, 1, w, step), out=rest[:, 1]
            )
            rest[:, 0] += sibs.as_strided(
                (batch, n, w - 1), (size**3, cube, 1), base + w * size + 1
            )
            rest[:, 1] += sibs.as_strided(
                (batch, n, w - 1), (size**3, cube, 1), base + w * size * size + 1
            )
        total, split_w = _weights(terms)  # [B, 3, n]: I(s -> t), I(t -> s) without arcs, S
        torch.add(total, arcs.diagonal(w, 2, 3), out=spans.diagonal(w, 2, 3))
        # C_L(s, t) = ⊕_j C_L(s, s+j) + I(t -> s+j);  C_R(s, t) = ⊕_j I(s -> s+1+j) + C_R(.., t)
        comp = arc_scores.new_empty(batch, 2, n, w)
        torch.add(_cells(c_l, n, w, 0, 0, 1), _cells(i_l, n, w, 0, w, step), out=comp[:, 0])
        torch.add(_cells(i_r, n, w, 0, 1, 1), _cells(c_r, n, w, 1, w, step), out=comp[:, 1])
        comp_new, comp_w = _weights(comp)
        charts.diagonal(w, 2, 3).copy_(comp_new)
        if keep:
            kept.append((split_w, comp_w))
    return c_r, kept


def _second_order_outside(
    kept: list[tuple[Tensor, Tensor]], last: Tensor, grad: Tensor, size: int
) -> tuple[Tensor, Tensor]:
    """The gradients of ``grad[b] * log Z[b]`` with respect to the arc [B, N, N] and sibling
    [B, N, N, N] scores (``grad`` times the marginals): the splits' weights spread the
    gradient of each cell to its children, widths down."""
    batch = grad.shape[0]
    step = size
    g_charts = grad.new_zeros(batch, 2, size, size)  # C_L, C_R
    g_spans = grad.new_zeros(batch, 3, size, size)  # I(s -> t), I(t -> s), S
    g_cl, g_cr = g_charts.unbind(1)
    g_ir, g_il, g_s = g_spans.unbind(1)
    g_sib = grad.new_zeros(batch, size**3)
    cube, base = size * size + size + 1, 0
    g_cr.select(1, 0).scatter_(1, last.unsqueeze(-1), grad.unsqueeze(-1))  # C_R(0, last)
    for w in range(size - 1, 0, -1):
        n = size - w
        split_w, comp_w = kept[w - 1]
        # the complete spans of width w use incomplete ones of width w (and smaller)
        t = comp_w * g_charts.diagonal(w, 2, 3).unsqueeze(-1)  # [B, 2, n, w]
        _cells(g_cl, n, w, 0, 0, 1).add_(t[:, 0])
        _cells(g_il, n, w, 0, w, step).add_(t[:, 0])
        _cells(g_ir, n, w, 0, 1, 1).add_(t[:, 1])
        _cells(g_cr, n, w, 1, w, step).add_(t[:, 1])
        # the incomplete spans and the sibling pairs of width w
        t = split_w * g_spans.diagonal(w, 2, 3).unsqueeze(-1)  # [B, 3, n, w]
        g_cl.diagonal(w - 1, 1, 2)[:, 1:].add_(t[:, 0, :, 0])
        g_cr.diagonal(w - 1, 1, 2)[:, :n].add_(t[:, 1, :, 0])
        if w > 1:
            right, left = t[:, 0, :, 1:], t[:, 1, :, 1:]
            _cells(g_ir, n, w - 1, 0, 1, 1).add_(right)
            _cells(g_s, n, w - 1, 1, w, step).add_(right)
            _cells(g_s, n, w - 1, 0, 1, 1).add_(left)
            _cells(g_il, n, w - 1, 1, w, step).add_(left)
            g_sib.as_strided((batch, n, w - 1), (size**3, cube, 1), base + w * size + 1).copy_(
                right
            )
            g_sib.as_strided(
                (batch, n, w - 1), (size**3, cube, 1), base + w * size * size + 1
            ).copy_(left)
        _cells(g_cr, n, w, 0, 0, 1).add_(t[:, 2])
        _cells(g_cl, n, w, 1, w, step).add_(t[:, 2])
    # I(s -> t) = arc(s, t) + ..., I(t -> s) = arc(t, s) + ... (upper triangles only)
    g_arc = g_ir + g_il.transpose(1, 2)
    return g_arc, g_sib.view(batch, size, size, size)


class _SecondOrderLogPartition(torch.autograd.Function):
    """log Z of :func:`second_order_inside` in the log semiring (forward: the inside pass
    without an autograd graph, keeping each width's split weights; backward: the outside
    pass by hand, i.e. the arc and sibling marginals times the incoming gradient). When the
    backward is itself differentiated (``create_graph``), it is autograd's through
    :func:`second_order_inside` (any order)."""

    @staticmethod
    def forward(
        ctx: Any, arc_scores: Tensor, sibling_scores: Tensor, lengths: Tensor | None
    ) -> Tensor:
        batch, size, _ = arc_scores.shape
        last = last_index(lengths, batch, size, arc_scores.device)
        keep = any(ctx.needs_input_grad[:2])
        c_r, kept = _second_order_log_charts(arc_scores.detach(), sibling_scores.detach(), keep)
        ctx.save_for_backward(arc_scores, sibling_scores)
        ctx.kept, ctx.last, ctx.lengths = kept, last, lengths
        return c_r[:, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        arc_scores, sibling_scores = ctx.saved_tensors
        if torch.is_grad_enabled():  # differentiated again: autograd through the inside pass
            logz = second_order_inside(arc_scores, sibling_scores, ctx.lengths, LogSemiring)
            g_arc, g_sib = torch.autograd.grad(
                logz, (arc_scores, sibling_scores), grad, create_graph=True, allow_unused=True
            )
        else:
            g_arc, g_sib = _second_order_outside(ctx.kept, ctx.last, grad, arc_scores.shape[-1])
        return g_arc, g_sib, None


def _plain(x: Tensor) -> bool:
    """Whether ``x`` is a plain tensor without a forward-mode tangent."""
    if is_transformed(x):
        return False
    return torch.autograd.forward_ad.unpack_dual(x).tangent is None


@full_precision
def second_order_log_partition(
    arc_scores: Tensor, sibling_scores: Tensor, lengths: Tensor | None
) -> Tensor:
    """log Z [B], :func:`second_order_inside` in the log semiring (same arguments) with a
    hand-written outside pass as its backward (the arc and sibling marginals); under
    ``torch.func`` transforms, forward-mode AD or tracing it is autograd's (that function)."""
    if tracing() or torch.jit.is_tracing() or not (_plain(arc_scores) and _plain(sibling_scores)):
        return second_order_inside(arc_scores, sibling_scores, lengths, LogSemiring)
    return _SecondOrderLogPartition.apply(arc_scores, sibling_scores, lengths)


@full_precision
def second_order_map(
    arc_scores: Tensor, sibling_scores: Tensor, lengths: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(score [B], heads LongTensor [B, N]) of the best projective tree under arc +
    adjacent-sibling scores (arguments as :func:`second_order_inside`): the max-plus pass of
    :func:`second_order_inside` without autograd, keeping each cell's best split, then the
    backtrack by hand, widths down (one gather and one scatter a width). Ties: the first
    split, as the gradient of the max semiring. Heads are ``-1`` at ROOT and padding (and
    arbitrary for an item with score ``-inf``: the caller invalidates those)."""
    batch, size, _ = arc_scores.shape
    last = last_index(lengths, batch, size, arc_scores.device)
    with torch.no_grad():
        score, splits = _second_order_max(arc_scores.detach(), sibling_scores.detach(), last)
        heads = _second_order_backtrack(splits, last, size)
    return score, heads


def _second_order_max(
    arc_scores: Tensor, sibling_scores: Tensor, last: Tensor
) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor]]]:
    """The max-plus charts of :func:`second_order_inside` (same stripes), returning the
    best score [B] and per width w >= 1 the best splits (S [B, n], I [B, 2, n] with 0 for a
    first child and 1 + j for the inner sibling s + 1 + j, C [B, 2, n]: (C_L, C_R))."""
    batch, size, _ = arc_scores.shape
    arcs = _arcs_by_width(arc_scores)  # per width [B, 2, n]: (s -> t, t -> s)
    sibs = _siblings_by_width(sibling_scores)  # per width >= 2 [B, 2, n, w-1]
    comp_s = arc_scores.new_zeros(batch, 2, size - 1, 1)
    comp_e = comp_s
    inc_s = inc_e = sib_s = sib_e = arc_scores.new_zeros(batch, size, 0)
    tops, splits = [], []
    for w in range(1, size):
        n = size - w
        sib_new, sib_arg = (comp_s[:, 1] + comp_e[:, 0]).max(-1)  # [B, n]
        first = torch.stack([comp_e[:, 0, :, 0], comp_s[:, 1, :, w - 1]], 1)  # [B, 2, n]
        if w == 1:
            inc, inc_arg = first + arcs[w], torch.zeros_like(first, dtype=torch.long)
        else:
            right = inc_s[:, :n] + sib_e[:, 1:]
            left = sib_s[:, :n] + inc_e[:, 1:]
            terms = torch.stack([right, left], 1) + sibs[w]  # [B, 2, n, w-1]
            inc, inc_arg = torch.cat([first.unsqueeze(-1), terms], -1).max(-1)
            inc = inc + arcs[w]
        inc_s = torch.cat([inc_s[:, :n], inc[:, 0, :, None]], -1)
        inc_e = torch.cat([inc[:, 1, :, None], inc_e[:, 1:]], -1)
        sib_s = torch.cat([sib_s[:, :n], sib_new[..., None]], -1)
        sib_e = torch.cat([sib_new[..., None], sib_e[:, 1:]], -1)
        comp, comp_arg = torch.stack([comp_s[:, 0] + inc_e, inc_s + comp_e[:, 1]], 1).max(-1)
        splits.append((sib_arg, inc_arg, comp_arg))
        tops.append(comp[:, 1, :1])
        if w < size - 1:
            comp_s = torch.cat([comp_s[:, :, : n - 1], comp[:, :, : n - 1, None]], -1)
            comp_e = torch.cat([comp[:, :, 1:, None], comp_e[:, :, 1:]], -1)
    top = torch.cat(tops, -1)  # [B, N-1]: C_R(0, w)
    return top.gather(1, (last - 1).unsqueeze(-1)).squeeze(-1), splits


# the cell types of the backtrack's chart [B, 5, N, N] (cell (s, t), s < t)
_CL, _CR, _IR, _IL, _S = range(5)  # C_L(s, t), C_R(s, t), I(s -> t), I(t -> s), S(s, t)


def _route(used: Tensor, own: Tensor, children: Tensor) -> None:
    """Mark the two ``children`` [B, K, n, 2] (flat cells) of the used cells ``own`` [K, n]
    in ``used`` [B, 5 N N] (in place)."""
    batch = used.shape[0]
    g = used.index_select(1, own.flatten()).view(batch, *own.shape, 1).expand_as(children)
    used.scatter_add_(1, children.flatten(1), g.flatten(1))


def _second_order_backtrack(
    splits: list[tuple[Tensor, Tensor, Tensor]], last: Tensor, size: int
) -> Tensor:
    """Heads [B, N] of the best derivation: a 0/1 chart of the cells it uses, seeded at
    C_R(0, last) and routed, widths down, to each used cell's two children (a first child's
    I cell has one: its second goes to the never-read cell C_L(0, 0))."""
    batch = last.shape[0]
    area = size * size
    used = torch.zeros(batch, 5 * area, dtype=torch.long, device=last.device)
    used.scatter_(1, (_CR * area + last).unsqueeze(-1), 1)

    def cell(kind: int, s: Tensor, t: Tensor) -> Tensor:
        return kind * area + s * size + t

    for w in range(size - 1, 0, -1):
        sib_arg, inc_arg, comp_arg = splits[w - 1]
        n = size - w
        s = torch.arange(n, device=last.device)  # [n]
        t = s + w
        j_cl, j_cr = comp_arg[:, 0], comp_arg[:, 1]  # [B, n]
        a_r, a_l = inc_arg[:, 0], inc_arg[:, 1]
        none = torch.zeros_like(a_r)  # C_L(0, 0): read by no one
        # the complete spans first: C_L(s, t) may use I(t -> s), C_R(s, t) I(s -> t)
        complete = torch.stack(
            [
                torch.stack([cell(_CL, s, s + j_cl), cell(_IL, s + j_cl, t)], -1),
                torch.stack([cell(_IR, s, s + 1 + j_cr), cell(_CR, s + 1 + j_cr, t)], -1),
            ],
            1,
        )  # [B, 2, n, 2]
        _route(used, torch.stack([cell(k, s, t) for k in (_CL, _CR)]), complete)
        # then the incomplete spans and the sibling pairs (children of smaller widths)
        rest = torch.stack(
            [
                torch.stack(
                    [
                        torch.where(a_r == 0, cell(_CL, s + 1, t), cell(_IR, s, s + a_r)),
                        torch.where(a_r == 0, none, cell(_S, s + a_r, t)),
                    ],
                    -1,
                ),
                torch.stack(
                    [
                        torch.where(a_l == 0, cell(_CR, s, t - 1), cell(_S, s, s + a_l)),
                        torch.where(a_l == 0, none, cell(_IL, s + a_l, t)),
                    ],
                    -1,
                ),
                torch.stack([cell(_CR, s, s + sib_arg), cell(_CL, s + sib_arg + 1, t)], -1),
            ],
            1,
        )  # [B, 3, n, 2]
        _route(used, torch.stack([cell(k, s, t) for k in (_IR, _IL, _S)]), rest)
    chart = used.view(batch, 5, size, size).clamp_max(1)
    arcs = chart[:, _IR] + chart[:, _IL].transpose(1, 2)  # [B, N(h), N(m)]
    heads = arcs.argmax(1)  # [B, N]
    return heads.masked_fill(arcs.sum(1) == 0, -1)


def inner_siblings(heads: Tensor, words: Tensor) -> Tensor:
    """Each word's inner sibling, LongTensor [B, N]: the child of its head closest to it
    strictly between the head and it; -1 for a first child and where not ``words``."""
    size = heads.shape[-1]
    position = torch.arange(size, device=heads.device)
    m = position.view(1, -1, 1)  # the word
    c = position.view(1, 1, -1)  # a candidate sibling
    head = heads.unsqueeze(-1)  # [B, N, 1]
    same = (heads.unsqueeze(1) == head) & words.unsqueeze(1) & words.unsqueeze(-1)
    between = (c > torch.minimum(head, m)) & (c < torch.maximum(head, m))
    candidate = same & between  # [B, N(m), N(c)]
    distance = (m - c).abs().expand_as(candidate)
    nearest = distance.masked_fill(~candidate, size + 1).argmin(-1)  # [B, N]
    return nearest.masked_fill(~candidate.any(-1), -1)


def sibling_score(sibling_scores: Tensor, heads: Tensor, words: Tensor) -> Tensor:
    """Sum of the adjacent-sibling scores of the trees ``heads`` [B, N] over the words
    (``words`` BoolTensor [B, N]), [B]."""
    batch, size = heads.shape
    inner = inner_siblings(heads, words)  # [B, N]
    has = inner >= 0
    position = torch.arange(size, device=heads.device)
    index = (heads.clamp_min(0) * size + position) * size + inner.clamp_min(0)  # (h, m, s)
    picked = sibling_scores.reshape(batch, size**3).gather(1, index)
    return picked.masked_fill(~has, 0.0).sum(-1)


def sibling_indicators(heads: Tensor) -> Tensor:
    """0/1 adjacent-sibling indicators [B, N, N, N] (``[b, h, m, s]``: h takes m right after
    s) of the trees ``heads`` LongTensor [B, N] (``-1`` at ROOT, padding and missing trees)."""
    batch, size = heads.shape
    words = heads >= 0
    inner = inner_siblings(heads, words)  # [B, N]
    position = torch.arange(size, device=heads.device)
    index = (heads.clamp_min(0) * size + position) * size + inner.clamp_min(0)  # (h, m, s)
    out = torch.zeros(batch, size**3, dtype=torch.long, device=heads.device)
    out.scatter_(1, index, (inner >= 0).long())
    return out.view(batch, size, size, size)


def _pair_sums(a: Tensor, b: Tensor) -> Tensor:
    """Sums of the sorted k-lists ``a``, ``b`` [..., J, K] over the rank pairs that can be
    among the k best, [..., J, P] (ordered by (rank in a, rank in b))."""
    first, second = _rank_pairs(a.shape[-1], a.device)
    return a.index_select(-1, first) + b.index_select(-1, second)


def _second_order_kbest_scores(
    arc_scores: Tensor, sibling_scores: Tensor, last: Tensor, k: int
) -> Tensor:
    """The k best scores [B, K] of :func:`second_order_inside`'s charts in the k-best
    semiring (a sorted k-list in every cell; differentiable by autograd: the gradient of rank
    r is the r-th tree's arc and sibling indicators). Stripes as there, with a last K
    dimension: comp_s / comp_e [B, 2, n, w, K], inc_s / inc_e / sib_s / sib_e [B, n, w, K]."""
    batch, size, _ = arc_scores.shape
    arcs = _arcs_by_width(arc_scores)  # per width [B, 2, n]
    sibs = _siblings_by_width(sibling_scores)  # per width >= 2 [B, 2, n, w-1]
    unit = arc_scores.new_full((k,), float("-inf"))
    unit[0] = 0.0  # a complete span of width 0: one derivation, score 0
    comp_s = unit.expand(batch, 2, size - 1, 1, k)
    comp_e = comp_s
    empty = arc_scores.new_zeros(batch, size, 0, k)
    inc_s = inc_e = sib_s = sib_e = empty
    tops = []
    for w in range(1, size):
        n = size - w
        # S(s, t) = ⊕_j C_R(s, s+j) ⊗ C_L(s+j+1, t)                                  [B, n, K]
        sib_new = _top(_pair_sums(comp_s[:, 1], comp_e[:, 0]).flatten(-2), k)
        # first children: I(s -> t) from C_L(s+1, t), I(t -> s) from C_R(s, t-1) [B, 2, n, 1, K]
        first = torch.stack([comp_e[:, 0, :, 0], comp_s[:, 1, :, w - 1]], 1).unsqueeze(3)
        if w == 1:
            inc = first.squeeze(3) + arcs[w].unsqueeze(-1)
        else:
            # inner sibling r = s+1+j: I(s -> r) ⊗ S(r, t) + sib(s, t, r) and
            # S(s, r) ⊗ I(t -> r) + sib(t, s, r)                            [B, 2, n, w-1, P]
            right = _pair_sums(inc_s[:, :n], sib_e[:, 1:])
            left = _pair_sums(sib_s[:, :n], inc_e[:, 1:])
            terms = (torch.stack([right, left], 1) + sibs[w].unsqueeze(-1)).flatten(-2)
            inc = _top(torch.cat([first.flatten(-2), terms], -1), k) + arcs[w].unsqueeze(-1)
        inc_s = torch.cat([inc_s[:, :n], inc[:, 0, :, None]], 2)
        inc_e = torch.cat([inc[:, 1, :, None], inc_e[:, 1:]], 2)
        sib_s = torch.cat([sib_s[:, :n], sib_new[:, :, None]], 2)
        sib_e = torch.cat([sib_new[:, :, None], sib_e[:, 1:]], 2)
        # C_L(s, t) = ⊕_j C_L(s, s+j) ⊗ I(t -> s+j); C_R(s, t) = ⊕_j I(s -> s+1+j) ⊗ C_R(.., t)
        left_c = _top(_pair_sums(comp_s[:, 0], inc_e).flatten(-2), k)
        right_c = _top(_pair_sums(inc_s, comp_e[:, 1]).flatten(-2), k)
        comp = torch.stack([left_c, right_c], 1)  # [B, 2, n, K]
        tops.append(comp[:, 1, :1])  # [B, 1, K]: C_R(0, w)
        if w < size - 1:
            comp_s = torch.cat([comp_s[:, :, : n - 1], comp[:, :, : n - 1, None]], 3)
            comp_e = torch.cat([comp[:, :, 1:, None], comp_e[:, :, 1:]], 3)
    top = torch.cat(tops, 1)  # [B, N-1, K]
    return top.gather(1, (last - 1).view(-1, 1, 1).expand(-1, 1, k)).squeeze(1)


@full_precision
def second_order_kbest(
    arc_scores: Tensor, sibling_scores: Tensor, lengths: Tensor | None, k: int
) -> Tensor:
    """Heads LongTensor [k, B, N] of the k best projective trees under arc + adjacent-sibling
    scores, best first; exact (second-order Eisner in the k-best semiring: every projective
    tree has one derivation, so the k best derivations are k distinct trees). Arguments as
    :func:`second_order_inside` (``-inf`` in column 0 and on the diagonal; single root:
    ``sibling_scores[:, 0] = -inf``). The trees are read off the arc gradient of the k
    scores seeded with 2^r (as :func:`structattn.structs.kbest_trees.eisner_kbest`). Ranks
    with no tree are ``-1`` everywhere. Time O(B N^3 k log k log(N k)), memory
    O(B N^3 k log k)."""
    batch, size, _ = arc_scores.shape
    last = last_index(lengths, batch, size, arc_scores.device)
    with torch.inference_mode(False), torch.enable_grad():
        leaf = arc_scores.detach().clone().requires_grad_(True)
        top = _second_order_kbest_scores(leaf, sibling_scores.detach(), last, k)  # [B, K]
        grads = _rank_arcs(top, leaf)
    return _indicators_to_heads(grads, torch.isneginf(top.detach()).t())
