r"""Mean-field inference in a fully connected binary CRF (Liu et al., mean-field CRF attention).

Model over spins s in {0, 1}^N with unary potentials phi [B, N] and interactions J [B, N, N]:

.. math:: \log \tilde p(s) = \sum_i \phi_i s_i + \tfrac12 \sum_{i,j} \bar J_{ij} s_i s_j,
          \qquad \bar J = (J + J^\top) / 2

Algorithm 1 of the paper runs parallel updates from chi^(0) = phi:
``s = sigmoid(chi); chi <- phi + J s``; after ``k`` updates the output is ``sigmoid(chi^(k))``.
For symmetric J these are the stationary equations of the variational (Gibbs) free energy

.. math:: F(q) = -\phi^\top q - \tfrac12 q^\top \bar J q - H(q), \quad
          H(q) = -\sum_i q_i \log q_i + (1 - q_i) \log (1 - q_i)

of a factorised q(s) = prod_i Bernoulli(q_i). When diag(J) = 0, ``F(q) = KL(q || p) - log Z``,
so ``F >= -log Z``. Parallel updates are not guaranteed to decrease F at every step (only
coordinate-wise updates are); inspect it with :func:`mean_field_free_energy` on the
trajectory returned by ``mean_field_marginals(..., return_trajectory=True)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import check_potentials

__all__ = ["mean_field_free_energy", "mean_field_marginals"]


def _check(unary: Tensor, pairwise: Tensor, mask: Tensor | None) -> Tensor:
    """Validate inputs; return the BoolTensor mask [B, N] (all True when ``mask`` is None)."""
    check_potentials("unary", unary, rank=2, allow_neg_inf=False)
    check_potentials("pairwise", pairwise, rank=3, allow_neg_inf=False)
    batch, n = unary.shape
    if pairwise.shape != (batch, n, n):
        raise ValueError(
            f"`pairwise` must have shape ({batch}, {n}, {n}), got {tuple(pairwise.shape)}"
        )
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=unary.device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (batch, n):
        raise ValueError(f"`mask` must be a BoolTensor of shape ({batch}, {n})")
    return mask.to(unary.device)


def mean_field_marginals(
    unary: Tensor,
    pairwise: Tensor,
    iterations: int,
    mask: Tensor | None = None,
    return_trajectory: bool = False,
) -> Tensor:
    """Expected spins q_i = p(s_i = 1) after ``iterations`` parallel mean-field updates.

    Args:
        unary: [B, N] unary potentials phi.
        pairwise: [B, N, N] interactions J (J_ij couples s_i and s_j; used as ``chi = phi + J s``).
        iterations: number k >= 0 of updates (k = 0 gives sigmoid(phi)).
        mask: BoolTensor [B, N], True at real positions; masked positions have spin 0 and
            exert no influence on the others.
        return_trajectory: also return every iterate.

    Returns:
        spins [B, N], or with ``return_trajectory`` the iterates [k + 1, B, N]
        (index t = sigmoid(chi^(t)); the last one is the output).

    Example:
        >>> q = mean_field_marginals(torch.zeros(1, 3), torch.zeros(1, 3, 3), iterations=2)
        >>> q
        tensor([[0.5000, 0.5000, 0.5000]])
    """
    if not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"`iterations` must be an int >= 0, got {iterations!r}")
    mask = _check(unary, pairwise, mask)
    keep = mask.to(unary.dtype)  # [B, N]
    coupling = pairwise * (keep.unsqueeze(-1) * keep.unsqueeze(-2))  # [B, N, N], masked rows/cols 0
    # masked columns of J are 0, so the spins of masked positions never reach the real ones:
    # they are zeroed once per returned iterate, not inside the loop. J s is a broadcast
    # product and a sum (a batched bmm of [N, N] x [N, 1] loops over the batch on the CPU)
    spins = torch.sigmoid(unary)  # [B, N]
    trajectory = [spins]
    for _ in range(iterations):
        chi = unary + (coupling * spins.unsqueeze(-2)).sum(-1)  # [B, N] phi + J s
        spins = torch.sigmoid(chi)
        if return_trajectory:
            trajectory.append(spins)
    if return_trajectory:
        return torch.stack(trajectory) * keep  # [k + 1, B, N]
    return spins * keep


def mean_field_free_energy(
    unary: Tensor, pairwise: Tensor, spins: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Variational free energy F(q) of factorised Bernoulli(q) (see module docstring), [B].

    ``spins`` [B, N] are the q_i; masked positions are excluded.
    """
    mask = _check(unary, pairwise, mask)
    if spins.shape != unary.shape:
        raise ValueError(f"`spins` must have shape {tuple(unary.shape)}")
    keep = mask.to(unary.dtype)
    q = spins * keep
    sym = 0.5 * (pairwise + pairwise.transpose(1, 2))
    sym = sym * (keep.unsqueeze(-1) * keep.unsqueeze(-2))
    energy = (unary * q).sum(-1) + 0.5 * torch.einsum("bi,bij,bj->b", q, sym, q)
    p = spins.clamp(0.0, 1.0)
    entropy = -(torch.special.xlogy(p, p) + torch.special.xlogy(1 - p, 1 - p))
    entropy = (entropy * keep).sum(-1)
    return -energy - entropy
