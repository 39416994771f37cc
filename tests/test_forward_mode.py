"""Forward mode over forward mode, and every order of forward and reverse mode, through the
hand-written ``torch.autograd.Function``s (issue 38.3): PyTorch runs a Function's ``jvp``
with forward-mode AD off, so ``jacfwd(jacfwd(f))`` and nested ``torch.func.jvp`` used to
see the inner tangent as a constant (Hessians off by up to 0.25, non-zero entries 0); and
``jacrev(jacfwd(f))`` lost the jvp's dependence on the scores (the distributions computed
log Z under ``no_grad`` for a jvp wrapper). Every jvp now runs through
``_validation.outer_jvp``. Each order is checked in float64 against autograd's double
backward (``torch.autograd.functional.hessian``) and, for chains and trees, against the
Hessian of the brute-force log Z over every structure (tests/oracles.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from oracles import chain_score, chains, tree_score, trees
from torch import Tensor
from torch.func import grad, hessian, jacfwd, jacrev, jvp

from structattn.distributions import (
    DependencyCRF,
    LinearChainCRF,
    NonProjectiveDependencyCRF,
    SemiMarkovCRF,
    SplitTreeDistribution,
    StructuredDistribution,
    TreeCRF,
)
from structattn.structs.mean_field import mean_field_marginals

F64 = torch.float64
LENGTHS = torch.tensor([4, 3])


def _draw(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


_SHARED = _draw(3, 3, seed=5)
_PER_STEP = _draw(2, 3, 3, 3, seed=7)
_COUPLING = _draw(2, 4, 4, seed=1)
_UNARY = _draw(2, 4, 3, seed=2)
_SEGMENT_TRANSITIONS = _draw(2, 2, seed=9)

Make = Callable[[Tensor], StructuredDistribution]

#: name -> (a distribution of one potential tensor, that tensor's shape)
CASES: dict[str, tuple[Make, tuple[int, ...]]] = {
    "chain-shared": (lambda x: LinearChainCRF(x, _SHARED, LENGTHS), (2, 4, 3)),
    "chain-per-step": (lambda x: LinearChainCRF(x, _PER_STEP, LENGTHS), (2, 4, 3)),
    "chain-transitions": (
        lambda p: LinearChainCRF(_UNARY, p, LENGTHS),
        (3, 3),
    ),
    "projective": (lambda x: DependencyCRF(x, LENGTHS), (2, 4, 4)),
    "projective-one-root": (lambda x: DependencyCRF(x, LENGTHS, multiroot=False), (2, 4, 4)),
    "non-projective": (lambda x: NonProjectiveDependencyCRF(x, LENGTHS), (2, 4, 4)),
    "non-projective-one-root": (
        lambda x: NonProjectiveDependencyCRF(x, LENGTHS, multiroot=False),
        (2, 4, 4),
    ),
    "constituency": (lambda x: TreeCRF(x, LENGTHS), (2, 4, 4)),
    "constituency-labelled": (lambda x: TreeCRF(x, LENGTHS), (2, 4, 4, 2)),
    "semi-markov": (
        lambda x: SemiMarkovCRF(x, _SEGMENT_TRANSITIONS, LENGTHS),
        (2, 4, 3, 2),
    ),
    "split-tree": (lambda x: SplitTreeDistribution(x, LENGTHS), (2, 4)),
}


def _logz(name: str) -> Callable[[Tensor], Tensor]:
    make, _ = CASES[name]
    return lambda a: make(a).log_partition.sum()


def _autograd_hessian(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    result = torch.autograd.functional.hessian(f, x)
    assert isinstance(result, Tensor)
    return result


#: the four ways of taking a Hessian with torch.func
ORDERS: dict[str, Callable[[Callable[[Tensor], Tensor]], Callable[[Tensor], Tensor]]] = {
    "jacfwd(jacfwd)": lambda f: jacfwd(jacfwd(f)),
    "jacrev(jacfwd)": lambda f: jacrev(jacfwd(f)),
    "jacfwd(jacrev)": lambda f: jacfwd(jacrev(f)),
    "jacrev(jacrev)": lambda f: jacrev(jacrev(f)),
}


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_order_of_the_hessian_equals_autograd(name: str, order: str) -> None:
    _, shape = CASES[name]
    x = _draw(*shape)
    f = _logz(name)
    torch.testing.assert_close(ORDERS[order](f)(x), _autograd_hessian(f, x))


@pytest.mark.parametrize("name", sorted(CASES))
def test_nested_jvp_and_forward_mode_marginals(name: str) -> None:
    """jvp of jvp is v^T H w; jacfwd of the marginals is the Hessian (no enclosing level)."""
    make, shape = CASES[name]
    x, v, w = _draw(*shape), _draw(*shape, seed=3), _draw(*shape, seed=4)
    f = _logz(name)
    expected = _autograd_hessian(f, x)
    second = jvp(lambda a: jvp(f, (a,), (v,))[1], (x,), (w,))[1]
    matrix = expected.reshape(x.numel(), x.numel())
    torch.testing.assert_close(second, v.flatten() @ matrix @ w.flatten())
    if name not in ("split-tree", "chain-transitions"):  # marginals over other parts
        marginals = jacfwd(lambda a: make(a).marginals)(x)
        torch.testing.assert_close(marginals, expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_autograd_over_forward_ad(name: str) -> None:
    """``torch.autograd.forward_ad`` (one dual level) with reverse mode on top: the jvp's
    result is differentiable with respect to the scores (H v)."""
    _, shape = CASES[name]
    x, v = _draw(*shape), _draw(*shape, seed=3)
    f = _logz(name)
    expected = _autograd_hessian(f, x).flatten(x.dim()) @ v.flatten()
    leaf = x.clone().requires_grad_(True)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(f(fwAD.make_dual(leaf, v))).tangent
    (hv,) = torch.autograd.grad(tangent, leaf)
    torch.testing.assert_close(hv, expected)


def test_the_brute_force_hessians() -> None:
    """The Hessians of log Z over every label sequence and every (projective or not) tree
    (tests/oracles.py), by forward over forward mode."""
    unary = _draw(1, 3, 2)
    pairwise = _draw(2, 2, seed=1)

    def chain_brute(u: Tensor) -> Tensor:
        steps = pairwise.expand(2, 2, 2)
        return torch.stack([chain_score(u[0], steps, z) for z in chains(3, 2)]).logsumexp(0)

    got = jacfwd(jacfwd(lambda u: LinearChainCRF(u, pairwise).log_partition.sum()))(unary)
    torch.testing.assert_close(got, _autograd_hessian(chain_brute, unary))
    arcs = _draw(1, 4, 4, seed=2)
    for projective, make in ((True, DependencyCRF), (False, NonProjectiveDependencyCRF)):

        def tree_brute(a: Tensor, projective: bool = projective) -> Tensor:
            heads = trees(3, projective, True)
            return torch.stack([tree_score(a[0], h) for h in heads]).logsumexp(0)

        got = jacfwd(jacfwd(lambda a, make=make: make(a).log_partition.sum()))(arcs)
        torch.testing.assert_close(got, _autograd_hessian(tree_brute, arcs))


def test_non_projective_forward_mode_first_order() -> None:
    """jacfwd of the non-projective log Z was wrong at first order: a jvp wrapper does not
    require grad, so log Z came from the no-grad LU pass (a constant)."""
    x = _draw(2, 4, 4)
    f = _logz("non-projective")
    torch.testing.assert_close(jacfwd(f)(x), jacrev(f)(x))


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_mean_field_every_order(order: str) -> None:
    unary = _draw(2, 4)

    def total(u: Tensor) -> Tensor:
        return mean_field_marginals(u, _COUPLING, iterations=3).sum()

    torch.testing.assert_close(ORDERS[order](total)(unary), _autograd_hessian(total, unary))
    torch.testing.assert_close(hessian(total)(unary), _autograd_hessian(total, unary))


def test_third_order_through_forward_mode() -> None:
    """jacfwd over the forward-mode Hessian of a chain's log Z (the marginals' jvp is then
    differentiated again: by torch.func through the plain inside pass) against autograd's
    triple backward."""
    x = _draw(1, 3, 3)

    def g(a: Tensor) -> Tensor:
        return LinearChainCRF(a, _SHARED).log_partition.sum()

    def autograd_hessian(a: Tensor) -> Tensor:
        result = torch.autograd.functional.hessian(g, a, create_graph=True)
        assert isinstance(result, Tensor)
        return result

    third = torch.autograd.functional.jacobian(autograd_hessian, x)
    torch.testing.assert_close(jacfwd(jacfwd(jacfwd(g)))(x), third)


def test_vmap_over_forward_over_forward() -> None:
    """A vmapped level around the two forward levels (it is not a differentiation level)."""
    xs = torch.stack([_draw(2, 4, 4, seed=s) for s in range(2)])
    f = _logz("projective")
    got = torch.func.vmap(jacfwd(jacfwd(f)))(xs)
    for v, x in enumerate(xs):
        torch.testing.assert_close(got[v], _autograd_hessian(f, x))


def _third(f: Callable[[Tensor], Tensor], x: Tensor, u: Tensor, v: Tensor, w: Tensor) -> Tensor:
    """The third derivative of ``f`` at ``x`` along u, v, w by triple backward."""
    leaf = x.clone().requires_grad_(True)
    (g1,) = torch.autograd.grad(f(leaf), leaf, create_graph=True)
    (g2,) = torch.autograd.grad((g1 * u).sum(), leaf, create_graph=True)
    (g3,) = torch.autograd.grad((g2 * v).sum(), leaf)
    return (g3 * w).sum()


@pytest.mark.parametrize("name", ["chain-shared", "projective", "constituency", "split-tree"])
def test_third_order_by_nested_jvp(name: str) -> None:
    """jvp(jvp(jvp(f))) and grad over jvp(jvp(f)): a jvp whose result an enclosing level
    differentiates runs torch.func through differentiable operations of the scores."""
    _, shape = CASES[name]
    x, u, v, w = (_draw(*shape, seed=s) for s in (0, 3, 4, 5))
    f = _logz(name)

    def twice(c: Tensor) -> Tensor:
        return jvp(lambda b: jvp(f, (b,), (u,))[1], (c,), (v,))[1]

    expected = _third(f, x, u, v, w)
    torch.testing.assert_close(jvp(twice, (x,), (w,))[1], expected)
    torch.testing.assert_close((torch.func.grad(twice)(x) * w).sum(), expected)


@pytest.mark.parametrize("name", ["chain-shared", "semi-markov"])
def test_forward_over_the_backward_of_a_jvp_refuses(name: str) -> None:
    """jvp(grad(jvp(f))) and grad(grad(grad(f))) would differentiate a backward computed
    from saved constants (grad^3 of a chain was off by 1.6 before): a clear error, not a
    wrong value."""
    _, shape = CASES[name]
    x, u, v = (_draw(*shape, seed=s) for s in (0, 3, 4))
    f = _logz(name)

    def hvp_dot(c: Tensor) -> Tensor:
        return (torch.func.grad(lambda b: jvp(f, (b,), (u,))[1])(c) * v).sum()

    with pytest.raises(RuntimeError, match="a third derivative under torch.func"):
        jvp(hvp_dot, (x,), (u,))
    with pytest.raises(RuntimeError, match="a third derivative under torch.func"):
        torch.func.grad(lambda c: (torch.func.grad(lambda b: (grad(f)(b) * u).sum())(c) * v).sum())(
            x
        )
