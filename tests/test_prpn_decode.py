"""PRPN trees from the split-tree distribution (#40): the most likely tree, bracket marginals,
the expected UF1 and samples, against enumeration of every split tree."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch

pytest.importorskip("nltk")

from structattn.data.treebank import TreebankSentence  # noqa: E402
from structattn.recipes._prpn_trees import (  # noqa: E402
    decode_trees,
    expected_scores,
    split_bracket_marginals,
    split_distribution,
    tree_from_nodes,
    uf1_scores,
)
from structattn.trees import split_tree, tree_spans  # noqa: E402


def _enumerate(a: int, b: int, d: list[float]) -> list[tuple[float, Any, list[Any]]]:
    """Every split tree of words a..b (inclusive): (probability by eq. 8, the tree as
    :func:`split_tree` builds it, its nodes [a, b])."""
    if a > b:
        return [(1.0, None, [])]
    total = sum(d[a : b + 1])
    out = []
    for i in range(a, b + 1):
        sides = itertools.product(_enumerate(a, i - 1, d), _enumerate(i + 1, b, d))
        for (pl, left, nl), (pr, right, nr) in sides:
            node: Any = i if right is None else (i, right)
            tree = node if left is None else (left, node)
            out.append((d[i] / total * pl * pr, tree, [(a, b), *nl, *nr]))
    return out


def _trees(a: int, b: int, d: list[float]) -> list[tuple[float, Any]]:
    return [(p, t) for p, t, _ in _enumerate(a, b, d)]


def _distances(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [math.exp(rng.gauss(0, 1.5)) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_map_is_the_brute_force_most_likely_tree(n: int) -> None:
    for seed in range(4):
        d = _distances(n, seed)
        trees = _trees(0, n - 1, d)
        assert len(trees) == math.comb(2 * n, n) // (n + 1)  # Catalan(n)
        assert sum(p for p, _ in trees) == pytest.approx(1.0)
        best = max(trees, key=lambda pt: pt[0])[1]
        (ours,) = decode_trees([d], "map")
        assert tree_spans(ours, include_root=True) == tree_spans(best, include_root=True)
        assert decode_trees([d], "greedy") == [split_tree(d)]


def test_greedy_split_is_not_the_most_likely_tree() -> None:
    d = [math.exp(x) for x in (0.0, 1.0, 1.5, 2.0)]  # the distribution's docstring example
    (greedy,), (best,) = decode_trees([d], "greedy"), decode_trees([d], "map")
    assert greedy == (((0, 1), 2), 3) and best == ((0, 1), (2, 3))


def test_tree_from_nodes_inverts_the_nodes_of_every_tree() -> None:
    d = _distances(5, 0)
    dist = split_distribution([d])
    for p, tree, nodes in _enumerate(0, 4, d):
        chart = torch.zeros(1, 5, 5, dtype=torch.long)
        for a, b in nodes:
            chart[0, a, b] = 1
        assert dist.log_prob(chart).exp().item() == pytest.approx(p)
        assert tree_from_nodes(chart[0], 5) == tree


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_bracket_marginals_and_expected_uf1_by_enumeration(n: int) -> None:
    d = _distances(n, n)
    trees = _trees(0, n - 1, d)
    dist = split_distribution([d])
    brackets = split_bracket_marginals(dist)[0]
    for a in range(n):
        for b in range(a + 1, n):
            want = sum(p for p, t in trees if (a, b + 1) in tree_spans(t, include_root=True))
            assert brackets[a, b].item() == pytest.approx(want, abs=1e-12)
    gold = frozenset({(0, n), (1, n)} | ({(1, 3)} if n >= 3 else set()))
    sentence = TreebankSentence("x.mrg", 0, 1, tuple("w" * n), tuple("NN" * n), gold, "")
    ours = expected_scores([d], [sentence])
    for key in ("uf1_sentence", "uf1_corpus", "uf1_sentence_root", "uf1_corpus_root"):
        want = sum(
            p * uf1_scores([tree_spans(t, include_root=True)], [sentence])[key] for p, t in trees
        )
        assert ours[key] == pytest.approx(want, abs=1e-9), key


def test_expected_corpus_uf1_of_two_sentences_by_enumeration() -> None:
    ds = [_distances(4, 1), _distances(3, 2)]
    golds = [frozenset({(0, 4), (0, 2), (2, 4)}), frozenset({(0, 3), (0, 2)})]
    sentences = [
        TreebankSentence("x.mrg", i, 1, tuple("w" * len(d)), tuple("NN" * len(d)), g, "")
        for i, (d, g) in enumerate(zip(ds, golds, strict=True))
    ]
    ours = expected_scores(ds, sentences)
    want = dict.fromkeys(ours, 0.0)
    for (p1, t1), (p2, t2) in itertools.product(_trees(0, 3, ds[0]), _trees(0, 2, ds[1])):
        spans = [tree_spans(t, include_root=True) for t in (t1, t2)]
        for key, value in uf1_scores(spans, sentences).items():
            if key in want:
                want[key] += p1 * p2 * value
    for key in ours:
        assert ours[key] == pytest.approx(want[key], abs=1e-9), key


def test_samples_are_split_trees_in_any_batching() -> None:
    ds = [_distances(n, n) for n in (1, 4, 7, 3)]
    torch.manual_seed(0)
    trees = decode_trees(ds, "sample", batch_size=2)
    for d, tree in zip(ds, trees, strict=True):
        assert len(tree_spans(tree, include_root=True)) == len(d) - 1
    with pytest.raises(ValueError, match="decode"):
        decode_trees(ds, "viterbi")  # type: ignore[arg-type]
