"""Projective dependency trees: Eisner's algorithm (tree checks: :mod:`structattn.trees`).

Shapes: ``arc_scores`` [B, N, N] with position 0 the ROOT symbol and ``arc_scores[b, h, m]``
the score of the arc h -> m; ``lengths`` [B] counts positions including ROOT.

Two implementations of the same dynamic program (time O(B N^3), N sequential span widths,
each one batched step over all N - w spans of width w):

* :func:`eisner_log_partition` / :func:`eisner_max` -- no autograd inside: one in-place chart
  (layout below), a hand-written outside pass as log Z's backward, a hand-written
  Hessian-vector product as the marginals' backward (the training path of structured
  attention), a hand-written backtrack for the MAP tree. Memory O(B N^2) (plus the split
  weights of small problems).
* :func:`eisner_inside` -- any semiring (sampling, the third-order fallback), differentiated
  by autograd. Charts ([B, N, N], ``s < t``): ``complete[s, t]`` right complete span s..t
  headed at s, ``complete[t, s]`` left, head t; ``incomplete[s, t]`` arc s -> t spanning
  s..t, ``incomplete[t, s]`` arc t -> s. Each width reads "stripes" [B, 2, N - w, w] of the
  narrower spans, rebuilt from the previous step's by one ``cat`` (no in-place writes, no
  strided views of a big tensor for autograd to scatter into)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._precision import full_precision
from .._validation import last_index
from ..semirings import LogSemiring, Semiring
from ..trees import is_projective, is_tree  # re-exported: their old import path
from ._extension import kernels as host_kernels
from ._extension import loaded_target
from ._library import tracing, tree_ops
from ._ops import (
    Stash,
    batch_dot,
    differentiated,
    is_transformed,
    outer_jvp,
    refuse_jit_trace,
    tensor_cache,
    vmap_by_folding,
)

__all__ = [
    "eisner_inside",
    "eisner_log_partition",
    "eisner_marginals",
    "eisner_max",
    "is_projective",
    "is_tree",
    "tree_score",
]


def compiled_kernels(x: Tensor) -> Any:
    """The C++ kernels for ``x`` (see :mod:`._extension`), never for tensors they cannot
    take (``torch.func`` wrappers, meta or fake tensors)."""
    return None if is_transformed(x) else host_kernels(x)


@tensor_cache(maxsize=64)
def _width_index(size: int, device: torch.device) -> tuple[Tensor, list[int]]:
    """Flat [N * N] positions of the arcs of every span, width by width (w = 1 .. N-1; per
    width the n = N - w arcs s -> t, then the n arcs t -> s), and the per-width counts."""
    index = []
    for w in range(1, size):
        start = torch.arange(size - w, device=device)
        index += [start * size + start + w, (start + w) * size + start]
    return torch.cat(index), [2 * (size - w) for w in range(1, size)]


def _arcs_by_width(arc_scores: Tensor) -> list[Tensor]:
    """``out[w]`` [B, 2, N - w]: (arc s -> s+w, arc s+w -> s) for the spans of width w (one
    gather; ``out[0]`` is an empty placeholder)."""
    batch, size, _ = arc_scores.shape
    index, counts = _width_index(size, arc_scores.device)
    flat = arc_scores.reshape(batch, size * size).index_select(1, index)
    parts = flat.split(counts, 1)
    return [flat[:, :0]] + [x.view(batch, 2, size - w) for w, x in enumerate(parts, 1)]


@full_precision
def eisner_inside(
    arc_scores: Tensor, lengths: Tensor | None, multiroot: bool, semiring: type[Semiring]
) -> Tensor:
    """⊕ over projective trees of the tree score (sum of arc scores), shape [B].

    ``arc_scores`` must already have ``-inf`` in column 0 (no arc into ROOT).
    """
    batch, size, _ = arc_scores.shape
    device = arc_scores.device
    last = last_index(lengths, batch, size, device)  # [B] index of the last real position
    arcs = _arcs_by_width(arc_scores)  # per width [B, 2, n]: (s -> t, t -> s)
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
        inc = inner.unsqueeze(1) + arcs[w]  # [B, 2, n]: (s -> t, t -> s)
        new_s = inc[:, 0].unsqueeze(-1)
        new_e = inc[:, 1].unsqueeze(-1)
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


# ---- log Z, marginals, their derivative and the MAP by hand -----------------------------------
# One chart X [B, 6, N, N] without autograd, read and written in place, width-major: planes
# 0-2 index a span by its start s (column) and width (row), planes 3-5 by its end e (column)
# and reversed width (row), so that both pieces of every term of a width are views that are
# contiguous along the span start (fast elementwise ops and reductions over the split):
#   0: I_R  X[0, k-1, s]       = I_R(s, k), the arc s -> s+k over s..s+k
#   1: C_R  X[1, k, s]         = right complete s..s+k, headed at s
#   2: C_L  X[2, k, s]         = left complete s..s+k, headed at s+k
#   3: C_R  X[3, N-1-k, s+k]   = C_R(s, k)   (the same values, end-indexed)
#   4: C_L  X[4, N-1-k, s+k]   = C_L(s, k)
#   5: I_L  X[5, N-k, s+k]     = I_L(s, k), the arc s+k -> s
# The terms of the three sums of a width w, [B, 3, w, n] (split j < w, n = N - w starts s,
# t = s + w), groups (right complete, inner, left complete), are first + second with
#   first  X[g, j, s]:            I_R(s, j + 1)        C_R(s, j)            C_L(s, j)
#   second X[3 + g, N-w+j, s+w]:  C_R(s+1+j, w-1-j)    C_L(s+1+j, w-1-j)    I_L(s+j, w-j)
# and C_R(s, w) = logaddexp(right partial, I_R(s, w)), C_L(s, w) = logaddexp(left partial,
# I_L(s, w)), where the partial sums miss the one term holding I(s, w) itself (right
# j = w - 1, left j = 0: still -inf when the sums are taken), and I(s, w) = inner(s, w) + arc.
# A complete span is written to both of its planes; an incomplete one lives in one plane, so
# the gradient of a complete span is the sum of its two copies' gradients.
class _Layout:
    """Strided views of a chart [B, 6, N, N] (see above) for the spans of width ``w``."""

    def __init__(self, chart: Tensor) -> None:
        self.b, self.d, self.r, _ = chart.stride()
        self.batch, self.size = chart.shape[0], chart.shape[-1]

    def first(self, x: Tensor, w: int) -> Tensor:
        """[B, 3, w, n]: the first piece of each term of the three sums."""
        return x.as_strided((self.batch, 3, w, self.size - w), (self.b, self.d, self.r, 1), 0)

    def second(self, x: Tensor, w: int) -> Tensor:
        """[B, 3, w, n]: the second piece of each term of the three sums."""
        offset = 3 * self.d + (self.size - w) * self.r + w
        return x.as_strided((self.batch, 3, w, self.size - w), (self.b, self.d, self.r, 1), offset)

    def inc(self, x: Tensor, w: int) -> Tensor:
        """[B, 2, n]: (I_R(s, w), I_L(s, w))."""
        n, r = self.size - w, self.r
        step = 5 * self.d + (n - w + 1) * r + w  # X[5, N-w, s+w] - X[0, w-1, s]
        return x.as_strided((self.batch, 2, n), (self.b, step, 1), (w - 1) * r)

    def comp(self, x: Tensor, w: int) -> Tensor:
        """[B, 2, 2, n]: (C_R(s, w), C_L(s, w)), start-indexed copy then end-indexed copy."""
        n, r = self.size - w, self.r
        step = 2 * self.d + (n - 1 - w) * r + w  # X[3, N-1-w, s+w] - X[1, w, s]
        return x.as_strided((self.batch, 2, 2, n), (self.b, step, self.d, 1), self.d + w * r)

    def terms(self, x: Tensor, w: int) -> Tensor:
        """first + second, [B, 3, w, n], stored split-major ([w, B, 3, n] in memory), so that
        the reductions over the split run over the outermost dimension (vectorised)."""
        out = x.new_empty(w, self.batch, 3, self.size - w).permute(1, 2, 0, 3)
        return torch.add(self.first(x, w), self.second(x, w), out=out)


def _groups(comp: Tensor, inner: Tensor) -> Tensor:
    """[B, 3, n] in the group order (right, inner, left) from [B, 2, n] and [B, 1, n]."""
    return torch.cat([comp[:, :1], inner, comp[:, 1:]], 1)


def _weights(
    e: Tensor, top: Tensor | None, sums: Tensor, inc: Tensor, open_root: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Split weights of width w (softmax of each sum's terms): (P [B, 3, w, n] over the terms,
    r [B, 2, n] of the I(s, w) term of the complete spans), from ``e`` = exp(terms - top)
    (top [B, 3, 1, n]; or the terms themselves when ``top`` is None), which is overwritten.
    The terms must be ``-inf`` in the I(s, w) slots; ``sums`` [B, 3, n] = (C_R, inner, C_L)
    of width w; ``open_root`` [B] marks the single-root items whose ROOT span of this width
    is masked (weights 0)."""
    norms = sums.clamp_min(torch.finfo(sums.dtype).min)  # -inf: exp(-inf - it) = 0, no NaN
    if top is None:
        p = e.sub_(norms.unsqueeze(2)).exp_()
    else:  # exp(terms - C) = e exp(top - C), top <= C
        p = e.mul_((top - norms.unsqueeze(2)).exp_())
    r = (inc - norms[:, 0::2]).exp_()
    if open_root is not None:
        p[:, 0, :, 0].masked_fill_(open_root.unsqueeze(-1), 0.0)
        r[:, 0, 0].masked_fill_(open_root, 0.0)
    return p, r


def _open_root(last: Tensor, multiroot: bool, w: int) -> Tensor | None:
    """[B] (single root only, else None): the items whose ROOT span of width ``w`` is not the
    whole sentence; it must stay open (one child of ROOT, closed only at the end)."""
    return None if multiroot else last != w


# The split weights of width w (3 B w (N - w) elements), kept from the inside pass for the
# outside pass and the Hessian-vector product while their total stays within this many
# elements, the others recomputed (one exp per term): memory O(B N^2) beyond the budget.
# Width by width (#42): when the rule kept all widths or none, the time stepped 2.4x from one
# size to the next where the whole stopped fitting (N = 64 -> 65 at B = 32); now one more
# position recomputes only what no longer fits.
_CACHE_ELEMENTS = 1 << 22


def _kept_widths(batch: int, size: int) -> int:
    """For the C++ kernels: how many span widths (1 .. k) keep their split weights for
    ``batch`` trees of ``size`` positions, the most whose elements fit in _CACHE_ELEMENTS
    (all N - 1 widths of the small problems). Their fused loops recompute at a cost per term,
    so which widths does not matter; a prefix keeps their packed layout."""
    total = 0
    for w in range(1, size):
        total += 3 * batch * w * (size - w)
        if total > _CACHE_ELEMENTS:
            return w - 1
    return max(size - 1, 0)


def _kept_mask(batch: int, size: int) -> list[bool]:
    """For the PyTorch code: per width 1 .. N-1, whether its split weights are kept. All if
    they fit in _CACHE_ELEMENTS; else the widths with the most terms (w (N - w): the middle
    ones) are recomputed, as few as bring the rest within it, since recomputing costs a dozen
    tensor operations per width and pass whatever its size."""
    sizes = [3 * batch * w * (size - w) for w in range(1, size)]
    keep, total = [True] * len(sizes), sum(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if total <= _CACHE_ELEMENTS:
            break
        keep[i], total = False, total - sizes[i]
    return keep


# The C++ kernels run trees of at most this many positions in fused loops (_eisner.cpp: the
# whole dynamic program on eight trees at once, in double precision; the split weights kept
# under the same rule as the ATen path's, _CACHE_ELEMENTS, else recomputed by the outside
# pass and the Hessian-vector product, one exp per term: memory O(B N^2)); larger trees run
# the per-width ATen operations, which split the batch over the threads where the fused
# loops keep one thread per group of eight trees. The timings that set the limit:
# benchmarks/README.md, "Figures behind the thresholds in structs/".
_FUSED_SIZE = 96

# Dispatch by measurement (#42): per SIMD target of the loaded kernels
# (_extension.loaded_target()), the largest tree the fused loops serve, where it differs from
# _FUSED_SIZE; larger trees take the kernels' per-width ATen path (the PyTorch code's
# operations without its Python overhead, whose speed does not depend on the clone much).
# Since the fused loops compute in each target's native vectors (_eisner.cpp, Pack), they
# are the faster path up to _FUSED_SIZE on every target: x86-64-v3 (AVX2) 0.05-0.90x the
# PyTorch code's time at N = 20-96 where the ATen path takes 0.52-1.04x, baseline x86-64
# (SSE2) 0.05-0.57x where the ATen path takes 0.53-1.06x (benchmarks/README.md, "Kernels per
# SIMD target"); so no target has an entry now. Where a target's loops lose again, its
# entry here routes the sizes above its limit to the ATen path (kernels too old to say their
# target: _FUSED_SIZE).
_FUSED_SIZES: dict[str, int] = {}


def _fused(size: int) -> bool:
    """Whether the C++ kernels take their fused path for trees of ``size`` positions (on the
    loaded kernels' SIMD target: _FUSED_SIZES)."""
    limit = _FUSED_SIZES.get(loaded_target() or "", _FUSED_SIZE)
    return size <= min(limit, _FUSED_SIZE)


# The C++ MAP kernel (eisner_map) keeps 7 N^2 vectors of 8 doubles per thread (29 MB at
# N = 256) and runs eight trees at once: above this many positions the PyTorch code's
# charts (O(B N^2)) are used instead. It adds float32 scores in double precision, so on
# float32 near-ties (within rounding) it may pick the tree that is better in exact arithmetic.
_MAP_FUSED_SIZE = 256


class _Charts(NamedTuple):
    chart: Tensor  # [B, 6, N, N] (layout above)
    inner: Tensor  # [B, N, N]: inner[b, w, s] = log sum_j C_R(s, s+j) + C_L(s+j+1, t)
    # (empty when ``weights`` are kept)
    last: Tensor  # [B] index of the last real position
    multiroot: bool
    # per width 1..N-1 (None where recomputed: _kept_mask), or None if none is kept
    weights: list[tuple[Tensor, Tensor] | None] | None

    def open_root(self, w: int) -> Tensor | None:
        return _open_root(self.last, self.multiroot, w)

    def kept(self, w: int) -> bool:
        """Whether width ``w``'s split weights are kept."""
        return self.weights is not None and self.weights[w - 1] is not None

    def split_weights(self, lay: _Layout, w: int) -> tuple[Tensor, Tensor]:
        if self.weights is not None and (kept := self.weights[w - 1]) is not None:
            return kept
        n = lay.size - w
        terms = lay.terms(self.chart, w)  # [B, 3, w, n]
        terms[:, 0, w - 1] = float("-inf")  # the I(s, w) slots
        terms[:, 2, 0] = float("-inf")
        sums = _groups(lay.comp(self.chart, w)[:, 0], self.inner[:, None, w, :n])
        return _weights(terms, None, sums, lay.inc(self.chart, w), self.open_root(w))


def _eisner_charts(
    arc_scores: Tensor,
    last: Tensor,
    multiroot: bool,
    keep: list[bool] | None = None,
    splits: list[tuple[Tensor, Tensor]] | None = None,
) -> _Charts:
    """Inside pass (log semiring; with ``splits``, a list, the max semiring, and the best
    split points of widths 1 .. N-1 are appended to it: (index [B, 3, n], direct [B, 2, n]));
    the split weights of the widths w with ``keep[w - 1]`` are kept (:func:`_kept_mask`)."""
    batch, size, _ = arc_scores.shape
    arcs = _arcs_by_width(arc_scores)  # per width [B, 2, n]: (s -> t, t -> s)
    chart = arc_scores.new_full((batch, 6, size, size), float("-inf"))
    chart[:, 1:3, 0] = 0.0  # complete spans of width 0
    chart[:, 3:5, size - 1] = 0.0
    keep = keep if splits is None and keep is not None and any(keep) else None
    # inner[b, w, s] (needed only to recompute the split weights; not kept with them)
    every = keep is not None and all(keep)
    inner = arc_scores.new_full((0,) if every else (batch, size, size), float("-inf"))
    weights: list[tuple[Tensor, Tensor] | None] | None = None if keep is None else []
    lay = _Layout(chart)
    for w in range(1, size):
        n = size - w
        terms = lay.terms(chart, w)  # [B, 3, w, n]
        open_root = _open_root(last, multiroot, w)
        if splits is None and weights is not None and keep is not None and keep[w - 1]:
            # log-sum-exp and the weights from one exp of the terms: with the max m over the
            # split, e = exp(terms - m), sums = m + log sum e, and later P = e exp(m - C)
            top = terms.amax(2, keepdim=True).clamp_min_(torch.finfo(terms.dtype).min)
            e = terms.sub_(top).exp_()  # [B, 3, w, n]
            sums = e.sum(2).log_().add_(top.squeeze(2))  # (right partial, inner, left p.)
            inc = torch.add(sums[:, 1:2], arcs[w], out=lay.inc(chart, w))  # I = inner + arc
            comp = sums[:, 0::2]  # C(s, w) = logaddexp(partial, I(s, w)), in place
            torch.logaddexp(comp, inc, out=comp)
            weights.append(_weights(e, top, sums, inc, open_root))
        elif splits is None:
            sums = torch.logsumexp(terms, 2)  # [B, 3, n]: (right partial, inner, left partial)
            # I(s, w) = inner + arc                                             [B, 2, n]
            inc = torch.add(sums[:, 1:2], arcs[w], out=lay.inc(chart, w))
            comp = torch.logaddexp(sums[:, 0::2], inc)
            inner[:, w, :n] = sums[:, 1]
            if weights is not None:
                weights.append(None)  # recomputed
        else:
            sums, index = terms.max(2)
            inc = torch.add(sums[:, 1:2], arcs[w], out=lay.inc(chart, w))
            partial = sums[:, 0::2]
            # ties as the plain max over j: left takes I (j = 0), right the partial
            direct = torch.stack([inc[:, 0] > partial[:, 0], inc[:, 1] >= partial[:, 1]], 1)
            comp = torch.where(direct, inc, partial)
            splits.append((index, direct))
        if open_root is not None:  # ROOT's right span is closed only at the sentence end
            comp[:, 0, 0].masked_fill_(open_root, float("-inf"))
        lay.comp(chart, w).copy_(comp.unsqueeze(1))  # both copies
    return _Charts(chart, inner, last, multiroot, weights)


@tensor_cache(maxsize=64)
def _arc_index(size: int, device: torch.device) -> Tensor:
    """LongTensor [N * N]: the flat chart position of the I span of each arc h -> m (a slot
    that is never written, X[0, N-1, N-1], for h = m)."""
    h = torch.arange(size, device=device).unsqueeze(1)
    m = torch.arange(size, device=device).unsqueeze(0)
    plane = size * size
    left = 5 * plane + (size - (h - m)) * size + h  # I_L(m, h - m) at X[5, N-(h-m), h]
    right = (m - h - 1) * size + h  # I_R(h, m - h) at X[0, m-h-1, h]
    unused = torch.full_like(left, plane - 1)
    return torch.where(h > m, left, torch.where(h < m, right, unused)).flatten()


def _arc_grads(grad_chart: Tensor) -> Tensor:
    """[B, N, N] arc gradients from a gradient chart [B, 6, N, N] (an arc enters only its
    own I span)."""
    batch, _, size, _ = grad_chart.shape
    index = _arc_index(size, grad_chart.device)
    return grad_chart.reshape(batch, 6 * size * size).index_select(1, index).view(batch, size, size)


def _outside_seed(grad: Tensor, last: Tensor, seed: Tensor) -> None:
    """Seed the gradient chart with d/d log Z: log Z = C_R(0, last) (start-indexed copy)."""
    grad[:, 1, :, 0].scatter_(1, last.unsqueeze(-1), seed.unsqueeze(-1))


def _eisner_outside(charts: _Charts, seed: Tensor, parents: list[Tensor] | None = None) -> Tensor:
    """Outside pass by hand: d (seed . log Z) / d chart entry, [B, 6, N, N] (final for the
    I spans; for a complete span, the sum of its two copies); ``seed`` [B] is the incoming
    gradient of log Z. Each span passes its gradient times the split weights to the two
    pieces of every term (widths down). If ``parents`` is a list, the gradients of the three
    sums of widths N-1 .. 1 are appended to it, [B, 3, 1, n] each."""
    grad = torch.zeros_like(charts.chart)
    _outside_seed(grad, charts.last, seed)
    lay = _Layout(grad)
    for w in range(lay.size - 1, 0, -1):
        p, r = charts.split_weights(lay, w)
        g_comp = lay.comp(grad, w).sum(1)  # [B, 2, n], final: every use is wider
        g_inc = lay.inc(grad, w).addcmul_(r, g_comp)  # + the complete spans' I(s, w) term
        g_parent = _groups(g_comp, g_inc.sum(1, keepdim=True)).unsqueeze(2)  # [B, 3, 1, n]
        if parents is not None:
            parents.append(g_parent)
        lay.first(grad, w).addcmul_(p, g_parent)  # [B, 3, w, n]
        lay.second(grad, w).addcmul_(p, g_parent)
    return grad


def _eisner_hvp(
    charts: _Charts, grad: Tensor, parents: list[Tensor] | None, direction: Tensor
) -> Tensor:
    """Hessian of log Z times ``direction`` [B, N, N] (arc layout), i.e. the derivative of the
    marginals along ``direction``: forward-mode tangents of the inside pass (widths up), then
    of the outside pass (``grad``, with ``parents`` from :func:`_eisner_outside` if kept;
    widths down), by hand. With p_j the weights of the terms A_j + B_j of a span P and dot
    the tangent:
      inside   dot P = sum_j p_j (dot A_j + dot B_j)      (+ the arc's direction for I)
      outside  dot g(A_j) += p_j ((dot A_j + dot B_j - dot P) g(P) + dot g(P))   (same for B_j)
    and the result is dot g of the I spans, mapped back to arcs."""
    tangent = torch.zeros_like(charts.chart)
    lay = _Layout(tangent)
    dirs = _arcs_by_width(direction)  # per width [B, 2, n]: (s -> t, t -> s)
    keep = parents is not None  # the tangent sums of the widths whose weights are kept
    sums: list[tuple[Tensor, Tensor]] = []  # per width (dot terms, dot sums [B, 3, 1, n])
    for w in range(1, lay.size):
        p, r = charts.split_weights(lay, w)
        d_terms = lay.terms(tangent, w)  # [B, 3, w, n]
        d_sums = (p * d_terms).sum(2)  # [B, 3, n]: (right partial, inner, left partial)
        d_inc = torch.add(d_sums[:, 1:2], dirs[w], out=lay.inc(tangent, w))  # [B, 2, n]
        d_comp = d_sums[:, 0::2].addcmul_(r, d_inc)  # d_sums: (dot C_R, dot inner, dot C_L)
        lay.comp(tangent, w).copy_(d_comp.unsqueeze(1))
        if keep and charts.kept(w):
            sums.append((d_terms, d_sums.unsqueeze(2)))
    d_grad = torch.zeros_like(tangent)
    for w in range(lay.size - 1, 0, -1):
        p, r = charts.split_weights(lay, w)
        dg_comp = lay.comp(d_grad, w).sum(1)  # [B, 2, n]
        d_inc = lay.inc(tangent, w)
        if keep and charts.kept(w):
            d_terms, d_parent = sums.pop()
            g_parent = parents[lay.size - 1 - w]  # type: ignore[index]
            g_comp = g_parent[:, 0::2, 0]
            d_comp = d_parent[:, 0::2, 0]
        else:
            d_comp = lay.comp(tangent, w)[:, 0]
            d_terms = lay.terms(tangent, w)
            d_inner = (p[:, 1] * d_terms[:, 1]).sum(1).unsqueeze(1)  # [B, 1, n]
            d_parent = _groups(d_comp, d_inner).unsqueeze(2)
            g_comp = lay.comp(grad, w).sum(1)
            g_parent = _groups(g_comp, lay.inc(grad, w).sum(1, keepdim=True)).unsqueeze(2)
        # the complete spans' I(s, w) term: dot g(I) += r ((dot I - dot C) g(C) + dot g(C))
        direct = (d_inc - d_comp).mul_(g_comp).add_(dg_comp).mul_(r)
        dg_inc = lay.inc(d_grad, w).add_(direct)
        dg_parent = _groups(dg_comp, dg_inc.sum(1, keepdim=True)).unsqueeze(2)
        # ((dot terms - dot P) g(P) + dot g(P)) p = (dot terms g(P) + shift) p   [B, 3, w, n]
        shift = dg_parent - d_parent * g_parent  # [B, 3, 1, n]
        t = torch.addcmul(shift, d_terms, g_parent).mul_(p)
        lay.first(d_grad, w).add_(t)
        lay.second(d_grad, w).add_(t)
    return _arc_grads(d_grad)


def _eisner_backtrack(
    splits: list[tuple[Tensor, Tensor]], last: Tensor, seed: Tensor, size: int
) -> Tensor:
    """The best tree's arc indicators [B, N, N] times ``seed`` [B], from the best split points
    of :func:`_eisner_charts` (the outside pass of the max semiring, widths down)."""
    batch = seed.shape[0]
    grad = seed.new_zeros(batch, 6, size, size)
    _outside_seed(grad, last, seed)
    lay = _Layout(grad)
    for w in range(size - 1, 0, -1):
        index, direct = splits[w - 1]  # [B, 3, n], [B, 2, n]
        g_comp = lay.comp(grad, w).sum(1)
        g_inc = lay.inc(grad, w).add_(g_comp * direct)
        g = _groups(g_comp * ~direct, g_inc.sum(1, keepdim=True)).unsqueeze(2)  # [B, 3, 1, n]
        lay.first(grad, w).scatter_add_(2, index.unsqueeze(2), g)
        lay.second(grad, w).scatter_add_(2, index.unsqueeze(2), g)
    return _arc_grads(grad)


def _map_kernels(arc_scores: Tensor) -> Any:
    """The compiled kernels if their MAP kernel (``eisner_map``) serves ``arc_scores``: built
    with it, CPU float32/64, at most _MAP_FUSED_SIZE positions; else None."""
    kernels = compiled_kernels(arc_scores)
    if kernels is None or not hasattr(kernels, "eisner_map"):
        return None
    return kernels if arc_scores.shape[-1] <= _MAP_FUSED_SIZE else None


class _EisnerMax(torch.autograd.Function):
    """Score of the best projective tree, [B] (forward: max-inside pass on an in-place chart,
    keeping the best split points; backward: the backtrack by hand, the best tree's arcs times
    the incoming gradient). On CPU with the C++ kernels built, the forward runs the max-plus
    pass and the backtrack in one fused kernel (``eisner_map``) and keeps the best heads."""

    @staticmethod
    def forward(
        arc_scores: Tensor, lengths: Tensor | None, multiroot: bool, stash: Stash
    ) -> Tensor:
        last = last_index(lengths, arc_scores.shape[0], arc_scores.shape[1], arc_scores.device)
        kernels = _map_kernels(arc_scores)
        if kernels is not None:  # fused C++ pass + backtrack
            score, heads = kernels.eisner_map(arc_scores.detach(), last, multiroot)
            stash.value = heads, None, last
            return score
        splits: list[tuple[Tensor, Tensor]] = []
        charts = _eisner_charts(arc_scores.detach(), last, multiroot, splits=splits)
        stash.value = None, splits, last
        return charts.chart[:, 1, :, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        arc_scores, lengths, multiroot, stash = inputs
        if stash.value is None:  # the forward ran through the vmap rule: recompute
            _EisnerMax.forward(arc_scores.detach(), lengths, multiroot, stash)
        ctx.heads, ctx.splits, last = stash.value
        ctx.size = arc_scores.shape[-1]
        ctx.save_for_backward(last)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        multiroot = args[2]
        return vmap_by_folding(
            lambda a, n: _EisnerMax.apply(a, n, multiroot, Stash()),
            info,
            in_dims[:2],
            args[:2],
            (True, True),
        )

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.heads is not None:  # the best tree's arcs heads[m] -> m, times grad
            heads = ctx.heads
            tree = grad.new_zeros(heads.shape[0], ctx.size, ctx.size)
            arcs = (heads >= 0).to(grad.dtype) * grad.unsqueeze(-1)  # [B, N]
            tree.scatter_(1, heads.clamp_min(0).unsqueeze(1), arcs.unsqueeze(1))
            return tree, None, None, None
        (last,) = ctx.saved_tensors
        return _eisner_backtrack(ctx.splits, last, grad, ctx.size), None, None, None


@full_precision
def eisner_argmax(
    arc_scores: Tensor, lengths: Tensor | None, multiroot: bool
) -> tuple[Tensor, Tensor] | None:
    """(score of the best projective tree [B] in the scores' dtype, its heads [B, N]: -1 at
    ROOT and padding) straight from the C++ MAP kernel: no autograd node, no [B, N, N] arc
    indicators, no copies (the kernel reads the scores as they are, no diagonal entry and
    nothing beyond an item's length, and takes column 0, arcs into ROOT, as -inf); the same
    tree as :func:`eisner_max`'s gradient. ``None`` where that kernel does not apply (not
    built, not CPU float32/64, more than _MAP_FUSED_SIZE positions): differentiate
    :func:`eisner_max` instead."""
    kernels = _map_kernels(arc_scores)
    if kernels is None:
        return None
    last = last_index(lengths, arc_scores.shape[0], arc_scores.shape[1], arc_scores.device)
    score, heads = kernels.eisner_map(arc_scores.detach(), last, multiroot)
    return score, heads


@full_precision
def eisner_max(arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
    """Score of the best projective tree, [B], like ``eisner_inside(..., MaxSemiring)``
    (ties: the first split point), with a hand-written backtrack as its backward (the
    gradient is the best tree's arc indicators); ``arc_scores`` must already have ``-inf``
    in column 0. Its gradient cannot be differentiated again (it is piecewise constant)."""
    refuse_jit_trace("A projective dependency CRF")
    return _EisnerMax.apply(arc_scores, lengths, multiroot, Stash())


class _EisnerLogPartition(torch.autograd.Function):
    """log Z over projective trees (forward: inside pass on an in-place chart, no autograd
    graph; backward: the outside pass by hand, the marginals times the incoming gradient).
    When the backward is itself differentiated (``create_graph``), the marginals come from
    :class:`_EisnerMarginals`, whose backward is a hand-written Hessian-vector product. On
    CPU the three passes run in the C++ kernels of :mod:`._extension` when they are built
    (the same algorithm; ``ctx.charts`` is then their state), else in the code above."""

    @staticmethod
    def forward(
        arc_scores: Tensor, lengths: Tensor | None, multiroot: bool, wants_grad: bool, stash: Stash
    ) -> Tensor:
        last = last_index(lengths, arc_scores.shape[0], arc_scores.shape[1], arc_scores.device)
        batch, size, _ = arc_scores.shape
        kernels = compiled_kernels(arc_scores)
        if kernels is not None:
            fused, kept = _fused(size), _kept_widths(batch, size) if wants_grad else 0
            charts = kernels.eisner_inside(arc_scores.detach(), last, multiroot, kept, fused)
            logz = kernels.eisner_log_partition(charts)
        else:
            keep = _kept_mask(batch, size) if wants_grad else None
            charts = _eisner_charts(arc_scores.detach(), last, multiroot, keep=keep)
            logz = charts.chart[:, 1, :, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)
        stash.value = charts, kernels
        return logz  # [B]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        arc_scores, lengths, multiroot, _, stash = inputs
        # an empty stash: the forward ran through the vmap rule (vmap outside grad); the
        # backward then recomputes the charts (in _EisnerMarginals)
        ctx.charts, ctx.kernels = stash.value if stash.value is not None else (None, None)
        ctx.save_for_backward(arc_scores)
        ctx.save_for_forward(arc_scores)
        ctx.lengths = lengths
        ctx.multiroot = multiroot

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        _, _, multiroot, wants_grad, _ = args
        return vmap_by_folding(
            lambda a, n: _EisnerLogPartition.apply(a, n, multiroot, wants_grad, Stash()),
            info,
            in_dims[:2],
            args[:2],
            (True, True),
        )

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: Any) -> Tensor:
        # <marginals, tangent>, the marginals by the Function on the scores: enclosing
        # levels differentiate it (_ops.outer_jvp)
        def body(arc_scores: Tensor, lengths: Tensor | None, tangent: Tensor) -> Tensor:
            seed = arc_scores.new_ones(arc_scores.shape[0])
            # differentiated again: the Function builds its own state from the scores
            charts, kernels = (
                (None, None) if differentiated(arc_scores) else (ctx.charts, ctx.kernels)
            )
            marginals = _EisnerMarginals.apply(
                arc_scores, seed, charts, lengths, ctx.multiroot, kernels, Stash()
            )
            return batch_dot((marginals, tangent))

        (arc_scores,) = ctx.saved_tensors
        return outer_jvp(body, arc_scores, ctx.lengths, tangent)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        (arc_scores,) = ctx.saved_tensors
        nones = (None, None, None, None)
        if torch.is_grad_enabled():  # differentiated again: one node with its own backward
            marginals = _EisnerMarginals.apply(
                arc_scores, grad, ctx.charts, ctx.lengths, ctx.multiroot, ctx.kernels, Stash()
            )
            return marginals, *nones
        if ctx.kernels is not None:
            return ctx.kernels.eisner_outside(ctx.charts, grad), *nones
        return _arc_grads(_eisner_outside(ctx.charts, grad)), *nones


class _EisnerMarginals(torch.autograd.Function):
    """``seed[b] * marginals[b]`` from the inside charts (forward: the outside pass by
    hand); backward: ``seed[b]`` times the Hessian-vector product of log Z by hand (the
    tangents of the inside and outside passes). Differentiating that once more falls back to
    autograd through :func:`eisner_inside` (any order)."""

    @staticmethod
    def forward(
        arc_scores: Tensor,
        seed: Tensor,
        charts: Any,
        lengths: Tensor | None,
        multiroot: bool,
        kernels: Any,
        stash: Stash,
    ) -> Tensor:
        if charts is None:  # not computed by the caller (a vmap rule): the inside pass here
            charts, kernels = _inside_charts(arc_scores, lengths, multiroot, True)
        parents: list[Tensor] | None = None
        kept = None
        if kernels is not None:  # the outside charts stay in ctx.kept, for the backward
            marginals, kept = kernels.eisner_marginals(charts, torch.ones_like(seed))
            outside = marginals.new_empty(0)
        else:
            parents = None if charts.weights is None else []
            outside = _eisner_outside(charts, torch.ones_like(seed), parents)
            marginals = _arc_grads(outside)  # [B, N, N]
        stash.value = charts, kernels, kept, parents, marginals, outside
        return marginals * seed.view(-1, 1, 1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        arc_scores, seed, _, lengths, multiroot, _, stash = inputs
        if stash.value is None:  # the forward ran through the vmap rule (vmap outside grad):
            # the backward works from the scores (by torch.func)
            stash.value = None, None, None, None, output.new_empty(0), output.new_empty(0)
        ctx.charts, ctx.kernels, ctx.kept, ctx.parents, marginals, outside = stash.value
        ctx.save_for_backward(arc_scores, seed, marginals, outside)
        ctx.save_for_forward(arc_scores, seed, marginals, outside)
        ctx.lengths = lengths
        ctx.multiroot = multiroot

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        arc_scores, seed, charts, lengths, multiroot, kernels = args[:6]
        if in_dims[0] is None and in_dims[3] is None:  # only the seed is vmapped
            unit = _EisnerMarginals.apply(
                arc_scores,
                torch.ones_like(arc_scores[:, 0, 0]),
                charts,
                lengths,
                multiroot,
                kernels,
                Stash(),
            )  # [B, N, N]
            return unit * seed.movedim(in_dims[1], 0)[..., None, None], 0
        return vmap_by_folding(
            lambda a, s, n: _EisnerMarginals.apply(a, s, None, n, multiroot, None, Stash()),
            info,
            (in_dims[0], in_dims[1], in_dims[3]),
            (arc_scores, seed, lengths),
            (True, True, True),
        )

    @staticmethod
    def jvp(ctx: Any, t_scores: Tensor | None, t_seed: Tensor | None, *_: Any) -> Tensor:
        # d(seed * mu) = seed * H t_scores + mu * t_seed (H: the Hessian of log Z), by
        # torch.func through the inside pass: differentiable (_ops.outer_jvp)
        def body(
            arc_scores: Tensor,
            seed: Tensor,
            marginals: Tensor,
            lengths: Tensor | None,
            t_scores: Tensor | None,
            t_seed: Tensor | None,
        ) -> Tensor:
            if differentiated(arc_scores, seed) or marginals.numel() == 0:
                marginals = _hvp_by_func(
                    arc_scores, lengths, ctx.multiroot, torch.zeros_like(arc_scores), True, True
                )
            out = torch.zeros_like(marginals)
            if t_scores is not None:
                out = out + _hvp_by_func(arc_scores, lengths, ctx.multiroot, t_scores, True)
                out = out * seed.view(-1, 1, 1)
            if t_seed is not None:
                out = out + marginals * t_seed.view(-1, 1, 1)
            return out

        arc_scores, seed, marginals, _ = ctx.saved_tensors
        return outer_jvp(body, arc_scores, seed, marginals, ctx.lengths, t_scores, t_seed)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        arc_scores, seed, marginals, outside = ctx.saved_tensors
        if ctx.needs_input_grad[0] and torch.is_grad_enabled() and not is_transformed(grad):
            # third order and beyond: autograd through the inside pass
            logz = eisner_inside(arc_scores, ctx.lengths, ctx.multiroot, LogSemiring)
            (unit,) = torch.autograd.grad(logz.sum(), arc_scores, create_graph=True)
            scaled = grad * seed.view(-1, 1, 1)
            (hvp,) = torch.autograd.grad(unit, arc_scores, scaled, create_graph=True)
            return hvp, (grad * unit).flatten(1).sum(-1), None, None, None, None, None
        if ctx.charts is None:
            marginals = torch.func.grad(
                lambda a: eisner_inside(a, ctx.lengths, ctx.multiroot, LogSemiring).sum()
            )(arc_scores)
        g_seed = (grad * marginals).flatten(1).sum(-1) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, g_seed, None, None, None, None, None
        if is_transformed(grad) or ctx.charts is None:
            # under torch.func (the in-place passes on the charts take plain tensors only)
            hvp = _hvp_by_func(arc_scores, ctx.lengths, ctx.multiroot, grad, False)
        elif ctx.kernels is not None:
            hvp = ctx.kernels.eisner_hvp(ctx.charts, ctx.kept, grad)
        else:
            hvp = _eisner_hvp(ctx.charts, outside, ctx.parents, grad)
        return hvp * seed.view(-1, 1, 1), g_seed, None, None, None, None, None


def _hvp_by_func(
    arc_scores: Tensor,
    lengths: Tensor | None,
    multiroot: bool,
    direction: Tensor,
    forward: bool,
    primal: bool = False,
) -> Tensor:
    """The Hessian of log Z times ``direction`` by ``torch.func`` through :func:`eisner_inside`
    (differentiable tensor operations: composes with vmap and the other transforms), by
    forward-over-reverse (``forward``) or reverse-over-reverse; ``primal``: the marginals
    instead (the same way)."""

    def unit(a: Tensor) -> Tensor:
        return eisner_inside(a, lengths, multiroot, LogSemiring).sum()

    marginals = torch.func.grad(unit)
    if primal:
        return marginals(arc_scores)
    if forward:
        out: Tensor = torch.func.jvp(marginals, (arc_scores,), (direction,))[1]
        return out
    _, vjp, *_ = torch.func.vjp(marginals, arc_scores)
    back: Tensor = vjp(direction)[0]
    return back


def _inside_charts(
    arc_scores: Tensor, lengths: Tensor | None, multiroot: bool, keep: bool
) -> tuple[Any, Any]:
    """(inside charts, the kernels that hold them or None) for :class:`_EisnerMarginals`."""
    batch, size, _ = arc_scores.shape
    last = last_index(lengths, batch, size, arc_scores.device)
    kernels = compiled_kernels(arc_scores)
    with torch.no_grad():
        if kernels is not None:
            fused, kept = _fused(size), _kept_widths(batch, size) if keep else 0
            return kernels.eisner_inside(arc_scores.detach(), last, multiroot, kept, fused), kernels
        mask = _kept_mask(batch, size) if keep else None
        return _eisner_charts(arc_scores.detach(), last, multiroot, keep=mask), None


@full_precision
def eisner_log_partition(arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
    """log Z over projective trees, [B], like ``eisner_inside(..., LogSemiring)`` but with a
    hand-written outside pass as its backward and a hand-written Hessian-vector product as
    the backward of that; ``arc_scores`` must already have ``-inf`` in column 0."""
    refuse_jit_trace("A projective dependency CRF")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        return torch.ops.structattn.eisner_log_partition(arc_scores, lengths, multiroot)
    wants_grad = arc_scores.requires_grad and torch.is_grad_enabled()
    return _EisnerLogPartition.apply(arc_scores, lengths, multiroot, wants_grad, Stash())


@full_precision
def eisner_marginals(arc_scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
    """Arc marginals p(h -> m) over projective trees, [B, N, N], in one autograd node:
    forward the inside and outside passes, backward the hand-written Hessian-vector product
    (the marginals of :func:`eisner_log_partition` without the first-order node and
    ``autograd.grad``; what a structured attention layer needs). ``arc_scores`` must
    already have ``-inf`` in column 0 and on the diagonal; entries beyond ``lengths`` are
    ignored. An item with no tree has zero marginals."""
    refuse_jit_trace("Projective tree attention")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        return torch.ops.structattn.eisner_marginals(arc_scores, lengths, multiroot)
    if is_transformed(arc_scores):  # the charts inside the Function (its vmap rule folds)
        charts, kernels = None, None
    else:
        charts, kernels = _inside_charts(arc_scores, lengths, multiroot, arc_scores.requires_grad)
    seed = arc_scores.new_ones(arc_scores.shape[0])
    return _EisnerMarginals.apply(arc_scores, seed, charts, lengths, multiroot, kernels, Stash())


def tree_score(arc_scores: Tensor, heads: Tensor, mask: Tensor) -> Tensor:
    """Sum of the scores of the arcs heads[m] -> m over real modifiers (``mask``), [B]."""
    safe = heads.masked_fill(~mask, 0).clamp(0, arc_scores.shape[-1] - 1)
    scores = arc_scores.gather(1, safe.unsqueeze(1)).squeeze(1)  # [B, N]: arc heads[m] -> m
    return scores.masked_fill(~mask, 0.0).sum(-1)


# the custom operators torch.compile and torch.export trace (._library)
tree_ops("eisner", eisner_log_partition, lambda a, n, r, _: eisner_marginals(a, n, r))
