"""Linear-chain dynamic programs: forward algorithm in any semiring, k-best Viterbi, scoring.

Shapes: ``unary`` [B, N, C] node log-potentials, ``pairwise`` [B, N-1, C, C] with
``pairwise[b, i, a, c]`` the log-potential of (z_i = a, z_{i+1} = c), ``lengths`` [B] (or None).
Positions ``>= lengths[b]`` are ignored. Time O(N C^2), sequential over N.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..semirings import Semiring

__all__ = ["chain_inside", "chain_inside_scan", "chain_kbest", "chain_score"]


def _use_scan(n: int, c: int) -> bool:
    """The parallel scan does O(N C^3) work in O(log N) steps, the forward algorithm O(N C^2)
    in N steps. Measured on CPU (B = 32, log Z forward + backward), the scan takes 0.25-0.65x
    the time for C = 2 and N >= 20, 0.4-0.8x for C = 3, 0.56-0.8x for C = 4 and N >= 50, and
    is slower from C = 6 on."""
    return (c <= 3 and n >= 16) or (c == 4 and n >= 48)


def chain_inside(
    unary: Tensor,
    pairwise: Tensor,
    lengths: Tensor | None,
    semiring: type[Semiring],
    method: str = "auto",
) -> Tensor:
    """⊕ over label sequences of the sequence score, shape [B].

    ``method``: ``"sequential"`` (forward algorithm), ``"scan"`` (log-depth parallel scan of
    the step matrices) or ``"auto"`` (the scan for few labels and long chains).
    """
    n, c = unary.shape[1], unary.shape[2]
    if method == "auto":
        method = "scan" if _use_scan(n, c) else "sequential"
    if method == "scan":
        return chain_inside_scan(unary, pairwise, lengths, semiring)
    if method != "sequential":
        raise ValueError(f"`method` must be 'auto', 'sequential' or 'scan', got {method!r}")
    steps_u = unary.unbind(1)  # N x [B, C]
    steps_p = pairwise.unbind(1)  # (N-1) x [B, C, C]
    alpha = steps_u[0]  # [B, C]
    for i in range(1, n):
        # alpha'[b, c] = ⊕_a alpha[b, a] + pairwise[b, i-1, a, c]  (+ unary[b, i, c])
        new = semiring.sum(alpha.unsqueeze(-1) + steps_p[i - 1], dim=1) + steps_u[i]
        alpha = new if lengths is None else torch.where((lengths > i).unsqueeze(-1), new, alpha)
    return semiring.sum(alpha, dim=-1)


def chain_inside_scan(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None, semiring: type[Semiring]
) -> Tensor:
    """The same quantity as the forward algorithm, by a log-depth tree of semiring matrix
    products of the step matrices M_i[a, c] = pairwise[i-1, a, c] + unary[i, c]; padded steps
    are semiring identities. Exact in every semiring (the sampling semiring's backward draws
    the middle state of each product given its ends, i.e. exact recursive bisection)."""
    batch, n, c = unary.shape
    if n == 1:
        return semiring.sum(unary[:, 0], dim=-1)
    eye = torch.full((c, c), float("-inf"), dtype=unary.dtype, device=unary.device)
    eye.fill_diagonal_(0.0)  # the identity of (⊕, +) matrix products
    steps = pairwise + unary[:, 1:].unsqueeze(-2)  # [B, N-1, C, C]
    if lengths is not None:
        active = torch.arange(1, n, device=unary.device) < lengths.unsqueeze(-1)  # [B, N-1]
        steps = torch.where(active[..., None, None], steps, eye)
    while steps.shape[1] > 1:
        if steps.shape[1] % 2:
            steps = torch.cat([steps, eye.expand(batch, 1, c, c)], dim=1)
        left, right = steps[:, 0::2], steps[:, 1::2]  # [B, M/2, C, C]
        # (left ⊗ right)[a, c] = ⊕_b left[a, b] + right[b, c]
        steps = semiring.sum(left.unsqueeze(-1) + right.unsqueeze(-3), dim=-2)
    end = semiring.sum(unary[:, 0].unsqueeze(-1) + steps[:, 0], dim=1)  # [B, C]
    return semiring.sum(end, dim=-1)


def chain_kbest(
    unary: Tensor, pairwise: Tensor, lengths: Tensor | None, k: int
) -> tuple[Tensor, Tensor]:
    """Exact k-best Viterbi. Returns (scores [k, B], labels LongTensor [k, B, N]).

    Scores are sorted in decreasing order; when fewer than k label sequences have a finite
    score, the missing ones have score ``-inf`` and labels ``-1``. Padding labels are ``-1``.
    """
    batch, n, c = unary.shape
    device = unary.device
    # alpha[b, s, r]: score of the r-th best prefix ending in state s
    alpha = unary.new_full((batch, c, k), float("-inf"))
    alpha[:, :, 0] = unary[:, 0]
    identity = torch.arange(c * k, device=device).view(1, c, k).expand(batch, c, k)
    backpointers = []
    for i in range(1, n):
        # cand[b, s', s, r] = alpha[b, s', r] + pairwise[b, i-1, s', s]
        cand = alpha.unsqueeze(2) + pairwise[:, i - 1].unsqueeze(-1)  # [B, C, C, k]
        cand = cand.permute(0, 2, 1, 3).reshape(batch, c, c * k)  # [B, C(s), C(s')*k]
        best, index = cand.topk(k, dim=-1)  # [B, C, k]; index = s' * k + r
        new = best + unary[:, i].unsqueeze(-1)
        if lengths is not None:
            active = (lengths > i).view(batch, 1, 1)
            new = torch.where(active, new, alpha)
            index = torch.where(active, index, identity)  # padding: stay in place
        alpha = new
        backpointers.append(index)
    scores, last = alpha.reshape(batch, c * k).topk(k, dim=-1)  # [B, k]
    labels = unary.new_empty((batch, k, n), dtype=torch.long)
    pointer = last  # [B, k], flat index s * k + r
    for i in range(n - 1, -1, -1):
        labels[:, :, i] = pointer // k
        if i > 0:
            pointer = backpointers[i - 1].reshape(batch, c * k).gather(1, pointer)
    if lengths is not None:
        pad = torch.arange(n, device=device) >= lengths.unsqueeze(-1)  # [B, N]
        labels = labels.masked_fill(pad.unsqueeze(1), -1)
    labels = labels.masked_fill(torch.isneginf(scores).unsqueeze(-1), -1)
    return scores.transpose(0, 1), labels.transpose(0, 1)


def chain_score(unary: Tensor, pairwise: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Score of given label sequences, shape [B]. ``labels`` [B, N] with valid labels where
    ``mask`` [B, N] is True (other entries are ignored)."""
    safe = labels.masked_fill(~mask, 0)
    node = unary.gather(2, safe.unsqueeze(-1)).squeeze(-1)  # [B, N]
    node = node.masked_fill(~mask, 0.0).sum(-1)
    if unary.shape[1] == 1:
        return node
    c = unary.shape[2]
    flat = (safe[:, :-1] * c + safe[:, 1:]).unsqueeze(-1)  # [B, N-1, 1]
    edge = pairwise.flatten(2).gather(2, flat).squeeze(-1)  # [B, N-1]
    edge_mask = mask[:, 1:]
    edge = edge.masked_fill(~edge_mask, 0.0).sum(-1)
    return node + edge
