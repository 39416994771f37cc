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
scores) on the items still running and one batched solve of the small KKT systems per
iteration (by LU; a pseudo-inverse only for an item whose LU fails, i.e. affinely dependent
structures); items that stopped keep their solution, and slots of dropped structures are
cut every few iterations. ``init=`` an earlier result warm-starts the working set with its
structures and weights (those that use no part now forbidden; the rest of the weight on
the MAP structure), so scores that moved little (a training step) take few iterations: the
same solution, found from a better start.

**Backward** (the paper's Proposition 1): on the support :math:`\bar A`
(:math:`\alpha_z > 0`) the solution is the affine map
:math:`\alpha = K^{-1} [M_{\bar A} \theta; 1]`, so
:math:`\partial \mu / \partial \theta = M_{\bar A}^\top (K^{-1})_{\alpha\alpha} M_{\bar A}`
(symmetric), applied to the incoming gradient in closed form: exact, piecewise constant in
the scores, no backward through the iterations. A loss on the sparse marginals trains the
scores by it. The same product is the forward-mode rule (``jvp``: ``torch.func.jvp``,
``jacfwd``, ``torch.autograd.forward_ad``), and it is made of matrix products with the
saved :math:`(K^{-1})_{\alpha\alpha}`, so it is differentiable again: the second derivative
(double backward, ``gradgradcheck``) is J in the incoming gradient and 0 in the scores,
exact wherever the support does not change (the map is piecewise linear; at a change of
support it has no derivative). ``torch.func.vmap`` over the scores is refused (the
iterations stop per item on values read on the host).

Costs: per iteration one MAP pass over the running items (the structure's argmax, O(its
MAP)), O(B S P) for the Gram row of the new structure (S active structures, P part
entries) and O(B S^3) for the KKT solves; memory O(B S P) for the active structures. At
least one iteration per structure of the final support (the support grows by one per
iteration), so items with a large support (small scores, long sentences) take many. The
QP is solved in float64 whatever the scores' dtype; the oracle runs in the scores' dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from .._validation import outer_jvp

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
    #: [B, S, P] float64 0/1 indicators of every part tensor of the weighed structures,
    #: flattened (``structures`` holds the first part only): ``init=`` of a later call
    part_structures: Tensor | None = None


class _Bordered:
    """The KKT systems ``[G, 1; 1^T, 0] [x; tau] = [b; 1]`` of one batch of restricted QPs,
    solved for any working set (``solve``) without rebuilding the bordered matrix."""

    def __init__(self, gram: Tensor, linear: Tensor) -> None:
        batch, size = linear.shape
        ones = linear.new_ones(batch, size, 1)
        top = torch.cat([gram, ones], -1)
        bottom = torch.cat([ones.transpose(1, 2), linear.new_zeros(batch, 1, 1)], -1)
        self.matrix = torch.cat([top, bottom], 1)  # [B, S + 1, S + 1]
        self.rhs = torch.cat([linear, linear.new_ones(batch, 1)], -1)  # [B, S + 1]
        self.eye = torch.eye(size + 1, dtype=gram.dtype, device=gram.device)
        self.scale = 1.0 + gram.abs().amax((-1, -2)) + linear.abs().amax(-1)  # [B]

    def solve(self, working: Tensor) -> Tensor:
        """x [B, S] on the ``working`` slots (0 elsewhere): by LU, and by a pseudo-inverse
        for the items whose LU fails or leaves a residual (affinely dependent structures)."""
        keep = torch.nn.functional.pad(working, (0, 1), value=True)  # [B, S + 1]
        kkt = torch.where(keep.unsqueeze(-1) & keep.unsqueeze(-2), self.matrix, self.eye)
        rhs = (self.rhs * keep).unsqueeze(-1)
        solution, info = torch.linalg.solve_ex(kkt, rhs)
        residual = (kkt @ solution - rhs).abs().amax((-1, -2))
        size = solution.abs().amax((-1, -2))
        bad = (info != 0) | ~(residual <= 1e-9 * self.scale * (1.0 + size))  # NaN fails too
        if bool(bad.any()):  # singular (affinely dependent structures): least-norm solution
            index = bad.nonzero().squeeze(-1)
            pinv = torch.linalg.pinv(kkt.index_select(0, index), hermitian=True)
            solution = solution.index_copy(0, index, pinv @ rhs.index_select(0, index))
        return solution[:, :-1, 0] * working


class _Restricted:
    """The working structures of every item and their restricted QP (float64 state): slot s
    of item b holds the indicators ``structures[b, s]`` [P], its Gram row and score, its
    weight (0 for a slot not in use) and whether it is in the working set."""

    def __init__(self, first: Tensor, scores: Tensor) -> None:
        # first [B, P]: the MAP structures' indicators; scores [B, P]: finite scores (-inf ->
        # 0: no structure uses them)
        self.scores = scores
        self.structures = first.unsqueeze(1)  # [B, S, P]
        self.gram = (first * first).sum(-1).view(-1, 1, 1)  # [B, S, S]
        self.linear = (first * scores).sum(-1, keepdim=True)  # [B, S]
        # [B, S]; 0 for an item with no structure (its oracle answer has no part)
        self.weights = (first != 0).any(-1, keepdim=True).to(first.dtype)
        self.working = self.weights > 0
        self.grow = self.working[:, 0]

    @property
    def mean(self) -> Tensor:
        """mu = sum_s alpha_s m_s, [B, P]."""
        return (self.weights.unsqueeze(1) @ self.structures).squeeze(1)

    def add(self, new: Tensor, grow: Tensor) -> Tensor:
        """Append the structures ``new`` [B, K, P] as K new slots (weight 0), in the working
        set where ``grow`` [B, K] and not a copy of a slot in use or of an earlier new one.
        Returns BoolTensor [B]: the first new structure is a copy of a working one (where
        ``grow``)."""
        cross = self.structures @ new.transpose(1, 2)  # [B, S, K]: <m_s, m_k>
        own = new @ new.transpose(1, 2)  # [B, K, K]
        size_old = self.gram.diagonal(dim1=1, dim2=2)  # [B, S] = |m_s|
        size_new = own.diagonal(dim1=1, dim2=2)  # [B, K]
        # 0/1 vectors a, b are equal iff |a| = |b| = <a, b>
        copy_old = (cross == size_old.unsqueeze(-1)) & (cross == size_new.unsqueeze(1))
        copy_old = (copy_old & self.working.unsqueeze(-1)).any(1)  # [B, K]
        repeated = copy_old[:, 0] & grow[:, 0]  # the first one is a working structure
        grow = grow & ~copy_old
        if new.shape[1] > 1:  # a copy of an earlier new one
            same_new = (own == size_new.unsqueeze(-1)) & (own == size_new.unsqueeze(1))
            grow = grow & ~same_new.tril(-1).any(-1)
        self.gram = torch.cat(
            [torch.cat([self.gram, cross], -1), torch.cat([cross.transpose(1, 2), own], -1)], 1
        )
        self.structures = torch.cat([self.structures, new], 1)
        self.linear = torch.cat([self.linear, (new @ self.scores.unsqueeze(-1)).squeeze(-1)], 1)
        self.weights = torch.cat([self.weights, self.weights.new_zeros(grow.shape)], 1)
        self.working = torch.cat([self.weights[:, : -grow.shape[1]] > 0, grow], 1)
        self.grow = grow.any(-1)
        return repeated

    def solve(self) -> None:
        """The restricted QP on the working set, by the primal active-set steps: re-solve,
        and where a weight turns negative step to the boundary and drop it (at most S
        rounds, batched; the bordered KKT matrix built once, masked per round)."""
        working = self.working
        weights = self.weights
        pending = self.grow  # the items that took a new structure
        system = _Bordered(self.gram, self.linear)
        for _ in range(working.shape[1] + 1):
            target = system.solve(working)  # [B, S]
            negative = working & (target < 0)
            feasible = ~negative.any(-1)
            done = pending & feasible
            weights = torch.where(done.unsqueeze(-1), target.clamp_min(0) * working, weights)
            # infeasible: alpha + t (target - alpha), t the largest keeping alpha >= 0
            step = pending & ~feasible
            if not bool(step.any()):
                break
            ratio = torch.where(negative, weights / (weights - target), torch.inf)
            t, drop = ratio.min(-1)  # [B]
            moved = (weights + t.unsqueeze(-1) * (target - weights)).clamp_min(0)
            dropped = torch.nn.functional.one_hot(drop, working.shape[1]).bool()
            moved = moved.masked_fill(dropped, 0.0)
            weights = torch.where(step.unsqueeze(-1), moved, weights)
            working = torch.where(step.unsqueeze(-1), working & ~dropped, working)
            pending = step
        self.weights = weights
        self.working = working & (weights > 0)

    def compact(self) -> None:
        """Move each item's slots in use (weight > 0) to the front and cut the slots no item
        uses (the state stays O(B S P) with S the largest support, not the iterations)."""
        keep = self.weights > 0  # [B, S]
        size = max(int(keep.sum(-1).max()), 1)
        if size == keep.shape[1] and bool(keep[:, :size].all()):
            return
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :size]
        self.structures = self.structures.gather(
            1, order.unsqueeze(-1).expand(-1, -1, self.structures.shape[-1])
        )
        rows = self.gram.gather(1, order.unsqueeze(-1).expand(-1, -1, self.gram.shape[-1]))
        self.gram = rows.gather(2, order.unsqueeze(1).expand(-1, size, -1))
        self.linear = self.linear.gather(1, order)
        self.weights = self.weights.gather(1, order)
        self.working = self.weights > 0


def _support_inverse(gram: Tensor, support: Tensor) -> Tensor:
    """(K^-1)_aa [B, S, S]: the weights block of the inverse of the KKT matrix of the final
    support (:class:`_Bordered`; 0 off the support), by LU with the pseudo-inverse for the
    items whose LU fails (affinely dependent structures)."""
    size = gram.shape[-1]
    system = _Bordered(gram, gram.new_zeros(gram.shape[:2]))
    keep = torch.nn.functional.pad(support, (0, 1), value=True)
    kkt = torch.where(keep.unsqueeze(-1) & keep.unsqueeze(-2), system.matrix, system.eye)
    inverse, info = torch.linalg.inv_ex(kkt)
    eye = torch.eye(size + 1, dtype=kkt.dtype, device=kkt.device)
    residual = (kkt @ inverse - eye).abs().amax((-1, -2))
    bad = (info != 0) | ~(residual <= 1e-9 * (1.0 + kkt.abs().amax((-1, -2))))
    if bool(bad.any()):
        index = bad.nonzero().squeeze(-1)
        fixed = torch.linalg.pinv(kkt.index_select(0, index), hermitian=True)
        inverse = inverse.index_copy(0, index, fixed)
    both = (support.unsqueeze(-1) & support.unsqueeze(-2)).to(kkt.dtype)
    return inverse[:, :size, :size] * both


def _apply_jacobian(structures: Tensor, block: Tensor, vector: Tensor) -> Tensor:
    """J v for the Jacobian J = M^T (K^-1)_aa M of SparseMAP on its final support (the
    paper's Proposition 1; ``block`` = (K^-1)_aa [B, S, S], ``structures`` M [B, S, P]),
    v [B, P] -> [B, P]; J is symmetric, so this is the vjp and the jvp alike. Matrix products
    only: differentiable in ``vector`` and batched under ``vmap`` (J is a constant: the map
    is piecewise linear in the scores, its second derivative 0 wherever the support is
    stable)."""
    flat = vector.to(structures.dtype).unsqueeze(-1)  # [B, P, 1]
    weights = block @ (structures @ flat)  # [B, S, 1]: (K^-1)_aa M v
    return (structures.transpose(1, 2) @ weights).squeeze(-1).to(vector.dtype)


class _SparseMAPFunction(torch.autograd.Function):
    """mu = SparseMAP(theta), computed by the caller (``mean``); backward and jvp: the
    closed-form Jacobian on the final support (:func:`_apply_jacobian`), differentiable
    again (double backward: J applied to the incoming gradient, 0 in the scores)."""

    generate_vmap_rule = True  # matrix products only: jacrev and jacfwd batch them

    @staticmethod
    def forward(theta: Tensor, mean: Tensor, structures: Tensor, block: Tensor) -> Tensor:
        return mean.to(theta.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, _, structures, block = inputs
        ctx.save_for_backward(structures, block)
        ctx.save_for_forward(structures, block)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        structures, block = ctx.saved_tensors  # [B, S, P], [B, S, S]
        return _apply_jacobian(structures, block, grad), None, None, None

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor | None, *_: Any) -> Tensor | None:
        structures, block = ctx.saved_tensors
        if tangent is None:
            return None
        return outer_jvp(_apply_jacobian, structures, block, tangent)


def _check(max_iter: object, tol: object) -> None:
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"`max_iter` must be a non-negative int, got {max_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"`tol` must be a non-negative float, got {tol!r}")


def _outside_transforms() -> contextlib.AbstractContextManager[object]:
    """A context that runs plain PyTorch (autograd included: the MAP oracles may take a
    gradient) with the ``torch.func`` transforms' interpreter stack set aside."""
    if not torch._C._are_functorch_transforms_active():
        return contextlib.nullcontext()
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


def _check_init(init: object, raw: Tensor) -> tuple[Tensor, Tensor]:
    """``init``'s part structures [B, S0, P] and weights [B, S0] (float64, on ``raw``'s
    device; the structures of weight 0 zeroed), ValueError unless it is a
    :class:`SparseMAPResult` of ``raw``'s batch and part shapes."""
    part_structures = getattr(init, "part_structures", None)
    if not isinstance(init, SparseMAPResult) or not isinstance(part_structures, Tensor):
        raise ValueError(
            "`init` must be the SparseMAPResult of an earlier sparsemap(), got "
            + type(init).__name__
        )
    if part_structures.dim() != 3 or (part_structures.shape[0], part_structures.shape[2]) != (
        raw.shape[0],
        raw.shape[1],
    ):
        raise ValueError(
            "`init` must come from a distribution of the same class and shapes: its structures "
            f"have {tuple(part_structures.shape)} (B, S, parts), the scores {tuple(raw.shape)}"
        )
    weights = init.weights.detach().to(device=raw.device, dtype=torch.float64)
    structures = part_structures.detach().to(device=raw.device, dtype=torch.float64)
    return structures * (weights > 0).unsqueeze(-1), weights.clamp_min(0)


def _plain(x: Tensor) -> Tensor:
    """``x``'s values as a plain tensor: unwrapped from every ``torch.func`` grad and jvp
    level (the active set runs outside them; its result enters through the Function).
    ValueError under ``vmap``: the active set's stopping rule reads values on the host."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(x):
        if functorch.is_batchedtensor(x):
            raise ValueError(
                "sparsemap() cannot take scores batched by torch.func.vmap: the active set "
                "stops per item on values read on the host (jacfwd and jacrev, which batch "
                "only the tangents, work; or loop over the vmapped dimension)"
            )
        x = functorch.get_unwrapped(x)
    return fwAD.unpack_dual(x).primal.detach()


class _Solution(NamedTuple):
    mean: Tensor  # [B, P] float64
    structures: Tensor  # [B, S, P] float64
    weights: Tensor  # [B, S] float64
    gram: Tensor  # [B, S, S] float64
    converged: Tensor  # [B]
    iterations: int


def _active_set(
    raw: Tensor,
    oracle: Callable[[Tensor, Tensor], Tensor],
    max_iter: int,
    tol: float,
    init: tuple[Tensor, Tensor] | None = None,
) -> _Solution:
    """The active-set iterations on the plain part scores ``raw`` [B, P] (``-inf`` allowed:
    forbidden parts); ``oracle(scores [R, P], items LongTensor [R])`` gives the MAP
    indicators [R, P] (float64) of those items under those scores. Each iteration asks the
    oracle about the items still running only. ``init`` (structures [B, S0, P], weights
    [B, S0]): a warm start; the working set begins with those structures (the allowed ones)
    and the MAP structure, from those weights (the rest on the MAP structure), and the
    restricted QP is solved before the first oracle call."""
    batch = raw.shape[0]
    scores = torch.where(torch.isfinite(raw), raw, 0.0).to(torch.float64)
    threshold = tol * (1.0 + scores.abs().amax(-1))  # [B]
    forbidden = torch.isneginf(raw)
    every = torch.arange(batch, device=raw.device)
    state = _Restricted(oracle(raw, every), scores)
    stopped = state.weights[:, 0] == 0  # no structure: nothing to do
    if init is not None:  # warm start: the earlier structures that are still allowed
        structures, weights = init
        allowed = (structures != 0).any(-1) & ~((structures != 0) & forbidden.unsqueeze(1)).any(-1)
        state.add(structures, allowed & ~stopped.unsqueeze(-1))
        # start from the earlier weights (a feasible point: the earlier solution where its
        # structures are still allowed), the rest of the weight on the MAP structure
        kept = weights * state.working[:, 1:]
        state.weights = torch.cat([(1.0 - kept.sum(-1, keepdim=True)).clamp_min(0), kept], 1)
        state.weights = state.weights * (~stopped).unsqueeze(-1)
        state.working = state.working | (state.weights > 0)
        state.solve()
    converged = torch.zeros(batch, dtype=torch.bool, device=raw.device)
    live = (~stopped).nonzero().squeeze(-1)  # the items still running
    iterations = 0
    while iterations < max_iter and live.numel():
        mean = state.mean
        gradient = scores - mean  # [B, P]: the objective's gradient
        # the oracle on the gradient, -inf parts kept forbidden
        query = torch.where(forbidden, raw, gradient.to(raw.dtype)).index_select(0, live)
        best = torch.zeros_like(scores).index_copy(0, live, oracle(query, live))
        gap = (gradient * (best - mean)).sum(-1)
        small = (gap <= threshold) & ~stopped
        converged = converged | small
        stopped = stopped | small
        # an active structure again: no progress possible (a dropped one may come back)
        stopped = stopped | state.add(best.unsqueeze(1), (~stopped).unsqueeze(-1))
        live = (~stopped).nonzero().squeeze(-1)
        if not live.numel():
            break
        iterations += 1
        state.solve()
        if iterations % 8 == 0:  # slots of dropped structures: cut now and then
            state.compact()
    state.compact()
    return _Solution(state.mean, state.structures, state.weights, state.gram, converged, iterations)


def sparsemap(
    dist: StructuredDistribution,
    max_iter: int = 50,
    tol: float = 1e-6,
    init: SparseMAPResult | None = None,
) -> SparseMAPResult:
    """SparseMAP marginals of ``dist`` (any structured distribution with an ``argmax``): the
    active-set algorithm with ``dist``'s MAP pass as oracle (see the module docstring).

    Args:
        dist: the distribution; its potentials are the scores (they may require grad).
        max_iter: at most this many active-set iterations (each one batched MAP call); the
            solution after the last one is returned, with ``converged`` False for the items
            whose gap was still above ``tol``.
        tol: stop an item when its Frank-Wolfe gap is at most ``tol * (1 + max |theta|)``.
        init: a warm start: the result of an earlier call on a distribution of the same
            class and shapes (e.g. the previous training step's scores); its structures
            (those that use no part now forbidden) start in the working set, so an item
            whose support changed little takes few iterations. The solution is the same as
            without (optimal up to ``tol``), only found faster.

    Returns:
        :class:`SparseMAPResult`: ``marginals`` (the shape of ``dist.marginals``), the part
        marginals, the ``weights`` [B, S] and ``structures`` [B, S, ...] of the convex
        combination, ``converged`` [B] and the number of ``iterations``. Differentiable in
        the potentials, in reverse and forward mode and again (closed-form Jacobian on the
        final support; see the module docstring). An item with no valid structure gets
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
    raw = _plain(theta)
    with torch.no_grad(), _outside_transforms():

        def oracle(flat: Tensor, items: Tensor) -> Tensor:  # [R, P], [R] -> [R, P] float64
            rows = flat.shape[0]
            chunks = flat.split(sizes, -1)
            given = tuple(c.reshape(rows, *s[1:]) for c, s in zip(chunks, shapes, strict=True))
            lengths = None if dist.lengths is None else dist.lengths.index_select(0, items)
            found = dist._sparsemap_argmax(given, lengths)
            return torch.cat([f.reshape(rows, -1) for f in found], -1).to(torch.float64)

        start = None
        if init is not None:
            start = _check_init(init, raw)
        solution = _active_set(raw, oracle, max_iter, tol, start)
        mean, structures, weights, gram = solution[:4]
        block = _support_inverse(gram, weights > 0)
    # always through the Function (it only saves): forward-mode duals need its jvp even where
    # nothing requires grad
    flat = _SparseMAPFunction.apply(theta, mean, structures, block)
    out = tuple(c.reshape(s) for c, s in zip(flat.split(sizes, -1), shapes, strict=True))
    first = structures[..., : sizes[0]].reshape(batch, -1, *shapes[0][1:])
    return SparseMAPResult(
        out[0],
        out,
        weights.to(raw.dtype),
        first.to(raw.dtype),
        solution.converged,
        solution.iterations,
        structures,
    )
