r"""SparseMAP (Niculae, Martins, Blondel & Cardie 2018): sparse structured marginals by the
active-set algorithm, with the MAP pass of a distribution as its only oracle.

For the part scores :math:`\theta` of a distribution (every part tensor of its inside pass,
flattened: labels and transitions of a chain, arcs (labelled trees: labelled arcs
[B, N, N, L]), spans (labelled or not), segments and transitions, arcs and sibling pairs)

.. math:: \mathrm{SparseMAP}(\theta) = \arg\max_{\mu \in \mathcal{M}}
          \theta^\top \mu - \tfrac12 \|\mu\|^2
          = \arg\min_{\mu \in \mathcal{M}} \|\mu - \theta\|^2,

the Euclidean projection of the scores onto the marginal polytope :math:`\mathcal{M}`, the
convex hull of the part indicators :math:`m_z` of the structures z. The solution is a
convex combination :math:`\mu = \sum_z \alpha_z m_z` of few structures (at most one more
than the dimension, usually a handful), so its ``marginals`` are sparse, unlike the dense
``marginals`` of the CRF (the entropic counterpart). Where a structure has parts beyond those
of ``marginals`` (transitions, sibling pairs), the paper's variant puts the quadratic on the
``marginals`` part only (:math:`\tfrac12 \|u\|^2`); that variant is not implemented here:
its restricted QP is singular whenever the active structures are affinely dependent in that
part alone (a chain's label indicators often are), which the plain active-set step below
does not handle. For trees and constituency trees (one part tensor) the two coincide.
Labelled dependency trees project their labelled arcs (``marginals``' [B, N, N, L]); their
oracle is the MAP tree under each arc's best label score, with that label (the labels
factor given the tree).

**Active set** (Nocedal & Wright 16.3; the paper's Algorithm 1). The problem restricted to a
working set A of structures is an equality-constrained QP in the weights,
:math:`\min_\alpha \tfrac12 \alpha^\top G \alpha - b^\top \alpha` with
:math:`\sum \alpha = 1`, :math:`G = M M^\top` (the Gram matrix of the active structures'
indicators) and :math:`b = M \theta` (their scores), solved in closed form from its KKT
system :math:`[G, 1; 1^\top, 0] [\alpha; \tau] = [b; 1]`. Each iteration asks the MAP
oracle for the best structure under the objective's gradient :math:`\theta - \mu`
(the structure of largest Frank-Wolfe gap), adds it, re-solves the restricted QP and, where
a weight would turn negative, steps to the boundary and drops that structure (repeated until
the weights are feasible). It stops when the Frank-Wolfe gap
:math:`\langle \nabla, m_z - \mu \rangle` of the oracle's structure is at most
``tol * (1 + max |theta|)`` (then :math:`\mu` is optimal up to that gap), when the oracle
returns a structure already active (no progress possible in floating point; a structure
dropped earlier may come back), or after
``max_iter`` iterations (``converged`` says which items stopped by the gap). All items of
the batch run together: one batched oracle call (``argmax`` of the distribution on modified
scores) and one batched solve of the small KKT systems per iteration; items that stopped
keep their solution.

**Backward** (the paper's Proposition 1): on the support :math:`\bar A`
(:math:`\alpha_z > 0`) the solution is the affine map
:math:`\alpha = K^{-1} [M_{\bar A} \theta; 1]`, so
:math:`\partial \mu / \partial \theta = M_{\bar A}^\top (K^{-1})_{\alpha\alpha} M_{\bar A}`
(symmetric), applied to the incoming gradient in closed form: exact, piecewise constant in
the scores, no backward through the iterations. A loss on the sparse marginals trains the
scores by it; its own derivative (double backward) is not available.

Costs: per iteration one MAP pass (the structure's argmax, O(its MAP)) and O(B S P) for the
Gram row of the new structure (S active structures, P part entries); memory O(B S P) for
the active structures. The QP is solved in float64 whatever the scores' dtype; the oracle
runs in the scores' dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:  # no runtime import: base.py imports this module from a method
    from .base import StructuredDistribution

__all__ = ["SparseMAPResult", "sparsemap"]


class SparseMAPResult(NamedTuple):
    """Output of :func:`sparsemap` (and ``StructuredDistribution.sparsemap``)."""

    #: sparse marginals, the shape of the distribution's ``marginals`` (differentiable)
    marginals: Tensor
    #: sparse marginals of every part tensor (``marginals`` first), differentiable
    parts: tuple[Tensor, ...]
    #: [B, S] convex weights of the active structures (0 at unused slots; each row sums to 1
    #: for an item with a structure, 0 for an item with none)
    weights: Tensor
    #: [B, S, ...] 0/1 indicators, the shape of ``marginals`` per slot, of the structures
    #: that ``weights`` weigh (``marginals = sum_s weights[:, s] * structures[:, s]``)
    structures: Tensor
    #: BoolTensor [B]: whether the item stopped with a Frank-Wolfe gap below ``tol``
    converged: Tensor
    #: the number of active-set iterations run (the same for the batch)
    iterations: int


def _kkt_solve(gram: Tensor, rhs: Tensor, active: Tensor, total: float) -> Tensor:
    """Solve ``[G, 1; 1^T, 0] [x; tau] = [rhs; total]`` on the ``active`` slots of each item
    (x = 0 elsewhere), by a pseudo-inverse (robust to affinely dependent structures), float64.

    gram [B, S, S], rhs [B, S], active BoolTensor [B, S] -> x [B, S]."""
    batch, size = rhs.shape
    both = active.unsqueeze(-1) & active.unsqueeze(-2)  # [B, S, S]
    eye = torch.eye(size, dtype=gram.dtype, device=gram.device)
    kkt = gram.new_zeros(batch, size + 1, size + 1)
    kkt[:, :size, :size] = torch.where(both, gram, eye * (~active).unsqueeze(-1))
    ones = active.to(gram.dtype)
    kkt[:, :size, size] = ones
    kkt[:, size, :size] = ones
    full = rhs.new_zeros(batch, size + 1)
    full[:, :size] = rhs * ones
    full[:, size] = total
    solution = torch.linalg.pinv(kkt, hermitian=True) @ full.unsqueeze(-1)
    return solution.squeeze(-1)[:, :size] * ones


class _Restricted:
    """The active structures of every item and their restricted QP (float64 state)."""

    def __init__(self, first: Tensor, quadratic: Tensor, scores: Tensor) -> None:
        # first [B, P]: the MAP structures' indicators; quadratic [P]: 1 on the parts under the
        # quadratic (all of them: the Euclidean projection)
        self.quadratic = quadratic
        self.scores = scores  # [B, P] finite scores (-inf -> 0: no active structure uses it)
        self.structures = first.unsqueeze(1)  # [B, S, P]
        self.gram = ((first * quadratic) * first).sum(-1).view(-1, 1, 1)  # [B, S, S]
        self.linear = (first * scores).sum(-1, keepdim=True)  # [B, S]
        # [B, S]; 0 for an item with no structure (its oracle answer has no part)
        self.weights = (first != 0).any(-1, keepdim=True).to(first.dtype)

    @property
    def mean(self) -> Tensor:
        """mu = sum_s alpha_s m_s, [B, P]."""
        return (self.weights.unsqueeze(1) @ self.structures).squeeze(1)

    def add(self, structure: Tensor, grow: Tensor) -> None:
        """Append ``structure`` [B, P] as a new slot (weight 0), active for the items ``grow``."""
        row = (self.structures * (structure * self.quadratic).unsqueeze(1)).sum(-1)  # [B, S]
        own = ((structure * self.quadratic) * structure).sum(-1, keepdim=True)  # [B, 1]
        self.gram = torch.cat(
            [torch.cat([self.gram, row.unsqueeze(-1)], -1), torch.cat([row, own], -1).unsqueeze(1)],
            1,
        )
        self.structures = torch.cat([self.structures, structure.unsqueeze(1)], 1)
        self.linear = torch.cat([self.linear, (structure * self.scores).sum(-1, keepdim=True)], 1)
        self.weights = torch.cat([self.weights, self.weights.new_zeros(len(grow), 1)], 1)
        self.working = torch.cat([self.weights[:, :-1] > 0, grow.unsqueeze(-1)], 1)
        self.grow = grow

    def solve(self) -> None:
        """The restricted QP on the working set, by the primal active-set steps: re-solve,
        and where a weight turns negative step to the boundary and drop it (at most S
        rounds, batched)."""
        working = self.working
        weights = self.weights
        pending = self.grow  # the items that took a new structure
        for _ in range(working.shape[1] + 1):
            if not bool(pending.any()):
                break
            target = _kkt_solve(self.gram, self.linear, working, 1.0)  # [B, S]
            negative = working & (target < 0)
            feasible = ~negative.any(-1)
            done = pending & feasible
            weights = torch.where(done.unsqueeze(-1), target.clamp_min(0) * working, weights)
            # infeasible: alpha + t (target - alpha), t the largest keeping alpha >= 0
            step = pending & ~feasible
            ratio = torch.where(negative, weights / (weights - target), torch.inf)
            t, drop = ratio.min(-1)  # [B]
            moved = (weights + t.unsqueeze(-1) * (target - weights)).clamp_min(0)
            dropped = torch.nn.functional.one_hot(drop, working.shape[1]).bool()
            moved = moved.masked_fill(dropped, 0.0)
            weights = torch.where(step.unsqueeze(-1), moved, weights)
            working = torch.where(step.unsqueeze(-1), working & ~dropped, working)
            pending = step
        self.weights = weights
        self.working = working


class _SparseMAPFunction(torch.autograd.Function):
    """mu = SparseMAP(theta) with the closed-form backward on the final support."""

    @staticmethod
    def forward(
        ctx: Any, theta: Tensor, mean: Tensor, structures: Tensor, support: Tensor, gram: Tensor
    ) -> Tensor:
        ctx.save_for_backward(structures, support, gram)
        return mean.to(theta.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        structures, support, gram = ctx.saved_tensors  # [B, S, P], [B, S], [B, S, S]
        projected = (structures @ grad.to(structures.dtype).unsqueeze(-1)).squeeze(-1)  # [B, S]
        weights = _kkt_solve(gram, projected, support, 0.0)  # (K^-1)_aa M g
        grad_theta = (weights.unsqueeze(1) @ structures).squeeze(1)
        return grad_theta.to(grad.dtype), None, None, None, None


def _check(max_iter: object, tol: object) -> None:
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"`max_iter` must be a non-negative int, got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"`tol` must be a non-negative float, got {tol!r}")


def sparsemap(
    dist: StructuredDistribution, max_iter: int = 50, tol: float = 1e-6
) -> SparseMAPResult:
    """SparseMAP marginals of ``dist`` (any structured distribution with an ``argmax``): the
    active-set algorithm with ``dist``'s MAP pass as oracle (see the module docstring).

    Args:
        dist: the distribution; its potentials are the scores (they may require grad).
        max_iter: at most this many active-set iterations (each one batched MAP call); the
            solution after the last one is returned, with ``converged`` False for the items
            whose gap was still above ``tol``.
        tol: stop an item when its Frank-Wolfe gap is at most ``tol * (1 + max |theta|)``.

    Returns:
        :class:`SparseMAPResult`: ``marginals`` (the shape of ``dist.marginals``), the part
        marginals, the ``weights`` [B, S] and ``structures`` [B, S, ...] of the convex
        combination, ``converged`` [B] and the number of ``iterations``. Differentiable in
        the potentials (closed-form backward, once). An item with no valid structure gets
        zero marginals and weights.
    """
    _check(max_iter, tol)
    grad_on = dist._differentiable()
    with torch.set_grad_enabled(grad_on):
        parts = dist._sparsemap_parts()
    batch = parts[0].shape[0]
    shapes = [p.shape for p in parts]
    sizes = [p[0].numel() for p in parts]
    theta = torch.cat([p.reshape(batch, -1) for p in parts], -1)  # [B, P]
    with torch.no_grad():
        raw = theta.detach()
        scores = torch.where(torch.isfinite(raw), raw, 0.0).to(torch.float64)
        # the parts under the quadratic: all of them (the Euclidean projection)
        quadratic = torch.ones(scores.shape[1], dtype=torch.float64, device=scores.device)
        threshold = tol * (1.0 + scores.abs().amax(-1))  # [B]

        def oracle(flat: Tensor) -> Tensor:  # scores [B, P] -> MAP indicators [B, P], float64
            chunks = flat.to(raw.dtype).split(sizes, -1)
            given = tuple(c.reshape(s) for c, s in zip(chunks, shapes, strict=True))
            found = dist._sparsemap_argmax(given)
            return torch.cat([f.reshape(batch, -1) for f in found], -1).to(torch.float64)

        state = _Restricted(oracle(raw), quadratic, scores)
        converged = torch.zeros(batch, dtype=torch.bool, device=scores.device)
        stopped = state.weights[:, 0] == 0  # no structure: nothing to do
        iterations = 0
        for _ in range(max_iter):
            mean = state.mean
            gradient = scores - quadratic * mean  # [B, P]: the objective's gradient
            # the oracle on the gradient, -inf parts kept forbidden
            best = oracle(torch.where(torch.isneginf(raw), raw, gradient.to(raw.dtype)))
            gap = (gradient * (best - mean)).sum(-1)
            small = gap <= threshold
            converged = converged | (small & ~stopped)  # an item with none: gap 0
            # an active structure again: no progress possible (a dropped one may come back)
            same = (state.structures == best.unsqueeze(1)).all(-1)  # [B, S]
            repeated = (same & (state.weights > 0)).any(-1)
            stopped = stopped | small | repeated
            if bool(stopped.all()):
                break
            iterations += 1
            state.add(best, ~stopped)
            state.solve()
        support = state.weights > 0
        mean = state.mean
        structures = state.structures
        gram = state.gram
        weights = state.weights
    if grad_on:
        flat = _SparseMAPFunction.apply(theta, mean, structures, support, gram)
    else:
        flat = mean.to(raw.dtype)
    out = tuple(c.reshape(s) for c, s in zip(flat.split(sizes, -1), shapes, strict=True))
    first = structures[..., : sizes[0]].reshape(batch, -1, *shapes[0][1:])
    return SparseMAPResult(
        out[0], out, weights.to(raw.dtype), first.to(raw.dtype), converged, iterations
    )
