"""Semi-Markov chains: the forward pass over labelled segmentations.

Shapes: ``segment_scores`` [B, N, K, C] with ``segment_scores[b, i, k, c]`` the score of a
segment of positions i..i+k (length k + 1 <= K) labelled c; ``transitions`` [B, C, C] with
``transitions[b, a, c]`` the score of a segment labelled c right after one labelled a.
A segmentation of n = lengths[b] positions tiles 0..n-1 with labelled segments of length
at most K (none runs past n); its score is the sum of its segments' scores and of the
transitions between consecutive segments.

The forward recursion (time O(B N (K C + C^2)) in N sequential steps, memory O(B N K C)):

    beta(0, c)  = 0                                  (a segment may start at 0)
    alpha(t, c) = ⊕_{k < K, k <= t} beta(t - k, c) + s(t - k, k, c)   (last segment ends at t)
    beta(t, c)  = ⊕_a alpha(t - 1, a) + T(a, c)      (a segment labelled c starts at t)
    ⊕ over segmentations = ⊕_c alpha(n - 1, c)

is written once against a semiring (:mod:`structattn.semirings`). Each step reads a window
[B, K, C] of the last K betas, rebuilt by one ``cat``, and the scores of the segments that
end at t, [B, K, C], taken from one end-indexed gather of ``segment_scores``.

log Z, the marginals and the Hessian-vector product (:func:`semi_markov_log_partition`,
:func:`semi_markov_marginals`) are written by hand: the log-semiring forward pass keeps its
local probabilities (each log-sum-exp's softmax, :class:`_Probs`), and every derivative is
then a linear sweep over them (:func:`_adjoint_sweep` positions down for reverse mode,
:func:`_tangent_sweep` positions up for forward mode), with out-of-place operations only,
so that the same code runs under ``torch.func``'s wrappers. On CPU, for plain float32 and
float64 tensors, the forward pass, the marginals' sweep and the Hessian-vector product run
in the C++ kernels (``_semi_markov.cpp``: the same recurrences one item at a time in double
precision, the local probabilities in the same layout) where they are built
(``STRUCTATTN_EXTENSION=0`` turns them off); the PyTorch code is the path for other
devices, for ``torch.func`` wrappers and without the kernels.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import last_index, refuse_differentiated_backward
from ..semirings import LogSemiring, Semiring
from ._extension import kernels as compiled_kernels
from ._library import semi_markov_ops, tracing
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
    "segment_mask",
    "segments_by_end",
    "semi_markov_inside",
    "semi_markov_log_partition",
    "semi_markov_marginals",
]


@tensor_cache(maxsize=64)
def _end_index(size: int, width: int, device: torch.device) -> Tensor:
    """Flat [N * K] positions, in ``segment_scores`` [N, K] padded with K - 1 leading rows,
    of the segment that ends at t with length k + 1 (start t - k + K - 1 in the padded rows)."""
    with torch.inference_mode(False):
        t = torch.arange(size, device=device).unsqueeze(-1)  # [N, 1]
        k = torch.arange(width, device=device)  # [K]
        return ((t - k + width - 1) * width + k).flatten()


def segments_by_end(segment_scores: Tensor, fill: float = float("-inf")) -> Tensor:
    """[B, N, K, C]: ``out[:, t, k] = segment_scores[:, t - k, k]`` (the segment of length
    k + 1 ending at t), ``fill`` where it would start before 0. One gather."""
    batch, size, width, labels = segment_scores.shape
    pad = segment_scores.new_full((batch, width - 1, width, labels), fill)
    padded = torch.cat([pad, segment_scores], 1)  # [B, K - 1 + N, K, C]
    flat = padded.reshape(batch, (width - 1 + size) * width, labels)
    index = _end_index(size, width, segment_scores.device)
    return flat.index_select(1, index).view(batch, size, width, labels)


def segment_mask(
    lengths: Tensor | None, batch: int, size: int, width: int, device: torch.device
) -> Tensor:
    """BoolTensor [B, N, K]: True at the segments i..i+k that end inside the item
    (i + k < lengths[b])."""
    end = torch.arange(size, device=device).unsqueeze(-1) + torch.arange(width, device=device)
    if lengths is None:
        return (end < size).expand(batch, size, width)
    return end < lengths.view(-1, 1, 1)


@full_precision
def semi_markov_inside(
    segment_scores: Tensor,
    transitions: Tensor,
    lengths: Tensor | None,
    semiring: type[Semiring],
) -> Tensor:
    """⊕ over the labelled segmentations of each item of their scores, [B].

    ``segment_scores`` [B, N, K, C] (segments past the length are never read into the
    result, but must not be NaN: callers sanitise the padding), ``transitions`` [B, C, C].
    ``-inf`` forbids a segment or a transition; an item with no allowed segmentation gives
    ``-inf``.
    """
    batch, size, width, labels = segment_scores.shape
    last = last_index(lengths, batch, size, segment_scores.device)  # [B]
    ends = segments_by_end(segment_scores)  # [B, N, K, C]
    # window[b, k, c] = beta(t - k, c): beta(0) = 0, none before position 0
    window = torch.cat(
        [
            segment_scores.new_zeros(batch, 1, labels),
            segment_scores.new_full((batch, width - 1, labels), float("-inf")),
        ],
        1,
    )
    alphas = []
    for t in range(size):
        # alpha(t, c) = ⊕_k beta(t - k, c) + s(t - k, k, c)   [B, C]
        alpha = semiring.sum(window + ends[:, t], dim=1)
        alphas.append(alpha)
        if t + 1 < size:
            # beta(t + 1, c) = ⊕_a alpha(t, a) + T(a, c)   [B, C]
            beta = semiring.sum(alpha.unsqueeze(-1) + transitions, dim=1)
            window = torch.cat([beta.unsqueeze(1), window[:, :-1]], 1)
    if not alphas:
        return segment_scores.new_full((batch,), float("-inf"))
    final = torch.stack(alphas, 1)  # [B, N, C]
    index = last.view(-1, 1, 1).expand(batch, 1, labels)
    return semiring.sum(final.gather(1, index).squeeze(1), dim=-1)


def _by_start(by_end: Tensor) -> Tensor:
    """The inverse of :func:`segments_by_end`: [B, N, K, C] indexed by end -> by start
    (``out[:, i, k] = by_end[:, i + k, k]``, 0 where i + k >= N). One gather."""
    batch, size, width, labels = by_end.shape
    pad = by_end.new_zeros(batch, width - 1, width, labels)
    padded = torch.cat([by_end, pad], 1).reshape(batch, (size + width - 1) * width, labels)
    return padded.index_select(1, _start_index(size, width, by_end.device)).view_as(by_end)


@tensor_cache(maxsize=64)
def _start_index(size: int, width: int, device: torch.device) -> Tensor:
    """Flat [N * K] positions, in a by-end tensor [N + K - 1, K], of the segment that starts
    at i with length k + 1 (end i + k)."""
    with torch.inference_mode(False):
        i = torch.arange(size, device=device).unsqueeze(-1)
        k = torch.arange(width, device=device)
        return ((i + k) * width + k).flatten()


def _finite(x: Tensor) -> Tensor:
    return x.masked_fill(torch.isneginf(x), 0.0)


class _Probs(NamedTuple):
    """The forward pass's local probabilities (log semiring, no autograd), with which every
    backward pass below is a linear sweep. "Window order": index j of the K segments that
    end at t is the one of length K - j (start t - K + 1 + j), so that the window of
    betas of a step is the K consecutive positions t - K + 1 .. t, oldest first."""

    logz: Tensor  # [B]
    last: Tensor  # [B]: n - 1
    #: [B, C]: softmax of alpha(n - 1), the derivative of log Z (0 for no segmentation)
    root: Tensor
    #: [B, N, K, C] (window order): exp(beta(t - k, c) + s(t - k, k, c) - alpha(t, c))
    seg: Tensor
    #: [B, N - 1, C, C]: exp(alpha(t, a) + T(a, c) - beta(t + 1, c))
    trans: Tensor
    dtype: torch.dtype  # of the scores (the results'); the passes run in :func:`_work_dtype`
    #: computed by the C++ kernels (float64, 0 past each item's length), whose marginals
    #: and Hessian-vector product (:func:`_outside`, :func:`_hvp`) then run there too
    kernel: bool = False


def _kernel_ops(*tensors: Tensor) -> Any:
    """``torch.ops.structattn_semi_markov`` where the C++ kernels apply to ``tensors`` (CPU,
    float32 or float64, no ``torch.func`` wrapper, built), else None (the PyTorch code)."""
    if any(is_transformed(x) for x in tensors) or compiled_kernels(tensors[0]) is None:
        return None
    try:  # registered by _semi_markov.cpp when the kernels load (absent from an older build)
        torch.ops.structattn_semi_markov.forward  # noqa: B018
    except (AttributeError, RuntimeError):
        return None
    return torch.ops.structattn_semi_markov


def _work_dtype(x: Tensor) -> torch.dtype:
    """float64 on CPU (as the C++ CKY kernels: the passes are N sequential steps of small
    ops whose time is their latency, and log-space values that grow with N lose float32
    digits in exp(beta + s - alpha)); the scores' dtype elsewhere (GPUs' float64 is slow)."""
    return torch.float64 if x.device.type == "cpu" else x.dtype


def _windows(rows: Tensor, width: int, fill: float) -> Tensor:
    """[B, N, K, C] (window order) of per-position values [B, N, C]: ``out[:, t, j] =
    rows[:, t - K + 1 + j]``, ``fill`` before position 0."""
    batch, _, labels = rows.shape
    padded = torch.cat([rows.new_full((batch, width - 1, labels), fill), rows], 1)
    return padded.unfold(1, width, 1).transpose(-1, -2)


def _forward_pass(segment_scores: Tensor, transitions: Tensor, last: Tensor) -> _Probs:
    """The log-semiring forward pass and its local probabilities (:class:`_Probs`), with
    out-of-place operations only (it runs on ``torch.func``'s wrapped tensors too), in
    :func:`_work_dtype`; in the C++ kernels where they apply (:func:`_kernel_ops`)."""
    dtype = segment_scores.dtype
    ops = _kernel_ops(segment_scores, transitions)
    if ops is not None and segment_scores.shape[0] > 0 and segment_scores.shape[1] > 0:
        logz, root, seg, trans = ops.forward(segment_scores.detach(), transitions.detach(), last)
        return _Probs(logz, last, root, seg, trans, dtype, kernel=True)
    segment_scores = segment_scores.to(_work_dtype(segment_scores))
    transitions = transitions.to(segment_scores.dtype)
    batch, size, width, labels = segment_scores.shape
    ends = segments_by_end(segment_scores).flip(2)  # [B, N, K, C], window order
    # window[b, j, c] = beta(t - K + 1 + j, c): beta(0) = 0, none before position 0
    window = torch.cat(
        [
            segment_scores.new_full((batch, width - 1, labels), float("-inf")),
            segment_scores.new_zeros(batch, 1, labels),
        ],
        1,
    )
    alphas, betas = [], [segment_scores.new_zeros(batch, labels)]
    for t in range(size):
        # alpha(t, c) = logsumexp_k beta(t - k, c) + s(t - k, k, c)   [B, C]
        alpha = torch.logsumexp(window + ends[:, t], 1)
        alphas.append(alpha)
        if t + 1 < size:
            # beta(t + 1, c) = logsumexp_a alpha(t, a) + T(a, c)   [B, C]
            beta = torch.logsumexp(alpha.unsqueeze(-1) + transitions, 1)
            betas.append(beta)
            window = torch.cat([window[:, 1:], beta.unsqueeze(1)], 1)
    alpha_all = torch.stack(alphas, 1)  # [B, N, C]
    beta_all = torch.stack(betas, 1)  # [B, N, C]
    final = alpha_all.gather(1, last.view(-1, 1, 1).expand(batch, 1, labels)).squeeze(1)
    logz = torch.logsumexp(final, -1)
    root = (final - _finite(logz).unsqueeze(-1)).exp() * torch.isfinite(logz).unsqueeze(-1)
    seg = _windows(beta_all, width, float("-inf")) + ends
    seg = (seg - _finite(alpha_all).unsqueeze(2)).exp()
    trans = alpha_all[:, :-1].unsqueeze(-1) + transitions.unsqueeze(1)
    trans = (trans - _finite(beta_all[:, 1:]).unsqueeze(2)).exp()
    return _Probs(logz, last, root, seg, trans, dtype)


def _at_last(probs: _Probs, values: Tensor) -> Tensor:
    """[B, N, C]: ``values`` [B, C] at each item's last position, 0 elsewhere."""
    batch, size = probs.seg.shape[:2]
    at = torch.arange(size, device=values.device) == probs.last.unsqueeze(-1)  # [B, N]
    return at.unsqueeze(-1) * values.unsqueeze(1)


def _adjoint_sweep(probs: _Probs, src_alpha: Tensor, src_beta: Tensor) -> tuple[Tensor, Tensor]:
    """Positions down, the linear recursion of reverse mode through the forward pass:

        A(t, a) = src_alpha(t, a) + Σ_c P_trans(t, a, c) B(t + 1, c)
        B(u, c) = src_beta(u, c) + Σ_k P_seg(u + k, k, c) A(u + k, c)

    (A, B) [B, N, C] each. Seeded with the derivative of log Z at the last position, A and B
    are the derivatives of log Z with respect to alpha and beta (the marginals' pass)."""
    batch, size, width, labels = probs.seg.shape
    by_start = _by_start(probs.seg.flip(2))  # [B, N, K, C]: P_seg(u + k, k, c)
    window = src_alpha.new_zeros(batch, width, labels)  # A(u + k), k = 0 .. K - 1
    a_rows: list[Tensor] = []
    b_rows: list[Tensor] = []
    b_next: Tensor | None = None
    for t in range(size - 1, -1, -1):
        if b_next is None:
            a = src_alpha[:, t]
        else:  # [B, A, C] @ [B, C, 1]
            a = torch.baddbmm(src_alpha[:, t, :, None], probs.trans[:, t], b_next[..., None])
            a = a.squeeze(-1)
        a_rows.append(a)
        window = torch.cat([a.unsqueeze(1), window[:, :-1]], 1)
        b_next = src_beta[:, t] + (by_start[:, t] * window).sum(1)
        b_rows.append(b_next)
    return torch.stack(a_rows[::-1], 1), torch.stack(b_rows[::-1], 1)


def _tangent_sweep(probs: _Probs, src_alpha: Tensor, src_beta: Tensor) -> tuple[Tensor, Tensor]:
    """Positions up, the linear recursion of forward mode through the forward pass:

        dalpha(t, c) = src_alpha(t, c) + Σ_k P_seg(t, k, c) dbeta(t - k, c)
        dbeta(t, c) = src_beta(t, c) + Σ_a dalpha(t - 1, a) P_trans(t - 1, a, c)

    ((dalpha, dbeta) [B, N, C] each; dbeta(0) = src_beta(0))."""
    batch, size, width, labels = probs.seg.shape
    window = src_alpha.new_zeros(batch, width, labels)  # dbeta(t - K + 1 + j), window order
    a_rows: list[Tensor] = []
    b_rows: list[Tensor] = []
    for t in range(size):
        if t == 0:
            b = src_beta[:, 0]
        else:  # [B, 1, A] @ [B, A, C]
            b = torch.baddbmm(src_beta[:, t, None], a_rows[-1][:, None], probs.trans[:, t - 1])
            b = b.squeeze(1)
        b_rows.append(b)
        window = torch.cat([window[:, 1:], b.unsqueeze(1)], 1)
        a_rows.append(src_alpha[:, t] + (probs.seg[:, t] * window).sum(1))
    return torch.stack(a_rows, 1), torch.stack(b_rows, 1)


class _Outside(NamedTuple):
    """The first-order backward pass: the derivatives of log Z with respect to alpha and
    beta [B, N, C], and the marginals."""

    g_alpha: Tensor
    g_beta: Tensor
    segments: Tensor  # [B, N, K, C] by start
    transitions: Tensor  # [B, C, C]


def _outside(probs: _Probs) -> _Outside:
    """The marginals by hand (the derivative of log Z): one :func:`_adjoint_sweep` seeded
    with softmax(alpha(n - 1)), then p(segment) = P_seg(t, k, c) A(t, c) and
    p(a -> c at t) = P_trans(t, a, c) B(t + 1, c). In the C++ kernels after their forward
    pass."""
    if probs.kernel:
        ops = torch.ops.structattn_semi_markov
        g_alpha, g_beta, segs, pairs = ops.marginals(
            probs.seg, probs.trans, probs.root, probs.last, probs.dtype
        )
        return _Outside(g_alpha, g_beta, segs, pairs)
    zeros = torch.zeros_like(probs.root).unsqueeze(1).expand(-1, probs.seg.shape[1], -1)
    g_alpha, g_beta = _adjoint_sweep(probs, _at_last(probs, probs.root), zeros)
    segments = _by_start((probs.seg * g_alpha.unsqueeze(2)).flip(2))
    pairs = (probs.trans * g_beta[:, 1:].unsqueeze(2)).sum(1)
    return _Outside(g_alpha, g_beta, segments.to(probs.dtype), pairs.to(probs.dtype))


def _hvp(probs: _Probs, out: _Outside, d_seg: Tensor, d_trans: Tensor) -> tuple[Tensor, Tensor]:
    """The Hessian of log Z times the direction (``d_seg`` [B, N, K, C], ``d_trans``
    [B, C, C]), i.e. the derivative of the marginals along it, by hand: the tangents of the
    forward pass (:func:`_tangent_sweep`), then reverse mode through the tangent of log Z.
    At each log-sum-exp node y = logsumexp_i x_i with probabilities p_i, the adjoint of x_i
    receives p_i (ybar + g_y (dx_i - dy)), g_y the first-order derivative of log Z with
    respect to y (:func:`_outside`); the ybar part is one more :func:`_adjoint_sweep`,
    the rest a source term computed for all positions at once. Time O(B N (K C + C^2)) in
    2N sequential steps; out-of-place operations only (the direction may be a
    ``torch.func`` wrapper). In the C++ kernels after their forward pass, for a plain
    direction."""
    if probs.kernel and _kernel_ops(d_seg, d_trans) is not None:
        ops = torch.ops.structattn_semi_markov
        h_seg, h_trans = ops.hvp(
            probs.seg,
            probs.trans,
            probs.root,
            probs.last,
            out.g_alpha,
            out.g_beta,
            d_seg.detach(),
            d_trans.detach(),
            probs.dtype,
        )
        return h_seg, h_trans
    d_seg, d_trans = d_seg.to(probs.seg.dtype), d_trans.to(probs.seg.dtype)
    d_ends = segments_by_end(d_seg, 0.0).flip(2)  # [B, N, K, C], window order
    src_alpha = (probs.seg * d_ends).sum(2)  # [B, N, C]
    src_beta = (probs.trans * d_trans.unsqueeze(1)).sum(2)  # [B, N - 1, C]: positions 1..
    src_beta = torch.cat([torch.zeros_like(src_alpha[:, :1]), src_beta], 1)
    d_alpha, d_beta = _tangent_sweep(probs, src_alpha, src_beta)
    d_logz = (_at_last(probs, probs.root) * d_alpha).sum((1, 2))  # [B]
    # the log-sum-exp nodes' second-order terms g_y p_i (dx_i - dy)
    d_x = _windows(d_beta, d_ends.shape[2], 0.0) + d_ends - d_alpha.unsqueeze(2)
    x_seg = probs.seg * out.g_alpha.unsqueeze(2) * d_x  # [B, N, K, C], window order
    d_x = d_alpha[:, :-1].unsqueeze(-1) + d_trans.unsqueeze(1) - d_beta[:, 1:].unsqueeze(2)
    x_trans = probs.trans * out.g_beta[:, 1:].unsqueeze(2) * d_x  # [B, N - 1, C, C]
    # the root log Z = logsumexp_c alpha(n - 1, c): ybar = 0, g_y = 1
    root = _at_last(probs, probs.root) * (d_alpha - d_logz.view(-1, 1, 1))
    src_alpha = root + torch.cat([x_trans.sum(-1), torch.zeros_like(root[:, :1])], 1)
    src_beta = _by_start(x_seg.flip(2)).sum(2)  # Σ_k of what position u's segments receive
    a_bar, b_bar = _adjoint_sweep(probs, src_alpha, src_beta)
    hvp_seg = _by_start((probs.seg * a_bar.unsqueeze(2) + x_seg).flip(2))
    hvp_trans = (probs.trans * b_bar[:, 1:].unsqueeze(2)).sum(1) + x_trans.sum(1)
    return hvp_seg.to(probs.dtype), hvp_trans.to(probs.dtype)


class _SemiMarkovLogPartition(torch.autograd.Function):
    """log Z [B] over labelled segmentations (forward: the forward pass, no autograd graph;
    backward: the marginals by hand, :func:`_outside`, times the incoming gradient). When
    the backward is itself differentiated (``create_graph``, ``torch.func``), the marginals
    come from :class:`_SemiMarkovMarginals`, whose backward is the Hessian-vector product
    by hand. ``vmap`` folds the vmapped dimension into the batch (one call); ``jvp`` is the
    inner product of the marginals with the tangent."""

    @staticmethod
    def forward(
        segment_scores: Tensor, transitions: Tensor, lengths: Tensor | None, stash: Stash
    ) -> Tensor:
        batch, size = segment_scores.shape[:2]
        last = last_index(lengths, batch, size, segment_scores.device)
        probs = _forward_pass(segment_scores, transitions, last)
        stash.value = probs
        return probs.logz.to(probs.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        segment_scores, transitions, lengths, stash = inputs
        # an empty stash: the forward ran through the vmap rule (vmap outside grad); the
        # backward then recomputes the forward pass (in _SemiMarkovMarginals)
        ctx.probs = stash.value
        ctx.lengths = lengths
        ctx.save_for_backward(segment_scores, transitions)
        ctx.save_for_forward(segment_scores, transitions)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        return vmap_by_folding(
            lambda s, t, n: _SemiMarkovLogPartition.apply(s, t, n, Stash()),
            info,
            in_dims[:3],
            args[:3],
            (True, True, True),
        )

    @staticmethod
    def jvp(ctx: Any, t_seg: Tensor | None, t_trans: Tensor | None, *_: Any) -> Tensor:
        # d log Z = <segment marginals, dot s> + <transition marginals, dot T>, the marginals
        # by the Function on the scores: enclosing levels differentiate it (_ops.outer_jvp)
        def body(
            segment_scores: Tensor,
            transitions: Tensor,
            lengths: Tensor | None,
            t_seg: Tensor | None,
            t_trans: Tensor | None,
        ) -> Tensor:
            seed = segment_scores.new_ones(segment_scores.shape[0])
            probs = None if differentiated(segment_scores, transitions) else ctx.probs
            segs, pairs = _SemiMarkovMarginals.apply(
                segment_scores, transitions, seed, lengths, probs, Stash()
            )
            return batch_dot((segs, t_seg), (pairs, t_trans))

        segment_scores, transitions = ctx.saved_tensors
        return outer_jvp(body, segment_scores, transitions, ctx.lengths, t_seg, t_trans)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        segment_scores, transitions = ctx.saved_tensors
        if torch.is_grad_enabled() or ctx.probs is None or is_transformed(grad):
            # differentiated again: one node with its own (hand-written) backward
            segs, pairs = _SemiMarkovMarginals.apply(
                segment_scores, transitions, grad, ctx.lengths, ctx.probs, Stash()
            )
            return segs, pairs, None, None
        out = _outside(ctx.probs)
        scale = grad.view(-1, 1, 1)
        return out.segments * scale.unsqueeze(-1), out.transitions * scale, None, None


def _seeded_jvp_by_func(
    segment_scores: Tensor,
    transitions: Tensor,
    seed: Tensor,
    lengths: Tensor | None,
    t_seg: Tensor | None,
    t_trans: Tensor | None,
    t_seed: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The jvp of :class:`_SemiMarkovMarginals` (``seed[b]`` times the marginals) by
    ``torch.func`` through :func:`semi_markov_inside`: differentiable operations of the
    scores, for a jvp that an enclosing transform differentiates again (any order)."""

    def seeded(s: Tensor, t: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        segs, pairs = torch.func.grad(
            lambda a, b: semi_markov_inside(a, b, lengths, LogSemiring).sum(), argnums=(0, 1)
        )(s, t)
        scale = g.view(-1, 1, 1)
        return segs * scale.unsqueeze(-1), pairs * scale

    tangents = tuple(
        torch.zeros_like(x) if d is None else d
        for x, d in ((segment_scores, t_seg), (transitions, t_trans), (seed, t_seed))
    )
    out: tuple[Tensor, Tensor] = torch.func.jvp(
        seeded, (segment_scores, transitions, seed), tangents
    )[1]
    return out


class _SemiMarkovMarginals(torch.autograd.Function):
    """``seed[b]`` times the (segment [B, N, K, C], transition [B, C, C]) marginals (forward:
    the forward pass, unless given, and :func:`_outside`); backward: ``seed[b]`` times the
    Hessian-vector product of log Z by hand (:func:`_hvp`), which is also its ``jvp``.
    Differentiating the backward once more falls back to autograd through
    :func:`semi_markov_inside` (any order; not under ``torch.func``, where derivatives go
    up to the second order)."""

    @staticmethod
    def forward(
        segment_scores: Tensor,
        transitions: Tensor,
        seed: Tensor,
        lengths: Tensor | None,
        probs: _Probs | None,
        stash: Stash,
    ) -> tuple[Tensor, Tensor]:
        if probs is None:  # not computed by the caller (a vmap rule): the forward pass here
            batch, size = segment_scores.shape[:2]
            last = last_index(lengths, batch, size, segment_scores.device)
            probs = _forward_pass(segment_scores, transitions, last)
        out = _outside(probs)
        stash.value = probs, out
        scale = seed.view(-1, 1, 1)
        return out.segments * scale.unsqueeze(-1), out.transitions * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        segment_scores, transitions, seed, lengths, _, stash = inputs
        ctx.state = stash.value  # None: the forward ran through the vmap rule
        ctx.lengths = lengths
        ctx.save_for_backward(segment_scores, transitions, seed)
        ctx.save_for_forward(segment_scores, transitions, seed)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        segment_scores, transitions, seed, lengths, probs, _ = args
        if in_dims[0] is None and in_dims[1] is None and in_dims[3] is None:
            # only the seed is vmapped (jacrev of log Z): the marginals once, scaled
            unit = segment_scores.new_ones(segment_scores.shape[0])
            segs, pairs = _SemiMarkovMarginals.apply(
                segment_scores, transitions, unit, lengths, probs, Stash()
            )
            scale = seed.movedim(in_dims[2], 0)[..., None, None]  # [V, B, 1, 1]
            return (segs * scale.unsqueeze(-1), pairs * scale), (0, 0)
        return vmap_by_folding(
            lambda s, t, g, n: _SemiMarkovMarginals.apply(s, t, g, n, None, Stash()),
            info,
            in_dims[:4],
            args[:4],
            (True, True, True, True),
        )

    @staticmethod
    def _state(ctx: Any, segment_scores: Tensor, transitions: Tensor) -> tuple[_Probs, _Outside]:
        if ctx.state is None:  # after the vmap rule: recompute (out-of-place, on wrappers)
            batch, size = segment_scores.shape[:2]
            last = last_index(ctx.lengths, batch, size, segment_scores.device)
            probs = _forward_pass(segment_scores.detach(), transitions.detach(), last)
            ctx.state = probs, _outside(probs)
        state: tuple[_Probs, _Outside] = ctx.state
        return state

    @staticmethod
    def jvp(
        ctx: Any, t_seg: Tensor | None, t_trans: Tensor | None, t_seed: Tensor | None, *_: Any
    ) -> tuple[Tensor, Tensor]:
        # d(seed mu) = seed H (dot s, dot T) + mu dot seed (H: the Hessian of log Z);
        # differentiated again by an enclosing level (_ops.outer_jvp): by torch.func through
        # the inside pass, from the scores
        def body(
            segment_scores: Tensor,
            transitions: Tensor,
            seed: Tensor,
            lengths: Tensor | None,
            t_seg: Tensor | None,
            t_trans: Tensor | None,
            t_seed: Tensor | None,
        ) -> tuple[Tensor, Tensor]:
            if differentiated(segment_scores, transitions, seed):
                return _seeded_jvp_by_func(
                    segment_scores, transitions, seed, lengths, t_seg, t_trans, t_seed
                )
            probs, out = _SemiMarkovMarginals._state(ctx, segment_scores, transitions)
            scale = seed.view(-1, 1, 1)
            d_seg = torch.zeros_like(out.segments)
            d_trans = torch.zeros_like(out.transitions)
            if t_seg is not None or t_trans is not None:
                d_seg, d_trans = _hvp(
                    probs,
                    out,
                    d_seg if t_seg is None else t_seg,
                    d_trans if t_trans is None else t_trans,
                )
                d_seg, d_trans = d_seg * scale.unsqueeze(-1), d_trans * scale
            if t_seed is not None:
                t_scale = t_seed.view(-1, 1, 1)
                d_seg = d_seg + out.segments * t_scale.unsqueeze(-1)
                d_trans = d_trans + out.transitions * t_scale
            return d_seg, d_trans

        segment_scores, transitions, seed = ctx.saved_tensors
        return outer_jvp(
            body, segment_scores, transitions, seed, ctx.lengths, t_seg, t_trans, t_seed
        )

    @staticmethod
    def backward(ctx: Any, g_seg: Tensor, g_trans: Tensor) -> tuple[Tensor | None, ...]:
        segment_scores, transitions, seed = ctx.saved_tensors
        nones = (None, None, None)
        wanted = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if wanted and torch.is_grad_enabled() and not is_transformed(g_seg):
            return (*_third_order(ctx, segment_scores, transitions, seed, g_seg, g_trans), *nones)
        refuse_differentiated_backward("SemiMarkovCRF marginals", segment_scores, transitions)
        probs, out = _SemiMarkovMarginals._state(ctx, segment_scores, transitions)
        g_seed = None
        if ctx.needs_input_grad[2]:
            g_seed = batch_dot((out.segments, g_seg), (out.transitions, g_trans))
        if not wanted:
            return None, None, g_seed, *nones
        h_seg, h_trans = _hvp(probs, out, g_seg, g_trans)
        scale = seed.view(-1, 1, 1)
        return h_seg * scale.unsqueeze(-1), h_trans * scale, g_seed, *nones


def _third_order(
    ctx: Any,
    segment_scores: Tensor,
    transitions: Tensor,
    seed: Tensor,
    g_seg: Tensor,
    g_trans: Tensor,
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """The backward of :class:`_SemiMarkovMarginals` when it is itself differentiated:
    autograd through :func:`semi_markov_inside` (any order)."""
    parts = (segment_scores, transitions)
    targets = [t for t in parts if t.requires_grad]
    logz = semi_markov_inside(segment_scores, transitions, ctx.lengths, LogSemiring)
    units = iter(torch.autograd.grad(logz.sum(), targets, create_graph=True))
    unit = [next(units) if t.requires_grad else None for t in parts]
    scale = seed.view(-1, 1, 1)
    grads = (g_seg * scale.unsqueeze(-1), g_trans * scale)
    pairs = [(u, g) for u, g in zip(unit, grads, strict=True) if u is not None]
    hvps = iter(
        torch.autograd.grad(
            [u for u, _ in pairs], targets, [g for _, g in pairs], create_graph=True
        )
    )
    h_seg, h_trans = (next(hvps) if t.requires_grad else None for t in parts)
    g_seed = sum(
        (
            (u * g).flatten(1).sum(-1)
            for u, g in zip(unit, (g_seg, g_trans), strict=True)
            if u is not None
        ),
        torch.zeros_like(seed),
    )
    return h_seg, h_trans, g_seed


@full_precision
def semi_markov_log_partition(
    segment_scores: Tensor, transitions: Tensor, lengths: Tensor | None
) -> Tensor:
    """log Z over labelled segmentations, [B], like ``semi_markov_inside(..., LogSemiring)``
    but with the marginals written by hand as its backward and a hand-written
    Hessian-vector product as the backward of that (:class:`_SemiMarkovMarginals`).
    ``transitions`` [B, C, C]; ``segment_scores`` as for :func:`semi_markov_inside`.
    Works under ``torch.func`` transforms (vmap folds into the batch; jvp by hand)."""
    refuse_jit_trace("A semi-Markov CRF")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        return torch.ops.structattn.semi_markov_log_partition(segment_scores, transitions, lengths)
    return _SemiMarkovLogPartition.apply(segment_scores, transitions, lengths, Stash())


@full_precision
def semi_markov_marginals(
    segment_scores: Tensor, transitions: Tensor, lengths: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(segment marginals [B, N, K, C], transition marginals [B, C, C]: the expected number
    of consecutive segments labelled (a, c)) in one autograd node: forward the forward pass
    and the marginals by hand, backward the hand-written Hessian-vector product (what
    structured attention trains through). Time O(B N (K C + C^2)) per pass in N sequential
    steps, memory O(B N (K C + C^2)). An item with no segmentation has zero marginals.
    Arguments as :func:`semi_markov_log_partition`."""
    refuse_jit_trace("A semi-Markov CRF")
    if tracing():  # torch.compile, torch.export: one custom operator (._library)
        ops = torch.ops.structattn
        segs, pairs = ops.semi_markov_marginals(segment_scores, transitions, lengths)
        return segs, pairs
    probs = None
    if not (is_transformed(segment_scores) or is_transformed(transitions)):
        batch, size = segment_scores.shape[:2]
        last = last_index(lengths, batch, size, segment_scores.device)
        with torch.no_grad():  # else inside the Function (its vmap rule folds)
            probs = _forward_pass(segment_scores.detach(), transitions.detach(), last)
    seed = segment_scores.new_ones(segment_scores.shape[0])
    segs, pairs = _SemiMarkovMarginals.apply(
        segment_scores, transitions, seed, lengths, probs, Stash()
    )
    return segs, pairs


# the custom operators torch.compile and torch.export trace (._library)
semi_markov_ops(semi_markov_log_partition, semi_markov_marginals)
