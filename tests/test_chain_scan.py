"""The log-depth parallel scan for chains agrees with the forward algorithm and brute force."""

from __future__ import annotations

import math

import oracles
import pytest
import torch

from structattn import LinearChainCRF
from structattn.semirings import LogSemiring, MaxSemiring, SampleSemiring
from structattn.structs.linear_chain import chain_inside

METHODS = ("sequential", "scan")


@pytest.mark.parametrize("semiring", [LogSemiring, MaxSemiring])
@pytest.mark.parametrize("c", [1, 2, 3])
def test_scan_against_brute_force(semiring, c: int) -> None:
    for n in range(1, 6):
        unary = torch.randn(3, n, c, dtype=torch.float64)
        pairwise = torch.randn(3, max(n - 1, 0), c, c, dtype=torch.float64)
        lengths = torch.tensor([n, max(1, n - 1), 1])
        got = chain_inside(unary, pairwise, lengths, semiring, method="scan")
        for b, length in enumerate(lengths.tolist()):
            scores = torch.stack(
                [oracles.chain_score(unary[b], pairwise[b], z) for z in oracles.chains(length, c)]
            )
            want = scores.logsumexp(0) if semiring is LogSemiring else scores.max()
            torch.testing.assert_close(got[b], want)


def test_scan_gradients_match_forward_algorithm() -> None:
    unary = torch.randn(4, 37, 2, dtype=torch.float64, requires_grad=True)
    pairwise = torch.randn(4, 36, 2, 2, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([37, 20, 5, 1])
    grads = {}
    for method in METHODS:
        logz = chain_inside(unary, pairwise, lengths, LogSemiring, method=method)
        g = torch.autograd.grad(logz.sum(), (unary, pairwise), create_graph=True)
        second = torch.autograd.grad((g[0] ** 2).sum(), (unary, pairwise))
        grads[method] = (logz, *g, *second)
    for a, b in zip(grads["sequential"], grads["scan"], strict=True):
        torch.testing.assert_close(a, b)


def test_scan_gradcheck_and_gradgradcheck() -> None:
    unary = torch.randn(2, 5, 2, dtype=torch.float64, requires_grad=True)
    pairwise = torch.randn(2, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([5, 3])

    def f(u, p):
        return chain_inside(u, p, lengths, LogSemiring, method="scan")

    assert torch.autograd.gradcheck(f, (unary, pairwise))
    assert torch.autograd.gradgradcheck(f, (unary, pairwise))


def test_scan_with_minus_inf_transitions_is_finite() -> None:
    unary = torch.randn(3, 40, 3, requires_grad=True)
    pairwise = torch.zeros(3, 3)
    pairwise.fill_diagonal_(float("-inf"))
    dist = LinearChainCRF(unary, pairwise, lengths=torch.tensor([40, 17, 1]))
    loss = dist.log_partition.sum() + dist.marginals.pow(2).sum()
    (grad,) = torch.autograd.grad(loss, unary)
    assert torch.isfinite(grad).all() and torch.isfinite(dist.marginals).all()
    seq = chain_inside(
        unary.double(),
        pairwise.double().expand(3, 39, 3, 3),
        torch.tensor([40, 17, 1]),
        LogSemiring,
        "sequential",
    )
    torch.testing.assert_close(dist.log_partition.double(), seq, rtol=1e-5, atol=1e-4)


def test_scan_samples_are_exact() -> None:
    n, c = 4, 2
    unary = torch.randn(1, n, c, dtype=torch.float64)
    pairwise = torch.randn(1, n - 1, c, c, dtype=torch.float64)
    support = oracles.chains(n, c)
    scores = torch.stack([oracles.chain_score(unary[0], pairwise[0], z) for z in support])
    probs = (scores - scores.logsumexp(0)).exp()
    draws = 4000
    u = unary.repeat(draws, 1, 1).requires_grad_()
    p = pairwise.repeat(draws, 1, 1, 1).requires_grad_()
    value = chain_inside(u, p, None, SampleSemiring, method="scan")
    (ind,) = torch.autograd.grad(value.sum(), (u,))
    labels = ind.argmax(-1)  # [draws, N]
    assert (ind.sum(-1) == 1).all()
    index = {z: i for i, z in enumerate(support)}
    counts = torch.zeros(len(support), dtype=torch.float64)
    for row in labels.tolist():
        counts[index[tuple(row)]] += 1
    tv = 0.5 * (counts / draws - probs).abs().sum()
    assert tv < 3 * math.sqrt(len(support) / (2 * math.pi * draws)), float(tv)


def test_distribution_uses_the_scan_and_agrees() -> None:
    unary = torch.randn(5, 64, 2)
    pairwise = torch.randn(2, 2)
    lengths = torch.tensor([64, 50, 33, 2, 1])
    dist = LinearChainCRF(unary, pairwise, lengths)  # C = 2, N = 64: scan
    seq = chain_inside(unary, pairwise.expand(5, 63, 2, 2), lengths, LogSemiring, "sequential")
    torch.testing.assert_close(dist.log_partition, seq, rtol=1e-5, atol=1e-4)
    scores, labels = dist.topk(2)
    torch.testing.assert_close(dist.max_score, scores[0])
