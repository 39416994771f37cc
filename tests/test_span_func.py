"""torch.func over the span dynamic programs' hand-written Functions (issue 39): the CKY
and semi-Markov Functions have vmap rules (the vmapped dimension folds into the batch) and
jvp rules (the marginals; the Hessian-vector product by hand), so that grad, jacrev,
jacfwd, hessian, jvp and vmap run the hand-written passes, not a plain differentiable
inside pass; each is checked against plain autograd through the semiring inside pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from structattn.distributions import SemiMarkovCRF, TreeCRF
from structattn.semirings import LogSemiring
from structattn.structs import constituency, semi_markov
from structattn.structs.constituency import cky_inside, cky_log_partition, cky_marginals
from structattn.structs.semi_markov import (
    semi_markov_inside,
    semi_markov_log_partition,
    semi_markov_marginals,
)

F64 = torch.float64
LENGTHS = torch.tensor([4, 3])


def _draw(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


TRANSITIONS = _draw(2, 2, seed=9)

#: name -> (hand-written log Z of one tensor, the autograd reference, the tensor's shape)
CASES: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor], tuple[int, ...]]]
CASES = {
    "cky": (
        lambda x: cky_log_partition(x, LENGTHS),
        lambda x: cky_inside(x, LENGTHS, LogSemiring),
        (2, 4, 4),
    ),
    "semi-markov": (
        lambda x: semi_markov_log_partition(x, TRANSITIONS.expand(2, 2, 2), LENGTHS),
        lambda x: semi_markov_inside(x, TRANSITIONS.expand(2, 2, 2), LENGTHS, LogSemiring),
        (2, 4, 3, 2),
    ),
}


def _autograd_hessian(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    result = torch.autograd.functional.hessian(lambda a: f(a).sum(), x)
    assert isinstance(result, Tensor)
    return result


@contextmanager
def _no_plain_inside() -> Iterator[None]:
    """Within the block the plain differentiable inside passes raise: what runs is the
    hand-written Functions (and their vmap and jvp rules)."""

    def refuse(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("the plain inside pass ran")

    saved = constituency.cky_inside, semi_markov.semi_markov_inside
    constituency.cky_inside = semi_markov.semi_markov_inside = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        constituency.cky_inside, semi_markov.semi_markov_inside = saved


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_jacrev_hessian_equal_autograd(name: str) -> None:
    hand, plain, shape = CASES[name]
    x = _draw(*shape)
    expected = _autograd_hessian(plain, x)
    with _no_plain_inside():  # first and reverse-over-reverse second order: by hand
        torch.testing.assert_close(grad(lambda a: hand(a).sum())(x), jacrev(plain)(x).sum(0))
        torch.testing.assert_close(jacrev(jacrev(lambda a: hand(a).sum()))(x), expected)
        # forward over reverse: jacfwd's batched tangents fold into the batch
        torch.testing.assert_close(hessian(lambda a: hand(a).sum())(x), expected)
        torch.testing.assert_close(jacfwd(jacrev(lambda a: hand(a).sum()))(x), expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jvp_of_log_partition_and_marginals(name: str) -> None:
    """jvp of log Z is <marginals, tangent>; jvp of the marginals is the Hessian-vector
    product by hand (a plain tangent)."""
    hand, plain, shape = CASES[name]
    x, tangent = _draw(*shape), _draw(*shape, seed=1)
    _, d_logz = jvp(hand, (x,), (tangent,))
    _, d_want = jvp(plain, (x,), (tangent,))
    torch.testing.assert_close(d_logz, d_want)

    def marginals(a: Tensor) -> Tensor:
        if name == "cky":
            return cky_marginals(a, LENGTHS)[1]
        return semi_markov_marginals(a, TRANSITIONS.expand(2, 2, 2), LENGTHS)[0]

    with _no_plain_inside():
        _, d_marginals = jvp(marginals, (x,), (tangent,))
    want = _autograd_hessian(plain, x).flatten(x.dim()) @ tangent.flatten()
    torch.testing.assert_close(d_marginals, want.view_as(x))


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_folds_into_the_batch(name: str) -> None:
    """vmap of log Z, its gradient and the marginals runs the Functions once on the folded
    batch, and equals a loop."""
    hand, plain, shape = CASES[name]
    xs = torch.stack([_draw(*shape, seed=seed) for seed in range(3)])
    with _no_plain_inside():
        logz = vmap(hand)(xs)
        grads = vmap(grad(lambda a: hand(a).sum()))(xs)
        hvps = vmap(lambda a: jacrev(jacrev(lambda b: hand(b).sum()))(a))(xs[:2])
    for v, x in enumerate(xs):
        torch.testing.assert_close(logz[v], plain(x))
        torch.testing.assert_close(grads[v], jacrev(plain)(x).sum(0))
        if v < 2:
            torch.testing.assert_close(hvps[v], _autograd_hessian(plain, x))


def test_distributions_under_vmap_and_second_order() -> None:
    """The distributions' marginals under vmap, and a loss on them differentiated by
    torch.func (the hand-written Hessian-vector products), against autograd."""
    spans = torch.stack([_draw(2, 5, 5, 3, seed=s) for s in range(2)])
    segs = torch.stack([_draw(2, 5, 3, 2, seed=s) for s in range(2)])
    trans = torch.stack([_draw(2, 2, seed=s + 5) for s in range(2)])
    lengths = torch.tensor([5, 3])
    weight = _draw(2, 5, 5, 3, seed=7)

    def tree_loss(a: Tensor) -> Tensor:
        return (TreeCRF(a, lengths).marginals * weight).sum()

    def semi_loss(a: Tensor, t: Tensor) -> Tensor:
        dist = SemiMarkovCRF(a, t, lengths)
        return dist.marginals.pow(2).sum() + dist.transition_marginals.sum()

    with _no_plain_inside():
        tree_grads = vmap(grad(tree_loss))(spans)
        semi_grads = vmap(grad(semi_loss, argnums=(0, 1)))(segs, trans)
        marginals = vmap(lambda a: TreeCRF(a, lengths).marginals)(spans)
    for v in range(2):
        x = spans[v].clone().requires_grad_()
        (want,) = torch.autograd.grad(tree_loss(x), x)
        torch.testing.assert_close(tree_grads[v], want)
        torch.testing.assert_close(marginals[v], TreeCRF(spans[v], lengths).marginals)
        a, t = segs[v].clone().requires_grad_(), trans[v].clone().requires_grad_()
        wants = torch.autograd.grad(semi_loss(a, t), (a, t))
        for got, w in zip((semi_grads[0][v], semi_grads[1][v]), wants, strict=True):
            torch.testing.assert_close(got, w)
