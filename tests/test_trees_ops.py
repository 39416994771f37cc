"""Operations on the dependency-tree CRFs (#41): k best trees (projective and non-projective),
labelled trees ([B, N, N, L] arc scores), against brute-force enumeration in float64."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from oracles import count_nonprojective, count_projective, trees
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck

from structattn.distributions import (
    DependencyCRF,
    NonProjectiveDependencyCRF,
    SecondOrderDependencyCRF,
)
from structattn.distributions.dependency import LabelledHeads, TreeCRFBase
from structattn.semirings import LogSemiring
from structattn.structs.second_order import second_order_inside, second_order_log_partition

NEG_INF = float("-inf")
CLASSES = pytest.mark.parametrize(
    "cls", [DependencyCRF, NonProjectiveDependencyCRF], ids=["projective", "non-projective"]
)
MULTIROOT = pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])


def _projective(cls: type[TreeCRFBase]) -> bool:
    return cls is DependencyCRF


def all_trees(cls: type[TreeCRFBase], n_words: int, multiroot: bool) -> list[tuple[int, ...]]:
    return list(trees(n_words, _projective(cls), multiroot))


def score_of(scores: Tensor, heads: tuple[int, ...]) -> float:
    """scores [N, N]: the tree's score (a float, -inf if it uses a -inf arc)."""
    return float(sum(float(scores[h, m]) for m, h in enumerate(heads, start=1)))


def labelled_support(
    scores: Tensor, support: list[tuple[int, ...]]
) -> list[tuple[tuple[int, ...], tuple[int, ...], float]]:
    """scores [N, N, L]: every (heads, labels, score) over the trees of ``support``."""
    n_labels = scores.shape[-1]
    out = []
    for heads in support:
        for labels in itertools.product(range(n_labels), repeat=len(heads)):
            value = sum(
                float(scores[h, m, lab])
                for m, (h, lab) in enumerate(zip(heads, labels, strict=True), 1)
            )
            out.append((heads, labels, value))
    return out


def tree_of(heads: Tensor, length: int) -> tuple[int, ...]:
    return tuple(int(h) for h in heads[1:length])


# ---- k best trees ---------------------------------------------------------------------------
@CLASSES
@MULTIROOT
@pytest.mark.parametrize("n_words", [1, 2, 3, 4, 5])
def test_topk_against_enumeration(cls: type[TreeCRFBase], multiroot: bool, n_words: int) -> None:
    """Scores equal the sorted enumeration, trees are distinct and valid and score what is
    claimed, and the ranks beyond the number of trees are -inf with heads -1 (k > count)."""
    gen = torch.Generator().manual_seed(n_words + 10 * multiroot)
    size = n_words + 1  # item 1 is padded by one position (when it can be)
    scores = torch.randn(2, size, size, dtype=torch.float64, generator=gen) * 2
    lengths = torch.tensor([size, max(size - 1, 2)])
    dist = cls(scores, lengths=lengths, multiroot=multiroot)
    k = len(all_trees(cls, n_words, multiroot)) + 3
    top_scores, heads = dist.topk(k)
    assert top_scores.shape == (k, 2) and heads.shape == (k, 2, size)
    for b, length in enumerate(lengths.tolist()):
        support = all_trees(cls, length - 1, multiroot)
        count = (count_projective if _projective(cls) else count_nonprojective)(
            length - 1, multiroot
        )
        assert len(support) == count
        ref = sorted((score_of(scores[b], t) for t in support), reverse=True)
        torch.testing.assert_close(top_scores[:count, b], torch.tensor(ref, dtype=torch.float64))
        found = [tree_of(heads[r, b], length) for r in range(count)]
        assert len(set(found)) == count and set(found) == set(support)
        for r, t in enumerate(found):
            assert heads[r, b, 0] == -1 and (heads[r, b, length:] == -1).all()
            assert score_of(scores[b], t) == pytest.approx(float(top_scores[r, b]))
        assert torch.isneginf(top_scores[count:, b]).all()
        assert (heads[count:, b] == -1).all()
    torch.testing.assert_close(top_scores[0], dist.max_score)


@CLASSES
@MULTIROOT
def test_topk_first_is_argmax_with_ties(cls: type[TreeCRFBase], multiroot: bool) -> None:
    """Integer potentials (many tied trees): rank 0 is exactly argmax, for several seeds and
    labelled trees too."""
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        scores = torch.randint(0, 2, (3, 6, 6), generator=gen).double()
        dist = cls(scores, lengths=torch.tensor([6, 5, 3]), multiroot=multiroot)
        top_scores, heads = dist.topk(4)
        assert torch.equal(heads[0], dist.argmax), seed
        torch.testing.assert_close(top_scores[0], dist.max_score)
        labelled = torch.randint(0, 2, (2, 5, 5, 3), generator=gen).double()
        ldist = cls(labelled, multiroot=multiroot)
        _, best = ldist.topk(3)
        assert torch.equal(best.heads[0], ldist.argmax.heads), seed
        assert torch.equal(best.labels[0], ldist.argmax.labels), seed


@CLASSES
def test_topk_with_forbidden_arcs(cls: type[TreeCRFBase]) -> None:
    """-inf arcs leave only the trees without them: exactly those are listed, then -inf."""
    scores = torch.zeros(1, 4, 4, dtype=torch.float64)
    scores[0, 0, 2] = scores[0, 0, 3] = NEG_INF  # only word 1 may attach to ROOT
    scores[0, 2, 1] = scores[0, 3, 1] = NEG_INF
    support = [
        t
        for t in all_trees(cls, 3, True)
        if all(not (h == 0 and m != 1) and not (m == 1 and h != 0) for m, h in enumerate(t, 1))
    ]
    top_scores, heads = cls(scores).topk(len(support) + 2)
    assert (top_scores[: len(support)] == 0).all()
    assert torch.isneginf(top_scores[len(support) :]).all()
    assert {tree_of(h, 4) for h in heads[: len(support), 0]} == set(support)
    none = scores.clone()
    none[0, :, 3] = NEG_INF  # word 3 has no head: no tree at all
    top_scores, heads = cls(none).topk(2)
    assert torch.isneginf(top_scores).all() and (heads == -1).all()


@CLASSES
def test_topk_scores_gradient_is_indicators(cls: type[TreeCRFBase]) -> None:
    scores = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    top_scores, heads = cls(scores).topk(3)
    (grad,) = torch.autograd.grad(top_scores[1].sum(), scores)
    expected = torch.zeros(2, 5, 5, dtype=torch.float64)
    for b in range(2):
        for m in range(1, 5):
            expected[b, heads[1, b, m], m] = 1.0
    torch.testing.assert_close(grad, expected)


@CLASSES
def test_topk_float32_large_scores(cls: type[TreeCRFBase]) -> None:
    scores = torch.randn(2, 6, 6) * 1e4
    top_scores, heads = cls(scores).topk(3)
    assert torch.isfinite(top_scores).all()
    assert (top_scores[:-1] >= top_scores[1:]).all()
    assert torch.equal(heads[0], cls(scores).argmax)


def test_topk_bad_k() -> None:
    dist = DependencyCRF(torch.randn(1, 3, 3))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="`k`"):
            dist.topk(bad)  # type: ignore[arg-type]


# ---- labelled trees -------------------------------------------------------------------------
@CLASSES
@MULTIROOT
@pytest.mark.parametrize("n_words", [1, 2, 3])
def test_labelled_against_enumeration(
    cls: type[TreeCRFBase], multiroot: bool, n_words: int
) -> None:
    """log Z, per-label marginals, entropy, max score, argmax, log_prob and k best over every
    (tree, labelling), with one item padded."""
    gen = torch.Generator().manual_seed(7 * n_words + multiroot)
    size, n_labels = n_words + 2, 3
    scores = torch.randn(2, size, size, n_labels, dtype=torch.float64, generator=gen)
    scores[0, 1, 2, 0] = NEG_INF  # a forbidden label
    lengths = torch.tensor([size, size - 1])
    dist = cls(scores, lengths=lengths, multiroot=multiroot)
    assert dist.marginals.shape == (2, size, size, n_labels)
    best = dist.argmax
    assert isinstance(best, LabelledHeads)
    k = 5
    top_scores, top = dist.topk(k)
    for b, length in enumerate(lengths.tolist()):
        support = labelled_support(scores[b], all_trees(cls, length - 1, multiroot))
        values = torch.tensor([v for _, _, v in support], dtype=torch.float64)
        logz = torch.logsumexp(values, 0)
        probs = (values - logz).exp()
        torch.testing.assert_close(dist.log_partition[b], logz)
        marginals = torch.zeros(size, size, n_labels, dtype=torch.float64)
        for (heads, labels, _), p in zip(support, probs, strict=True):
            for m, (h, lab) in enumerate(zip(heads, labels, strict=True), 1):
                marginals[h, m, lab] += p
        torch.testing.assert_close(dist.marginals[b], marginals)
        torch.testing.assert_close(dist.arc_marginals[b], marginals.sum(-1))
        finite = probs > 0
        entropy = -(probs[finite] * probs[finite].log()).sum()
        torch.testing.assert_close(dist.entropy[b], entropy)
        torch.testing.assert_close(dist.max_score[b], values.max())
        arg = (tree_of(best.heads[b], length), tree_of(best.labels[b], length))
        assert support[int(values.argmax())][2] == pytest.approx(float(values.max()))
        assert any(s[:2] == arg and s[2] == pytest.approx(float(values.max())) for s in support)
        ref = values.sort(descending=True).values[:k]
        torch.testing.assert_close(top_scores[: len(ref), b], ref)
        found = {
            (tree_of(top.heads[r, b], length), tree_of(top.labels[r, b], length))
            for r in range(len(ref))
        }
        assert len(found) == len(ref)
        assert torch.isneginf(top_scores[len(ref) :, b]).all()  # k > number of labelled trees
        assert (top.heads[len(ref) :, b] == -1).all() and (top.labels[len(ref) :, b] == -1).all()
    torch.testing.assert_close(
        dist.log_prob(best.heads, best.labels), dist.max_score - dist.log_partition
    )
    torch.testing.assert_close(dist.log_prob(best), dist.log_prob(*best))


@CLASSES
def test_labelled_one_label_equals_unlabelled(cls: type[TreeCRFBase]) -> None:
    scores = torch.randn(2, 5, 5, dtype=torch.float64)
    lengths = torch.tensor([5, 3])
    plain = cls(scores, lengths=lengths)
    labelled = cls(scores.unsqueeze(-1), lengths=lengths)
    torch.testing.assert_close(labelled.log_partition, plain.log_partition)
    torch.testing.assert_close(labelled.marginals[..., 0], plain.marginals)
    torch.testing.assert_close(labelled.entropy, plain.entropy)
    assert torch.equal(labelled.argmax.heads, plain.argmax)
    assert ((labelled.argmax.labels == 0) == (plain.argmax >= 0)).all()


@CLASSES
def test_labelled_samples_match_probabilities(cls: type[TreeCRFBase]) -> None:
    """Frequencies of 4000 samples over the 2 * 3^2 * trees labelled trees of 2 words."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(1, 3, 3, 2, dtype=torch.float64, generator=gen)
    dist = cls(scores)
    n = 4000
    sample = dist.sample(n)
    assert isinstance(sample, LabelledHeads) and sample.heads.shape == (n, 1, 3)
    counts = Counter(
        (tuple(h[0].tolist()), tuple(lab[0].tolist()))
        for h, lab in zip(sample.heads, sample.labels, strict=True)
    )
    for (heads, labels), count in counts.items():
        value = dist.log_prob(
            torch.tensor([heads]), torch.tensor([labels])
        ).exp()  # a sampled structure has positive probability
        assert float(value) > 0
        assert abs(count / n - float(value)) < 4 * (float(value) / n) ** 0.5 + 1e-3


@CLASSES
def test_labelled_gradients(cls: type[TreeCRFBase]) -> None:
    scores = torch.randn(2, 4, 4, 2, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([4, 3])
    gradcheck(lambda s: cls(s, lengths=lengths).log_partition, (scores,))
    gradcheck(lambda s: cls(s, lengths=lengths).marginals, (scores,))
    gradcheck(lambda s: cls(s, lengths=lengths).entropy, (scores,))
    dist = cls(scores, lengths=lengths)
    (grad,) = torch.autograd.grad(dist.max_score.sum(), scores)
    best = dist.argmax
    expected = torch.zeros_like(scores)
    for b, length in enumerate(lengths.tolist()):
        for m in range(1, length):
            expected[b, best.heads[b, m], m, best.labels[b, m]] = 1.0
    torch.testing.assert_close(grad, expected)
    # d log Z / d scores = the labelled marginals
    (grad,) = torch.autograd.grad(cls(scores, lengths=lengths).log_partition.sum(), scores)
    torch.testing.assert_close(grad, cls(scores, lengths=lengths).marginals.detach())


@CLASSES
def test_labelled_float32_stability(cls: type[TreeCRFBase]) -> None:
    scores = torch.randn(2, 5, 5, 3) * 1e4
    scores[:, :, :, 1] = NEG_INF  # one label never allowed
    dist = cls(scores)
    assert torch.isfinite(dist.log_partition).all()
    assert torch.isfinite(dist.marginals).all() and (dist.marginals[..., 1] == 0).all()
    assert torch.isfinite(dist.entropy).all()
    assert (dist.argmax.labels[:, 1:] != 1).all()


@CLASSES
def test_labelled_errors(cls: type[TreeCRFBase]) -> None:
    dist = cls(torch.randn(1, 4, 4, 2))
    heads = torch.tensor([[-1, 0, 1, 2]])
    with pytest.raises(ValueError, match="`heads` and `labels`"):
        dist.log_prob(heads)
    with pytest.raises(ValueError, match="`labels` must lie in"):
        dist.log_prob(heads, torch.tensor([[-1, 0, 2, 0]]))
    with pytest.raises(ValueError, match="`labels` must be an integer"):
        dist.log_prob(heads, torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\[B, N, N, L\]"):
        cls(torch.randn(1, 4, 4, 0))
    with pytest.raises(ValueError, match="`arc_scores`"):
        cls(torch.randn(1, 4, 3, 2))
    cycle = torch.tensor([[-1, 2, 1, 2]])
    assert torch.isneginf(dist.log_prob(cycle, torch.zeros(1, 4, dtype=torch.long)))


# ---- second-order (adjacent sibling) trees ---------------------------------------------------
def sibling_triples(heads: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(h, m, s) for every adjacent pair of children s, m of h on one side, s nearer h."""
    full = (-1, *heads)
    out = []
    for h in range(len(full)):
        right = [m for m in range(1, len(full)) if full[m] == h and m > h]
        left = [m for m in range(len(full) - 1, 0, -1) if full[m] == h and m < h]
        for side in (right, left):
            out += [(h, outer, inner) for inner, outer in zip(side, side[1:], strict=False)]
    return out


def second_order_score(arcs: Tensor, sibs: Tensor, heads: tuple[int, ...]) -> Tensor:
    total = sum(arcs[h, m] for m, h in enumerate(heads, 1))
    return total + sum((sibs[t] for t in sibling_triples(heads)), torch.zeros((), dtype=arcs.dtype))


@MULTIROOT
@pytest.mark.parametrize("n_words", [1, 2, 3, 4, 5])
def test_second_order_against_enumeration(multiroot: bool, n_words: int) -> None:
    gen = torch.Generator().manual_seed(n_words + 20 * multiroot)
    size = n_words + 1
    arcs = torch.randn(3, size, size, dtype=torch.float64, generator=gen)
    sibs = torch.randn(3, size, size, size, dtype=torch.float64, generator=gen)
    sibs[2] = sibs[2].masked_fill(torch.rand(size, size, size, generator=gen) < 0.3, NEG_INF)
    lengths = torch.tensor([size, max(size - 1, 2), size])
    dist = SecondOrderDependencyCRF(arcs, sibs, lengths=lengths, multiroot=multiroot)
    for b, length in enumerate(lengths.tolist()):
        support = list(trees(length - 1, True, multiroot))
        values = torch.stack([second_order_score(arcs[b], sibs[b], t) for t in support])
        logz = torch.logsumexp(values, 0)
        probs = (values - logz).exp()
        arc_marg = torch.zeros(size, size, dtype=torch.float64)
        sib_marg = torch.zeros(size, size, size, dtype=torch.float64)
        for t, p in zip(support, probs, strict=True):
            for m, h in enumerate(t, 1):
                arc_marg[h, m] += p
            for triple in sibling_triples(t):
                sib_marg[triple] += p
        torch.testing.assert_close(dist.log_partition[b], logz)
        torch.testing.assert_close(dist.marginals[b], arc_marg)
        torch.testing.assert_close(dist.sibling_marginals[b], sib_marg)
        finite = probs > 0
        torch.testing.assert_close(dist.entropy[b], -(probs[finite] * probs[finite].log()).sum())
        torch.testing.assert_close(dist.max_score[b], values.max())
        best = tree_of(dist.argmax[b], length)
        assert best in support
        assert float(second_order_score(arcs[b], sibs[b], best)) == pytest.approx(
            float(values.max())
        )
        heads = dist.argmax.clone()
        pick = len(support) // 2
        heads[b, 1:length] = torch.tensor(support[pick])
        torch.testing.assert_close(dist.log_prob(heads)[b], values[pick] - logz)


def test_second_order_zero_siblings_is_first_order() -> None:
    arcs = torch.randn(2, 6, 6, dtype=torch.float64)
    lengths = torch.tensor([6, 4])
    first = DependencyCRF(arcs, lengths=lengths, multiroot=False)
    second = SecondOrderDependencyCRF(
        arcs, torch.zeros(2, 6, 6, 6, dtype=torch.float64), lengths=lengths, multiroot=False
    )
    torch.testing.assert_close(second.log_partition, first.log_partition)
    torch.testing.assert_close(second.marginals, first.marginals)
    assert torch.equal(second.argmax, first.argmax)


def test_second_order_samples_and_crossing() -> None:
    gen = torch.Generator().manual_seed(5)
    arcs = torch.randn(1, 4, 4, dtype=torch.float64, generator=gen)
    sibs = torch.randn(1, 4, 4, 4, dtype=torch.float64, generator=gen) * 2
    dist = SecondOrderDependencyCRF(arcs, sibs)
    n = 3000
    counts = Counter(tuple(h[0].tolist()) for h in dist.sample(n))
    for heads, count in counts.items():
        p = float(dist.log_prob(torch.tensor([heads])).exp())
        assert abs(count / n - p) < 4 * (p / n) ** 0.5 + 1e-3
    crossing = SecondOrderDependencyCRF(torch.zeros(1, 5, 5), torch.zeros(1, 5, 5, 5))
    assert torch.isneginf(crossing.log_prob(torch.tensor([[-1, 3, 4, 0, 0]])))


def test_second_order_gradients_and_stability() -> None:
    arcs = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    sibs = torch.randn(2, 5, 5, 5, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([5, 3])
    gradcheck(
        lambda a, s: SecondOrderDependencyCRF(a, s, lengths=lengths).log_partition, (arcs, sibs)
    )
    gradcheck(lambda a, s: SecondOrderDependencyCRF(a, s, lengths=lengths).marginals, (arcs, sibs))
    dist = SecondOrderDependencyCRF(arcs, sibs, lengths=lengths)
    grad_arcs, grad_sibs = torch.autograd.grad(dist.log_partition.sum(), (arcs, sibs))
    torch.testing.assert_close(grad_arcs, dist.marginals.detach())
    torch.testing.assert_close(grad_sibs, dist.sibling_marginals.detach())
    big = SecondOrderDependencyCRF(torch.randn(2, 7, 7) * 1e4, torch.randn(2, 7, 7, 7) * 1e4)
    assert torch.isfinite(big.log_partition).all() and torch.isfinite(big.marginals).all()
    assert torch.isfinite(big.entropy).all()
    none = torch.zeros(1, 4, 4)
    none[0, :, 2] = NEG_INF  # word 2 has no head
    empty = SecondOrderDependencyCRF(none, torch.zeros(1, 4, 4, 4))
    assert torch.isneginf(empty.log_partition).all() and (empty.marginals == 0).all()
    assert (empty.argmax == -1).all() and (empty.entropy == 0).all()


@MULTIROOT
def test_second_order_outside_by_hand_is_autograd(multiroot: bool) -> None:
    """log Z's hand-written outside pass (its backward) gives autograd's gradients through
    the inside pass in float64: padding, -inf scores, items with no tree, strided inputs."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(10):
        size = 2 + trial % 7
        arcs = torch.randn(4, size, size, dtype=torch.float64, generator=gen)
        # a view with a storage offset: the forward reads the sibling scores by strides
        sibs = torch.randn(4 * size**3 + 5, dtype=torch.float64, generator=gen)[5:]
        sibs = sibs.view(4, size, size, size)
        arcs[torch.rand(arcs.shape, generator=gen) < 0.2] = NEG_INF
        sibs[torch.rand(sibs.shape, generator=gen) < 0.2] = NEG_INF
        if trial % 3 == 0:
            arcs[1, :, -1] = NEG_INF  # item 1's last word has no head: no tree
        lengths = torch.randint(2, size + 1, (4,), generator=gen)
        lengths[0] = size
        dist = SecondOrderDependencyCRF(arcs, sibs, lengths=lengths, multiroot=multiroot)
        parts = [p.detach().requires_grad_(True) for p in dist._parts(arcs, sibs)]
        by_hand = second_order_log_partition(*parts, lengths)
        seed = torch.randn(4, dtype=torch.float64, generator=gen)
        got = torch.autograd.grad(by_hand, parts, seed)
        auto = second_order_inside(*parts, lengths, LogSemiring)
        torch.testing.assert_close(by_hand, auto, rtol=1e-12, atol=0)
        want = torch.autograd.grad(auto, parts, seed, materialize_grads=True)
        for g, h in zip(got, want, strict=True):
            torch.testing.assert_close(g, h.nan_to_num(0.0), rtol=1e-10, atol=1e-12)
        # the distribution: marginals without and with a graph (autograd's path) agree
        fast = SecondOrderDependencyCRF(arcs, sibs, lengths=lengths, multiroot=multiroot)
        leaves = [arcs.clone().requires_grad_(True), sibs.clone().requires_grad_(True)]
        slow = SecondOrderDependencyCRF(*leaves, lengths=lengths, multiroot=multiroot)
        torch.testing.assert_close(fast.marginals, slow.marginals.detach())
        torch.testing.assert_close(fast.sibling_marginals, slow.sibling_marginals.detach())


def test_second_order_log_partition_differentiated_twice() -> None:
    """The backward of the hand-written log Z is differentiable (by autograd's path):
    gradgradcheck, and forward mode (torch.func.jvp) gives <marginals, tangent>."""
    arcs = torch.randn(2, 5, 5, dtype=torch.float64, requires_grad=True)
    sibs = torch.randn(2, 5, 5, 5, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([5, 4])
    for multiroot in (True, False):

        def logz(a: Tensor, s: Tensor, multiroot: bool = multiroot) -> Tensor:
            return SecondOrderDependencyCRF(a, s, lengths, multiroot=multiroot).log_partition

        gradgradcheck(logz, (arcs, sibs))
        tangents = torch.randn_like(arcs), torch.randn_like(sibs)
        _, jvp = torch.func.jvp(logz, (arcs.detach(), sibs.detach()), tangents)
        dist = SecondOrderDependencyCRF(arcs.detach(), sibs.detach(), lengths, multiroot=multiroot)
        want = (dist.marginals * tangents[0]).sum((1, 2))
        want = want + (dist.sibling_marginals * tangents[1]).sum((1, 2, 3))
        torch.testing.assert_close(jvp, want)


@MULTIROOT
def test_second_order_map_by_hand_is_the_max_semiring_gradient(multiroot: bool) -> None:
    """The hand-written MAP pass and backtrack (argmax, SparseMAP's oracle) give the tree
    and score of the max semiring's gradient, ties (integer scores) and padding included."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(12):
        size = 2 + trial % 7
        arcs = torch.randn(4, size, size, dtype=torch.float64, generator=gen)
        sibs = torch.randn(4, size, size, size, dtype=torch.float64, generator=gen)
        if trial % 2:
            arcs, sibs = arcs.round().clamp(-1, 1), sibs.round().clamp(-1, 1)
        lengths = torch.randint(2, size + 1, (4,), generator=gen)
        lengths[0] = size
        dist = SecondOrderDependencyCRF(arcs, sibs, lengths=lengths, multiroot=multiroot)
        score, indicators = dist._map  # the autograd path of the base class
        assert torch.equal(dist.argmax, dist._invalidate(dist._to_structure(*indicators), score))
        found = dist._part_argmax(dist._parts(arcs, sibs), lengths)
        for got, want in zip(found, indicators, strict=True):
            assert torch.equal(got, want), trial
        torch.testing.assert_close(dist.max_score, score)


def test_second_order_errors() -> None:
    with pytest.raises(ValueError, match="`sibling_scores` must have shape"):
        SecondOrderDependencyCRF(torch.randn(1, 4, 4), torch.randn(1, 4, 4, 3))
    with pytest.raises(ValueError, match="`sibling_scores` must have the dtype"):
        SecondOrderDependencyCRF(torch.randn(1, 4, 4), torch.randn(1, 4, 4, 4).double())
    with pytest.raises(ValueError, match="`arc_scores` must have 3 dimensions"):
        SecondOrderDependencyCRF(torch.randn(1, 4, 4, 2), torch.randn(1, 4, 4, 4))
    with pytest.raises(ValueError, match="`sibling_scores` contains NaN"):
        SecondOrderDependencyCRF(torch.randn(1, 4, 4), torch.full((1, 4, 4, 4), float("nan")))


def test_tree_ops_benchmark_runs() -> None:
    """benchmarks/tree_ops.py (run.py --only treeops): every row timed, ours at least."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        module = importlib.import_module("tree_ops")
        rows = module.run_rows(2, (5,), repeats=1, warmup=0, k=2, labels=2)
        matched = module.run_rows(2, (5,), 1, 0, k=2, labels=2, match=("SparseMAP",))
    finally:
        sys.path.remove(folder)
    assert len(rows) == 12  # 6 beside peers, SparseMAP and its yardsticks (2 x 3)
    assert [row.op for row in matched] == ["SparseMAP projective", "SparseMAP non-projective"]
    assert all(row.ms["ours"] > 0 for row in rows)
    assert all(err < 1e-4 for row in rows for err in row.agree.values())


@CLASSES
def test_labelled_structured_nll(cls: type[TreeCRFBase]) -> None:
    """The parser loss takes labelled gold trees; an impossible one is named in the error."""
    from structattn import structured_nll

    scores = torch.randn(2, 5, 5, 3, dtype=torch.float64, requires_grad=True)
    dist = cls(scores, lengths=torch.tensor([5, 4]))
    gold = LabelledHeads(
        torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, 2, -1]]), torch.ones(2, 5).long()
    )
    loss = structured_nll(dist, gold, reduction="sum")
    torch.testing.assert_close(loss, -dist.log_prob(gold).sum())
    loss.backward()
    assert torch.isfinite(scores.grad).all()
    cycle = LabelledHeads(torch.tensor([[-1, 2, 1, 2, 3], [-1, 0, 1, 2, -1]]), gold.labels)
    with pytest.raises(ValueError, match="item 0: not a tree"):
        structured_nll(cls(scores.detach(), lengths=torch.tensor([5, 4])), cycle)


@MULTIROOT
@pytest.mark.parametrize("n_words", [1, 2, 3, 4, 5])
def test_second_order_topk_against_enumeration(multiroot: bool, n_words: int) -> None:
    gen = torch.Generator().manual_seed(n_words + 40 * multiroot)
    size = n_words + 1
    arcs = torch.randn(3, size, size, dtype=torch.float64, generator=gen).requires_grad_()
    sibs = torch.randn(3, size, size, size, dtype=torch.float64, generator=gen)
    sibs[2] = sibs[2].masked_fill(torch.rand(size, size, size, generator=gen) < 0.3, NEG_INF)
    sibs.requires_grad_()
    lengths = torch.tensor([size, max(size - 1, 2), size])
    dist = SecondOrderDependencyCRF(arcs, sibs, lengths=lengths, multiroot=multiroot)
    k = 7
    scores, heads = dist.topk(k)
    assert scores.shape == (k, 3) and heads.shape == (k, 3, size)
    assert torch.equal(heads[0], dist.argmax)
    for b, length in enumerate(lengths.tolist()):
        support = list(trees(length - 1, True, multiroot))
        values = torch.stack([second_order_score(arcs[b], sibs[b], t) for t in support]).detach()
        want = values.sort(descending=True).values[:k]
        want = want[torch.isfinite(want)]
        found = len(want)
        torch.testing.assert_close(scores[:found, b].detach(), want)
        got = [tree_of(heads[r, b], length) for r in range(found)]
        assert len(set(got)) == found and all(t in support for t in got)
        for r, t in enumerate(got):
            torch.testing.assert_close(
                scores[r, b].detach(), second_order_score(arcs[b], sibs[b], t).detach()
            )
        assert torch.isneginf(scores[found:, b]).all() and (heads[found:, b] == -1).all()
    # the scores' gradient is each tree's arc and sibling indicators
    finite = torch.isfinite(scores)
    picked = scores[finite].sum()
    grad_arcs, grad_sibs = torch.autograd.grad(picked, (arcs, sibs))
    want_arcs = torch.zeros_like(arcs)
    want_sibs = torch.zeros_like(sibs)
    for r, b in finite.nonzero().tolist():
        t = tree_of(heads[r, b], int(lengths[b]))
        for m, h in enumerate(t, 1):
            want_arcs[b, h, m] += 1
        for triple in sibling_triples(t):
            want_sibs[(b, *triple)] += 1
    torch.testing.assert_close(grad_arcs, want_arcs)
    torch.testing.assert_close(grad_sibs, want_sibs)


def test_second_order_topk_ties_and_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    arcs = torch.randn(2, 5, 5, generator=gen).round().clamp(-1, 1)
    sibs = torch.randn(2, 5, 5, 5, generator=gen).round().clamp(-1, 1)
    dist = SecondOrderDependencyCRF(arcs, sibs)
    scores, heads = dist.topk(4)
    assert torch.equal(heads[0], dist.argmax)
    torch.testing.assert_close(scores[0], dist.max_score)
    assert (scores[:-1] >= scores[1:]).all()
    with pytest.raises(ValueError, match="`k`"):
        dist.topk(0)
