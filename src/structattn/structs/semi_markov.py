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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import last_index
from ..semirings import LogSemiring, Semiring
from ._ops import is_transformed, tensor_cache

__all__ = [
    "segment_mask",
    "segments_by_end",
    "semi_markov_inside",
    "semi_markov_log_partition",
]


@tensor_cache(maxsize=64)
def _end_index(size: int, width: int, device: torch.device) -> Tensor:
    """Flat [N * K] positions, in ``segment_scores`` [N, K] padded with K - 1 leading rows,
    of the segment that ends at t with length k + 1 (start t - k + K - 1 in the padded rows)."""
    with torch.inference_mode(False):
        t = torch.arange(size, device=device).unsqueeze(-1)  # [N, 1]
        k = torch.arange(width, device=device)  # [K]
        return ((t - k + width - 1) * width + k).flatten()


def segments_by_end(segment_scores: Tensor) -> Tensor:
    """[B, N, K, C]: ``out[:, t, k] = segment_scores[:, t - k, k]`` (the segment of length
    k + 1 ending at t), ``-inf`` where it would start before 0. One gather."""
    batch, size, width, labels = segment_scores.shape
    pad = segment_scores.new_full((batch, width - 1, width, labels), float("-inf"))
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
    t = torch.arange(size, device=by_end.device).unsqueeze(-1)  # start
    k = torch.arange(width, device=by_end.device)
    index = ((t + k) * width + k).flatten()
    return padded.index_select(1, index).view(batch, size, width, labels)


def _forward_pass(
    segment_scores: Tensor, transitions: Tensor, last: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The log-semiring forward pass without autograd: (log Z [B], alpha [B, N, C],
    beta [B, N, C], the segments by end [B, N, K, C])."""
    batch, size, width, labels = segment_scores.shape
    ends = segments_by_end(segment_scores)
    alphas = segment_scores.new_empty(batch, size, labels)
    betas = segment_scores.new_full((batch, size + width - 1, labels), float("-inf"))
    betas[:, width - 1] = 0.0  # beta(0) = 0; rows 0 .. K - 2: before position 0
    for t in range(size):
        # window[b, k, c] = beta(t - k, c), rows t + K - 1 down to t
        window = betas[:, t : t + width].flip(1)
        alpha = torch.logsumexp(window + ends[:, t], 1)  # [B, C]
        alphas[:, t] = alpha
        if t + 1 < size:
            betas[:, t + width] = torch.logsumexp(alpha.unsqueeze(-1) + transitions, 1)
    final = alphas.gather(1, last.view(-1, 1, 1).expand(batch, 1, labels)).squeeze(1)
    return torch.logsumexp(final, -1), alphas, betas, ends


def _backward_pass(
    segment_scores: Tensor,
    transitions: Tensor,
    last: Tensor,
    saved: tuple[Tensor, Tensor, Tensor, Tensor],
) -> tuple[Tensor, Tensor]:
    """The marginals by hand, widths down in the probability domain: (segment marginals
    [B, N, K, C], expected transition counts [B, C, C]). With g the derivative of log Z,

        g_alpha(t, a) = [t = n - 1] softmax(alpha(n - 1))_a
                        + Σ_c g_beta(t + 1, c) exp(alpha(t, a) + T(a, c) - beta(t + 1, c)),
        p(t - k, k, c) = g_alpha(t, c) exp(beta(t - k, c) + s(t - k, k, c) - alpha(t, c)),
        g_beta(t - k, c) += p(t - k, k, c)."""
    logz, alphas, betas, ends = saved
    batch, size, width, labels = segment_scores.shape

    def finite(x: Tensor) -> Tensor:
        return x.masked_fill(torch.isneginf(x), 0.0)

    safe_alpha = finite(alphas)
    g_beta = segment_scores.new_zeros(batch, size + width - 1, labels)
    by_end = torch.empty_like(ends)
    pairs = segment_scores.new_zeros(batch, labels, labels)
    # the derivative of log Z = logsumexp(alpha(n - 1)): a softmax at each item's last position
    index = last.view(-1, 1, 1).expand(batch, 1, labels)
    top = (alphas.gather(1, index) - finite(logz).view(-1, 1, 1)).exp()
    top = top * torch.isfinite(logz).view(-1, 1, 1)
    seed = torch.zeros_like(alphas).scatter_(1, index, top)  # [B, N, C]
    for t in range(size - 1, -1, -1):
        g_alpha = seed[:, t]
        if t + 1 < size:
            nxt = g_beta[:, t + width]  # [B, C]: complete (every later alpha has passed)
            split = (
                alphas[:, t].unsqueeze(-1) + transitions - finite(betas[:, t + width]).unsqueeze(1)
            )
            split = split.exp_().mul_(nxt.unsqueeze(1))  # [B, A, C]
            pairs += split
            g_alpha = g_alpha + split.sum(-1)
        window = betas[:, t : t + width].flip(1)
        seg = (window + ends[:, t] - safe_alpha[:, t].unsqueeze(1)).exp_()
        seg.mul_(g_alpha.unsqueeze(1))  # [B, K, C]
        by_end[:, t] = seg
        g_beta[:, t : t + width] += seg.flip(1)
    return _by_start(by_end), pairs


class _SemiMarkovLogPartition(torch.autograd.Function):
    """log Z over labelled segmentations (forward: the forward pass, no autograd graph;
    backward: the marginals by hand, :func:`_backward_pass`). Differentiated again (a loss
    on the marginals), the backward falls back to autograd through
    :func:`semi_markov_inside` (any order)."""

    @staticmethod
    def forward(
        segment_scores: Tensor, transitions: Tensor, lengths: Tensor | None, stash: list[Any]
    ) -> Tensor:
        batch, size = segment_scores.shape[:2]
        last = last_index(lengths, batch, size, segment_scores.device)
        saved = _forward_pass(segment_scores.detach(), transitions.detach(), last)
        stash.append(saved)
        return saved[0].clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        segment_scores, transitions, lengths, stash = inputs
        ctx.saved = stash[-1]
        ctx.lengths = lengths
        ctx.save_for_backward(segment_scores, transitions)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        segment_scores, transitions = ctx.saved_tensors
        if torch.is_grad_enabled():  # differentiated again: autograd through the inside pass
            parts = (segment_scores, transitions)
            targets = [t for t in parts if t.requires_grad]  # a constant has no gradient
            if not targets:
                return None, None, None, None
            logz = semi_markov_inside(segment_scores, transitions, ctx.lengths, LogSemiring)
            grads = iter(torch.autograd.grad(logz, targets, grad, create_graph=True))
            g_seg, g_trans = (next(grads) if t.requires_grad else None for t in parts)
            return g_seg, g_trans, None, None
        batch, size = segment_scores.shape[:2]
        last = last_index(ctx.lengths, batch, size, segment_scores.device)
        segs, pairs = _backward_pass(segment_scores, transitions, last, ctx.saved)
        scale = grad.view(-1, 1, 1)
        segs = segs * scale.unsqueeze(-1)
        pairs = pairs * scale
        return segs, pairs, None, None


@full_precision
def semi_markov_log_partition(
    segment_scores: Tensor, transitions: Tensor, lengths: Tensor | None
) -> Tensor:
    """log Z over labelled segmentations, [B], like ``semi_markov_inside(..., LogSemiring)``
    but with the marginals written by hand as its backward (first order; the backward of
    that is autograd through :func:`semi_markov_inside`). ``transitions`` [B, C, C]. Under
    ``torch.func`` transforms it is ``semi_markov_inside`` itself, differentiated by them."""
    if is_transformed(segment_scores) or is_transformed(transitions):
        return semi_markov_inside(segment_scores, transitions, lengths, LogSemiring)
    return _SemiMarkovLogPartition.apply(segment_scores, transitions, lengths, [])
