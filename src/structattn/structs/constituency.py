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

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import last_index
from ..semirings import LogSemiring, Semiring
from ._extension import kernels as compiled_kernels
from ._library import cky_ops, tracing
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
    "cky_inside",
    "cky_kbest",
    "cky_labelled_log_partition",
    "cky_labelled_marginals",
    "cky_log_partition",
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


@full_precision
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


class _Charts(NamedTuple):
    """What the inside pass of :func:`_cky_charts` leaves for the outside pass and the
    Hessian-vector product: dense charts [B, N, N] (entry [i, j] the span [i, j], 0 below
    the diagonal), written width by width without autograd."""

    inside: Tensor  # I(i, j)
    inner: Tensor  # inner(i, j) = I(i, j) - s(i, j), the log-sum over the splits; -inf -> 0
    last: Tensor  # [B]: n - 1
    logz: Tensor  # [B]
    #: the C++ kernels' charts (float64; the third is I by column) where they ran, else None
    kernel: tuple[Tensor, Tensor, Tensor, Tensor] | None = None


def _view(chart: Tensor, w: int, offset: int, strides: tuple[int, ...]) -> Tensor:
    batch, size, _ = chart.shape
    shape = (batch, size - w + 1, *([w - 1] if len(strides) == 2 else []))
    return chart.as_strided(shape, (size * size, *strides), chart.storage_offset() + offset)


def _diag(chart: Tensor, w: int) -> Tensor:
    """View [B, N - w + 1] of the spans [i, i + w - 1] of a contiguous chart [B, N, N]."""
    return _view(chart, w, w - 1, (chart.shape[1] + 1,))


def _left(chart: Tensor, w: int) -> Tensor:
    """View [B, N - w + 1, w - 1]: the left children [i, i + k] of the spans of width w."""
    return _view(chart, w, 0, (chart.shape[1] + 1, 1))


def _right(chart: Tensor, w: int) -> Tensor:
    """View [B, N - w + 1, w - 1]: the right children [i + k + 1, i + w - 1] of the spans of
    width w (split k = 0 .. w - 2, as :func:`_left`)."""
    size = chart.shape[1]
    return _view(chart, w, size + w - 1, (size + 1, size))


def _kernel_ops(span_scores: Tensor) -> Any:
    """``torch.ops.structattn_cky`` where the C++ kernels apply to ``span_scores`` (CPU,
    float32 or float64, built), else None (the PyTorch code below)."""
    if compiled_kernels(span_scores) is None:
        return None
    try:  # registered by _cky.cpp when the kernels load (absent from an older build)
        torch.ops.structattn_cky.inside  # noqa: B018
    except (AttributeError, RuntimeError):
        return None
    return torch.ops.structattn_cky


def _cky_charts(span_scores: Tensor, lengths: Tensor | None) -> _Charts:
    """The log-semiring inside pass without autograd (``span_scores`` [B, N, N] detached):
    in the C++ kernels (``_cky.cpp``) on CPU, else per width one ``logsumexp`` over the
    splits of strided views of the chart."""
    batch, size, _ = span_scores.shape
    last = last_index(lengths, batch, size, span_scores.device)
    ops = _kernel_ops(span_scores)
    if ops is not None:
        kernel = tuple(ops.inside(span_scores, last))
        logz = kernel[3].to(span_scores.dtype)
        return _Charts(kernel[0], kernel[1], last, logz, kernel)
    scores = span_scores.contiguous()
    inside = torch.zeros_like(scores)
    inner = torch.zeros_like(scores)
    _diag(inside, 1).copy_(_diag(scores, 1))
    for w in range(2, size + 1):
        total = torch.logsumexp(_left(inside, w) + _right(inside, w), -1)  # [B, n]
        torch.add(_diag(scores, w), total, out=_diag(inside, w))
        _diag(inner, w).copy_(total.masked_fill_(torch.isneginf(total), 0.0))
    logz = inside[:, 0].gather(1, last.unsqueeze(-1)).squeeze(-1)  # I(0, n - 1)
    return _Charts(inside, inner, last, logz)


def _split_probs(charts: _Charts, w: int) -> Tensor:
    """[B, N - w + 1, w - 1]: the probability of each split of each span of width w given
    the span, exp(I(left) + I(right) - inner): a softmax of the inside pass's own terms."""
    terms = _left(charts.inside, w) + _right(charts.inside, w)
    return terms.sub_(_diag(charts.inner, w).unsqueeze(-1)).exp_()


def _root_seed(charts: _Charts, w: int) -> Tensor:
    """BoolTensor [B]: the items whose whole sentence is the span [0, w - 1] and that have
    a tree at all (their outside pass starts there with probability 1)."""
    return (charts.last == w - 1) & torch.isfinite(charts.logz)


class _Children:
    """Accumulators of what the spans receive from their parents, widths down: a parent of
    width W passes x [B, N - W + 1, W - 1] (one value per split k) to its left child
    [i, i + k] and its right child [i + k + 1, i + W - 1]; ``take(w)`` is then the total of
    the spans of width w (complete once every wider parent has passed)."""

    def __init__(self, like: Tensor) -> None:
        self.left = torch.zeros_like(like)  # [b, i, m]: the child [i, i + m]
        self.right = torch.zeros_like(like)  # [b, j, m]: the child [j - m, j]

    def give(self, x: Tensor, w: int) -> None:
        self.left[:, : x.shape[1], : w - 1].add_(x)
        self.right[:, w - 1 :, : w - 1].add_(x.flip(-1))

    def take(self, w: int) -> Tensor:
        n = self.left.shape[1] - w + 1
        return self.left[:, :n, w - 1] + self.right[:, w - 1 :, w - 1]


def _cky_outside(charts: _Charts) -> Tensor:
    """The span marginals [B, N, N] (0 below the diagonal and past the length), by hand.

    Widths down, in the probability domain: a span passes its marginal times the
    probability of each of its splits (:func:`_split_probs`) to the split's two children,
    and a span's marginal is the total it receives (the whole sentence: 1). Time O(B N^3):
    per width one exp, one product and two in-place sums over [B, N - w + 1, w - 1]."""
    if charts.kernel is not None:
        inside, inner, inside_t, logz = charts.kernel
        marginals = torch.ops.structattn_cky.outside(inside, inner, inside_t, logz, charts.last)
        return marginals.to(charts.logz.dtype)
    inside = charts.inside
    batch, size, _ = inside.shape
    marginals = torch.zeros_like(inside)
    children = _Children(inside)
    for w in range(size, 0, -1):
        p_w = children.take(w)
        p_w[:, 0] = torch.where(_root_seed(charts, w), 1.0, p_w[:, 0])
        _diag(marginals, w).copy_(p_w)
        if w > 1:
            children.give(_split_probs(charts, w).mul_(p_w.unsqueeze(-1)), w)
    return marginals


def _to_chart(chart: Tensor, lengths: Tensor | None) -> Tensor:
    """``chart`` [B, N, N] with 0 below the diagonal and past the length."""
    batch, size, _ = chart.shape
    return chart.masked_fill(~span_mask(lengths, batch, size, chart.device), 0.0)


def _cky_hvp(charts: _Charts, direction: Tensor) -> Tensor:
    """The Hessian of log Z times ``direction`` [B, N, N] (the derivative of the span
    marginals along it), by hand: forward-mode tangents of the inside pass (widths up),

        dot I(c) = direction(c) + dot inner(c),  dot inner(c) = Σ_k p_k(c) D_k(c),
        D_k(c) = dot I(left_k) + dot I(right_k),

    with p_k(c) the probability of split k of c (:func:`_split_probs`), then widths down
    the marginals p(c) (as :func:`_cky_outside`) and the adjoint g(c) of
    dot I(root) = <marginals, direction> with respect to I(c): a span passes to the two
    children of each split k

        p_k(P) [g(P) + p(P) (D_k(P) - dot inner(P))],

    and the result is g, as a span's score enters only its own I. Time O(B N^3)."""
    if charts.kernel is not None:
        inside, inner, inside_t, logz = charts.kernel
        ops = torch.ops.structattn_cky
        return ops.hvp(inside, inner, inside_t, logz, charts.last, direction).to(direction.dtype)
    inside = charts.inside
    batch, size, _ = inside.shape
    direction = direction.contiguous()
    tangent = torch.zeros_like(inside)
    d_inner = torch.zeros_like(inside)
    _diag(tangent, 1).copy_(_diag(direction, 1))
    probs: list[Tensor] = []  # per width 2 .. N
    for w in range(2, size + 1):
        p = _split_probs(charts, w)
        probs.append(p)
        total = (p * (_left(tangent, w) + _right(tangent, w))).sum(-1)
        _diag(d_inner, w).copy_(total)
        torch.add(_diag(direction, w), total, out=_diag(tangent, w))
    hvp = torch.zeros_like(inside)
    marginal = _Children(inside)
    adjoint = _Children(inside)
    for w in range(size, 0, -1):
        p_w = marginal.take(w)
        p_w[:, 0] = torch.where(_root_seed(charts, w), 1.0, p_w[:, 0])
        g_w = adjoint.take(w)
        _diag(hvp, w).copy_(g_w)
        if w > 1:
            p = probs[w - 2]
            q = p * p_w.unsqueeze(-1)  # p(P, split k)
            marginal.give(q, w)
            d_terms = _left(tangent, w) + _right(tangent, w)
            d_terms.sub_(_diag(d_inner, w).unsqueeze(-1)).mul_(q)
            adjoint.give(d_terms.addcmul_(p, g_w.unsqueeze(-1)), w)
    return hvp


class _CKYLogPartition(torch.autograd.Function):
    """log Z over binary bracketings (forward: the inside pass, no autograd graph; backward:
    the outside pass by hand, the marginals times the incoming gradient). When the backward
    is itself differentiated (``create_graph``, ``torch.func``), the marginals come from
    :class:`_CKYMarginals`, whose backward is a hand-written Hessian-vector product.
    ``vmap`` folds the vmapped dimension into the batch (one call of the same passes);
    ``jvp`` is the inner product of the marginals with the tangent."""

    @staticmethod
    def forward(span_scores: Tensor, lengths: Tensor | None, stash: Stash) -> Tensor:
        charts = _cky_charts(span_scores.detach(), lengths)
        stash.value = charts
        return charts.logz.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        span_scores, lengths, stash = inputs
        # an empty stash: the forward ran through the vmap rule (vmap outside grad); the
        # backward then recomputes the charts (in _CKYMarginals)
        ctx.charts = stash.value
        ctx.lengths = lengths
        ctx.save_for_backward(span_scores)
        ctx.save_for_forward(span_scores)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_by_folding(
            lambda a, n: _CKYLogPartition.apply(a, n, Stash()),
            info,
            in_dims[:2],
            args[:2],
            (True, True),
        )

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor, *_: Any) -> Tensor:
        # d log Z = <marginals, tangent>, the marginals by the Function on the scores:
        # enclosing levels differentiate it (_ops.outer_jvp)
        def body(span_scores: Tensor, lengths: Tensor | None, tangent: Tensor) -> Tensor:
            seed = span_scores.new_ones(span_scores.shape[0])
            charts = None if differentiated(span_scores) else ctx.charts
            marginals = _CKYMarginals.apply(span_scores, seed, lengths, charts, Stash())
            return batch_dot((marginals, tangent))

        (span_scores,) = ctx.saved_tensors
        return outer_jvp(body, span_scores, ctx.lengths, tangent)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (span_scores,) = ctx.saved_tensors
        if torch.is_grad_enabled() or ctx.charts is None or is_transformed(grad):
            # differentiated again: one node with its own backward
            marginals = _CKYMarginals.apply(span_scores, grad, ctx.lengths, ctx.charts, Stash())
            return marginals, None, None
        outside = _to_chart(_cky_outside(ctx.charts), ctx.lengths)
        return outside.mul_(grad.view(-1, 1, 1)), None, None


class _CKYMarginals(torch.autograd.Function):
    """``seed[b] * marginals[b]`` from the inside charts (forward: the outside pass by hand,
    after the inside pass unless the charts are given); backward: ``seed[b]`` times the
    Hessian-vector product of log Z by hand, which is also its ``jvp``. Differentiating the
    backward once more falls back to autograd through :func:`cky_inside` (any order). A
    direction that is a ``torch.func`` wrapper (jacfwd's batched tangents, an outer
    transform's cotangents) goes through :class:`_CKYHvp`, whose vmap rule folds it into
    the batch: the hand-written passes write into charts in place and the C++ kernels take
    plain tensors."""

    @staticmethod
    def forward(
        span_scores: Tensor,
        seed: Tensor,
        lengths: Tensor | None,
        charts: _Charts | None,
        stash: Stash,
    ) -> Tensor:
        if charts is None:  # not computed by the caller (a vmap rule): the inside pass here
            charts = _cky_charts(span_scores.detach(), lengths)
        marginals = _to_chart(_cky_outside(charts), lengths)
        stash.value = charts, marginals
        return marginals * seed.view(-1, 1, 1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        span_scores, seed, lengths, _, stash = inputs
        # an empty stash: the forward ran through the vmap rule (vmap outside grad)
        ctx.charts, marginals = stash.value if stash.value is not None else (None, None)
        ctx.lengths = lengths
        saved = (span_scores, seed) if marginals is None else (span_scores, seed, marginals)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        span_scores, seed, lengths, charts, _ = args
        if in_dims[0] is None and in_dims[2] is None:
            # only the seed is vmapped (jacrev of log Z): the marginals once, scaled
            unit = span_scores.new_ones(span_scores.shape[0])
            marginals = _CKYMarginals.apply(span_scores, unit, lengths, charts, Stash())
            return marginals * seed.movedim(in_dims[1], 0)[..., None, None], 0
        return vmap_by_folding(
            lambda a, s, n: _CKYMarginals.apply(a, s, n, None, Stash()),
            info,
            in_dims[:3],
            args[:3],
            (True, True, True),
        )

    @staticmethod
    def _unit(ctx: Any, span_scores: Tensor, saved: tuple[Tensor, ...]) -> Tensor:
        """The marginals (seed 1): saved by the forward, else (after the vmap rule) again
        through this Function (whose vmap rule folds)."""
        if len(saved) == 3:
            return saved[2]
        unit = span_scores.new_ones(span_scores.shape[0])
        marginals: Tensor = _CKYMarginals.apply(span_scores, unit, ctx.lengths, None, Stash())
        return marginals

    @staticmethod
    def _hvp(ctx: Any, span_scores: Tensor, direction: Tensor) -> Tensor:
        if ctx.charts is None or is_transformed(direction) or is_transformed(span_scores):
            # through a Function whose vmap rule folds the direction into the batch
            hvp: Tensor = _CKYHvp.apply(span_scores, direction, ctx.lengths, ctx.charts)
            return hvp
        return _to_chart(_cky_hvp(ctx.charts, _to_chart(direction, ctx.lengths)), ctx.lengths)

    @staticmethod
    def jvp(ctx: Any, t_scores: Tensor | None, t_seed: Tensor | None, *_: Any) -> Tensor:
        # d(seed mu) = seed H t_scores + mu t_seed (H: the Hessian of log Z); differentiated
        # again by an enclosing level (_ops.outer_jvp): by torch.func through the inside pass
        def body(
            span_scores: Tensor,
            seed: Tensor,
            lengths: Tensor | None,
            t_scores: Tensor | None,
            t_seed: Tensor | None,
            saved: list[Tensor],
        ) -> Tensor:
            again = differentiated(span_scores, seed)
            out = torch.zeros_like(span_scores)
            if t_scores is not None:
                if again:
                    hvp = _hvp_by_func(span_scores, lengths, t_scores)
                else:
                    hvp = _CKYMarginals._hvp(ctx, span_scores, t_scores)
                out = hvp * seed.view(-1, 1, 1)
            if t_seed is not None:
                if again:
                    unit = _to_chart(
                        torch.func.grad(lambda a: cky_inside(a, lengths, LogSemiring).sum())(
                            span_scores
                        ),
                        lengths,
                    )
                else:
                    unit = _CKYMarginals._unit(ctx, span_scores, (span_scores, seed, *saved))
                out = out + unit * t_seed.view(-1, 1, 1)
            return out

        span_scores, seed, *saved = ctx.saved_tensors
        return outer_jvp(body, span_scores, seed, ctx.lengths, t_scores, t_seed, saved)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        span_scores, seed = saved[:2]
        nones = (None, None, None)
        if ctx.needs_input_grad[0] and torch.is_grad_enabled() and not is_transformed(grad):
            # third order and beyond: autograd through the inside pass
            logz = cky_inside(span_scores, ctx.lengths, LogSemiring)
            (unit,) = torch.autograd.grad(logz.sum(), span_scores, create_graph=True)
            scaled = grad * seed.view(-1, 1, 1)
            (hvp,) = torch.autograd.grad(unit, span_scores, scaled, create_graph=True)
            return hvp, (grad * unit).flatten(1).sum(-1), *nones
        g_seed = None
        if ctx.needs_input_grad[1]:
            g_seed = (grad * _CKYMarginals._unit(ctx, span_scores, saved)).flatten(1).sum(-1)
        if not ctx.needs_input_grad[0]:
            return None, g_seed, *nones
        hvp = _CKYMarginals._hvp(ctx, span_scores, grad)
        return hvp * seed.view(-1, 1, 1), g_seed, *nones


class _CKYHvp(torch.autograd.Function):
    """The Hessian of log Z times ``direction`` [B, N, N] by hand (:func:`_cky_hvp`), for a
    direction or scores that are ``torch.func`` wrappers: its vmap rule folds a vmapped
    direction into the batch (the charts repeated, not recomputed), so that jacrev of the
    marginals, hessian and jacfwd run the hand-written pass once. Its own backward (third
    order) is by ``torch.func`` through :func:`cky_inside`."""

    @staticmethod
    def forward(
        span_scores: Tensor, direction: Tensor, lengths: Tensor | None, charts: _Charts | None
    ) -> Tensor:
        if charts is None:
            charts = _cky_charts(span_scores.detach(), lengths)
        return _to_chart(_cky_hvp(charts, _to_chart(direction, lengths)), lengths)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        span_scores, direction, lengths, _ = inputs
        ctx.lengths = lengths
        ctx.save_for_backward(span_scores, direction)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        span_scores, direction, lengths, charts = args
        if in_dims[0] is None and in_dims[2] is None and charts is not None:
            # only the direction is vmapped: the same charts for every direction
            stacked = direction.movedim(in_dims[1], 0)  # [V, B, N, N]
            size = stacked.shape[0]
            folded = stacked.reshape(-1, *stacked.shape[2:])

            def repeat(x: Tensor) -> Tensor:
                return x.repeat(size, *([1] * (x.dim() - 1)))

            kernel = charts.kernel
            repeated = _Charts(
                repeat(charts.inside),
                repeat(charts.inner),
                repeat(charts.last),
                repeat(charts.logz),
                None if kernel is None else (*map(repeat, kernel),),  # type: ignore[arg-type]
            )
            out = _CKYHvp.apply(
                repeat(span_scores),
                folded,
                None if lengths is None else repeat(lengths),
                repeated,
            )
            return out.view_as(stacked), 0
        return vmap_by_folding(
            lambda a, d, n: _CKYHvp.apply(a, d, n, None),
            info,
            in_dims[:3],
            args[:3],
            (True, True, True),
        )

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # d <grad, H(a) d> / da, and H grad for the direction (H is symmetric)
        span_scores, direction = ctx.saved_tensors
        g_scores = g_direction = None
        if ctx.needs_input_grad[0]:
            g_scores = torch.func.grad(
                lambda a: (_hvp_by_func(a, ctx.lengths, direction) * grad).sum()
            )(span_scores)
        if ctx.needs_input_grad[1]:
            g_direction = _hvp_by_func(span_scores, ctx.lengths, grad)
        return g_scores, g_direction, None, None


def _hvp_by_func(span_scores: Tensor, lengths: Tensor | None, direction: Tensor) -> Tensor:
    """The Hessian of log Z times ``direction`` by ``torch.func`` (forward over reverse)
    through :func:`cky_inside` (differentiable out-of-place operations: any order); 0 below
    the diagonal and past the length. Only the third derivative uses it."""

    def unit(a: Tensor) -> Tensor:
        return cky_inside(a, lengths, LogSemiring).sum()

    direction = _to_chart(direction, lengths)  # NaN-free where it is not read
    out: Tensor = torch.func.jvp(torch.func.grad(unit), (span_scores,), (direction,))[1]
    return _to_chart(out, lengths)


@full_precision
def cky_log_partition(span_scores: Tensor, lengths: Tensor | None) -> Tensor:
    """log Z over binary bracketings, [B], like ``cky_inside(..., LogSemiring)`` but with a
    hand-written outside pass as its backward and a hand-written Hessian-vector product as
    the backward of that. ``span_scores`` [B, N, N] as for :func:`cky_inside`. Works under
    ``torch.func`` transforms (``vmap`` folds into the batch; ``jvp`` by the marginals)."""
    refuse_jit_trace("A constituency-tree CRF")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        return torch.ops.structattn.cky_log_partition(span_scores, lengths)
    return _CKYLogPartition.apply(span_scores, lengths, Stash())


@full_precision
def cky_marginals(span_scores: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """log Z [B] (not differentiable) and the span marginals [B, N, N], in one autograd
    node: forward the inside and outside passes written by hand (:func:`_cky_outside`),
    backward the hand-written Hessian-vector product (:func:`_cky_hvp`; what structured
    attention trains through). Time O(B N^3) in N sequential widths per pass (one batched
    gather and reduction each), memory O(B N^2) plus O(N^3) cached indices. An item with no
    tree has zero marginals. ``span_scores`` as for :func:`cky_inside`. Under ``torch.func``
    transforms the charts are computed inside the Function (whose vmap rule folds)."""
    refuse_jit_trace("A constituency-tree CRF")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        logz, marginals = torch.ops.structattn.cky_marginals(span_scores, lengths)
        return logz.detach(), marginals
    seed = span_scores.new_ones(span_scores.shape[0])
    if is_transformed(span_scores):
        with torch.no_grad():
            logz = _CKYLogPartition.apply(span_scores.detach(), lengths, Stash())
        marginals = _CKYMarginals.apply(span_scores, seed, lengths, None, Stash())
        return logz, marginals
    with torch.no_grad():
        charts = _cky_charts(span_scores.detach(), lengths)
    marginals = _CKYMarginals.apply(span_scores, seed, lengths, charts, Stash())
    return charts.logz, marginals


# the custom operators torch.compile and torch.export trace (._library)
cky_ops(cky_log_partition, cky_marginals)


# ---- labelled spans [B, N, N, L]: the labels summed out in the same node -------------------
# A labelled tree gives each of its spans one label, and the labels factor: the CKY reads the
# log-sum-exp of each span's labels, and p(span [i, j] with label l) is the span's marginal
# times the softmax of its labels. Composed of autograd nodes that is a `where` over
# [B, N, N, L] (NaN padding must not reach the gradients), a logsumexp over L and their
# backward passes; the Functions below do the label passes by hand (in the C++ kernels on
# CPU: one pass over the items' spans, in double, never reading the padding) with the CKY's.


def _read_labels(span_scores: Tensor, lengths: Tensor | None) -> Tensor:
    """BoolTensor [B, N, N, 1]: the entries of ``span_scores`` [B, N, N, L] that are read."""
    batch, size = span_scores.shape[:2]
    return span_mask(lengths, batch, size, span_scores.device).unsqueeze(-1)


def _labelled_parts(span_scores: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
    """(``span_scores`` with 0 where never read, the label log-sum-exp [B, N, N]), by
    differentiable operations (the reference composition, and what transforms trace)."""
    parts = torch.where(_read_labels(span_scores, lengths), span_scores, 0.0)
    return parts, LogSemiring.sum(parts, dim=-1)


def _label_probs(parts: Tensor, spans: Tensor) -> Tensor:
    """p(label | span) [B, N, N, L] from :func:`_labelled_parts` (differentiable; 0 for a
    -inf label, and for every label of a span whose labels are all -inf)."""
    return (parts - spans.masked_fill(torch.isneginf(spans), 0.0).unsqueeze(-1)).exp()


def _composed_marginals(span_scores: Tensor, lengths: Tensor | None) -> Tensor:
    """The labelled marginals [B, N, N, L] by differentiable nodes: the span marginals
    (:func:`cky_marginals`, whose backward is the hand-written Hessian-vector product)
    times the labels' softmax."""
    parts, spans = _labelled_parts(span_scores, lengths)
    _, marginals = cky_marginals(spans, lengths)
    return marginals.unsqueeze(-1) * _label_probs(parts, spans)


class _LabelCharts(NamedTuple):
    """The inside pass of a labelled CKY, without autograd: ``spans`` [B, N, N] the label
    log-sum-exp of each span (float64 from the C++ kernels, else the scores' dtype; 0 where
    never read by the kernels), the CKY charts over them, the kernels' operators (None: the
    PyTorch code) and, once computed, the span marginals."""

    spans: Tensor
    charts: _Charts
    ops: Any
    marginals: Tensor | None = None


def _label_charts(span_scores: Tensor, lengths: Tensor | None) -> _LabelCharts:
    """The label log-sum-exp and the inside pass of ``span_scores`` [B, N, N, L] (detached):
    one C++ pass over the items' spans on CPU, else a ``where`` and a ``logsumexp``."""
    batch, size = span_scores.shape[:2]
    ops = _kernel_ops(span_scores)
    if ops is not None:
        last = last_index(lengths, batch, size, span_scores.device)
        spans = ops.label_logsumexp(span_scores, last)
    else:
        read = _read_labels(span_scores, lengths)
        spans = torch.logsumexp(torch.where(read, span_scores, 0.0), -1)
    return _LabelCharts(spans, _cky_charts(spans, lengths), ops)


def _label_probs_masked(span_scores: Tensor, c: _LabelCharts, lengths: Tensor | None) -> Tensor:
    """p(label | span) [B, N, N, L] (0 where never read), the PyTorch code."""
    norm = c.spans.masked_fill(torch.isneginf(c.spans), 0.0).unsqueeze(-1)
    read = _read_labels(span_scores, lengths)
    return torch.where(read, span_scores - norm, float("-inf")).exp_()


def _span_marginals(c: _LabelCharts) -> Tensor:
    """The span marginals [B, N, N] (float64 from the kernels), 0 outside the items' spans
    (the outside pass starts at each item's whole sentence)."""
    return _cky_outside(c.charts) if c.marginals is None else c.marginals


def _expand_labels(
    span_scores: Tensor, c: _LabelCharts, lengths: Tensor | None, scale: Tensor
) -> Tensor:
    """``scale[b]`` times the labelled marginals [B, N, N, L], in the dtype of the scores."""
    marginals = _span_marginals(c)
    if c.ops is not None:
        last = c.charts.last
        return c.ops.label_marginals(span_scores, c.spans, marginals, scale, last)
    probs = _label_probs_masked(span_scores, c, lengths)
    weight = marginals.to(span_scores.dtype) * scale.view(-1, 1, 1)
    return probs.mul_(weight.unsqueeze(-1))


def _batched(grad: Tensor) -> bool:
    """Whether a cotangent is a ``torch.func`` wrapper or batched by
    ``torch.autograd.grad(..., is_grads_batched=True)`` (legacy vmap)."""
    return is_transformed(grad) or bool(torch._C._functorch.is_legacy_batchedtensor(grad))


def _fused(span_scores: Tensor, lengths: Tensor | None) -> bool:
    """Whether the hand-written label passes apply: plain tensors, no ``torch.func``
    transform, tracing or forward-mode tangent (those take the composed nodes, which
    every transform differentiates)."""
    if tracing() or torch._C._are_functorch_transforms_active():
        return False
    if is_transformed(span_scores) or is_transformed(lengths):
        return False
    return torch.autograd.forward_ad.unpack_dual(span_scores).tangent is None


def _keep_label_charts(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    """``setup_context`` of the two labelled Functions: the charts their forward stashed,
    the lengths and the scores."""
    span_scores, lengths, stash = inputs
    ctx.charts = stash.value
    ctx.lengths = lengths
    ctx.save_for_backward(span_scores)


class _CKYLabelledLogPartition(torch.autograd.Function):
    """log Z of labelled span scores [B, N, N, L]: forward the label log-sum-exp and the
    inside pass (no autograd graph), backward the outside pass and the labels' softmax
    scaled by the incoming gradient, by hand (one C++ pass over the spans on CPU). A
    backward that is itself differentiated (``create_graph``) takes the composed labelled
    marginals (:func:`_composed_marginals`); batched cotangents (``torch.func``,
    ``is_grads_batched``) multiply them after the pass. Used only where :func:`_fused`
    allows (no vmap rule or jvp needed)."""

    @staticmethod
    def forward(span_scores: Tensor, lengths: Tensor | None, stash: Stash) -> Tensor:
        stash.value = _label_charts(span_scores.detach(), lengths)
        return stash.value.charts.logz.to(span_scores.dtype)

    setup_context = staticmethod(_keep_label_charts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (span_scores,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # differentiated again: differentiable nodes
            marginals = _composed_marginals(span_scores, ctx.lengths)
            return marginals * grad.view(-1, 1, 1, 1), None, None
        if _batched(grad):  # batched cotangents: the marginals, then scaled
            unit = torch.ones_like(ctx.charts.charts.logz, dtype=span_scores.dtype)
            marginals = _expand_labels(span_scores, ctx.charts, ctx.lengths, unit)
            return marginals * grad.view(-1, 1, 1, 1), None, None
        return _expand_labels(span_scores, ctx.charts, ctx.lengths, grad), None, None


class _CKYLabelledMarginals(torch.autograd.Function):
    """The labelled marginals [B, N, N, L]: forward the label log-sum-exp, the inside and
    outside passes and the labels' softmax times the span marginals; backward, along G,

        p_l (mu (G_l - ḡ) + (H ḡ)),   ḡ = Σ_l p_l G_l,

    with p_l the labels' softmax, mu the span marginals and H the span-level Hessian of
    log Z (its hand-written product, :func:`_cky_hvp`): by hand, in the C++ kernels on
    CPU. A backward that is itself differentiated, or a ``torch.func`` G, computes the same
    formula from differentiable nodes (the span marginals' Function and :class:`_CKYHvp`,
    whose vmap rule folds). Used only where :func:`_fused` allows."""

    @staticmethod
    def forward(span_scores: Tensor, lengths: Tensor | None, stash: Stash) -> Tensor:
        c = _label_charts(span_scores.detach(), lengths)
        c = c._replace(marginals=_span_marginals(c))  # kept for the backward
        stash.value = c
        unit = torch.ones_like(c.charts.logz, dtype=span_scores.dtype)
        return _expand_labels(span_scores.detach(), c, lengths, unit)

    setup_context = staticmethod(_keep_label_charts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (span_scores,) = ctx.saved_tensors
        lengths = ctx.lengths
        if torch.is_grad_enabled() or is_transformed(grad):
            read = _read_labels(span_scores, lengths)
            parts, spans = _labelled_parts(span_scores, lengths)
            probs = _label_probs(parts, spans)
            _, marginals = cky_marginals(spans, lengths)
            grad = torch.where(read, grad, 0.0)
            mean = (probs * grad).sum(-1)
            hvp = _CKYHvp.apply(spans, mean, lengths, None)
            out = probs * (marginals.unsqueeze(-1) * (grad - mean.unsqueeze(-1)))
            return out + probs * hvp.unsqueeze(-1), None, None
        c: _LabelCharts = ctx.charts
        if c.ops is not None:
            last = c.charts.last
            mean = c.ops.label_contract(span_scores, c.spans, grad, last)
            hvp = _cky_hvp(c.charts, mean)
            unit = torch.ones_like(c.charts.logz)
            marginals = _span_marginals(c)
            return (
                c.ops.label_backward(span_scores, c.spans, grad, mean, marginals, hvp, unit, last),
                None,
                None,
            )
        probs = _label_probs_masked(span_scores, c, lengths)
        grad = torch.where(_read_labels(span_scores, lengths), grad, 0.0)
        mean = (probs * grad).sum(-1)
        hvp = _cky_hvp(c.charts, mean)
        marginals = _span_marginals(c)
        out = grad.sub_(mean.unsqueeze(-1)).mul_(marginals.unsqueeze(-1))
        return out.add_(hvp.unsqueeze(-1)).mul_(probs), None, None


@full_precision
def cky_labelled_log_partition(span_scores: Tensor, lengths: Tensor | None) -> Tensor:
    """log Z over labelled binary bracketings, [B]: ``span_scores`` [B, N, N, L] (entries
    below the diagonal and past the length never read, NaN there harmless). The labels are
    summed out by hand with the inside pass (:class:`_CKYLabelledLogPartition`: in the C++
    kernels on CPU one pass over the items' spans); under ``torch.func`` transforms,
    forward-mode AD and tracing the same value by composed nodes (a ``where``, a logsumexp
    over L and :func:`cky_log_partition`), differentiable to any order."""
    refuse_jit_trace("A constituency-tree CRF")
    if _fused(span_scores, lengths):
        return _CKYLabelledLogPartition.apply(span_scores, lengths, Stash())
    _, spans = _labelled_parts(span_scores, lengths)
    return cky_log_partition(spans, lengths)


@full_precision
def cky_labelled_marginals(span_scores: Tensor, lengths: Tensor | None) -> Tensor:
    """p(span [i, j] with label l is in the tree) [B, N, N, L] (0 below the diagonal and
    past the length), ``span_scores`` as for :func:`cky_labelled_log_partition`; one node
    whose backward (the Hessian-vector product path) does the label passes by hand
    (:class:`_CKYLabelledMarginals`), else (transforms, forward mode, tracing) the span
    marginals of :func:`cky_marginals` times the labels' softmax."""
    refuse_jit_trace("A constituency-tree CRF")
    if _fused(span_scores, lengths):
        marginals: Tensor = _CKYLabelledMarginals.apply(span_scores, lengths, Stash())
        return marginals
    return _composed_marginals(span_scores, lengths)


def _topk(x: Tensor, k: int) -> Tensor:
    """The k largest values along the last dimension, [..., k], best first (``-inf`` where
    there are fewer than k)."""
    if x.shape[-1] < k:
        pad = x.new_full((*x.shape[:-1], k - x.shape[-1]), float("-inf"))
        x = torch.cat([x, pad], -1)
    return x.topk(k, dim=-1).values


@full_precision
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
