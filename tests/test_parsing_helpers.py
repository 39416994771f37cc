"""What a parser author needs from the inference core (issue 20.5): heads out of range are
errors, ``is_projective`` and ``projectivize`` (lifting) against brute force over every tree
of a few words, and ``structured_nll`` = -log_prob with gradient = marginals - gold."""

from __future__ import annotations

import itertools

import oracles
import pytest
import torch
from torch import Tensor

import structattn
from structattn import (
    DependencyCRF,
    LinearChainCRF,
    NonProjectiveDependencyCRF,
    is_projective,
    projectivize,
    structured_nll,
)


def _heads(trees: list[tuple[int, ...]], size: int | None = None, pad: int = -1) -> Tensor:
    """Head tuples (word m -> t[m-1]) as LongTensor [T, size]: -1 at ROOT, ``pad`` after."""
    n = len(trees[0]) + 1
    size = n if size is None else size
    out = torch.full((len(trees), size), pad, dtype=torch.long)
    out[:, 0] = -1
    out[:, 1:n] = torch.tensor(trees, dtype=torch.long)
    return out


def _crossing_free(heads: tuple[int, ...]) -> bool:
    """The definition: no two arcs (as intervals of positions, ROOT = 0) cross."""
    arcs = [(min(h, m), max(h, m)) for m, h in enumerate(heads, start=1)]
    return not any(a < c < b < d for (a, b), (c, d) in itertools.permutations(arcs, 2))


def _all_trees(n_words: int, multiroot: bool = True) -> list[tuple[int, ...]]:
    return list(oracles.trees(n_words, projective=False, multiroot=multiroot))


# ---- heads out of range are errors ------------------------------------------------------------
@pytest.mark.parametrize("crf", [DependencyCRF, NonProjectiveDependencyCRF])
def test_tree_log_prob_rejects_heads_out_of_range(crf: type[DependencyCRF]) -> None:
    """A head outside the item (7 with N = 5, negative at a real word, or pointing into the
    padding) is a ValueError naming ``heads``, not a silent -inf training loss."""
    arcs = torch.randn(2, 5, 5, dtype=torch.float64)
    dist = crf(arcs, lengths=torch.tensor([5, 3]))
    good = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, 99, -7]])  # padding entries ignored
    assert torch.isfinite(dist.log_prob(good)).all()
    for item, word, head in [(0, 1, 7), (0, 2, -1), (1, 2, -3), (1, 2, 3), (1, 1, 4)]:
        bad = good.clone()
        bad[item, word] = head
        with pytest.raises(ValueError, match="heads"):
            dist.log_prob(bad)


def test_chain_log_prob_rejects_labels_out_of_range() -> None:
    dist = LinearChainCRF(torch.randn(2, 4, 3), lengths=torch.tensor([4, 2]))
    labels = torch.tensor([[0, 1, 2, 0], [2, 2, 9, -1]])
    assert torch.isfinite(dist.log_prob(labels)).all()
    for value in (3, -1):
        bad = labels.clone()
        bad[1, 1] = value
        with pytest.raises(ValueError, match="labels"):
            dist.log_prob(bad)


# ---- is_projective --------------------------------------------------------------------------
@pytest.mark.parametrize("n_words", [1, 2, 3, 4, 5])
def test_is_projective_against_every_tree(n_words: int) -> None:
    """Equal to the crossing-arcs definition (and to the dominance one) on every tree of
    n words, with padding ignored; the counts are the known ones."""
    trees = _all_trees(n_words)
    want = [_crossing_free(t) for t in trees]
    assert want == [oracles._projective(t) for t in trees]  # the two definitions agree
    got = is_projective(_heads(trees))
    assert got.dtype == torch.bool and got.tolist() == want
    assert sum(want) == oracles.count_projective(n_words, multiroot=True)
    # the same trees padded to 8 positions, garbage in the padding
    padded = _heads(trees, size=8, pad=3)
    lengths = torch.full((len(trees),), n_words + 1)
    assert is_projective(padded, lengths).tolist() == want


def test_is_projective_checks_its_input() -> None:
    with pytest.raises(ValueError, match="heads"):
        is_projective(torch.tensor([[-1, 0, 5]]))
    with pytest.raises(ValueError, match="heads"):
        is_projective(torch.tensor([[-1.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match="lengths"):
        is_projective(torch.tensor([[-1, 0, 1]]), torch.tensor([4]))


# ---- projectivize (lifting) --------------------------------------------------------------------
def _ancestors(heads: tuple[int, ...], m: int) -> set[int]:
    out, node = set(), m
    while node != 0:
        node = heads[node - 1]
        out.add(node)
    return out


@pytest.mark.parametrize("multiroot", [True, False], ids=["multiroot", "oneroot"])
def test_projectivize_every_tree_of_five_words(multiroot: bool) -> None:
    """The output of every tree of 5 words is a projective tree (one root child stays one);
    projective trees are unchanged; each moved word's new head is an ancestor of it (lifting)."""
    trees = _all_trees(5, multiroot)
    heads = _heads(trees, size=7, pad=0)
    lengths = torch.full((len(trees),), 6)
    lifted = projectivize(heads, lengths)
    assert lifted.dtype == torch.long and lifted.shape == heads.shape
    assert torch.equal(lifted[:, [0, 6]], heads[:, [0, 6]])  # ROOT and padding as given
    assert is_projective(lifted, lengths).all()
    for tree, new in zip(trees, lifted[:, 1:6].tolist(), strict=True):
        new_tree = tuple(new)
        assert oracles._reaches_root(new_tree) and _crossing_free(new_tree)
        if not multiroot:
            assert sum(h == 0 for h in new_tree) == 1
        if _crossing_free(tree):
            assert new_tree == tree
        for old_head, new_head in zip(tree, new_tree, strict=True):
            if old_head != new_head:
                assert new_head in _ancestors(tree, old_head)


# (heads of words 1..n, the expected lifted heads)
HAND_EXAMPLES = [
    # "A hearing is scheduled on the issue today" with the PP attached to "hearing" (the
    # example of Nivre & Nilsson 2005): hearing -> on spans "is", which hearing does not
    # dominate; "on" is lifted to "is"
    ((2, 3, 0, 3, 2, 7, 5, 3), (2, 3, 0, 3, 3, 7, 5, 3)),
    # 2 -> 4 spans 3 (a child of 1): lifted to 1
    ((0, 1, 1, 2), (0, 1, 1, 1)),
    # 1 -> 4 spans 3 (a child of ROOT): lifted to ROOT
    ((0, 3, 0, 1), (0, 3, 0, 0)),
    # 3 -> 5 spans 4 (a child of ROOT): lifted three times, to ROOT (one arc moved)
    ((0, 1, 2, 0, 3), (0, 1, 2, 0, 0)),
    # two crossings, each needing its own arc moved: two arcs move
    ((0, 3, 0, 1, 0, 7, 0, 5), (0, 3, 0, 0, 0, 7, 0, 0)),
    # 2 -> 5 (length 3) and 4 -> 8 (length 4) are both non-projective; lifting the
    # shorter one first leaves 4 -> 8 spanning 5, which is lifted too
    ((2, 3, 0, 3, 2, 7, 5, 4), (2, 3, 0, 3, 3, 7, 5, 3)),
]


@pytest.mark.parametrize(("tree", "want"), HAND_EXAMPLES)
def test_projectivize_hand_examples(tree: tuple[int, ...], want: tuple[int, ...]) -> None:
    """The expected lift, which moves as few arcs as any projective tree does (checked by
    enumeration where the sentence is short)."""
    assert not _crossing_free(tree) and _crossing_free(want)
    got = projectivize(_heads([tree]))[0, 1:].tolist()
    assert tuple(got) == want
    moved = sum(a != b for a, b in zip(tree, got, strict=True))
    if len(tree) <= 6:
        fewest = min(
            sum(a != b for a, b in zip(tree, t, strict=True))
            for t in _all_trees(len(tree))
            if _crossing_free(t)
        )
        assert moved == fewest
    # the batched call gives each item its own result (with padding)
    batch = torch.stack(
        [_heads([tree], size=10, pad=-1)[0], _heads([tuple(range(len(tree)))], size=10)[0]]
    )
    lengths = torch.tensor([len(tree) + 1, len(tree) + 1])
    assert projectivize(batch, lengths)[0, 1 : len(tree) + 1].tolist() == list(want)


def test_projectivize_rejects_non_trees() -> None:
    with pytest.raises(ValueError, match="heads"):
        projectivize(torch.tensor([[-1, 2, 1, 0]]))  # a cycle
    with pytest.raises(ValueError, match="heads"):
        projectivize(torch.tensor([[-1, 0, 9]]))


def test_projectivized_gold_trees_train_a_dependency_crf() -> None:
    """The parser author's path: a non-projective gold tree has probability 0 under
    DependencyCRF; after projectivize its log-probability is finite."""
    gold = _heads([(0, 3, 0, 1)])
    dist = DependencyCRF(torch.randn(1, 5, 5))
    assert torch.isneginf(dist.log_prob(gold)).all()
    assert torch.isfinite(dist.log_prob(projectivize(gold))).all()


# ---- structured_nll -------------------------------------------------------------------------
def _tree_batch(crf: type[DependencyCRF]) -> tuple[Tensor, Tensor, Tensor]:
    """Scores [3, 6, 6] with padding and projective gold trees (valid for both CRFs)."""
    scores = torch.randn(3, 6, 6, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([6, 4, 2])
    gold = torch.tensor([[-1, 2, 0, 2, 3, 3], [-1, 0, 1, 1, -1, -1], [-1, 0, -1, -1, -1, -1]])
    return scores, lengths, gold


@pytest.mark.parametrize("crf", [DependencyCRF, NonProjectiveDependencyCRF])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "token"])
def test_structured_nll_of_trees(crf: type[DependencyCRF], reduction: str) -> None:
    """-log_prob, reduced per item or per token (word); its gradient with reduction="sum"
    is marginals - gold arc indicators."""
    scores, lengths, gold = _tree_batch(crf)
    dist = crf(scores, lengths)
    nll = -dist.log_prob(gold)
    want = {
        "none": nll,
        "sum": nll.sum(),
        "mean": nll.mean(),
        "token": nll.sum() / (lengths - 1).sum(),
    }[reduction]
    loss = structured_nll(dist, gold, reduction=reduction)
    torch.testing.assert_close(loss, want)
    if reduction == "sum":
        (grad,) = torch.autograd.grad(loss, scores)
        indicator = torch.zeros(3, 6, 6, dtype=torch.float64)
        for b, n in enumerate(lengths.tolist()):
            for m in range(1, n):
                indicator[b, gold[b, m], m] = 1.0
        torch.testing.assert_close(grad, dist.marginals.detach() - indicator)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "token"])
def test_structured_nll_of_chains(reduction: str) -> None:
    unary = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    pairwise = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([4, 2])
    labels = torch.tensor([[0, 2, 1, 1], [1, 0, -1, -1]])
    dist = LinearChainCRF(unary, pairwise, lengths)
    nll = -dist.log_prob(labels)
    want = {"none": nll, "sum": nll.sum(), "mean": nll.mean(), "token": nll.sum() / 6}
    loss = structured_nll(dist, labels, reduction=reduction)
    torch.testing.assert_close(loss, want[reduction])
    if reduction == "sum":
        grad_unary, grad_pairwise = torch.autograd.grad(loss, (unary, pairwise))
        gold_unary = torch.zeros(2, 4, 3, dtype=torch.float64)
        gold_pairwise = torch.zeros(3, 3, dtype=torch.float64)
        for b, n in enumerate(lengths.tolist()):
            for i in range(n):
                gold_unary[b, i, labels[b, i]] = 1.0
            for i in range(n - 1):
                gold_pairwise[labels[b, i], labels[b, i + 1]] += 1.0
        torch.testing.assert_close(grad_unary, dist.marginals.detach() - gold_unary)
        expected_pairwise = dist.edge_marginals.detach().sum((0, 1)) - gold_pairwise
        torch.testing.assert_close(grad_pairwise, expected_pairwise)


def test_structured_nll_impossible_gold_is_an_error_or_ignored() -> None:
    """A non-projective gold tree under DependencyCRF: a ValueError that says why and what
    to do; with impossible="ignore" the item is left out (loss and gradient) and counted."""
    scores = torch.randn(3, 5, 5, dtype=torch.float64, requires_grad=True)
    gold = torch.tensor([[-1, 0, 1, 2, 3], [-1, 3, 0, 0, 1], [-1, 0, 0, 2, 2]])
    dist = DependencyCRF(scores)
    with pytest.raises(ValueError, match=r"(?s)item.*1.*projective.*projectivize.*ignore"):
        structured_nll(dist, gold)
    loss, ignored = structured_nll(
        dist, gold, reduction="mean", impossible="ignore", return_ignored=True
    )
    assert int(ignored) == 1
    log_prob = dist.log_prob(gold)
    torch.testing.assert_close(loss, -(log_prob[0] + log_prob[2]) / 2)
    (grad,) = torch.autograd.grad(loss, scores)
    assert torch.isfinite(grad).all() and grad[1].eq(0).all()
    per_item = structured_nll(dist, gold, reduction="none", impossible="ignore")
    assert per_item[1] == 0 and torch.isfinite(per_item).all()
    # the reasons: a cycle, two children of ROOT under multiroot=False
    with pytest.raises(ValueError, match="cycle"):
        structured_nll(NonProjectiveDependencyCRF(scores), torch.tensor([[-1, 2, 1, 0, 0]] * 3))
    with pytest.raises(ValueError, match="multiroot=False"):
        structured_nll(DependencyCRF(scores, multiroot=False), gold[[2]].expand(3, 5))
    # every item ignored: a zero loss that still back-propagates
    none_left = structured_nll(dist, gold[[1, 1, 1]], impossible="ignore")
    assert none_left == 0 and none_left.requires_grad


def test_structured_nll_checks_its_arguments() -> None:
    dist = LinearChainCRF(torch.randn(2, 3, 4))
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        structured_nll(dist, labels, reduction="avg")
    with pytest.raises(ValueError, match="impossible"):
        structured_nll(dist, labels, impossible="skip")
    with pytest.raises(ValueError, match="labels"):
        structured_nll(dist, torch.full((2, 3), 4))


def test_helpers_are_exported() -> None:
    for name in ("is_projective", "projectivize", "structured_nll"):
        assert name in structattn.__all__ and name in structattn.distributions.__all__
