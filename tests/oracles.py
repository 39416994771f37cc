"""Brute-force oracles: enumerate every structure of a tiny problem (float64).

These are deliberately naive and independent of the library's dynamic programs and of its
tree checks: validity is decided from definitions (reachability, descendant sets).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor


# ---- chains -------------------------------------------------------------------------------
def chains(n: int, c: int) -> list[tuple[int, ...]]:
    """All label sequences of length n over c labels."""
    return list(itertools.product(range(c), repeat=n))


def chain_score(unary: Tensor, pairwise: Tensor, z: tuple[int, ...]) -> Tensor:
    """unary [N, C], pairwise [N-1, C, C]; score of the label sequence z (length <= N)."""
    s = sum(unary[i, z[i]] for i in range(len(z)))
    s = s + sum(pairwise[i, z[i], z[i + 1]] for i in range(len(z) - 1))
    return torch.as_tensor(s, dtype=unary.dtype)


# ---- trees --------------------------------------------------------------------------------
def _reaches_root(heads: tuple[int, ...]) -> bool:
    """heads[m-1] is the head of word m (1-based); True iff every word reaches 0 (no cycle)."""
    n = len(heads)
    for m in range(1, n + 1):
        seen = set()
        node = m
        while node != 0:
            if node in seen:
                return False
            seen.add(node)
            node = heads[node - 1]
    return True


def _descendants(heads: tuple[int, ...], h: int) -> set[int]:
    out = {h}
    changed = True
    while changed:
        changed = False
        for m in range(1, len(heads) + 1):
            if m not in out and heads[m - 1] in out:
                out.add(m)
                changed = True
    return out


def _projective(heads: tuple[int, ...]) -> bool:
    """Every arc h -> m dominates all words strictly between h and m."""
    for m in range(1, len(heads) + 1):
        h = heads[m - 1]
        desc = _descendants(heads, h)
        lo, hi = min(h, m), max(h, m)
        if any(k not in desc for k in range(lo + 1, hi)):
            return False
    return True


def trees(n_words: int, projective: bool, multiroot: bool) -> Iterator[tuple[int, ...]]:
    """All trees over words 1..n_words with ROOT 0, as head tuples (word m -> heads[m-1])."""
    choices = [[h for h in range(n_words + 1) if h != m] for m in range(1, n_words + 1)]
    for heads in itertools.product(*choices):
        if not _reaches_root(heads):
            continue
        if not multiroot and sum(h == 0 for h in heads) != 1:
            continue
        if projective and not _projective(heads):
            continue
        yield heads


def tree_score(arc_scores: Tensor, heads: tuple[int, ...]) -> Tensor:
    """arc_scores [N, N] (ROOT = 0); sum of arc scores of the tree."""
    return sum(arc_scores[h, m] for m, h in enumerate(heads, start=1))  # type: ignore[return-value]


# ---- generic summaries over an enumerated support ------------------------------------------
def summarize(scores: Tensor) -> dict[str, Tensor]:
    """log Z, probabilities, max score, entropy of a Gibbs distribution given all scores [S]."""
    logz = torch.logsumexp(scores, 0)
    probs = (scores - logz).exp()
    finite = torch.isfinite(scores)
    entropy = -(probs[finite] * (scores[finite] - logz)).sum()
    return {"log_partition": logz, "probs": probs, "max_score": scores.max(), "entropy": entropy}


# ---- analytic counts ----------------------------------------------------------------------
def count_projective(n_words: int, multiroot: bool) -> int:
    """Projective trees with ROOT at the left: A001764 (multi-root) / A006013 (single root)."""
    from math import comb

    if multiroot:
        return comb(3 * n_words, n_words) // (2 * n_words + 1)
    return comb(3 * n_words - 2, n_words - 1) // n_words


def count_nonprojective(n_words: int, multiroot: bool) -> int:
    """Cayley: (n+1)^(n-1) rooted at ROOT with any number of children; n^(n-1) single root."""
    return (n_words + 1) ** (n_words - 1) if multiroot else n_words ** (n_words - 1)


# ---- span structures ----------------------------------------------------------------------
Spans = frozenset[tuple[int, int]]


def bracketings(start: int, end: int) -> list[Spans]:
    """All binary bracketings of the words start..end (inclusive) as sets of spans (i, j):
    every word, the whole span and the constituents in between (2n - 1 spans each)."""
    if start == end:
        return [frozenset({(start, end)})]
    out = []
    for k in range(start, end):
        for left in bracketings(start, k):
            for right in bracketings(k + 1, end):
                out.append(left | right | {(start, end)})
    return out


def labelled_bracketings(n: int, labels: int) -> Iterator[tuple[tuple[int, int, int], ...]]:
    """All labelled binary bracketings of n words: tuples of (i, j, label), one per span."""
    for tree in bracketings(0, n - 1):
        spans = sorted(tree)
        for choice in itertools.product(range(labels), repeat=len(spans)):
            yield tuple((i, j, lab) for (i, j), lab in zip(spans, choice, strict=True))


def segmentations(n: int, width: int, labels: int) -> Iterator[tuple[tuple[int, int, int], ...]]:
    """All segmentations of 0..n-1 into labelled segments of length <= width, as tuples of
    (start, length - 1, label)."""
    if n == 0:
        yield ()
        return
    for length in range(1, min(width, n) + 1):  # the last segment
        for head in segmentations(n - length, width, labels):
            for label in range(labels):
                yield (*head, (n - length, length - 1, label))


def segmentation_score(
    segments: Tensor, transitions: Tensor, z: tuple[tuple[int, int, int], ...]
) -> Tensor:
    """segments [N, K, C], transitions [C, C]: score of the segmentation z."""
    s = sum(segments[i, k, c] for i, k, c in z)
    s = s + sum(transitions[a[2], b[2]] for a, b in itertools.pairwise(z))
    return torch.as_tensor(s, dtype=segments.dtype)


def split_trees(start: int, end: int) -> list[tuple[tuple[int, int, int], ...]]:
    """All split trees (PRPN notes, eq. 8) of the positions start..end (inclusive): tuples
    of nodes (a, b, pivot), one per position; Catalan(n) of them."""
    if start > end:
        return [()]
    out = []
    for pivot in range(start, end + 1):
        for left in split_trees(start, pivot - 1):
            for right in split_trees(pivot + 1, end):
                out.append(((start, end, pivot), *left, *right))
    return out


def split_tree_log_prob(scores: Tensor, nodes: tuple[tuple[int, int, int], ...]) -> Tensor:
    """log p of a split tree: each node's pivot by the softmax of the scores of its span."""
    terms = [scores[p] - scores[a : b + 1].logsumexp(0) for a, b, p in nodes]
    return torch.stack(terms).sum()


def plackett_luce_tree_probs(scores: Tensor) -> dict[frozenset[tuple[int, int]], Tensor]:
    """Eq. 9: p(tree) when a ranking of the positions is drawn from the Plackett-Luce model
    (sampling without replacement, proportionally to exp(scores)) and every span is split at
    its top-ranked position; trees as sets of node spans (a, b)."""
    n = scores.shape[0]
    out: dict[frozenset[tuple[int, int]], Tensor] = {}
    for ranking in itertools.permutations(range(n)):
        rest = list(ranking)
        log_p = scores.new_zeros(())
        for pos in ranking:  # draw the ranking, best first
            log_p = log_p + scores[pos] - scores[rest].logsumexp(0)
            rest.remove(pos)
        nodes = _split_at_top({pos: r for r, pos in enumerate(ranking)}, 0, n - 1)
        key = frozenset(nodes)
        out[key] = out.get(key, scores.new_zeros(())) + log_p.exp()
    return out


def _split_at_top(rank: dict[int, int], a: int, b: int) -> set[tuple[int, int]]:
    """Node spans of the recursion that splits every span at its top-ranked position."""
    if a > b:
        return set()
    top = min(range(a, b + 1), key=rank.__getitem__)
    return {(a, b)} | _split_at_top(rank, a, top - 1) | _split_at_top(rank, top + 1, b)


def catalan(n: int) -> int:
    from math import comb

    return comb(2 * n, n) // (n + 1)


# ---- span supports: every structure of one item as (part indicators, score) ---------------
Support = list[tuple[tuple[Tensor, ...], Tensor]]


def tree_support(scores: Tensor, length: int) -> Support:
    """Every (labelled) bracketing of ``length`` words of a TreeCRF item: scores [N, N] or
    [N, N, L]; indicators of the scores' shape."""
    labelled = scores.dim() == 3
    out = []
    for tree in labelled_bracketings(length, scores.shape[2] if labelled else 1):
        ind = torch.zeros_like(scores)
        index = [(i, j, lab) if labelled else (i, j) for i, j, lab in tree]
        for idx in index:
            ind[idx] = 1
        out.append(((ind,), torch.stack([scores[idx] for idx in index]).sum()))
    return out


def segmentation_support(segments: Tensor, transitions: Tensor, length: int) -> Support:
    """Every segmentation of a SemiMarkovCRF item: segments [N, K, C], transitions [C, C];
    indicators (segments [N, K, C], transition counts [C, C])."""
    _, width, labels = segments.shape
    out = []
    for z in segmentations(length, width, labels):
        ind = torch.zeros_like(segments)
        count = torch.zeros_like(transitions)
        for i, k, c in z:
            ind[i, k, c] = 1
        for a, b in itertools.pairwise(z):
            count[a[2], b[2]] += 1
        out.append(((ind, count), segmentation_score(segments, transitions, z)))
    return out


def transition_counts(segments: Tensor, labels: int) -> Tensor:
    """[C, C]: the consecutive segment label pairs of a 0/1 segmentation [N, K, C]."""
    chosen = sorted((int(i), int(c)) for i, _, c in segments.nonzero())
    count = segments.new_zeros(labels, labels)
    for (_, a), (_, b) in itertools.pairwise(chosen):
        count[a, b] += 1
    return count


def split_tree_support(scores: Tensor, length: int) -> Support:
    """Every split tree of a SplitTreeDistribution item: scores [N]; indicators [N, N] of
    the node spans; the score is the tree's log probability."""
    n = scores.shape[0]
    out = []
    for nodes in split_trees(0, length - 1):
        ind = scores.new_zeros(n, n)
        for a, b, _ in nodes:
            ind[a, b] = 1
        out.append(((ind,), split_tree_log_prob(scores[:length], nodes)))
    return out
