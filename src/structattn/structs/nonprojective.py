r"""Non-projective dependency trees: matrix-tree log-partition, Chu-Liu-Edmonds MAP, sampling.

Shapes: ``arc_scores`` [B, N, N] with position 0 the ROOT symbol and ``arc_scores[b, h, m]``
the score of the arc h -> m; ``lengths`` [B] counts positions including ROOT (``None`` = N).
Column 0 (arcs into ROOT), the diagonal (self loops) and arcs touching padding are ignored.

**Matrix-tree theorem.** With weights :math:`w_{hm} = e^{s_{hm}}` over the words 1..n and
root weights :math:`\rho_m = e^{s_{0m}}`, the Laplacian

.. math:: L_{hm} = -w_{hm} \; (h \ne m), \qquad
          L_{mm} = \rho_m + \textstyle\sum_{h \ne m} w_{hm}

has :math:`\det L = Z`, the sum over all arborescences rooted at ROOT of
:math:`\exp(\text{score})` (Koo et al. 2007; Smith & Smith 2007). With exactly one root child,
:math:`Z_1 = \sum_r \rho_r T_r` where :math:`T_r` is the weight of the arborescences of the
words rooted at r (Koo et al.: the determinant of the Laplacian without :math:`\rho` on its
diagonal and with its first row replaced by :math:`\rho`).

**Fast path: LU of the rescaled Laplacian.** Column m of L holds only weights of arcs into
m, so dividing it by :math:`e^{c_m}`, :math:`c_m = \max_h s_{hm}`, rescales det L by
:math:`e^{-\sum_m c_m}` exactly and leaves every entry in [0, 1] (times N on the diagonal).
Every item's rescaled L is factorised (batched LU, float64) and inverted: log Z is the log
of the pivots' product plus :math:`\sum_m c_m`, the marginals come in closed form from the
inverse (Koo et al. 2007), and the gradient of a loss on the marginals (second order) by a
hand-written formula with two batched matmuls (in float32 for float32 scores, in float64
for the items whose condition number exceeds 1e3, where float32 would lose about
cond * 1e-8 of the gradient); derivatives of any order stay exact. (The
C++ kernels invert by Gauss-Jordan elimination with the same partial pivoting, eight
matrices at once in the lanes of SIMD vectors, instead of LAPACK's LU and solve, except for
a few items left over from the groups of eight and for more than 384 words.) This is
trusted only for items whose 1-norm condition number is small (<= 1e4 for float64 scores,
<= 1e7 otherwise; measured error ~ cond * 4e-16): an LU of ``exp(scores - column max)``
is singular to working precision once score gaps exceed ~100 in float32 (~700 in float64)
and the best heads form a cycle, and an item with no tree has a singular L.

**Fallback: subtraction-free log-space elimination (GTH).** The other items (found per item,
recomputed together in one batch) go through an exact elimination. L is an M-matrix with
column sums :math:`\rho`, and Gaussian elimination can be written on the off-diagonal
weights and the column sums alone (Grassmann-Taksar-Heyman): eliminating word k with pivot
:math:`p_k = \rho_k + \sum_{i} w_{ik}` gives

.. math:: w'_{ij} = w_{ij} + w_{ik} w_{kj} / p_k, \qquad
          \rho'_j = \rho_j + \rho_k w_{kj} / p_k, \qquad \det L = p_k \det L'.

Every quantity is a sum of positive terms, so it is run in log space with ``logsumexp``: no
cancellation, no overflow, exact ``-inf`` for structurally impossible parts (log Z is ``-inf``
exactly when no tree exists), any |score|. For one root child the pivots leave out
:math:`\rho` (they eliminate the word Laplacian rooted at the last word, :math:`T_{last}`) and
:math:`\rho'` is carried linearly, so the last word ends with
:math:`\rho'_{last} = Z_1 / T_{last}`; words are relabelled first so that the last one reaches
every word through finite arcs, which keeps every pivot positive. Time O(B N^3) in N
sequential steps; autograd through it gives marginals (and their derivatives).

**MAP** is Chu-Liu-Edmonds, batched: every round takes the best head of each (super-)node,
contracts all cycles of all items at once, and the contractions are undone top-down at the
end. Weights are pairs (rank, score) compared lexicographically, with an integer rank that
counts forbidden arcs and, with one root child, root arcs: this enforces ``-inf`` arcs and
the single root child exactly (a symbolic, not a numeric, "large penalty").

**Sampling** is exact sequential conditioning: word m's head is drawn from its marginal given
the heads of words 1..m-1 (their other incoming arcs set to ``-inf``). Fixing a head changes
one column of the Laplacian, so the inverse follows by the Sherman-Morrison formula in O(N^2)
per word, O(N^3) per sample (refreshed by a fresh inversion every few words); items whose
Laplacian is ill-conditioned recompute the marginals for every word instead (O(N^4)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import length_mask
from ..semirings import logsumexp
from ._extension import kernels as host_kernels
from ._library import tracing, tree_ops
from ._ops import (
    batch_dot,
    differentiated,
    is_transformed,
    outer_jvp,
    reads_host,
    refuse_jit_trace,
    vmap_by_folding,
)

__all__ = [
    "chu_liu_edmonds",
    "matrix_tree_log_partition",
    "matrix_tree_marginals",
    "matrix_tree_sample",
]

_NEG_INF = float("-inf")


def compiled_kernels(x: Tensor) -> Any:
    """The C++ kernels for ``x`` (see :mod:`._extension`), never for tensors they cannot
    take (``torch.func`` wrappers, meta or fake tensors)."""
    return None if is_transformed(x) else host_kernels(x)


# ---- helpers ------------------------------------------------------------------------------
def _arc_mask(real: Tensor) -> Tensor:
    """BoolTensor [B, N, N]: allowed arcs h -> m (h real, m a real word, h != m)."""
    size = real.shape[-1]
    eye = torch.eye(size, dtype=torch.bool, device=real.device)
    words = real.clone()
    words[:, 0] = False
    return real.unsqueeze(-1) & words.unsqueeze(1) & ~eye


def _logaddexp(x: Tensor, y: Tensor) -> Tensor:
    """``log(exp(x) + exp(y))`` with finite gradients (of any order) when both are ``-inf``."""
    return logsumexp(torch.stack(torch.broadcast_tensors(x, y), -1), -1)


def _spanning_word(arc_scores: Tensor, real: Tensor) -> Tensor:
    """LongTensor [B]: the first word from which every real word is reachable through finite
    arcs among words (the last real word if there is none: then no one-root tree exists)."""
    batch, size, _ = arc_scores.shape
    words = real.clone()
    words[:, 0] = False
    eye = torch.eye(size, dtype=torch.bool, device=real.device)
    adj = torch.isfinite(arc_scores) & words.unsqueeze(-1) & words.unsqueeze(1)
    reach = (adj | eye).float()  # [B, N, N]: reach[h, m] = m reachable from h
    for _ in range(max(1, math.ceil(math.log2(size)))):
        reach = (reach @ reach > 0).float()  # paths of length <= 2^k
    reaches_all = ((reach > 0) | ~words.unsqueeze(1)).all(-1) & words  # [B, N]
    last = real.sum(-1) - 1  # [B]
    first = reaches_all.float().argmax(-1)  # [B]: first word that reaches all
    return torch.where(reaches_all.any(-1), first, last)


def _swap(arc_scores: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """Relabel positions i[b] <-> j[b] in both axes of ``arc_scores`` [B, N, N]."""
    batch, size, _ = arc_scores.shape
    perm = torch.arange(size, device=arc_scores.device).expand(batch, size)  # [B, N]
    # out of place: under vmap i and j may be batched where perm is not
    perm = perm.scatter(1, i.unsqueeze(-1), j.unsqueeze(-1))
    perm = perm.scatter(1, j.unsqueeze(-1), i.unsqueeze(-1))
    rows = arc_scores.gather(1, perm.unsqueeze(-1).expand(batch, size, size))
    return rows.gather(2, perm.unsqueeze(1).expand(batch, size, size))


# ---- log-partition: fast path (LU of the rescaled Laplacian) --------------------------------
# The words' Laplacian is a linear map of the weights, L = Phi(W), with W [B, N, n] holding
# the weights of the arcs into the n words (row 0: ROOT). Then d log det L = <L^{-T}, Phi(dW)>
# = <Phi*(L^{-T}), dW>, so the marginals are mu = W * Phi*(L^{-T}) (Koo et al. 2007), and for
# a loss with gradient G on mu (the training path of structured attention):
#   d loss / d scores = G * mu - W * Phi*(Y A Y)^T,  Y = L^{-1},  A = Phi(G * W)
# (two batched matmuls), which _TreeMarginals implements by hand.
def _laplacian(weights: Tensor, padding: Tensor | None, multiroot: bool) -> Tensor:
    r"""Laplacian [B, n, n] of the words, :math:`\Phi(W)` (differentiable), from ``weights``
    [B, N, n] (row 0: root weights rho, rows 1..: w_{hm}; zero on the diagonal and at
    padding) plus ``padding`` [B, n] on the diagonal (1.0 at padding words: their rows and
    columns become those of the identity; None: nothing added).

    Multi-root: :math:`L = \mathrm{diag}(\rho + \sum_h w_{h\cdot}) - w`. One root child
    (Koo et al. 2007): rho off the diagonal and the first row replaced by rho."""
    words = weights[:, 1:]  # [B, n, n]
    incoming = (weights if multiroot else words).sum(1)  # [B, n] column sums
    if padding is not None:
        incoming = incoming + padding
    lap = torch.diag_embed(incoming) - words  # [B, n, n]
    if not multiroot:
        lap = torch.cat([weights[:, :1], lap[:, 1:]], 1)  # first row := rho
    return lap


def _weighted_adjoint(weights: Tensor, inverse: Tensor, multiroot: bool) -> Tensor:
    r""":math:`W \odot \Phi^*(Y^T)`, shape [B, N, n], from ``weights`` W [B, N, n] and ``inverse``
    Y [B, n, n], in differentiable ops. With :math:`Y = L^{-1}` these are the marginals:
    multi-root :math:`\mu_{0m} = \rho_m Y_{mm}`, :math:`\mu_{hm} = w_{hm}(Y_{mm} - Y_{mh})`;
    one root child :math:`\mu_{0m} = \rho_m Y_{m1}`,
    :math:`\mu_{hm} = w_{hm}([m \ne 1] Y_{mm} - [h \ne 1] Y_{mh})` (word 1 = first row)."""
    trans = inverse.transpose(1, 2)  # [B, n, n]
    diag = inverse.diagonal(dim1=1, dim2=2).unsqueeze(1)  # [B, 1, n]
    if multiroot:
        coef = torch.cat([diag, diag - trans], 1)  # [B, N, n]
    else:
        diag = torch.cat([torch.zeros_like(diag[..., :1]), diag[..., 1:]], -1)  # Y_11 unused
        coef = torch.cat([trans[:, :1], diag, diag - trans[:, 1:]], 1)  # [B, N, n]
    return weights * coef


def _adjoint_coefficients(inverse: Tensor, multiroot: bool) -> Tensor:
    r""":math:`\Phi^*(Y^T)`, shape [B, N, n] in the dtype of ``inverse`` Y [B, n, n] (not
    differentiable): with :math:`Y = \Phi(W)^{-1}` the gradient of :math:`\log\det\Phi(W)`
    with respect to W, so the marginals are :math:`W \odot \Phi^*(Y^T)` (see
    :func:`_weighted_adjoint`). Multi-root: row 0 (root arcs) :math:`Y_{mm}`, row h
    :math:`Y_{mm} - Y_{mh}`. One allocation (large temporaries are costly to first-touch)."""
    batch, words, _ = inverse.shape
    trans = inverse.transpose(1, 2)  # [B, n, n]
    diag = inverse.diagonal(dim1=1, dim2=2).unsqueeze(1)  # [B, 1, n]
    coef = inverse.new_empty(batch, words + 1, words)  # [B, N, n]
    torch.sub(diag, trans, out=coef[:, 1:])  # arcs between words: Y_mm - Y_mh
    if multiroot:
        coef[:, 0] = diag[:, 0]  # root arcs: Y_mm
    else:
        coef[:, 0] = trans[:, 0]  # root arcs: Y_m1
        coef[:, 1] = diag[:, 0]  # arcs from word 1 (the replaced row): no Y_mh term
        coef[:, 2:, 0] -= diag[:, :, 0]  # arcs into word 1: no Y_11 term
    return coef


def _marginals(
    scores: Tensor, weights: Tensor, inverse: Tensor, multiroot: bool, scale: Tensor | None = None
) -> Tensor:
    """Marginals [B, N, N] in the dtype of ``scores`` (0 in column 0), times ``scale`` [B] if
    given, from the weights [B, N, n] and the inverse Laplacian (not differentiable)."""
    kernels = compiled_kernels(scores)
    if kernels is not None:  # the same operations in C++, the batch split over the threads
        return kernels.matrix_tree_marginals(scores, weights, inverse, multiroot, scale)
    coef = _adjoint_coefficients(inverse, multiroot)  # [B, N, n]
    if scale is not None:
        coef.mul_(scale[:, None, None])
    out = scores.new_zeros(scores.shape)  # [B, N, N]
    torch.mul(weights, coef.to(weights.dtype), out=out[:, :, 1:])
    return out


class _KnownInverse(torch.autograd.Function):
    """``matrix -> inverse`` where the inverse is already known (from the LU of the forward
    pass); backward :math:`-Y^T G Y^T` in differentiable ops, so any order works."""

    generate_vmap_rule = True  # forward and backward are plain tensor operations

    @staticmethod
    def forward(matrix: Tensor, inverse: Tensor) -> Tensor:
        return inverse.view_as(inverse)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (inverse,) = ctx.saved_tensors
        trans = inverse.transpose(1, 2)
        return -(trans @ grad @ trans), None


def _padding(real: Tensor | None) -> Tensor | None:
    """[B, n] float64, 1.0 at padding words (None without padding)."""
    return None if real is None else (~real[:, 1:]).to(torch.float64)


def _live_weights_and_inverse(
    scores: Tensor, inverse: Tensor, real: Tensor | None, keep: Tensor | None, multiroot: bool
) -> tuple[Tensor, Tensor]:
    """(weights [B, N, n], inverse [B, n, n]) as differentiable functions of ``scores`` (the
    inverse through :class:`_KnownInverse`, from its known value), both float64: the
    third-order path, where a hand-written backward is itself differentiated."""
    batch, size, _ = scores.shape
    arcs = _arc_mask(length_mask(None, batch, size, scores.device) if real is None else real)
    masked = scores[:, :, 1:].masked_fill(~arcs[:, :, 1:], _NEG_INF).to(torch.float64)
    shift = masked.detach().amax(1, keepdim=True).nan_to_num(neginf=0.0)
    live = (masked - shift).exp()  # [B, N, n]
    if keep is not None:
        live = live * keep[:, None, None]
    lap = _laplacian(live, _padding(real), multiroot)
    return live, _KnownInverse.apply(lap, inverse.to(torch.float64))


def _marginals_by_inverse(
    scores: Tensor, real: Tensor | None, keep: Tensor | None, multiroot: bool
) -> Tensor:
    """Marginals [B, N, N] as differentiable operations of ``scores`` (the inverse Laplacian
    by ``torch.linalg.inv``, float64; 0 for an item with no tree): for a jvp that an
    enclosing transform differentiates again (any order; slower than the closed forms)."""
    batch, size, _ = scores.shape
    arcs = _arc_mask(length_mask(None, batch, size, scores.device) if real is None else real)
    masked = scores[:, :, 1:].masked_fill(~arcs[:, :, 1:], _NEG_INF).to(torch.float64)
    shift = masked.detach().amax(1, keepdim=True).nan_to_num(neginf=0.0)
    live = (masked - shift).exp()  # [B, N, n]
    lap = _laplacian(live, _padding(real), multiroot)
    if keep is not None:  # an item with no tree: weights 0, the identity for its Laplacian
        live = live * keep[:, None, None]
        eye = torch.eye(lap.shape[-1], dtype=lap.dtype, device=lap.device)
        lap = torch.where(keep[:, None, None], lap, eye)
    adj = _weighted_adjoint(live, torch.linalg.inv(lap), multiroot)
    return torch.nn.functional.pad(adj.to(scores.dtype), (1, 0))


def _marginals_backward(
    grad: Tensor,
    weights: Tensor,
    inverse: Tensor,
    marginals: Tensor,
    multiroot: bool,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """d loss / d scores [B, N, N] (in the dtype of ``grad``) for the gradient ``grad`` of a
    loss on the marginals: G * mu - W * Phi*((Y A Y)^T) with A = Phi(G * W), computed in
    ``dtype`` (default: the weights'; ported to C++ in ``_matrix_tree.cpp``)."""
    dtype = weights.dtype if dtype is None else dtype
    weights = weights.to(dtype)
    scaled = grad[:, :, 1:].to(dtype) * weights  # [B, N, n]
    lap = scaled[:, 1:].neg()  # [B, n, n] A: a copy, then completed in place
    lap.diagonal(dim1=1, dim2=2).add_((scaled if multiroot else scaled[:, 1:]).sum(1))
    if not multiroot:
        lap[:, 0] = scaled[:, 0]
    inverse = inverse.to(dtype)
    coef = _adjoint_coefficients(torch.bmm(torch.bmm(inverse, lap), inverse), multiroot)
    out = grad.to(dtype) * marginals.to(dtype)
    out[:, :, 1:] -= coef.mul_(weights)
    return out.to(grad.dtype)


class _TreeMarginals(torch.autograd.Function):
    """Marginals [B, N, N] (input dtype) from the weights and inverse Laplacian of
    :func:`_lu_path`; backward by the closed form above (two batched matmuls, in the weights'
    dtype, and in float64 for the items marked ``precise``). When that backward is itself
    differentiated (third order), it is rebuilt from differentiable ops on the scores, with
    the known inverse."""

    @staticmethod
    def forward(
        scores: Tensor,
        weights: Tensor,
        inverse: Tensor,
        real: Tensor | None,
        keep: Tensor | None,
        precise: Tensor | None,
        multiroot: bool,
    ) -> Tensor:
        return _marginals(scores, weights, inverse, multiroot)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(*inputs[:6], output)
        ctx.save_for_forward(*inputs[:6], output)
        ctx.multiroot = inputs[6]

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_by_folding(
            lambda *a: _TreeMarginals.apply(*a, args[-1]),
            info,
            in_dims[:-1],
            args[:-1],
            (True,) * 6,
        )

    @staticmethod
    def jvp(ctx: Any, t_scores: Tensor, *_: Any) -> Tensor:
        # the Jacobian of the marginals is the (symmetric) Hessian of log Z: jvp = vjp;
        # differentiated again by an enclosing level (_ops.outer_jvp): by torch.func through
        # differentiable operations of the scores
        def body(t_scores: Tensor, *saved: Tensor) -> Tensor:
            scores, _, _, real, keep = saved[:5]
            if differentiated(scores):
                return torch.func.jvp(
                    lambda s: _marginals_by_inverse(s, real, keep, ctx.multiroot),
                    (scores,),
                    (t_scores,),
                )[1]
            return _tree_hvp(saved, ctx.multiroot, t_scores)

        return outer_jvp(body, t_scores, *ctx.saved_tensors)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        none = (None, None, None, None, None, None)
        return _tree_hvp(ctx.saved_tensors, ctx.multiroot, grad), *none


def _tree_hvp(saved: Sequence[Tensor], multiroot: bool, grad: Tensor) -> Tensor:
    """The backward (a Hessian-vector product) of :class:`_TreeMarginals` from its saved
    tensors."""
    scores, weights, inverse, real, keep, precise, marginals = saved
    if torch.is_grad_enabled() or is_transformed(grad):
        # differentiated again (or under torch.func): rebuild from the scores
        live, inverse = _live_weights_and_inverse(scores, inverse, real, keep, multiroot)
        lap = _laplacian(grad[:, :, 1:] * live, None, multiroot)
        adj = _weighted_adjoint(live, inverse @ lap @ inverse, multiroot)
        adj = torch.nn.functional.pad(adj.to(scores.dtype), (1, 0))  # [B, N, N]
        return grad * marginals - adj
    # in the weights' dtype (float32 matmuls for float32 scores), then again in float64
    # for the ill-conditioned items (float32 would lose about cond * 1e-8 of the scale)
    kernels = compiled_kernels(grad)
    if kernels is not None:  # the same operations in C++, the batch split over the threads
        out: Tensor = kernels.matrix_tree_marginals_backward(
            grad, weights, inverse, marginals, multiroot, precise
        )
        return out
    if precise is not None and not reads_host(precise):  # every item in float64
        return _marginals_backward(grad, weights, inverse, marginals, multiroot, torch.float64)
    out = _marginals_backward(grad, weights, inverse, marginals, multiroot)
    if precise is not None:
        index = precise.nonzero().squeeze(1)
        g, w, y, mu = (t.index_select(0, index) for t in (grad, weights, inverse, marginals))
        out.index_copy_(0, index, _marginals_backward(g, w, y, mu, multiroot, torch.float64))
    return out


def _lu_operations(
    scores: Tensor, real: Tensor | None, multiroot: bool, max_cond: float, need_logz: bool
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor]:
    """The operations of :func:`_lu_path` before the items are sorted out (ported to C++ in
    ``_matrix_tree.cpp``): (log Z or None, weights, inverse, keep, cond: the 1-norm condition
    number bound [B], NaN or inf if singular), every item as computed."""
    dtype = torch.promote_types(scores.dtype, torch.float32)
    weights = scores[:, :, 1:].to(dtype, copy=True, memory_format=torch.contiguous_format)
    weights.diagonal(-1, 1, 2).fill_(_NEG_INF)  # self loops: weights[:, m, m - 1]
    if real is not None:
        weights.masked_fill_(~(real.unsqueeze(-1) & real[:, None, 1:]), _NEG_INF)
    shift = weights.amax(1, keepdim=True).nan_to_num_(neginf=0.0)  # [B, 1, n]
    weights.sub_(shift).exp_()
    lap = weights[:, 1:].to(torch.float64, copy=True).neg_()  # [B, n, n]
    incoming = (weights if multiroot else weights[:, 1:]).sum(1, dtype=torch.float64)  # [B, n]
    if real is not None:
        incoming += ~real[:, 1:]  # padding words: rows and columns of the identity
    lap.diagonal(dim1=1, dim2=2).add_(incoming)
    if not multiroot:
        lap[:, 0] = weights[:, 0]  # first row := rho
    factor, pivots, _ = torch.linalg.lu_factor_ex(lap)
    eye = torch.eye(lap.shape[-1], dtype=lap.dtype, device=lap.device)
    inverse = torch.linalg.lu_solve(factor, pivots, eye.expand_as(lap))  # [B, n, n]
    # 1-norm condition number; ||L||_1 <= 2 max_m (rho_m + sum_h w_hm) (padding: 1 <= it)
    norm = incoming if multiroot else incoming + weights[:, 0]  # [B, n] column sums
    cond = inverse.abs().sum(1).amax(-1).mul_(norm.amax(-1))
    keep = cond <= max_cond / 2  # NaN: False
    logz = None
    if need_logz:
        logz = factor.diagonal(dim1=1, dim2=2).abs().log_().add_(shift.squeeze(1)).sum(-1)
    return logz, weights, inverse, keep, cond


@overload
def _lu_path(
    scores: Tensor,
    real: Tensor | None,
    multiroot: bool,
    max_cond: float,
    need_logz: Literal[True] = ...,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]: ...
@overload
def _lu_path(
    scores: Tensor, real: Tensor | None, multiroot: bool, max_cond: float, need_logz: Literal[False]
) -> tuple[None, Tensor, Tensor, Tensor | None, Tensor | None]: ...
def _lu_path(
    scores: Tensor, real: Tensor | None, multiroot: bool, max_cond: float, need_logz: bool = True
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None, Tensor | None]:
    r"""The LU of the column-rescaled Laplacian (not differentiable): (log Z [B] in the input
    dtype, or None if ``need_logz`` is False; weights W [B, N, n] = ``exp(s - shift)`` for the
    arcs into the words in the input dtype (at least float32; 0 at self loops and padding);
    the inverse :math:`L^{-1}` [B, n, n] float64; ``keep`` [B] bool, or None when every item
    is kept; ``precise`` [B] bool, the kept items whose condition number exceeds
    ``_PRECISE_COND`` when W is not float64 (their backward of a loss on the marginals is
    computed in float64), or None when there is none). One host sync.

    Column m of L holds only weights of arcs into m, so subtracting its best score
    :math:`c_m` rescales det L by :math:`e^{-c_m}` exactly and leaves every weight in [0, 1]
    (a relative rounding of W is an absolute rounding of the scores: harmless in float32);
    the Laplacian is formed and factorised in float64. Items whose 1-norm condition number
    exceeds ``max_cond`` (NaN or inf if singular: no tree) are not kept: they get log Z 0, zero
    weights and the identity as inverse (zero marginals and gradients), for the caller to
    replace. When the condition number is small the determinant is accurate, hence positive
    like Z: no sign check is needed."""
    kernels = compiled_kernels(scores)
    if kernels is not None:  # the same operations in C++, the batch split over the threads
        logz, weights, inverse, keep, precise, all_kept, any_precise = kernels.matrix_tree_lu(
            scores, real, multiroot, max_cond, need_logz, precise_cond=_PRECISE_COND
        )
        logz = logz if need_logz else None
    else:
        logz, weights, inverse, keep, cond = _lu_operations(
            scores, real, multiroot, max_cond, need_logz
        )
        precise = keep & (cond > _PRECISE_COND)
        if reads_host(keep):
            all_kept, any_precise = torch.stack([keep.all(), precise.any()]).tolist()
        else:  # no host read: as if some item were not kept and some were precise
            all_kept, any_precise = False, True
    precise = precise if any_precise and weights.dtype != torch.float64 else None
    if all_kept:
        return None if logz is None else logz.to(scores.dtype), weights, inverse, None, precise
    eye = torch.eye(inverse.shape[-1], dtype=inverse.dtype, device=inverse.device)
    inverse = torch.where(keep[:, None, None], inverse, eye)
    weights.mul_(keep[:, None, None])
    if logz is not None:
        logz = logz.masked_fill(~keep, 0.0).to(scores.dtype)
    return logz, weights, inverse, keep, precise


class _LogPartition(torch.autograd.Function):
    r"""log Z [B] as computed by :func:`_lu_path` (passed through), differentiable with respect
    to ``scores``: the backward gives the marginals in closed form from the inverse
    (:func:`_adjoint_coefficients`), and through :class:`_TreeMarginals` when it is itself
    differentiated."""

    @staticmethod
    def forward(
        scores: Tensor,
        logz: Tensor,
        weights: Tensor,
        inverse: Tensor,
        real: Tensor | None,
        keep: Tensor | None,
        precise: Tensor | None,
        multiroot: bool,
    ) -> Tensor:
        return logz.clone()  # not a view: callers may modify it in place

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        scores, _, *rest, multiroot = inputs
        ctx.save_for_backward(scores, *rest)
        ctx.save_for_forward(scores, *rest)
        ctx.multiroot = multiroot

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_by_folding(
            lambda *a: _LogPartition.apply(*a, args[-1]),
            info,
            in_dims[:-1],
            args[:-1],
            (True,) * 7,
        )

    @staticmethod
    def jvp(ctx: Any, t_scores: Tensor, *_: Any) -> Tensor:
        # <marginals, tangent>, the marginals by the Function on the scores: enclosing levels
        # differentiate it (_ops.outer_jvp)
        def body(t_scores: Tensor, *saved: Tensor) -> Tensor:
            marginals = _TreeMarginals.apply(*saved, ctx.multiroot)
            return batch_dot((marginals, t_scores))

        return outer_jvp(body, t_scores, *ctx.saved_tensors)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        scores, weights, inverse, real, keep, precise = ctx.saved_tensors
        none = (None, None, None, None, None, None, None)
        if torch.is_grad_enabled() or is_transformed(grad):
            # create_graph (or torch.func): the marginals are differentiated again
            marginals = _TreeMarginals.apply(
                scores, weights, inverse, real, keep, precise, ctx.multiroot
            )
            return grad[:, None, None] * marginals, *none
        return _marginals(scores, weights, inverse, ctx.multiroot, grad), *none


#: largest 1-norm condition number of the rescaled Laplacian for which the LU path is used,
#: by input dtype; float64 arithmetic throughout, measured marginal error ~ cond * 4e-16
_MAX_COND = {torch.float64: 1e4}
_MAX_COND_DEFAULT = 1e7
#: above this condition number the backward of a loss on the marginals runs in float64 for
#: float32 scores (float32 matmuls lose about cond * 1e-8 of the gradient's scale: measured
#: relative errors 3.5e-5 at cond 3.5e3, 4e-4 at 3e4, 2e-2 at 1.5e6)
_PRECISE_COND = 1e3


# ---- log-partition: exact log-space elimination (fallback) ---------------------------------
def _eliminate(scores: Tensor, real: Tensor, multiroot: bool) -> Tensor:
    """log Z [B] by subtraction-free Gaussian elimination in log space (see the module
    docstring); ``scores`` [B, N, N], ``real`` [B, N]. Non-arcs (column 0, the diagonal,
    padding) are set to ``-inf`` here."""
    scores = scores.masked_fill(~_arc_mask(real), _NEG_INF)
    batch, size, _ = scores.shape
    last = real.sum(-1) - 1  # [B] index of the last word
    if not multiroot:
        # the word eliminated last must reach every word: then no pivot vanishes
        scores = _swap(scores, _spanning_word(scores, real), last)
    root = scores[:, 0, 1:]  # [B, n] log rho of words 1..n (n = N - 1)
    block = scores[:, 1:, 1:]  # [B, n, n] log w between the words not yet eliminated
    total = scores.new_zeros(batch)
    for k in range(1, size):
        into = block[:, 1:, 0]  # [B, M-1] log w_{ik}: remaining words i -> word k
        out = block[:, 0, 1:]  # [B, M-1] log w_{kj}
        terms = torch.cat([into, root[:, :1]], -1) if multiroot else into  # [B, M(-1)]
        pivot = logsumexp(terms, -1)  # [B] log p_k (-inf only if no tree or padding)
        # log det L = sum_k log p_k over words before the last; the last word contributes
        # log rho' (equal to its pivot when multiroot); padding contributes log 1 = 0
        step = torch.where(last > k, pivot, torch.where(last == k, root[:, 0], 0.0))
        total = total + step
        safe = torch.where(torch.isneginf(pivot), 0.0, pivot).unsqueeze(-1)  # [B, 1]
        # w'_{ij} = w_{ij} + w_{ik} w_{kj} / p_k        [B, M-1, M-1]
        block = _logaddexp(
            block[:, 1:, 1:], into.unsqueeze(-1) + out.unsqueeze(1) - safe[..., None]
        )
        # rho'_j = rho_j + rho_k w_{kj} / p_k            [B, M-1]
        root = _logaddexp(root[:, 1:], root[:, :1] + out - safe)
    # the gradient of an item with no tree must be 0, not a sum over its finite pivots
    return torch.where(torch.isneginf(total), torch.full_like(total, _NEG_INF), total)


def _fallback_items(keep: Tensor, lengths: Tensor | None, size: int) -> tuple[Tensor, Tensor]:
    """(index [K] of the items the LU path did not keep, their real positions [K, N]): the
    items for the exact elimination; every item where the host cannot be read (K = B, see
    :func:`._ops.reads_host`; the caller then picks by ``keep``)."""
    if not reads_host(keep):
        index = torch.arange(keep.shape[0], device=keep.device)
        return index, length_mask(lengths, keep.shape[0], size, keep.device)
    index = (~keep).nonzero().squeeze(1)
    sub = length_mask(None if lengths is None else lengths[index], len(index), size, keep.device)
    return index, sub


@full_precision
def matrix_tree_log_partition(
    arc_scores: Tensor, lengths: Tensor | None = None, multiroot: bool = True
) -> Tensor:
    """log Z over non-projective trees by the matrix-tree theorem, shape [B].

    ``arc_scores`` [B, N, N] (ROOT = 0, ``[b, h, m]`` scores h -> m; entries may be ``-inf``);
    ``lengths`` [B] in 2..N counts positions including ROOT. Column 0, the diagonal and
    padding are ignored. ``-inf`` exactly for items with no tree; then every gradient is 0.
    Differentiable to any order.

    Every item first goes through the LU of its column-rescaled Laplacian in float64
    (:func:`_lu_path`: O(N^3) in a few batched LAPACK calls, marginals in closed form
    from the inverse); the items where that is ill-conditioned or singular (no tree, huge
    score ranges, ``-inf`` arcs that disconnect words) are recomputed together by the exact
    log-space elimination (:func:`_eliminate`, N sequential steps).
    """
    refuse_jit_trace("A non-projective dependency CRF")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        return torch.ops.structattn.matrix_tree_log_partition(arc_scores, lengths, multiroot)
    batch, size, _ = arc_scores.shape
    device = arc_scores.device
    real = None if lengths is None else length_mask(lengths, batch, size, device)  # [B, N]
    max_cond = _MAX_COND.get(arc_scores.dtype, _MAX_COND_DEFAULT)
    with torch.no_grad():
        logz, weights, inverse, keep, precise = _lu_path(
            arc_scores.detach(), real, multiroot, max_cond
        )
    if differentiated(arc_scores):  # requires grad, or a torch.func grad or jvp wrapper
        logz = _LogPartition.apply(
            arc_scores, logz, weights, inverse, real, keep, precise, multiroot
        )
    if keep is not None:
        index, sub = _fallback_items(keep, lengths, size)
        exact = _eliminate(arc_scores.index_select(0, index), sub, multiroot)
        if index.shape[0] == keep.shape[0] and not reads_host(keep):  # every item eliminated
            return torch.where(keep, logz, exact)
        logz = logz.index_copy(0, index, exact)
    return logz


@full_precision
def matrix_tree_marginals(
    arc_scores: Tensor,
    lengths: Tensor | None = None,
    multiroot: bool = True,
    create_graph: bool = False,
) -> Tensor:
    """p(h -> m in the tree), shape [B, N, N], the gradient of log Z; 0 at column 0, the
    diagonal, padding and for items with no tree (``create_graph`` keeps it differentiable
    with respect to ``arc_scores``, to any order).

    Directly from the LU path (:func:`_lu_path`, closed form from the inverse, no autograd
    round trip through log Z); the items it cannot trust are recomputed as the gradient of
    the exact log-space elimination."""
    refuse_jit_trace("Non-projective tree attention")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        return torch.ops.structattn.matrix_tree_marginals(arc_scores, lengths, multiroot)
    batch, size, _ = arc_scores.shape
    device = arc_scores.device
    real = None if lengths is None else length_mask(lengths, batch, size, device)  # [B, N]
    max_cond = _MAX_COND.get(arc_scores.dtype, _MAX_COND_DEFAULT)
    differentiable = create_graph and differentiated(arc_scores)  # torch.func wrappers too
    scores = arc_scores if differentiable else arc_scores.detach()
    with torch.no_grad():
        _, weights, inverse, keep, precise = _lu_path(
            scores.detach(), real, multiroot, max_cond, need_logz=False
        )
    with torch.set_grad_enabled(differentiable):
        marginals = _TreeMarginals.apply(scores, weights, inverse, real, keep, precise, multiroot)
    if keep is None:
        return marginals
    index, sub = _fallback_items(keep, lengths, size)
    if bool(torch._C._functorch.is_functorch_wrapped_tensor(scores)):
        # under torch.func: a transform that composes with the others
        exact = torch.func.grad(lambda p: _eliminate(p, sub, multiroot).sum())(
            scores.index_select(0, index)
        )
        return torch.where(keep[:, None, None], marginals, exact)
    with torch.inference_mode(False), torch.enable_grad():
        picked = scores.index_select(0, index)
        if not differentiable:  # a fresh leaf (a clone first for inference-mode tensors)
            picked = (picked.clone() if picked.is_inference() else picked).requires_grad_(True)
        logz = _eliminate(picked, sub, multiroot)
        (exact,) = torch.autograd.grad(
            logz.sum(), picked, create_graph=differentiable, materialize_grads=True
        )
    if index.shape[0] == keep.shape[0] and not reads_host(keep):  # every item eliminated
        return torch.where(keep[:, None, None], marginals, exact)
    return marginals.index_copy(0, index, exact)


# ---- MAP: Chu-Liu-Edmonds -------------------------------------------------------------------
# Arc weights are pairs (rank, score) compared lexicographically; CLE only needs a totally
# ordered abelian group, and pairs under + with lexicographic order are one. The integer rank
# makes constraints exact without a "large constant": a forbidden (-inf) arc has rank -(N+1),
# and with one root child every root arc has rank -1 more, so the best tree first has the
# fewest forbidden arcs, then the fewest root children, then the highest score.
_NONE = -(2**40)  # rank of a non-arc (column 0, diagonal, padding, arcs inside a super-node)


def _greedy_heads(rank: Tensor, score: Tensor, alive: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Best incoming arc (lexicographic) of every node: (rank [B, N], score [B, N],
    head [B, N]); head 0 for ROOT and dead nodes."""
    top = rank.amax(1)  # [B, N] best rank into each column m
    best, head = score.masked_fill(rank != top.unsqueeze(1), _NEG_INF).max(1)  # [B, N]
    return top, best, head.masked_fill(~alive, 0)


def _find_cycles(head: Tensor) -> tuple[Tensor, Tensor]:
    """Cycles of the functional graph ``head`` [B, N] (ROOT = 0 points to itself).

    Returns (on_cycle [B, N] bool, rep [B, N]: the smallest node of the cycle through each
    node), by pointer doubling: after 2^J >= N jumps every node sits on its terminal cycle.
    """
    batch, size = head.shape
    idx = torch.arange(size, device=head.device).expand(batch, size)
    jump, low = head, torch.minimum(idx, head)  # h^(2^j), min over the first 2^j + 1 nodes
    for _ in range(max(1, math.ceil(math.log2(size)))):
        low = torch.minimum(low, low.gather(1, jump))
        jump = jump.gather(1, jump)
    on_cycle = torch.zeros_like(head, dtype=torch.bool).scatter_(1, jump, True)
    on_cycle[:, 0] = False
    return on_cycle, low


def _group_max(
    rank: Tensor, score: Tensor, group: Tensor, dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Lexicographic max of the arcs [B, N, N] over the members of each group along ``dim``
    (1: tails, 2: heads). Returns (rank, score, arg), each [B, N, N], indexed by group id
    along ``dim``; ``arg`` is the smallest member reaching the max (ids that are no group get
    rank ``_NONE``)."""
    batch, size, _ = rank.shape
    shape = (batch, size, 1) if dim == 1 else (batch, 1, size)
    index = group.view(shape).expand_as(rank)  # [B, N, N] group of each row (or column)
    top = torch.full_like(rank, _NONE).scatter_reduce_(dim, index, rank, "amax")
    at_top = rank == top.gather(dim, index)
    score = score.masked_fill(~at_top, _NEG_INF)
    best = torch.full_like(score, _NEG_INF).scatter_reduce_(dim, index, score, "amax")
    hit = (score == best.gather(dim, index)).logical_and_(at_top)
    view = (1, size, 1) if dim == 1 else (1, 1, size)
    pos = torch.arange(size, device=rank.device).view(view)  # [1, N, 1] or [1, 1, N]
    # the smallest hit member (size - 1 for ids that are no group: any valid index)
    arg = torch.full_like(rank, size - 1).scatter_reduce_(
        dim, index, torch.where(hit, pos, size - 1), "amin"
    )
    return top, best.masked_fill_(torch.isneginf(best), 0.0), arg


def _max_arborescence(rank: Tensor, score: Tensor, real: Tensor) -> Tensor:
    """Heads [B, N] of the lexicographically best spanning arborescence rooted at 0 over the
    real positions, for arc weights (``rank`` long [B, N, N], ``score`` [B, N, N]); non-arcs
    have rank ``_NONE``.

    Each round takes the best incoming arc of every super-node and contracts all cycles of all
    items at once (an arc h -> m entering a cycle is reweighted w[h, m] - w[head[m], m]);
    every round removes a super-node of every unfinished item, so at most N - 1 rounds, and
    the items without a cycle leave the working batch (one host sync per round, two in the
    rounds where items finish). The
    contractions are then undone top-down.
    """
    batch, size, _ = rank.shape
    device = rank.device
    idx = torch.arange(size, device=device).expand(batch, size)  # [B, N]
    eye = torch.eye(size, dtype=torch.bool, device=device)
    # orig[b, h, m] = flat id h * N + m of the original arc behind super-arc h -> m
    orig = torch.arange(size * size, device=device).view(1, size, size).expand(batch, -1, -1)
    alive = real.clone()  # super-nodes still present (ROOT is never a modifier)
    alive[:, 0] = False
    comp = idx.clone()  # [B, N] original node -> its current super-node
    items = torch.arange(batch, device=device)  # the working batch's items
    arc = torch.zeros(batch, size, dtype=torch.long, device=device)  # final arc into each node
    final_alive = torch.zeros_like(alive)
    history: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]] = []
    for _ in range(size):
        top, best, head = _greedy_heads(rank, score, alive)
        on_cycle, rep = _find_cycles(head)
        cyclic = on_cycle.any(1)  # [A], A = the items still in the working batch
        kept = cyclic.nonzero().squeeze(1)
        left = len(kept)
        if left < len(items):  # finished items: record their arcs, drop them
            done = (~cyclic).nonzero().squeeze(1)
            arc[items[done]] = orig.gather(1, head.unsqueeze(1)).squeeze(1)[done]
            final_alive[items[done]] = alive[done]
            if left == 0:
                break
            items, rank, score, orig, alive, comp = (
                t[kept] for t in (items, rank, score, orig, alive, comp)
            )
            top, best, head, on_cycle, rep = (t[kept] for t in (top, best, head, on_cycle, rep))
        if not left:  # an empty batch
            break
        loc = idx[: len(items)]
        cycle_arc = orig.gather(1, head.unsqueeze(1)).squeeze(1)  # [A, N] arc head[m] -> m
        history.append((items, on_cycle, rep, cycle_arc, comp))
        group = torch.where(on_cycle, rep, loc)  # [A, N] super-node after contraction
        # an arc h -> m entering a cycle replaces m's cycle arc: w[h, m] - w[head[m], m]
        rank = rank - torch.where(on_cycle, top, 0).unsqueeze(1)
        score = score - torch.where(on_cycle, best, 0.0).unsqueeze(1)
        rank, score, arg_h = _group_max(rank, score, group, 1)  # [A, G, N] best tail per group
        orig = orig.gather(1, arg_h)
        rank, score, arg_m = _group_max(rank, score, group, 2)  # [A, G, G] best head per group
        orig = orig.gather(2, arg_m)
        rank = rank.masked_fill(eye, _NONE)  # arcs inside a super-node are gone
        alive = alive & (~on_cycle | (loc == rep))
        comp = group.gather(1, comp)
    # entry[s]: the original node where the arc entering super-node s lands
    entry = torch.where(final_alive, arc % size, idx)
    heads = torch.full((batch, size + 1), -1, dtype=torch.long, device=device)  # +1: dump slot
    heads.scatter_(1, torch.where(final_alive, arc % size, size), arc // size)
    for items, on_cycle, rep, cycle_arc, comp_before in reversed(history):
        loc = idx[: len(items)]
        group = torch.where(on_cycle, rep, loc)
        into_group = entry[items].gather(1, group)  # where the arc into m's cycle lands
        broken = comp_before.gather(1, into_group)  # the member that arc enters
        keep = on_cycle & (broken != loc)  # the other members keep their cycle arc
        entry[items] = torch.where(keep, cycle_arc % size, into_group)
        rows = heads[items]
        rows.scatter_(1, torch.where(keep, cycle_arc % size, size), cycle_arc // size)
        heads[items] = rows
    words = real.clone()
    words[:, 0] = False
    return heads[:, :size].masked_fill(~words, -1)


@full_precision
def chu_liu_edmonds(
    arc_scores: Tensor, lengths: Tensor | None = None, multiroot: bool = True
) -> Tensor:
    """Heads [B, N] (LongTensor, ``-1`` at ROOT and padding) of the highest-scoring
    non-projective tree, batched Chu-Liu-Edmonds; ``-1`` everywhere for items with no tree.

    ``-inf`` arcs and ``multiroot=False`` (exactly one root child) are exact, through
    lexicographic (rank, score) weights. Not differentiable. Time O(B N^2) per round, at most
    N - 1 rounds (one or two host syncs each); on CPU with the C++ kernels built, each item
    contracts its own cycles (the same weights, scores added in double), the batch split
    over the threads.
    """
    with torch.no_grad():
        batch, size, _ = arc_scores.shape
        real = length_mask(lengths, batch, size, arc_scores.device)
        arcs = _arc_mask(real)  # [B, N, N]
        scores = arc_scores.detach().masked_fill(~arcs, _NEG_INF)
        forbidden = torch.isneginf(scores)
        rank = forbidden.long() * -(size + 1)  # [B, N, N]
        if not multiroot:
            rank[:, 0] -= 1  # each root child costs one rank unit
        rank = rank.masked_fill(~arcs, _NONE)
        finite = scores.masked_fill(forbidden, 0.0)
        kernels = compiled_kernels(scores)
        if kernels is not None:  # per item in C++, the batch split over the threads
            heads = kernels.max_arborescence(rank, finite, real.sum(-1))
        else:
            heads = _max_arborescence(rank, finite, real)
        bad = torch.isneginf(_heads_score(scores, heads))
        if not multiroot:
            bad |= (heads == 0).sum(-1) != 1
        return heads.masked_fill(bad.unsqueeze(-1), -1)


def _heads_score(scores: Tensor, heads: Tensor) -> Tensor:
    """Sum of ``scores`` [B, N, N] over the arcs heads[m] -> m with heads[m] >= 0, [B]."""
    has = heads >= 0
    arcs = scores.gather(1, heads.clamp(min=0).unsqueeze(1)).squeeze(1)  # [B, N]
    return arcs.masked_fill(~has, 0.0).sum(-1)


# ---- exact sampling ------------------------------------------------------------------------
@full_precision
def matrix_tree_sample(
    arc_scores: Tensor, lengths: Tensor | None = None, multiroot: bool = True, n: int = 1
) -> Tensor:
    """``n`` exact samples of heads, LongTensor [n, B, N] (``-1`` at ROOT, padding and for
    items with no tree), by sequential conditioning on the matrix-tree marginals.

    For m = 1..N-1: draw head[m] ~ p(head[m] = h | head[1..m-1]) (column m of the marginals of
    the conditioned scores, Gumbel-max with the global torch RNG), then keep only that arc in
    column m. Conditioning changes one column of the Laplacian, so its inverse is updated by
    the Sherman-Morrison formula in O(N^2) per word (:func:`_sample_by_updates`): O(n B N^3)
    in all, in float64, with the inverse refreshed by a fresh LU every
    ``_REFRESH`` words. The items that path cannot trust (an ill-conditioned Laplacian at the
    start or at a refresh, or conditional probabilities that do not sum to 1) are sampled by
    :func:`_sample_by_conditioning` (the marginals recomputed for every word: O(N^4)).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"`n` must be a positive int, got {n!r}")
    with torch.no_grad():
        batch, size, _ = arc_scores.shape
        device = arc_scores.device
        real = length_mask(lengths, batch, size, device)
        scores = arc_scores.detach().masked_fill(~_arc_mask(real), _NEG_INF)
        scores = scores.repeat(n, 1, 1)  # [n * B, N, N], sample-major
        real = real.repeat(n, 1)  # [n * B, N]
        reps = None if lengths is None else lengths.repeat(n)
        ok = torch.isfinite(matrix_tree_log_partition(scores, reps, multiroot))  # [n * B]
        heads, trusted = _sample_by_updates(scores, real, ok, multiroot)
        redo = (ok & ~trusted).nonzero().squeeze(1)  # [K]
        if len(redo):
            sub_lengths = None if reps is None else reps[redo]
            again = _sample_by_conditioning(
                scores[redo], real[redo], ok[redo], sub_lengths, multiroot
            )
            heads = heads.index_copy(0, redo, again)
        heads = heads.masked_fill(~ok.unsqueeze(-1), -1)
        return heads.view(n, batch, size)


#: words between two fresh inversions of the Laplacian in :func:`_sample_by_updates`
_REFRESH = 32
#: tolerance on the sum of a column's conditional probabilities in :func:`_sample_by_updates`
_SAMPLE_TOLERANCE = 1e-6


def _laplacian_column(weights: Tensor, column: int, padding: Tensor, multiroot: bool) -> Tensor:
    """Column ``column`` [B, n] of :func:`_laplacian` from the weights of the arcs into that
    word, ``weights`` [B, N] (row 0: ROOT; zero at the self loop), and ``padding`` [B, n]."""
    out = -weights[:, 1:].clone()  # [B, n] off the diagonal: -w_{hm}
    total = weights.sum(-1) if multiroot else weights[:, 1:].sum(-1)  # [B]
    out[:, column] = total + padding[:, column]  # the self loop's weight is 0
    if not multiroot:
        out[:, 0] = weights[:, 0]  # first row := rho
    return out


def _coefficient_column(inverse: Tensor, column: int, multiroot: bool) -> Tensor:
    """Column ``column`` [B, N] of :func:`_adjoint_coefficients` from row ``column`` of the
    inverse Laplacian ``inverse`` [B, n, n] alone (O(n) instead of O(n^2))."""
    row = inverse[:, column]  # [B, n]: Y_{m, .}
    diag = row[:, column : column + 1]  # [B, 1]: Y_mm
    if multiroot:
        return torch.cat([diag, diag - row], 1)  # root arcs Y_mm, word arcs Y_mm - Y_mh
    words = (diag if column else torch.zeros_like(diag)) - row  # no Y_11 term into word 1
    words[:, 0] = diag[:, 0]  # arcs from word 1 (the replaced row): no Y_mh term
    return torch.cat([row[:, :1], words], 1)  # root arcs: Y_m1


def _sample_by_updates(
    scores: Tensor, real: Tensor, ok: Tensor, multiroot: bool
) -> tuple[Tensor, Tensor]:
    """One sample of heads per item of ``scores`` [B, N, N] (``-inf`` at non-arcs) by
    sequential conditioning with Sherman-Morrison updates of the inverse Laplacian: (heads
    [B, N] LongTensor, ``-1`` at ROOT and padding; trusted [B] bool, False where the result
    must be recomputed). All in float64; no host sync inside the loop over words."""
    batch, size, _ = scores.shape
    heads = torch.full((batch, size), -1, dtype=torch.long, device=scores.device)
    _, weights, inverse, keep, _ = _lu_path(
        scores.to(torch.float64), real, multiroot, _MAX_COND_DEFAULT, need_logz=False
    )
    weights = weights.to(torch.float64)  # [B, N, n], column m - 1: the arcs into word m
    trusted = ok if keep is None else ok & keep  # [B]
    padding = (~real[:, 1:]).to(torch.float64)  # [B, n]
    lap = _laplacian(weights, padding, multiroot)  # [B, n, n]
    for m in range(1, size):
        j = m - 1
        if m > 1 and j % _REFRESH == 0:  # a fresh inverse bounds the updates' rounding
            inverse, info = torch.linalg.inv_ex(lap)
            cond = inverse.abs().sum(1).amax(-1) * lap.abs().sum(1).amax(-1)
            trusted = trusted & (info == 0) & (cond <= _MAX_COND_DEFAULT)
        active = trusted & real[:, m]  # [B]
        prob = weights[:, :, j] * _coefficient_column(inverse, j, multiroot)  # [B, N]
        total = prob.sum(-1)
        trusted = trusted & (~active | ((total - 1).abs() <= _SAMPLE_TOLERANCE))
        logp = prob.clamp(min=0).log()
        gumbel = -torch.empty_like(logp).exponential_().log()
        choice = (logp + gumbel).argmax(-1)  # [B]
        heads[:, m] = torch.where(active, choice, -1)
        # keep only the drawn arc, at weight 1 (a column's scale does not change the
        # distribution): column j of the Laplacian changes by u, L' = L + u e_j^T
        column = torch.zeros_like(weights[:, :, j]).scatter_(1, choice.unsqueeze(1), 1.0)
        column = torch.where(active.unsqueeze(-1), column, weights[:, :, j])  # [B, N]
        new = _laplacian_column(column, j, padding, multiroot)  # [B, n]
        change = new - lap[:, :, j]  # [B, n] (zero for inactive items)
        y_change = torch.bmm(inverse, change.unsqueeze(-1)).squeeze(-1)  # [B, n] Y u
        denominator = 1 + y_change[:, j]  # [B]
        trusted = trusted & (~active | (denominator.abs() > 1e-12))
        safe = torch.where(denominator.abs() > 1e-12, denominator, 1.0)
        row = (inverse[:, j] / safe.unsqueeze(-1)).unsqueeze(1)  # [B, 1, n]: e_j^T Y / (1 + .)
        inverse = inverse.baddbmm_(y_change.unsqueeze(-1), row, alpha=-1)  # minus Y u e_j^T Y
        weights[:, :, j] = column
        lap[:, :, j] = new
    return heads, trusted


def _sample_by_conditioning(
    scores: Tensor, real: Tensor, ok: Tensor, lengths: Tensor | None, multiroot: bool
) -> Tensor:
    """One sample of heads per item [B, N] by sequential conditioning with the marginals
    recomputed for every word (O(N^4), any condition number): the path of the items that
    :func:`_sample_by_updates` cannot trust. A draw that the log-partition shows impossible
    (an arc whose marginal is rounding noise) is redrawn without it."""
    size = scores.shape[-1]
    device = scores.device
    heads = torch.full(real.shape, -1, dtype=torch.long, device=device)
    cand = torch.arange(size, device=device)
    for m in range(1, size):
        active = ok & real[:, m]  # [B]
        prob = matrix_tree_marginals(scores, lengths, multiroot)[:, :, m]  # [B, N]
        logp = prob.clamp(min=0).log()
        choice = torch.zeros_like(heads[:, 0])
        redraw = active.clone()
        for _ in range(size):
            gumbel = -torch.empty_like(logp).exponential_().log()
            choice = torch.where(redraw, (logp + gumbel).argmax(-1), choice)  # [B]
            keep = cand == choice.unsqueeze(-1)  # [B, N] the only arc left into m
            column = scores[:, :, m].masked_fill(~keep, _NEG_INF)
            fixed = torch.cat([scores[:, :, :m], column.unsqueeze(-1), scores[:, :, m + 1 :]], -1)
            logz = matrix_tree_log_partition(fixed, lengths, multiroot)
            redraw = active & torch.isneginf(logz)
            if not bool(redraw.any()):
                break
            logp = logp.masked_fill(redraw.unsqueeze(-1) & keep, _NEG_INF)
        scores = torch.where(active.view(-1, 1, 1), fixed, scores)
        heads[:, m] = torch.where(active, choice, -1)
    return heads


# the custom operators torch.compile and torch.export trace (._library)
tree_ops("matrix_tree", matrix_tree_log_partition, matrix_tree_marginals)
