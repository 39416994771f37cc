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

from typing import Any

import torch
from torch import Tensor

from .._precision import full_precision
from .._validation import check_potentials
from ._library import tracing
from ._ops import Stash, differentiated, is_transformed, outer_jvp

__all__ = ["mean_field_free_energy", "mean_field_marginals", "mean_field_updates"]


def _check(unary: Tensor, pairwise: Tensor, mask: Tensor | None, values: bool = True) -> Tensor:
    """Validate inputs (``values``: also no NaN or infinity, one host synchronisation);
    return the BoolTensor mask [B, N] (all True when ``mask`` is None)."""
    if values:
        check_potentials("unary", unary, rank=2, allow_neg_inf=False)
        check_potentials("pairwise", pairwise, rank=3, allow_neg_inf=False)
    elif unary.dim() != 2 or pairwise.dim() != 3:
        raise ValueError(
            "`unary` and `pairwise` must have 2 and 3 dimensions, got shapes "
            f"{tuple(unary.shape)} and {tuple(pairwise.shape)}"
        )
    batch, n = unary.shape
    if n == 0:
        raise ValueError(
            f"`unary` must have at least one position (N >= 1), got shape {tuple(unary.shape)}"
        )
    if pairwise.dtype != unary.dtype:
        raise ValueError(
            f"`pairwise` must have the dtype of `unary` ({unary.dtype}), got {pairwise.dtype}"
        )
    if pairwise.shape != (batch, n, n):
        raise ValueError(
            f"`pairwise` must have shape ({batch}, {n}, {n}), got {tuple(pairwise.shape)}"
        )
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=unary.device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (batch, n):
        raise ValueError(f"`mask` must be a BoolTensor of shape ({batch}, {n})")
    return mask.to(unary.device)


def _iterates(unary: Tensor, coupling: Tensor, iterations: int) -> list[Tensor]:
    """The k + 1 iterates [*, N] of ``s <- sigmoid(phi + J s)`` from ``sigmoid(phi)`` for
    unary [*, N] and coupling [*, N, N] (no masking; the operations are recorded)."""
    # J s is a broadcast product and a sum: as a recorded bmm of [N, N] x [N, 1], its
    # backward would take dJ as a bmm of [N, 1] x [1, N], several times slower on the CPU
    spins = torch.sigmoid(unary)  # [*, N]
    trajectory = [spins]
    for _ in range(iterations):
        spins = torch.sigmoid(unary + (coupling * spins.unsqueeze(-2)).sum(-1))  # phi + J s
        trajectory.append(spins)
    return trajectory


class _MeanFieldUpdates(torch.autograd.Function):
    """The last of :func:`_iterates` as one autograd node with a hand-written backward: the
    forward runs the k updates unrecorded and keeps the iterates, the backward runs them in
    reverse (``c_t = g_t s_t (1 - s_t)``, ``dphi = sum_t c_t``, ``dJ = sum_t c_t s_{t-1}^T``,
    ``g_{t-1} = J^T c_t``). Matrix-vector products are batched ``bmm`` of [N, N] x [N, 1]
    here (the fastest form without autograd); outer products are broadcast products (as a
    bmm of [N, 1] x [1, N] they cost several times more, which is why the recorded
    :func:`_iterates` uses broadcast products and sums). Differentiated again
    (``create_graph``), the backward is autograd through :func:`_iterates` (any order)."""

    @staticmethod
    def forward(unary: Tensor, coupling: Tensor, iterations: int, stash: Stash) -> Tensor:
        n = unary.shape[-1]
        phi = unary.reshape(-1, n, 1)  # [B', N, 1]
        matrix = coupling.reshape(-1, n, n)  # [B', N, N]
        spins = torch.sigmoid(phi)
        trajectory = [spins]
        for _ in range(iterations):
            spins = torch.sigmoid(torch.baddbmm(phi, matrix, spins))  # phi + J s
            trajectory.append(spins)
        stash.value = trajectory  # k + 1 iterates [B', N, 1]
        return spins.view(unary.shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        unary, coupling, iterations, stash = inputs
        ctx.iterations = iterations
        ctx.save_for_backward(unary, coupling, *stash.value)
        ctx.save_for_forward(unary, coupling, *stash.value)

    @staticmethod
    def jvp(ctx: Any, t_unary: Tensor | None, t_coupling: Tensor | None, *_: Any) -> Tensor:
        # dot s_t = s_t (1 - s_t) (dot phi + dot J s_{t-1} + J dot s_{t-1}), s_0 = sigmoid(phi);
        # differentiated again by an enclosing level (_ops.outer_jvp): by torch.func through
        # the recorded updates, from the inputs
        return outer_jvp(
            lambda *args: _MeanFieldUpdates._tangent(ctx.iterations, *args),
            t_unary,
            t_coupling,
            *ctx.saved_tensors,
        )

    @staticmethod
    def _tangent(
        iterations: int,
        t_unary: Tensor | None,
        t_coupling: Tensor | None,
        unary: Tensor,
        coupling: Tensor,
        *trajectory: Tensor,
    ) -> Tensor:
        if differentiated(unary, coupling):
            tangents = (
                torch.zeros_like(unary) if t_unary is None else t_unary,
                torch.zeros_like(coupling) if t_coupling is None else t_coupling,
            )
            out: Tensor = torch.func.jvp(
                lambda u, c: _iterates(u, c, iterations)[-1], (unary, coupling), tangents
            )[1]
            return out
        n = unary.shape[-1]
        matrix = coupling.reshape(-1, n, n)  # [B', N, N]
        d_phi = torch.zeros_like(trajectory[0]) if t_unary is None else t_unary.reshape(-1, n, 1)
        d_matrix = None if t_coupling is None else t_coupling.reshape(-1, n, n)
        spins = trajectory[0]
        tangent = spins * (1 - spins) * d_phi  # [B', N, 1]
        for t in range(1, iterations + 1):
            d_chi = d_phi + torch.bmm(matrix, tangent)
            if d_matrix is not None:
                d_chi = d_chi + torch.bmm(d_matrix, trajectory[t - 1])
            spins = trajectory[t]
            tangent = spins * (1 - spins) * d_chi
        return tangent.view(unary.shape)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Tensor, int]:
        # any leading dimensions are batch dimensions: the vmapped one goes in front
        unary, coupling, iterations, _ = args
        size = info.batch_size
        unary, coupling = (
            x.movedim(d, 0) if d is not None else x.expand(size, *x.shape)
            for x, d in ((unary, in_dims[0]), (coupling, in_dims[1]))
        )
        return _MeanFieldUpdates.apply(unary, coupling, iterations, Stash()), 0

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        unary, coupling, *trajectory = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():
            if not is_transformed(unary):  # differentiated again: autograd through the updates
                inputs = [x for x, w in zip((unary, coupling), wanted, strict=True) if w]
                with torch.enable_grad():
                    spins = _iterates(unary, coupling, ctx.iterations)[-1]
                grads = iter(torch.autograd.grad(spins, inputs, grad, create_graph=True))
                return (
                    next(grads) if wanted[0] else None,
                    next(grads) if wanted[1] else None,
                    None,
                    None,
                )
            # under torch.func (which always asks for a differentiable backward, and whose
            # transforms autograd.grad cannot see): the reverse sweep below on recorded
            # iterates, out of place, is differentiable again
            n = unary.shape[-1]
            trajectory = [s.reshape(-1, n, 1) for s in _iterates(unary, coupling, ctx.iterations)]
        n = unary.shape[-1]
        grad = grad.reshape(-1, n, 1)  # [B', N, 1] dL/ds_k
        transposed = coupling.reshape(-1, n, n).transpose(1, 2).contiguous()  # [B', N, N] J^T
        grad_unary: Tensor | None = None
        grad_coupling: Tensor | None = None
        for t in range(ctx.iterations, 0, -1):
            chi = torch.ops.aten.sigmoid_backward(grad, trajectory[t])  # [B', N, 1] dL/dchi_t
            grad_unary = chi if grad_unary is None else grad_unary + chi
            if wanted[1]:  # sum_t c_t s_{t-1}^T
                outer = chi * trajectory[t - 1].transpose(1, 2)  # [B', N, 1] x [B', 1, N]
                grad_coupling = outer if grad_coupling is None else grad_coupling + outer
            grad = torch.bmm(transposed, chi)  # [B', N, 1]  J^T c = dL/ds_{t-1}
        first = torch.ops.aten.sigmoid_backward(grad, trajectory[0])  # through sigmoid(phi)
        grad_unary = first if grad_unary is None else grad_unary + first
        return (
            grad_unary.view(unary.shape) if wanted[0] else None,
            None if grad_coupling is None else grad_coupling.view(coupling.shape),
            None,
            None,
        )


@full_precision
def mean_field_updates(unary: Tensor, coupling: Tensor, iterations: int) -> Tensor:
    """Spins [*, N] after ``iterations`` updates ``s <- sigmoid(phi + J s)`` from
    ``sigmoid(phi)`` with unary [*, N] and coupling [*, N, N] (same leading dimensions), no
    checks and no masking (zero the coupling's columns at padding): the kernel of
    :func:`mean_field_marginals` and of the mean-field attention layers. From k = 2 on, one
    autograd node with a hand-written backward (faster than the recorded ops: timed in
    benchmarks/README.md, "Mean-field attention vs softmax attention in a training step");
    k <= 1 is recorded op by op, cheaper than the node's fixed cost."""
    if iterations <= 1 or tracing():  # torch.compile, torch.export: the recorded ops
        return _iterates(unary, coupling, iterations)[-1]
    return _MeanFieldUpdates.apply(unary, coupling, iterations, Stash())


@full_precision
def mean_field_marginals(
    unary: Tensor,
    pairwise: Tensor,
    iterations: int,
    mask: Tensor | None = None,
    return_trajectory: bool = False,
    validate_args: bool = True,
) -> Tensor:
    """Expected spins q_i = p(s_i = 1) after ``iterations`` parallel mean-field updates.

    Args:
        unary: [B, N] unary potentials phi.
        pairwise: [B, N, N] interactions J (J_ij couples s_i and s_j; used as ``chi = phi + J s``).
        iterations: number k >= 0 of updates (k = 0 gives sigmoid(phi)).
        mask: BoolTensor [B, N], True at real positions; masked positions have spin 0 and
            exert no influence on the others.
        return_trajectory: also return every iterate.
        validate_args: check that the potentials have no NaN or infinity (one host
            synchronisation); False skips that check (shapes are still checked).

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
    mask = _check(unary, pairwise, mask, validate_args)
    keep = mask.to(unary.dtype)  # [B, N]
    coupling = pairwise * (keep.unsqueeze(-1) * keep.unsqueeze(-2))  # [B, N, N], masked rows/cols 0
    # masked columns of J are 0, so the spins of masked positions never reach the real ones:
    # they are zeroed once per returned iterate, not inside the loop
    if not return_trajectory:
        return mean_field_updates(unary, coupling, iterations) * keep  # [B, N]
    return torch.stack(_iterates(unary, coupling, iterations)) * keep  # [k + 1, B, N]


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
