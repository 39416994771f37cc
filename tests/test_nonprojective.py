"""NonProjectiveDependencyCRF against brute-force enumeration of every tree (float64), plus
padding, degenerate, no-tree, float32-stability, gradient and property checks."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck

sys.path.insert(0, str(Path(__file__).parent))

from oracles import count_nonprojective, summarize, tree_score, trees  # noqa: E402

import structattn.structs.nonprojective as nonprojective  # noqa: E402
from structattn.distributions.nonprojective import NonProjectiveDependencyCRF  # noqa: E402
from structattn.semirings import MaxSemiring  # noqa: E402
from structattn.trees import is_tree  # noqa: E402

NEG_INF = float("-inf")
MULTIROOT = pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])


# ---- helpers --------------------------------------------------------------------------------
@dataclass
class Enumerated:
    """Everything about one item, by brute force over its trees."""

    support: list[tuple[int, ...]]  # every tree, as head tuples of words 1..n
    probs: Tensor  # [T]
    log_partition: Tensor
    entropy: Tensor
    max_score: Tensor
    argmax: list[int]  # heads with -1 at ROOT
    marginals: Tensor  # [N, N]


def enumerate_item(scores: Tensor, multiroot: bool) -> Enumerated:
    """Brute force over every tree of one item, ``scores`` [N, N] (N - 1 words)."""
    size = scores.shape[-1]
    support = list(trees(size - 1, projective=False, multiroot=multiroot))
    values = torch.stack([tree_score(scores, t) for t in support])  # [T]
    summary = summarize(values)
    marginals = torch.zeros(size, size, dtype=scores.dtype)
    if torch.isfinite(values).any():
        for t, p in zip(support, summary["probs"], strict=True):
            for m, h in enumerate(t, start=1):
                marginals[h, m] += p
    return Enumerated(
        support=support,
        probs=summary["probs"],
        log_partition=summary["log_partition"],
        entropy=summary["entropy"],
        max_score=summary["max_score"],
        argmax=[-1, *support[int(values.argmax())]],
        marginals=marginals,
    )


def heads_tensor(support: list[tuple[int, ...]]) -> Tensor:
    """Head tuples -> LongTensor [T, N] with -1 at ROOT."""
    return torch.tensor([[-1, *t] for t in support], dtype=torch.long)


def chain_kept(scores: Tensor, frac: float, generator: torch.Generator) -> Tensor:
    """Set a fraction of arcs to -inf but keep ROOT -> 1 -> 2 -> ... so a tree exists."""
    size = scores.shape[-1]
    drop = torch.rand(scores.shape, generator=generator) < frac
    keep = torch.zeros(size, size, dtype=torch.bool)
    keep[torch.arange(size - 1), torch.arange(1, size)] = True
    return scores.masked_fill(drop & ~keep, NEG_INF)


def koo_log_det(scores: Tensor, multiroot: bool) -> Tensor:
    """Reference matrix-tree theorem with a dense determinant (fine at moderate scales)."""
    size = scores.shape[-1]
    banned = torch.eye(size, dtype=torch.bool)
    banned[:, 0] = True
    weights = scores.masked_fill(banned, NEG_INF).exp()  # [B, N, N]
    first = 0 if multiroot else 1  # single root: no root weight on the diagonal (Koo et al.)
    lap = torch.diag_embed(weights[:, first:, 1:].sum(1)) - weights[:, 1:, 1:]
    if not multiroot:
        lap[:, 0] = weights[:, 0, 1:]  # first row replaced by the root weights
    sign, logabs = torch.linalg.slogdet(lap)
    assert (sign > 0).all()
    return logabs


# ---- against enumeration --------------------------------------------------------------------
@MULTIROOT
@pytest.mark.parametrize("n_words", [1, 2, 3, 4, 5])
def test_matches_enumeration(n_words: int, multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(10 * n_words + multiroot)
    size = n_words + 1
    scores = torch.randn(3, size, size, dtype=torch.float64, generator=gen) * 2
    scores[2] = chain_kept(scores[2], 0.4, gen)
    dist = NonProjectiveDependencyCRF(scores, multiroot=multiroot)
    for b in range(3):
        ref = enumerate_item(scores[b], multiroot)
        torch.testing.assert_close(dist.log_partition[b], ref.log_partition)
        torch.testing.assert_close(dist.marginals[b], ref.marginals)
        torch.testing.assert_close(dist.entropy[b], ref.entropy)
        torch.testing.assert_close(dist.max_score[b], ref.max_score)
        assert dist.argmax[b].tolist() == ref.argmax


@MULTIROOT
@pytest.mark.parametrize("n_words", [1, 2, 3, 4, 5, 6, 8])
def test_zero_scores_count_trees(n_words: int, multiroot: bool) -> None:
    scores = torch.zeros(1, n_words + 1, n_words + 1, dtype=torch.float64)
    dist = NonProjectiveDependencyCRF(scores, multiroot=multiroot)
    expected = math.log(count_nonprojective(n_words, multiroot))
    torch.testing.assert_close(dist.log_partition[0].item(), expected)
    torch.testing.assert_close(dist.entropy[0].item(), expected)  # uniform distribution


@MULTIROOT
def test_log_prob(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 5, 5, dtype=torch.float64, generator=gen)
    ref = enumerate_item(scores[0], multiroot)
    support = ref.support
    heads = heads_tensor(support)  # [T, N]
    dist = NonProjectiveDependencyCRF(scores.expand(len(support), 5, 5), multiroot=multiroot)
    logp = dist.log_prob(heads)
    probs = ref.probs
    torch.testing.assert_close(logp, probs.log())
    torch.testing.assert_close(logp.exp().sum().item(), 1.0)
    bad = torch.tensor(
        [
            [-1, 2, 1, 0, 0],  # 1 <-> 2 cycle
            [-1, 1, 0, 0, 0],  # self loop
            [-1, 0, 0, 0, 0] if not multiroot else [-1, 4, 4, 4, 3],  # 4 roots / cycle 3 <-> 4
        ]
    )
    three = NonProjectiveDependencyCRF(scores.expand(3, 5, 5), multiroot=multiroot)
    assert torch.isneginf(three.log_prob(bad)).all()
    four = NonProjectiveDependencyCRF(scores.expand(4, 5, 5), multiroot=multiroot)
    with pytest.raises(ValueError, match="heads"):  # head out of range: an error
        four.log_prob(torch.cat([bad, torch.tensor([[-1, 0, 7, 0, 0]])]))
    with pytest.raises(ValueError):
        three.log_prob(bad.double())


@MULTIROOT
def test_sample_frequencies(multiroot: bool) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(1, 4, 4, dtype=torch.float64, generator=gen) * 1.5
    ref = enumerate_item(scores[0], multiroot)
    support, probs = ref.support, ref.probs
    n = 4000
    samples = NonProjectiveDependencyCRF(scores, multiroot=multiroot).sample(n)
    assert samples.shape == (n, 1, 4) and samples.dtype == torch.long
    counts = Counter(tuple(row[1:].tolist()) for row in samples[:, 0])
    assert set(counts) <= set(support)  # every sample is a tree of the support
    freq = torch.tensor([counts[t] / n for t in support], dtype=torch.float64)
    # total variation ~0.015 for an exact sampler here; drawing each head from the
    # unconditioned marginals (a classic mistake) gives ~0.2
    assert 0.5 * (freq - probs).abs().sum() < 0.04
    # and the target is far from uniform, so the bound is discriminative
    assert 0.5 * (probs - 1 / len(support)).abs().sum() > 0.2


def test_sample_padding_neg_inf_and_no_tree() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(3, 6, 6, generator=gen)
    scores[0] = chain_kept(scores[0], 0.5, gen)
    scores[2, :, 3] = NEG_INF  # word 3 has no head: no tree
    lengths = torch.tensor([6, 4, 6])
    for multiroot in (True, False):
        samples = NonProjectiveDependencyCRF(scores, lengths, multiroot).sample(50)
        assert samples.shape == (50, 3, 6)
        flat = samples[:, :2].reshape(100, 6)  # [n * 2, N]
        assert is_tree(flat, lengths[:2].repeat(50), multiroot).all()
        assert (samples[:, 1, 4:] == -1).all() and (samples[:, :, 0] == -1).all()
        assert (samples[:, 2] == -1).all()
        used = scores[0][samples[:, 0, 1:], torch.arange(1, 6)]  # [n, 5] sampled arc scores
        assert torch.isfinite(used).all()  # no -inf arc ever sampled


def test_sample_redraws_impossible_arcs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Marginals with rounding noise on impossible arcs must still give valid trees."""
    torch.manual_seed(0)
    exact = nonprojective.matrix_tree_marginals

    def noisy(scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
        allowed = torch.isfinite(scores)
        return exact(scores, lengths, multiroot) + 0.3 * allowed  # every allowed arc likely

    monkeypatch.setattr(nonprojective, "matrix_tree_marginals", noisy)
    scores = torch.randn(2, 5, 5)
    for multiroot in (True, False):
        samples = NonProjectiveDependencyCRF(scores, multiroot=multiroot).sample(100)
        assert is_tree(samples.reshape(200, 5), torch.full((200,), 5), multiroot).all()


@MULTIROOT
@pytest.mark.parametrize("path", ["updates", "conditioning"])
def test_both_samplers_are_exact(
    multiroot: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sherman-Morrison updates of the inverse Laplacian (the default, O(N^3) per sample)
    and the recomputed marginals (the fallback for ill-conditioned items, O(N^4)) both match
    the enumerated distribution, with variable lengths (issue 37.3.12)."""
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 5, 5, dtype=torch.float64, generator=gen) * 1.5
    lengths = torch.tensor([5, 4])
    calls: list[int] = []
    conditioning = nonprojective._sample_by_conditioning

    def counted(scores: Tensor, *args: object) -> Tensor:
        calls.append(len(scores))
        return conditioning(scores, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(nonprojective, "_sample_by_conditioning", counted)
    if path == "conditioning":  # no item is trusted to the updates
        monkeypatch.setattr(nonprojective, "_MAX_COND_DEFAULT", 0.0)
    n = 3000
    samples = NonProjectiveDependencyCRF(scores, lengths, multiroot).sample(n)
    assert calls == ([] if path == "updates" else [2 * n])
    for b, length in enumerate(lengths.tolist()):
        ref = enumerate_item(scores[b, :length, :length], multiroot)
        counts = Counter(tuple(row[1:length].tolist()) for row in samples[:, b])
        assert set(counts) <= set(ref.support)
        freq = torch.tensor([counts[t] / n for t in ref.support], dtype=torch.float64)
        assert 0.5 * (freq - ref.probs).abs().sum() < 0.05
        assert (samples[:, b, length:] == -1).all()


def test_sampler_at_hundreds_of_words_gives_trees() -> None:
    """N = 300: every sample a tree, drawn by the updates alone (the conditioning sampler
    took minutes at N = 500)."""
    torch.manual_seed(0)
    scores = torch.randn(2, 300, 300)
    for multiroot in (True, False):
        samples = NonProjectiveDependencyCRF(scores, multiroot=multiroot).sample(1)
        assert is_tree(samples[0], torch.full((2,), 300), multiroot).all()


# ---- padding, degenerate sizes, items with no tree ------------------------------------------
@MULTIROOT
def test_padding_invariance(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 7, 7, dtype=torch.float64, generator=gen)
    lengths = torch.tensor([7, 2, 5, 3])
    for b, length in enumerate(lengths.tolist()):  # junk in the padding must not matter
        scores[b, length:, :] = 1e4
        scores[b, :, length:] = NEG_INF
    dist = NonProjectiveDependencyCRF(scores, lengths, multiroot)
    for b, length in enumerate(lengths.tolist()):
        alone = NonProjectiveDependencyCRF(scores[b : b + 1, :length, :length], None, multiroot)
        torch.testing.assert_close(dist.log_partition[b], alone.log_partition[0])
        torch.testing.assert_close(dist.entropy[b], alone.entropy[0])
        torch.testing.assert_close(dist.max_score[b], alone.max_score[0])
        torch.testing.assert_close(dist.marginals[b, :length, :length], alone.marginals[0])
        assert (dist.marginals[b, length:] == 0).all() and (
            dist.marginals[b, :, length:] == 0
        ).all()
        assert dist.argmax[b, :length].tolist() == alone.argmax[0].tolist()
        assert (dist.argmax[b, length:] == -1).all()
    torch.testing.assert_close(dist.log_prob(dist.argmax), dist.max_score - dist.log_partition)


@MULTIROOT
def test_one_word(multiroot: bool) -> None:
    scores = torch.tensor([[[0.0, 1.5], [0.3, 2.0]]], dtype=torch.float64, requires_grad=True)
    dist = NonProjectiveDependencyCRF(scores, multiroot=multiroot)
    torch.testing.assert_close(dist.log_partition, torch.tensor([1.5], dtype=torch.float64))
    expected = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    torch.testing.assert_close(dist.marginals, expected)
    assert dist.argmax.tolist() == [[-1, 0]] and dist.sample(3).tolist() == [[[-1, 0]]] * 3
    torch.testing.assert_close(dist.entropy, torch.zeros(1, dtype=torch.float64))


@MULTIROOT
def test_no_valid_tree(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(4, 5, 5, dtype=torch.float64, generator=gen)
    scores[0, :, 2] = NEG_INF  # word 2 has no possible head
    scores[1, 0, 1:3] = NEG_INF  # words 1 and 2 may only head each other: a cycle
    scores[1, 3:, 1:3] = NEG_INF
    scores[2, 1:, 1:] = NEG_INF  # every word hangs from ROOT: a tree only with many roots
    scores = scores.requires_grad_(True)
    dist = NonProjectiveDependencyCRF(scores, multiroot=multiroot)
    invalid = [0, 1] if multiroot else [0, 1, 2]
    valid = [b for b in range(4) if b not in invalid]
    logz = dist.log_partition
    assert torch.isneginf(logz[invalid]).all() and torch.isfinite(logz[valid]).all()
    assert (dist.marginals[invalid] == 0).all() and (dist.entropy[invalid] == 0).all()
    assert torch.isneginf(dist.max_score[invalid]).all() and (dist.argmax[invalid] == -1).all()
    assert (dist.sample(5)[:, invalid] == -1).all()
    assert torch.isneginf(dist.log_prob(dist.argmax)[invalid]).all()
    for b in valid:  # the other items are unaffected
        alone = NonProjectiveDependencyCRF(scores[b : b + 1].detach(), multiroot=multiroot)
        torch.testing.assert_close(logz[b], alone.log_partition[0])
        torch.testing.assert_close(dist.marginals[b], alone.marginals[0])
    loss = logz[valid].sum() + (dist.marginals**2).sum() + dist.entropy.sum()
    (grad,) = torch.autograd.grad(loss, scores)
    assert torch.isfinite(grad).all() and (grad[invalid] == 0).all()


# ---- gradients --------------------------------------------------------------------------------
def _check_derivatives(scores: Tensor, lengths: Tensor, multiroot: bool) -> None:
    """gradcheck / gradgradcheck of log Z and of the marginals (float64 ``scores``)."""
    scores = scores.clone().requires_grad_(True)

    def log_partition(x: Tensor) -> Tensor:
        return NonProjectiveDependencyCRF(x, lengths, multiroot).log_partition

    def marginals(x: Tensor) -> Tensor:
        return NonProjectiveDependencyCRF(x, lengths, multiroot).marginals

    assert gradcheck(log_partition, (scores,))
    assert gradgradcheck(log_partition, (scores,))
    assert gradcheck(marginals, (scores,))
    # third derivatives of log Z: a random projection (fast mode) keeps this quick
    assert gradgradcheck(marginals, (scores,), fast_mode=True)


@MULTIROOT
def test_gradcheck(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 4, 4, dtype=torch.float64, generator=gen)
    scores[0, 2, 3] = NEG_INF  # a forbidden arc that leaves trees
    _check_derivatives(scores, torch.tensor([4, 3]), multiroot)


@MULTIROOT
def test_gradcheck_with_an_item_on_the_fallback(multiroot: bool) -> None:
    # item 1's scores span ~60 nats per column: ill-conditioned for the LU path in float64,
    # so it is recomputed by the exact elimination while item 0 stays on the LU path
    gen = torch.Generator().manual_seed(17)
    scores = torch.randn(2, 4, 4, dtype=torch.float64, generator=gen)
    scores[1, 0, 1:] -= 60.0
    lengths = torch.tensor([4, 4])
    assert _lu_items(scores, lengths, multiroot).tolist() == [True, False]
    _check_derivatives(scores, lengths, multiroot)


def test_log_partition_can_be_modified_in_place() -> None:
    scores = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    dist = NonProjectiveDependencyCRF(scores)
    logz = dist.log_partition
    expected = logz.detach() + 1.0
    logz.add_(1.0)  # an output, not a view of an internal tensor
    torch.testing.assert_close(logz.detach(), expected)
    logz.sum().backward()
    assert scores.grad is not None
    torch.testing.assert_close(scores.grad, dist.marginals.detach())  # d log Z = marginals


# ---- numerical stability ----------------------------------------------------------------------
@MULTIROOT
def test_float32_huge_scores(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    scores = torch.randn(4, 9, 9, generator=gen) * 1e4
    scores[3] = chain_kept(scores[3], 0.5, gen)
    scores.requires_grad_(True)
    dist = NonProjectiveDependencyCRF(scores, multiroot=multiroot)
    logz, marginals = dist.log_partition, dist.marginals
    assert logz.dtype == torch.float32 and torch.isfinite(logz).all()
    assert torch.isfinite(marginals).all() and torch.isfinite(dist.entropy).all()
    torch.testing.assert_close(marginals.sum(1)[:, 1:], torch.ones(4, 8))
    # max_score <= log Z <= max_score + log(number of trees), up to float32 rounding
    gap, slack = logz - dist.max_score, 1e-6 * dist.max_score.abs()
    assert (gap >= -slack).all()
    assert (gap <= math.log(count_nonprojective(8, multiroot)) + slack).all()
    reference = NonProjectiveDependencyCRF(scores.detach().double(), multiroot=multiroot)
    torch.testing.assert_close(logz.double(), reference.log_partition, rtol=1e-6, atol=0.0)
    weights = torch.randn(marginals.shape, generator=gen)
    (grad,) = torch.autograd.grad(logz.sum() + (marginals * weights).sum(), scores)
    assert torch.isfinite(grad).all()
    samples = dist.sample(4)
    assert is_tree(samples.reshape(16, 9), torch.full((16,), 9), multiroot).all()


@MULTIROOT
def test_float32_neg_inf_arcs_match_enumeration(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(3, 6, 6, dtype=torch.float64, generator=gen) * 3
    for b in range(3):
        scores[b] = chain_kept(scores[b], 0.6, gen)
    single = scores.float().requires_grad_(True)
    dist = NonProjectiveDependencyCRF(single, multiroot=multiroot)
    (grad,) = torch.autograd.grad(dist.log_partition.sum() + dist.entropy.sum(), single)
    assert torch.isfinite(grad).all()
    for b in range(3):
        ref = enumerate_item(scores[b], multiroot)
        logz, marginals = dist.log_partition[b].double(), dist.marginals[b].double()
        torch.testing.assert_close(logz, ref.log_partition, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(marginals, ref.marginals, rtol=0, atol=1e-5)
        assert dist.argmax[b].tolist() == ref.argmax


# ---- the LU fast path and the exact elimination agree ---------------------------------------
def _by_elimination(scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
    """log Z [B] by the exact log-space elimination alone (the fallback path)."""
    batch, size, _ = scores.shape
    real = nonprojective.length_mask(lengths, batch, size, scores.device)
    return nonprojective._eliminate(scores, real, multiroot)


def _lu_items(scores: Tensor, lengths: Tensor | None, multiroot: bool) -> Tensor:
    """BoolTensor [B]: the items that the LU fast path keeps (not sent to the fallback)."""
    batch, size, _ = scores.shape
    real = None if lengths is None else nonprojective.length_mask(lengths, batch, size, "cpu")
    limit = nonprojective._MAX_COND.get(scores.dtype, nonprojective._MAX_COND_DEFAULT)
    keep = nonprojective._lu_path(scores, real, multiroot, limit)[3]
    return torch.ones(batch, dtype=torch.bool) if keep is None else keep


def _first_and_second_order(
    fn: Callable[..., torch.Tensor],
    scores: torch.Tensor,
    lengths: torch.Tensor | None,
    multiroot: bool,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log Z, marginals and the gradient of (marginals * weights).sum() by ``fn``."""
    x = scores.clone().requires_grad_(True)
    logz = fn(x, lengths, multiroot)
    (marginals,) = torch.autograd.grad(logz.sum(), x, create_graph=True)
    (second,) = torch.autograd.grad((marginals * weights).sum(), x)
    return logz.detach(), marginals.detach(), second


@MULTIROOT
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_lu_path_matches_elimination_to_second_order(multiroot: bool, padded: bool) -> None:
    gen = torch.Generator().manual_seed(14)
    batch, size = 6, 15
    scores = torch.randn(batch, size, size, dtype=torch.float64, generator=gen) * 2
    scores[1] = chain_kept(scores[1], 0.5, gen)  # -inf arcs, still well conditioned
    lengths = torch.tensor([15, 9, 2, 15, 3, 12]) if padded else None
    assert _lu_items(scores, lengths, multiroot).all()  # all on the fast path
    weights = torch.randn(batch, size, size, dtype=torch.float64, generator=gen)
    results = [
        _first_and_second_order(fn, scores, lengths, multiroot, weights)
        for fn in (nonprojective.matrix_tree_log_partition, _by_elimination)
    ]
    for fast, exact in zip(*results, strict=True):
        torch.testing.assert_close(fast, exact, rtol=0, atol=1e-10)


@MULTIROOT
def test_lu_path_float32_matches_float64(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(15)
    scores = torch.randn(8, 40, 40, dtype=torch.float64, generator=gen)
    weights = torch.randn(8, 40, 40, dtype=torch.float64, generator=gen)
    lengths = torch.randint(20, 41, (8,), generator=gen)
    results = []
    for dtype in (torch.float32, torch.float64):
        x = scores.to(dtype).requires_grad_(True)
        dist = NonProjectiveDependencyCRF(x, lengths, multiroot)
        (second,) = torch.autograd.grad((dist.marginals * weights.to(dtype)).sum(), x)
        results.append((dist.log_partition.double(), dist.marginals.double(), second.double()))
    (logz32, marg32, grad32), (logz64, marg64, grad64) = results
    torch.testing.assert_close(logz32, logz64, rtol=1e-6, atol=0)
    torch.testing.assert_close(marg32, marg64, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad32, grad64, rtol=0, atol=1e-5 * float(grad64.abs().max()))


@MULTIROOT
def test_float32_second_order_of_ill_conditioned_items(
    multiroot: bool, kernel_backend: str
) -> None:
    """Items kept on the LU path although ill-conditioned (two cycles of best heads 14 above
    the other arcs: condition numbers around 1e6; float32 matmuls were 2e-2 off) get the
    backward of a loss on the marginals in float64: within 1e-5 of the float64 gradient,
    next to well-conditioned items of the same batch."""
    gen = torch.Generator().manual_seed(16)
    scores = torch.randn(6, 20, 20, dtype=torch.float64, generator=gen)
    scores[:3, 1, 2] = scores[:3, 2, 1] = 14.0
    scores[:3, 3, 4] = scores[:3, 4, 3] = 14.0
    weights = torch.randn(6, 20, 20, dtype=torch.float64, generator=gen)
    cond = nonprojective._lu_operations(scores, None, multiroot, 1e7, False)[4]
    assert bool((cond[:3] > 1e5).all() & (cond[:3] < 5e6).all() & (cond[3:] < 1e3).all())
    grads = []
    for dtype in (torch.float32, torch.float64):
        x = scores.to(dtype).requires_grad_(True)
        dist = NonProjectiveDependencyCRF(x, multiroot=multiroot)
        (second,) = torch.autograd.grad((dist.marginals * weights.to(dtype)).sum(), x)
        grads.append(second.double())
    scale = grads[1].abs().amax(dim=(1, 2), keepdim=True)
    torch.testing.assert_close(grads[0] / scale, grads[1] / scale, rtol=0, atol=1e-5)


@MULTIROOT
def test_ill_conditioned_items_fall_back_per_item(multiroot: bool) -> None:
    """A batch mixing well- and ill-conditioned items and items with no tree: each item's
    log Z, marginals and second-order gradient are those of the exact elimination."""
    gen = torch.Generator().manual_seed(16)
    batch, size = 5, 9
    scores = torch.randn(batch, size, size, dtype=torch.float64, generator=gen)
    scores[1] *= 300.0  # huge score range (on either path, depending on the best heads)
    scores[2, :, 4] = NEG_INF  # word 4 has no head: no tree
    scores[3, 0, 1:] -= 60.0  # ROOT arcs e^-60 below the others: ill-conditioned
    lengths = torch.tensor([9, 9, 9, 7, 5])
    lu = _lu_items(scores, lengths, multiroot)
    assert lu[[0, 4]].all() and not lu[[2, 3]].any()
    weights = torch.randn(batch, size, size, dtype=torch.float64, generator=gen)
    results = [
        _first_and_second_order(fn, scores, lengths, multiroot, weights)
        for fn in (nonprojective.matrix_tree_log_partition, _by_elimination)
    ]
    assert torch.isneginf(results[0][0][2]) and torch.isfinite(results[0][0][[0, 1, 3, 4]]).all()
    for fast, exact in zip(*results, strict=True):
        torch.testing.assert_close(fast, exact, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(results[0][1]).all() and torch.isfinite(results[0][2]).all()
    # the direct marginals (closed form per LU item, elimination for the others) agree too
    x = scores.clone().requires_grad_(True)
    direct = nonprojective.matrix_tree_marginals(x, lengths, multiroot, create_graph=True)
    (second,) = torch.autograd.grad((direct * weights).sum(), x)
    torch.testing.assert_close(direct.detach(), results[1][1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second, results[1][2], rtol=1e-12, atol=1e-12)
    plain = nonprojective.matrix_tree_marginals(scores, lengths, multiroot)
    assert not plain.requires_grad
    torch.testing.assert_close(plain, results[1][1], rtol=1e-12, atol=1e-12)


# ---- beyond enumeration: dense determinant and root-by-root MAP ----------------------------
@MULTIROOT
def test_matches_dense_determinant(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    size = 12
    scores = torch.randn(3, size, size, dtype=torch.float64, generator=gen)
    # heads only left of their modifiers: the word graph is a DAG, word 1 must be the root
    # child, and the elimination has to be relabelled to avoid a zero pivot
    scores[1] = scores[1].masked_fill(~torch.ones(size, size, dtype=torch.bool).triu(1), NEG_INF)
    scores[2] = chain_kept(scores[2], 0.6, gen)
    dist = NonProjectiveDependencyCRF(scores, multiroot=multiroot)
    torch.testing.assert_close(dist.log_partition, koo_log_det(scores, multiroot))


def test_single_root_argmax_matches_root_by_root_search() -> None:
    gen = torch.Generator().manual_seed(12)
    batch, size = 16, 11
    scores = torch.randn(batch, size, size, dtype=torch.float64, generator=gen)
    for b in range(0, batch, 2):
        scores[b] = chain_kept(scores[b], 0.5, gen)
    lengths = torch.randint(2, size + 1, (batch,), generator=gen)
    dist = NonProjectiveDependencyCRF(scores, lengths, multiroot=False)
    assert is_tree(dist.argmax, lengths, multiroot=False).all()
    # best over r of the multi-root MAP with ROOT -> r as the only root arc
    best = torch.full((batch,), NEG_INF, dtype=torch.float64)
    for r in range(1, size):
        only = scores.clone()
        only[:, 0, :r] = NEG_INF
        only[:, 0, r + 1 :] = NEG_INF
        best = torch.maximum(best, NonProjectiveDependencyCRF(only, lengths).max_score)
    torch.testing.assert_close(dist.max_score, best)


@MULTIROOT
def test_argmax_beats_samples_and_single_head_changes(multiroot: bool) -> None:
    gen = torch.Generator().manual_seed(13)
    size = 10
    scores = torch.randn(1, size, size, dtype=torch.float64, generator=gen)
    dist = NonProjectiveDependencyCRF(scores, multiroot=multiroot)
    best = dist.log_prob(dist.argmax)  # [1]
    samples = dist.sample(20)  # [n, 1, N]
    assert all((dist.log_prob(s) <= best + 1e-9).all() for s in samples)
    # every tree one head away from the MAP scores no higher
    heads = dist.argmax[0]
    moves = heads.repeat(size * size, 1)  # [N * N, N]: move m gets head h
    moves[torch.arange(size * size), torch.arange(size * size) % size] = torch.arange(
        size * size
    ).div(size, rounding_mode="floor")
    moves = moves[is_tree(moves, torch.full((size * size,), size), multiroot)]  # [K, N]
    assert len(moves) > size
    around = NonProjectiveDependencyCRF(scores.expand(len(moves), size, size), multiroot=multiroot)
    assert (around.log_prob(moves) <= best + 1e-9).all()


@MULTIROOT
def test_argmax_of_a_batch_is_that_of_each_item_alone(multiroot: bool) -> None:
    # items finish their contraction rounds at different times and leave the working batch
    gen = torch.Generator().manual_seed(16)
    batch, size = 12, 30
    scores = torch.randn(batch, size, size, generator=gen) * 3
    scores[3] = chain_kept(scores[3], 0.3, gen)  # -inf arcs
    scores[5, :, 7] = NEG_INF  # word 7 has no head: no tree
    lengths = torch.randint(2, size + 1, (batch,), generator=gen)
    lengths[0] = lengths[5] = size
    heads = nonprojective.chu_liu_edmonds(scores, lengths, multiroot)
    for b in range(batch):
        alone = nonprojective.chu_liu_edmonds(scores[b : b + 1], lengths[b : b + 1], multiroot)
        assert torch.equal(heads[b : b + 1], alone), b
    assert (heads[5] == -1).all()
    has_tree = heads[:, 1] >= 0
    assert has_tree.sum() == batch - 1
    assert is_tree(heads[has_tree], lengths[has_tree], multiroot).all()


# ---- API ----------------------------------------------------------------------------------------
def test_validation_errors() -> None:
    good = torch.randn(2, 4, 4)
    with pytest.raises(ValueError):
        NonProjectiveDependencyCRF(torch.randn(4, 4))  # wrong rank
    with pytest.raises(ValueError):
        NonProjectiveDependencyCRF(torch.zeros(2, 4, 4, dtype=torch.long))  # not floating
    with pytest.raises(ValueError):
        NonProjectiveDependencyCRF(torch.full((2, 4, 4), float("nan")))
    with pytest.raises(ValueError):
        NonProjectiveDependencyCRF(torch.randn(2, 4, 3))  # not square
    for bad in ([1, 4], [2, 5]):
        with pytest.raises(ValueError):
            NonProjectiveDependencyCRF(good, torch.tensor(bad))
    with pytest.raises(ValueError):
        NonProjectiveDependencyCRF(good).sample(0)


def test_only_log_semiring() -> None:
    dist = NonProjectiveDependencyCRF(torch.randn(1, 3, 3))
    with pytest.raises(NotImplementedError, match="semiring"):
        dist._inside(MaxSemiring, dist._parts(dist.arc_scores), None)


def test_inference_mode_and_no_grad() -> None:
    scores = torch.randn(2, 5, 5)
    with torch.inference_mode():
        dist = NonProjectiveDependencyCRF(scores)
        marginals, samples = dist.marginals, dist.sample(2)
    torch.testing.assert_close(marginals.sum(1)[:, 1:], torch.ones(2, 4))
    assert is_tree(samples.reshape(4, 5), torch.full((4,), 5), True).all()


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(2, 7),
    batch=st.integers(1, 3),
    multiroot=st.booleans(),
    scale=st.sampled_from([0.1, 1.0, 10.0, 1e3]),
    neg_inf=st.floats(0.0, 0.7),
    seed=st.integers(0, 2**31 - 1),
)
def test_properties(
    size: int, batch: int, multiroot: bool, scale: float, neg_inf: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, size, size, dtype=torch.float64, generator=gen) * scale
    scores = scores.masked_fill(torch.rand(scores.shape, generator=gen) < neg_inf, NEG_INF)
    lengths = torch.randint(2, size + 1, (batch,), generator=gen)
    dist = NonProjectiveDependencyCRF(scores, lengths, multiroot)
    logz, marginals, argmax = dist.log_partition, dist.marginals, dist.argmax
    ok = torch.isfinite(logz)
    assert not torch.isnan(logz).any() and not torch.isnan(marginals).any()
    words = (torch.arange(size) >= 1) & (torch.arange(size) < lengths[:, None])  # [B, N]
    sums = marginals.sum(1)  # [B, N]
    torch.testing.assert_close(sums[ok] * words[ok], words[ok].double())
    assert (marginals[~ok] == 0).all() and (marginals[:, :, 0] == 0).all()
    assert (torch.isfinite(dist.max_score) == ok).all()
    assert (logz[ok] >= dist.max_score[ok] - 1e-9 * dist.max_score[ok].abs().clamp(min=1)).all()
    assert is_tree(argmax[ok], lengths[ok], multiroot).all() and (argmax[~ok] == -1).all()
    entropy = dist.entropy[ok]
    counts = torch.tensor([count_nonprojective(n - 1, multiroot) for n in lengths[ok].tolist()])
    assert (entropy >= -1e-6).all() and (entropy <= counts.double().log() + 1e-6).all()
